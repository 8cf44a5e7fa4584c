"""Every numeric tolerance the tests use, in one place, each with the reason for its size."""

from __future__ import annotations

import math

import torch

# fp64 paths that only reorder sums of O(1) terms over a few thousand products: a few ulps of
# 2^-52 times the reduction length.
FP64_RTOL = 1e-10
FP64_ATOL = 1e-10

# fp32 explicit-vs-autograd or layer-vs-layer checks with reductions of up to ~10^4 terms.
FP32_RTOL = 1e-4
FP32_ATOL = 1e-5

# An fp32-accumulated GEMM of bf16 inputs against fp64: each product is exact in fp32 and the
# k-term sum gains at most ~k * 2^-24 of sum |a_i b_i| (k <= ~10^3 here); measured against that
# L1 scale, elementwise.
FP32_GEMM_RTOL = 1e-4


def assert_fp32_gemm(got: torch.Tensor, oracle: torch.Tensor, l1: torch.Tensor) -> None:
    """|got - oracle| <= FP32_GEMM_RTOL * l1 + FP32_ATOL elementwise (l1 = |A| |B|, fp64)."""
    bound = FP32_GEMM_RTOL * l1 + FP32_ATOL
    worst = ((got.double() - oracle).abs() - bound).max().item()
    assert worst <= 0, f"fp32 GEMM error exceeds its bound by {worst:.3e}"


# The FlashAttention rule: a bf16 result may be at most this many times further from the fp64
# oracle than the same reference computed in bf16 is, plus a small absolute floor so that
# exact-zero reference errors do not make the bound zero.
BF16_ERROR_RATIO = 2.0
BF16_ABS_FLOOR = 1e-6
# With few outputs (a call of one or a few tokens) the bf16 reference's maximum error is a small
# sample and can fall well below its usual half-ulp of the output scale, while a correct result
# whose fp32 value lies on the other side of one rounding boundary is a whole bf16 ulp (2^-7
# relative) off on that element, on top of the error its fp32 value already carries (the
# rounded SwiGLU output before the down GEMM, as in the reference). Below this many elements the
# rule's bound is at least the reference's error plus one bf16 ulp of max |oracle|; larger
# outputs keep the plain rule. Measured: the EP32 forward on one rank's 16 tokens (4096
# outputs, max |oracle| 2.48) was 2.03e-2 off against the reference's 8.6e-3, while the other
# 31 ranks' outputs were bitwise those of EP1 (2026-12-07, one H100).
BF16_SMALL_SAMPLE = 1 << 16
BF16_ULP = 2.0**-7


def max_abs_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.double() - b.double()).abs().max().item() if a.numel() else 0.0


def assert_bf16_rule(got: torch.Tensor, ref_bf16: torch.Tensor, oracle: torch.Tensor) -> None:
    """``got`` is within BF16_ERROR_RATIO x the error of ``ref_bf16`` against ``oracle`` (at
    least that error plus one bf16 ulp of the output scale for outputs of fewer than
    BF16_SMALL_SAMPLE elements)."""
    assert got.shape == oracle.shape, f"shape {tuple(got.shape)} != {tuple(oracle.shape)}"
    err = max_abs_err(got, oracle)
    ref_err = max_abs_err(ref_bf16, oracle)
    bound = BF16_ERROR_RATIO * ref_err + BF16_ABS_FLOOR
    if 0 < oracle.numel() < BF16_SMALL_SAMPLE:
        bound = max(bound, ref_err + BF16_ULP * oracle.abs().max().item())
    assert err <= bound, (
        f"bf16 error {err:.3e} exceeds {BF16_ERROR_RATIO} x reference {ref_err:.3e} "
        f"(bound {bound:.3e})"
    )


def stored_like(ref_bf16: torch.Tensor, got: torch.Tensor) -> torch.Tensor:
    """The bf16 reference as the result under test stores it (fp64 values on the host): the
    reference's backward keeps weight gradients in its fp32 carrier (reference.moe.MoEGrads),
    while a gradient of a bf16 weight is itself bf16, one more rounding the same reference
    computed in bf16 would make to store it. Rounding the reference to ``got``'s dtype compares
    like with like (a no-op for fp32 results and for values the reference already rounded)."""
    return ref_bf16.to(got.dtype).cpu().double()


