"""torch.library custom ops over the CUDA kernels (with fake implementations, so torch.compile
can trace graphs that call them).

Each op mutates workspace buffers passed as arguments and returns nothing; ``handle`` names the
:class:`mok.workspace.Workspace` (``Workspace.id``). The ops never synchronise with the host:
they raise an error a previous kernel recorded (host-mapped memory), bump host-side epochs and
launch.
"""

from __future__ import annotations

import functools
import inspect

import torch

from mok import _ext, record
from mok.errors import MoKInputError, MoKUnsupportedError
from mok.sms import budget_sms
from mok.workspace import workspace_by_id

__all__ = [
    "build_schedule",
    "dispatch",
    "fanout",
    "combine",
    "dedup_partials",
    "dedup_sum",
    "layer_forward",
    "swiglu_backward_sm90",
    "swiglu_saving_gather_sm90",
    "swiglu_backward_gather_sm90",
    "wgrad_gather_sm90",
    "wgrad_sm90",
    "bwd_fused_sm90",
    "bwd_layer_sm90",
]

# Whether the fused backward's gate / up dgrad (d_a) stages each tile's output in shared memory
# and stores it by TMA, overlapping the next tile's k-loop, instead of every thread storing its
# words to global memory (launches without token transfers; with them d_a goes to scattered
# slots and each thread stores). The same values either way; its own switch so one build times
# both (docs/perf-notes.md, "d_a's epilogue staged").
STAGED_DA = True

# Whether the experts' backward computes dW_gate_up as its transpose x^T dgu, each tile stored
# transposed into the weight's [L, 2I, H] layout (the weight-gradient kernels' ``transposed``
# form): x's rows are then the kernel's 128-column operand, so the one-rank backward that
# gathers them copies a third of each k-block's bytes by cp.async instead of two thirds. Read by
# mok.experts where dW_gate_up is computed with one launch per GEMM (dispatched or gathered
# rows) and here by the fused backward's launches (bwd_fused_sm90, bwd_layer_sm90), so that
# every path of one setting computes it the same way: the gathered and dispatched backwards
# give the same bits, and EP > 1 EP1's. On: the gathering kernel ran 0.85 -> 0.65 ms a step at
# SonicMoE's fine-grained shape, the TMA and fused kernels within 2 % either way (one H100;
# docs/perf-notes.md, "dW_gate_up stored transposed"). Both settings give the same bits (a GPU
# test compares every path with it off and on).
WGRAD_GU_TRANSPOSED = True

# Row-copy engines of the pull dispatches: bulk copies (TMA) or 16-byte vector loads (v1).
ENGINES = ("tma", "vector")
# dedup_sum also has the cp.async gather ring (v3; slower than vector on 2x H200, kept for study).
SUM_ENGINES = ("gather", "tma", "vector")

_DISPATCH_KERNELS = {
    "pull": "dispatch_pull",
    "dedup_pull": "dispatch_dedup_pull",
    "push": "dispatch_push",
}


# NOTE: the kernels' per-call epochs are host counters, so a captured launch would replay with
# the captured epoch; tagged, torch.compile's CUDA graphs (mode="reduce-overhead") leave mok's
# ops out of the captured partitions, and a direct capture is refused (Workspace.launch).
TAGS = (torch.Tag.cudagraph_unsafe,) if hasattr(torch.Tag, "cudagraph_unsafe") else None


def _mok_op(name: str, mutates_args: tuple[str, ...]):
    """``torch.library.custom_op`` with an eager fast path.

    Outside tracing, a call runs the op's body directly and bumps the version counters of the
    tensors it mutates itself: the dispatcher's bookkeeping costs tens of microseconds of host
    time per call, a large share of a small layer's time. Under torch.compile, and whenever an
    argument is a fake, functional or other tensor subclass (make_fx, FakeTensorMode), the call
    goes through the registered op and its fake implementation.
    """

    def wrap(body):
        op = torch.library.custom_op(name, mutates_args=mutates_args, tags=TAGS)(body)
        params = list(inspect.signature(body).parameters)
        mutated = tuple(params.index(a) for a in mutates_args)

        @functools.wraps(body)
        def call(*args):
            if traced(args):
                return op(*args)
            for i in mutated:
                if i < len(args) and args[i] is not None:
                    torch.autograd.graph.increment_version(args[i])
            return body(*args)

        call.op = op
        call.register_fake = op.register_fake
        return call

    return wrap


_PLAIN_TENSORS = (torch.Tensor, torch.nn.Parameter)


def traced(args) -> bool:
    """Whether a call with these arguments is being traced (torch.compile, or a tensor argument
    that is a fake, functional or other subclass, as under make_fx or FakeTensorMode): then mok
    calls its registered ops, whose fake implementations give the shapes, rather than the
    bodies."""
    return torch.compiler.is_compiling() or not all(
        type(a) in _PLAIN_TENSORS for a in args if isinstance(a, torch.Tensor)
    )


