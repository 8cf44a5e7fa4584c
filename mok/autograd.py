"""The MoE layer under autograd: :func:`moe` is :func:`mok.functional.moe_forward` that
``loss.backward()`` differentiates (gradients for x, the routing weights and every weight).

Forward: :func:`mok.functional.moe_forward` as it is (fused or not); nothing but the inputs is
saved. Backward (:class:`_MoE`), through mok's communication kernels and torch grouped GEMMs,
recomputing the forward activations:

* the schedule is built again from the saved routing, with unit weights (the workspace's table
  may belong to a later call by then; the build is deterministic, so the rows are the forward's);
* reverse combine: ``dispatch(grad_out)`` brings each token's output gradient to its receive
  rows (rows that hold no token are zero);
* the experts (:func:`mok.experts.swiglu_backward`): x dispatched again, gate / up recomputed
  by one fp32-output grouped GEMM, SwiGLU, the down projection's dgrad in fp32 with the routing
  weight applied after it, the router-weight gradient ``<h, dY @ W_down>``, the gate / up dgrad
  and the weight gradients per expert group (``torch._grouped_mm`` over the token axis, one
  fp32 accumulation each, no atomics);
* reverse dispatch: the combine kernel with unit weights sums each token's k row gradients in
  fixed k order onto the shared expert's fp32 input gradient (rounded to bf16 once).

So far at one rank (the workspace's group of size 1); the router-weight gradient at more ranks
needs the expert outputs of the token's owners, which this path does not move yet.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import torch

from mok.comm import combine, dispatch
from mok.errors import MoKUnsupportedError
from mok.experts import gate_up_weight, swiglu_backward
from mok.layer import _received_rows_bound, as_config, moe_forward, unfused_config
from mok.schedule import build_schedule
from mok.workspace import get_workspace

if TYPE_CHECKING:
    from mok.spec.config import MoKConfig
    from reference.weights import MoEWeights

__all__ = ["moe"]

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
    if num_tokens == 0:  # no rows: zero weight gradients, empty input gradients
        zeros = [None if t is None else torch.zeros_like(t) for t in (*routed, *shared)]
        return (torch.zeros_like(x), torch.zeros_like(topk_weights), *zeros)
    # NOTE: one schedule, of unit weights: the reverse dispatch's combine must sum the row
    # gradients unweighted (the dedup combine reads the weights the schedule was built with);
    # dispatches only move rows, and the routing, hence every row index, is the forward's.
    sched = build_schedule(topk_idx, torch.ones_like(topk_weights), ws)
    rows = _received_rows_bound(ws, num_tokens)
    src_index = sched.src_index[:rows].long()
    valid = (sched.src_rank[:rows] >= 0) & (
        torch.arange(rows, device=x.device) < sched.num_rows.to(torch.int64)
    )
    row_w = torch.where(valid, topk_weights.reshape(-1).float()[src_index.clamp(min=0)], 0.0)
    # reverse combine: each receive row gets its token's output gradient (a copy; the routing
    # weight is applied inside the experts' backward, after the down projection's dgrad)
    g_out = grad_out.to(torch.bfloat16).contiguous()
    dy = torch.where(valid[:, None], dispatch(g_out, sched)[:rows], 0)
    # the experts, recomputed from x dispatched again; rows that hold no token are zero
    recv = torch.where(valid[:, None], dispatch(x, sched)[:rows], 0)
    inter = wd.shape[-1]
    d_recv, d_row_w, d_wgu, d_wd = swiglu_backward(
        recv, gate_up_weight(wg, wu), wd, dy, row_w, sched.group_ends.clone()
    )
    # router weights: each (token, k) has its own receive row at one rank
    d_topk = d_row_w[sched.dst_index.long()].to(topk_weights.dtype)
    # the shared expert, its input gradient kept fp32 for the reverse dispatch's sum
    dx_shared, d_shared = None, (None, None, None)
    if shared[0] is not None:
        swg, swu, swd = shared
        dx_shared, _, d_swgu, d_swd = swiglu_backward(
            x, gate_up_weight(swg, swu), swd, g_out, d_a_dtype=torch.float32
        )
        si = swd.shape[-1]
        d_shared = (d_swgu[:si], d_swgu[si:], d_swd)
    # reverse dispatch: dx = dx_shared + sum_k dRecv[t, k], fixed k order, fp32, bf16 once
    full = torch.empty(ws.capacity, hidden, dtype=torch.bfloat16, device=x.device)
    full[:rows] = torch.where(valid[:, None], d_recv, 0)
    dx = combine(full, sched, shared_y=dx_shared)
    return (dx.to(x.dtype), d_topk, d_wgu[:, :inter], d_wgu[:, inter:], d_wd, *d_shared)
