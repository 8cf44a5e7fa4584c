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

__all__ = ["gate_up_weight", "grouped_swiglu", "dense_swiglu", "clear_cache"]

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


def _fp32_out(name: str, fn, *args):
    """``fn(*args, out_dtype=torch.float32)`` where torch supports it on this device type, else
    ``fn(*args)`` in bf16 promoted to fp32 (one extra rounding)."""
    key = f"{name}:{args[0].device.type}"
    if _FP32_OUT.get(key, True):
        try:
            out = fn(*args, out_dtype=torch.float32)
            _FP32_OUT[key] = True
            return out
        except (RuntimeError, TypeError, NotImplementedError):
            _FP32_OUT[key] = False
    return fn(*args).float()


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
    if exact:
        gu = _fp32_out("grouped_mm", torch._grouped_mm, a, wgu, offs)
    else:
        gu = torch._grouped_mm(a, wgu, offs=offs)
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
    gu = _fp32_out("mm", torch.mm, x, wgu.T) if exact else x @ wgu.T
    return _swiglu(gu, inter) @ w_down.T
