"""Schedule table properties (bitwise: it is index data) and a brute-force transcription."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mok.spec.workload import make_routing
from reference.schedule import build_all_schedules, build_schedule, required_rows
from tests.schedule_bruteforce import brute_force_pull_rows


@st.composite
def routings(draw):
    num_ranks = draw(st.sampled_from([1, 2, 3, 4]))
    num_local = draw(st.integers(1, 4))
    num_experts = num_ranks * num_local
    num_topk = draw(st.integers(1, min(num_experts, 5)))
    num_tokens = draw(st.integers(0, 40))
    skew = draw(st.sampled_from(["uniform", "zipf:1.5", "zipf:0.5@0.7"]))
    seed = draw(st.integers(0, 2**16))
    row_tile = draw(st.sampled_from([1, 4, 8]))
    t = make_routing(num_tokens, num_experts, num_topk, num_ranks, skew, seed)
    idx = torch.from_numpy(t.per_rank().copy())
    return idx, num_experts, row_tile


@settings(max_examples=60, deadline=None)
@given(routings(), st.sampled_from(["interleaved", "source"]))
def test_schedule_properties(case, row_order):
    idx, num_experts, row_tile = case
    num_ranks, num_tokens, num_topk = idx.shape
    num_local = num_experts // num_ranks
    scheds = build_all_schedules(idx, num_experts, row_tile, row_order=row_order)
    seen = torch.zeros(num_ranks, num_tokens * num_topk, dtype=torch.int64)
    for s in scheds:
        d = s.rank
        # Offsets: tile aligned, regions just large enough.
        assert int(s.offsets[0]) == 0
        assert bool((s.offsets % row_tile == 0).all())
        sizes = s.offsets[1:] - s.offsets[:-1]
        assert bool((sizes >= s.tokens_per_expert).all())
        assert bool((sizes - s.tokens_per_expert < row_tile).all())
        assert torch.equal(s.tokens_per_expert, s.counts.sum(dim=1))
        real = s.src_rank >= 0
        # Padding rows are -1 in both fields.
        assert torch.equal(real, s.src_index >= 0)
        for lx in range(num_local):
            a, n, b = int(s.offsets[lx]), int(s.tokens_per_expert[lx]), int(s.offsets[lx + 1])
            assert bool(real[a : a + n].all()) and not bool(real[a + n : b].any())
            # Every row in the region routes its token to this very expert.
            sr, si = s.src_rank[a : a + n], s.src_index[a : a + n]
            experts = idx[sr, si // num_topk, si % num_topk]
            assert bool((experts == d * num_local + lx).all())
        seen[s.src_rank[real], s.src_index[real]] += 1
        # Loop-by-loop transcription of the position formula.
        off, rows = brute_force_pull_rows(idx, num_experts, d, row_tile, row_order=row_order)
        assert off == s.offsets.tolist()
        assert rows == list(zip(s.src_rank.tolist(), s.src_index.tolist(), strict=True))
    # Every routed (token, k) appears exactly once over all ranks.
    assert bool((seen == 1).all())
    # Push view agrees with the pull view.
    for s in scheds:
        for t in range(num_tokens):
            for k in range(num_topk):
                dst = scheds[int(s.dst_rank[t, k])]
                assert int(s.dst_rank[t, k]) == int(idx[s.rank, t, k]) // num_local
                p = int(s.dst_index[t, k])
                assert (int(dst.src_rank[p]), int(dst.src_index[p])) == (s.rank, t * num_topk + k)


@settings(max_examples=40, deadline=None)
@given(routings())
def test_dedup_schedule_properties(case):
    idx, num_experts, row_tile = case
    num_ranks, num_tokens, num_topk = idx.shape
    num_local = num_experts // num_ranks
    dst_of = idx // num_local  # [R, N, K]
    for s in build_all_schedules(idx, num_experts, row_tile):
        pairs = list(zip(s.dedup_src_rank.tolist(), s.dedup_src_token.tolist(), strict=True))
        want = {
            (r, t)
            for r in range(num_ranks)
            for t in range(num_tokens)
            if bool((dst_of[r, t] == s.rank).any())
        }
        assert len(pairs) == len(set(pairs)) and set(pairs) == want
        # Round-robin over source ranks, tokens in increasing order per source.
        for r in range(num_ranks):
            toks = [t for (rr, t) in pairs if rr == r]
            assert toks == sorted(toks)
        counts = [sum(1 for p in pairs if p[0] == r) for r in range(num_ranks)]
        for pos, (r, _) in enumerate(pairs):
            o = sum(1 for (rr, _) in pairs[:pos] if rr == r)
            expect = sum(min(c, o) for c in counts) + sum(1 for r2 in range(r) if counts[r2] > o)
            assert pos == expect
        # Fan-out: each real row reads the dedup row of its own (source, token).
        real = (s.src_rank >= 0).nonzero().squeeze(1)
        f = s.fanout[real]
        assert bool((s.fanout[s.src_rank < 0] == -1).all())
        assert torch.equal(s.dedup_src_rank[f], s.src_rank[real])
        assert torch.equal(s.dedup_src_token[f], s.src_index[real] // num_topk)
        # Combine slot: token * K + ordinal of this rank among the token's destination ranks.
        for j, (r, t) in enumerate(pairs):
            ordinal = len({int(v) for v in dst_of[r, t] if int(v) < s.rank})
            assert int(s.dedup_slot[j]) == t * num_topk + ordinal


@settings(max_examples=60, deadline=None)
@given(routings())
def test_source_order_gives_every_expert_its_rows_as_one_rank_does(case):
    """Rank r holding the global tokens after those of ranks < r: with ``row_order="source"``
    every expert's rows are the (global token, k) sequence of one rank holding the whole batch,
    at every rank count (what makes the sums over rows, hence the weight gradients, the same
    bits); interleaved order differs once two ranks send rows to one expert."""
    idx, num_experts, row_tile = case
    num_ranks, num_tokens, num_topk = idx.shape
    num_local = num_experts // num_ranks
    one = build_schedule(idx.reshape(1, -1, num_topk), num_experts, 0, row_tile)

    def rows_of(s, lx):  # the expert's real rows as global (token * K + k)
        a, n = int(s.offsets[lx]), int(s.tokens_per_expert[lx])
        return (s.src_rank[a : a + n] * num_tokens * num_topk + s.src_index[a : a + n]).tolist()

    for s in build_all_schedules(idx, num_experts, row_tile, row_order="source"):
        for lx in range(num_local):
            assert rows_of(s, lx) == rows_of(one, s.rank * num_local + lx)


def test_round_robin_example_by_hand():
    # Two ranks, one expert each on rank 0 (expert 0), k=1. Rank 0 sends 3 tokens, rank 1 one.
    idx = torch.tensor([[[0], [0], [0]], [[1], [0], [1]]])
    s = build_schedule(idx, num_experts=2, rank=0, row_tile=4)
    assert s.offsets.tolist() == [0, 4]
    # Round 0: rank 0 token 0, rank 1 token 1; round 1: rank 0 token 1; round 2: token 2.
    assert s.src_rank.tolist() == [0, 1, 0, 0]
    assert s.src_index.tolist() == [0, 1, 1, 2]
    s1 = build_schedule(idx, num_experts=2, rank=1, row_tile=4)
    assert s1.src_rank.tolist() == [1, 1, -1, -1] and s1.src_index.tolist() == [0, 2, -1, -1]


def test_required_rows_matches_schedules():
    t = make_routing(64, 16, 4, num_ranks=4, skew="zipf:1.2", seed=1)
    idx = torch.from_numpy(t.per_rank().copy())
    offs = required_rows(idx, 16, 8)
    for s in build_all_schedules(idx, 16, 8):
        assert torch.equal(offs[s.rank], s.offsets)


def test_large_schedule_builds_vectorised():
    # Realistic size at the CI budget: 4096 tokens x 16 ranks x top-8 (time is a benchmark, the
    # test checks only that it completes and stays consistent).
    t = make_routing(4096, 256, 8, num_ranks=16, seed=0)
    idx = torch.from_numpy(t.per_rank().copy())
    s = build_schedule(idx, 256, rank=5)
    assert int(s.tokens_per_expert.sum()) == int((idx // 16 == 5).sum())
    assert int((s.src_rank >= 0).sum()) == int(s.tokens_per_expert.sum())


def test_bad_inputs():
    idx = torch.tensor([[[0, 1]], [[2, 3]]])
    with pytest.raises(ValueError, match="num_experts=5 is not divisible by num_ranks=2"):
        build_schedule(idx, 5, 0)
    with pytest.raises(ValueError, match="same expert twice"):
        build_schedule(torch.tensor([[[1, 1]], [[2, 3]]]), 4, 0)
    with pytest.raises(ValueError, match=r"holds expert 7 .* outside \[0, 4\)"):
        build_schedule(torch.tensor([[[1, 7]], [[2, 3]]]), 4, 0)
    with pytest.raises(ValueError, match="must be \\[num_ranks, num_tokens, num_topk\\]"):
        build_schedule(idx[0], 4, 0)
    with pytest.raises(ValueError, match="rank 2 outside"):
        build_schedule(idx, 4, 2)
    with pytest.raises(ValueError, match="int32 or int64"):
        build_schedule(idx.float(), 4, 0)
    # Two local experts on rank 0, one row each, each region padded to the 128-row tile.
    want = [0] + [-1] * 127 + [0] + [-1] * 127
    assert np.array_equal(build_schedule(idx, 4, 0).src_rank.numpy(), want)


@settings(max_examples=80, deadline=None)
@given(routings(), st.sampled_from([1, 16, 64, 128]))
def test_the_capacity_formula_holds_every_padded_routing(case, row_tile):
    """MoKConfig.capacity_rows (capacity_factor x tokens x k routed rows, plus row_tile - 1
    padding rows per local expert, to whole tiles) holds the schedule's padded rows on every
    rank whenever the factor covers the busiest rank's routed rows: the padding never needs a
    larger factor, at any EP size and skew."""
    from mok.spec.config import MoKConfig

    idx, num_experts, _ = case
    num_ranks, num_tokens, num_topk = idx.shape
    if num_tokens == 0:
        return
    offsets = required_rows(idx, num_experts, row_tile)  # [R, L + 1], padded
    routed = torch.bincount(idx.reshape(-1) // (num_experts // num_ranks), minlength=num_ranks)
    factor = max(float(routed.max()) / (num_tokens * num_topk), 1e-6)
    cfg = MoKConfig(capacity_factor=factor, row_tile=row_tile, minibatch_size=max(row_tile, 128))
    cap = cfg.capacity_rows(num_tokens, num_topk, num_experts // num_ranks, num_ranks)
    assert int(offsets[:, -1].max()) <= cap
