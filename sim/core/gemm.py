"""Grouped-GEMM time model: 128 x N output tiles, one per SM, in waves over the compute SMs.

A tile of ``row_tile x n_tile`` outputs with reduction depth K costs ``2 * row_tile * n_tile * K``
FLOPs at the per-SM tensor rate ``tensor_tflops[dtype] / num_sms * gemm_efficiency``. A GEMM of
``row_tiles x ceil(N / n_tile)`` tiles runs ``ceil(tiles / compute_sms)`` waves; a partial wave
costs a full one (the tail), as does a partial N tile. ``mok-sim calibrate`` fits
``gemm_efficiency`` with it; the layer model times its GEMMs with :mod:`sim.core.gemm_waves`.
"""

from __future__ import annotations

import math

from sim.core.hardware import GpuProfile

__all__ = ["gemm_us", "reduce_us"]


def gemm_us(
    gpu: GpuProfile,
    row_tiles: int,
    n: int,
    k: int,
    compute_sms: int,
    dtype: str = "bf16",
    row_tile: int = 128,
) -> float:
    """Time (us) of a GEMM with ``row_tiles`` row tiles, output width ``n``, depth ``k``."""
    if row_tiles <= 0 or n <= 0 or k <= 0:
        return 0.0
    if compute_sms <= 0:
        raise ValueError(f"no compute SMs left (compute_sms={compute_sms})")
    tiles = row_tiles * math.ceil(n / gpu.gemm_n_tile)
    waves = math.ceil(tiles / compute_sms)
    per_sm_flops_per_us = gpu.tflops(dtype) * 1e6 / gpu.num_sms * gpu.gemm_efficiency
    return waves * 2.0 * row_tile * gpu.gemm_n_tile * k / per_sm_flops_per_us


def reduce_us(gpu: GpuProfile, rows_in: int, rows_out: int, hidden: int, bytes_per_elem=2) -> float:
    """Memory-bound weighted sum on the home rank: read ``rows_in`` rows, write ``rows_out``."""
    traffic = (rows_in + rows_out) * hidden * bytes_per_elem
    return traffic / (2.0 * gpu.hbm_copy_gbps * 1e3)
