"""Expert-parallel reference: a single-rank group in process, and 4 and 8 gloo ranks (torchrun)."""

import pytest
import torch
import torch.distributed as dist

from mok.spec.workload import ModelShape, get_shape, make_routing
from reference.ep import ep_backward, ep_forward
from reference.moe import moe_backward, moe_forward
from reference.weights import MoEWeights
from tests import tolerances as tol
from tests.dist.launch import torchrun


@pytest.fixture
def single_rank_group():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_single_rank_matches_reference(single_rank_group):
    shape = get_shape("tiny")
    w = MoEWeights.random(shape, seed=0, dtype=torch.float64)
    t = make_routing(50, shape.num_experts, shape.num_topk, seed=0)
    x = torch.randn(
        50, shape.hidden, generator=torch.Generator().manual_seed(0), dtype=w.w_gate.dtype
    )
    idx, tw = torch.from_numpy(t.topk_idx), torch.from_numpy(t.topk_weights).double()
    want = moe_forward(x, idx, tw, w, torch.float64)
    for dm in ("pull", "push", "dedup_pull"):
        got = ep_forward(
            x, idx, tw, w, shape.num_experts, dispatch_mode=dm, compute_dtype=torch.float64
        ).out
        torch.testing.assert_close(got, want, rtol=tol.FP64_RTOL, atol=tol.FP64_ATOL)


def test_bad_modes_and_sharding(single_rank_group):
    shape = get_shape("tiny")
    w = MoEWeights.random(shape, seed=0)
    x = torch.zeros(4, shape.hidden)
    idx = torch.arange(4).repeat(4, 1)
    tw = torch.full((4, 4), 0.25)
    with pytest.raises(ValueError, match="unknown dispatch_mode 'scatter'"):
        ep_forward(x, idx, tw, w, 16, dispatch_mode="scatter")
    with pytest.raises(ValueError, match="dedup_pull dispatch pairs with the dedup push"):
        ep_forward(x, idx, tw, w, 16, dispatch_mode="dedup_pull", combine_mode="pull")
    with pytest.raises(ValueError, match="holds 8 experts, expected num_experts / num_ranks = 16"):
        ep_forward(x, idx, tw, w.shard(0, 2), 16)


@pytest.mark.parametrize(("num_tokens", "num_topk"), [(0, 4), (0, 0), (20, 0)])
def test_single_rank_zero_tokens_or_zero_topk(single_rank_group, num_tokens, num_topk):
    """Every transfer mode and the backward with no tokens or no routed experts: the shapes of
    the single-device reference, and its values."""
    shape = ModelShape("ep-zero", 8, 32, 16, 4, shared_intermediate=16)
    w = MoEWeights.random(shape, seed=0, dtype=torch.float64)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(num_tokens, shape.hidden, generator=g, dtype=torch.float64)
    go = torch.randn(num_tokens, shape.hidden, generator=g, dtype=torch.float64)
    idx = torch.arange(num_topk).repeat(num_tokens, 1)
    tw = torch.full((num_tokens, num_topk), 1.0 / max(num_topk, 1), dtype=torch.float64)
    want = moe_forward(x, idx, tw, w, torch.float64)
    for dm, cm in [("pull", "push"), ("push", "push"), ("pull", "pull"), ("dedup_pull", "push")]:
        r = ep_forward(
            x, idx, tw, w, 8, dispatch_mode=dm, combine_mode=cm, compute_dtype=torch.float64
        )
        assert r.out.shape == (num_tokens, shape.hidden) and r.schedule.num_rows == 0
        torch.testing.assert_close(r.out, want, rtol=tol.FP64_RTOL, atol=tol.FP64_ATOL)
    got = ep_backward(go, x, idx, tw, w, 8, compute_dtype=torch.float64)
    ref = moe_backward(go, x, idx, tw, w, torch.float64)
    assert got.d_topk_weights.shape == (num_tokens, num_topk)
    for name in ("dx", "dw_gate", "dw_up", "dw_down", "d_shared_w_gate", "d_shared_w_down"):
        a, b = getattr(got, name), getattr(ref, name)
        assert a.shape == b.shape, name
        torch.testing.assert_close(a, b, rtol=tol.FP64_RTOL, atol=tol.FP64_ATOL)
    assert not bool(got.dw_gate.any())  # no routed rows
    assert bool(got.dx.any()) == bool(num_tokens)  # the shared expert's term


@pytest.mark.parametrize("num_ranks", [4, 8])
def test_gloo_ranks_against_full_reference(num_ranks):
    """Includes ranks with no tokens next to ranks with tokens, and num_topk = 0."""
    torchrun("ep_worker.py", num_ranks, "EP-WORKER-OK")
