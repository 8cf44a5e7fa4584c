"""mok.bench preflight on the CPU: the rounds of pairs cover every pair once with every rank in
at most one pair per round, slow pairs are named, and the command is allowed on shared-GPU
ranks. (Its GPU run: tests/test_mok_shared_gpu.py.)"""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mok.bench import __main__ as bench_main
from mok.bench.preflight import SLOW_BANDWIDTH, PairResult, slow_pairs, tournament

PROPERTY = settings(max_examples=60, deadline=None, derandomize=True)


@PROPERTY
@given(st.integers(1, 80))
def test_every_pair_meets_once_and_no_rank_twice_in_a_round(n):
    rounds = tournament(n)
    met = [pair for r in rounds for pair in r]
    assert sorted(met) == list(itertools.combinations(range(n), 2))
    for r in rounds:
        ranks = [x for pair in r for x in pair]
        assert len(ranks) == len(set(ranks))
        assert all(a < b for a, b in r)
    # linear in R: R - 1 rounds for an even count, R for an odd one (a bye each)
    assert len(rounds) == (0 if n == 1 else n - 1 if n % 2 == 0 else n)


def test_no_ranks_is_refused():
    with pytest.raises(ValueError, match="at least one rank"):
        tournament(0)


def _row(a, b, bw, rt, ok=True):
    return PairResult(
        rank_a=a, rank_b=b, host_a="h", host_b="h", reachable=True, copy_ok=ok,
        gbps_a_from_b=bw, gbps_b_from_a=bw + 5, round_trip_us=rt,
    )  # fmt: skip


def test_slow_pairs_are_named_with_the_medians():
    rows = [_row(0, 1, 400.0, 2.0), _row(0, 2, 410.0, 2.1), _row(1, 2, 390.0, 2.0)]
    rows.append(_row(2, 3, 400.0 * SLOW_BANDWIDTH * 0.9, 2.0))  # slow copy
    rows.append(_row(1, 3, 405.0, 9.0))  # slow flags
    rows.append(_row(0, 3, 1.0, None, ok=False))  # failed: not a slow pair, a failed one
    slow = {(r["rank_a"], r["rank_b"]): why for r, why in slow_pairs(rows)}
    assert set(slow) == {(2, 3), (1, 3)}
    assert "GB/s against a median of 400" in slow[(2, 3)]
    assert "round trip 9.00 us against a median of 2.00" in slow[(1, 3)]


def test_preflight_is_a_command_that_runs_on_shared_gpu_ranks():
    assert "preflight" in bench_main.COMMANDS
    assert "preflight" in bench_main.SHARED_GPU_COMMANDS
