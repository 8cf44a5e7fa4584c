"""MXFP8 (E4M3 elements) quantisation, after the OCP Microscaling Formats (MX) Specification v1.0.

An MXFP8 tensor stores, for every run of ``MX_BLOCK = 32`` consecutive elements along the
reduction axis, one shared scale ``X`` and 32 FP8 E4M3 elements ``P_i``; element ``i`` denotes
``X * P_i``.

* The scale is E8M0: an 8-bit unsigned biased exponent, bias 127, so code ``c`` in 0..254 is
  ``2**(c - 127)`` (0 is ``2**-127``, 254 is ``2**127``) and code 255 (0xFF) is NaN. E8M0 has no
  zero, no infinity and no sign.
* The elements are OCP FP8 E4M3 ("fn" in PyTorch's naming: no infinities): sign, 4 exponent bits
  with bias 7, 3 mantissa bits. Largest normal 448 = 1.75 * 2**8, smallest normal 2**-6, smallest
  subnormal 2**-9, and the only NaN encodings are S.1111.111 (0x7F and 0xFF).

Quantisation follows the spec's conversion algorithm (section 6.3, which the spec presents as the
reference way to convert scalar floats to MX)::

    shared_exp = floor(log2(max_i |V_i|)) - emax_elem        # emax_elem = 8 for E4M3
    X          = 2**shared_exp
    P_i        = quantize_to_element_format(V_i / X)          # RNE, clamping normal numbers

This puts the block maximum in E4M3's top binade [256, 512); block maxima in (448, 512) times
``X`` exceed the largest element and saturate to 448 (this is the spec's rule, it is not
rounded up to the next scale).

Choices the spec leaves open or that an implementation must make, and what this module does:

* **Exact arithmetic.** ``floor(log2(amax))`` is read off the binary exponent (``torch.frexp``),
  never from a floating-point ``log2``, so powers of two and values just below them get the right
  exponent. Powers of two are built from their bit patterns. Quantisation computes in float32
  (float64 for float64 input): the input converts exactly, and every step is a multiplication by
  a normal power of two or a rounding to an integer below 2**5, so it is exact, except that a
  scaled value may underflow float32's normal range, which only happens far below E4M3's
  smallest subnormal, where the result is zero either way.
* **Element rounding** is round-to-nearest, ties-to-even, implemented explicitly with
  ``torch.round`` on the value divided by the E4M3 quantum of its binade (subnormals included,
  quantum ``2**-9`` below ``2**-6``). PyTorch's own cast to ``float8_e4m3fn`` is deliberately not
  used for rounding: on CPU it rounds a float64 to float32 first (double rounding), and it maps
  infinities to 448. The cast is only applied to values that are already exactly representable.
* **Saturation.** A scaled magnitude above 448 becomes 448 with the element's sign, as in the
  spec's "clamping normal numbers" (conversion with saturation). Magnitudes in (448, 464] round
  to 448 by RNE anyway; clamping before rounding gives the same result as saturating after.
* **Clamping the scale.** ``shared_exp`` is clamped into E8M0's finite range [-127, 127]. Below
  the range (block maxima under ``2**-119``, e.g. float32 subnormals) the scale is ``2**-127``
  and elements that fall below E4M3's smallest subnormal round to zero. Above the range (only
  reachable from float64 input, block maxima of ``2**136`` or more) the scale is ``2**127`` and
  the elements saturate to +-448; some other implementations emit a NaN scale there instead.
  Inputs that are float32 subnormals are quantised exactly like any other value (no flush).
* **Zero blocks** (amax == 0) get scale code 0 (``2**-127``), which is what the formula gives in
  the limit amax -> 0+ after clamping, and is the convention of the MX reference emulation code.
  Their elements are zeros (with each input's sign kept), so they dequantise to exact zeros.
* **NaN / Inf.** E4M3 has no infinity and ``log2`` of a non-finite amax has no finite exponent.
  Per the spec's semantics (a NaN scale makes every element of its block NaN, whatever ``P_i``
  holds), a block containing any NaN or +-Inf gets scale code 255 (NaN) and all of its elements
  are stored as E4M3 NaN (0x7F); it dequantises to 32 NaNs. Other blocks are unaffected.
* **Signed zero.** A negative value that rounds to zero is stored as E4M3 -0 (0x80), following
  IEEE rounding; ``-0 == 0`` so dequantised values compare equal to zero.
* **Autograd.** Quantisation is piecewise constant, so these functions detach their input and
  return tensors that do not require grad; a caller that wants a straight-through estimator
  writes it explicitly (e.g. ``x + (mxfp8_round(x) - x).detach()``).
* **Dequantisation** computes ``P_i * X`` exactly in float64 and rounds once to the requested
  dtype (float32 is exact for every product unless it overflows, which only float64-sized scales
  can cause; the result is then +-inf). Code 255 dequantises the whole block to NaN, and an E4M3
  NaN element dequantises to NaN.
"""