# The bf16 reference itself against the fp64 oracle, relative to max |oracle|: inputs, SwiGLU
# output, expert outputs and the layer output are each rounded to bf16 (2^-9 relative), and the
# roundings compound through two GEMMs and a k-term sum to about 1e-2 of the output scale.
BF16_REF_REL_ERR = 2e-2


def assert_bf16_ref_bound(got: torch.Tensor, oracle: torch.Tensor, what: str = "bf16") -> None:
    """``got`` is within BF16_REF_REL_ERR x max |oracle| of ``oracle`` (exact when the oracle is
    zero). Unlike :func:`assert_bf16_rule` it needs no second bf16 result, and holds for a few
    tokens, where the ratio of two small maximum errors is noise."""
    assert got.shape == oracle.shape, f"{what}: shape {tuple(got.shape)} != {tuple(oracle.shape)}"
    err = max_abs_err(got, oracle)
    scale = oracle.abs().max().item() if oracle.numel() else 0.0
    assert err <= BF16_REF_REL_ERR * scale, (
        f"{what}: error {err:.3e} exceeds {BF16_REF_REL_ERR} x max |oracle| {scale:.3e}"
    )


# The MXFP8 reference against the fp64 oracle, relative to max |oracle|: E4M3 keeps 3 mantissa
# bits (half-ulp 2^-4 relative) at both GEMM inputs of both GEMMs.
MXFP8_REF_REL_ERR = 1e-1

# A profile fitted afresh against the committed JSON of the same fit: the fit goes through
# np.linalg.lstsq, whose OpenBLAS kernel (AVX-512 or AVX2) the CPU picks at run time, so the
# same inputs give values a few ulps (below 1e-15 relative) apart on different CPUs. 1e-9
# absorbs that with a wide margin and still catches any real change of the fit.
FIT_RTOL = 1e-9


# mok.bench lm on CPU (fp32, the reference layer): the global loss of each of the first steps at
# EP4 against EP1 from the same seed. The MoE layer sums every expert's rows in the same order at
# both sizes, but the replicated Parameters' gradients are all-reduced (four partial fp32 sums
# instead of one GEMM over the batch) and the loss is a mean of four means: a few ulps per step
# (measured: below 5e-7 relative over 20 steps), which AdamW carries into the next step's weights.
# 1e-5 leaves a wide margin; a wrong expert shard or token slice moves the loss by far more.
LM_EP_LOSS_RTOL = 1e-5


def assert_json_close(
    got: object, want: object, rel_tol: float = FIT_RTOL, path: str = "$"
) -> None:
    """``got`` equals ``want`` as nested JSON-like data: dict keys, str, int, bool and None
    exactly, floats within ``rel_tol``. The message names the path of the first mismatch."""
    if isinstance(want, dict):
        assert isinstance(got, dict), f"{path}: got {type(got).__name__}, want dict"
        missing, extra = sorted(set(want) - set(got)), sorted(set(got) - set(want))
        assert not missing and not extra, f"{path}: missing keys {missing}, extra keys {extra}"
        for k, v in want.items():
            assert_json_close(got[k], v, rel_tol, f"{path}.{k}")
    elif isinstance(want, list | tuple):
        assert isinstance(got, list | tuple), f"{path}: got {type(got).__name__}, want list"
        assert len(got) == len(want), f"{path}: length {len(got)} != {len(want)}"
        for i, (g, w) in enumerate(zip(got, want, strict=True)):
            assert_json_close(g, w, rel_tol, f"{path}[{i}]")
    elif isinstance(want, float):
        assert type(got) is float, f"{path}: got {got!r} ({type(got).__name__}), want {want!r}"
        assert math.isclose(got, want, rel_tol=rel_tol), (
            f"{path}: {got!r} != {want!r} (rel_tol={rel_tol})"
        )
    else:
        assert type(got) is type(want) and got == want, f"{path}: got {got!r}, want {want!r}"


# mok.integrations.hf on CPU: a tiny HF transformers model in fp32 with the "mok" experts (mok's
# reference layer, fp32) against transformers' own experts on the same Parameters. The same
# products are summed in another order (per expert then over k, against transformers' grouped
# GEMMs and index_add_), a few fp32 ulps per layer that the later layers carry into the logits,
# every gradient and, through SGD, the next steps' losses; each compared relative to its own
# scale, max |transformers'|. Measured below 1e-6; a wrong gate / up half, a lost routing weight
# or a missing slot moves them by 1e-2 or more.
HF_FP32_RTOL = 1e-5
