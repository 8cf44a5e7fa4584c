"""Grouped-GEMM waves: a persistent tile queue over the compute SMs, with fractional waves,
backfill, a per-GEMM fill/drain cost, weight streaming and a chip-wide tensor-rate ceiling.

The compute SMs of a rank take 128 x N output tiles from one queue in order (the GEMMs of a
round, then those of the next round once its rows have arrived). An SM that finishes a tile takes
the next one, so the tiles of the next GEMM start on the SMs left idle by the last, partial wave
of the previous GEMM (backfill); inside a round the down GEMM's tiles of a row tile only wait for
the gate+up tiles of that row tile, which the GPU-scope handoff covers.

One GEMM of ``T`` tiles of ``m_tile x n_tile``, reduction depth K, ``E`` experts, on ``P`` compute
SMs:

* per-SM rate (:func:`per_sm_tflops`): ``r(P) = min(tile_efficiency * F / num_sms,
  sustained_efficiency * F / P)`` with ``F = tensor_tflops[dtype]``: a few SMs each run at
  ``tile_efficiency``, but all of them together never exceed ``sustained_efficiency * F`` (the
  chip's power-limited rate: in the dense probe's SM-carveout sweep the rate per SM is flat up to
  66 SMs and the total about flat from 116 to 132 SMs). In the layer the compute SMs share it
  alone: the comm SMs' copies are assumed to draw none of it;
* compute time of a tile: ``t_c = tile_fixed_us + 2 * m_tile * n_tile * K / r(P)``; with an
  operand ceiling (``operand_tbps``, set by a fused profile only) the second term is the 2-norm of
  itself and the tile's share of the ceiling, ``P * (m_tile + n_tile) * K * bytes / operand_tbps
  - tile_fixed_us``;
* weight streaming: the GEMM reads ``E * N * K * weight bytes`` from HBM at ``weight_gbps`` (on
  another GPU scaled by its ``hbm_gbps`` over ``reference_hbm_gbps``):
  ``t_w``. A tile lasts ``t = max(t_c, t_w / max(1, T / P))`` (its share of the stream), so a GEMM
  takes at least ``t_w`` (``max(flops / rate, weight bytes / bandwidth)``);
* fill/drain: every SM pays ``fill_us`` once per GEMM before its first tile of that GEMM (kernel
  ramp, pipeline fill of new operand shapes, epilogue drain); inside the megakernel
  ``layer_fill_us = fill_us - launch_us``.

A round (one or more GEMMs released together) is then timed two ways (:func:`round_times`):

* ``busy``: the fluid occupancy of the pool, ``sum(fill + handoff + T * t / P)``, i.e. fractional
  waves: when the next round's rows are there, its tiles backfill the tail;
* ``done``: when its last tile ends, from a list schedule of its tiles on ``P`` SMs that start idle
  (exact for a persistent queue of equal tiles per GEMM): ``ceil(T / P)`` waves for one GEMM, one
  wave for two GEMMs whose tiles sum to one wave.

The layer (:mod:`sim.layer.model`) puts ``busy`` on the rank's compute chain and ``done - busy``
(the tail) on the path to the round's combine. Approximation: a round that starts while the
previous round's tail still runs is timed as if its first wave were aligned.

The fit (:mod:`sim.app.gemm_fit`) times the probe's standalone ``torch._grouped_mm`` with
:func:`standalone_gemm_us`, which adds what that kernel does and the megakernel does not: its
tiling (:func:`probe_tiles`: CUTLASS 128 x 256 tiles, or 64 x 128 up to 128 rows per expert, in
clusters of two CTAs along M, so that each expert's row tiles round up to an even count) and the
host time of a call issued back to back (``host_us``, a floor on the measured time).

:class:`GemmWaves` holds the parameters. They are GPU profile data (the class lives in
:mod:`sim.core.hardware` beside the profile's other sections): the ``gemm_waves`` section of
``sim/profiles/<gpu>.json`` (:attr:`sim.core.hardware.GpuProfile.gemm_waves`), which
``python -m sim.app.calibrate`` writes from :func:`sim.app.gemm_fit.fit` for the H200 and the
H100 (each on its own probe) and carries over from the H200 to the other derived profiles (rates
as the same fractions of their own ``tensor_tflops``).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from sim.core.hardware import FUSED_PROFILE_FORMAT, GemmWaves, GpuProfile, profile_path

__all__ = [
    "GemmWaves",
    "kernel_waves",
    "load_kernel_waves",
    "GemmSpec",
    "gemm_spec",
    "per_sm_tflops",
    "probe_tiles",
    "schedule_tiles",
    "round_times",
    "standalone_gemm_us",
    "weight_bytes_per_elem",
    "PROBE_TILE",
    "PROBE_SMALL_TILE",
    "PROBE_CLUSTER_M",
]

# torch._grouped_mm (bf16, sm90; torch 2.11, aten/src/ATen/native/cuda/GroupMM.cu): a persistent
# CUTLASS kernel with 128 x 256 tiles, 64 x 128 tiles when the rows per group or N are <= 128,
# both in clusters of 2 x 1 CTAs; the group scheduler rounds each group's M tiles up to the
# cluster, so an odd count of row tiles per expert runs one idle tile.
PROBE_TILE = (128, 256)
PROBE_SMALL_TILE = (64, 128)
PROBE_SMALL_MAX = 128
PROBE_CLUSTER_M = 2


def weight_bytes_per_elem(dtype: str) -> float:
    """Weight bytes per element: bf16 2; mxfp8 1 plus one e8m0 scale per 32 elements."""
    return 2.0 if dtype == "bf16" else 1.0 + 1.0 / 32


def per_sm_tflops(gpu: GpuProfile, p: GemmWaves, compute_sms: int, dtype: str = "bf16") -> float:
    """Tensor TFLOP/s of each of ``compute_sms`` SMs that run tiles together: the per-SM rate,
    capped by the chip's sustained rate shared among them."""
    f = gpu.tflops(dtype)
    return min(p.tile_efficiency * f / gpu.num_sms, p.sustained_efficiency * f / compute_sms)


