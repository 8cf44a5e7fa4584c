"""The standalone communication kernels: dispatch (pull / dedup pull / push), the dedup fan-out,
combine (push / pull / dedup push) and the two dedup pull combine steps.

Each takes a :class:`mok.schedule.DeviceSchedule`; see :mod:`mok.functional` for the errors.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from mok import ops
from mok.checks import check_tensor
from mok.errors import MoKInputError
from mok.spec.limits import TMA_MIN_ROW_BYTES
from mok.workspace import Workspace

if TYPE_CHECKING:
    pass
from mok.schedule import DeviceSchedule

__all__ = [
    "dispatch",
    "fanout",
    "combine",
    "dedup_partials",
    "dedup_sum",
    "stage_row_grads",
    "pull_row_grads",
]


def _check_engine(engine: str, engines: tuple[str, ...] = ops.ENGINES) -> None:
    if engine not in engines:
        raise MoKInputError(
            f"unknown copy engine {engine!r}; supported: auto, {', '.join(engines)}"
        )


def _engine(ws: Workspace, engine: str, engines: tuple[str, ...] = ops.ENGINES) -> str:
    """Resolve ``auto`` by row size; check anything else."""
    if engine == "auto":
        return "tma" if ws.row_bytes >= TMA_MIN_ROW_BYTES else "vector"
    _check_engine(engine, engines)
    return engine


def dispatch(
    x: torch.Tensor,
    schedule: DeviceSchedule,
    mode: str | None = None,
    fan_out: bool = True,
    engine: str = "auto",
    skip_local: bool = False,
    out: torch.Tensor | None = None,
    zero_padding: bool = False,
) -> torch.Tensor:
    """Move this rank's token rows to the expert owners.

    Collective: every rank of the group dispatches the same schedule. Writing x into
    ``ws.x_buffer`` first saves a copy: call ``ws.wait_x_free()`` before that write (peers may
    still be pulling the previous rows).

    Args:
        x: [num_tokens, hidden] in the workspace dtype, this rank's tokens
            (``num_tokens == schedule.num_tokens``); ``ws.x_buffer[:num_tokens]`` skips the
            staging copy of the pull modes.
        schedule: :func:`build_schedule` of this call's routing, on a workspace of the stage
            functions (``get_workspace(..., fused=False)``).
        mode: ``pull``, ``push`` or ``dedup_pull``; None: the config's ``dispatch_mode``.
        fan_out: False (``dedup_pull`` only) moves one row per (token, destination rank) only
            and returns the dedup buffer; :func:`fanout` then fills the receive buffer.
        engine: row copies of the pull modes: ``tma`` (bulk copies), ``vector`` (16-byte
            loads/stores, v1), or ``auto`` (``tma`` for rows of at least 8 KiB, else
            ``vector``).
        skip_local: (with ``fan_out=False``) move only the rows of other ranks' tokens: the rows
            of this rank's own tokens stay unspecified in the dedup buffer and are read from
            ``ws.x_buffer`` by ``fanout(..., skip_local=True)`` (the data is already local).
        out: a contiguous [capacity, hidden] tensor of the workspace dtype on its device to
            receive into instead of the workspace's receive buffer (``fan_out=True``, pull
            modes: the rows land locally); rows the dispatch does not write keep their values,
            so a zeroed ``out`` gives zero padding rows.
        zero_padding: (with ``out``) also write zeros into the padding rows (rows before
            ``num_rows`` that hold no token), so that an uninitialised ``out``
            (``torch.empty``) gets what a zeroed one would, without writing the whole buffer;
            rows past ``num_rows`` stay unspecified.

    Returns:
        The receive buffer [capacity, hidden] in the workspace dtype (a workspace view, valid
        until the next dispatch): rows ``offsets[l]..offsets[l] + tokens_per_expert[l]`` hold
        local expert l's tokens in schedule order; padding rows and rows past ``num_rows`` are
        unspecified. With ``fan_out=False``, the dedup buffer [ws.dedup_rows, hidden]
        instead (a workspace buffer, valid until the next dispatch; row i = dedup row i, see
        ``schedule.dedup_src_rank`` / ``dedup_src_token``; rows past ``num_dedup_rows``
        unspecified).

    Raises:
        MoKInputError: x of the wrong shape, dtype or device; an unknown mode or engine;
            ``fan_out=False`` without ``dedup_pull``; ``skip_local=True`` with ``fan_out=True``;
            a workspace of the fused layer only.
        MoKUnsupportedError: called inside a CUDA graph capture.
        MoKInputError, MoKCapacityError, MoKTimeoutError: an error a kernel recorded on the
            device (see the module docstring), raised by this call when an earlier one
            recorded it.
    """
    ws = schedule.ws
    ws._standalone("dispatch into a receive buffer of capacity rows")
    mode = mode or ws.config.dispatch_mode
    if mode not in ops._DISPATCH_KERNELS:
        raise MoKInputError(
            f"unknown dispatch mode {mode!r}; supported: {', '.join(ops._DISPATCH_KERNELS)}"
        )
    engine = _engine(ws, engine)
    if not fan_out and mode != "dedup_pull":
        raise MoKInputError("fan_out=False needs mode='dedup_pull'")
    if skip_local and fan_out:
        raise MoKInputError("skip_local=True needs mode='dedup_pull' and fan_out=False")
    n = schedule.num_tokens
    check_tensor("x", x, (n, ws.shapes.hidden), (ws.shapes.dtype,), ws.device)
    x = x.contiguous()
    if zero_padding and out is None:
        raise MoKInputError("zero_padding=True needs out= (a receive buffer of the caller's)")
    if out is None:
        out = ws.recv_buffer if fan_out else ws.dedup_buffer
    else:
        if not fan_out or mode == "push":
            raise MoKInputError("out= needs a pull mode with fan_out=True (rows land locally)")
        check_tensor("out", out, (ws.capacity, ws.shapes.hidden), (ws.shapes.dtype,), ws.device)
        if not out.is_contiguous():
            raise MoKInputError("out must be contiguous")
    ops.dispatch(x, ws.sched, out, ws.id, mode, fan_out, engine, skip_local)
    if zero_padding:
        ops.zero_padding(out, ws.sched, ws.id)
    return out


def fanout(
    dedup: torch.Tensor,
    schedule: DeviceSchedule,
    engine: str = "auto",
    skip_local: bool = False,
) -> torch.Tensor:
    """Local fan-out of a dedup buffer into the expert-contiguous receive buffer.

    Args:
        dedup: [ws.dedup_rows, hidden] in the workspace dtype: the dedup buffer that
            ``dispatch(..., 'dedup_pull', fan_out=False)`` returned for ``schedule``.
        schedule: the :func:`build_schedule` of that dispatch.
        engine: ``tma``, ``vector`` or ``auto``, as for :func:`dispatch`.
        skip_local: the dedup buffer came from ``dispatch(..., skip_local=True)``; this rank's
            own rows are read from the workspace x buffer (which the dispatch filled).

    Returns:
        The receive buffer [capacity, hidden], as :func:`dispatch` returns it (a workspace view,
        valid until the next dispatch or fan-out).

    Raises:
        MoKInputError: dedup of the wrong shape, dtype or device; an unknown engine; a
            workspace of the fused layer only.
        MoKUnsupportedError: called inside a CUDA graph capture.
        MoKInputError, MoKCapacityError, MoKTimeoutError: an error a kernel recorded on the
            device (see the module docstring), raised by this call when an earlier one
            recorded it.
    """
    ws = schedule.ws
    ws._standalone("fan-out into a receive buffer of capacity rows")
    engine = _engine(ws, engine)
    s = ws.shapes
    check_tensor("dedup", dedup, (ws.dedup_rows, s.hidden), (s.dtype,), ws.device)
    recv = ws.recv_buffer
    ops.fanout(dedup.contiguous(), ws.sched, recv, ws.id, engine, skip_local)
    return recv


def combine(
    y: torch.Tensor,  # [capacity, hidden] bf16 expert outputs in receive-row order
    schedule: DeviceSchedule,
    mode: str | None = None,
    shared_y: torch.Tensor | None = None,  # [num_tokens, hidden] bf16 or fp32
    dedup: bool | None = None,
) -> torch.Tensor:
    """Return expert outputs to their home rank and sum them in fixed order.

    ``out = bf16(shared_y + w_0 * y_0 + w_1 * y_1 + ...)`` (fp32, separate roundings), with the
    w_k of ``schedule.topk_weights``. Collective: every rank of the group combines the same
    schedule.

    Args:
        y: [capacity, hidden] bf16, the expert outputs in receive-row order (row p: the output
            for receive row p of :func:`dispatch`). ``ws.y_buffer`` skips the staging copy of
            the (non-dedup) pull combine.
        schedule: the :func:`build_schedule` of this call.
        mode: ``push`` or ``pull``; None: the config's ``combine_mode``.
        shared_y: [num_tokens, hidden] bf16 or fp32, the shared experts' output, or None.
        dedup: first sum each token's rows on the expert owner in k order into one partial per
            (token, rank); ``push`` then pushes the partials into the home rank's slots,
            ``pull`` runs :func:`dedup_partials` + :func:`dedup_sum` (the home rank reads the
            partials from the owners). None: whether the config's dispatch_mode is
            ``dedup_pull``.

    Returns:
        [num_tokens, hidden] bf16, a new tensor.

    Raises:
        MoKInputError: y or shared_y of the wrong shape, dtype or device; an unknown mode; a
            workspace of the fused layer only.
        MoKUnsupportedError: called inside a CUDA graph capture.
        MoKInputError, MoKCapacityError, MoKTimeoutError: an error a kernel recorded on the
            device (see the module docstring), raised by this call when an earlier one
            recorded it.
    """
    ws = schedule.ws
    ws._standalone("standalone combine")
    s = ws.shapes
    mode = mode or ws.config.combine_mode
    if mode not in ("push", "pull"):
        raise MoKInputError(f"unknown combine mode {mode!r}; supported: push, pull")
    dedup = ws.config.dispatch_mode == "dedup_pull" if dedup is None else dedup
    if dedup and mode == "pull":
        dedup_partials(y, schedule)
        return dedup_sum(schedule, shared_y)
    check_tensor("y", y, (ws.capacity, s.hidden), (torch.bfloat16,), ws.device)
    if shared_y is not None:
        check_tensor(
            "shared_y",
            shared_y,
            (schedule.num_tokens, s.hidden),
            (torch.bfloat16, torch.float32),
            ws.device,
        )
        shared_y = shared_y.contiguous()
    out = torch.empty(schedule.num_tokens, s.hidden, dtype=torch.bfloat16, device=ws.device)
    kernel_mode = "dedup_push" if dedup else mode
    ops.combine(
        y.contiguous(),
        ws.sched,
        schedule.topk_idx,
        schedule.topk_weights,
        shared_y,
        out,
        ws.id,
        kernel_mode,
    )
    return out


def dedup_partials(
    y: torch.Tensor, schedule: DeviceSchedule, grid: int | None = None, engine: str = "vector"
) -> None:
    """Expert-side step of the dedup pull combine (the fused layer's GEMM epilogue).

    For every dedup row, the sum over this rank's rows of that token, in k order, of w * y
    (fp32, stored bf16) goes into the workspace's symmetric partials buffer
    (:attr:`Workspace.partials_buffer`), where the home ranks' :func:`dedup_sum` reads it.

    Args:
        y: [capacity, hidden] bf16, the expert outputs in receive-row order.
        schedule: the :func:`build_schedule` of this call.
        grid: blocks; None or 0: the config's num_comm_sms.
        engine: ``vector`` (16-byte loads, a warp per row) or ``tma`` (bulk copies into shared
            memory, consumer warps); ``auto`` is not accepted here.

    Returns:
        None. The partials stay in the workspace until the :func:`dedup_sum` with
        ``release=True`` that ends them.

    Raises:
        MoKInputError: y of the wrong shape, dtype or device; an unknown engine; a workspace of
            the fused layer only; the previous partials not released yet (every
            :func:`dedup_sum` of them ran with ``release=False``).
        MoKUnsupportedError: called inside a CUDA graph capture.
        MoKInputError, MoKCapacityError, MoKTimeoutError: an error a kernel recorded on the
            device (see the module docstring), raised by this call when an earlier one
            recorded it.
    """
    ws = schedule.ws
    ws._standalone("dedup partials buffer")
    _check_engine(engine)
    check_tensor("y", y, (ws.capacity, ws.shapes.hidden), (torch.bfloat16,), ws.device)
    ops.dedup_partials(y.contiguous(), ws.sched, ws.partials_buffer, ws.id, grid or 0, engine)


def dedup_sum(
    schedule: DeviceSchedule,
    shared_y: torch.Tensor | None = None,
    engine: str = "auto",
    release: bool = True,
) -> torch.Tensor:
    """Transfer step of the dedup pull combine.

    The home rank reads its tokens' partials from every owner (after their
    :func:`dedup_partials`) and returns ``bf16(shared_y + partial_0 + partial_1 + ...)`` in
    ascending owner rank order.

    Args:
        schedule: the :func:`build_schedule` of this call.
        shared_y: [num_tokens, hidden] bf16 or fp32, the shared experts' output, or None.
        engine: ``vector`` (a warp per row, 16-byte loads), ``tma`` (the peers' partial rows
            bulk-loaded whole into a shared-memory ring, the local terms read by consumer
            warps; with many ranks, when whole rows do not fit, 4 KiB chunks of every term),
            ``auto`` (``tma`` for rows of at least 8 KiB, else ``vector``), or ``gather`` (a
            warp per row, several row chunks of every term in flight through cp.async; slower
            than ``vector`` on 2x H200, docs/perf-notes.md v3).
        release: this is the last sum of these partials, so their owners may overwrite them
            with the next :func:`dedup_partials` (a later sum of them raises); pass False to
            every sum but the last when one set of partials is summed several times.

    Returns:
        [num_tokens, hidden] bf16, a new tensor.

    Raises:
        MoKInputError: shared_y of the wrong shape, dtype or device; an unknown engine; a
            workspace of the fused layer only; no :func:`dedup_partials` on the workspace yet,
            or these partials already released by an earlier sum.
        MoKUnsupportedError: called inside a CUDA graph capture.
        MoKInputError, MoKCapacityError, MoKTimeoutError: an error a kernel recorded on the
            device (see the module docstring), raised by this call when an earlier one
            recorded it.
    """
    ws = schedule.ws
    ws._standalone("dedup partials buffer")
    engine = _engine(ws, engine, ops.SUM_ENGINES)
    s = ws.shapes
    if shared_y is not None:
        check_tensor(
            "shared_y",
            shared_y,
            (schedule.num_tokens, s.hidden),
            (torch.bfloat16, torch.float32),
            ws.device,
        )
        shared_y = shared_y.contiguous()
    out = torch.empty(schedule.num_tokens, s.hidden, dtype=torch.bfloat16, device=ws.device)
    ops.dedup_sum(ws.sched, shared_y, out, ws.id, engine, release)
    return out


def stage_row_grads(values: torch.Tensor, schedule: DeviceSchedule) -> None:
    """Expert-side step of returning one fp32 value per receive row to its token's home rank
    (the backward's router-weight gradient): the values go into this rank's symmetric
    ``row_grads`` region, where the home ranks' :func:`pull_row_grads` reads them.

    NOTE (ordering, not checked): call it before the :func:`combine` of ``schedule`` and call
    :func:`pull_row_grads` after that combine on every rank. The combine's cross-rank waits
    (each home rank waits for every owner, whose signal follows this write on its stream) are
    what makes the values visible to the home ranks; the next schedule build (each owner waits
    for every home rank, whose signal follows its read) is what keeps them until read.

    Args:
        values: [capacity] fp32, one value per receive row of ``schedule`` (padding rows and
            rows past ``num_rows`` are never read).
        schedule: the :func:`build_schedule` of this call.
    """
    ws = schedule.ws
    check_tensor("values", values, (ws.capacity,), (torch.float32,), ws.device)
    ws.peer_view(ws.rank, "row_grads", torch.float32, (ws.capacity,)).copy_(values)


def pull_row_grads(schedule: DeviceSchedule) -> torch.Tensor:
    """Home-side step of :func:`stage_row_grads`: each of this rank's (token, k) reads the
    value its expert's owner staged for its receive row (a gather from every peer's symmetric
    memory; pure data movement, so bitwise the staged values).

    Returns:
        [num_tokens, num_topk] fp32, a new tensor.
    """
    ws = schedule.ws
    dst_rank, dst_index = schedule.dst_rank, schedule.dst_index.long()
    out = torch.zeros(dst_rank.shape, dtype=torch.float32, device=ws.device)
    for r in range(ws.num_ranks):
        peer = ws.peer_view(r, "row_grads", torch.float32, (ws.capacity,))
        here = dst_rank == r
        out = torch.where(here, peer[torch.where(here, dst_index, 0)], out)
    return out
