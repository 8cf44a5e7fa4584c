"""Functional layer: schedule, dispatch, combine and an MoE forward built from them.

All calls are asynchronous: no ``.item()``, no host-side counts, no shape-dependent host
allocation. Sizes that depend on the routing (rows received, dedup rows) stay on the device; the
receive buffer has the fixed capacity of the workspace (:meth:`MoKConfig.capacity_rows`).

:func:`forward` runs the whole layer (dispatch, routed and shared SwiGLU experts, combine) as
one fused kernel on Hopper; :func:`moe_forward` builds the schedule and calls it
(``fused=True``) or composes the communication kernels with ``torch._grouped_mm`` experts.
Wherever a config is taken, a :class:`MoKConfig`, a dict or the path of the JSON that
``mok-sim tune --emit-config`` writes are accepted.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from mok import _ext, ops
from mok.config import MoKConfig
from mok.errors import MoKInputError, MoKUnsupportedError
from mok.workspace import Workspace, get_workspace

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
    """A :class:`MoKConfig` from itself, a dict, a JSON string or a JSON file path (the file
    ``mok-sim tune --emit-config`` writes), or the defaults for None."""
    if config is None:
        return MoKConfig()
    if isinstance(config, MoKConfig):
        return config
    return MoKConfig.from_json(config)


@dataclass
class DeviceSchedule:
    """The schedule table on the device (views into the workspace; valid until the next
    :func:`build_schedule` on the same workspace).

    Row-indexed arrays have the workspace capacity; rows at or past ``num_rows`` (and dedup
    rows past ``num_dedup_rows``) are unspecified. All int32.
    """

    ws: Workspace
    topk_idx: torch.Tensor  # [num_tokens, num_topk] int32 (this rank's routing)
    topk_weights: torch.Tensor  # [num_tokens, num_topk] fp32

    @property
    def num_tokens(self) -> int:
        """This rank's tokens in this call (0..ws.max_tokens; ranks may differ)."""
        return self.topk_idx.shape[0]

    def _v(self, name: str, n: int) -> torch.Tensor:
        return self.ws.sched_view(name, n)

    @property
    def counts_all(self) -> torch.Tensor:  # [num_experts, num_ranks] (M of every expert)
        return self._v("counts", self.ws.shapes.num_experts * self.ws.num_ranks).view(
            self.ws.shapes.num_experts, self.ws.num_ranks
        )

    @property
    def counts(self) -> torch.Tensor:  # [num_local_experts, num_ranks]
        L, r = self.ws.num_local_experts, self.ws.rank
        return self.counts_all[r * L : (r + 1) * L]

    @property
    def offsets_all(self) -> torch.Tensor:  # [num_ranks, num_local_experts + 1]
        R, L = self.ws.num_ranks, self.ws.num_local_experts
        return self._v("offsets", R * (L + 1)).view(R, L + 1)

    @property
    def offsets(self) -> torch.Tensor:  # [num_local_experts + 1]
        return self.offsets_all[self.ws.rank]

    def _rows(self, name: str) -> torch.Tensor:  # [capacity]
        return self._v(name, self.ws.capacity)

    @property
    def src_rank(self) -> torch.Tensor:
        return self._rows("src_rank")

    @property
    def src_index(self) -> torch.Tensor:
        return self._rows("src_index")

    @property
    def fanout(self) -> torch.Tensor:
        return self._rows("fanout")

    def _nk(self, name: str) -> torch.Tensor:  # [num_tokens, num_topk]
        n, k = self.num_tokens, self.ws.shapes.num_topk
        return self._v(name, n * k).view(n, k)

    @property
    def dst_rank(self) -> torch.Tensor:
        return self._nk("dst_rank")

    @property
    def dst_index(self) -> torch.Tensor:
        return self._nk("dst_index")

    def _dedup(self, name: str) -> torch.Tensor:  # [num_ranks * max_tokens]
        return self._v(name, self.ws.num_ranks * self.ws.max_tokens)

    @property
    def dedup_src_rank(self) -> torch.Tensor:
        return self._dedup("dedup_src_rank")

    @property
    def dedup_src_token(self) -> torch.Tensor:
        return self._dedup("dedup_src_token")

    @property
    def dedup_slot(self) -> torch.Tensor:
        return self._dedup("dedup_slot")

    @property
    def num_rows(self) -> torch.Tensor:  # [1] int32 on the device
        return self.ws.sched_view("meta", 1)

    @property
    def num_dedup_rows(self) -> torch.Tensor:  # [1] int32 on the device
        m = self.ws.sched_off["meta"] + 1
        return self.ws.sched[m : m + 1]

    @property
    def group_ends(self) -> torch.Tensor:  # [num_local_experts] int32: padded region ends
        return self.offsets[1:]

    def to_host(self) -> dict[str, torch.Tensor]:
        """Synchronise and return the table trimmed to its real sizes as CPU int64 tensors,
        named like :class:`reference.schedule.Schedule` (for tests and debugging)."""
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

    ``num_tokens`` may be anything from 0 to ``ws.max_tokens`` and differ between ranks.
    Expert ids out of range or repeated within a token are detected on the device and raised
    (as :class:`mok.MoKInputError`, on every rank) by the next mok call or
    :meth:`Workspace.check`; the workspace then recovers (the call after the one that raised
    runs normally). More than ``ws.max_tokens`` tokens raise :class:`mok.MoKCapacityError`
    here, and on the other ranks at their next mok call.
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


