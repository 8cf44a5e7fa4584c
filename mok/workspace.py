"""Workspace: symmetric buffers, schedule storage, signal epochs and the error record.

One symmetric allocation per rank (``torch.distributed._symmetric_memory.empty`` +
``rendezvous``; no multicast) holds, at fixed byte offsets: the signal pad, the all-gathered
routing, the x buffer (pull dispatch reads peers' rows from it), the receive buffer (push
dispatch stores into peers'), the combine slots (push combine) and the expert-output buffer
(pull combine). Workspaces are cached per (group, device, hidden, top-k, experts, dtype,
config); creating one is collective and happens once, outside the steady state. A workspace is
sized for ``max_tokens`` tokens per rank and serves every call with 0..max_tokens tokens per rank;
the ranks' counts may differ. ``max_tokens`` is ``MoKConfig.max_tokens``, or, when that is 0,
the larger of a default (:func:`mok.sizing.default_max_tokens`: 8192, less where that would
take more than 1/16 of the GPU's memory) and the largest count any rank passes in the first
call; a one-rank workspace of that kind grows (to twice its size or more) when a call passes
more. Steady-state calls only bump host-side epoch counters and launch kernels: no
host synchronisation.

Errors the kernels find in the inputs (a bad expert id, a full receive buffer, more tokens than
``max_tokens``) are found by every rank in the same schedule build; every later kernel of the
workspace returns at once. The host raises the error at the next mok call (or
:meth:`Workspace.check`) and puts the workspace back into the state it had right after that
schedule build, so the next call runs normally. A timeout leaves the peers' state unknown: the
workspace stays unusable until :func:`clear_workspaces`.
"""

from __future__ import annotations

import math
import weakref
from collections import OrderedDict

import torch

from mok import _ext
from mok.errors import MoKCapacityError, MoKInputError, MoKTimeoutError, MoKUnsupportedError
from mok.ranks import shared_gpu
from mok.sizing import ALIGN, CHUNK_TOKENS, Shapes, dedup_rows, default_max_tokens, plan
from mok.sms import budget_sms, device_sms
from mok.spec.config import MoKConfig
from mok.spec.limits import expert_split_problem, rank_count_problem

__all__ = ["Workspace", "get_workspace", "cached_workspaces", "clear_workspaces", "check"]

_SCHEDULE_BLOCKS = 64
# Distinct layer shapes / configs held at once (each holds its buffers until cleared).
MAX_WORKSPACES = 16
# Schedule builds whose host state is kept for the recovery after an input error (the host may
# run this many schedule builds ahead of the device before it sees the error).
_SNAPSHOTS = 64
# Symmetric regions without a field of their own in the kernels' Params (host-side torch ops
# read them, and the fused backward gets their offsets as launch arguments).
HOST_REGIONS = frozenset({"row_grads", "dy"})
_cache: dict[tuple, Workspace] = {}
# Every live workspace by id (the custom ops pass ids): weak, so that a workspace dropped from
# the cache (cleared, or outgrown at one rank) stays usable while its holder keeps it and is
# freed after.
_by_handle: weakref.WeakValueDictionary[int, Workspace] = weakref.WeakValueDictionary()
_next_id = 1