@dataclass(frozen=True)
class GemmSpec:
    """One GEMM of a round: ``tiles`` tiles of ``tile_us`` each (weight share included)."""

    tiles: int
    tile_us: float
    compute_tile_us: float
    weight_us: float


def kernel_waves(
    gpu: GpuProfile, gemm_efficiency: float, tile_fixed_us: float, operand_tbps: float
) -> GemmWaves:
    """The GPU's GEMM waves at a fused kernel's fitted rates: ``tile_efficiency`` = its k-loop
    efficiency (both a fraction of the GPU's per-SM share of ``tensor_tflops``), its per-tile
    fixed cost, and its operand ceiling (TB/s; inf: none) as the 2-norm of :func:`gemm_spec`.
    The sustained cap, fill, launch, host floor and weight streaming stay the GPU's; the fused
    model's 64-row sub-tile factors have no counterpart here (the layer model has no split
    blocks)."""
    return gpu.waves().replace(
        tile_efficiency=gemm_efficiency,
        tile_fixed_us=tile_fixed_us,
        operand_tbps=None if math.isinf(operand_tbps) else operand_tbps,
        source=f"k-loop, tile and operand terms of a fused profile; the rest: {gpu.waves().source}",
    )


def load_kernel_waves(gpu: GpuProfile, profile: str) -> GemmWaves:
    """:func:`kernel_waves` with the terms of a fused profile (``sim/profiles/<name>.json`` or a
    path, format ``mok-fused-profile/1``: ``gemm_efficiency``, ``tile_fixed_us``,
    ``operand_tbps``; :class:`sim.fused.profile.FusedProfile`)."""
    try:
        d = json.loads(profile_path(profile).read_text())
    except OSError as e:
        raise ValueError(f"gemm_profile {profile!r} not found ({e.strerror})") from None
    if d.get("format") != FUSED_PROFILE_FORMAT:
        raise ValueError(
            f"gemm_profile {profile!r} is not a fused profile (format {d.get('format')!r}, "
            f"want {FUSED_PROFILE_FORMAT})"
        )
    ceiling = d.get("operand_tbps")
    return kernel_waves(
        gpu, d["gemm_efficiency"], d["tile_fixed_us"], math.inf if ceiling is None else ceiling
    )


def gemm_spec(
    gpu: GpuProfile,
    p: GemmWaves,
    row_tiles: int,
    n: int,
    k: int,
    experts: int,
    compute_sms: int,
    dtype: str = "bf16",
    row_tile: int = 128,
    n_tile: int | None = None,
    weight_elems: float | None = None,
) -> GemmSpec:
    """Tiles and tile time of a grouped GEMM of ``row_tiles`` row tiles over ``experts``
    experts' weights ([N, K] each), output width ``n``, depth ``k``; tiles of ``row_tile`` x
    ``n_tile`` (default: the GPU's ``gemm_n_tile``). ``weight_elems``: the elements streamed
    once per GEMM in place of ``experts x N x K`` (a weight-gradient GEMM, whose depth is the
    token axis, writes its ``[N_out, K_out]`` gradient per expert once instead)."""
    if compute_sms <= 0:
        raise ValueError(f"no compute SMs left (compute_sms={compute_sms})")
    if row_tiles <= 0 or n <= 0 or k <= 0:
        return GemmSpec(0, 0.0, 0.0, 0.0)
    n_tile = n_tile or gpu.gemm_n_tile
    tiles = row_tiles * math.ceil(n / n_tile)
    per_sm = per_sm_tflops(gpu, p, compute_sms, dtype) * 1e6  # flops per us
    own = 2.0 * row_tile * n_tile * k / per_sm
    if p.operand_tbps is not None:
        # the 2-norm of the SM's own MMA time and its share of the chip-wide operand ceiling
        # (all compute SMs streaming their A and B boxes; the part of the ceiling the others
        # spend in the tiles' fixed parts does not count), as sim.fused.tiles.kblock_us does
        # per k-block
        operand = (row_tile + n_tile) * k * weight_bytes_per_elem(dtype) * compute_sms
        shared = operand / (p.operand_tbps * 1e6) - p.tile_fixed_us
        own = math.hypot(own, max(shared, 0.0))
    t_c = p.tile_fixed_us + own
    bw = p.weight_gbps * gpu.hbm_gbps / p.reference_hbm_gbps
    if weight_elems is None:
        t_w = max(1, experts) * n * k * weight_bytes_per_elem(dtype) / (bw * 1e3)
    else:
        t_w = weight_elems * weight_bytes_per_elem(dtype) / (bw * 1e3)
    t = max(t_c, t_w / max(1.0, tiles / compute_sms))
    return GemmSpec(tiles, t, t_c, t_w)


