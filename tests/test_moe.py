"""Single-device reference layer: explicit backward vs autograd, numerics per mode, errors."""

import pytest
import torch

from mok.workload import ModelShape, get_shape, make_routing
from reference.moe import moe_backward, moe_forward, route
from reference.weights import MoEWeights
from tests import tolerances as tol

SHAPES = [get_shape("tiny"), ModelShape("noshared", 8, 64, 96, 3)]


def _case(shape: ModelShape, num_tokens: int, dtype: torch.dtype, seed: int = 0):
    w = MoEWeights.random(shape, seed=seed, dtype=dtype)
    t = make_routing(num_tokens, shape.num_experts, shape.num_topk, skew="zipf:1.0", seed=seed)
    g = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(num_tokens, shape.hidden, generator=g, dtype=torch.float64).to(dtype)
    idx = torch.from_numpy(t.topk_idx)
    tw = torch.from_numpy(t.topk_weights).to(dtype if dtype != torch.bfloat16 else torch.float32)
    return x, idx, tw, w


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: s.name)
def test_explicit_backward_matches_autograd(shape):
    x, idx, tw, w = _case(shape, 48, torch.float64)
    params = [p for p in vars(w).values() if p is not None]
    for p in params:
        p.requires_grad_(True)
    xs, tws = x.clone().requires_grad_(True), tw.clone().requires_grad_(True)
    out = moe_forward(xs, idx, tws, w, torch.float64)
    grad_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(9), dtype=out.dtype)
    out.backward(grad_out)
    with torch.no_grad():
        g = moe_backward(grad_out, x, idx, tw, w, torch.float64)
    pairs = [
        (g.dx, xs.grad),
        (g.d_topk_weights, tws.grad),
        (g.dw_gate, w.w_gate.grad),
        (g.dw_up, w.w_up.grad),
        (g.dw_down, w.w_down.grad),
    ]
    if w.has_shared:
        pairs += [
            (g.d_shared_w_gate, w.shared_w_gate.grad),
            (g.d_shared_w_up, w.shared_w_up.grad),
            (g.d_shared_w_down, w.shared_w_down.grad),
        ]
    for got, want in pairs:
        torch.testing.assert_close(got, want, rtol=tol.FP64_RTOL, atol=tol.FP64_ATOL)


def test_router_weight_gradient_is_inner_product_with_expert_output():
    # d out / d w_k = y_k: check one token by finite differences of the fp64 layer.
    x, idx, tw, w = _case(get_shape("tiny"), 8, torch.float64)
    grad_out = torch.randn(8, w.hidden, generator=torch.Generator().manual_seed(2), dtype=x.dtype)
    g = moe_backward(grad_out, x, idx, tw, w, torch.float64)
    eps = 1e-6
    bumped = tw.clone()
    bumped[3, 1] += eps
    fd = (
        (moe_forward(x, idx, bumped, w, torch.float64) - moe_forward(x, idx, tw, w, torch.float64))
        * grad_out
    ).sum() / eps
    assert abs(fd.item() - g.d_topk_weights[3, 1].item()) < 1e-5


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: s.name)
def test_fp32_close_to_fp64_oracle(shape):
    x, idx, tw, w = _case(shape, 64, torch.float64)
    oracle = moe_forward(x, idx, tw, w, torch.float64)
    got = moe_forward(x.float(), idx, tw.float(), w.to(torch.float32), torch.float32)
    torch.testing.assert_close(got.double(), oracle, rtol=tol.FP32_RTOL, atol=tol.FP32_ATOL)
    go = torch.randn(oracle.shape, generator=torch.Generator().manual_seed(3), dtype=x.dtype)
    g64 = moe_backward(go, x, idx, tw, w, torch.float64)
    g32 = moe_backward(go.float(), x.float(), idx, tw.float(), w.to(torch.float32), torch.float32)
    torch.testing.assert_close(g32.dx.double(), g64.dx, rtol=tol.FP32_RTOL, atol=tol.FP32_ATOL)
    torch.testing.assert_close(
        g32.dw_up.double(), g64.dw_up, rtol=tol.FP32_RTOL, atol=tol.FP32_ATOL
    )


