"""SwiGLU experts on torch GEMMs, for the unfused path (``moe_forward(..., fused=False)``, which
every GPU without the fused kernel takes) and the benchmarks' baselines.

Gate and up run as one GEMM over a ``[L, 2I, H]`` weight (gate rows, then up rows): that is the
layout HF transformers and torchtitan keep, and the one ``torch._grouped_mm`` is fastest on (its
``[L, H, 2I]`` transposed view is column-major). :func:`gate_up_weight` returns it without a copy
when ``w_gate`` and ``w_up`` are already the two halves of one such tensor, and otherwise builds
it once per weight version and caches it (an in-place update of either weight, as an optimizer
step makes, bumps the tensor's version and so rebuilds it).

Numerics: the GEMMs accumulate in fp32. ``exact=False`` (mok's unfused path and the torch
baselines) rounds the gate/up output to bf16 and runs SwiGLU in bf16, as a bf16 torch model
would; ``exact=True`` keeps the gate/up output fp32 (no rounding before SwiGLU, as in the fused
kernel), SwiGLU in fp32, and rounds h to bf16 once. Both meet the BF16 rule of the tests; the
fp32 output costs a [rows, 2I] fp32 tensor and ~15 % of the experts' time on an H200
(DeepSeek-V3 shapes, 33k rows: 8.2 vs 7.2 ms).
"""

from __future__ import annotations

import weakref
from collections import OrderedDict

import torch
import torch.nn.functional as F

from mok import ops
from mok.spec.arch import arch_paths

__all__ = [
    "gate_up_weight",
    "grouped_swiglu",
    "grouped_swiglu_saving",
    "grouped_swiglu_saving_gathered",
    "gathered_backward_fits",
    "swiglu_backward_gathered",
    "dense_swiglu",
    "dense_swiglu_saving",
    "swiglu_backward",
    "gate_up_dgrad",
    "clear_cache",
]

# Expert groups the Hopper backward kernel takes in one launch (csrc/layer/sm90_bwd.cuh).
KERNEL_MAX_EXPERTS = 1024
_CACHE_SIZE = 8  # weight pairs kept (one per layer of a model under test is typical)
_cache: OrderedDict[tuple, tuple] = OrderedDict()
_FP32_OUT: dict[str, bool] = {}


def _halves_of_one(w_gate: torch.Tensor, w_up: torch.Tensor) -> torch.Tensor | None:
    """The ``[L, 2I, H]`` tensor whose halves ``w_gate`` and ``w_up`` are, or None."""
    if w_gate.dim() != 3 or w_gate.shape != w_up.shape or w_gate.dtype != w_up.dtype:
        return None
    L, inter, hidden = w_gate.shape
    want = (2 * inter * hidden, hidden, 1)
    for w in (w_gate, w_up):
        # NOTE: with one expert the outer stride is never used (an unsqueezed 2-D weight).
        if w.stride()[1:] != want[1:] or (L > 1 and w.stride()[0] != want[0]):
            return None
    if w_gate.device != w_up.device:
        return None
    # NOTE: two separate allocations can sit back to back in memory; only views of one storage
    # are halves of one tensor.
    if w_gate.untyped_storage().data_ptr() != w_up.untyped_storage().data_ptr():
        return None
    if w_up.data_ptr() != w_gate.data_ptr() + inter * hidden * w_gate.element_size():
        return None
    return torch.as_strided(w_gate, (L, 2 * inter, hidden), want)


def gate_up_weight(w_gate: torch.Tensor, w_up: torch.Tensor) -> torch.Tensor:
    """``[L, 2I, H]`` (gate rows, then up rows) of ``w_gate`` / ``w_up`` ``[L, I, H]`` (or
    ``[2I, H]`` of 2-D ``[I, H]`` weights): a view when they are the halves of one tensor, else
    a cached copy, rebuilt when either weight changes in place.

    NOTE: the cache holds weak references and checks them: a freed weight whose memory (and even
    Python id) is reused by a new one is never mistaken for it."""
    two_d = w_gate.dim() == 2
    g3, u3 = (w_gate.unsqueeze(0), w_up.unsqueeze(0)) if two_d else (w_gate, w_up)
    base = _halves_of_one(g3, u3)
    if base is not None:
        return base[0] if two_d else base
    key = (id(w_gate), id(w_up))
    hit = _cache.get(key)
    if hit is not None:
        ref_g, ref_u, versions, out = hit
        if ref_g() is w_gate and ref_u() is w_up and versions == (w_gate._version, w_up._version):
            _cache.move_to_end(key)
            return out
        del _cache[key]
    out = torch.cat([w_gate, w_up], dim=0 if two_d else 1).contiguous()
    _cache[key] = (weakref.ref(w_gate), weakref.ref(w_up), (w_gate._version, w_up._version), out)
    while len(_cache) > _CACHE_SIZE:
        _cache.popitem(last=False)
    return out


def clear_cache() -> None:
    """Drop the cached ``[L, 2I, H]`` copies (their memory is freed once nothing else holds
    them)."""
    _cache.clear()