def _stamps(ws, p) -> None:
    """Point the kernel at the workspace's phase-stamp buffer, if one is set (diagnostics)."""
    if ws.stamps is not None:
        p.in3 = ws.stamps.data_ptr()
        p.flags |= _ext.FLAG_STAMPS


@_mok_op("mok::build_schedule", ("sched",))
def build_schedule(
    topk_idx: torch.Tensor,  # [num_tokens, num_topk] int32
    topk_weights: torch.Tensor,  # [num_tokens, num_topk] fp32
    sched: torch.Tensor,  # workspace schedule storage, int32
    handle: int,
) -> None:
    ws = workspace_by_id(handle)
    ws.raise_if_failed()
    p = ws.params("route", topk_idx.shape[0], advance=True)
    p.in0, p.in1 = topk_idx.data_ptr(), topk_weights.data_ptr()
    if ws.config.row_order == "source":
        p.flags |= _ext.FLAG_SOURCE_ORDER
    _stamps(ws, p)
    ws.launch("schedule", p, ws.schedule_blocks())
    ws.advance("route")


@build_schedule.register_fake
def _(topk_idx, topk_weights, sched, handle) -> None:
    return None


@_mok_op("mok::dispatch", ("recv",))
def dispatch(
    x: torch.Tensor,  # [num_tokens, hidden]
    sched: torch.Tensor,  # workspace schedule storage, int32
    recv: torch.Tensor,  # [capacity, hidden] workspace receive buffer
    handle: int,
    mode: str,
    fan_out: bool = True,
    engine: str = "tma",
    skip_local: bool = False,
) -> None:
    """``recv`` is the dedup buffer ([ws.dedup_rows, hidden]) when ``mode`` is
    ``dedup_pull`` and ``fan_out`` is False; ``skip_local`` leaves this rank's own rows out of
    it (they stay in the x buffer)."""
    ws = workspace_by_id(handle)
    ws.raise_if_failed()
    family = "recv" if mode == "push" else "x"
    p = ws.params(family, x.shape[0], advance=True)
    p.in0, p.out0 = x.data_ptr(), recv.data_ptr()
    if mode != "push" and x.data_ptr() != ws.x_buffer.data_ptr():
        p.flags |= _ext.FLAG_STAGE
    if engine == "vector":
        p.flags |= _ext.FLAG_VECTOR
    if mode == "dedup_pull" and not fan_out:
        p.flags |= _ext.FLAG_NO_FANOUT
        if skip_local:
            p.flags |= _ext.FLAG_SKIP_LOCAL
    if mode == "dedup_pull":
        _stamps(ws, p)
    ws.launch(_DISPATCH_KERNELS[mode], p, ws.config.num_comm_sms)
    ws.advance(family)


@_mok_op("mok::zero_padding", ("buf",))
def zero_padding(
    buf: torch.Tensor,  # [capacity, hidden]: a receive buffer of the schedule in sched
    sched: torch.Tensor,  # workspace schedule storage, int32
    handle: int,
) -> None:
    """Zeros into ``buf``'s padding rows (before ``num_rows``, without a token); other rows keep
    their values (csrc/comm/dispatch_kernels.cuh zero_padding_kernel)."""
    ws = workspace_by_id(handle)
    ws.raise_if_failed()
    p = ws.params(None)
    p.out0 = buf.data_ptr()
    ws.launch("zero_padding", p, ws.num_sms)


@zero_padding.register_fake
def _(buf, sched, handle) -> None:
    return None


@dispatch.register_fake
def _(x, sched, recv, handle, mode, fan_out=True, engine="tma", skip_local=False) -> None:
    return None


@_mok_op("mok::fanout", ("recv",))
def fanout(
    dedup: torch.Tensor,  # [ws.dedup_rows, hidden] dedup buffer
    sched: torch.Tensor,
    recv: torch.Tensor,  # [capacity, hidden] workspace receive buffer
    handle: int,
    engine: str = "tma",
    skip_local: bool = False,
) -> None:
    ws = workspace_by_id(handle)
    ws.raise_if_failed()
    p = ws.params(None)
    p.in0, p.out0 = dedup.data_ptr(), recv.data_ptr()
    if engine == "vector":
        p.flags |= _ext.FLAG_VECTOR
    if skip_local:
        p.flags |= _ext.FLAG_SKIP_LOCAL
    ws.launch("fanout", p, ws.config.num_comm_sms)


@fanout.register_fake
def _(dedup, sched, recv, handle, engine="tma", skip_local=False) -> None:
    return None


@_mok_op("mok::dedup_partials", ("partials",))
def dedup_partials(
    y: torch.Tensor,  # [capacity, hidden] bf16 expert outputs in schedule row order
    sched: torch.Tensor,
    partials: torch.Tensor,  # workspace partials buffer (symmetric)
    handle: int,
    grid: int = 0,
    engine: str = "vector",
) -> None:
    ws = workspace_by_id(handle)
    ws.raise_if_failed()
    if ws.partials_released != ws.epochs["partials"]:
        raise MoKInputError(
            "mok: dedup_partials before a releasing dedup_sum of the previous partials (every "
            "sum ran with release=False): the new partials would wait for the peers' "
            "'consumed' signal forever; end the previous sums with dedup_sum(..., release=True)"
        )
    p = ws.params("partials", advance=True)
    p.in0 = y.data_ptr()
    if engine == "vector":
        p.flags |= _ext.FLAG_VECTOR
    ws.launch("dedup_partials", p, grid or ws.config.num_comm_sms)
    ws.advance("partials")


