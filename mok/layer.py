"""The MoE layer's forward composed from mok's stages (:func:`moe_forward`) and the config
helpers it runs under (:func:`as_config`, :func:`unfused_config`). Its public namespace is
:mod:`mok.functional`, which documents the calls' asynchrony and errors."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from mok.comm import combine, dispatch
from mok.errors import MoKInputError
from mok.experts import (
    dense_swiglu,
    dense_swiglu_saving,
    gate_up_weight,
    grouped_swiglu,
    grouped_swiglu_saving,
    grouped_swiglu_saving_gathered,
    saving_shapes_fit,
    shared_kept,
)
from mok.fused import forward
from mok.path_choice import (
    AUTO,
    check_fused_arg,
    choice_key,
    file_key,
    fused_refusals,
    measured_choice,
)
from mok.path_choice import resolve_fused as _resolve
from mok.reference_layer import check_reference_inputs, reference_layer
from mok.schedule import build_schedule, received_rows_bound
from mok.sms import budget_sms, sm_budget
from mok.spec.arch import arch_paths
from mok.spec.config import MAX_COMM_SMS, MoKConfig
from mok.workspace import get_workspace

if TYPE_CHECKING:
    from reference.weights import MoEWeights

__all__ = ["UNFUSED_ROW_TILE", "as_config", "moe_forward", "resolve_path", "unfused_config"]


def as_config(config: MoKConfig | dict | str | Path | None) -> MoKConfig:
    """A :class:`MoKConfig` from itself, a dict, a JSON string or a JSON file path.

    Args:
        config: a :class:`MoKConfig` (returned as it is); a dict, a JSON string or the path of a
            JSON file in the ``{"format": "mok-config/1", "config": {...}}`` form of
            :meth:`MoKConfig.to_dict` (the file ``mok-sim tune --emit-config`` writes); or None
            for the defaults.

    Returns:
        The :class:`MoKConfig` (frozen).

    Raises:
        MoKConfigError: a malformed source: empty, of another type, a missing file or a
            directory, text that is not a JSON object, unknown keys, or fields of the wrong type
            or out of range.
    """
    if config is None:
        return MoKConfig()
    if isinstance(config, MoKConfig):
        return config
    return MoKConfig.from_json(config)


# Expert regions of the unfused path are padded to this many rows: its grouped GEMMs compute
# the padding rows too, and 16 keeps them to a few percent (128, the fused layer's tile, adds
# ~25 % at 256 rows per expert).
UNFUSED_ROW_TILE = 16


def unfused_config(config: MoKConfig, num_sms: int) -> MoKConfig:
    """The config :func:`moe_forward` runs its unfused path with: ``config`` with every SM of its
    budget given to the communication kernels (nothing runs beside them in this path;
    ``num_comm_sms`` sizes the fused layer's split) and expert regions padded to
    :data:`UNFUSED_ROW_TILE` rows when ``config.row_tile`` is larger.

    Args:
        config: the caller's config (the same on every rank).
        num_sms: the SMs of the call's budget (:func:`mok.sms.budget_sms`: the device's count
            or the config's ``num_sms``).

    Returns:
        A :class:`MoKConfig` (``config`` itself when nothing changes).
    """
    sms = min(int(num_sms), MAX_COMM_SMS)
    row_tile = unfused_row_tile(config)
    if (config.num_comm_sms, config.row_tile) == (sms, row_tile):
        return config
    return dataclasses.replace(config, num_comm_sms=sms, row_tile=row_tile)


def unfused_row_tile(config: MoKConfig) -> int:
    """The row tile :func:`unfused_config` pads expert regions to."""
    return min(config.row_tile, UNFUSED_ROW_TILE)


def moe_forward(
    x: torch.Tensor,  # [num_tokens, hidden] bf16
    topk_idx: torch.Tensor,  # [num_tokens, num_topk] int
    topk_weights: torch.Tensor,  # [num_tokens, num_topk] float
    weights: MoEWeights,  # w_gate/w_up [L, I, H], w_down [L, H, I] bf16; optional shared_w_*
    num_experts: int,
    config: MoKConfig | dict | str | Path | None = None,
    group=None,
    fused: bool | str = False,
    *,
    _saved: list | None = None,
    _schedule: list | None = None,
) -> torch.Tensor:
    """The MoE layer on this rank: schedule, dispatch, grouped SwiGLU experts, combine. Off CUDA
    it is the reference layer (:mod:`mok.reference_layer`: any float dtype, ``fused`` and
    ``config`` ignored), on one device or expert-parallel over ``group``.

    Collective over ``group``. The workspace of this shape and config is created (collectively)
    on first use and cached (:func:`mok.get_workspace`).

    Args:
        x: [num_tokens, hidden] bf16, this rank's tokens (0..max_tokens of them; ranks may
            differ).
        topk_idx: [num_tokens, num_topk] int32 or int64, global expert ids in
            ``[0, num_experts)``, distinct within a token.
        topk_weights: [num_tokens, num_topk] float, the routing weights.
        weights: this rank's experts (:class:`reference.weights.MoEWeights`), bf16 on x's
            device: w_gate / w_up [L, I, H] and w_down [L, H, I] with
            ``L = num_experts / num_ranks``; optional shared_w_gate / shared_w_up [Is, H] and
            shared_w_down [H, Is].
        num_experts: the global expert count, divisible by the number of ranks.
        config: see :func:`as_config`; the same on every rank.
        group: the process group of the expert-parallel ranks; None: the default group (one
            rank without torch.distributed).
        fused: run :func:`forward` (one kernel; Hopper); False: the communication kernels with
            the routed experts' gate / up and SwiGLU in mok's kernel where the GPU has it
            (Hopper; at one rank it reads the rows from x: no dispatch, :func:`gathers_rows`)
            or ``torch._grouped_mm`` elsewhere, and the down projection by
            ``torch._grouped_mm`` (:mod:`mok.experts`), under :func:`unfused_config`;
            ``"auto"``: the faster of the two, timed at the first call of this layer's shapes
            and config (:mod:`mok.path_choice`: opt-in, as the two paths' bits differ).

    Returns:
        [num_tokens, hidden] bf16 = shared(x) + sum_k w_k expert_k(x), a new tensor.

    Raises:
        MoKInputError: x, topk_idx, topk_weights or the routed weights of the wrong shape,
            dtype or device; num_experts not divisible by the number of ranks; shapes or config
            that differ between ranks when the workspace is created; too many cached
            workspaces.
        MoKConfigError: a malformed config.
        MoKUnsupportedError: ``fused=True`` with a GPU, config or shapes the fused layer does
            not run (see :func:`forward`); more ranks than mok supports; a call inside a CUDA
            graph capture.
        MoKCapacityError: more tokens than the workspace's max_tokens (here, and on the other
            ranks at their next mok call); a receive buffer too small for the routing (found on
            the device, raised by the next mok call or :func:`mok.check`).
        MoKInputError, MoKCapacityError, MoKTimeoutError: an error a kernel recorded on the
            device (see the module docstring), raised by this call when an earlier one
            recorded it.
    """
    config = as_config(config)
    check_fused_arg(fused)
    if not x.is_cuda:  # the reference layer (one device, or reference.ep over the group)
        check_reference_inputs(x, topk_idx, topk_weights, weights, num_experts)
        return reference_layer(x, topk_idx, topk_weights, weights, num_experts, group)
    if fused == AUTO:
        fused = resolve_path(
            fused,
            x,
            topk_idx,
            topk_weights,
            weights,
            num_experts,
            config,
            group,
            _saved is not None,
        )
    with sm_budget(config.num_sms):
        return _moe_forward(x, topk_idx, topk_weights, weights, num_experts, config, group, fused,
                            _saved, _schedule)  # fmt: skip


def resolve_path(
    fused: bool | str,
    x: torch.Tensor,
    topk_idx: torch.Tensor,
    topk_weights: torch.Tensor,
    weights: MoEWeights,
    num_experts: int,
    config: MoKConfig,
    group,
    saving: bool,
    tracing: bool = False,
) -> bool:
    """``fused`` as a bool on CUDA: itself, or for ``"auto"`` the faster forward of this layer,
    measured at its first call on these inputs (collective over ``group``) and kept
    (:mod:`mok.path_choice`). ``saving``: the forward keeps g / u (recompute=False), and is
    timed so. ``tracing``: under torch.compile (nothing is timed)."""
    if fused != AUTO:
        check_fused_arg(fused)
        return bool(fused)
    n, hidden = x.shape
    num_local, inter = weights.w_gate.shape[0], weights.w_gate.shape[1]
    key = choice_key(x, weights, num_experts, topk_idx.shape[1], config, group, not saving)

    def measure():
        sms = budget_sms(x.device, config.num_sms)
        refusals = fused_refusals(x, weights, config, num_local, sms)
        text = (
            f"hidden {hidden}, intermediate {inter}, top-{topk_idx.shape[1]} of {num_experts} "
            f"experts ({num_local} on this rank), {n} tokens on this rank"
            + (", keeping g / u" if saving else "")
        )

        def run(f: bool):
            keep = [] if saving else None
            return moe_forward(x, topk_idx, topk_weights, weights, num_experts, config, group, f,
                               _saved=keep)  # fmt: skip

        return measured_choice(run, refusals, group, text)

    name = None if tracing else file_key(key, torch.cuda.get_device_name(x.device))
    return _resolve(fused, key, measure, tracing, name, group)


def _moe_forward(
    x, topk_idx, topk_weights, weights, num_experts, config, group, fused, _saved, _schedule=None
):
    """:func:`moe_forward` on CUDA, under its SM budget. ``_schedule`` (a list): the unfused
    path's :class:`mok.schedule.DeviceSchedule` is appended (:mod:`mok.autograd` keeps its
    tables for the backward); the fused layer's is not (its workspace and row tile are not the
    backward's)."""
    if not fused:
        config = unfused_config(config, budget_sms(x.device, config.num_sms))
    if x.ndim != 2 or x.dtype != torch.bfloat16:
        raise MoKInputError(
            f"x must be [num_tokens, hidden] bf16 (found {tuple(x.shape)} {x.dtype})"
        )
    if topk_idx.ndim != 2 or topk_idx.shape[0] != x.shape[0]:
        raise MoKInputError(
            f"topk_idx must be [num_tokens={x.shape[0]}, num_topk] (found {tuple(topk_idx.shape)})"
        )
    wg, wu, wd = weights.w_gate, weights.w_up, weights.w_down
    for name, t in (("w_gate", wg), ("w_up", wu), ("w_down", wd)):
        if t.dtype != torch.bfloat16 or t.device != x.device:
            raise MoKInputError(
                f"weights.{name} must be bf16 on {x.device} (found {t.dtype} on {t.device})"
            )
    if wg.shape[2] != x.shape[1]:
        raise MoKInputError(f"x has hidden={x.shape[1]} but w_gate has hidden={wg.shape[2]}")
    ws = get_workspace(
        x.shape[0],
        x.shape[1],
        topk_idx.shape[1],
        num_experts,
        x.dtype,
        config,
        group,
        x.device,
        fused=fused,
    )
    if wg.shape[0] != ws.num_local_experts:
        raise MoKInputError(
            f"rank {ws.rank} holds {wg.shape[0]} experts, expected num_experts / num_ranks = "
            f"{ws.num_local_experts}"
        )
    sched = build_schedule(topk_idx, topk_weights, ws)
    if fused:
        return forward(x, sched, weights, keep=_fused_keep(x, weights, ws, _saved))
    if _schedule is not None:
        _schedule.append(sched)
    rows = received_rows_bound(ws, x.shape[0])
    # NOTE: checked on the device (no synchronisation): SwiGLU leaves rows past the bound
    # unwritten, so a wrong bound must stop the call rather than feed garbage to the combine.
    torch._assert_async(sched.group_ends[-1] <= rows, "mok: receive rows past the host bound")
    keep = _saved is not None
    kernel = kernel_forward_fits(x, weights)
    if kernel and gathers_rows(ws, x):
        # one rank: the experts' kernel reads each receive row from x itself (no dispatch);
        # its outputs have the receive buffer's rows, as the combine takes them
        y, gu32 = grouped_swiglu_saving_gathered(
            x,
            sched.src_index,
            topk_idx.shape[1],
            gate_up_weight(wg, wu),
            wd,
            sched.group_ends,
            ws.capacity,
            keep=keep,
        )
    else:
        recv = dispatch(x, sched)
        if keep or kernel:
            # mok's kernel for gate / up and SwiGLU (with recompute=False, mok.autograd, it
            # keeps the fp32 gate / up for the backward), torch's grouped GEMM for down
            y, gu32 = grouped_swiglu_saving(
                recv, gate_up_weight(wg, wu), wd, sched.group_ends, keep=keep
            )
        else:
            y = grouped_swiglu(recv, wg, wu, wd, sched.group_ends, exact=False, rows=rows)
    if keep:
        _saved.append(gu32)
    return combine(y, sched, shared_y=_shared_expert(x, weights, _saved))


