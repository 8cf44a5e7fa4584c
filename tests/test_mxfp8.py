"""Tests for reference/mxfp8.py (OCP MX v1.0 MXFP8, E4M3 elements, E8M0 scales).

Expected codes in the hand-checked tests were worked out by hand from the formats' definitions:
E4M3 code = sign(1) | exponent(4, bias 7) | mantissa(3), subnormal value m * 2**-9; E8M0 code
c is 2**(c - 127). The property tests compare against an independent pure-Python oracle that
works in exact rational arithmetic (fractions.Fraction) and a table of E4M3 values decoded from
the bit fields, so neither the oracle nor the expected values come from the implementation.
Every comparison is exact; no tolerance is used.
"""

from __future__ import annotations

import bisect
import math
from fractions import Fraction

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from reference.mxfp8 import (
    E4M3_MAX,
    MX_BLOCK,
    dequantize_mxfp8,
    mxfp8_round,
    quantize_mxfp8,
)

NAN_CODE = 0xFF


# ----------------------------------------------------------------------------------------------
# Independent oracle
# ----------------------------------------------------------------------------------------------


def e4m3_decode(code: int) -> Fraction | None:
    """Value of an E4M3 code from its bit fields, or None for NaN (S.1111.111)."""
    sign = -1 if code & 0x80 else 1
    exp = (code >> 3) & 0xF
    mant = code & 0x7
    if exp == 0xF and mant == 0x7:
        return None
    if exp == 0:  # subnormal
        return sign * Fraction(mant, 2**9)
    return sign * (1 + Fraction(mant, 8)) * Fraction(2) ** (exp - 7)


# Non-negative finite E4M3 values, ascending, with their codes (0x00 .. 0x7E).
_POS = [(e4m3_decode(c), c) for c in range(0x7F)]
_POS_VALUES = [v for v, _ in _POS]
assert sorted(_POS_VALUES) == _POS_VALUES and _POS_VALUES[-1] == 448


def oracle_element(y: Fraction, negative: bool) -> int:
    """E4M3 code of y: round to nearest, ties to the even code, saturating at 448."""
    a = abs(y)
    sign = 0x80 if negative else 0
    if a >= 448:
        return sign | 0x7E
    i = bisect.bisect_right(_POS_VALUES, a) - 1
    (lo, lo_code), (hi, hi_code) = _POS[i], _POS[i + 1]
    if a - lo < hi - a:
        return sign | lo_code
    if a - lo > hi - a:
        return sign | hi_code
    return sign | (lo_code if lo_code % 2 == 0 else hi_code)


def floor_log2(a: Fraction) -> int:
    k = math.floor(math.log2(a.numerator) - math.log2(a.denominator))
    while Fraction(2) ** k > a:
        k -= 1
    while Fraction(2) ** (k + 1) <= a:
        k += 1
    return k


def oracle_block(values: list[float]) -> tuple[int, list[int]]:
    """(E8M0 code, E4M3 codes) for one block, following the spec's algorithm and the module's
    documented choices (NaN/Inf -> scale 0xFF and NaN elements; zero block -> code 0)."""
    assert len(values) == MX_BLOCK
    if any(not math.isfinite(v) for v in values):
        return NAN_CODE, [0x7F] * MX_BLOCK
    negative = [math.copysign(1.0, v) < 0 for v in values]
    amax = max(abs(Fraction(v)) for v in values)
    if amax == 0:
        return 0, [0x80 if n else 0x00 for n in negative]
    shared_exp = min(max(floor_log2(amax) - 8, -127), 127)
    x = Fraction(2) ** shared_exp
    return shared_exp + 127, [
        oracle_element(Fraction(v) / x, n) for v, n in zip(values, negative, strict=True)
    ]


def oracle_dequant(scale_code: int, codes: list[int]) -> list[float]:
    if scale_code == NAN_CODE:
        return [math.nan] * len(codes)
    x = Fraction(2) ** (scale_code - 127)
    out = []
    for c in codes:
        v = e4m3_decode(c)
        out.append(math.nan if v is None else math.copysign(float(v * x), -1 if c & 0x80 else 1))
    return out


