"""Grouped-GEMM time model: 128 x N output tiles, one per SM, in waves over the compute SMs.

A tile of ``row_tile x n_tile`` outputs with reduction depth K costs ``2 * row_tile * n_tile * K``
FLOPs at the per-SM tensor rate ``tensor_tflops[dtype] / num_sms * gemm_efficiency``. A GEMM of
``row_tiles x ceil(N / n_tile)`` tiles runs ``ceil(tiles / compute_sms)`` waves; a partial wave
costs a full one (the tail), as does a partial N tile. The expert FFN of one round is the gate+up
GEMM (N = 2 * intermediate, K = hidden) with SwiGLU fused into its epilogue, a local handoff
(GPU-scope flag) and the down GEMM (N = hidden, K = intermediate).
"""

from __future__ import annotations

import math

from sim.core.hardware import GpuProfile

__all__ = ["gemm_us", "expert_ffn_us", "reduce_us"]


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


def expert_ffn_us(
    gpu: GpuProfile,
    row_tiles: int,
    hidden: int,
    intermediate: int,
    compute_sms: int,
    dtype: str = "bf16",
    row_tile: int = 128,
) -> float:
    """SwiGLU FFN of ``row_tiles`` row tiles: gate+up, handoff, down."""
    if row_tiles <= 0:
        return 0.0
    up = gemm_us(gpu, row_tiles, 2 * intermediate, hidden, compute_sms, dtype, row_tile)
    down = gemm_us(gpu, row_tiles, hidden, intermediate, compute_sms, dtype, row_tile)
    return up + gpu.flag_latency_local_us + down


def reduce_us(gpu: GpuProfile, rows_in: int, rows_out: int, hidden: int, bytes_per_elem=2) -> float:
    """Memory-bound weighted sum on the home rank: read ``rows_in`` rows, write ``rows_out``."""
    traffic = (rows_in + rows_out) * hidden * bytes_per_elem
    return traffic / (2.0 * gpu.hbm_copy_gbps * 1e3)
