"""The schedule on the device: :func:`build_schedule` all-gathers the routing into symmetric
memory and builds this rank's schedule table there; :class:`DeviceSchedule` is its view. At one
rank :meth:`DeviceSchedule.save` keeps a device copy of the tables a backward reads and
:func:`restore_schedule` puts them back in place of a second build.

Collective and asynchronous (no host-side counts); see :mod:`mok.functional` for the errors.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from mok import _ext, ops
from mok.checks import check_tensor
from mok.errors import MoKInputError
from mok.workspace import Workspace

if TYPE_CHECKING:
    pass

__all__ = [
    "DeviceSchedule",
    "SavedSchedule",
    "UNSAVED_TABLES",
    "build_schedule",
    "received_rows_bound",
    "restore_schedule",
    "routed_rows_bound",
    "saved_tables",
]


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
        route_epoch: the schedule build's epoch (which copy of the all-gathered routing it
            read; 0 where unknown).
    """

    ws: Workspace
    topk_idx: torch.Tensor  # [num_tokens, num_topk] int32 (this rank's routing)
    topk_weights: torch.Tensor  # [num_tokens, num_topk] fp32
    route_epoch: int = 0

    def row_weights(self) -> torch.Tensor:
        """The routing weight of each receive row, read from the routing every rank published
        in this build (the weight of the (token, k) on its home rank: no transfer).

        Returns:
            [capacity] fp32, a new tensor: 0 for padding rows and rows past ``num_rows``.
        """
        ws = self.ws
        if not self.route_epoch:
            raise MoKInputError("row_weights needs a schedule from build_schedule")
        src_rank, src_index = self.src_rank, self.src_index
        flat = ws.route_weights(self.route_epoch).reshape(-1)
        at = src_rank.long().clamp(min=0) * (ws.max_tokens * ws.shapes.num_topk)
        at += src_index.long().clamp(min=0)
        return torch.where(self.real_rows(), flat[at], 0.0)

    def real_rows(self) -> torch.Tensor:
        """Which receive rows hold a (token, k): not padding, before ``num_rows``.

        Returns:
            [capacity] bool, a new tensor (no synchronisation).
        """
        rows = torch.arange(self.ws.capacity, device=self.ws.device)
        return (self.src_rank >= 0) & (rows < self.num_rows.to(torch.int64))

    def unit_weights(self) -> DeviceSchedule:
        """This schedule with every combine weight 1: a combine of it sums each token's rows
        unweighted (the backward's reverse dispatch). NOTE: it overwrites the table's dedup fan
        weights (the weights the dedup combines read), so a weighted dedup combine of this
        build is no longer possible; :meth:`row_weights` still reads the routing's weights.

        Returns:
            A :class:`DeviceSchedule` over the same table with ``topk_weights`` all ones.
        """
        R, N, K = self.ws.num_ranks, self.ws.max_tokens, self.ws.shapes.num_topk
        self._v("fan_w", R * N * K).view(torch.float32).fill_(1.0)
        ones = torch.ones_like(self.topk_weights)
        return DeviceSchedule(self.ws, self.topk_idx, ones, self.route_epoch)

    def save(self) -> SavedSchedule | None:
        """A device copy of the tables of this build that a backward at one rank reads
        (:func:`saved_tables`), for :func:`restore_schedule`. Take it before the next build on
        the workspace (the copy is queued on the current stream, after the build).

        Returns:
            The :class:`SavedSchedule` (a new int32 tensor of about ``(5 * num_topk + 3) *
            num_tokens`` words: 4.2 MB at 24576 tokens, top-8 of 128 experts), or None where no
            restore applies: with peers (their builds are collective) and without tokens (no
            backward reads a schedule then).
        """
        ws, n = self.ws, self.num_tokens
        if ws.num_ranks != 1 or n == 0:
            return None
        tables = saved_tables(ws, n)
        data = torch.cat([ws.sched_view(name, words) for name, words in tables])
        return SavedSchedule(ws.id, n, tables, data)

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
    idx, w = _routing(topk_idx, topk_weights, ws)
    ops.build_schedule(idx, w, ws.sched, ws.id)
    if idx.shape[0] > ws.max_tokens:
        # Every rank learns of it in this schedule build; this rank knows now.
        ws.check()
    return DeviceSchedule(ws, idx, w, ws.epochs["route"])


