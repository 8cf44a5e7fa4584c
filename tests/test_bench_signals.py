"""mok.bench signals on the CPU: flags counted from two snapshots of a signal pad (added kinds by
their increase, stored kinds once per call), the stored kinds the same set the kernels store,
and the command allowed on shared-GPU ranks. (Its GPU run: tests/test_mok_shared_gpu.py.)"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from mok import _ext
from mok.bench import __main__ as bench_main
from mok.bench.signals import PATHS, build_parser, count_flags

CSRC = Path(__file__).resolve().parents[1] / "csrc"
# the Signal enum of csrc/params.h: name -> value (an index of _ext.SIGNALS)
SIG = {k: int(v) for k, v in re.findall(r"(kSig\w+) = (\d+)", (CSRC / "params.h").read_text())}


def _pad() -> torch.Tensor:
    return torch.zeros(_ext.NUM_SIGNALS, _ext.MAX_RANKS, dtype=torch.int64)


def test_added_kinds_count_their_increase_and_stored_ones_once_per_call():
    ranks, calls, me = 4, 3, 1
    a, b = _pad(), _pad()
    added = _ext.SIGNALS.index("y_ready")
    stored = _ext.SIGNALS.index("layer_slots_filled")
    a[stored, :ranks] = 7
    b[added, :ranks] = 5 * calls  # raised five times by every rank, per call
    b[stored, :ranks] = 7 + calls  # the epoch moved on
    c = count_flags(a, b, me, ranks, calls)
    assert c.own == 5 + 1
    assert c.remote == (ranks - 1) * (5 + 1)
    assert c.handshakes == 2 and c.kinds == ("y_ready", "layer_slots_filled")


def test_a_kind_not_every_rank_raised_is_no_handshake_and_entries_past_the_ranks_are_ignored():
    a, b = _pad(), _pad()
    b[_ext.SIGNALS.index("x_ready"), 0] = 2  # rank 0 only
    b[_ext.SIGNALS.index("route_ready"), 5] = 9  # not a rank of this group
    c = count_flags(a, b, 0, 2, 2)
    assert (c.remote, c.own, c.handshakes) == (0.0, 1.0, 0)


def test_a_signal_going_backwards_is_an_error():
    a, b = _pad(), _pad()
    a[0, 0] = 3
    with pytest.raises(RuntimeError, match="went backwards"):
        count_flags(a, b, 0, 1, 1)


def _raised(pattern: str) -> set[int]:
    kinds = set()
    for f in CSRC.rglob("*.cuh"):
        if f.name == "waits.cuh":
            continue
        kinds |= {SIG[k] for k in re.findall(pattern, f.read_text())}
    return kinds


def test_stored_signals_are_the_kinds_the_kernels_store():
    name = r"(kSig\w+)"
    stored = _raised(rf"grid_signal_all\(c, {name}")
    stored |= _raised(rf"block_store_all\(c, {name}")
    stored |= _raised(rf"st_release_sys\(c\.peer_signal\(r, {name}\)")
    stored |= _raised(rf"peers_store\(c, {name}")
    added = _raised(rf"block_signal_all\(c, {name}")
    assert stored == set(_ext.STORED_SIGNALS)
    assert not stored & added
    # every kind is raised one way or the other
    assert stored | added == set(range(len(_ext.SIGNALS)))


def test_parser_defaults_and_every_path_named():
    args = build_parser().parse_args([])
    assert args.paths.split(",") == list(PATHS)
    assert args.tokens > 0 and args.calls > 0


def test_signals_is_a_command_allowed_on_shared_gpu_ranks():
    assert "signals" in bench_main.COMMANDS
    assert "signals" in bench_main.SHARED_GPU_COMMANDS


def test_the_measured_counts_are_the_construction():
    """The committed EP2..EP64 run (2 communication SMs, git ef0fa73: the fused layer's x
    consumed still once per communication block): the max over ranks is k x (R - 1) with k =
    flags_per_peer, every path, every EP size."""
    import csv

    from mok.bench.signals import flags_per_peer
    from sim.measured import measured_path

    path = measured_path("h100x1-shared-signals-2026-12-07.csv")
    with open(path) as f:
        rows = list(csv.DictReader(f))
    assert {int(r["ep"]) for r in rows} == {2, 8, 16, 32, 64}
    for r in rows:
        want = flags_per_peer(r["path"], 2, x_consumed_per_block=True)
        assert float(r["remote_flags"]) == want * (int(r["ep"]) - 1), r
        assert float(r["own_flags"]) == want, r


def test_the_measured_counts_per_call_are_the_construction():
    """The EP2..EP64 run at git 1fcfabc (the fused layer's x consumed once per call): every
    path's max over ranks is flags_per_peer x (R - 1), as its ``expected`` column says."""
    import csv

    from mok.bench.signals import flags_per_peer
    from sim.measured import measured_path

    with open(measured_path("h100x1-shared-signals-percall-2026-12-07.csv")) as f:
        rows = list(csv.DictReader(f))
    assert {int(r["ep"]) for r in rows} == {2, 8, 16, 32, 64}
    assert {r["path"] for r in rows} == {"pull/push", "dedup/push", "fused", "train in-launch"}
    for r in rows:
        want = flags_per_peer(r["path"], 2) * (int(r["ep"]) - 1)
        assert float(r["remote_flags"]) == want == int(r["expected"]), r