def _swiglu(gu: torch.Tensor, inter: int, rows: int | None = None) -> torch.Tensor:
    """h = bf16(silu(g) * u) of gu = [R, 2I] (g | u) as a new contiguous [R, I] tensor, of
    which only the first ``rows`` rows (None: all) are computed; the rest is left unwritten.
    gu's gate half is overwritten (no other temporary of [rows, I])."""
    rows = gu.shape[0] if rows is None else min(rows, gu.shape[0])
    g, u = gu[:rows, :inter], gu[:rows, inter:]
    h = torch.empty(gu.shape[0], inter, dtype=torch.bfloat16, device=gu.device)
    torch.mul(F.silu(g, inplace=True), u, out=h[:rows])
    return h


def grouped_swiglu(
    a: torch.Tensor,
    w_gate: torch.Tensor,
    w_up: torch.Tensor,
    w_down: torch.Tensor,
    offs: torch.Tensor,
    exact: bool = True,
    w_gate_up: torch.Tensor | None = None,
    rows: int | None = None,
) -> torch.Tensor:
    """Routed experts: a [R, H] bf16, grouped by local expert (``offs``: [L] int32 group
    ends), w_gate / w_up [L, I, H], w_down [L, H, I] bf16 -> y [R, H] bf16. Rows past
    ``offs[-1]`` are not computed (their output is unspecified). ``w_gate_up``: the
    :func:`gate_up_weight` of w_gate / w_up if the caller holds it (else looked up).
    ``rows``: a bound on ``offs[-1]`` known on the host (None: R); SwiGLU runs on that many
    rows only, so a receive buffer sized for the worst case costs no elementwise work past
    it (``offs`` itself stays on the device: no synchronisation)."""
    inter = w_gate.shape[1]
    if w_gate_up is None:
        w_gate_up = gate_up_weight(w_gate, w_up)
    wgu = w_gate_up.transpose(1, 2)  # [L, H, 2I], column-major
    gu = _mm32(a, wgu, offs) if exact else _mm(a, wgu, offs)
    h = _swiglu(gu, inter, rows)
    return torch._grouped_mm(h, w_down.transpose(1, 2), offs=offs)


def dense_swiglu(
    x: torch.Tensor,
    w_gate: torch.Tensor,
    w_up: torch.Tensor,
    w_down: torch.Tensor,
    exact: bool = True,
    w_gate_up: torch.Tensor | None = None,
) -> torch.Tensor:
    """The shared expert: x [n, H] bf16, w_gate / w_up [Is, H], w_down [H, Is] bf16 -> [n, H]
    bf16, gate and up as one GEMM (``w_gate_up``: as in :func:`grouped_swiglu`)."""
    inter = w_gate.shape[0]
    wgu = gate_up_weight(w_gate, w_up) if w_gate_up is None else w_gate_up  # [2Is, H]
    gu = _mm32(x, wgu.T, None) if exact else x @ wgu.T
    return _swiglu(gu, inter) @ w_down.T


# ---- the backward ------------------------------------------------------------------------------
def _mm32(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor | None) -> torch.Tensor:
    """``a @ b`` (per group of ``offs`` when given) with an fp32 result of bf16 operands: the
    GEMM's own fp32 output where torch has one on this device, on a CPU the product of the
    operands promoted to fp32 (the same values: bf16 products are exact in fp32), elsewhere the
    bf16 result promoted (one extra rounding)."""
    if offs is None:
        fn, args = torch.mm, (a, b)
    else:
        fn, args = torch._grouped_mm, (a, b, offs)
    key = f"{fn.__name__}:{a.device.type}"
    if _FP32_OUT.get(key, True):
        try:
            out = fn(*args, out_dtype=torch.float32)
            _FP32_OUT[key] = True
            return out
        except (RuntimeError, TypeError, NotImplementedError):
            _FP32_OUT[key] = False
    if a.device.type == "cpu":
        return _mm(a.float(), b.float(), offs)
    return _mm(a, b, offs).float()


def _mm(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor | None) -> torch.Tensor:
    return torch.mm(a, b) if offs is None else torch._grouped_mm(a, b, offs=offs)