from __future__ import annotations

import torch

__all__ = [
    "E4M3_MAX",
    "E8M0_BIAS",
    "E8M0_NAN",
    "MX_BLOCK",
    "dequantize_mxfp8",
    "mxfp8_round",
    "quantize_mxfp8",
]

E4M3_MAX = 448.0
MX_BLOCK = 32

E8M0_BIAS = 127
E8M0_NAN = 255
_E8M0_MIN_EXP = -127
_E8M0_MAX_EXP = 127

# E4M3: largest normal is 1.75 * 2**8, so emax_elem = 8; normals have exponents -6..8 and 3
# mantissa bits; subnormals are multiples of 2**-9.
_E4M3_EMAX = 8
_E4M3_EMIN = -6
_E4M3_MANT_BITS = 3

_SUPPORTED_INPUT = (torch.bfloat16, torch.float16, torch.float32, torch.float64)


def _pow2(exponent: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Exactly ``2.0**exponent`` in ``dtype`` (float32 or float64), built from its bit pattern.

    Only for exponents in the dtype's normal range (callers guarantee it).
    """
    if dtype == torch.float64:
        return ((exponent.to(torch.int64) + 1023) << 52).view(torch.float64)
    return ((exponent.to(torch.int32) + 127) << 23).view(torch.float32)


def _normalise_axis(ndim: int, axis: int) -> int:
    if ndim == 0:
        raise ValueError("MXFP8 needs a tensor with at least one dimension; found a 0-d tensor")
    if not -ndim <= axis < ndim:
        raise ValueError(f"axis {axis} is out of range for a tensor with {ndim} dimensions")
    return axis % ndim


def _check_block_axis(shape: torch.Size, axis: int) -> None:
    length = shape[axis]
    if length % MX_BLOCK != 0:
        raise ValueError(
            f"MXFP8 blocks run along axis {axis}, whose length {length} is not a multiple of "
            f"{MX_BLOCK}; found shape {tuple(shape)}"
        )


def _round_to_e4m3(y: torch.Tensor) -> torch.Tensor:
    """Round ``y`` (float32 or float64) to E4M3 values, RNE, saturating at +-448; same dtype.

    Exact for every finite ``y`` (NaN in, NaN out). Let ``b = floor(log2 |y|)`` clamped below at
    E4M3's smallest normal exponent -6; E4M3 values near ``y`` are the multiples of the quantum
    ``2**(b - 3)``. Scaling by powers of two is exact here, ``torch.round`` rounds half to even,
    and a round-up into the next binade (or to 448) is still an E4M3 value: 448 is a multiple of
    its binade's quantum 32, and nothing above 448 survives the clamp.
    """
    a = y.abs().clamp_(max=E4M3_MAX)
    # frexp: a = m * 2**e with m in [0.5, 1), so floor(log2 a) = e - 1. For a = 0 it gives e = 0,
    # and 0 rounds to 0 at any quantum.
    _, e = torch.frexp(a)
    quantum_exp = (e - 1).clamp_(min=_E4M3_EMIN) - _E4M3_MANT_BITS  # in [-9, 5]
    r = torch.round(a * _pow2(-quantum_exp, a.dtype)) * _pow2(quantum_exp, a.dtype)
    return torch.copysign(r, y)


def quantize_mxfp8(x: torch.Tensor, axis: int = -1) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantise ``x`` to MXFP8 in blocks of 32 consecutive elements along ``axis``.

    Returns ``(q, scales)``: ``q`` is ``torch.float8_e4m3fn`` with ``x``'s shape; ``scales`` is
    ``torch.uint8`` holding E8M0 codes, with ``x``'s shape except that ``axis`` is 32 times
    shorter. ``x`` must be bfloat16, float16, float32 or float64 and ``x.shape[axis]`` a multiple
    of 32. See the module docstring for the spec's algorithm and the choices made.
    """
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"quantize_mxfp8 expects a torch.Tensor; found {type(x).__name__}")
    if x.dtype not in _SUPPORTED_INPUT:
        raise TypeError(
            f"quantize_mxfp8 supports floating dtypes {_dtype_names(_SUPPORTED_INPUT)}; "
            f"found {x.dtype}"
        )
    ax = _normalise_axis(x.dim(), axis)
    _check_block_axis(x.shape, ax)
    x = x.detach()  # quantisation has no useful derivative; see the module docstring

    # float32 holds bfloat16/float16/float32 inputs exactly and the arithmetic below is exact in
    # it (module docstring, "Exact arithmetic"); float64 input stays float64.
    cdt = torch.float64 if x.dtype == torch.float64 else torch.float32
    moved = x.movedim(ax, -1)
    v = moved.reshape(*moved.shape[:-1], moved.shape[-1] // MX_BLOCK, MX_BLOCK).to(cdt)

    amax = v.abs().amax(dim=-1)  # amax propagates NaN; Inf gives Inf
    bad = ~torch.isfinite(amax)  # the block holds a NaN or an Inf
    zero = amax == 0

    _, e = torch.frexp(amax)
    shared_exp = (e.to(torch.int64) - 1) - _E4M3_EMAX  # floor(log2(amax)) - emax_elem
    shared_exp = shared_exp.clamp(_E8M0_MIN_EXP, _E8M0_MAX_EXP)
    shared_exp = torch.where(zero | bad, _E8M0_MIN_EXP, shared_exp)

    # 1 / X = 2**-shared_exp. In float64 every exponent in [-127, 127] is normal. Inputs that
    # compute in float32 have amax < 2**128, so shared_exp <= 119 and 1 / X is in
    # [2**-119, 2**127], normal in float32 too.
    elems = _round_to_e4m3(v * _pow2(-shared_exp, cdt).unsqueeze(-1))
    elems = torch.where(bad.unsqueeze(-1), float("nan"), elems)

    codes = torch.where(bad, E8M0_NAN, shared_exp + E8M0_BIAS).to(torch.uint8)
    # Every finite value in ``elems`` is exactly representable in E4M3 (and in float32), so the
    # cast only changes the storage; NaN becomes the E4M3 NaN.
    q = elems.to(torch.float32).to(torch.float8_e4m3fn).reshape(moved.shape).movedim(-1, ax)
    scales = codes.movedim(-1, ax).contiguous()
    return q.contiguous(), scales


def dequantize_mxfp8(
    q: torch.Tensor, scales: torch.Tensor, axis: int = -1, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """Inverse of :func:`quantize_mxfp8`: ``q * 2**(scales - 127)`` per block, as ``dtype``.

    ``q`` is ``torch.float8_e4m3fn``; ``scales`` is ``torch.uint8`` E8M0 codes shaped like ``q``
    with ``axis`` 32 times shorter. Code 255 (NaN) makes its whole block NaN. The product is
    exact in float64 and rounded once to ``dtype`` (bfloat16, float16, float32 or float64).
    """
    if not isinstance(q, torch.Tensor) or q.dtype != torch.float8_e4m3fn:
        found = q.dtype if isinstance(q, torch.Tensor) else type(q).__name__
        raise TypeError(f"dequantize_mxfp8 expects q of dtype torch.float8_e4m3fn; found {found}")
    if not isinstance(scales, torch.Tensor) or scales.dtype != torch.uint8:
        found = scales.dtype if isinstance(scales, torch.Tensor) else type(scales).__name__
        raise TypeError(
            f"dequantize_mxfp8 expects scales of dtype torch.uint8 (E8M0 codes); found {found}"
        )
    if dtype not in _SUPPORTED_INPUT:
        raise TypeError(
            f"dequantize_mxfp8 supports output dtypes {_dtype_names(_SUPPORTED_INPUT)}; "
            f"found {dtype}"
        )
    ax = _normalise_axis(q.dim(), axis)
    _check_block_axis(q.shape, ax)
    expected = list(q.shape)
    expected[ax] //= MX_BLOCK
    if list(scales.shape) != expected:
        raise ValueError(
            f"scales must have shape {tuple(expected)} for q of shape {tuple(q.shape)} with "
            f"axis {axis}; found {tuple(scales.shape)}"
        )

    moved = q.movedim(ax, -1)
    p = moved.to(torch.float32).to(torch.float64)  # E4M3 -> float32 is exact, NaN stays NaN
    p = p.reshape(*moved.shape[:-1], moved.shape[-1] // MX_BLOCK, MX_BLOCK)
    codes = scales.movedim(ax, -1).to(torch.int64)
    is_nan = codes == E8M0_NAN
    x_scale = _pow2(torch.where(is_nan, 0, codes - E8M0_BIAS), torch.float64)
    x_scale = torch.where(is_nan, float("nan"), x_scale)
    out = (p * x_scale.unsqueeze(-1)).reshape(moved.shape).movedim(-1, ax)
    if dtype != torch.float64:
        # float64 -> float32 is exact (4 significant bits, exponent >= -136) unless it
        # overflows; float32 -> bf16/fp16 is then the single rounding.
        out = out.to(torch.float32)
    return out.to(dtype).contiguous()


def mxfp8_round(x: torch.Tensor, axis: int = -1) -> torch.Tensor:
    """Fake-quantise: ``dequantize_mxfp8(*quantize_mxfp8(x, axis), axis)`` as float32."""
    q, scales = quantize_mxfp8(x, axis)
    return dequantize_mxfp8(q, scales, axis, dtype=torch.float32)


def _dtype_names(dtypes: tuple[torch.dtype, ...]) -> str:
    return ", ".join(str(d) for d in dtypes)
