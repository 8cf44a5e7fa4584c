"""The fused layer forward: dispatch, routed and shared SwiGLU experts and combine as one
persistent kernel (Hopper); see :mod:`mok.functional` for the errors.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from mok import _ext, ops
from mok.checks import check_tensor
from mok.errors import MoKInputError, MoKUnsupportedError
from mok.experts import _halves_of_one
from mok.spec.arch import arch_paths, refusal
from mok.spec.limits import why_unsupported
from mok.workspace import Workspace

if TYPE_CHECKING:
    from reference.weights import MoEWeights
from mok.schedule import DeviceSchedule, received_rows_bound

__all__ = ["forward"]


def _check_fused(ws: Workspace, weights: MoEWeights, x: torch.Tensor, num_tokens: int) -> None:
    """Raise a clear error for everything the fused layer does not support (yet)."""
    paths = arch_paths(torch.cuda.get_device_capability(ws.device))
    if not paths.fused_forward:
        raise MoKUnsupportedError(
            refusal(paths, "the fused layer", "Use moe_forward(..., fused=False).")
            + f" ({torch.cuda.get_device_name(ws.device)}, {_ext._versions()})"
        )
    cfg, s = ws.config, ws.shapes
    L, H = ws.num_local_experts, s.hidden
    inter = weights.w_gate.shape[1]
    shared_inter = 0 if weights.shared_w_gate is None else weights.shared_w_gate.shape[0]
    dtype = {torch.bfloat16: "bf16", torch.float32: "fp32"}.get(s.dtype, str(s.dtype))
    why = why_unsupported(cfg, H, inter, shared_inter, dtype, ws.num_sms, L)
    if why:
        raise MoKUnsupportedError("; ".join(why))
    want = {
        "w_gate": (L, inter, H),
        "w_up": (L, inter, H),
        "w_down": (L, H, inter),
    }
    if shared_inter:
        want |= {
            "shared_w_gate": (shared_inter, H),
            "shared_w_up": (shared_inter, H),
            "shared_w_down": (H, shared_inter),
        }
    halves = _halves_of_one(weights.w_gate, weights.w_up) is not None
    for name, shape in want.items():
        t = getattr(weights, name)
        check_tensor(f"weights.{name}", t, shape, (torch.bfloat16,), ws.device)
        dense = t.is_contiguous() or (halves and name in ("w_gate", "w_up"))
        if not dense or t.data_ptr() % 16:
            raise MoKInputError(
                f"weights.{name} must be contiguous and 16-byte aligned (w_gate / w_up may also "
                "be the two halves of one contiguous [L, 2I, H] tensor)"
            )
    check_tensor("x", x, (num_tokens, H), (torch.bfloat16,), ws.device)
    if not x.is_contiguous() or x.data_ptr() % 16:
        raise MoKInputError("x must be contiguous and 16-byte aligned")


def forward(
    x: torch.Tensor,
    schedule: DeviceSchedule,
    weights: MoEWeights,
    trace: torch.Tensor | None = None,
    keep: tuple[torch.Tensor | None, torch.Tensor | None] | None = None,
) -> torch.Tensor:
    """The fused MoE layer forward on this rank (one kernel launch; Hopper).

    Computes ``bf16(shared(x) + sum_k w_k expert_k(x))`` with the sum in fixed order (fp32), so
    the result is bitwise reproducible. Collective: every rank of the group runs it for the same
    schedule.

    Args:
        x: [num_tokens, hidden] bf16, contiguous and 16-byte aligned, this rank's tokens
            (``num_tokens == schedule.num_tokens``).
        schedule: :func:`build_schedule` of this call's routing (its workspace carries the
            config: communication SMs, minibatch, ring size = macrobatch, dispatch mode pull /
            dedup_pull).
        weights: this rank's experts (:class:`reference.weights.MoEWeights` layout), all bf16,
            contiguous, 16-byte aligned, on the workspace's device: routed w_gate / w_up
            [L, I, H] (or the two halves of one contiguous [L, 2I, H] tensor, as
            :class:`mok.MoE` holds them) and w_down [L, H, I] (``L = ws.num_local_experts``),
            optional shared_w_gate / shared_w_up [Is, H] and shared_w_down [H, Is]. H must be a
            multiple of 256, I and Is multiples of 128.
        trace: a buffer from :func:`mok.layer_trace.new_trace` that the kernel fills with
            per-tile timestamps, or None.
        keep: the saving mode (the backward from kept activations, ``recompute=False``): a
            pair of contiguous fp32 buffers that the kernel fills with the gate / up GEMMs'
            fp32 outputs, g in columns [0, I) and u in [I, 2I): the routed experts'
            [rows, 2I], row r being receive row r of the schedule (at least
            :func:`mok.schedule.received_rows_bound` rows, what a call can fill; padding rows
            get whatever their tile computed, rows past ``num_rows`` stay untouched), and the
            shared expert's [num_tokens, 2Is] (None: not kept). The output is the same bits
            with or without it.

    Returns:
        [num_tokens, hidden] bf16, a new tensor.

    Raises:
        MoKUnsupportedError: a GPU other than Hopper (sm_90); a workspace dtype other than
            bf16; a config the fused layer does not run (dispatch_mode other than pull /
            dedup_pull, combine_mode other than push, row_tile other than 64 / 128,
            minibatch_size not a multiple of 128, num_comm_sms not in [1, SMs)); hidden or
            intermediate sizes off the tiles above; a call inside a CUDA graph capture.
        MoKInputError: x or a weight of the wrong shape, dtype or device, not contiguous or not
            16-byte aligned; a ``keep`` buffer of the wrong shape, dtype or device, not
            contiguous or of too few rows, or a shared one without a shared expert.
        MoKInputError, MoKCapacityError, MoKTimeoutError: errors the kernel records (bad
            routing, capacity, timeouts) are raised by the next mok call or
            :meth:`Workspace.check` / :func:`mok.check`; this call raises those of earlier ones.
    """
    ws = schedule.ws
    _check_fused(ws, weights, x, schedule.num_tokens)
    out = torch.empty_like(x)
    gu32, shared_gu32 = (None, None) if keep is None else keep
    _check_keep(ws, weights, gu32, shared_gu32, num_tokens=schedule.num_tokens)
    ops.layer_forward(
        x,
        ws.sched,
        schedule.topk_weights,
        weights.w_gate,
        weights.w_up,
        weights.w_down,
        weights.shared_w_gate,
        weights.shared_w_up,
        weights.shared_w_down,
        out,
        gu32,
        shared_gu32,
        ws.id,
        trace,
    )
    return out


def _check_keep(ws: Workspace, weights: MoEWeights, gu32, shared_gu32, num_tokens: int) -> None:
    """MoKInputError for saving-mode buffers the kernel cannot fill: it writes every receive
    row it computes, so the routed one must hold as many as a call can fill
    (:func:`mok.schedule.received_rows_bound`)."""
    inter = weights.w_gate.shape[1]
    if gu32 is not None:
        rows, need = (gu32.shape[0] if gu32.ndim == 2 else -1), received_rows_bound(ws, num_tokens)
        check_tensor("keep[0]", gu32, (rows, 2 * inter), (torch.float32,), ws.device)
        if not gu32.is_contiguous() or rows < need:
            raise MoKInputError(
                f"keep[0] must be a contiguous fp32 [rows, {2 * inter}] buffer of at least "
                f"{need} rows (found {rows})"
            )
    if shared_gu32 is not None:
        if weights.shared_w_gate is None:
            raise MoKInputError("keep[1] is given but the layer has no shared expert")
        shape = (num_tokens, 2 * weights.shared_w_gate.shape[0])
        check_tensor("keep[1]", shared_gu32, shape, (torch.float32,), ws.device)
        if not shared_gu32.is_contiguous():
            raise MoKInputError("keep[1] must be contiguous")