def swiglu_backward(
    a: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    dy: torch.Tensor,
    row_weight: torch.Tensor | None = None,
    offs: torch.Tensor | None = None,
    d_a_dtype: torch.dtype | None = None,
    kernel: bool | None = None,
    wgrad_kernel: bool | None = None,
    group_align: int = 1,
    saved_gu: torch.Tensor | None = None,
    wgrad_into: tuple[torch.Tensor, torch.Tensor] | None = None,
    fused: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor]:
    """The backward of SwiGLU experts, recomputing their activations, with explicit GEMMs.

    Forward (per group of rows when ``offs`` is given, else one dense expert):
    ``y = row_weight * (h @ w_down.T)``, ``h = bf16(silu(g) * u)``, ``[g | u] = a @ w_gate_up.T``.

    Args:
        a: [R, H] bf16 input rows, grouped by expert (``offs``: [L] int32 group ends); rows
            past ``offs[-1]`` reach no gradient (their d_a rows are unspecified). Rows that hold
            no token must be zero (with a zero ``dy`` or routing weight).
        w_gate_up: [L, 2I, H] (gate rows, then up rows), or [2I, H] without ``offs``.
        w_down: [L, H, I], or [H, I].
        dy: [R, H] bf16 gradient of the token's output (before the routing weight).
        row_weight: [R] fp32 routing weight of each row, or None (weight 1, the shared expert).
        d_a_dtype: dtype of d_a (default a's; fp32 keeps the GEMM's accumulator).
        kernel: run gate / up and the SwiGLU backward in mok's Hopper kernel (True), in torch
            (False), or the kernel where it takes the operands (None: a Hopper GPU, bf16,
            contiguous, H a multiple of 64, I of 128, at most KERNEL_MAX_EXPERTS groups).
        wgrad_kernel: the weight gradients in mok's Hopper kernel (:func:`mok.ops.wgrad_sm90`)
            where ``kernel`` holds, every group end is a multiple of 16 (``group_align``) and
            the output a multiple of 128 x 256 (with ``mok.ops.WGRAD_GU_TRANSPOSED``
            d_w_gate_up as the kernel's transposed form: H a multiple of 128, 2I of 256); else
            torch's GEMMs. None (the default): the
            kernel for grouped rows (``offs``; on the H200 it runs DeepSeek-V3's per-expert
            weight gradients at 470-550 TFLOP/s against 384-470 for torch's grouped GEMM), torch
            for one dense expert (the shared expert: cuBLAS over thousands of rows).
        group_align: every group end is a multiple of this (the schedule's row tile; rows
            without a token must then be zero).
        saved_gu: the fp32 [R, 2I] gate / up outputs :func:`grouped_swiglu_saving` kept (the
            kernel then runs only the dh GEMM); needs the kernel.
        wgrad_into: contiguous fp32 accumulators (like ``w_gate_up``, like ``w_down``;
            ``main_grad`` in Megatron) that the weight gradients are added onto, from their fp32
            sums (never rounded to bf16); they are then the gradients returned. The kernel adds
            each element once (deterministic); elsewhere the fp32 GEMM result is added.
        fused: from ``saved_gu``, run the whole backward (dh with the SwiGLU backward, ``d_a``,
            both weight gradients) as one launch of mok's fused kernel
            (:func:`mok.ops.bwd_fused_sm90`) instead of a kernel per GEMM with torch's grouped
            GEMM for ``d_a``. None (the default): fused where it takes the operands (grouped
            rows, H and I multiples of 256, group ends multiples of 16, bf16 ``d_a``, both or
            neither of ``wgrad_into``); True raises where it does not. Fused or not, the
            results are the same bits: ``d_a`` is mok's GEMM (:func:`gate_up_dgrad`) wherever
            the kernel runs on grouped rows with H and I multiples of 256 and a bf16 ``d_a``,
            torch's grouped GEMM elsewhere.

    Returns:
        (d_a [R, H], d_row_weight [R] fp32 or None, d_w_gate_up like ``w_gate_up``, d_w_down
        like ``w_down``).

    Numerics (the reference's bf16 backward): g, u and the down projection's input gradient
    ``dy @ w_down`` stay fp32; the routing weight is applied to that fp32 gradient; the SwiGLU
    gradients [dg | du] are rounded to bf16 once as the GEMM inputs they are. The router-weight
    gradient is ``<bf16(h), dy @ w_down>`` (= <y / w, dy>, without the forward's down GEMM).
    The down projection's weight gradient is ``dy^T bf16(w h)`` (the reference's is
    ``bf16(w dy)^T bf16(h)``; scaling h, narrower than dy, needs no pass over dy and rounds
    once). On the GPU torch's grouped GEMM has no fp32 output (torch 2.11): the kernel keeps g,
    u and ``dy @ w_down`` in its fp32 accumulators, the torch path rounds them to bf16 there
    (measured against the bf16 rule in docs/backward.md).
    """
    if kernel is None:
        kernel = _kernel_fits(a, w_gate_up, w_down, dy)
    if saved_gu is not None and not kernel:
        raise ValueError("saved_gu needs mok's Hopper kernel (kernel=True)")
    why = _fused_misfit(kernel, a, w_down, offs, saved_gu, d_a_dtype, wgrad_kernel, group_align,
                        wgrad_into)  # fmt: skip
    if fused and why:
        raise ValueError(f"swiglu_backward: fused=True, but {why}")
    wgrad_into = _checked_into(wgrad_into, w_gate_up, w_down)
    if fused is not False and not why:
        return _swiglu_backward_fused(a, w_gate_up, w_down, dy, row_weight, offs, saved_gu,
                                      wgrad_into)  # fmt: skip
    if kernel:
        hw, dgu, d_w = _swiglu_backward_sm90(a, w_gate_up, w_down, dy, row_weight, offs, saved_gu)
    else:
        hw, dgu, d_w = _swiglu_backward_torch(a, w_gate_up, w_down, dy, row_weight, offs)
    if _dgrad_fits(kernel, a, w_down, offs, d_a_dtype):
        d_a = gate_up_dgrad(dgu, w_gate_up, offs)
    elif d_a_dtype == torch.float32:
        d_a = _mm32(dgu, w_gate_up, offs)
    else:
        d_a = _mm(dgu, w_gate_up, offs)
    if d_a_dtype is not None:
        d_a = d_a.to(d_a_dtype)
    wk = kernel and (offs is not None if wgrad_kernel is None else wgrad_kernel)
    into = (None, None) if wgrad_into is None else wgrad_into
    # dW_gate_up = dgu^T a, or (switch on) computed as a^T dgu stored transposed
    d_wgu = _wgrad(dgu, a, offs, wk, group_align, into[0], ops.WGRAD_GU_TRANSPOSED)
    d_wd = _wgrad(dy, hw, offs, wk, group_align, into[1])  # sum over rows of dy (x) w h
    return d_a, d_w, d_wgu, d_wd


