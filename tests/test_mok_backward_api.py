"""``mok.functional.moe_backward``, the layer's backward as one explicit call, off CUDA: the
reference's backward (reference.moe.moe_backward) bit for bit, the gradients autograd gives
through ``mok.functional.moe``, in the inputs' dtypes, and a clear error for a grad_out of the
wrong shape. The CUDA path is checked in tests/test_mok_autograd_gpu.py."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from mok import MoKInputError
from mok import functional as mf
from mok.spec.workload import ModelShape, make_routing
from reference.moe import MoEGrads, moe_backward
from reference.weights import MoEWeights

SHAPE = ModelShape("tiny", num_experts=6, hidden=16, intermediate=8, num_topk=2,
                   shared_intermediate=12)  # fmt: skip
N = 9
FIELDS = [f.name for f in dataclasses.fields(MoEGrads)]
# the gradient field of each weight
GRAD_OF = {"w_gate": "dw_gate", "w_up": "dw_up", "w_down": "dw_down"}
GRAD_OF.update({f"shared_w_{n}": f"d_shared_w_{n}" for n in ("gate", "up", "down")})


def _inputs(dtype, seed=0):
    w = MoEWeights.random(SHAPE, seed=seed, dtype=dtype)
    t = make_routing(N, SHAPE.num_experts, SHAPE.num_topk, 1, "zipf:1.0", seed=seed)
    g = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(N, SHAPE.hidden, generator=g, dtype=dtype)
    grad_out = torch.randn(N, SHAPE.hidden, generator=g, dtype=dtype)
    return x, torch.from_numpy(t.topk_idx), torch.from_numpy(t.topk_weights).to(dtype), w, grad_out


@pytest.mark.parametrize("call", ["moe_backward", "backward"])
def test_it_is_the_references_backward_in_fp64(call):
    x, idx, tw, w, grad_out = _inputs(torch.float64)
    got = getattr(mf, call)(grad_out, x, idx, tw, w, SHAPE.num_experts)
    want = moe_backward(grad_out, x, idx, tw, w, torch.float64)
    for name in FIELDS:
        assert torch.equal(getattr(got, name), getattr(want, name)), name


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_it_gives_what_autograd_gives_through_moe(dtype):
    x, idx, tw, w, grad_out = _inputs(dtype, seed=1)
    leaves = {k: v.detach().clone().requires_grad_(True) for k, v in vars(w).items()}
    xs, tws = x.clone().requires_grad_(True), tw.clone().requires_grad_(True)
    mf.moe(xs, idx, tws, MoEWeights(**leaves), SHAPE.num_experts).backward(grad_out)
    got = mf.moe_backward(grad_out, x, idx, tw, w, SHAPE.num_experts)
    want = {"dx": xs.grad, "d_topk_weights": tws.grad}
    want.update({GRAD_OF[k]: v.grad for k, v in leaves.items()})
    for name, t in want.items():
        g = getattr(got, name)
        assert g.dtype == t.dtype and torch.equal(g, t), name


def test_a_grad_out_unlike_the_output_is_refused():
    x, idx, tw, w, grad_out = _inputs(torch.float32)
    with pytest.raises(MoKInputError, match=r"grad_out must be like the layer's output, \(9, 16\)"):
        mf.moe_backward(grad_out[:, :8], x, idx, tw, w, SHAPE.num_experts)


def test_the_eager_cuda_function_refuses_a_second_derivative(monkeypatch):
    """The eager CUDA path's autograd.Function (mok.autograd._MoE), with its forward and
    backward stood in on CPU tensors: one backward gives the backward's gradients; a backward
    through those gradients (create_graph=True) raises instead of differentiating kernels that
    autograd never saw."""
    import mok.autograd as ma

    monkeypatch.setattr(ma, "moe_forward", lambda x, *a, **k: 2 * x)

    def backward(grad_out, x, idx, tw, routed, shared, *rest):
        zeros = [None if t is None else torch.zeros_like(t) for t in (*routed, *shared)]
        return (2 * grad_out, torch.zeros_like(tw), *zeros)

    monkeypatch.setattr(ma, "_backward", backward)
    x, idx, tw, w, grad_out = _inputs(torch.float64)
    x.requires_grad_(True)
    leaves = [w.w_gate, w.w_up, w.w_down, None, None, None]
    out = ma._MoE.apply(idx, w, SHAPE.num_experts, None, None, False, True, None, x, tw, *leaves)
    grad_out.requires_grad_(True)  # as in a gradient penalty: the seed is itself differentiable
    (g,) = torch.autograd.grad(out, x, grad_out, create_graph=True)
    assert torch.equal(g, 2 * grad_out)
    with pytest.raises(RuntimeError, match="once_differentiable"):
        g.sum().backward()