@dedup_partials.register_fake
def _(y, sched, partials, handle, grid=0, engine="vector") -> None:
    return None


@_mok_op("mok::dedup_sum", ("out",))
def dedup_sum(
    sched: torch.Tensor,
    shared_y: torch.Tensor | None,  # [num_tokens, hidden] bf16 or fp32
    out: torch.Tensor,  # [num_tokens, hidden] bf16
    handle: int,
    engine: str = "vector",
    release: bool = True,
) -> None:
    ws = workspace_by_id(handle)
    ws.raise_if_failed()
    if ws.epochs["partials"] == 0:
        raise MoKInputError("mok: dedup_sum before any dedup_partials on this workspace")
    if ws.partials_released == ws.epochs["partials"]:
        raise MoKInputError(
            "mok: dedup_sum after a sum that released these partials (its peers may be "
            "overwriting them now); run dedup_partials again, or pass release=False to every "
            "sum of one partials epoch but the last"
        )
    p = ws.params("partials", out.shape[0])
    p.out0 = out.data_ptr()
    if shared_y is not None:
        p.in2 = shared_y.data_ptr()
        p.flags |= _ext.FLAG_HAS_SHARED
        if shared_y.dtype == torch.float32:
            p.flags |= _ext.FLAG_SHARED_FP32
    if engine == "vector":
        p.flags |= _ext.FLAG_VECTOR
    elif engine == "gather":
        p.flags |= _ext.FLAG_GATHER
    if not release:
        p.flags |= _ext.FLAG_KEEP
    _stamps(ws, p)
    ws.launch("dedup_sum", p, ws.config.num_comm_sms)
    if release:
        ws.partials_released = ws.epochs["partials"]


@dedup_sum.register_fake
def _(sched, shared_y, out, handle, engine="vector", release=True) -> None:
    return None


@_mok_op("mok::combine", ("out",))
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
    p = ws.params(family, out.shape[0], advance=True)
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
    ws.advance(family)


@combine.register_fake
def _(y, sched, topk_idx, topk_weights, shared_y, out, handle, mode) -> None:
    return None


@_mok_op("mok::layer_forward", ("out", "gu32", "shared_gu32", "trace"))
def layer_forward(
    x: torch.Tensor,  # [num_tokens, hidden] bf16
    sched: torch.Tensor,  # workspace schedule storage, int32 (built for this routing)
    topk_weights: torch.Tensor,  # [num_tokens, num_topk] fp32
    w_gate: torch.Tensor,  # [L, I, H] bf16
    w_up: torch.Tensor,  # [L, I, H] bf16
    w_down: torch.Tensor,  # [L, H, I] bf16
    shared_w_gate: torch.Tensor | None,  # [Is, H] bf16
    shared_w_up: torch.Tensor | None,  # [Is, H] bf16
    shared_w_down: torch.Tensor | None,  # [H, Is] bf16
    out: torch.Tensor,  # [num_tokens, hidden] bf16
    # the saving mode (recompute=False): fp32 [receive rows, 2I] g | u of every routed row
    # (rows past the schedule's num_rows untouched) and [num_tokens, 2Is] of the shared
    # expert; None: off
    gu32: torch.Tensor | None,
    shared_gu32: torch.Tensor | None,
    handle: int,
    # int64 [num_sms, 2, entries, 2], zeroed (layer_trace), or None. NOTE: no default: the
    # dispatcher drops trailing defaulted arguments, and torch 2.11's mutation bookkeeping then
    # indexes past the end of the argument tuple (pytorch issue 176078).
    trace: torch.Tensor | None,
) -> None:
    """The fused layer forward (csrc/layer/sm90_fwd.cuh): dispatch, routed and shared SwiGLU
    experts, combine, in one launch over every SM of the GPU."""
    ws = workspace_by_id(handle)
    ws.raise_if_failed()
    inter = w_gate.shape[1]
    shared_inter = 0 if shared_w_gate is None else shared_w_gate.shape[0]
    bufs = ws.layer_buffers(inter, shared_inter)
    dedup = ws.dedup_buffer if ws.config.dispatch_mode == "dedup_pull" else None
    p = ws.params("layer", x.shape[0], advance=True)
    p.in0, p.in1, p.out0 = x.data_ptr(), topk_weights.data_ptr(), out.data_ptr()
    if ws.config.dispatch_mode == "dedup_pull":
        p.flags |= _ext.FLAG_DEDUP
    a = _ext.LayerArgs()
    a.inter, a.shared_inter = inter, shared_inter
    a.num_comm_blocks, a.ring_rows = ws.config.num_comm_sms, ws.ring_rows
    a.w_gate, a.w_up, a.w_down = w_gate.data_ptr(), w_up.data_ptr(), w_down.data_ptr()
    # gate rows of consecutive experts: I apart, or 2I in the halves of one [L, 2I, H] tensor
    a.gate_up_stride = w_gate.stride(0) // w_gate.shape[2] if w_gate.shape[0] > 1 else inter
    if shared_inter:
        p.in2 = bufs["shared_y"].data_ptr()
        p.flags |= _ext.FLAG_HAS_SHARED
        a.shared_w_gate = shared_w_gate.data_ptr()
        a.shared_w_up = shared_w_up.data_ptr()
        a.shared_w_down = shared_w_down.data_ptr()
    a.h, a.shared_h = bufs["h"].data_ptr(), bufs["shared_h"].data_ptr()
    if dedup is not None:
        a.dedup = dedup.data_ptr()
    a.counters, a.counters_len = bufs["counters"].data_ptr(), bufs["counters"].numel()
    if trace is not None:
        a.trace, a.trace_entries = trace.data_ptr(), trace.shape[2]
    if gu32 is not None:
        a.gu32 = gu32.data_ptr()
    if shared_gu32 is not None:
        a.shared_gu32 = shared_gu32.data_ptr()
    if ws.fault is not None:
        p.in3, p.flags = 2 * ws.fault[0] + ws.fault[1], p.flags | _ext.FLAG_FAULT
    ws.launch_layer(p, a)
    ws.advance("layer")


