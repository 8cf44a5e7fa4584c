"""The default workspace size on one GPU (EP1, no process group): with ``max_tokens=0`` a small
first call does not cap later calls, on every path of the forward and under training, and a
call above the default grows the workspace.

The oracle is the workspace's history: every call gives, bitwise, what the same call gives on a
fresh workspace (mok's kernels and the unfused path's torch GEMMs are deterministic for a given
row count), whatever calls came before; one count per path is also held to the BF16 rule
against the reference."""

from __future__ import annotations

import dataclasses

import pytest

torch = pytest.importorskip("torch")

import mok  # noqa: E402
from mok import functional as mf  # noqa: E402
from mok import sizing  # noqa: E402
from mok.spec.workload import ModelShape  # noqa: E402
from reference.moe import moe_forward as ref_moe_forward  # noqa: E402
from tests import tolerances as tol  # noqa: E402
from tests.layer_problem import layer_problem  # noqa: E402
from tests.marks import LAYER_PATHS, hopper  # noqa: E402

# Every test runs where mok's kernels build; the fused layer's and recompute=False's cases need
# sm_90 (hopper()).
pytestmark = [pytest.mark.gpu, pytest.mark.kernels, pytest.mark.usefixtures("fresh_workspaces")]

SEED = 4321
SHAPE = ModelShape("sizing", 16, 512, 256, 4, shared_intermediate=256)
COUNTS = [0, 1, 777, 1024, 4096]
ORDERS = [COUNTS, COUNTS[::-1]]
FORWARD_PATHS = LAYER_PATHS
# fused, recompute
TRAIN_PATHS = [hopper(True, False), hopper(True, True), hopper(False, False), (False, True)]


@pytest.fixture(scope="module")
def problem():
    return layer_problem(SHAPE, max(COUNTS), SEED)


def _cfg(dm: str = "dedup_pull", cm: str = "push") -> mok.MoKConfig:
    # max_tokens left at 0: the default size
    return mok.MoKConfig(dispatch_mode=dm, combine_mode=cm, num_comm_sms=8, minibatch_size=256)


def _forward(problem, cfg, fused):
    w, x, idx, tw = problem

    def call(n: int) -> list[torch.Tensor]:
        out = mf.moe_forward(x[:n], idx[:n], tw[:n], w, SHAPE.num_experts, cfg, fused=fused)
        mok.check()
        return [out]

    return call


def _train(problem, fused, recompute):
    w, x, idx, tw = problem
    g = torch.Generator(device="cuda").manual_seed(SEED + 1)
    grad_out = torch.randn(x.shape, device="cuda", generator=g).to(torch.bfloat16)

    def call(n: int) -> list[torch.Tensor]:
        leaves = {
            k: v.detach().clone().requires_grad_(True) for k, v in vars(w).items() if v is not None
        }
        ws = dataclasses.replace(w, **leaves)
        xs, tws = x[:n].clone().requires_grad_(True), tw[:n].clone().requires_grad_(True)
        out = mf.moe(
            xs, idx[:n], tws, ws, SHAPE.num_experts, _cfg(), fused=fused, recompute=recompute
        )
        out.backward(grad_out[:n])
        mok.check()
        return [out.detach(), xs.grad, tws.grad, *(leaves[k].grad for k in sorted(leaves))]

    return call


def _fresh(call, counts) -> dict[int, list[torch.Tensor]]:
    got = {}
    for n in counts:
        mok.clear_workspaces()
        got[n] = call(n)
    mok.clear_workspaces()
    return got


def _check_sequences(call, what: str) -> None:
    fresh = _fresh(call, COUNTS)
    for order in ORDERS:
        for n in order:
            got = call(n)
            for i, (a, b) in enumerate(zip(got, fresh[n], strict=True)):
                assert a.shape == b.shape and torch.equal(a, b), (
                    f"{what}: {n} tokens after {order[: order.index(n)]} differ from a fresh "
                    f"workspace (tensor {i})"
                )
        held = mok.cached_workspaces()
        assert held and all(ws.max_tokens == sizing.DEFAULT_MAX_TOKENS for ws in held), what
        mok.clear_workspaces()


@pytest.mark.parametrize("dm,cm,fused", FORWARD_PATHS)
def test_forward_call_sequences_on_the_default_size(problem, dm, cm, fused):
    w, x, idx, tw = problem
    call = _forward(problem, _cfg(dm, cm), fused)
    _check_sequences(call, f"forward {dm}/{cm} fused={fused}")
    (out,) = call(777)
    oracle = ref_moe_forward(
        x[:777].double(), idx[:777], tw[:777].double(), w.to(torch.float64), torch.float64
    )
    ref_b = ref_moe_forward(x[:777], idx[:777], tw[:777], w, torch.bfloat16)
    tol.assert_bf16_rule(out.cpu(), ref_b.cpu(), oracle.cpu())


@pytest.mark.parametrize("fused,recompute", TRAIN_PATHS)
def test_training_call_sequences_on_the_default_size(problem, fused, recompute):
    _check_sequences(
        _train(problem, fused, recompute), f"training fused={fused} recompute={recompute}"
    )


@pytest.mark.parametrize("fused", [hopper(True), False])
def test_a_call_above_the_default_grows_the_workspace(problem, fused):
    w, x, idx, tw = problem
    big = sizing.DEFAULT_MAX_TOKENS + 777
    reps = -(-big // x.shape[0])
    xb, ib, twb = (t.repeat(reps, 1)[:big] for t in (x, idx, tw))
    call = _forward((w, xb, ib, twb), _cfg(), fused)
    fresh = _fresh(call, [100, big])
    assert torch.equal(call(100)[0], fresh[100][0])
    (ws,) = mok.cached_workspaces()
    assert ws.max_tokens == sizing.DEFAULT_MAX_TOKENS
    assert torch.equal(call(big)[0], fresh[big][0])
    (grown,) = mok.cached_workspaces()
    assert grown is not ws and grown.max_tokens == 2 * sizing.DEFAULT_MAX_TOKENS
    assert torch.equal(call(100)[0], fresh[100][0])
    assert mok.cached_workspaces() == [grown]
