"""Functional layer: schedule, dispatch, combine and an MoE forward built from them.

All calls are asynchronous: no ``.item()``, no host-side counts, no shape-dependent host
allocation. Sizes that depend on the routing (rows received, dedup rows) stay on the device; the
receive buffer has the fixed capacity of the workspace (:meth:`MoKConfig.capacity_rows`).

:func:`forward` runs the whole layer (dispatch, routed and shared SwiGLU experts, combine) as
one fused kernel on Hopper; :func:`moe_forward` builds the schedule and calls it
(``fused=True``) or composes the communication kernels with ``torch._grouped_mm`` experts.
Wherever a config is taken, a :class:`MoKConfig`, a dict or the path of the JSON that
``mok-sim tune --emit-config`` writes are accepted.

Errors: arguments are checked on the host and raise at once (:class:`mok.MoKInputError` for bad
shapes, dtypes, devices or option values; :class:`mok.MoKUnsupportedError` for a GPU or config
mok does not run, or a call inside a CUDA graph capture). What only the device can see is
recorded by the kernel and raised, on every rank, by the next mok call on the workspace or by
:func:`mok.check`: expert ids out of range or repeated within a token
(:class:`mok.MoKInputError`), a receive buffer too small or more than ``max_tokens`` tokens on
some rank (:class:`mok.MoKCapacityError`), a peer that does not arrive
(:class:`mok.MoKTimeoutError`). After an input or capacity error the workspace recovers and the
next call runs normally; after a timeout it is unusable until :func:`mok.clear_workspaces`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from mok import _ext, ops
from mok.errors import MoKInputError, MoKUnsupportedError
from mok.spec.config import MoKConfig
from mok.spec.limits import TMA_MIN_ROW_BYTES, why_unsupported
from mok.workspace import Workspace, get_workspace

if TYPE_CHECKING:
    from reference.weights import MoEWeights

__all__ = [
    "DeviceSchedule",
    "build_schedule",
    "dispatch",
    "fanout",
    "combine",
    "dedup_partials",
    "dedup_sum",
    "forward",
    "moe_forward",
    "as_config",
]


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


@dataclass
class DeviceSchedule:
    """The schedule table on the device, as :func:`build_schedule` returns it.

    Every table property is a view into the workspace (valid until the next
    :func:`build_schedule` on the same workspace). Row-indexed arrays have the workspace
    capacity; rows at or past ``num_rows`` (and dedup rows past ``num_dedup_rows``) are
    unspecified. All table arrays are int32. Shapes below: ``L`` = ``ws.num_local_experts``,
    ``R`` = ``ws.num_ranks``, ``K`` = num_topk.

    Attributes:
        ws: the workspace that holds the table.
        topk_idx: [num_tokens, K] int32, this rank's routing (global expert ids).
        topk_weights: [num_tokens, K] fp32, this rank's routing weights (the combine's w_k).
    """

    ws: Workspace
    topk_idx: torch.Tensor  # [num_tokens, num_topk] int32 (this rank's routing)
    topk_weights: torch.Tensor  # [num_tokens, num_topk] fp32

    @property
    def num_tokens(self) -> int:
        """This rank's tokens in this call (0..ws.max_tokens; ranks may differ).

        Returns:
            ``topk_idx.shape[0]`` (a host int; no synchronisation).
        """
        return self.topk_idx.shape[0]

    def _v(self, name: str, n: int) -> torch.Tensor:
        return self.ws.sched_view(name, n)

    @property
    def counts_all(self) -> torch.Tensor:
        """Rows that each source rank sends to each global expert (M of every expert).

        Returns:
            [num_experts, R] int32: row e, column r = rows of rank r routed to expert e. A view
            into the workspace.
        """
        return self._v("counts", self.ws.shapes.num_experts * self.ws.num_ranks).view(
            self.ws.shapes.num_experts, self.ws.num_ranks
        )

    @property
    def counts(self) -> torch.Tensor:
        """Rows that each source rank sends to this rank's local experts (M).

        Returns:
            [L, R] int32: row l, column r = rows of rank r routed to local expert l (global
            expert ``ws.rank * L + l``). A view into the workspace.
        """
        L, r = self.ws.num_local_experts, self.ws.rank
        return self.counts_all[r * L : (r + 1) * L]

    @property
    def offsets_all(self) -> torch.Tensor:
        """Padded expert region starts in the receive buffer of every rank.

        Returns:
            [R, L + 1] int32: row d = :attr:`offsets` of rank d. A view into the workspace.
        """
        R, L = self.ws.num_ranks, self.ws.num_local_experts
        return self._v("offsets", R * (L + 1)).view(R, L + 1)

    @property
    def offsets(self) -> torch.Tensor:
        """Padded region starts of this rank's local experts in its receive buffer (S).

        Local expert l's rows start at ``offsets[l]``; every region is padded to a multiple of
        ``config.row_tile`` and ``offsets[L]`` is the number of receive rows (``num_rows``).

        Returns:
            [L + 1] int32, a view into the workspace.
        """
        return self.offsets_all[self.ws.rank]

    def _rows(self, name: str) -> torch.Tensor:  # [capacity]
        return self._v(name, self.ws.capacity)

    @property
    def src_rank(self) -> torch.Tensor:
        """Source rank of each receive row.

        Returns:
            [capacity] int32: -1 for padding rows; rows past ``num_rows`` unspecified. A view
            into the workspace.
        """
        return self._rows("src_rank")

    @property
    def src_index(self) -> torch.Tensor:
        """Row ``token * num_topk + k`` on the source rank of each receive row.

        Returns:
            [capacity] int32: -1 for padding rows; rows past ``num_rows`` unspecified. A view
            into the workspace.
        """
        return self._rows("src_index")

    @property
    def fanout(self) -> torch.Tensor:
        """Dedup row that feeds each receive row (the fan-out map of ``dedup_pull``).

        Returns:
            [capacity] int32: -1 for padding rows; rows past ``num_rows`` unspecified. A view
            into the workspace.
        """
        return self._rows("fanout")

    def _nk(self, name: str) -> torch.Tensor:  # [num_tokens, num_topk]
        n, k = self.num_tokens, self.ws.shapes.num_topk
        return self._v(name, n * k).view(n, k)

    @property
    def dst_rank(self) -> torch.Tensor:
        """Rank that owns the expert of each of this rank's (token, k).

        Returns:
            [num_tokens, K] int32, a view into the workspace.
        """
        return self._nk("dst_rank")

    @property
    def dst_index(self) -> torch.Tensor:
        """Receive row of each of this rank's (token, k) on its :attr:`dst_rank`.

        Returns:
            [num_tokens, K] int32, a view into the workspace.
        """
        return self._nk("dst_index")

    def _dedup(self, name: str) -> torch.Tensor:  # [num_ranks * max_tokens]
        return self._v(name, self.ws.num_ranks * self.ws.max_tokens)

    @property
    def dedup_src_rank(self) -> torch.Tensor:
        """Source rank of each dedup row (one per (source rank, token) with an expert here).

        Returns:
            [R * max_tokens] int32: rows past ``num_dedup_rows`` unspecified. A view into the
            workspace.
        """
        return self._dedup("dedup_src_rank")

    @property
    def dedup_src_token(self) -> torch.Tensor:
        """Token index on its source rank of each dedup row.

        Returns:
            [R * max_tokens] int32: rows past ``num_dedup_rows`` unspecified. A view into the
            workspace.
        """
        return self._dedup("dedup_src_token")

    @property
    def dedup_slot(self) -> torch.Tensor:
        """Home-rank combine slot ``token * num_topk + j`` of each dedup row (``j``: this rank's
        ordinal among the token's distinct destination ranks, ascending).

        Returns:
            [R * max_tokens] int32: rows past ``num_dedup_rows`` unspecified. A view into the
            workspace.
        """
        return self._dedup("dedup_slot")

    @property
    def num_rows(self) -> torch.Tensor:
        """Receive rows of this rank, padding included (``offsets[L]``), kept on the device.

        Returns:
            [1] int32 on the device (read it with ``.item()``, which synchronises). A view into
            the workspace.
        """
        return self.ws.sched_view("meta", 1)

    @property
    def num_dedup_rows(self) -> torch.Tensor:
        """Dedup rows of this rank, kept on the device.

        Returns:
            [1] int32 on the device (read it with ``.item()``, which synchronises). A view into
            the workspace.
        """
        m = self.ws.sched_off["meta"] + 1
        return self.ws.sched[m : m + 1]

    @property
    def group_ends(self) -> torch.Tensor:
        """End of each local expert's padded region (``offsets[1:]``): the ``offs`` of
        ``torch._grouped_mm`` over the receive buffer.

        Returns:
            [L] int32, a view into the workspace.
        """
        return self.offsets[1:]

    def to_host(self) -> dict[str, torch.Tensor]:
        """Synchronise and return the table trimmed to its real sizes (for tests and debugging).

        Returns:
            CPU int64 tensors named like the fields of :class:`reference.schedule.Schedule`
            (``counts``, ``tokens_per_expert``, ``offsets``, ``src_rank``, ...): copies, owned by
            the caller.

        Raises:
            MoKInputError, MoKCapacityError, MoKTimeoutError: an error the kernels recorded on
                the workspace (see the module docstring).
        """
        self.ws.check()
        P, D = int(self.num_rows.item()), int(self.num_dedup_rows.item())

        def h(t: torch.Tensor) -> torch.Tensor:
            return t.to("cpu", torch.int64)

        return {
            "counts": h(self.counts),
            "tokens_per_expert": h(self.counts).sum(dim=1),
            "offsets": h(self.offsets),
            "src_rank": h(self.src_rank[:P]),
            "src_index": h(self.src_index[:P]),
            "dst_rank": h(self.dst_rank),
            "dst_index": h(self.dst_index),
            "dedup_src_rank": h(self.dedup_src_rank[:D]),
            "dedup_src_token": h(self.dedup_src_token[:D]),
            "dedup_slot": h(self.dedup_slot[:D]),
            "fanout": h(self.fanout[:P]),
        }


def _check_tensor(name: str, t: torch.Tensor, shape: tuple, dtypes: tuple, device) -> None:
    if not isinstance(t, torch.Tensor):
        raise MoKInputError(f"{name} must be a torch.Tensor (found {type(t).__name__})")
    if tuple(t.shape) != shape:
        raise MoKInputError(f"{name} must have shape {shape} (found {tuple(t.shape)})")
    if t.dtype not in dtypes:
        names = ", ".join(str(d).replace("torch.", "") for d in dtypes)
        raise MoKInputError(f"{name} must be {names} (found {str(t.dtype).replace('torch.', '')})")
    if t.device != device:
        raise MoKInputError(f"{name} is on {t.device}; the workspace lives on {device}")


def build_schedule(
    topk_idx: torch.Tensor,  # [num_tokens, num_topk] int32/int64
    topk_weights: torch.Tensor,  # [num_tokens, num_topk] float
    ws: Workspace,
) -> DeviceSchedule:
    """All-gather the routing into symmetric memory and build this rank's schedule on the GPU.

    Collective: every rank of the workspace's group calls it for the same layer call.

    Args:
        topk_idx: [num_tokens, num_topk] int32 or int64, the global expert ids of this rank's
            tokens: in ``[0, num_experts)`` and distinct within a token. ``num_tokens`` may be
            anything from 0 to ``ws.max_tokens`` and differ between ranks.
        topk_weights: [num_tokens, num_topk] fp32, bf16, fp16 or fp64, the routing weights
            (used as fp32).
        ws: the workspace (:func:`mok.get_workspace`), on the device of both tensors.

    Returns:
        The :class:`DeviceSchedule`: views into ``ws``, valid until the next
        :func:`build_schedule` on ``ws``.

    Raises:
        MoKInputError: a tensor of the wrong shape, dtype or device. Expert ids out of range or
            repeated within a token are detected on the device and raised (on every rank) by
            the next mok call or :meth:`Workspace.check`; the workspace then recovers (the call
            after the one that raised runs normally).
        MoKCapacityError: more than ``ws.max_tokens`` tokens, here (and on the other ranks at
            their next mok call); a receive buffer too small for the routing is found on the
            device and raised by the next mok call or :meth:`Workspace.check`.
        MoKUnsupportedError: called inside a CUDA graph capture.
        MoKInputError, MoKCapacityError, MoKTimeoutError: an error a kernel recorded on the
            device (see the module docstring), raised by this call when an earlier one
            recorded it.
    """
    s = ws.shapes
    if not isinstance(topk_idx, torch.Tensor) or topk_idx.ndim != 2:
        found = tuple(topk_idx.shape) if isinstance(topk_idx, torch.Tensor) else type(topk_idx)
        raise MoKInputError(f"topk_idx must have shape (num_tokens, {s.num_topk}) (found {found})")
    shape = (topk_idx.shape[0], s.num_topk)
    _check_tensor("topk_idx", topk_idx, shape, (torch.int32, torch.int64), ws.device)
    floats = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
    _check_tensor("topk_weights", topk_weights, shape, floats, ws.device)
    if topk_idx.dtype == torch.int64:
        # NOTE: ids outside int32 would wrap into range; clamped, the device check sees them.
        topk_idx = topk_idx.clamp(-(2**31), 2**31 - 1)
    idx = topk_idx.to(torch.int32).contiguous()
    w = topk_weights.to(torch.float32).contiguous()
    ops.build_schedule(idx, w, ws.sched, ws.id)
    if idx.shape[0] > ws.max_tokens:
        # Every rank learns of it in this schedule build; this rank knows now.
        ws.check()
    return DeviceSchedule(ws, idx, w)


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

    Returns:
        The receive buffer [capacity, hidden] in the workspace dtype (a workspace view, valid
        until the next dispatch): rows ``offsets[l]..offsets[l] + tokens_per_expert[l]`` hold
        local expert l's tokens in schedule order; padding rows and rows past ``num_rows`` are
        unspecified. With ``fan_out=False``, the dedup buffer [num_ranks * max_tokens, hidden]
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
    _check_tensor("x", x, (n, ws.shapes.hidden), (ws.shapes.dtype,), ws.device)
    x = x.contiguous()
    out = ws.recv_buffer if fan_out else ws.dedup_buffer
    ops.dispatch(x, ws.sched, out, ws.id, mode, fan_out, engine, skip_local)
    return out


def fanout(
    dedup: torch.Tensor,
    schedule: DeviceSchedule,
    engine: str = "auto",
    skip_local: bool = False,
) -> torch.Tensor:
    """Local fan-out of a dedup buffer into the expert-contiguous receive buffer.

    Args:
        dedup: [num_ranks * max_tokens, hidden] in the workspace dtype: the dedup buffer that
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
    R, s = ws.num_ranks, ws.shapes
    _check_tensor("dedup", dedup, (R * s.max_tokens, s.hidden), (s.dtype,), ws.device)
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
    _check_tensor("y", y, (ws.capacity, s.hidden), (torch.bfloat16,), ws.device)
    if shared_y is not None:
        _check_tensor(
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
    _check_tensor("y", y, (ws.capacity, ws.shapes.hidden), (torch.bfloat16,), ws.device)
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
        _check_tensor(
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


def _check_fused(ws: Workspace, weights: MoEWeights, x: torch.Tensor, num_tokens: int) -> None:
    """Raise a clear error for everything the fused layer does not support (yet)."""
    cap = torch.cuda.get_device_capability(ws.device)
    if cap != (9, 0):
        raise MoKUnsupportedError(
            f"the fused layer has a Hopper (sm_90a) path only; found "
            f"{torch.cuda.get_device_name(ws.device)} (sm_{cap[0]}{cap[1]}, {_ext._versions()}). "
            "Use moe_forward(..., fused=False) (communication kernels + torch grouped GEMM)"
        )
    cfg, s = ws.config, ws.shapes
    L, H = ws.num_local_experts, s.hidden
    inter = weights.w_gate.shape[1]
    shared_inter = 0 if weights.shared_w_gate is None else weights.shared_w_gate.shape[0]
    dtype = {torch.bfloat16: "bf16", torch.float32: "fp32"}.get(s.dtype, str(s.dtype))
    why = why_unsupported(cfg, H, inter, shared_inter, dtype, ws.num_sms)
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
    for name, shape in want.items():
        t = getattr(weights, name)
        _check_tensor(f"weights.{name}", t, shape, (torch.bfloat16,), ws.device)
        if not t.is_contiguous() or t.data_ptr() % 16:
            raise MoKInputError(f"weights.{name} must be contiguous and 16-byte aligned")
    _check_tensor("x", x, (num_tokens, H), (torch.bfloat16,), ws.device)
    if not x.is_contiguous() or x.data_ptr() % 16:
        raise MoKInputError("x must be contiguous and 16-byte aligned")


def forward(
    x: torch.Tensor,
    schedule: DeviceSchedule,
    weights: MoEWeights,
    trace: torch.Tensor | None = None,
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
            [L, I, H] and w_down [L, H, I] (``L = ws.num_local_experts``), optional
            shared_w_gate / shared_w_up [Is, H] and shared_w_down [H, Is]. H must be a multiple
            of 256, I and Is multiples of 128.
        trace: a buffer from :func:`mok.layer_trace.new_trace` that the kernel fills with
            per-tile timestamps, or None.

    Returns:
        [num_tokens, hidden] bf16, a new tensor.

    Raises:
        MoKUnsupportedError: a GPU other than Hopper (sm_90); a workspace dtype other than
            bf16; a config the fused layer does not run (dispatch_mode other than pull /
            dedup_pull, combine_mode other than push, row_tile other than 64 / 128,
            minibatch_size not a multiple of 128, num_comm_sms not in [1, SMs)); hidden or
            intermediate sizes off the tiles above; a call inside a CUDA graph capture.
        MoKInputError: x or a weight of the wrong shape, dtype or device, not contiguous or not
            16-byte aligned.
        MoKInputError, MoKCapacityError, MoKTimeoutError: errors the kernel records (bad
            routing, capacity, timeouts) are raised by the next mok call or
            :meth:`Workspace.check` / :func:`mok.check`; this call raises those of earlier ones.
    """
    ws = schedule.ws
    _check_fused(ws, weights, x, schedule.num_tokens)
    out = torch.empty_like(x)
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
        ws.id,
        trace,
    )
    return out


_GMM_FP32_OUT: bool | None = None


def _grouped_mm(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """a [M, K] bf16 @ b [G, K, N] per group of rows ending at offs [G]; fp32 output where
    torch supports it (no extra rounding of the intermediate), else bf16."""
    global _GMM_FP32_OUT
    if _GMM_FP32_OUT is not False:
        try:
            out = torch._grouped_mm(a, b, offs=offs, out_dtype=torch.float32)
            _GMM_FP32_OUT = True
            return out
        except (RuntimeError, TypeError):
            _GMM_FP32_OUT = False
    return torch._grouped_mm(a, b, offs=offs).float()


def moe_forward(
    x: torch.Tensor,  # [num_tokens, hidden] bf16
    topk_idx: torch.Tensor,  # [num_tokens, num_topk] int
    topk_weights: torch.Tensor,  # [num_tokens, num_topk] float
    weights: MoEWeights,  # w_gate/w_up [L, I, H], w_down [L, H, I] bf16; optional shared_w_*
    num_experts: int,
    config: MoKConfig | dict | str | Path | None = None,
    group=None,
    fused: bool = False,
) -> torch.Tensor:
    """The MoE layer on this rank: schedule, dispatch, grouped SwiGLU experts, combine.

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
        fused: run :func:`forward` (one kernel; Hopper); else the communication kernels with
            ``torch._grouped_mm`` experts.

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
        return forward(x, sched, weights)
    recv = dispatch(x, sched)
    offs = sched.group_ends
    # NOTE: gate and up as two grouped GEMMs: concatenating the weights would copy them (GBs)
    # on every call.
    g = _grouped_mm(recv, wg.transpose(1, 2), offs)  # [capacity, I] fp32
    u = _grouped_mm(recv, wu.transpose(1, 2), offs)
    h = (F.silu(g) * u).to(torch.bfloat16)
    y = _grouped_mm(h, wd.transpose(1, 2), offs).to(torch.bfloat16)  # [capacity, H]
    shared_y = None
    if getattr(weights, "shared_w_gate", None) is not None:
        xf = x.float()
        g = xf @ weights.shared_w_gate.float().T
        u = xf @ weights.shared_w_up.float().T
        sh = (F.silu(g) * u).to(torch.bfloat16).float()
        shared_y = (sh @ weights.shared_w_down.float().T).to(torch.bfloat16)
    return combine(y, sched, shared_y=shared_y)