@layer_forward.register_fake
def _(
    x,
    sched,
    topk_weights,
    w_gate,
    w_up,
    w_down,
    shared_w_gate,
    shared_w_up,
    shared_w_down,
    out,
    gu32,
    shared_gu32,
    handle,
    trace,
) -> None:
    return None


@_mok_op("mok::swiglu_backward_sm90", ("hw", "dgu", "part", "gu32"))
def swiglu_backward_sm90(
    a: torch.Tensor,  # [R, H] bf16, rows grouped by expert
    dy: torch.Tensor,  # [R, H] bf16: the gradient of each row's output, before its weight
    w_gate_up: torch.Tensor,  # [L, 2I, H] bf16, contiguous
    w_down: torch.Tensor,  # [L, H, I] bf16, contiguous
    group_ends: torch.Tensor,  # [L] int32
    row_w: torch.Tensor | None,  # [R] fp32 routing weights (None: 1)
    hw: torch.Tensor,  # [R, I] bf16 out: SwiGLU's output x the row's routing weight
    dgu: torch.Tensor,  # [R, 2I] bf16 out
    # [I / 128, R] fp32 out (router-weight partials), or None. NOTE: no default (layer_forward)
    part: torch.Tensor | None,
    gu32: torch.Tensor | None,  # [R, 2I] fp32 g | u: out in mode 1, in in mode 2
    mode: int,  # 0: recompute g / u; 1: a forward that saves them (h into hw); 2: from saved
) -> None:
    """The experts' backward kernel (csrc/layer/sm90_bwd.cuh): per expert group the down
    projection's dgrad and the gate / up GEMM recomputed, with the SwiGLU backward in the
    epilogue, over every SM of the GPU (``mode`` 0; 1 and 2 split it at g / u, see
    ``SwigluBwdLaunch`` in csrc/api.h). Rows past the last group end are left unwritten."""
    _launch_swiglu(a, dy, w_gate_up, w_down, group_ends, row_w, hw, dgu, part, gu32, None, mode)


def _launch_swiglu(a, dy, w_gate_up, w_down, group_ends, row_w, hw, dgu, part, gu32, gather, mode):
    """One launch of the experts' kernel; ``gather``: None, or (x, grad_out, row_src, num_topk)
    whose rows the gate / up GEMM (x) and, mode 0 with grad_out not None, the dh GEMM
    (grad_out) read in place of ``a``'s and ``dy``'s (``a`` then only gives the row count)."""
    rows = a.shape[0]
    if rows == 0:
        return
    L, two_i, hidden = w_gate_up.shape
    dev = a.device
    gx, gdy, gsrc, topk = gather if gather is not None else (None, None, None, 0)
    tokens = 0 if gather is None else (gx if gx is not None else gdy).shape[0]
    # the kernel's tile counter (zeroed by the launcher on this stream)
    next_tile = torch.empty(1, dtype=torch.int32, device=dev)
    _ext.load().launch_swiglu_bwd(
        0 if gather is not None else a.data_ptr(),
        dy.data_ptr(),
        w_gate_up.data_ptr(),
        w_down.data_ptr(),
        group_ends.data_ptr(),
        0 if row_w is None else row_w.data_ptr(),
        hw.data_ptr(),
        dgu.data_ptr(),
        0 if part is None else part.data_ptr(),
        0 if gu32 is None else gu32.data_ptr(),
        next_tile.data_ptr(),
        0 if gx is None else gx.data_ptr(),
        0 if gdy is None else gdy.data_ptr(),
        0 if gsrc is None else gsrc.data_ptr(),
        tokens,
        topk,
        mode,
        rows,
        hidden,
        two_i // 2,
        L,
        budget_sms(dev),
        torch.cuda.current_stream(dev).cuda_stream,
    )