def _routing(
    topk_idx: torch.Tensor, topk_weights: torch.Tensor, ws: Workspace
) -> tuple[torch.Tensor, torch.Tensor]:
    """(topk_idx as contiguous int32, topk_weights as contiguous fp32): the routing a build
    publishes, after the checks of :func:`build_schedule`."""
    s = ws.shapes
    if not isinstance(topk_idx, torch.Tensor) or topk_idx.ndim != 2:
        found = tuple(topk_idx.shape) if isinstance(topk_idx, torch.Tensor) else type(topk_idx)
        raise MoKInputError(f"topk_idx must have shape (num_tokens, {s.num_topk}) (found {found})")
    shape = (topk_idx.shape[0], s.num_topk)
    check_tensor("topk_idx", topk_idx, shape, (torch.int32, torch.int64), ws.device)
    floats = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
    check_tensor("topk_weights", topk_weights, shape, floats, ws.device)
    if topk_idx.dtype == torch.int64:
        # NOTE: ids outside int32 would wrap into range; clamped, the device check sees them.
        topk_idx = topk_idx.clamp(-(2**31), 2**31 - 1)
    return topk_idx.to(torch.int32).contiguous(), topk_weights.to(torch.float32).contiguous()


# ---- the forward's schedule kept for its backward (one rank) ------------------------------


@dataclass(frozen=True)
class SavedSchedule:
    """A device copy of the schedule tables a backward at one rank reads
    (:meth:`DeviceSchedule.save`), for :func:`restore_schedule`.

    Attributes:
        ws_id: the id of the workspace whose build it copies (only that one takes it back).
        num_tokens: the build's tokens (this rank's, the only rank).
        tables: (table, int32 words from its start) of each copied table, in ``data``'s order.
        data: [sum of the words] int32, the tables one after another.
    """

    ws_id: int
    num_tokens: int
    tables: tuple[tuple[str, int], ...]
    data: torch.Tensor


# The schedule tables a one-rank build writes that no copy keeps, and why a backward does not
# need them back (tests/test_schedule_restore.py checks that these and saved_tables name every
# table of the workspace's plan).
UNSAVED_TABLES = {
    "fanout": "read only by the fused forward's communication blocks, never by a backward",
    "fan_w": "the backward sets every word to 1 (unit_weights) before any combine reads it",
    "hist": "the build's per-chunk scratch, read only by the build itself",
    "dhist": "the build's per-chunk scratch, read only by the build itself",
    "ready": "the dispatches' per-minibatch counters: no build writes them",
}


def saved_tables(ws: Workspace, num_tokens: int) -> tuple[tuple[str, int], ...]:
    """The schedule tables that :meth:`DeviceSchedule.save` copies at one rank, as (table, int32
    words from its start) for a build of ``num_tokens`` tokens: every word the build writes
    that a later kernel or a :class:`DeviceSchedule` view reads. The receive-row tables up to
    :func:`received_rows_bound` (the build's ``num_rows`` is on the device); one dedup row per
    token (each has its experts here); ``meta``'s first two words (``num_rows``,
    ``num_dedup``), not its control words. :data:`UNSAVED_TABLES` names the rest."""
    n, nk = num_tokens, num_tokens * ws.shapes.num_topk
    rows = received_rows_bound(ws, n)
    return (
        ("counts", ws.shapes.num_experts),
        ("offsets", ws.num_local_experts + 1),
        ("src_rank", rows),
        ("src_index", rows),
        ("dst_rank", nk),
        ("dst_index", nk),
        ("dedup_src_rank", n),
        ("dedup_src_token", n),
        ("dedup_slot", n),
        ("fan_rows", nk),
        ("dcount", 1),
        ("meta", 2),
    )


_ROUTE_SIGNAL = _ext.SIGNALS.index("route_ready")