def check_against_oracle(x: torch.Tensor) -> None:
    """x: (rows, 32 * blocks) float32 or float64; compares codes bit for bit, values exactly."""
    q, s = quantize_mxfp8(x)
    got_codes = q.view(torch.uint8).reshape(-1, MX_BLOCK).tolist()
    got_scales = s.reshape(-1).tolist()
    got_deq = mxfp8_round(x).reshape(-1, MX_BLOCK).tolist() if x.dtype == torch.float32 else None
    for b, vals in enumerate(x.reshape(-1, MX_BLOCK).tolist()):
        want_scale, want_codes = oracle_block(vals)
        assert got_scales[b] == want_scale, (b, vals)
        if want_scale == NAN_CODE:
            assert all(c & 0x7F == 0x7F for c in got_codes[b])
        else:
            assert got_codes[b] == want_codes, (b, vals)
        if got_deq is not None:
            want = oracle_dequant(want_scale, want_codes)
            for g, w in zip(got_deq[b], want, strict=True):
                assert (math.isnan(g) and math.isnan(w)) or (
                    g == w and math.copysign(1, g) == math.copysign(1, w)
                )


# ----------------------------------------------------------------------------------------------
# Helpers
# ----------------------------------------------------------------------------------------------


def block(*head: float, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """One 32-element block: ``head`` followed by zeros."""
    assert len(head) <= MX_BLOCK
    return torch.tensor(list(head) + [0.0] * (MX_BLOCK - len(head)), dtype=dtype)


def codes_of(q: torch.Tensor) -> list[int]:
    return q.view(torch.uint8).reshape(-1).tolist()


def quant1(x: torch.Tensor) -> tuple[int, list[int]]:
    q, s = quantize_mxfp8(x)
    assert s.shape == (1,)
    return int(s.item()), codes_of(q)


# ----------------------------------------------------------------------------------------------
# Constants and the E4M3 table itself
# ----------------------------------------------------------------------------------------------


def test_constants() -> None:
    assert E4M3_MAX == 448.0
    assert MX_BLOCK == 32


def test_e4m3_table_matches_torch_cast() -> None:
    """The hand decoder and torch's float8_e4m3fn -> float32 cast agree on all 256 codes."""
    all_codes = torch.arange(256, dtype=torch.uint8)
    as_f32 = all_codes.view(torch.float8_e4m3fn).to(torch.float32).tolist()
    for c, got in enumerate(as_f32):
        want = e4m3_decode(c)
        if want is None:
            assert math.isnan(got), c
        else:
            assert got == float(want), c
    assert e4m3_decode(0x7E) == 448 and e4m3_decode(0x01) == Fraction(1, 512)
    assert e4m3_decode(0x08) == Fraction(1, 64)


def test_every_e4m3_value_round_trips_and_every_midpoint_rounds_to_even() -> None:
    """With 448 in the block (X = 1), each E4M3 value keeps its code; each midpoint between
    neighbours goes to the even code, and nudging it by 2**-30 relative picks the nearer one."""
    values, expected = [], []
    for (lo, lo_code), (hi, hi_code) in zip(_POS[:-1], _POS[1:], strict=True):
        mid = (lo + hi) / 2
        nudge = mid * Fraction(1, 2**30) if mid else Fraction(1, 2**40)
        for v, code in (
            (lo, lo_code),
            (mid, lo_code if lo_code % 2 == 0 else hi_code),
            (mid - nudge, lo_code),
            (mid + nudge, hi_code),
        ):
            for sign in (1, -1):
                values.append(sign * float(v))  # keeps -0.0
                expected.append(code | (0x80 if sign < 0 else 0))
    per_block = MX_BLOCK - 1
    pad = (-len(values)) % per_block
    values += [0.0] * pad
    expected += [0x00] * pad
    rows = [[448.0] + values[i : i + per_block] for i in range(0, len(values), per_block)]
    want = [[0x7E] + expected[i : i + per_block] for i in range(0, len(expected), per_block)]
    x = torch.tensor(rows, dtype=torch.float64)  # mid +- nudge needs more than 24 bits
    q, s = quantize_mxfp8(x)
    assert s.reshape(-1).tolist() == [127] * len(rows)
    assert q.view(torch.uint8).tolist() == want


# ----------------------------------------------------------------------------------------------
# Hand-checked vectors
# ----------------------------------------------------------------------------------------------


def test_amax_one_gives_scale_code_119() -> None:
    # floor(log2 1) - 8 = -8 -> X = 2**-8, E8M0 code 127 - 8 = 119; v / X = 256 * v.
    x = block(1.0, 0.5, -0.25, 0.75, -1.0)
    scale, codes = quant1(x)
    assert scale == 119
    # 256 = 2**8: exp field 15 -> 0x78; 128 -> 0x70; -64 -> 0x80|0x68 = 0xE8;
    # 192 = 1.5 * 2**7: exp 14, mantissa 100 -> 0x74; -256 -> 0xF8.
    assert codes[:5] == [0x78, 0x70, 0xE8, 0x74, 0xF8]
    assert codes[5:] == [0x00] * 27
    assert torch.equal(mxfp8_round(x), x)


def test_amax_448_gives_scale_code_127() -> None:
    # floor(log2 448) = 8 -> shared_exp 0 -> X = 1, code 127; 448 = 1.75 * 2**8 -> 0x7E.
    x = block(448.0, -448.0, 1.0, -2.0)
    scale, codes = quant1(x)
    assert scale == 127
    assert codes[:4] == [0x7E, 0xFE, 0x38, 0xC0]
    assert torch.equal(mxfp8_round(x), x)


@pytest.mark.parametrize(
    ("k", "code"),
    # code = 127 + (k - 8), written out.
    [(-119, 0), (-20, 99), (-1, 118), (0, 119), (1, 120), (8, 127), (9, 128), (100, 219),
     (127, 246)],
)  # fmt: skip
def test_amax_exact_power_of_two(k: int, code: int) -> None:
    x = block(2.0**k)
    scale, codes = quant1(x)
    assert scale == code
    assert codes[0] == 0x78  # the block max lands on 256 exactly
    assert torch.equal(mxfp8_round(x), x)


def test_amax_just_below_power_of_two() -> None:
    # 1 - 2**-24 is the float32 just below 1: floor(log2) = -1 -> X = 2**-9, code 118.
    # 512 * (1 - 2**-24) = 512 - 2**-15 > 448, so it saturates to 448 -> 448 * 2**-9 = 0.875.
    below_one = 1.0 - 2.0**-24
    scale, codes = quant1(block(below_one, 0.5))
    assert scale == 118
    assert codes[:2] == [0x7E, 0x78]  # 0.5 * 512 = 256
    assert mxfp8_round(block(below_one)).tolist()[0] == 0.875

    # 2 - 2**-23: floor(log2) = 0 -> code 119; 256 * (2 - 2**-23) saturates -> 1.75.
    scale, codes = quant1(block(2.0 - 2.0**-23))
    assert (scale, codes[0]) == (119, 0x7E)
    assert mxfp8_round(block(2.0 - 2.0**-23)).tolist()[0] == 1.75

    # 2**24 - 1: floor(log2) = 23 -> code 127 + 23 - 8 = 142, X = 2**15; float32 log2 of it
    # rounds to exactly 24.0, which would give code 143. v / X = 512 - 2**-15 -> 448, and
    # 448 * 2**15 = 14680064.
    scale, codes = quant1(block(2.0**24 - 1))
    assert (scale, codes[0]) == (142, 0x7E)
    assert mxfp8_round(block(2.0**24 - 1)).tolist()[0] == 14680064.0

    # 15/16: code 118, 480 -> 448 -> 0.875.
    scale, codes = quant1(block(0.9375))
    assert (scale, codes[0]) == (118, 0x7E)
    assert mxfp8_round(block(0.9375)).tolist()[0] == 0.875


def test_zero_block() -> None:
    # Documented choice: zero block -> E8M0 code 0 (2**-127), zero elements (sign kept).
    x = torch.zeros(2, 2 * MX_BLOCK)
    x[0, 3] = -0.0
    x[1, MX_BLOCK:] = block(1.0)  # second block of row 1 is not zero
    q, s = quantize_mxfp8(x)
    assert s.tolist() == [[0, 0], [0, 119]]
    codes = q.view(torch.uint8)
    assert codes[0, 3].item() == 0x80
    assert codes[0].tolist() == [0x00] * 3 + [0x80] + [0x00] * (2 * MX_BLOCK - 4)
    assert codes[1, :MX_BLOCK].tolist() == [0x00] * MX_BLOCK
    y = dequantize_mxfp8(q, s)
    assert torch.equal(y, x)
    assert y[0, 3].item() == 0.0 and math.copysign(1, y[0, 3].item()) == -1


def test_subnormal_elements() -> None:
    # amax 1.0 -> X = 2**-8, so v / X = 256 v; E4M3 subnormals are m * 2**-9, m = 1..7.
    vals = [
        1.0,  # anchor
        2.0**-17,  # 2**-9: smallest subnormal, code 0x01
        2.0**-18,  # 2**-10: tie between 0 and 2**-9 -> 0 (even)
        2.0**-18 + 2.0**-40,  # just above the tie -> 0x01
        2.0**-18 - 2.0**-41,  # just below the tie -> 0x00
        3 * 2.0**-18,  # 1.5 * 2**-9: tie 0x01 / 0x02 -> 0x02
        5 * 2.0**-18,  # 2.5 * 2**-9: tie 0x02 / 0x03 -> 0x02
        7 * 2.0**-17,  # 7 * 2**-9: largest subnormal, 0x07
        15 * 2.0**-18,  # 7.5 * 2**-9: tie 0x07 / 0x08 (2**-6, smallest normal) -> 0x08
        2.0**-14,  # 2**-6 -> 0x08
        -(2.0**-17),  # -> 0x81
        -(2.0**-19),  # -2**-11 rounds to -0 -> 0x80
        2.0**-30,  # far below -> 0x00
    ]
    scale, codes = quant1(block(*vals))
    assert scale == 119
    assert codes[: len(vals)] == [
        0x78, 0x01, 0x00, 0x01, 0x00, 0x02, 0x02, 0x07, 0x08, 0x08, 0x81, 0x80, 0x00,
    ]  # fmt: skip
    got = mxfp8_round(block(*vals)).tolist()[: len(vals)]
    assert got == [
        1.0, 2.0**-17, 0.0, 2.0**-17, 0.0, 2.0**-16, 2.0**-16, 7 * 2.0**-17, 2.0**-14,
        2.0**-14, -(2.0**-17), 0.0, 0.0,
    ]  # fmt: skip
    assert math.copysign(1, got[11]) == -1


def test_saturation() -> None:
    # amax 500: floor(log2 500) = 8 -> X = 1 (code 127). Above 448 saturates to 448.
    vals = [500.0, -500.0, 511.0, 464.0, 460.0, 440.0, 432.0, 424.0, 416.0]
    scale, codes = quant1(block(*vals))
    assert scale == 127
    # 464: midpoint of 448 and 480, beyond the format -> 448. 440 > 432 -> 448.
    # 432: tie of 416 (0x7D, mantissa 101) and 448 (0x7E, mantissa 110) -> 448. 424 -> 416.
    assert codes[: len(vals)] == [0x7E, 0xFE, 0x7E, 0x7E, 0x7E, 0x7E, 0x7E, 0x7D, 0x7D]
    got = mxfp8_round(block(*vals)).tolist()[: len(vals)]
    assert got == [448.0, -448.0, 448.0, 448.0, 448.0, 448.0, 448.0, 416.0, 416.0]


def test_round_to_nearest_even_ties() -> None:
    # 448 anchors X = 1. In [16, 32) the E4M3 step is 2; in [1, 2) it is 1/8; in [8, 16) it is 1.
    vals = [448.0, 17.0, 19.0, 1.0625, 1.1875, 15.5, 17.0 + 2.0**-10, -17.0, -19.0,
            2.0**-6 + 2.0**-10, 2.0**-6 + 3 * 2.0**-10]  # fmt: skip
    scale, codes = quant1(block(*vals))
    assert scale == 127
    # 17 -> 16 (0x58, mantissa 000), 19 -> 20 (0x5A, 010), 1.0625 -> 1 (0x38),
    # 1.1875 -> 1.25 (0x3A), 15.5 -> 16 (0x58; 15 is 0x57, odd), 17 + eps -> 18 (0x59),
    # negatives set bit 7; 2**-6 * 1.0625 -> 2**-6 (0x08); 2**-6 * 1.1875 -> 2**-6 * 1.25 (0x0A).
    assert codes[: len(vals)] == [0x7E, 0x58, 0x5A, 0x38, 0x3A, 0x58, 0x59, 0xD8, 0xDA, 0x08, 0x0A]


def test_float64_input_is_rounded_once() -> None:
    # 17 + 2**-40 rounds to 17.0 in float32, whose tie would go to 16; exactly it goes to 18.
    x = block(448.0, 17.0 + 2.0**-40, 17.0 - 2.0**-40, 2.0**-10 + 2.0**-60, dtype=torch.float64)
    scale, codes = quant1(x)
    assert scale == 127
    assert codes[:4] == [0x7E, 0x59, 0x58, 0x01]


def test_negative_values() -> None:
    x = block(-1.0, -0.75, -(2.0**-17), 0.5)
    scale, codes = quant1(x)
    assert scale == 119
    assert codes[:4] == [0xF8, 0xF4, 0x81, 0x70]
    assert torch.equal(mxfp8_round(x), x)


def test_nan_and_inf_blocks() -> None:
    # Documented choice: any NaN/Inf in a block -> scale 0xFF (NaN) and E4M3 NaN elements, so
    # the whole block dequantises to NaN; other blocks are untouched.
    x = torch.zeros(3, 2 * MX_BLOCK)
    x[:, :MX_BLOCK] = block(1.0, 0.5)
    x[:, MX_BLOCK:] = block(448.0, 3.0)
    x[0, 5] = math.nan
    x[1, MX_BLOCK + 7] = math.inf
    x[2, 0] = -math.inf
    q, s = quantize_mxfp8(x)
    assert s.tolist() == [[255, 127], [119, 255], [255, 127]]
    codes = q.view(torch.uint8)
    assert codes[0, :MX_BLOCK].tolist() == [0x7F] * MX_BLOCK
    assert codes[1, MX_BLOCK:].tolist() == [0x7F] * MX_BLOCK
    y = mxfp8_round(x)
    nan_mask = torch.zeros_like(x, dtype=torch.bool)
    nan_mask[0, :MX_BLOCK] = True
    nan_mask[1, MX_BLOCK:] = True
    nan_mask[2, :MX_BLOCK] = True
    assert torch.equal(torch.isnan(y), nan_mask)
    assert torch.equal(y[~nan_mask], x[~nan_mask])


def test_dequantize_nan_scale_and_nan_element() -> None:
    q = torch.full((MX_BLOCK * 2,), 0x38, dtype=torch.uint8)  # 1.0 everywhere
    q[MX_BLOCK + 1] = 0x7F  # E4M3 NaN under a finite scale
    s = torch.tensor([255, 128], dtype=torch.uint8)
    y = dequantize_mxfp8(q.view(torch.float8_e4m3fn), s)
    assert torch.isnan(y[:MX_BLOCK]).all()
    assert torch.isnan(y[MX_BLOCK + 1])
    assert y[MX_BLOCK].item() == 2.0 and y[MX_BLOCK + 2 :].eq(2.0).all()


def test_scale_clamped_below() -> None:
    # Block maxima below 2**-119 clamp the scale to E8M0's smallest, 2**-127 (code 0).
    # 2**-130 (a float32 subnormal): v / X = 2**-3 -> exp field 4 -> 0x20. 2**-126 -> 2 -> 0x40.
    # 2**-149 / 2**-127 = 2**-22, far below E4M3's smallest subnormal -> 0.
    x = torch.stack([block(2.0**-130), block(2.0**-126), block(2.0**-149)])
    q, s = quantize_mxfp8(x)
    assert s.reshape(-1).tolist() == [0, 0, 0]
    assert q.view(torch.uint8)[:, 0].tolist() == [0x20, 0x40, 0x00]
    y = mxfp8_round(x)
    assert y[:, 0].tolist() == [2.0**-130, 2.0**-126, 0.0]


def test_scale_clamped_above_float64() -> None:
    # Only float64 can exceed the E8M0 range: 2**200 -> shared_exp 192 -> clamp 127 (code 254);
    # v / X = 2**73 saturates to 448 (0x7E); 2**127 -> 1 -> 0x38; 2**130 -> 8 -> exp 10 -> 0x50.
    x = block(2.0**200, 2.0**127, 2.0**130, dtype=torch.float64)
    scale, codes = quant1(x)
    assert (scale, codes[:3]) == (254, [0x7E, 0x38, 0x50])
    q, s = quantize_mxfp8(x)
    y64 = dequantize_mxfp8(q, s, dtype=torch.float64)
    assert y64[:3].tolist() == [448.0 * 2.0**127, 2.0**127, 2.0**130]
    y32 = dequantize_mxfp8(q, s)  # 448 * 2**127 and 2**130 overflow float32
    assert y32[:3].tolist() == [math.inf, 2.0**127, math.inf]
    # And 2**-200 clamps to code 0 and underflows to zero elements.
    assert quant1(block(2.0**-200, dtype=torch.float64)) == (0, [0x00] * MX_BLOCK)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float64])
