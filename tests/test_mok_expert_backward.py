"""``mok.autograd.expert_backward`` (the routed experts' recompute + dgrad / wgrad of the
backward) on CPU in fp32 against a per-expert fp64 autograd oracle: both weight layouts
(separate gate / up, halves of one [L, 2I, H] tensor), padding rows inside a group, and rows past
the last group that must not reach any gradient."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from mok.autograd import expert_backward

L, H, INTER = 3, 16, 8
SIZES = [5, 0, 7]  # rows per expert (an empty one in the middle)


def _oracle(recv, wg, wu, wd, sizes, dy):
    leaves = [t.double().detach().requires_grad_() for t in (recv, wg, wu, wd)]
    a, g_, u_, d_ = leaves
    ys, r = [], 0
    for e, n in enumerate(sizes):
        x = a[r : r + n]
        h = F.silu(x @ g_[e].T) * (x @ u_[e].T)
        ys.append(h @ d_[e].T)
        r += n
    y = torch.cat(ys)
    d_a, *grads = torch.autograd.grad(y, leaves, dy[: y.shape[0]].double())
    return y.detach(), d_a[: y.shape[0]], *grads


@pytest.mark.parametrize("fused_layout", [False, True])
def test_against_per_expert_autograd(fused_layout):
    g = torch.Generator().manual_seed(0)
    rows = sum(SIZES) + 4  # 4 rows past the last group
    recv = torch.randn(rows, H, generator=g)
    recv[3] = 0.0  # a padding row inside expert 0 (zeros, as the backward passes them)
    recv[-4:] = float("nan")  # past the last group: unspecified, never read into a gradient
    dy = torch.randn(rows, H, generator=g)
    dy[3] = 0.0
    dy[-4:] = 0.0
    if fused_layout:
        gate_up = torch.randn(L, 2 * INTER, H, generator=g) / 4
        wg, wu = gate_up[:, :INTER], gate_up[:, INTER:]
    else:
        wg, wu = (
            torch.randn(L, INTER, H, generator=g) / 4,
            torch.randn(L, INTER, H, generator=g) / 4,
        )
    wd = torch.randn(L, H, INTER, generator=g) / 3
    offs = torch.tensor(SIZES, dtype=torch.int32).cumsum(0).to(torch.int32)
    y, d_recv, d_wg, d_wu, d_wd = expert_backward(recv, wg, wu, wd, offs, dy)
    want = _oracle(recv, wg, wu, wd, SIZES, dy)
    n = sum(SIZES)
    for got, ref in zip((y[:n], d_recv[:n], d_wg, d_wu, d_wd), want, strict=True):
        assert torch.isfinite(got).all()
        torch.testing.assert_close(got.double(), ref, rtol=1e-5, atol=1e-5)
    if fused_layout:  # gradients of the two halves are views of one [L, 2I, H] gradient
        assert d_wu.data_ptr() == d_wg.data_ptr() + INTER * H * 4