# Rows of at least this many bytes move faster through the bulk-copy rings; smaller rows make
# their single issuing thread the limit, and 16-byte vector loads win (docs/perf-notes.md v3, v4).
_TMA_MIN_ROW_BYTES = 8192


def _engine(ws: Workspace, engine: str, engines: tuple[str, ...] = ops.ENGINES) -> str:
    """Resolve ``auto`` by row size; check anything else."""
    if engine == "auto":
        return "tma" if ws.row_bytes >= _TMA_MIN_ROW_BYTES else "vector"
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

    x: [num_tokens, hidden] (the workspace dtype). Returns the receive buffer [capacity, hidden]
    (a workspace view, valid until the next dispatch): rows ``offsets[l]..offsets[l] +
    tokens_per_expert[l]`` hold local expert l's tokens in schedule order; padding rows and rows
    past ``num_rows`` are unspecified. Writing x into ``ws.x_buffer`` first saves a copy: call
    ``ws.wait_x_free()`` before that write (peers may still be pulling the previous rows).

    ``dedup_pull`` with ``fan_out=False`` moves one row per (token, destination rank) only and
    returns the dedup buffer [num_ranks * num_tokens, hidden] (row i = dedup row i, see
    ``schedule.dedup_src_rank`` / ``dedup_src_token``; rows past ``num_dedup_rows``
    unspecified); :func:`fanout` then fills the receive buffer. ``skip_local`` (with
    ``fan_out=False``) moves only the rows of other ranks' tokens: the rows of this rank's own
    tokens stay unspecified in the dedup buffer and are read from ``ws.x_buffer`` by
    ``fanout(..., skip_local=True)`` (the data is already local). ``engine``: ``tma`` (bulk
    copies) or ``vector`` (16-byte loads/stores, v1) for the pull modes; ``auto`` takes
    ``tma`` for rows of at least 8 KiB, else ``vector``.
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
    """Local fan-out of a dedup buffer (``dispatch(..., 'dedup_pull', fan_out=False)``) into
    the expert-contiguous receive buffer, which it returns (as :func:`dispatch` does).
    ``skip_local``: the dedup buffer came from ``dispatch(..., skip_local=True)``; this rank's
    own rows are read from the workspace x buffer (which the dispatch filled)."""
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
    """Return expert outputs to their home rank and sum them in fixed order:
    ``out = bf16(shared_y + w_0 * y_0 + w_1 * y_1 + ...)`` (fp32, separate roundings).

    ``mode`` is ``push`` or ``pull`` (default: the config's combine_mode); ``dedup`` (default:
    the config's dispatch_mode is ``dedup_pull``) first sums each token's rows on the expert
    owner in k order into one partial per (token, rank); ``push`` then pushes the partials
    into the home rank's slots, ``pull`` runs :func:`dedup_partials` + :func:`dedup_sum` (the
    home rank reads the partials from the owners). Returns [num_tokens, hidden] bf16.
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
    """Expert-side step of the dedup pull combine (the fused layer's GEMM epilogue): for every
    dedup row, the sum over this rank's rows of that token, in k order, of w * y (fp32, stored
    bf16) into the workspace's symmetric partials buffer. ``grid``: blocks (default
    num_comm_sms); ``engine``: ``vector`` (16-byte loads, a warp per row) or ``tma`` (bulk
    copies into shared memory, consumer warps)."""
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
    """Transfer step of the dedup pull combine: the home rank reads its tokens' partials from
    every owner (after their :func:`dedup_partials`) and returns ``bf16(shared_y + partial_0 +
    partial_1 + ...)`` in ascending owner rank order, [num_tokens, hidden]. ``engine``:
    ``vector`` (a warp per row, 16-byte loads), ``tma`` (the peers' partial rows bulk-loaded
    whole into a shared-memory ring, the local terms read by consumer warps; with many ranks,
    when whole rows do not fit, 4 KiB chunks of every term), ``auto`` (``tma`` for rows of at
    least 8 KiB, else ``vector``), or ``gather`` (a warp per row, several row chunks of every
    term in flight through cp.async; slower than ``vector`` on 2x H200, docs/perf-notes.md
    v3). ``release``: this is the last sum of these partials, so their owners may overwrite
    them with the next :func:`dedup_partials` (a later sum of them raises); pass False to every
    sum but the last when one set of partials is summed several times."""
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


# Tile sizes of the fused layer (csrc/layer.cuh): 128 receive rows, 256 output columns of the
# down projection, 128 SwiGLU columns of the gate/up projection.
_FUSED_BLOCK_ROWS, _FUSED_HIDDEN_TILE, _FUSED_INTER_TILE = 128, 256, 128
# Expert regions padded to 64 rows run their 64-row tails as half tiles (csrc/layer.cuh).
_FUSED_ROW_TILES = (64, 128)


def _check_fused(ws: Workspace, weights, x: torch.Tensor, num_tokens: int) -> None:
    """Raise a clear error for everything the fused layer does not support (yet)."""
    cap = torch.cuda.get_device_capability(ws.device)
    if cap != (9, 0):
        raise MoKUnsupportedError(
            f"the fused layer has a Hopper (sm_90a) path only; found "
            f"{torch.cuda.get_device_name(ws.device)} (sm_{cap[0]}{cap[1]}, {_ext._versions()}). "
            "Use moe_forward(..., fused=False) (communication kernels + torch grouped GEMM)"
        )
    cfg, s = ws.config, ws.shapes
    if s.dtype != torch.bfloat16:
        raise MoKUnsupportedError(f"the fused layer runs bf16 tokens (workspace dtype {s.dtype})")
    if cfg.dispatch_mode not in ("pull", "dedup_pull") or cfg.combine_mode != "push":
        raise MoKUnsupportedError(
            f"the fused layer supports dispatch_mode pull or dedup_pull with combine_mode push "
            f"(config has {cfg.dispatch_mode!r} / {cfg.combine_mode!r}); the other modes run "
            "through moe_forward(..., fused=False)"
        )
    if cfg.row_tile not in _FUSED_ROW_TILES:
        raise MoKUnsupportedError(
            f"the fused layer needs row_tile in {_FUSED_ROW_TILES} (config has {cfg.row_tile})"
        )
    if cfg.minibatch_size % _FUSED_BLOCK_ROWS:
        raise MoKUnsupportedError(
            f"the fused layer needs minibatch_size % {_FUSED_BLOCK_ROWS} == 0 (its GEMM row "
            f"blocks must not straddle minibatches; config has {cfg.minibatch_size})"
        )
    if not 1 <= cfg.num_comm_sms < ws.num_sms:
        raise MoKUnsupportedError(
            f"the fused layer needs 1 <= num_comm_sms < {ws.num_sms} SMs (config has "
            f"{cfg.num_comm_sms})"
        )
    L, H = ws.num_local_experts, s.hidden
    inter = weights.w_gate.shape[1]
    shared_inter = 0 if weights.shared_w_gate is None else weights.shared_w_gate.shape[0]
    if H % _FUSED_HIDDEN_TILE:
        raise MoKUnsupportedError(
            f"the fused layer needs hidden % {_FUSED_HIDDEN_TILE} == 0 (found hidden={H})"
        )
    for name, n in (("intermediate", inter), ("shared intermediate", shared_inter)):
        if n % _FUSED_INTER_TILE:
            raise MoKUnsupportedError(
                f"the fused layer needs {name} % {_FUSED_INTER_TILE} == 0 (found {n})"
            )
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
    x: torch.Tensor, schedule: DeviceSchedule, weights, trace: torch.Tensor | None = None
) -> torch.Tensor:
    """The fused MoE layer forward on this rank (one kernel launch; Hopper).

    x: [num_tokens, hidden] bf16; ``schedule``: :func:`build_schedule` of this call's routing
    (its workspace carries the config: communication SMs, minibatch, ring size = macrobatch,
    dispatch mode pull / dedup_pull); ``weights``: routed w_gate / w_up [L, I, H] and w_down
    [L, H, I], optional shared_w_gate / shared_w_up [Is, H] and shared_w_down [H, Is]
    (:class:`reference.weights.MoEWeights` layout), all bf16. Returns [num_tokens, hidden] bf16
    = ``bf16(shared(x) + sum_k w_k expert_k(x))`` with the sum in fixed order (fp32), so the
    result is bitwise reproducible. Errors recorded by the kernel (timeouts, capacity) are
    raised by the next mok call or :meth:`Workspace.check`. ``trace``: a buffer from
    :func:`mok.layer_trace.new_trace` that the kernel fills with per-tile timestamps.
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
    weights,  # w_gate/w_up [L, I, H], w_down [L, H, I] bf16; optional shared_w_* (MoEWeights)
    num_experts: int,
    config: MoKConfig | dict | str | Path | None = None,
    group=None,
    fused: bool = False,
) -> torch.Tensor:
    """The MoE layer on this rank: schedule, dispatch, grouped SwiGLU experts, combine.

    ``fused``: run :func:`forward` (one kernel); else the communication kernels with
    ``torch._grouped_mm`` experts. ``config``: see :func:`as_config`.
    Returns [num_tokens, hidden] bf16 = shared(x) + sum_k w_k expert_k(x).
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
