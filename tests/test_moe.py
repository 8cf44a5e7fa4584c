"""Single-device reference layer: explicit backward vs autograd, numerics per mode, errors."""

import pytest
import torch

from mok.spec.workload import ModelShape, get_shape, make_routing
from reference.moe import moe_backward, moe_forward, output_dtype, route
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


ALL_MODES = [torch.float64, torch.float32, torch.bfloat16, "mxfp8"]
# small shapes, with and without a shared expert (hidden a multiple of the MXFP8 block)
SMALL = [ModelShape("small", 8, 32, 48, 3, shared_intermediate=16), SHAPES[1]]


def _dtypes(mode) -> tuple[torch.dtype, torch.dtype]:
    """(dtype of x and the weights, dtype of the router weights) of a mode."""
    if mode in (torch.float64, torch.float32):
        return mode, mode
    return torch.bfloat16, torch.float32


def _empty_routing(num_tokens: int, num_topk: int, dtype: torch.dtype):
    idx = torch.zeros(num_tokens, num_topk, dtype=torch.int64)
    return idx, torch.zeros(num_tokens, num_topk, dtype=dtype)


@pytest.mark.parametrize("mode", ALL_MODES, ids=str)
@pytest.mark.parametrize("shape", SMALL, ids=lambda s: s.name)
def test_zero_tokens(shape, mode):
    """No tokens: an empty output and empty activation gradients, zero weight gradients."""
    wdtype, dtype = _dtypes(mode)
    w = MoEWeights.random(shape, dtype=wdtype)
    h = shape.hidden
    for k in (shape.num_topk, 0):
        x = torch.zeros(0, h, dtype=w.w_gate.dtype)
        idx, tw = _empty_routing(0, k, dtype)
        out = moe_forward(x, idx, tw, w, mode)
        assert out.shape == (0, h) and out.dtype == output_dtype(mode)
        g = moe_backward(torch.zeros(0, h, dtype=x.dtype), x, idx, tw, w, mode)
        assert g.dx.shape == (0, h) and g.dx.dtype == output_dtype(mode)
        assert g.d_topk_weights.shape == (0, k)
        for got, want in [(g.dw_gate, w.w_gate), (g.dw_up, w.w_up), (g.dw_down, w.w_down)]:
            assert got.shape == want.shape and not bool(got.any())
        shared = [g.d_shared_w_gate, g.d_shared_w_up, g.d_shared_w_down]
        if w.has_shared:
            assert [t.shape for t in shared] == [
                w.shared_w_gate.shape,
                w.shared_w_up.shape,
                w.shared_w_down.shape,
            ]
            assert not any(bool(t.any()) for t in shared)
        else:
            assert shared == [None, None, None]


@pytest.mark.parametrize("mode", ALL_MODES, ids=str)
@pytest.mark.parametrize("shape", SMALL, ids=lambda s: s.name)
def test_zero_topk_is_the_shared_expert_alone(shape, mode):
    """num_topk == 0: the layer is its shared expert (zero without one), bitwise the layer whose
    router weights are all zero; the routed weight gradients are zero."""
    wdtype, dtype = _dtypes(mode)
    x, idx, tw, w = _case(shape, 24, wdtype)
    tw = tw.to(dtype)
    none_idx, none_w = _empty_routing(24, 0, dtype)
    zero_w = torch.zeros_like(tw)
    out = moe_forward(x, none_idx, none_w, w, mode)
    assert out.shape == (24, shape.hidden) and out.dtype == output_dtype(mode)
    assert torch.equal(out, moe_forward(x, idx, zero_w, w, mode))
    assert bool(out.any()) == w.has_shared
    go = torch.randn(out.shape, generator=torch.Generator().manual_seed(5)).to(x.dtype)
    g = moe_backward(go, x, none_idx, none_w, w, mode)
    ref = moe_backward(go, x, idx, zero_w, w, mode)
    assert g.d_topk_weights.shape == (24, 0)
    assert torch.equal(g.dx, ref.dx) and g.dx.shape == x.shape
    assert bool(g.dx.any()) == w.has_shared
    for got in (g.dw_gate, g.dw_up, g.dw_down):
        assert got.shape[0] == shape.num_experts and not bool(got.any())
    if w.has_shared:
        assert torch.equal(g.d_shared_w_gate, ref.d_shared_w_gate)
        assert torch.equal(g.d_shared_w_down, ref.d_shared_w_down)


def test_zero_topk_backward_matches_autograd():
    x, _, _, w = _case(SMALL[0], 12, torch.float64)
    idx, tw = _empty_routing(12, 0, torch.float64)
    params = [w.shared_w_gate, w.shared_w_up, w.shared_w_down]
    for p in params:
        p.requires_grad_(True)
    xs = x.clone().requires_grad_(True)
    out = moe_forward(xs, idx, tw, w, torch.float64)
    go = torch.randn(out.shape, generator=torch.Generator().manual_seed(4), dtype=out.dtype)
    out.backward(go)
    with torch.no_grad():
        g = moe_backward(go, x, idx, tw, w, torch.float64)
    got = [g.dx, g.d_shared_w_gate, g.d_shared_w_up, g.d_shared_w_down]
    for a, b in zip(got, [xs.grad] + [p.grad for p in params], strict=True):
        torch.testing.assert_close(a, b, rtol=tol.FP64_RTOL, atol=tol.FP64_ATOL)


def test_route_zero_tokens_and_zero_topk():
    for n, k in [(0, 2), (0, 0), (3, 0)]:
        idx, w = route(torch.randn(n, 6, generator=torch.Generator().manual_seed(0)), k)
        assert idx.shape == (n, k) and w.shape == (n, k) and w.dtype == torch.float32
    with pytest.raises(ValueError, match="0 <= num_topk <= num_experts"):
        route(torch.zeros(2, 6), 7)