# Whether the unfused forward at one rank reads its receive rows from x inside the experts'
# kernel (gathers_rows) instead of dispatching them into the receive buffer first.
GATHER_AT_ONE_RANK = True


def kernel_forward_fits(x: torch.Tensor, weights: MoEWeights) -> bool:
    """Whether the unfused forward runs the routed experts' gate / up and SwiGLU in mok's
    kernel (:func:`mok.experts.grouped_swiglu_saving`, g / u not kept unless the backward
    wants them) rather than torch's grouped GEMMs: on a GPU that has the experts' kernels,
    where the kernel takes the shapes."""
    return arch_paths(torch.cuda.get_device_capability(x.device)).expert_kernels and (
        saving_shapes_fit(x, weights.w_down, weights.w_gate, weights.w_up)
    )


def gathers_rows(ws, x: torch.Tensor) -> bool:
    """Whether :func:`moe_forward`'s unfused forward, where the experts' kernel runs it
    (:func:`kernel_forward_fits`), takes its receive rows straight from ``x``
    (:func:`mok.experts.grouped_swiglu_saving_gathered`): at one rank (every row is a row of
    x), with :data:`GATHER_AT_ONE_RANK`, where x has rows (the kernel's gather source must not
    be empty). The same bits as the kernel on the dispatched rows."""
    return GATHER_AT_ONE_RANK and ws.num_ranks == 1 and x.shape[0] > 0 and x.is_contiguous()


