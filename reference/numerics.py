"""Where the reference rounds: GEMM inputs, GEMM outputs and stored activations per mode.

A *mode* is what the ``compute_dtype`` argument of every reference stage accepts:

==============  ====================  =======================  ==========================
mode            GEMM inputs           accumulation             stored tensors (h, y, out)
==============  ====================  =======================  ==========================
torch.float64   fp64                  fp64                     fp64 (the oracle)
torch.float32   fp32                  fp32                     fp32
torch.bfloat16  bf16                  fp32                     bf16
"mxfp8"         MXFP8 (32-blocks      fp32                     bf16
                along the reduction
                axis, E4M3 elements)
==============  ====================  =======================  ==========================

Values are carried in fp64 (oracle) or fp32 tensors holding exactly the rounded values, so every
rounding point is explicit. Products of two bf16 (or two E4M3 times power-of-two scales) are
exact in fp32, so an fp32 matmul of rounded inputs is "bf16 inputs, fp32 accumulation".
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from reference.mxfp8 import MX_BLOCK, mxfp8_round

__all__ = ["Mode", "MODES", "check_mode", "carrier", "linear", "store", "mode_name"]

Mode = torch.dtype | str
MODES: tuple[Mode, ...] = (torch.float64, torch.float32, torch.bfloat16, "mxfp8")


def check_mode(mode: Mode) -> Mode:
    if mode not in MODES:
        raise ValueError(
            f"unsupported compute_dtype {mode!r}; supported: torch.float64, torch.float32, "
            "torch.bfloat16, 'mxfp8'"
        )
    return mode


def mode_name(mode: Mode) -> str:
    return mode if isinstance(mode, str) else str(mode).replace("torch.", "")


def carrier(mode: Mode) -> torch.dtype:
    """dtype of the tensors that carry values in this mode."""
    return torch.float64 if mode == torch.float64 else torch.float32


def store(t: torch.Tensor, mode: Mode) -> torch.Tensor:
    """Round a GEMM output or activation to the mode's storage precision (stays in carrier)."""
    if mode in (torch.bfloat16, "mxfp8"):
        return t.to(torch.bfloat16).to(torch.float32)
    return t.to(carrier(mode))


def _mx_along_last(t: torch.Tensor) -> torch.Tensor:
    """MXFP8 fake-quant along the last axis, zero-padding it to a multiple of the block."""
    n = t.shape[-1]
    pad = (-n) % MX_BLOCK
    if pad:
        t = F.pad(t, (0, pad))
    return mxfp8_round(t, axis=-1)[..., :n]


def gemm_input(t: torch.Tensor, mode: Mode) -> torch.Tensor:
    """Round a GEMM operand whose reduction axis is its last axis."""
    if mode == "mxfp8":
        return _mx_along_last(t.float())
    if mode == torch.bfloat16:
        return t.to(torch.bfloat16).to(torch.float32)
    return t.to(carrier(mode))


def linear(a: torch.Tensor, w: torch.Tensor, mode: Mode) -> torch.Tensor:
    """``a @ w.T`` with both operands reduced over their last axis, rounded per ``mode``.

    a: [n, K], w: [m, K] -> [n, m] in the carrier dtype (not yet rounded for storage).
    """
    return gemm_input(a, mode) @ gemm_input(w, mode).T
