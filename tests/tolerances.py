"""Every numeric tolerance the tests use, in one place, each with the reason for its size."""

from __future__ import annotations

import torch

# fp64 paths that only reorder sums of O(1) terms over a few thousand products: a few ulps of
# 2^-52 times the reduction length.
FP64_RTOL = 1e-10
FP64_ATOL = 1e-10

# fp32 explicit-vs-autograd or layer-vs-layer checks with reductions of up to ~10^4 terms.
FP32_RTOL = 1e-4
FP32_ATOL = 1e-5

# STYLE.md / FlashAttention rule: a bf16 result may be at most this many times further from the
# fp64 oracle than the same reference computed in bf16 is, plus a small absolute floor so that
# exact-zero reference errors do not make the bound zero.
BF16_ERROR_RATIO = 2.0
BF16_ABS_FLOOR = 1e-6


def max_abs_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.double() - b.double()).abs().max().item() if a.numel() else 0.0


def assert_bf16_rule(got: torch.Tensor, ref_bf16: torch.Tensor, oracle: torch.Tensor) -> None:
    """``got`` is within BF16_ERROR_RATIO x the error of ``ref_bf16`` against ``oracle``."""
    err = max_abs_err(got, oracle)
    ref_err = max_abs_err(ref_bf16, oracle)
    bound = BF16_ERROR_RATIO * ref_err + BF16_ABS_FLOOR
    assert err <= bound, (
        f"bf16 error {err:.3e} exceeds {BF16_ERROR_RATIO} x reference {ref_err:.3e}"
    )


# The bf16 reference itself against the fp64 oracle, relative to max |oracle|: inputs, SwiGLU
# output, expert outputs and the layer output are each rounded to bf16 (2^-9 relative), and the
# roundings compound through two GEMMs and a k-term sum to about 1e-2 of the output scale.
BF16_REF_REL_ERR = 2e-2

# The MXFP8 reference against the fp64 oracle, relative to max |oracle|: E4M3 keeps 3 mantissa
# bits (half-ulp 2^-4 relative) at both GEMM inputs of both GEMMs.
MXFP8_REF_REL_ERR = 1e-1