@_mok_op("mok::swiglu_saving_gather_sm90", ("h", "gu32"))
def swiglu_saving_gather_sm90(
    x: torch.Tensor,  # [T, H] bf16, contiguous: the tokens
    row_src: torch.Tensor,  # [>= R] int32: token * num_topk + k of each row, -1 for padding
    num_topk: int,
    w_gate_up: torch.Tensor,  # [L, 2I, H] bf16, contiguous
    w_down: torch.Tensor,  # [L, H, I] bf16, contiguous (its shape only)
    group_ends: torch.Tensor,  # [L] int32
    h: torch.Tensor,  # [R, I] bf16 out: bf16(silu(g) u)
    gu32: torch.Tensor | None,  # [R, 2I] fp32 out: g | u, or None (h only)
) -> None:
    """The experts' saving forward (``swiglu_backward_sm90`` mode 1) with its rows gathered from
    the tokens inside the gate / up GEMM's operand loads (row r is ``x[row_src[r] // num_topk]``,
    zeros where ``row_src`` is -1): no receive buffer is written or read. Without ``gu32``
    only h is written (a forward that recomputes g / u in its backward)."""
    _launch_swiglu(
        h, h, w_gate_up, w_down, group_ends, None, h, h, None, gu32, (x, None, row_src, num_topk), 1
    )


@swiglu_saving_gather_sm90.register_fake
def _(x, row_src, num_topk, w_gate_up, w_down, group_ends, h, gu32) -> None:
    return None


@swiglu_backward_sm90.register_fake
def _(a, dy, w_gate_up, w_down, group_ends, row_w, hw, dgu, part, gu32, mode) -> None:
    return None


@_mok_op("mok::wgrad_sm90", ("c",))
def wgrad_sm90(
    a: torch.Tensor,  # [R, M] bf16, rows grouped by expert
    b: torch.Tensor,  # [R, N] bf16
    group_ends: torch.Tensor,  # [L] int32, multiples of 16
    # [L, M, N] bf16 or fp32 out: c[e] = a[e]^T b[e] (zero for an empty group); [L, N, M] with
    # transposed: c[e] = (a[e]^T b[e])^T
    c: torch.Tensor,
    accumulate: bool = False,  # fp32 c only: c[e] += a[e]^T b[e] (an fp32 gradient accumulator)
    transposed: bool = False,  # each tile stored transposed (the same sums)
) -> None:
    """The experts' weight-gradient kernel (csrc/layer/sm90_bwd.cuh wgrad_kernel), over every
    SM of the GPU. With ``accumulate`` each element of ``c`` gets one fp32 add of its tile's sum
    (no split-K), so the result does not depend on the order of the tiles. ``transposed``: the
    same tiles, each stored as its transpose (dW_gate_up computed as x^T dgu, x's rows the
    128-column operand, into the weight's [L, 2I, H] layout); M a multiple of 128 and N of 256
    either way."""
    _launch_wgrad(
        a, b, a.shape[0], a.shape[1], b.shape[1], group_ends, c, accumulate, None, transposed
    )


def _launch_wgrad(a, b, rows, m, n, group_ends, c, accumulate, gather, transposed=False) -> None:
    """One launch of the weight-gradient kernel; ``gather``: None, or (tokens, row_src,
    num_topk, operand) with operand 0 (A) or 1 (B) read from ``tokens`` (its ``a`` / ``b`` then
    unused); ``transposed``: C^T stored, c [L, n, m]."""
    if c.dtype not in (torch.bfloat16, torch.float32):
        raise MoKUnsupportedError(f"wgrad_sm90: c must be bf16 or fp32, got {c.dtype}")
    if accumulate and c.dtype != torch.float32:
        raise MoKUnsupportedError(
            f"wgrad_sm90: accumulate=True adds into an fp32 c (a main_grad buffer), got {c.dtype}"
        )
    if transposed:
        _check_transposed(rows, m, n, c, gather)
    out = 0 if c.dtype == torch.bfloat16 else (2 if accumulate else 1)
    dev = c.device
    tokens, row_src, topk, operand = gather if gather is not None else (None, None, 0, 0)
    _ext.load().launch_wgrad(
        0 if a is None else a.data_ptr(),
        0 if b is None else b.data_ptr(),
        group_ends.data_ptr(),
        c.data_ptr(),
        rows,
        m,
        n,
        c.shape[0],
        out,
        0 if tokens is None else tokens.data_ptr(),
        0 if row_src is None else row_src.data_ptr(),
        0 if tokens is None else tokens.shape[0],
        topk,
        operand,
        int(transposed),
        budget_sms(dev),
        torch.cuda.current_stream(dev).cuda_stream,
    )


