"""The MoE layer under autograd: :func:`moe` is :func:`mok.functional.moe_forward` that
``loss.backward()`` differentiates (gradients for x, the routing weights and every weight).

Forward: :func:`mok.functional.moe_forward` as it is (fused or not); nothing but the inputs is
saved. Backward (:class:`_MoE`), through mok's communication kernels and torch grouped GEMMs,
recomputing the forward activations:

* the schedule is built again from the saved routing (the workspace's table may belong to a
  later call by then; the build is deterministic, so it is the forward's);
* reverse combine: ``dispatch(grad_out)`` brings each token's output gradient to its receive
  rows, scaled there by the row's routing weight (rows that hold no token are zero);
* the experts: x dispatched again, gate, up, SwiGLU and down recomputed with
  ``torch._grouped_mm`` and differentiated by torch (dgrad and wgrad per expert group); the
  router-weight gradient is ``<grad_out[t], y[t, k]>`` of the recomputed expert outputs;
* reverse dispatch: the combine kernel with unit weights sums each token's k row gradients in
  fixed k order onto the shared expert's input gradient (fp32, rounded to bf16 once).

So far at one rank (the workspace's group of size 1); the router-weight gradient at more ranks
needs the expert outputs of the token's owners, which this path does not move yet.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from mok.comm import combine, dispatch
from mok.errors import MoKUnsupportedError
from mok.experts import _halves_of_one
from mok.layer import _received_rows_bound, as_config, moe_forward, unfused_config
from mok.schedule import build_schedule
from mok.workspace import get_workspace

if TYPE_CHECKING:
    from mok.spec.config import MoKConfig
    from reference.weights import MoEWeights

__all__ = ["moe", "expert_backward"]

_ROUTED = ("w_gate", "w_up", "w_down")
_SHARED = ("shared_w_gate", "shared_w_up", "shared_w_down")


def moe(
    x: torch.Tensor,
    topk_idx: torch.Tensor,
    topk_weights: torch.Tensor,
    weights: MoEWeights,
    num_experts: int,
    config: MoKConfig | dict | str | Path | None = None,
    group=None,
    fused: bool = False,
) -> torch.Tensor:
    """:func:`mok.functional.moe_forward` (same arguments, same result), differentiable: when
    autograd records (grad mode on and x, topk_weights or a weight requires grad), the backward
    gives gradients for x (bf16), topk_weights (its dtype) and every weight tensor of
    ``weights`` (their dtype). The backward runs at one rank (MoKUnsupportedError at more).
    """
    shared = [getattr(weights, n, None) for n in _SHARED]
    tensors = [x, topk_weights, *(getattr(weights, n) for n in _ROUTED), *shared]
    if not (torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)):
        return moe_forward(x, topk_idx, topk_weights, weights, num_experts, config, group, fused)
    return _MoE.apply(topk_idx, weights, num_experts, config, group, fused, *tensors)


class _MoE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, topk_idx, weights, num_experts, config, group, fused, *tensors):
        out = moe_forward(
            tensors[0], topk_idx, tensors[1], weights, num_experts, config, group, fused
        )
        ctx.save_for_backward(topk_idx, *tensors)
        ctx.args = (num_experts, config, group)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        topk_idx, x, topk_weights, wg, wu, wd, swg, swu, swd = ctx.saved_tensors
        grads = _backward(
            grad_out, x, topk_idx, topk_weights, (wg, wu, wd), (swg, swu, swd), *ctx.args
        )
        return (None,) * 6 + grads


def expert_backward(recv, wg, wu, wd, offs, dy):
    """The routed experts recomputed and differentiated: ``recv`` [R, H] rows grouped by expert
    (``offs``: [L] group ends), weights w_gate / w_up [L, I, H], w_down [L, H, I], ``dy`` [R, H]
    the gradient of the expert outputs. Returns (y, d_recv, d_w_gate, d_w_up, d_w_down); rows
    past ``offs[-1]`` of y and d_recv are unspecified. Gate and up run as one GEMM where they are
    the halves of one [L, 2I, H] tensor (mok.MoE's layout; their gradients are then views of
    one [L, 2I, H] gradient), else one each."""
    inter = wg.shape[1]
    base = _halves_of_one(wg, wu)
    gate_up = (wg, wu) if base is None else (base,)
    leaves = [t.detach().requires_grad_() for t in (recv, *gate_up, wd)]
    with torch.enable_grad():
        a, ld = leaves[0], leaves[-1]
        if base is None:
            g = torch._grouped_mm(a, leaves[1].transpose(1, 2), offs=offs)
            u = torch._grouped_mm(a, leaves[2].transpose(1, 2), offs=offs)
        else:
            gu = torch._grouped_mm(a, leaves[1].transpose(1, 2), offs=offs)
            g, u = gu[:, :inter], gu[:, inter:]
        h = (F.silu(g.float()) * u.float()).to(a.dtype)
        y = torch._grouped_mm(h, ld.transpose(1, 2), offs=offs)
        d_recv, *d_gate_up, d_wd = torch.autograd.grad(y, leaves, dy)
    if base is None:
        d_wg, d_wu = d_gate_up
    else:
        d_wg, d_wu = d_gate_up[0][:, :inter], d_gate_up[0][:, inter:]
    return y.detach(), d_recv, d_wg, d_wu, d_wd


def _backward(grad_out, x, topk_idx, topk_weights, routed, shared, num_experts, config, group):
    wg, wu, wd = routed
    num_tokens, hidden = x.shape
    cfg = unfused_config(
        as_config(config), torch.cuda.get_device_properties(x.device).multi_processor_count
    )
    ws = get_workspace(
        num_tokens, hidden, topk_idx.shape[1], num_experts, x.dtype, cfg, group, x.device
    )
    if ws.num_ranks > 1:
        raise MoKUnsupportedError(
            f"mok's backward runs at one rank so far (this group has {ws.num_ranks}); the "
            "reference layer (reference.ep) differentiates the expert-parallel layer"
        )
    sched = build_schedule(topk_idx, topk_weights, ws)
    rows = _received_rows_bound(ws, num_tokens)
    src_index = sched.src_index[:rows].long()
    valid = (sched.src_rank[:rows] >= 0) & (
        torch.arange(rows, device=x.device) < sched.num_rows.to(torch.int64)
    )
    at = src_index.clamp(min=0)
    # reverse combine: dY of each receive row = its routing weight x the token's output grad
    g_out = grad_out.to(torch.bfloat16).contiguous()
    row_w = torch.where(valid, topk_weights.reshape(-1).float()[at], 0.0)
    dy = dispatch(g_out, sched)[:rows].float() * row_w[:, None]
    dy = torch.where(valid[:, None], dy, 0.0).to(torch.bfloat16)
    # the experts, recomputed from x dispatched again, differentiated by torch
    recv = torch.where(valid[:, None], dispatch(x, sched)[:rows], 0)
    offs = sched.group_ends.clone()
    y, d_recv, d_wg, d_wu, d_wd = expert_backward(recv, wg, wu, wd, offs, dy)
    # router weights: <dY_out[t], y[t, k]> of the token's receive row (one rank: all local)
    dst = sched.dst_index.long()
    d_topk = (g_out.float()[:, None, :] * y[dst].float()).sum(-1)
    d_topk = d_topk.to(topk_weights.dtype)
    # the shared expert
    dx_shared, d_shared = None, (None, None, None)
    if shared[0] is not None:
        sl = [t.detach().requires_grad_() for t in (x, *shared)]
        with torch.enable_grad():
            xs, sg, su, sd = sl
            hs = (F.silu((xs @ sg.T).float()) * (xs @ su.T).float()).to(torch.bfloat16)
            ys = hs @ sd.T
            dx_shared, *d_shared = torch.autograd.grad(ys, sl, g_out)
    # reverse dispatch: dx = dx_shared + sum_k dRecv[t, k], fixed k order, fp32, bf16 once
    full = torch.empty(ws.capacity, hidden, dtype=torch.bfloat16, device=x.device)
    full[:rows] = torch.where(valid[:, None], d_recv, 0)
    # NOTE: a schedule of unit weights (the dedup combine reads the routing weights the schedule
    # was built with, not only the ones passed to the combine); the routing is the same
    ones = build_schedule(topk_idx, torch.ones_like(topk_weights), ws)
    dx = combine(full, ones, shared_y=None if dx_shared is None else dx_shared.float())
    return (dx.to(x.dtype), d_topk, d_wg, d_wu, d_wd, *d_shared)