class Workspace:
    """Buffers and state of the layer on one rank. Use :func:`get_workspace`."""

    def __init__(
        self, shapes: Shapes, config: MoKConfig, group, device: torch.device, fused: bool = False
    ):
        import torch.distributed as dist

        self.shapes, self.config, self.device = shapes, config, device
        # A workspace of the fused layer only holds what that kernel touches: a receive buffer
        # of the ring's rows, and neither the expert-output buffer nor the dedup partials of the
        # standalone combines.
        self.fused = fused
        self.group = group
        distributed = dist.is_available() and dist.is_initialized()
        self.rank = dist.get_rank(group) if distributed else 0
        self.num_ranks = dist.get_world_size(group) if distributed else 1
        R, N, H, K, E = (
            self.num_ranks,
            shapes.max_tokens,
            shapes.hidden,
            shapes.num_topk,
            shapes.num_experts,
        )
        ranks = rank_count_problem(R)
        if ranks:
            raise MoKUnsupportedError(ranks)
        split = expert_split_problem(E, R)
        if split:
            raise MoKInputError(f"mok: {split}")
        if N < 1:
            raise MoKInputError(f"a workspace holds at least 1 token per rank (max_tokens={N})")
        if not 1 <= K <= _ext.MAX_TOPK:
            raise MoKInputError(f"num_topk must be in [1, {_ext.MAX_TOPK}] (found {K})")
        elem = torch.empty((), dtype=shapes.dtype).element_size()
        self.row_bytes = H * elem
        if (H * 2) % 16 or self.row_bytes % 16:
            raise MoKInputError(f"hidden={H} must make 16-byte rows (hidden % 8 == 0 for bf16)")
        self.num_local_experts = E // R
        self.plan = plan(shapes, config, R, fused)
        self.capacity = self.plan.capacity
        self.num_chunks = self.plan.num_chunks
        self.num_minibatches = self.plan.num_minibatches
        # Symmetric layout (bytes) and local schedule layout (int32 elements).
        self.sym_sizes = dict(self.plan.sym_sizes)
        self.sym_off, sym_bytes = self.plan.sym_layout
        self.sched_off, sched_len = self.plan.sched_layout
        self.sched = torch.zeros(sched_len, dtype=torch.int32, device=device)
        self.sched[self.sched_off["meta"] + _ext.META["bad_detail"]] = 2**31 - 1

        if distributed:
            import torch.distributed._symmetric_memory as symm_mem

            self.sym = symm_mem.empty(sym_bytes, dtype=torch.uint8, device=device)
            self.handle = symm_mem.rendezvous(self.sym, group=group or dist.group.WORLD)
            ptrs = list(self.handle.buffer_ptrs)
            if ptrs[self.rank] != self.sym.data_ptr():
                raise MoKUnsupportedError(
                    f"symmetric buffer of rank {self.rank} is at {ptrs[self.rank]:#x} in the "
                    f"handle but the tensor is at {self.sym.data_ptr():#x}; mok needs the tensor "
                    "to be the start of its symmetric allocation"
                )
        else:
            self.sym = torch.empty(sym_bytes, dtype=torch.uint8, device=device)
            self.handle = None
            ptrs = [self.sym.data_ptr()]
        self.sym_ptrs = ptrs
        # NOTE: the signal pad must start at zero on every rank before any peer signals it.
        self.sym[: self.sym_off["route_idx"]].zero_()
        torch.cuda.synchronize(device)
        if self.handle is not None:
            self.handle.barrier()

        # Host-mapped error record (8 int64, see csrc/params.h ErrorField): kernels write it,
        # Python reads it without synchronising the device.
        self.error = torch.zeros(8, dtype=torch.int64).pin_memory()
        self._ext = _ext.load()
        self.error_dev = self._ext.host_device_pointer(self.error.data_ptr())
        self.epochs = {
            "route": 0,
            "x": 0,
            "recv": 0,
            "slots": 0,
            "y": 0,
            "partials": 0,
            "layer": 0,
            "bwd": 0,
        }
        self._layer_buffers: dict[tuple[int, int], dict[str, torch.Tensor]] = {}
        self._peer_views: dict[tuple, torch.Tensor] = {}
        self._dedup_buffer: torch.Tensor | None = None
        # The partials epoch whose last dedup_sum ran (its owners may overwrite them now).
        self.partials_released = 0
        self.broken: Exception | None = None
        self._params_base: bytes | None = None
        # Epochs right after each recent schedule build, by route epoch (input-error recovery).
        self._snapshots: OrderedDict[int, dict[str, int]] = OrderedDict()
        # Diagnostics: an int64 CUDA tensor [num_comm_sms, NUM_STAMPS] here makes the dedup pull
        # dispatch and dedup_sum kernels write each block's phase times (globaltimer ns) into it.
        self.stamps: torch.Tensor | None = None
        # Tests only: (tile, mode) makes the fused layer's worker that claims that tile fail:
        # mode 0 its dependency wait, mode 1 its wait for the tile's second pipeline stage.
        self.fault: tuple[int, int] | None = None
        global _next_id
        self.id = _next_id
        _next_id += 1
        _by_handle[self.id] = self
        sms = self.num_sms
        if config.num_comm_sms > sms:
            budget = f"num_sms={config.num_sms} of " if config.num_sms else ""
            raise MoKUnsupportedError(
                f"num_comm_sms={config.num_comm_sms} exceeds the {budget}"
                f"{device_sms(device)} SMs of this GPU"
            )

    # ---- views ---------------------------------------------------------------------------
    def sym_view(self, name: str, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
        off = self.sym_off[name]
        nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        return self.sym[off : off + nbytes].view(dtype).view(shape)

    def peer_view(
        self, rank: int, name: str, dtype: torch.dtype, shape: tuple[int, ...]
    ) -> torch.Tensor:
        """Region ``name`` of rank ``rank``'s symmetric allocation as a tensor on this device
        (the peer mapping; this rank's own region for ``rank == self.rank``). Loads and stores
        through it cross the link; order them against the peer's writes or reads with mok's
        signals (a kernel of the same stream that waits for the peer). Cached."""
        key = (rank, name, dtype, shape)
        view = self._peer_views.get(key)
        if view is None:
            if rank == self.rank or self.handle is None:
                view = self.sym_view(name, dtype, shape)
            else:
                size = torch.empty((), dtype=dtype).element_size()
                off = self.sym_off[name]
                if off % size:
                    raise MoKInputError(f"region {name} is not aligned to {dtype}")
                view = self.handle.get_buffer(rank, shape, dtype, off // size)
            self._peer_views[key] = view
        return view

    def route_weights(self, route_epoch: int) -> torch.Tensor:
        """The routing weights every rank published in the schedule build of ``route_epoch``
        (the all-gather), valid until the build two epochs later overwrites them.

        Returns:
            [num_ranks, max_tokens * num_topk] fp32 view of this rank's symmetric memory: row r,
            entry ``token * num_topk + k`` = rank r's weight of (token, k) (entries past rank r's
            token count unspecified).
        """
        R, N, K = self.num_ranks, self.shapes.max_tokens, self.shapes.num_topk
        both = self.sym_view("route_w", torch.float32, (2, R, N * K))
        return both[route_epoch & 1]

    @property
    def max_tokens(self) -> int:
        """Most tokens one rank may pass in one call.

        Returns:
            ``MoKConfig.max_tokens``, or the largest count any rank passed when the workspace
            was created (config max_tokens 0).
        """
        return self.shapes.max_tokens

    @property
    def x_buffer(self) -> torch.Tensor:
        """Symmetric x buffer: write a call's tokens into its first rows and pass
        ``x_buffer[:num_tokens]`` to skip the staging copy of pull dispatch.

        Call :meth:`wait_x_free` before such a write: peers may still be pulling the previous
        call's rows.

        Returns:
            [max_tokens, hidden] in the workspace dtype: a view into the symmetric allocation,
            valid as long as the workspace; a pull dispatch of another x copies it into it.
        """
        return self.sym_view("x", self.shapes.dtype, (self.shapes.max_tokens, self.shapes.hidden))

    def _standalone(self, what: str) -> None:
        if self.fused:
            raise MoKInputError(
                f"this workspace serves the fused layer only (mok.functional.forward), which "
                f"has no {what}; the stage functions need a workspace from "
                "get_workspace(..., fused=False), which moe_forward(..., fused=False) uses"
            )

    @property
    def recv_buffer(self) -> torch.Tensor:
        """Receive buffer (expert-contiguous rows; padding rows untouched).

        Returns:
            [capacity, hidden] in the workspace dtype: a view into the symmetric allocation,
            rewritten by every dispatch and fan-out.

        Raises:
            MoKInputError: a workspace of the fused layer only (``fused=True``).
        """
        self._standalone("receive buffer of capacity rows")
        return self.sym_view("recv", self.shapes.dtype, (self.capacity, self.shapes.hidden))

    @property
    def y_buffer(self) -> torch.Tensor:
        """Expert-output buffer read by pull combine: write the expert outputs here to skip its
        staging copy.

        Returns:
            [capacity, hidden] bf16: a view into the symmetric allocation, valid as long as the
            workspace; a pull combine of other expert outputs copies them into it.

        Raises:
            MoKInputError: a workspace of the fused layer only (``fused=True``).
        """
        self._standalone("expert-output buffer")
        return self.sym_view("y", torch.bfloat16, (self.capacity, self.shapes.hidden))

    @property
    def partials_buffer(self) -> torch.Tensor:
        """Dedup partials that this rank's experts produced for the dedup pull combine.

        Returns:
            [dedup_rows, hidden] bf16 (row ``i``: the partial of dedup row ``i``, the home rank
            finds it through its ``partials_index`` region): a view into the symmetric
            allocation, rewritten by every :func:`mok.functional.dedup_partials`.

        Raises:
            MoKInputError: a workspace of the fused layer only (``fused=True``).
        """
        self._standalone("dedup partials buffer")
        return self.sym_view("partials", torch.bfloat16, (self.dedup_rows, self.shapes.hidden))

    @property
    def dedup_rows(self) -> int:
        """Rows of the dedup buffer: ``min(num_ranks * max_tokens, capacity)``
        (:func:`mok.sizing.dedup_rows`: a dedup row is a (source rank, token) with at least one
        receive row here)."""
        return dedup_rows(self.num_ranks, self.shapes.max_tokens, self.capacity)

    @property
    def dedup_buffer(self) -> torch.Tensor:
        """Local buffer of the dedup dispatch without fan-out. Allocated on first use.

        Returns:
            [dedup_rows, hidden] in the workspace dtype (row i = dedup row i; rows past
            num_dedup_rows unspecified): the same tensor on every access, held by the workspace
            and rewritten by every dedup dispatch without fan-out.
        """
        if self._dedup_buffer is None:
            shape = (self.dedup_rows, self.shapes.hidden)
            self._dedup_buffer = torch.empty(shape, dtype=self.shapes.dtype, device=self.device)
        return self._dedup_buffer

    def memory_report(self) -> dict[str, dict[str, int]]:
        """Bytes of every buffer of this workspace on this rank.

        Returns:
            ``{"symmetric": {buffer: bytes}, "local": {buffer: bytes}, "total": {"symmetric":
            bytes, "local": bytes}}``: ``symmetric`` is one allocation, the same size on every
            rank; ``local`` counts the buffers allocated so far. A new dict (plain ints).
        """
        local = {"schedule": self.sched.numel() * 4, "error": self.error.numel() * 8}
        if self._dedup_buffer is not None:
            local["dedup"] = self._dedup_buffer.numel() * self._dedup_buffer.element_size()
        for (inter, shared), bufs in self._layer_buffers.items():
            for name, t in bufs.items():
                local[f"layer_{name}(I={inter},Is={shared})"] = t.numel() * t.element_size()
        sym = {name: -(-size // ALIGN) * ALIGN for name, size in self.sym_sizes.items()}
        return {
            "symmetric": sym,
            "local": local,
            "total": {"symmetric": sum(sym.values()), "local": sum(local.values())},
        }

    def wait_x_free(self) -> None:
        """Make the current stream wait until every peer finished reading this rank's x buffer.

        The last pull dispatch is the reader. Call it before writing a call's tokens into
        :attr:`x_buffer` directly (no staging copy): without it the write can overtake a peer
        still pulling the previous call's rows. Bounded like every wait; asynchronous (no host
        synchronisation).

        Raises:
            MoKUnsupportedError: called inside a CUDA graph capture.
            MoKError: an error a kernel recorded earlier (see :meth:`raise_if_failed`). A wait
                that expires here is recorded and raised by the next mok call as
                :class:`mok.MoKTimeoutError`.
        """
        self.raise_if_failed()
        self.launch("wait_x_free", self.params("x"), 1)

    def sched_view(self, name: str, length: int) -> torch.Tensor:
        off = self.sched_off[name]
        return self.sched[off : off + length]

    # ---- launches ------------------------------------------------------------------------
    def params(
        self, family: str | None, num_tokens: int | None = None, advance: bool = False
    ) -> _ext.Params:
        """A fresh Params for one launch: the workspace's fixed fields (built once, then
        copied: host time per call matters) with the family's current epoch (``advance``: the
        next one, which :meth:`advance` makes current once the launch went through) and this
        rank's token count (default max_tokens)."""
        if self._params_base is None:
            self._params_base = bytes(self._fixed_params())
        p = _ext.Params.from_buffer_copy(self._params_base)
        p.epoch = (self.epochs[family] + int(advance)) if family else 0
        if num_tokens is not None:
            p.num_tokens = num_tokens
        return p

    def advance(self, family: str) -> None:
        """Count a launched call of ``family``. NOTE: only after the launch went through: a
        call that fails before or at its launch leaves every epoch as it was, so the next call
        waits for the signals the peers really send."""
        self.epochs[family] += 1
        if family == "route":
            self.note_schedule()

    def note_schedule(self) -> None:
        """Keep the host state right after a schedule build (see :meth:`raise_if_failed`)."""
        self._snapshots[self.epochs["route"]] = dict(self.epochs)
        while len(self._snapshots) > _SNAPSHOTS:
            self._snapshots.popitem(last=False)

    def _fixed_params(self) -> _ext.Params:
        s, p = self.shapes, _ext.Params()
        p.rank, p.num_ranks, p.num_tokens, p.max_tokens, p.num_topk = (
            self.rank,
            self.num_ranks,
            s.max_tokens,
            s.max_tokens,
            s.num_topk,
        )
        p.num_experts, p.num_local_experts = s.num_experts, self.num_local_experts
        p.row_tile, p.capacity = self.config.row_tile, self.capacity
        p.chunk_tokens, p.num_chunks = CHUNK_TOKENS, self.num_chunks
        p.minibatch_rows, p.num_minibatches = self.config.minibatch_size, self.num_minibatches
        p.hidden, p.row_bytes = s.hidden, self.row_bytes
        p.timeout_ns = int(self.config.wait_timeout_ms * 1e6)
        for r, ptr in enumerate(self.sym_ptrs):
            p.sym_base[r] = ptr
        for name, off in self.sym_off.items():
            if name not in HOST_REGIONS:
                setattr(p, f"off_{name}", off)
        p.sched = self.sched.data_ptr()
        for name, off in self.sched_off.items():
            setattr(p, f"o_{name}", off)
        p.error = self.error_dev
        return p

    def launch(self, kernel: str, p: _ext.Params, grid: int) -> None:
        stream = self.stream()
        self._ext.launch(_ext.KERNELS[kernel], bytes(p), grid, stream)

    def launch_layer(self, p: _ext.Params, args: _ext.LayerArgs) -> None:
        stream = self.stream()
        self._ext.launch_layer(bytes(p), bytes(args), self.num_sms, stream)

    def stream(self) -> int:
        """The current CUDA stream of the workspace's device, for a launch (refused while a
        CUDA graph captures)."""
        if torch.cuda.is_current_stream_capturing():
            raise MoKUnsupportedError(
                "mok's kernels cannot be captured in a CUDA graph (yet): each call's epochs, "
                "which every cross-rank wait targets, are host counters in the launch "
                "parameters, so a replay would reuse the captured ones and read stale data. "
                "Run the layer outside torch.cuda.graph; under torch.compile(mode="
                "'reduce-overhead') mok's ops are tagged cudagraph_unsafe and run outside the "
                "captured graphs"
            )
        return torch.cuda.current_stream(self.device).cuda_stream

    @property
    def num_sms(self) -> int:
        """The SMs this workspace's kernels use: ``config.num_sms`` (0: every SM of the GPU)."""
        return budget_sms(self.device, self.config.num_sms)

    @property
    def ring_rows(self) -> int:
        """Rows of the fused layer's receive / h ring: the config's macrobatch_size, or every
        minibatch of the receive buffer (no reuse) when it is 0 or larger."""
        return self.plan.ring_rows

    def layer_buffers(self, inter: int, shared_inter: int) -> dict[str, torch.Tensor]:
        """The fused layer's local buffers for these FFN sizes (allocated once): h ring,
        shared expert intermediate and output, tile counters."""
        key = (inter, shared_inter)
        bufs = self._layer_buffers.get(key)
        if bufs is None:
            N, H, dev = self.shapes.max_tokens, self.shapes.hidden, self.device
            words = self._ext.layer_counters(bytes(self.params("layer")))
            bufs = {
                "h": torch.empty(self.ring_rows, inter, dtype=torch.bfloat16, device=dev),
                "shared_h": torch.empty(N, max(shared_inter, 1), dtype=torch.bfloat16, device=dev),
                "shared_y": torch.empty(N, H, dtype=torch.bfloat16, device=dev),
                "counters": torch.zeros(words, dtype=torch.int32, device=dev),
            }
            self._layer_buffers[key] = bufs
        return bufs

    def schedule_blocks(self) -> int:
        return min(self.num_sms, _SCHEDULE_BLOCKS)

    # ---- errors --------------------------------------------------------------------------
    def raise_if_failed(self) -> None:
        """Raise the error a kernel recorded (reads host memory; no device synchronisation
        unless there is one).

        Input errors (bad expert ids, a full receive buffer, too many tokens) are found by
        every rank in the same schedule build, and every later kernel of the workspace returned
        at once without touching a peer. So each rank can, on its own, wait for its kernels,
        clear the error, and go back to the epochs it had right after that build: the next
        call runs normally on every rank. Timeouts stay: the workspace is unusable after one
        (every later call raises the same error).

        Raises:
            MoKInputError: bad routing (an expert id out of range or repeated within a token)
                recorded by a schedule build; the workspace has recovered.
            MoKCapacityError: a receive buffer too small, or more than ``max_tokens`` tokens on
                some rank, recorded by a schedule build; the workspace has recovered.
            MoKTimeoutError: a bounded wait expired (a peer did not arrive); the workspace is
                unusable until :func:`clear_workspaces`.
            MoKUnsupportedError: the kernel has no code path for this GPU.
        """
        if self.broken is not None:
            raise self.broken
        rec = self.error.tolist()
        if rec[0] == 0:
            return
        code, epoch = rec[0], rec[6]
        snapshot = self._snapshots.get(epoch)
        recoverable = code in _RECOVERABLE and snapshot is not None
        err = self._decode(rec, recoverable)
        if not recoverable:
            self.broken = err
            raise err
        torch.cuda.synchronize(self.device)
        meta = self.sched_off["meta"]
        for word in ("abort", "err_claim", "bar_count", "bad_input", "last_count"):
            self.sched[meta + _ext.META[word]] = 0
        self.sched[meta + _ext.META["bad_detail"]] = 2**31 - 1
        self.error.zero_()
        self.epochs = dict(snapshot)
        self._snapshots.clear()
        self._snapshots[epoch] = dict(snapshot)
        raise err

    def check(self) -> None:
        """Synchronise the device, then raise any recorded error (for tests and debugging).

        Raises:
            MoKInputError, MoKCapacityError, MoKTimeoutError, MoKUnsupportedError: as
                :meth:`raise_if_failed`, for every kernel launched so far.
        """
        torch.cuda.synchronize(self.device)
        self.raise_if_failed()

    def _decode(self, rec: list[int], recovered: bool = False) -> Exception:
        code, wait, peer, observed, expected, rank, epoch, extra = rec
        where = f"rank {rank}, epoch {epoch}"
        tail = (
            " Every rank raises it; the workspace has recovered and the next call runs normally."
            if recovered
            else " The workspace is unusable now; call mok.clear_workspaces() on every rank and "
            "rebuild it."
        )
        if code == _ext.ERR_TIMEOUT:
            name = _ext.LOCAL_WAITS.get(wait) or (
                _ext.SIGNALS[wait] if 0 <= wait < len(_ext.SIGNALS) else f"wait {wait}"
            )
            if wait in _ext.LOCAL_WAITS and wait != _ext.WAIT_GRID_BARRIER:
                name += f" ({extra})"  # the minibatch or row block
            return MoKTimeoutError(
                f"mok: wait '{name}' for peer {peer} timed out after "
                f"{self.config.wait_timeout_ms:g} ms on {where}: counter {observed}, expected "
                f">= {expected}. Did every rank of the group enter the layer with the same "
                f"shapes and config?{tail}",
                wait=name,
                peer=peer,
                observed=observed,
                expected=expected,
            )
        if code == _ext.ERR_CAPACITY:
            N, K, R = self.shapes.max_tokens, self.shapes.num_topk, self.num_ranks
            pad = self.num_local_experts * (self.config.row_tile - 1)
            need = math.ceil(100 * max(0, observed - pad) / (N * K)) / 100
            return MoKCapacityError(
                f"mok: rank {peer} must receive {observed} rows (padded to row_tile="
                f"{self.config.row_tile}) but its receive buffer holds {expected} "
                f"(capacity_factor={self.config.capacity_factor:g}); the overflow starts at "
                f"expert {extra}. Raise capacity_factor to at least {need:g} for this routing "
                f"({R:g} holds any routing at {R} ranks); mok never drops tokens ({where}).{tail}"
            )
        if code == _ext.ERR_TOO_MANY_TOKENS:
            sized = (
                "MoKConfig.max_tokens"
                if self.config.max_tokens
                else "MoKConfig.max_tokens=0: the default size or the first call's count, the "
                "larger; several ranks cannot grow it"
            )
            return MoKCapacityError(
                f"mok: rank {peer} passed {observed} tokens but the workspace holds at most "
                f"{expected} per rank ({sized}); set max_tokens to the largest batch any rank "
                f"passes ({where}).{tail}"
            )
        if code in (_ext.ERR_BAD_EXPERT, _ext.ERR_DUP_EXPERT):
            K = self.shapes.num_topk
            what = (
                f"expert {observed} outside [0, num_experts={expected})"
                if code == _ext.ERR_BAD_EXPERT
                else f"expert {observed} twice (each token's top-k experts must be distinct)"
            )
            return MoKInputError(
                f"mok: topk_idx of rank {peer} routes token {extra // K} (k={extra % K}) to "
                f"{what}; detected on {where}.{tail}"
            )
        if code == _ext.ERR_FAULT:
            return MoKTimeoutError(
                f"mok: a fault injected by a test stopped the fused layer at tile {extra} "
                f"({where}).{tail}",
                wait="injected fault",
                peer=peer,
                observed=observed,
                expected=expected,
            )
        if code == _ext.ERR_UNSUPPORTED:
            return MoKUnsupportedError(
                f"mok: the kernel has no code path for this GPU ({where}); the fused layer "
                f"needs sm_90a (Hopper).{tail}"
            )
        return MoKUnsupportedError(f"mok: kernel error code {code} on {where}: {rec}")


# Errors every rank finds in the same schedule build (see Workspace.raise_if_failed).
_RECOVERABLE = (
    _ext.ERR_BAD_EXPERT,
    _ext.ERR_DUP_EXPERT,
    _ext.ERR_CAPACITY,
    _ext.ERR_TOO_MANY_TOKENS,
)


def group_key(group) -> tuple:
    """What identifies ``group`` in the caches keyed by it (its name and size; ``("local",)``
    without torch.distributed)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return ("local",)
    g = group or dist.group.WORLD
    return (getattr(g, "group_name", str(id(g))), dist.get_world_size(g))


def get_workspace(
    num_tokens: int,
    hidden: int,
    num_topk: int,
    num_experts: int,
    dtype: torch.dtype = torch.bfloat16,
    config: MoKConfig | None = None,
    group=None,
    device: torch.device | int | str | None = None,
    fused: bool = False,
) -> Workspace:
    """The cached workspace of this layer shape and config (created collectively on first use).

    Creation is collective over ``group`` (every rank calls it with the same shapes and config)
    and allocates the symmetric memory; later calls only look the workspace up.

    Args:
        num_tokens: this rank's token count of the call at hand (an int >= 0); it matters only
            when ``config.max_tokens == 0``: the workspace is then created for the larger of
            the default (:func:`mok.sizing.default_max_tokens`, agreed by every rank) and the
            largest ``num_tokens`` any rank passes (one collective, at creation); at one rank
            a later call with more tokens replaces it by one at least twice as large (the
            device synchronised once). Otherwise calls of any count up to the workspace's
            ``max_tokens`` reuse it; more raise :class:`mok.MoKCapacityError` on every rank
            (from the schedule build).
        hidden: the token row width; rows must be a multiple of 16 bytes (hidden % 8 == 0 for
            bf16).
        num_topk: experts per token, in [1, 32] (``_ext.MAX_TOPK``).
        num_experts: the global expert count, divisible by the number of ranks.
        dtype: the dtype of the token rows (x and the receive buffer).
        config: the :class:`MoKConfig`, the same on every rank; None: the defaults.
        group: the process group of the expert-parallel ranks; None: the default group when
            torch.distributed is initialised, else one rank.
        device: the CUDA device (index, name or :class:`torch.device`); None or ``"cuda"``
            without an index: the current device.
        fused: a workspace of the fused layer alone (:func:`mok.functional.forward`), without
            the buffers only the stage functions use (about half the memory of a full one).

    Returns:
        The :class:`Workspace`, cached (the same object for every later call with this key)
        until :func:`clear_workspaces`.

    Raises:
        MoKInputError: num_tokens not an int >= 0; num_experts not divisible by the number of
            ranks; num_topk out of range; hidden not making 16-byte rows; ranks that disagree on
            the shapes, config or SM count; already ``MAX_WORKSPACES`` workspaces cached.
        MoKUnsupportedError: more than 72 ranks (``mok.spec.limits.MAX_RANKS``);
            ``config.num_comm_sms`` above the GPU's SM count; a symmetric allocation that does
            not start at its tensor.
    """
    config = config or MoKConfig()
    device = torch.device("cuda", torch.cuda.current_device()) if device is None else device
    device = torch.device(device)
    if device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    if isinstance(num_tokens, bool) or not isinstance(num_tokens, int) or num_tokens < 0:
        raise MoKInputError(f"num_tokens must be an int >= 0 (found {num_tokens!r})")
    key = (group_key(group), device.index, hidden, num_topk, num_experts, dtype, config, fused)
    ws = _cache.get(key)
    floor = 1
    if ws is not None and num_tokens > ws.max_tokens and ws.num_ranks == 1:
        if config.max_tokens:
            return ws  # the schedule build raises MoKCapacityError, naming max_tokens
        floor = _outgrown(key, ws, num_tokens)
        ws = None
    if ws is None:
        if len(_cache) >= MAX_WORKSPACES:
            raise MoKInputError(
                f"mok holds {len(_cache)} workspaces (one per layer shape, dtype, config and "
                f"group), the most it keeps; call mok.clear_workspaces() on every rank, or use "
                "fewer distinct configs"
            )
        shapes = Shapes(config.max_tokens or 1, hidden, num_topk, num_experts, dtype)
        ranks = key[0][1] if len(key[0]) > 1 else 1
        default = 0 if config.max_tokens else _default_tokens(shapes, config, ranks, fused, device)
        most, default = _check_same_everywhere(key, group, num_tokens, config.num_sms, default)
        max_tokens = config.max_tokens or max(floor, most, default)
        shapes = Shapes(max_tokens, hidden, num_topk, num_experts, dtype)
        ws = Workspace(shapes, config, group, device, fused)
        _cache[key] = ws
    return ws


def _default_tokens(shapes: Shapes, config: MoKConfig, ranks: int, fused: bool, device) -> int:
    """This rank's proposal for a default-sized workspace (:func:`mok.sizing.default_max_tokens`;
    ranks sharing the GPU split its memory)."""
    memory = _device_memory(device)
    return default_max_tokens(shapes, config, ranks, fused, memory, ranks if shared_gpu() else 1)


def _capturing() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def _device_memory(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).total_memory


def _outgrown(key: tuple, ws: Workspace, num_tokens: int) -> int:
    """Drop ``ws``, a one-rank workspace of a config with ``max_tokens=0`` that a call with
    ``num_tokens`` tokens outgrew (its pending errors raised first; the device synchronised
    once); the caller creates one for at least twice its tokens (the returned floor): a later
    ordinary call never fails for its size, and a growing batch grows it a few times at most.
    Several ranks cannot grow without a collective that every rank enters (a rank does not
    know its peers' counts): their workspaces keep the size they were created with."""
    if _capturing():
        raise MoKCapacityError(
            f"mok: {num_tokens} tokens, but the workspace holds at most {ws.max_tokens} and "
            "cannot grow during a CUDA graph capture; set MoKConfig.max_tokens to the largest "
            "batch"
        )
    ws.check()
    del _cache[key]  # a caller still holding it keeps a working (smaller) workspace
    return 2 * ws.max_tokens


def workspace_by_id(handle: int) -> Workspace:
    return _by_handle[handle]


def cached_workspaces() -> list[Workspace]:
    """The workspaces mok holds now (each keeps its GPU memory until clear_workspaces).

    Returns:
        A new list of the cached :class:`Workspace` objects, in creation order.
    """
    return list(_cache.values())


def check() -> None:
    """Wait for the GPU, then raise the first error any cached workspace recorded (so that it
    is attributed to the call just made; the next mok call would raise it otherwise).

    Raises:
        What :meth:`Workspace.raise_if_failed` raises, for the first workspace with an error.
    """
    for ws in list(_cache.values()):
        ws.check()


def clear_workspaces() -> None:
    """Drop every cached workspace and free its memory (collective when distributed: call on
    every rank).

    Synchronises the device. Workspaces and schedules obtained before must not be used after
    it; the next :func:`get_workspace` creates a new workspace.
    """
    import gc

    _cache.clear()
    _by_handle.clear()
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def _check_same_everywhere(
    key: tuple, group, num_tokens: int, num_sms: int, default: int = 0
) -> tuple[int, int]:
    """Check that every rank creates the same workspace, its kernels on the same SM count
    (``num_sms``: the config's budget); the largest token count of any rank and the smallest
    ``default`` (each rank's proposal of a default size: the same rule on GPUs of different
    memory gives different counts, and every rank must size alike)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return num_tokens, default
    world = dist.get_world_size(group)
    # NOTE: the launch geometry too: the fused layer runs one block per SM and its fill targets
    # count the peers' blocks as its own grid.
    sms = budget_sms(torch.cuda.current_device(), num_sms)
    mine = f"{key[2:]!r} with {sms} SMs"
    # NOTE: only on workspace creation (once per shape/config), never in the steady state.
    t = torch.tensor(list(mine.encode()), dtype=torch.uint8)
    n = torch.tensor([t.numel(), num_tokens, default], dtype=torch.int64)
    dev = torch.device("cuda", torch.cuda.current_device())
    ns = [torch.empty_like(n, device=dev) for _ in range(world)]
    dist.all_gather(ns, n.to(dev), group=group)
    lengths = [int(x[0].item()) for x in ns]
    size = max(lengths)
    pad = torch.zeros(size, dtype=torch.uint8, device=dev)
    pad[: t.numel()] = t.to(dev)
    parts = [torch.empty_like(pad) for _ in range(world)]
    dist.all_gather(parts, pad, group=group)
    texts = [bytes(p[:k].tolist()).decode() for p, k in zip(parts, lengths, strict=True)]
    if any(x != mine for x in texts):
        diff = "; ".join(f"rank {r}: {x}" for r, x in enumerate(texts))
        raise MoKInputError(
            f"ranks disagree on the layer's shapes, config or GPU (SM count): {diff}"
        )
    return max(int(x[1].item()) for x in ns), min(int(x[2].item()) for x in ns)