def schedule_tiles(free: np.ndarray, tiles: int, tile_us: float) -> np.ndarray:
    """Free times of the SMs after a persistent queue hands out ``tiles`` equal tiles of
    ``tile_us``: each tile goes to the SM that frees first (list scheduling). ``free`` is not
    modified; the result is sorted."""
    f = np.sort(np.asarray(free, dtype=np.float64))
    rem = int(tiles)
    if rem <= 0 or tile_us <= 0:
        return f
    P = f.size
    while rem > 0:
        # SMs that free before the first one would finish another tile: one tile each, in order
        s = int(np.searchsorted(f, f[0] + tile_us, side="right"))
        if s >= P and rem >= P:
            q = rem // P
            f += q * tile_us
            rem -= q * P
            continue
        n = min(s, rem)
        f[:n] += tile_us
        rem -= n
        f.sort()
    return f


def _round_times(
    specs: tuple[tuple[int, float], ...], compute_sms: int, fill_us: float, handoff_us: float
) -> tuple[float, float]:
    free = np.zeros(compute_sms)
    busy = 0.0
    for i, (tiles, t) in enumerate(specs):
        if tiles <= 0:
            continue
        gap = fill_us + (handoff_us if i else 0.0)
        free = schedule_tiles(free + gap, tiles, t)
        busy += gap + tiles * t / compute_sms
    return busy, float(free.max()) if busy else 0.0


_round_times_cached = lru_cache(maxsize=65536)(_round_times)


def round_times(
    specs: list[GemmSpec], compute_sms: int, fill_us: float, handoff_us: float = 0.0
) -> tuple[float, float]:
    """(busy, done) of the GEMMs ``specs`` released together on ``compute_sms`` idle SMs, in us:
    ``busy`` the fluid occupancy (fractional waves), ``done`` the end of the last tile (list
    schedule). ``handoff_us`` separates consecutive GEMMs (the GPU-scope flag)."""
    key = tuple((s.tiles, s.tile_us) for s in specs)
    return _round_times_cached(key, int(compute_sms), float(fill_us), float(handoff_us))


def probe_tiles(experts: int, rows_per_expert: int, n: int) -> tuple[int, int, int]:
    """(row tiles, tile rows, tile columns) of the probe's ``torch._grouped_mm`` over
    ``experts`` groups of ``rows_per_expert`` rows and output width ``n``: the kernel's tile
    shape (:data:`PROBE_TILE`, :data:`PROBE_SMALL_TILE`), and each expert's row tiles rounded
    up to whole clusters of :data:`PROBE_CLUSTER_M`."""
    small = rows_per_expert <= PROBE_SMALL_MAX or n <= PROBE_SMALL_MAX
    tm, tn = PROBE_SMALL_TILE if small else PROBE_TILE
    per_expert = -(-math.ceil(rows_per_expert / tm) // PROBE_CLUSTER_M) * PROBE_CLUSTER_M
    return experts * per_expert, tm, tn


def standalone_gemm_us(
    gpu: GpuProfile,
    p: GemmWaves,
    experts: int,
    rows_per_expert: int,
    n: int,
    k: int,
    compute_sms: int,
    dtype: str = "bf16",
) -> float:
    """One grouped GEMM launched alone and timed back to back (the probe's
    ``torch._grouped_mm``): ``experts`` groups of ``rows_per_expert`` rows in that kernel's
    tiles (:func:`probe_tiles`); ``fill_us`` plus the list schedule of its tiles, at least
    ``host_us``."""
    if rows_per_expert <= 0:
        return p.host_us
    row_tiles, tm, tn = probe_tiles(experts, rows_per_expert, n)
    s = gemm_spec(gpu, p, row_tiles, n, k, experts, compute_sms, dtype, tm, tn)
    return max(p.host_us, round_times([s], compute_sms, p.fill_us)[1])