def _check_transposed(rows, m, n, c, gather) -> None:
    """The transposed form's refusals: a gather only of operand 0 (x's rows as A of x^T dgu),
    its kernel's M (a's columns: H for dW_gate_up) a multiple of 128 and N (b's: 2I) of 256, and
    c [L, N, M]."""
    if gather is not None and gather[3] != 0:
        raise MoKUnsupportedError(
            "wgrad_gather_sm90(transposed=True): the transposed form gathers operand 0 only "
            f"(x's rows as A of x^T dgu), got operand {gather[3]}"
        )
    if m % 128 or n % 256:
        raise MoKUnsupportedError(
            f"wgrad_sm90(transposed=True): a [{rows}, {m}] and b [{rows}, {n}]: the transposed "
            "form needs a's columns (H of x^T dgu) a multiple of 128 and b's (2I) of 256"
        )
    if c.dim() != 3 or tuple(c.shape[1:]) != (n, m):
        raise MoKInputError(
            f"wgrad_sm90(transposed=True): c must be [L, {n}, {m}] (each group's a^T b "
            f"transposed), got {tuple(c.shape)}"
        )


@wgrad_sm90.register_fake
def _(a, b, group_ends, c, accumulate=False, transposed=False) -> None:
    return None


@_mok_op("mok::swiglu_backward_gather_sm90", ("hw", "dgu", "part"))
def swiglu_backward_gather_sm90(
    x: torch.Tensor,  # [T, H] bf16, contiguous: the tokens (the gate / up GEMM's rows)
    grad_out: torch.Tensor,  # [T, H] bf16, contiguous: their output gradients (the dh GEMM's)
    row_src: torch.Tensor,  # [>= R] int32: token * num_topk + k of each row, -1 for padding
    num_topk: int,
    w_gate_up: torch.Tensor,  # [L, 2I, H] bf16, contiguous
    w_down: torch.Tensor,  # [L, H, I] bf16, contiguous
    group_ends: torch.Tensor,  # [L] int32
    row_w: torch.Tensor | None,  # [R] fp32 routing weights (None: 1)
    hw: torch.Tensor,  # [R, I] bf16 out
    dgu: torch.Tensor,  # [R, 2I] bf16 out
    part: torch.Tensor | None,  # [I / 128, R] fp32 out (router-weight partials), or None
    gu32: torch.Tensor | None,  # [R, 2I] fp32 g | u the forward kept, or None (recomputed)
) -> None:
    """:func:`swiglu_backward_sm90` (mode 0, g / u recomputed, or mode 2 from ``gu32``) with
    its GEMMs' rows gathered from the tokens inside their operand loads (row r is
    ``x[row_src[r] // num_topk]`` and ``grad_out[...]``, zeros where ``row_src`` is -1): no
    receive rows are copied first."""
    if gu32 is None:
        gather, mode = (x, grad_out, row_src, num_topk), 0
    else:
        gather, mode = (None, grad_out, row_src, num_topk), 2
    _launch_swiglu(hw, hw, w_gate_up, w_down, group_ends, row_w, hw, dgu, part, gu32, gather, mode)


@swiglu_backward_gather_sm90.register_fake
def _(x, grad_out, row_src, num_topk, w_gate_up, w_down, group_ends, row_w, hw, dgu, part, gu32):
    return None


@_mok_op("mok::wgrad_gather_sm90", ("c",))
def wgrad_gather_sm90(
    other: torch.Tensor,  # [R, N] (operand 0 gathered) or [R, M] (operand 1) bf16: the other
    tokens: torch.Tensor,  # [T, M] (operand 0) or [T, N] (operand 1) bf16: the gathered rows
    row_src: torch.Tensor,  # [>= R] int32: token * num_topk + k of each row, -1 for padding
    num_topk: int,
    operand: int,  # 0: A gathered, 1: B gathered
    group_ends: torch.Tensor,  # [L] int32, multiples of 16
    c: torch.Tensor,  # [L, M, N] bf16 or fp32 out ([L, N, M] with transposed)
    accumulate: bool,
    transposed: bool = False,  # C^T stored (operand 0 gathered only)
) -> None:
    """:func:`wgrad_sm90` with one operand's rows gathered from ``tokens`` (row r is
    ``tokens[row_src[r] // num_topk]``, zeros where ``row_src`` is -1) instead of read from a
    [R, .] copy (csrc/layer/sm90_bwd.cuh wgrad_gather_kernel)."""
    rows = other.shape[0]
    a, b = (None, other) if operand == 0 else (other, None)
    m, n = (tokens.shape[1], other.shape[1]) if operand == 0 else (other.shape[1], tokens.shape[1])
    gather = (tokens, row_src, num_topk, operand)
    _launch_wgrad(a, b, rows, m, n, group_ends, c, accumulate, gather, transposed)


@wgrad_gather_sm90.register_fake
def _(other, tokens, row_src, num_topk, operand, group_ends, c, accumulate, transposed=False):
    return None


# Task kinds of the fused backward (csrc/layer/sm90_bwd_fused.cuh BwdRun).
BWD_RUN_DH, BWD_RUN_DA, BWD_RUN_WGRAD, BWD_RUN_ALL = 1, 2, 4, 7