def test_input_dtypes_agree_with_float32(dtype: torch.dtype) -> None:
    # Values exactly representable in every input dtype give the same codes.
    vals = [1.5, -0.75, 3.0, 0.0625, -12.0, 2.0**-10, 96.0, 0.3125]
    x32 = torch.stack([block(*vals), block(*[v / 64 for v in vals])])
    q32, s32 = quantize_mxfp8(x32)
    q, s = quantize_mxfp8(x32.to(dtype))
    assert torch.equal(s, s32)
    assert torch.equal(q.view(torch.uint8), q32.view(torch.uint8))
    assert torch.equal(mxfp8_round(x32.to(dtype)), mxfp8_round(x32))
    y = dequantize_mxfp8(q, s, dtype=dtype)
    assert y.dtype == dtype
    assert torch.equal(y, x32.to(dtype))


# ----------------------------------------------------------------------------------------------
# Shapes and the axis argument
# ----------------------------------------------------------------------------------------------


def _randn_wide(shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    """Normal values times per-element powers of two spread over 2**-20 .. 2**20."""
    spread = torch.randint(-20, 21, shape, generator=gen).to(torch.float32)
    return torch.randn(shape, generator=gen) * torch.exp2(spread)


def test_output_shapes_and_dtypes() -> None:
    gen = torch.Generator().manual_seed(1)
    x = _randn_wide((3, 64, 5), gen)
    q, s = quantize_mxfp8(x, axis=1)
    assert q.shape == (3, 64, 5) and q.dtype == torch.float8_e4m3fn
    assert s.shape == (3, 2, 5) and s.dtype == torch.uint8
    y = mxfp8_round(x, axis=1)
    assert y.shape == x.shape and y.dtype == torch.float32
    assert dequantize_mxfp8(q, s, axis=1, dtype=torch.bfloat16).dtype == torch.bfloat16


def test_axis_zero_and_minus_one_on_2d() -> None:
    gen = torch.Generator().manual_seed(2)
    x = _randn_wide((64, 96), gen)
    q0, s0 = quantize_mxfp8(x, axis=0)
    assert q0.shape == (64, 96) and s0.shape == (2, 96)
    qt, st_ = quantize_mxfp8(x.t().contiguous(), axis=-1)
    assert torch.equal(s0, st_.t())
    assert torch.equal(q0.view(torch.uint8), qt.view(torch.uint8).t())
    assert torch.equal(mxfp8_round(x, axis=0), mxfp8_round(x.t(), axis=-1).t())
    # axis=1 is axis=-1; blocks really run along the chosen axis.
    q1, s1 = quantize_mxfp8(x, axis=1)
    qm, sm = quantize_mxfp8(x, axis=-1)
    assert s1.shape == (64, 3) and torch.equal(s1, sm)
    assert torch.equal(q1.view(torch.uint8), qm.view(torch.uint8))
    assert torch.equal(dequantize_mxfp8(q0, s0, axis=0), mxfp8_round(x, axis=0))
    check_against_oracle(x.t().contiguous())


def test_axis_blocks_are_independent_along_axis_zero() -> None:
    # A single large value only changes the scale of its own block along axis 0.
    x = torch.ones(64, 2)
    x[40, 1] = 448.0
    _, s = quantize_mxfp8(x, axis=0)
    assert s.tolist() == [[119, 119], [119, 127]]


def test_empty_and_autograd_inputs() -> None:
    assert mxfp8_round(torch.zeros(0, 64)).shape == (0, 64)
    q, s = quantize_mxfp8(torch.zeros(4, 0))
    assert q.shape == (4, 0) and s.shape == (4, 0)
    x = torch.ones(2, 64, requires_grad=True)
    y = mxfp8_round(x)
    assert not y.requires_grad
    assert torch.equal(y, x.detach())


def test_noncontiguous_input() -> None:
    gen = torch.Generator().manual_seed(3)
    base = _randn_wide((64, 128), gen)
    x = base[:, ::2]  # (64, 64), strided
    assert torch.equal(mxfp8_round(x), mxfp8_round(x.contiguous()))
    assert torch.equal(mxfp8_round(x, axis=0), mxfp8_round(x.contiguous(), axis=0))


# ----------------------------------------------------------------------------------------------
# Bad input
# ----------------------------------------------------------------------------------------------


def test_rejects_non_float_dtypes() -> None:
    with pytest.raises(TypeError, match=r"supports floating dtypes .*found torch\.int64"):
        quantize_mxfp8(torch.zeros(32, dtype=torch.int64))
    with pytest.raises(TypeError, match=r"found torch\.float8_e4m3fn"):
        quantize_mxfp8(torch.zeros(32, dtype=torch.float8_e4m3fn))
    with pytest.raises(TypeError, match=r"found torch\.complex64"):
        mxfp8_round(torch.zeros(32, dtype=torch.complex64))
    with pytest.raises(TypeError, match="expects a torch.Tensor; found list"):
        quantize_mxfp8([0.0] * 32)  # type: ignore[arg-type]


def test_rejects_axis_length_not_multiple_of_32() -> None:
    with pytest.raises(ValueError, match=r"length 48 is not a multiple of 32"):
        quantize_mxfp8(torch.zeros(4, 48))
    with pytest.raises(ValueError, match=r"axis 0, whose length 4 is not a multiple of 32"):
        mxfp8_round(torch.zeros(4, 64), axis=0)


def test_rejects_bad_axis_and_scalars() -> None:
    with pytest.raises(ValueError, match=r"axis 2 is out of range for a tensor with 2 dim"):
        quantize_mxfp8(torch.zeros(32, 32), axis=2)
    with pytest.raises(ValueError, match=r"axis -3 is out of range"):
        quantize_mxfp8(torch.zeros(32, 32), axis=-3)
    with pytest.raises(ValueError, match=r"found a 0-d tensor"):
        quantize_mxfp8(torch.tensor(1.0))


def test_dequantize_rejects_bad_arguments() -> None:
    q, s = quantize_mxfp8(torch.ones(2, 64))
    with pytest.raises(TypeError, match=r"q of dtype torch\.float8_e4m3fn; found torch\.uint8"):
        dequantize_mxfp8(q.view(torch.uint8), s)
    with pytest.raises(TypeError, match=r"scales of dtype torch\.uint8.*found torch\.float32"):
        dequantize_mxfp8(q, s.float())
    with pytest.raises(ValueError, match=r"scales must have shape \(2, 2\).*found \(2, 1\)"):
        dequantize_mxfp8(q, s[:, :1])
    with pytest.raises(ValueError, match=r"length 2 is not a multiple of 32"):
        dequantize_mxfp8(q, s, axis=0)
    with pytest.raises(TypeError, match=r"output dtypes .*found torch\.int32"):
        dequantize_mxfp8(q, s, dtype=torch.int32)


# ----------------------------------------------------------------------------------------------
# Properties
# ----------------------------------------------------------------------------------------------


def assert_round_trip_properties(x: torch.Tensor, axis: int = -1) -> None:
    """x finite float32. Checks scale form, error bounds, idempotence and sign symmetry."""
    q, s = quantize_mxfp8(x, axis)
    y = mxfp8_round(x, axis)
    xb = x.movedim(axis, -1).reshape(-1, MX_BLOCK).double()
    yb = y.movedim(axis, -1).reshape(-1, MX_BLOCK).double()
    codes = s.movedim(axis, -1).reshape(-1).long()

    # The scale is a finite E8M0 power of two and puts non-zero block maxima in [256, 512)
    # (or below 512 when the scale sits at its clamp 2**-127).
    assert codes.le(254).all()
    scale = torch.exp2(codes.double() - 127)
    amax = xb.abs().amax(dim=-1)
    ratio = amax / scale
    nonzero = amax > 0
    assert ratio.lt(512).all()
    unclamped = nonzero & (codes > 0)
    assert ratio[unclamped].ge(256).all()
    assert codes[~nonzero].eq(0).all()
    assert amax[codes == 0].lt(2.0**-118).all()

    # Error bounds: half an E4M3 ulp of v / X's binade, times X; saturated elements are +-448 X.
    scaled = xb / scale[:, None]
    a = scaled.abs()
    binade = torch.floor(torch.log2(a.clamp(min=2.0**-200))).clamp(min=-6)
    # log2 of a float may be off at binade edges; correct with exact power-of-two comparisons.
    binade = torch.where(torch.exp2(binade) > a, binade - 1, binade)
    binade = torch.where(torch.exp2(binade + 1) <= a, binade + 1, binade).clamp(min=-6)
    half_ulp = torch.exp2(binade - 4) * scale[:, None]
    err = (yb - xb).abs()
    sat = a > E4M3_MAX
    assert err[~sat].le(half_ulp[~sat]).all()
    assert torch.equal(yb[sat], torch.sign(xb[sat]) * E4M3_MAX * scale[:, None].expand_as(a)[sat])
    normal = ~sat & (a >= 2.0**-6)
    assert err[normal].le(xb[normal].abs() * 2.0**-4).all()

    # Idempotence: fake-quant of fake-quant is identical, and re-quantising gives the same codes.
    assert torch.equal(mxfp8_round(y, axis), y)
    q2, s2 = quantize_mxfp8(y, axis)
    assert torch.equal(s2, s)
    assert torch.equal(q2.view(torch.uint8), q.view(torch.uint8))

    # Sign symmetry: negating the input flips only the element sign bits.
    qn, sn = quantize_mxfp8(-x, axis)
    assert torch.equal(sn, s)
    assert torch.equal(qn.view(torch.uint8), q.view(torch.uint8) ^ 0x80)


_f32 = st.floats(width=32, allow_nan=False, allow_infinity=False)


@settings(max_examples=120, deadline=None)
@given(st.integers(1, 4).flatmap(lambda n: st.lists(_f32, min_size=32 * n, max_size=32 * n)))
def test_matches_oracle_on_arbitrary_float32(values: list[float]) -> None:
    x = torch.tensor(values, dtype=torch.float32).reshape(-1, MX_BLOCK)
    check_against_oracle(x)
    assert_round_trip_properties(x)


@settings(max_examples=100, deadline=None)
@given(
    seed=st.integers(0, 2**31 - 1),
    shift=st.integers(-140, 110),
    spread=st.integers(0, 30),
    rows=st.integers(1, 8),
    blocks=st.integers(1, 4),
    axis=st.sampled_from([0, -1]),
)
def test_round_trip_properties_random(
    seed: int, shift: int, spread: int, rows: int, blocks: int, axis: int
) -> None:
    gen = torch.Generator().manual_seed(seed)
    shape = (rows, MX_BLOCK * blocks) if axis == -1 else (MX_BLOCK * blocks, rows)
    e = (torch.randint(-spread, spread + 1, shape, generator=gen).double() + shift).clamp(max=120)
    x = (torch.randn(shape, generator=gen, dtype=torch.float64) * torch.exp2(e)).float()
    zero = torch.rand(shape, generator=gen) < 0.1
    x = torch.where(zero, 0.0, x)
    assert torch.isfinite(x).all()
    assert_round_trip_properties(x, axis)


@settings(max_examples=50, deadline=None)
@given(seed=st.integers(0, 2**31 - 1))
def test_matches_oracle_float64_near_ties(seed: int) -> None:
    # Random E4M3 midpoints (scaled by a random power of two) nudged by tiny float64 amounts:
    # exercises exact rounding that a float32 detour would get wrong.
    gen = torch.Generator().manual_seed(seed)
    lo = torch.randint(0, 0x7E, (4, MX_BLOCK), generator=gen)
    mids = [
        [(float(_POS_VALUES[i]) + float(_POS_VALUES[i + 1])) / 2 for i in r] for r in lo.tolist()
    ]
    x = torch.tensor(mids, dtype=torch.float64)
    nudge = torch.randint(-1, 2, x.shape, generator=gen).double() * 2.0**-40
    sign = torch.where(torch.rand(x.shape, generator=gen) < 0.5, -1.0, 1.0).double()
    x = sign * (x + nudge * x)
    x[:, 0] = 448.0
    k = int(torch.randint(-100, 100, (1,), generator=gen))
    check_against_oracle(x * 2.0**k)


def test_matches_oracle_seeded_large() -> None:
    gen = torch.Generator().manual_seed(4)
    x = _randn_wide((64, 256), gen)
    x[3, :MX_BLOCK] = 0.0
    x[5, 7] = math.nan
    x[9, 100] = -math.inf
    check_against_oracle(x)
