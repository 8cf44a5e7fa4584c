"""``mok.experts.swiglu_backward`` (the experts' recompute + dgrad / wgrad of the backward) on
CPU: in fp32 against a per-expert fp64 autograd oracle (grouped, with an empty group, padding
rows inside a group and rows past the last group that must reach no gradient; dense, without a
routing weight, as the shared expert runs), and in bf16 against the reference's bf16 backward
under the bf16 rule (the rounding points the GPU path shares)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from mok.experts import swiglu_backward
from reference.moe import expert_ffn, expert_ffn_backward
from tests import tolerances as tol

L, H, INTER = 3, 16, 8
SIZES = [5, 0, 7]  # rows per expert (an empty one in the middle)


def _oracle(a, wgu, wd, sizes, dy, row_w):
    """Per-expert fp64 autograd of y = w * (silu(a Wg^T) * (a Wu^T)) Wd^T."""
    leaves = [t.double().detach().requires_grad_() for t in (a, wgu, wd, row_w)]
    a_, wgu_, wd_, w_ = leaves
    ys, r = [], 0
    for e, n in enumerate(sizes):
        gu = a_[r : r + n] @ wgu_[e].T
        h = F.silu(gu[:, :INTER]) * gu[:, INTER:]
        ys.append(w_[r : r + n, None] * (h @ wd_[e].T))
        r += n
    y = torch.cat(ys)
    return torch.autograd.grad(y, leaves, dy[: y.shape[0]].double())


def test_grouped_against_per_expert_autograd():
    g = torch.Generator().manual_seed(0)
    rows = sum(SIZES) + 4  # 4 rows past the last group
    a = torch.randn(rows, H, generator=g)
    dy = torch.randn(rows, H, generator=g)
    row_w = torch.rand(rows, generator=g)
    a[3], dy[3], row_w[3] = 0.0, 0.0, 0.0  # a padding row inside expert 0
    a[-4:] = float("nan")  # past the last group: unspecified, never read into a gradient
    dy[-4:], row_w[-4:] = 0.0, 0.0
    wgu = torch.randn(L, 2 * INTER, H, generator=g) / 4
    wd = torch.randn(L, H, INTER, generator=g) / 3
    offs = torch.tensor(SIZES, dtype=torch.int32).cumsum(0).to(torch.int32)
    d_a, d_w, d_wgu, d_wd = swiglu_backward(a, wgu, wd, dy, row_w, offs)
    want = _oracle(a, wgu, wd, SIZES, dy, row_w)
    n = sum(SIZES)
    want = (want[0][:n], want[1], want[2], want[3][:n])
    for got, ref in zip((d_a[:n], d_wgu, d_wd, d_w[:n]), want, strict=True):
        assert torch.isfinite(got).all()
        torch.testing.assert_close(got.double(), ref, rtol=tol.FP32_RTOL, atol=tol.FP32_ATOL)


def test_dense_without_routing_weight():
    g = torch.Generator().manual_seed(1)
    a, dy = torch.randn(9, H, generator=g), torch.randn(9, H, generator=g)
    wgu, wd = torch.randn(2 * INTER, H, generator=g) / 4, torch.randn(H, INTER, generator=g) / 3
    d_a, d_w, d_wgu, d_wd = swiglu_backward(a, wgu, wd, dy, d_a_dtype=torch.float32)
    assert d_w is None and d_a.dtype == torch.float32
    want = _oracle(a, wgu[None], wd[None], [9], dy, torch.ones(9))
    for got, ref in zip((d_a, d_wgu, d_wd), (want[0], want[1][0], want[2][0]), strict=True):
        torch.testing.assert_close(got.double(), ref, rtol=tol.FP32_RTOL, atol=tol.FP32_ATOL)


@pytest.mark.parametrize("seed", [0, 1])
def test_bf16_meets_the_rule_against_the_reference(seed):
    """One expert of 300 rows in bf16: every gradient within the bf16 rule of the reference's
    bf16 backward against its fp64 one."""
    g = torch.Generator().manual_seed(seed)
    n, hid, inter = 300, 256, 128
    x = torch.randn(n, hid, generator=g).bfloat16()
    dy = torch.randn(n, hid, generator=g).bfloat16()
    w = torch.rand(n, generator=g)
    wg = (torch.randn(inter, hid, generator=g) / hid**0.5).bfloat16()
    wu = (torch.randn(inter, hid, generator=g) / hid**0.5).bfloat16()
    wd = (torch.randn(hid, inter, generator=g) / inter**0.5).bfloat16()
    offs = torch.tensor([n], dtype=torch.int32)
    got = swiglu_backward(x, torch.cat([wg, wu])[None], wd[None], dy, w, offs)
    d_a, d_w, d_wgu, d_wd = got
    got = (d_a, d_w, d_wgu[0, :inter], d_wgu[0, inter:], d_wd[0])

    def ref(mode):
        _, saved = expert_ffn(x, wg, wu, wd, mode)
        return expert_ffn_backward(dy, w, x, saved, wg, wu, wd, mode)

    for mine, r16, r64 in zip(got, ref(torch.bfloat16), ref(torch.float64), strict=True):
        tol.assert_bf16_rule(mine.double(), r16.double(), r64)


def test_weight_gradients_added_into_fp32_accumulators():
    """wgrad_into (main_grad): the weight gradients' fp32 sums added onto the given buffers,
    which are returned; the other gradients unchanged; a buffer of the wrong dtype or shape is
    refused."""
    g = torch.Generator().manual_seed(2)
    rows = sum(SIZES)
    a = torch.randn(rows, H, generator=g).bfloat16()
    dy = torch.randn(rows, H, generator=g).bfloat16()
    row_w = torch.rand(rows, generator=g)
    wgu = (torch.randn(L, 2 * INTER, H, generator=g) / 4).bfloat16()
    wd = (torch.randn(L, H, INTER, generator=g) / 3).bfloat16()
    offs = torch.tensor(SIZES, dtype=torch.int32).cumsum(0).to(torch.int32)
    plain = swiglu_backward(a, wgu, wd, dy, row_w, offs)
    acc = (torch.randn(wgu.shape, generator=g), torch.randn(wd.shape, generator=g))
    start = tuple(t.clone() for t in acc)
    got = swiglu_backward(a, wgu, wd, dy, row_w, offs, wgrad_into=acc)
    assert got[2] is acc[0] and got[3] is acc[1]
    for i in (0, 1):
        assert torch.equal(got[i], plain[i])
    for added, s0, bf in zip(acc, start, plain[2:], strict=True):
        # the fp32 sums, which the plain call rounds to bf16 (within half a bf16 ulp of it)
        assert added.dtype == torch.float32
        torch.testing.assert_close(added - s0, bf.float(), rtol=tol.BF16_ULP, atol=tol.FP32_ATOL)
    with pytest.raises(ValueError, match="fp32 tensors of the weights' shapes"):
        swiglu_backward(a, wgu, wd, dy, row_w, offs, wgrad_into=(acc[0].bfloat16(), acc[1]))