@_mok_op("mok::bwd_fused_sm90", ("hw", "dgu", "part", "d_a", "d_w_gate_up", "d_w_down"))
def bwd_fused_sm90(
    # [R, H] bf16 input rows, grouped by expert (dW_gate_up = dgu^T a; BWD_RUN_WGRAD)
    a: torch.Tensor | None,
    # [R, H] bf16: the gradient of each row's output, before its weight (BWD_RUN_DH, _WGRAD)
    dy: torch.Tensor | None,
    w_gate_up: torch.Tensor,  # [L, 2I, H] bf16, contiguous
    w_down: torch.Tensor | None,  # [L, H, I] bf16, contiguous (BWD_RUN_DH)
    group_ends: torch.Tensor,  # [L] int32, multiples of 16
    row_w: torch.Tensor | None,  # [R] fp32 routing weights (None: 1)
    gu32: torch.Tensor | None,  # [R, 2I] fp32 g | u kept by the saving forward (BWD_RUN_DH)
    hw: torch.Tensor | None,  # [R, I] bf16 out (BWD_RUN_DH; in for BWD_RUN_WGRAD without it)
    dgu: torch.Tensor,  # [R, 2I] bf16 out (in without BWD_RUN_DH)
    part: torch.Tensor | None,  # [I / 128, R] fp32 out (router-weight partials), or None
    d_a: torch.Tensor | None,  # [R, H] bf16 out: dgu @ w_gate_up per group (BWD_RUN_DA)
    # [L, 2I, H] bf16 out, or fp32 (added onto with accumulate) (BWD_RUN_WGRAD)
    d_w_gate_up: torch.Tensor | None,
    d_w_down: torch.Tensor | None,  # [L, H, I], as d_w_gate_up
    accumulate: bool,  # fp32 weight gradients added onto what they hold
    run: int,  # the task kinds (BWD_RUN_*)
    fault: int,  # tests only: the dh task that never reports done (-1: none)
) -> None:
    """The experts' backward from saved g / u in one launch (csrc/layer/sm90_bwd_fused.cuh): the
    dh tiles with the SwiGLU backward, the gate / up dgrad ``d_a`` and both weight gradients, over
    every SM of the GPU. A wait between its blocks that expires is recorded
    (:mod:`mok.record`) and raised at the next call. Rows past the last group end are left
    unwritten. The operands a task kind named in ``run`` does not read may be None; the launch
    refuses a missing one it needs."""
    _launch_bwd_fused(
        a, dy, w_gate_up, w_down, group_ends, row_w, gu32, hw, dgu, part, d_a, d_w_gate_up,
        d_w_down, accumulate, run, fault, None,
    )  # fmt: skip


def _launch_bwd_fused(
    a, dy, w_gate_up, w_down, group_ends, row_w, gu32, hw, dgu, part, d_a, d_w_gate_up,
    d_w_down, accumulate, run, fault, xfer, handle=0,
) -> None:  # fmt: skip
    """One launch of the fused backward; ``xfer``: (grad_out, x, row_src, slots, dx_shared,
    dx, num_topk, dedup, copy_ahead) of :func:`bwd_layer_sm90`, or None; ``handle``: the
    workspace whose ranks the transfers reach (0: none, one rank)."""
    rows = dgu.shape[0]
    ws = workspace_by_id(handle) if handle else None
    if ws is not None:
        ws.raise_if_failed()
    if rows == 0:
        return
    L, two_i, hidden = w_gate_up.shape
    dev = dgu.device
    out = 0  # WgradOut
    if d_w_gate_up is not None and d_w_down is not None:
        if d_w_down.dtype != d_w_gate_up.dtype:
            raise MoKUnsupportedError(
                f"bwd_fused_sm90: both weight gradients in one dtype, got {d_w_gate_up.dtype} "
                f"and {d_w_down.dtype}"
            )
        if d_w_gate_up.dtype == torch.float32:
            out = 2 if accumulate else 1
    if ws is None:
        params = record.record_for(dev).params()
        peers = (0, 0, 0)
    else:
        # the transfers' signals count the backward's own epochs; its rank's tokens are x's
        params = bytes(ws.params("bwd", xfer[1].shape[0], advance=True))
        peers = (1, ws.sym_off["dy"], ws.sym_off["row_grads"])
    ext = _ext.load()
    n_counters = ext.bwd_fused_counters(rows, L)
    counters = torch.empty(n_counters, dtype=torch.int32, device=dev)

    def ptr(t: torch.Tensor | None) -> int:
        return 0 if t is None else t.data_ptr()

    grad_out, x, row_src, slots, dx_shared, dx, topk, dedup, ahead = (
        (None,) * 6 + (0, False, 0) if xfer is None else xfer
    )
    ext.launch_bwd_fused(
        params,
        ptr(a),
        ptr(dy),
        w_gate_up.data_ptr(),
        ptr(w_down),
        group_ends.data_ptr(),
        ptr(row_w),
        ptr(hw),
        dgu.data_ptr(),
        ptr(part),
        ptr(gu32),
        ptr(d_a),
        ptr(d_w_gate_up),
        ptr(d_w_down),
        counters.data_ptr(),
        n_counters,
        out,
        run,
        fault,
        rows,
        hidden,
        two_i // 2,
        L,
        ptr(grad_out),
        ptr(x),
        ptr(row_src),
        ptr(slots),
        ptr(dx_shared),
        ptr(dx),
        0 if x is None else x.shape[0],
        topk,
        int(dedup),
        ahead,
        *peers,
        int(STAGED_DA),
        int(WGRAD_GU_TRANSPOSED),
        budget_sms(dev),
        torch.cuda.current_stream(dev).cuda_stream if ws is None else ws.stream(),
    )
    if ws is not None:
        ws.advance("bwd")