def test_bf16_and_mxfp8_error_against_oracle():
    x, idx, tw, w = _case(get_shape("tiny"), 128, torch.float64)
    oracle = moe_forward(x, idx, tw, w, torch.float64)
    xb, wb = x.to(torch.bfloat16), w.to(torch.bfloat16)
    xr, wr = xb.double(), wb.to(torch.float64)  # the bf16 inputs, exactly, for a fair oracle
    oracle_b = moe_forward(xr, idx, tw, wr, torch.float64)
    scale = oracle.abs().max().item()
    bf16 = moe_forward(xb, idx, tw.float(), wb, torch.bfloat16)
    mx = moe_forward(xb, idx, tw.float(), wb, "mxfp8")
    assert bf16.dtype == torch.bfloat16 and mx.dtype == torch.bfloat16
    err_bf16 = tol.max_abs_err(bf16, oracle_b) / scale
    err_mx = tol.max_abs_err(mx, oracle_b) / scale
    assert 0 < err_bf16 < tol.BF16_REF_REL_ERR
    assert err_bf16 < err_mx < tol.MXFP8_REF_REL_ERR


def test_mxfp8_leaves_shared_expert_in_bf16():
    x, idx, tw, w = _case(get_shape("tiny"), 32, torch.float64)
    xb, wb = x.to(torch.bfloat16), w.to(torch.bfloat16)
    zero = torch.zeros_like(tw, dtype=torch.float32)  # routed experts contribute nothing
    a = moe_forward(xb, idx, zero, wb, "mxfp8")
    b = moe_forward(xb, idx, zero, wb, torch.bfloat16)
    assert torch.equal(a, b)
    assert not torch.equal(
        moe_forward(xb, idx, tw.float(), wb, "mxfp8"),
        moe_forward(xb, idx, tw.float(), wb, torch.bfloat16),
    )


def test_forward_is_deterministic():
    x, idx, tw, w = _case(get_shape("tiny"), 64, torch.bfloat16)
    a = moe_forward(x, idx, tw, w, torch.bfloat16)
    b = moe_forward(x, idx, tw, w, torch.bfloat16)
    assert torch.equal(a, b)


def test_route_by_hand():
    logits = torch.tensor([[0.0, 2.0, 1.0, 2.0], [5.0, -1.0, 0.0, 0.0]])
    idx, w = route(logits, 2)
    assert idx.tolist() == [[1, 3], [0, 2]]  # ties go to the lower expert id
    torch.testing.assert_close(w[0], torch.tensor([0.5, 0.5]))
    assert w.dtype == torch.float32 and torch.allclose(w.sum(1), torch.ones(2))
    idx_s, _ = route(logits, 1, score="sigmoid", normalize=False)
    assert idx_s.tolist() == [[1], [0]]
    with pytest.raises(ValueError, match="unknown router score 'relu'"):
        route(logits, 2, score="relu")


def test_bad_inputs_are_explained():
    x, idx, tw, w = _case(get_shape("tiny"), 16, torch.float32)
    with pytest.raises(ValueError, match="x has hidden=255 but the weights have hidden=256"):
        moe_forward(x[:, :255], idx, tw, w)
    with pytest.raises(ValueError, match="x is torch.float64 but the expert weights are"):
        moe_forward(x.double(), idx, tw, w)
    bad = tw.clone()
    bad[2, 1] = float("nan")
    with pytest.raises(ValueError, match="topk_weights is not finite at token 2, k=1"):
        moe_forward(x, idx, bad, w)
    bad_idx = idx.clone()
    bad_idx[0, 0] = 16
    with pytest.raises(ValueError, match="expert 16 .* outside \\[0, 16\\)"):
        moe_forward(x, bad_idx, tw, w)
    bad_idx[0, :2] = 3
    with pytest.raises(ValueError, match="same expert twice"):
        moe_forward(x, bad_idx, tw, w)
    with pytest.raises(ValueError, match="topk_weights has shape \\(16, 3\\)"):
        moe_forward(x, idx, tw[:, :3], w)
    with pytest.raises(ValueError, match="different devices"):
        moe_forward(x.to("meta"), idx, tw, w.to(torch.float32))
    with pytest.raises(ValueError, match="unsupported compute_dtype"):
        moe_forward(x, idx, tw, w, torch.float16)
    with pytest.raises(ValueError, match="w_up has shape"):
        MoEWeights(w.w_gate, w.w_up[:, :5], w.w_down)