def restore_schedule(
    saved: SavedSchedule | None,
    topk_idx: torch.Tensor,  # [num_tokens, num_topk] int32/int64, the saved build's routing
    topk_weights: torch.Tensor,  # [num_tokens, num_topk] float, its weights
    ws: Workspace,
) -> DeviceSchedule:
    """:func:`build_schedule` of this routing, from the copy ``saved`` that the build of the same
    routing on ``ws`` left (:meth:`DeviceSchedule.save`) instead of the schedule kernel: the
    same tables and the same host and device state for every later kernel. Where the copy does
    not apply it builds: ``saved`` None, another workspace (a one-rank workspace that grew is a
    new one) or token count, more than one rank, a CUDA graph capture (whose kernels the build
    refuses, as always).

    Args:
        saved: the copy, or None.
        topk_idx: [num_tokens, num_topk] int32 or int64: the routing of the saved build.
        topk_weights: [num_tokens, num_topk] float: its weights.
        ws: the workspace (one rank).

    Returns:
        The :class:`DeviceSchedule` (views into ``ws``, valid until the next build or restore
        on it), with a route epoch of its own. NOTE: restored, its tables of
        :data:`UNSAVED_TABLES` are not this routing's: the dedup fan weights in particular, so
        (as after :meth:`DeviceSchedule.unit_weights`) it takes no weighted dedup combine, and
        the fused layer does not take it.

    Raises:
        MoKInputError, MoKCapacityError, MoKTimeoutError: an error a kernel recorded on the
            device, as :func:`build_schedule` raises it.
    """
    if not _restorable(saved, topk_idx, ws):
        return build_schedule(topk_idx, topk_weights, ws)
    idx, w = _routing(topk_idx, topk_weights, ws)
    ws.raise_if_failed()
    # NOTE: what a one-rank build leaves that later kernels rely on, and how a restore leaves the
    # same (csrc/common/schedule_kernel.cuh):
    # - the tables of saved_tables, copied back; the tables of UNSAVED_TABLES keep their words;
    # - the routing weights of the new route epoch, in its half of the double-buffered route_w
    #   region (row_weights reads them there): the same fp32 words the build publishes. The
    #   routing ids and the status words the build publishes beside them are read by that
    #   build alone (each build writes its own before its signal, and reads after it);
    # - the route signal: a build adds 1 to this rank's route_ready counter, and the next build
    #   waits for it to reach its epoch, so the counter must follow the host's route epoch. The
    #   restore adds 1 unless the workspace's abort word is set: an aborted build returns
    #   before its signal, and the host then rolls the epochs back to a snapshot that counts
    #   only the signalled builds (Workspace.raise_if_failed);
    # - the control words of meta: a build without an input error leaves the grid barrier's
    #   count, the routing-error words and the error claim as it found them, and its barriers
    #   wait for the generation to move, not for a value. An input error in this routing was
    #   found by the saved build, on this workspace, first: raised above, or recorded and
    #   raised at a later call (the abort word set, every later kernel returns at once);
    # - the host: the route epoch advanced and its snapshot kept (Workspace.advance).
    # The copies and the add are stream-ordered torch ops on one rank's memory: nothing else
    # writes it, and the next kernel on the stream sees them.
    epoch = ws.epochs["route"] + 1
    nk = idx.numel()
    # the new epoch's routing weights as int32 words: one dtype for the multi-tensor copy
    route_w = ws.route_weights(epoch)[0, :nk].view(torch.int32)
    dst = [ws.sched_view(name, words) for name, words in saved.tables]
    src = list(saved.data.split([words for _, words in saved.tables]))
    torch._foreach_copy_(dst + [route_w], src + [w.view(torch.int32).view(-1)])
    signals = ws.sym_view("signals", torch.int64, (_ext.NUM_SIGNALS, _ext.MAX_RANKS))
    abort = ws.sched_view("meta", _ext.META_WORDS)[_ext.META["abort"]]
    signals[_ROUTE_SIGNAL, ws.rank].add_(abort == 0)
    ws.advance("route")
    return DeviceSchedule(ws, idx, w, ws.epochs["route"])


def _restorable(saved: SavedSchedule | None, topk_idx: torch.Tensor, ws: Workspace) -> bool:
    """Whether ``saved`` is a copy of a build on ``ws`` of ``topk_idx``'s token count at one
    rank, outside a CUDA graph capture."""
    if saved is None or saved.ws_id != ws.id or ws.num_ranks != 1:
        return False
    if not isinstance(topk_idx, torch.Tensor) or topk_idx.ndim != 2:
        return False
    capturing = torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()
    return topk_idx.shape[0] == saved.num_tokens and not capturing


def routed_rows_bound(num_tokens: int, num_topk: int, num_experts: int, row_tile: int) -> int:
    """The receive rows one rank's call fills at most when every routed row is local: its
    ``num_tokens * num_topk`` rows plus each of ``num_experts`` regions' padding to
    ``row_tile``."""
    return num_tokens * num_topk + num_experts * (row_tile - 1)


def received_rows_bound(ws: Workspace, num_tokens: int) -> int:
    """An upper bound, known on the host, of the receive rows a call fills (the schedule's
    padded row count lives on the device): at one rank :func:`routed_rows_bound`; with peers
    the workspace's capacity (a peer may send up to its own ``max_tokens``)."""
    if ws.num_ranks > 1:
        return ws.capacity
    bound = routed_rows_bound(
        num_tokens, ws.shapes.num_topk, ws.num_local_experts, ws.config.row_tile
    )
    return min(ws.capacity, bound)
