"""torch.library custom ops over the CUDA kernels (with fake implementations, so torch.compile
can trace graphs that call them).

Each op mutates workspace buffers passed as arguments and returns nothing; ``handle`` names the
:class:`mok.workspace.Workspace` (``Workspace.id``). The ops never synchronise with the host:
they raise an error a previous kernel recorded (host-mapped memory), bump host-side epochs and
launch.
"""

from __future__ import annotations

import torch

from mok import _ext
from mok.workspace import workspace_by_id

__all__ = ["build_schedule", "dispatch", "combine"]

_DISPATCH_KERNELS = {
    "pull": "dispatch_pull",
    "dedup_pull": "dispatch_dedup_pull",
    "push": "dispatch_push",
}


@torch.library.custom_op("mok::build_schedule", mutates_args=("sched",))
def build_schedule(
    topk_idx: torch.Tensor,  # [num_tokens, num_topk] int32
    topk_weights: torch.Tensor,  # [num_tokens, num_topk] fp32
    sched: torch.Tensor,  # workspace schedule storage, int32
    handle: int,
) -> None:
    ws = workspace_by_id(handle)
    ws.raise_if_failed()
    ws.epochs["route"] += 1
    p = ws.params("route")
    p.in0, p.in1 = topk_idx.data_ptr(), topk_weights.data_ptr()
    ws.launch("schedule", p, ws.schedule_blocks())


@build_schedule.register_fake
def _(topk_idx, topk_weights, sched, handle) -> None:
    return None


@torch.library.custom_op("mok::dispatch", mutates_args=("recv",))
def dispatch(
    x: torch.Tensor,  # [num_tokens, hidden]
    sched: torch.Tensor,  # workspace schedule storage, int32
    recv: torch.Tensor,  # [capacity, hidden] workspace receive buffer
    handle: int,
    mode: str,
) -> None:
    ws = workspace_by_id(handle)
    ws.raise_if_failed()
    family = "recv" if mode == "push" else "x"
    ws.epochs[family] += 1
    p = ws.params(family)
    p.in0, p.out0 = x.data_ptr(), recv.data_ptr()
    if mode != "push" and x.data_ptr() != ws.x_buffer.data_ptr():
        p.flags |= _ext.FLAG_STAGE
    ws.launch(_DISPATCH_KERNELS[mode], p, ws.config.num_comm_sms)


@dispatch.register_fake
def _(x, sched, recv, handle, mode) -> None:
    return None


@torch.library.custom_op("mok::combine", mutates_args=("out",))
def combine(
    y: torch.Tensor,  # [capacity, hidden] bf16 expert outputs in schedule row order
    sched: torch.Tensor,  # workspace schedule storage, int32
    topk_idx: torch.Tensor,  # [num_tokens, num_topk] int32
    topk_weights: torch.Tensor,  # [num_tokens, num_topk] fp32
    shared_y: torch.Tensor | None,  # [num_tokens, hidden] bf16 or fp32
    out: torch.Tensor,  # [num_tokens, hidden] bf16
    handle: int,
    mode: str,
) -> None:
    ws = workspace_by_id(handle)
    ws.raise_if_failed()
    family = "y" if mode == "pull" else "slots"
    ws.epochs[family] += 1
    p = ws.params(family)
    p.in0, p.in1, p.in3, p.out0 = (
        y.data_ptr(),
        topk_weights.data_ptr(),
        topk_idx.data_ptr(),
        out.data_ptr(),
    )
    if shared_y is not None:
        p.in2 = shared_y.data_ptr()
        p.flags |= _ext.FLAG_HAS_SHARED
        if shared_y.dtype == torch.float32:
            p.flags |= _ext.FLAG_SHARED_FP32
    kernel = {"push": "combine_push", "dedup_push": "combine_dedup_push", "pull": "combine_pull"}
    if mode == "pull" and y.data_ptr() != ws.y_buffer.data_ptr():
        p.flags |= _ext.FLAG_STAGE
    ws.launch(kernel[mode], p, ws.config.num_comm_sms)


@combine.register_fake
def _(y, sched, topk_idx, topk_weights, shared_y, out, handle, mode) -> None:
    return None