def _shared_expert(x: torch.Tensor, weights: MoEWeights, saved: list | None):
    """The shared expert's output (None without one). ``saved`` (a list: recompute=False, on a
    GPU the routed experts' saving kernel runs on): its fp32 gate / up outputs are appended
    (None where it has no shared expert or the saving kernel does not take its weights,
    :func:`mok.experts.shared_kept`); the output is then the kernel's h times w_down, as
    for the routed experts."""
    sg, su, sd = _shared_weights(weights)
    if saved is None or not shared_kept(x, sg, su, sd):
        if saved is not None:
            saved.append(None)
        return None if sg is None else dense_swiglu(x, sg, su, sd, exact=False)
    y, gu32 = dense_swiglu_saving(x, gate_up_weight(sg, su), sd)
    saved.append(gu32)
    return y


def _fused_keep(x: torch.Tensor, weights: MoEWeights, ws, saved: list | None):
    """The fused kernel's saving-mode buffers (None without ``saved``, recompute=True), also
    appended to ``saved``: the routed experts' fp32 [rows, 2I] g / u by receive row and the
    shared expert's [num_tokens, 2Is] (None where it has none or the backward's kernel does not
    take its shapes, :func:`mok.experts.shared_kept`, as in the unfused path)."""
    if saved is None:
        return None
    rows, inter = received_rows_bound(ws, x.shape[0]), weights.w_gate.shape[1]
    gu32 = torch.empty(rows, 2 * inter, dtype=torch.float32, device=x.device)
    sg, su, sd = _shared_weights(weights)
    shared = None
    if shared_kept(x, sg, su, sd):
        shared = torch.empty(x.shape[0], 2 * sg.shape[0], dtype=torch.float32, device=x.device)
    saved.extend([gu32, shared])
    return gu32, shared


def _shared_weights(weights: MoEWeights) -> tuple:
    """(shared_w_gate, shared_w_up, shared_w_down) of ``weights``, each None without a shared
    expert."""
    return tuple(getattr(weights, f"shared_w_{n}", None) for n in ("gate", "up", "down"))