@bwd_fused_sm90.register_fake
def _(
    a, dy, w_gate_up, w_down, group_ends, row_w, gu32, hw, dgu, part, d_a, d_w_gate_up,
    d_w_down, accumulate, run, fault,
) -> None:  # fmt: skip
    return None


@_mok_op(
    "mok::bwd_layer_sm90",
    ("recv_dy", "recv_x", "hw", "dgu", "part", "slots", "d_w_gate_up", "d_w_down", "dx"),
)
def bwd_layer_sm90(
    grad_out: torch.Tensor,  # [T, H] bf16: the layer's output gradient
    x: torch.Tensor,  # [T, H] bf16: the layer's input
    row_src: torch.Tensor,  # [R] int32: token * K + k of each receive row, -1 for no token
    w_gate_up: torch.Tensor,  # [L, 2I, H] bf16, contiguous
    w_down: torch.Tensor,  # [L, H, I] bf16, contiguous
    group_ends: torch.Tensor,  # [L] int32, multiples of 16
    row_w: torch.Tensor,  # [R] fp32 routing weights
    gu32: torch.Tensor,  # [R, 2I] fp32 g | u kept by the saving forward
    recv_dy: torch.Tensor,  # [R, H] bf16 scratch out: grad_out by receive row
    recv_x: torch.Tensor,  # [R, H] bf16 scratch out: x by receive row
    hw: torch.Tensor,  # [R, I] bf16 scratch out
    dgu: torch.Tensor,  # [R, 2I] bf16 scratch out
    part: torch.Tensor,  # [I / 128, R] fp32 out (router-weight partials)
    slots: torch.Tensor | None,  # [T * K, H] bf16 scratch out: d_a by (token, k) (one rank)
    d_w_gate_up: torch.Tensor,  # [L, 2I, H] bf16 out, or fp32 (added onto with accumulate)
    d_w_down: torch.Tensor,  # [L, H, I], as d_w_gate_up
    dx_shared: torch.Tensor | None,  # [T, H] fp32: the shared expert's input gradient
    dx: torch.Tensor,  # [T, H] bf16 out
    accumulate: bool,
    dedup: bool,  # sum as the dedup combine does (a bf16 partial of the k rows, then dx_shared)
    copy_ahead: int,  # experts whose row copies are handed out ahead of their dh tiles (>= 1)
    num_topk: int,
    handle: int,  # the workspace of the schedule whose ranks the rows come from (0: one rank)
) -> None:
    """The routed experts' backward with its token transfers, one launch
    (csrc/layer/sm90_bwd_fused.cuh with BwdTransfers): :func:`bwd_fused_sm90`'s tasks, the
    reverse combine (each receive row gets its token's grad_out and x rows, zeros where it
    holds none) and the reverse dispatch (``dx = bf16(dx_shared + sum_k d_a[t, k])``, fixed k
    order; with ``dedup`` ``bf16(dx_shared + bf16(sum_k d_a[t, k]))``, the combine kernels'
    sums), so that ``dx`` is bitwise what dispatch + the fused backward + combine give.

    With ``handle`` (several ranks; ``dedup`` False) the rows come from and go to the ranks of
    that workspace's last schedule build (``row_src`` is the token * num_topk + k on the row's
    source rank), ``slots`` is unused (None: the symmetric slots take its place), and each
    receive row's router-weight gradient (``part`` summed in column order) is staged for
    :func:`mok.comm.pull_row_grads`, to be called after this launch on every rank."""
    _launch_bwd_fused(
        recv_x, recv_dy, w_gate_up, w_down, group_ends, row_w, gu32, hw, dgu, part, None,
        d_w_gate_up, d_w_down, accumulate, BWD_RUN_ALL, -1,
        (grad_out, x, row_src, slots, dx_shared, dx, num_topk, dedup, copy_ahead), handle,
    )  # fmt: skip


@bwd_layer_sm90.register_fake
def _(
    grad_out, x, row_src, w_gate_up, w_down, group_ends, row_w, gu32, recv_dy, recv_x, hw, dgu,
    part, slots, d_w_gate_up, d_w_down, dx_shared, dx, accumulate, dedup, copy_ahead, num_topk,
    handle,
) -> None:  # fmt: skip
    return None