def gathered_backward_fits(
    x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor, group_align: int
) -> bool:
    """Whether :func:`swiglu_backward_gathered` takes these operands: mok's Hopper kernels
    (:func:`_kernel_fits` of the tokens), grouped rows whose group ends are multiples of 16,
    and both weight gradients in mok's kernel (H and I multiples of 256)."""
    hidden, inter = x.shape[1], w_down.shape[-1]
    return (
        w_down.dim() == 3
        and group_align % 16 == 0
        and hidden % 256 == 0
        and inter % 256 == 0
        and _kernel_fits(x, w_gate_up, w_down, x)
    )


def swiglu_backward_gathered(
    x: torch.Tensor,
    grad_out: torch.Tensor,
    row_src: torch.Tensor,
    num_topk: int,
    rows: int,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    row_weight: torch.Tensor,
    offs: torch.Tensor,
    wgrad_into: tuple[torch.Tensor, torch.Tensor] | None = None,
    saved_gu: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`swiglu_backward` (mok's kernels, g / u recomputed or read from ``saved_gu``, one
    kernel per GEMM) of the receive rows one rank would dispatch to itself, read straight from
    the tokens: row r's input is
    ``x[row_src[r] // num_topk]`` and its output gradient ``grad_out[...]`` (``row_src``: the
    schedule's ``src_index``, -1 for padding rows, which are zeros), ``rows`` of them. The
    experts' kernel and both weight-gradient kernels gather them in their operand loads, so no
    receive rows are written or read; the same bits as :func:`swiglu_backward` of the
    dispatched rows (``group_align`` a multiple of 16; :func:`gathered_backward_fits`)."""
    inter = w_down.shape[-1]
    dev = x.device
    hw = torch.empty(rows, inter, dtype=x.dtype, device=dev)
    dgu = torch.empty(rows, 2 * inter, dtype=x.dtype, device=dev)
    part = torch.empty(inter // 128, rows, dtype=torch.float32, device=dev)
    row_weight = row_weight.float().contiguous()
    ops.swiglu_backward_gather_sm90(
        x,
        grad_out,
        row_src,
        num_topk,
        w_gate_up,
        w_down,
        offs,
        row_weight,
        hw,
        dgu,
        part,
        saved_gu,
    )
    d_a = gate_up_dgrad(dgu, w_gate_up, offs)
    into = _checked_into(wgrad_into, w_gate_up, w_down) or (None, None)
    # dgu^T x rows (switch on: x rows^T dgu, x's rows the 128-column operand, stored transposed)
    d_wgu = _wgrad_gathered(dgu, x, row_src, num_topk, 1, offs, into[0], ops.WGRAD_GU_TRANSPOSED)
    d_wd = _wgrad_gathered(hw, grad_out, row_src, num_topk, 0, offs, into[1])  # dy rows^T hw
    return d_a, sum_partials(part), d_wgu, d_wd


def _wgrad_gathered(other, tokens, row_src, num_topk, operand, offs, into, transposed=False):
    """:func:`_wgrad` by mok's kernel with operand ``operand`` (0: A, 1: B) gathered from
    ``tokens``; ``other`` is the operand read as it is. ``transposed`` (operand 1 only): the
    same [L, M, N] result computed as tokens^T other, the gathered rows the kernel's operand A,
    each tile stored transposed."""
    m, n = (tokens.shape[1], other.shape[1]) if operand == 0 else (other.shape[1], tokens.shape[1])
    if transposed and operand != 1:
        raise ValueError(
            f"_wgrad_gathered: transposed computes tokens^T other with the tokens as operand 0; "
            f"it takes them as operand 1 of the result, got operand {operand}"
        )
    k_op = 0 if transposed else operand  # the kernel's gathered operand

    def launch(c, accumulate):
        ops.wgrad_gather_sm90(other, tokens, row_src, num_topk, k_op, offs, c, accumulate,
                              transposed)  # fmt: skip

    return _wgrad_out(launch, offs.shape[0], m, n, other, into)


def _wgrad_out(launch, groups: int, m: int, n: int, like: torch.Tensor, into):
    """A weight-gradient kernel's [groups, m, n] result: ``launch(c, accumulate)`` adds onto
    ``into`` (an fp32 accumulator, returned) where one is given, else writes a new ``c`` of
    ``like``'s dtype."""
    if into is not None:
        launch(into.view(groups, m, n), True)
        return into
    c = torch.empty(groups, m, n, dtype=like.dtype, device=like.device)
    launch(c, False)
    return c


def _fused_misfit(kernel, a, w_down, offs, saved_gu, d_a_dtype, wgrad_kernel, group_align, into):
    """Why the fused backward kernel does not take these operands ("" where it does): what
    mok's d_a GEMM needs (:func:`_dgrad_checks`) and more."""
    checks = (
        *_dgrad_checks(kernel, a, w_down, offs, d_a_dtype),
        (saved_gu is not None, "it runs from saved g / u (saved_gu)"),
        (group_align % 16 == 0, f"group ends must be multiples of 16 (group_align={group_align})"),
        (wgrad_kernel is not False, "it computes the weight gradients itself (wgrad_kernel)"),
        (into is None or len({t is None for t in into}) == 1, "it takes both wgrad_into "
         "accumulators or neither"),
    )  # fmt: skip
    return next((why for ok, why in checks if not ok), "")


def _dgrad_checks(kernel, a, w_down, offs, d_a_dtype) -> tuple:
    """(condition, what it needs) pairs of ``d_a`` by mok's GEMM (the fused kernel's d_a tiles,
    so that a backward from saved g / u, fused, and one that recomputes them give the same
    bits)."""
    hidden, inter = a.shape[1], w_down.shape[-1]
    return (
        (kernel, "it needs mok's Hopper kernel"),
        (offs is not None, "it runs grouped rows (offs)"),
        (hidden % 256 == 0 and inter % 256 == 0, f"H={hidden} and I={inter} must be multiples "
         "of 256"),
        (d_a_dtype in (None, torch.bfloat16), f"d_a is bf16 (d_a_dtype={d_a_dtype})"),
        (a.shape[0] > 0, "no rows"),
    )  # fmt: skip


def _checked_into(into, w_gate_up, w_down):
    """``wgrad_into`` with (None, None) as None; ValueError unless each accumulator (or None)
    is a contiguous fp32 tensor of its weight's shape."""
    if into is not None and all(t is None for t in into):
        into = None
    for acc, w in zip((None, None) if into is None else into, (w_gate_up, w_down), strict=True):
        if acc is not None and (
            acc.dtype != torch.float32 or acc.shape != w.shape or not acc.is_contiguous()
        ):
            raise ValueError(
                f"wgrad_into: contiguous fp32 tensors of the weights' shapes, got {acc.dtype} "
                f"{tuple(acc.shape)} for a weight of {tuple(w.shape)}"
            )
    return into


def _dgrad_fits(kernel, a, w_down, offs, d_a_dtype) -> bool:
    """Whether ``d_a`` is mok's GEMM (:func:`_dgrad_checks`)."""
    return all(ok for ok, _ in _dgrad_checks(kernel, a, w_down, offs, d_a_dtype))


def gate_up_dgrad(dgu: torch.Tensor, w_gate_up: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """``dgu @ w_gate_up`` per group (dgu [R, 2I] bf16, w_gate_up [L, 2I, H], offs [L] int32
    group ends) -> [R, H] bf16 in mok's Hopper kernel (the fused backward's d_a tiles alone:
    128 x 256 tiles, fp32 accumulators over the 2I columns in order). Rows past ``offs[-1]``
    are unspecified."""
    rows, hidden = dgu.shape[0], w_gate_up.shape[-1]
    d_a = torch.empty(rows, hidden, dtype=dgu.dtype, device=dgu.device)
    ops.bwd_fused_sm90(
        None, None, w_gate_up, None, offs, None, None, None, dgu, None, d_a, None, None, False,
        ops.BWD_RUN_DA, -1,
    )  # fmt: skip
    return d_a


def _swiglu_backward_fused(a, w_gate_up, w_down, dy, row_weight, offs, saved_gu, into):
    """:func:`swiglu_backward` by the fused kernel (one launch)."""
    hw, dgu, part, (d_wgu, d_wd) = _fused_outputs(a, w_gate_up, w_down, row_weight, into)
    d_a = torch.empty_like(a)
    if row_weight is not None:
        row_weight = row_weight.float().contiguous()
    ops.bwd_fused_sm90(
        a, dy, w_gate_up, w_down, offs, row_weight, saved_gu, hw, dgu, part, d_a, d_wgu, d_wd,
        into is not None, ops.BWD_RUN_ALL, -1,
    )  # fmt: skip
    return d_a, None if part is None else sum_partials(part), d_wgu, d_wd


def _fused_outputs(a, w_gate_up, w_down, row_weight, into):
    """The fused kernel's buffers for rows like ``a``: hw [R, I], dgu [R, 2I], the
    router-weight partials [I / 128, R] fp32 (None without ``row_weight``), and the weight
    gradients (``into``'s accumulators, or new tensors like the weights)."""
    rows, inter, dev = a.shape[0], w_down.shape[-1], a.device
    hw = torch.empty(rows, inter, dtype=a.dtype, device=dev)
    dgu = torch.empty(rows, 2 * inter, dtype=a.dtype, device=dev)
    part = None
    if row_weight is not None:
        part = torch.empty(inter // 128, rows, dtype=torch.float32, device=dev)
    wgrads = (torch.empty_like(w_gate_up), torch.empty_like(w_down)) if into is None else into
    return hw, dgu, part, wgrads


# Experts whose row copies swiglu_backward_tokens's launch hands out ahead of their dh tiles.
COPY_AHEAD = 32


def tokens_backward_misfit(recv, w_gate_up, w_down, offs, saved_gu, group_align, into) -> str:
    """Why :func:`swiglu_backward_tokens` does not take these operands ("" where it does):
    those of the fused kernel (:func:`swiglu_backward` with ``fused=True``), ``recv`` the
    [R, H] receive buffers it fills."""
    kernel = _kernel_fits(recv, w_gate_up, w_down, recv)
    return _fused_misfit(kernel, recv, w_down, offs, saved_gu, None, None, group_align, into)


def swiglu_backward_tokens(
    grad_out: torch.Tensor,
    x: torch.Tensor,
    row_src: torch.Tensor,
    num_topk: int,
    recv: tuple[torch.Tensor, torch.Tensor],
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    row_weight: torch.Tensor,
    offs: torch.Tensor,
    saved_gu: torch.Tensor,
    dx_shared: torch.Tensor | None = None,
    wgrad_into: tuple[torch.Tensor, torch.Tensor] | None = None,
    dedup: bool = False,
    handle: int = 0,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor]:
    """The routed experts' backward from saved g / u with the token transfers in the same
    launch (:func:`mok.ops.bwd_layer_sm90`; :func:`tokens_backward_misfit` says where it
    runs): the reverse combine fills ``recv`` = (dy, x by receive row, [R, H] bf16) from
    ``grad_out`` / ``x`` ([T, H] bf16, contiguous) by ``row_src`` ([R] int32, token *
    ``num_topk`` + k, -1 for a row without a token), then :func:`swiglu_backward`'s fused
    tasks, then the reverse dispatch sums each token's row gradients in k order onto
    ``dx_shared`` (fp32 [T, H], or None; as the dedup combine does with ``dedup``).

    ``handle``: the workspace (several ranks) whose last schedule build made ``row_src``; the
    rows then come from and return to their source ranks inside the launch, and the router-weight
    gradients are staged for :func:`mok.comm.pull_row_grads` instead of returned.

    Returns:
        (dx [T, H] bf16, d_row_weight [R] fp32 or None with ``handle``, d_w_gate_up,
        d_w_down): the bits of :func:`mok.comm.dispatch`, :func:`swiglu_backward` and
        :func:`mok.comm.combine` run one after another.
    """
    recv_dy, recv_x = recv
    (num_tokens, hidden), dev = x.shape, x.device
    wgrad_into = _checked_into(wgrad_into, w_gate_up, w_down)
    hw, dgu, part, (d_wgu, d_wd) = _fused_outputs(recv_x, w_gate_up, w_down, row_weight,
                                                  wgrad_into)  # fmt: skip
    slots = None
    if not handle:
        slots = torch.empty(num_tokens * num_topk, hidden, dtype=x.dtype, device=dev)
    dx = torch.empty(num_tokens, hidden, dtype=x.dtype, device=dev)
    ops.bwd_layer_sm90(
        grad_out, x, row_src, w_gate_up, w_down, offs, row_weight.float().contiguous(), saved_gu,
        recv_dy, recv_x, hw, dgu, part, slots, d_wgu, d_wd, dx_shared, dx,
        wgrad_into is not None, dedup, COPY_AHEAD, num_topk, handle,
    )  # fmt: skip
    return dx, None if handle else sum_partials(part), d_wgu, d_wd


def sum_partials(part: torch.Tensor) -> torch.Tensor:
    """The router-weight gradient of each row from the backward kernels' partials ([C, R]
    fp32, one per 128 intermediate columns): fp32, summed in column order from the first, the
    order the fused backward sums them in when it stages them for other ranks (so every path
    and every EP size gives the same bits)."""
    out = part[0].clone()
    for col in range(1, part.shape[0]):
        out += part[col]
    return out


def _wgrad(
    a: torch.Tensor,
    b: torch.Tensor,
    offs,
    kernel: bool,
    group_align: int,
    into=None,
    transposed: bool = False,
):
    """``a[e]^T b[e]`` per group (one [M, N] without ``offs``): mok's Hopper kernel where the
    shapes and the groups' alignment allow it, else torch's grouped GEMM. ``into``: an fp32
    accumulator the fp32 sums are added onto (and returned). ``transposed``: the kernel computes
    b^T a (b's rows its 128-column operand) and stores each tile transposed, the same [M, N]
    result; it then needs N a multiple of 128 and M of 256."""
    rows, m, n = a.shape[0], a.shape[1], b.shape[1]
    aligned = group_align % 16 == 0 if offs is not None else rows % 16 == 0
    fits = n % 128 == 0 and m % 256 == 0 if transposed else m % 128 == 0 and n % 256 == 0
    if not (kernel and aligned and rows > 0 and fits):
        if into is None:
            return _mm(a.T, b, offs)
        return into.add_(_mm32(a.T, b, offs))
    ends = _group_ends(offs, rows, a.device)

    def launch(c, accumulate):
        if transposed:
            ops.wgrad_sm90(b, a, ends, c, accumulate, True)
        else:
            ops.wgrad_sm90(a, b, ends, c, accumulate)

    c = _wgrad_out(launch, ends.shape[0], m, n, a, into)
    return c if offs is not None or into is not None else c[0]


def _kernel_fits(a, w_gate_up, w_down, dy) -> bool:
    """Whether the Hopper kernel (:func:`mok.ops.swiglu_backward_sm90`) takes these operands."""
    if not a.is_cuda or not arch_paths(torch.cuda.get_device_capability(a.device)).expert_kernels:
        return False
    return _kernel_shapes_fit(a, w_down, w_gate_up, dy)


def _kernel_shapes_fit(a, w_down, *others) -> bool:
    """:func:`_kernel_fits` but for the device: ``a``, ``w_down`` and ``others`` bf16 and
    contiguous, H a multiple of 64, I of 128, at most KERNEL_MAX_EXPERTS groups."""
    hidden, inter = a.shape[1], w_down.shape[-1]
    experts = w_down.shape[0] if w_down.dim() == 3 else 1
    return (
        all(t.dtype == torch.bfloat16 and t.is_contiguous() for t in (a, w_down, *others))
        and hidden % 64 == 0
        and inter % 128 == 0
        and experts <= KERNEL_MAX_EXPERTS
    )


# Modes of the experts' backward kernel (csrc/layer/sm90_bwd.cuh SwigluMode).
_RECOMPUTE, _SAVE, _SAVED = 0, 1, 2


def _group_ends(offs, rows: int, device) -> torch.Tensor:
    """``offs``, or one group of all ``rows`` rows (a dense expert) without it."""
    return offs if offs is not None else torch.full((1,), rows, dtype=torch.int32, device=device)


def _groups(offs, rows, w_gate_up, w_down, device):
    """(group ends, [L, 2I, H], [L, H, I]): one group of every row without ``offs``."""
    if offs is None:
        return _group_ends(None, rows, device), w_gate_up[None], w_down[None]
    return offs, w_gate_up, w_down


def _swiglu_backward_sm90(a, w_gate_up, w_down, dy, row_weight, offs, saved_gu=None):
    """(hw, dgu, d_row_weight) by the Hopper kernel: the down dgrad ``dy @ w_down`` and gate / up
    recomputed with fp32 accumulators (or read from ``saved_gu``, :func:`grouped_swiglu_saving`'s
    fp32 [g | u]), the SwiGLU backward in the epilogue."""
    rows, inter = a.shape[0], w_down.shape[-1]
    hw = torch.empty(rows, inter, dtype=a.dtype, device=a.device)
    dgu = torch.empty(rows, 2 * inter, dtype=a.dtype, device=a.device)
    part = None
    if row_weight is not None:
        part = torch.empty(inter // 128, rows, dtype=torch.float32, device=a.device)
        row_weight = row_weight.float().contiguous()
    ends, wgu, wd = _groups(offs, rows, w_gate_up, w_down, a.device)
    mode = _RECOMPUTE if saved_gu is None else _SAVED
    ops.swiglu_backward_sm90(a, dy, wgu, wd, ends, row_weight, hw, dgu, part, saved_gu, mode)
    return hw, dgu, None if part is None else sum_partials(part)


def grouped_swiglu_saving(
    a: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    offs: torch.Tensor,
    keep: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The routed experts' forward that keeps what the backward needs: (y [R, H] bf16, the fp32
    [R, 2I] gate / up outputs). Gate / up and h = bf16(silu(g) u) in mok's Hopper kernel (fp32
    accumulators, as the backward would recompute them, so the backward from them is bitwise
    the recomputing one), the down projection by torch's grouped GEMM. Rows past ``offs[-1]``
    are unspecified. ``keep`` False: the fp32 gate / up are not written (None in their
    place)."""
    h, gu32 = _saving(a, w_gate_up, w_down, offs, keep)
    return _mm(h, w_down.transpose(1, 2), offs), gu32


def grouped_swiglu_saving_gathered(
    x: torch.Tensor,
    row_src: torch.Tensor,
    num_topk: int,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    offs: torch.Tensor,
    rows: int,
    keep: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """:func:`grouped_swiglu_saving` of the receive rows one rank would dispatch to itself, read
    straight from the tokens: row r is ``x[row_src[r] // num_topk]`` (``row_src``: the schedule's
    ``src_index``, -1 for padding rows, which are zeros), ``rows`` of them (the receive
    buffer's bound). The gate / up GEMM gathers them in its operand loads, so no receive buffer
    is written or read; the same bits as the saving forward of the dispatched rows. ``keep``
    False: the fp32 gate / up are not written (None in their place)."""
    h, gu32 = _saving_outputs(rows, w_down.shape[-1], x, keep)
    ops.swiglu_saving_gather_sm90(x, row_src, num_topk, w_gate_up, w_down, offs, h, gu32)
    return _mm(h, w_down.transpose(1, 2), offs), gu32


def dense_swiglu_saving(
    x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`grouped_swiglu_saving` of one dense expert (the shared expert): x [n, H] bf16,
    w_gate_up [2Is, H], w_down [H, Is] -> (y [n, H] bf16, the fp32 [n, 2Is] gate / up)."""
    ends, wgu, wd = _groups(None, x.shape[0], w_gate_up, w_down, x.device)
    h, gu32 = _saving(x, wgu, wd, ends)
    return h @ w_down.T, gu32


def saving_shapes_fit(
    a: torch.Tensor, w_down: torch.Tensor, *w_gate_up: torch.Tensor | None
) -> bool:
    """Whether the saving forward (:func:`grouped_swiglu_saving`, :func:`dense_swiglu_saving`)
    takes rows ``a`` with ``w_down`` and the gate / up weight tensors as given (one
    ``[.., 2I, H]`` tensor or the two halves; None entries skipped), whose
    :func:`gate_up_weight` is contiguous: shapes, dtypes and strides (a traced forward's fake
    implementation asks it too); the device (a Hopper GPU) is the caller's to check."""
    return _kernel_shapes_fit(a, w_down) and all(
        w.dtype == torch.bfloat16 for w in w_gate_up if w is not None
    )


def shared_kept(
    x: torch.Tensor,
    shared_w_gate: torch.Tensor | None,
    shared_w_up: torch.Tensor | None,
    shared_w_down: torch.Tensor | None,
) -> bool:
    """Whether a ``recompute=False`` forward keeps the shared expert's fp32 gate / up (fused or
    not, and a traced forward's fake implementation): it has one (``shared_w_down`` not None)
    and the saving kernel takes its weights (:func:`saving_shapes_fit`)."""
    if shared_w_down is None:
        return False
    return saving_shapes_fit(x, shared_w_down, shared_w_gate, shared_w_up)


def _saving_outputs(rows: int, inter: int, like: torch.Tensor, keep: bool):
    """The saving forward's outputs: h [rows, I] in ``like``'s dtype and, with ``keep``, the
    fp32 [rows, 2I] gate / up (else None)."""
    h = torch.empty(rows, inter, dtype=like.dtype, device=like.device)
    gu32 = torch.empty(rows, 2 * inter, dtype=torch.float32, device=like.device) if keep else None
    return h, gu32


def _saving(a, w_gate_up, w_down, ends, keep=True) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(h [R, I] bf16, [g | u] [R, 2I] fp32, or None without ``keep``) of the groups ``ends``
    by the kernel's saving mode."""
    h, gu32 = _saving_outputs(a.shape[0], w_down.shape[-1], a, keep)
    none = torch.empty(0, dtype=a.dtype, device=a.device)
    ops.swiglu_backward_sm90(a, a, w_gate_up, w_down, ends, None, h, none, None, gu32, _SAVE)
    return h, gu32


def _swiglu_backward_torch(a, w_gate_up, w_down, dy, row_weight, offs):
    """(hw, dgu, d_row_weight) by torch GEMMs and elementwise ops."""
    inter = w_down.shape[-1]
    gu = _mm32(a, w_gate_up.transpose(-2, -1), offs)  # [R, 2I] fp32
    g, u = gu[:, :inter], gu[:, inter:]
    sig = torch.sigmoid(g)
    silu = g * sig
    h = silu * u
    dh = _mm32(dy, w_down, offs)  # [R, I] fp32, unweighted
    d_w = None
    if row_weight is not None:
        d_w = torch.linalg.vecdot(h.to(a.dtype).float(), dh)
        dh.mul_(row_weight[:, None])
        h.mul_(row_weight[:, None])
    dgu = torch.empty_like(gu, dtype=a.dtype)
    # d silu(g) / dg = sig * (1 + g * (1 - sig))
    torch.mul(dh * u, sig * (1.0 + g * (1.0 - sig)), out=dgu[:, :inter])
    torch.mul(dh, silu, out=dgu[:, inter:])
    return h.to(a.dtype), dgu, d_w
