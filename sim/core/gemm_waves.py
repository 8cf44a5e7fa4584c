"""Grouped-GEMM waves: a persistent tile queue over the compute SMs, with fractional waves,
backfill, a per-GEMM fill/drain cost and weight streaming.

The compute SMs of a rank take 128 x N output tiles from one queue in order (the GEMMs of a
round, then those of the next round once its rows have arrived). An SM that finishes a tile takes
the next one, so the tiles of the next GEMM start on the SMs left idle by the last, partial wave
of the previous GEMM (backfill); inside a round the down GEMM's tiles of a row tile only wait for
the gate+up tiles of that row tile, which the GPU-scope handoff covers.

One GEMM of ``T`` tiles, reduction depth K, ``E`` experts, on ``P`` compute SMs:

* compute time of a tile: ``t_c = tile_fixed_us + 2 * row_tile * n_tile * K / r``, with the per-SM
  rate ``r = tile_efficiency * tensor_tflops[dtype] / num_sms``;
* weight streaming: the GEMM reads ``E * N * K * weight bytes`` from HBM at ``weight_gbps`` (on
  another GPU scaled by its ``hbm_gbps`` over ``reference_hbm_gbps``):
  ``t_w``. A tile lasts ``t = max(t_c, t_w / max(1, T / P))`` (its share of the stream), so a GEMM
  takes at least ``t_w`` (``max(flops / rate, weight bytes / bandwidth)``);
* fill/drain: every SM pays ``fill_us`` once per GEMM before its first tile of that GEMM (pipeline
  fill of new operand shapes, epilogue drain).

A round (one or more GEMMs released together) is then timed two ways (:func:`round_times`):

* ``busy``: the fluid occupancy of the pool, ``sum(fill + handoff + T * t / P)``, i.e. fractional
  waves: when the next round's rows are there, its tiles backfill the tail;
* ``done``: when its last tile ends, from a list schedule of its tiles on ``P`` SMs that start idle
  (exact for a persistent queue of equal tiles per GEMM): ``ceil(T / P)`` waves for one GEMM, one
  wave for two GEMMs whose tiles sum to one wave.

The layer (:mod:`sim.layer.model`) puts ``busy`` on the rank's compute chain and ``done - busy``
(the tail) on the path to the round's combine. Approximation: a round that starts while the
previous round's tail still runs is timed as if its first wave were aligned.

:class:`GemmWaves` holds the parameters, fitted by :func:`sim.app.gemm_fit.fit` on the one-H200
probe's grouped GEMMs by rows per expert. They belong in the GPU hardware profile
(``sim/profiles/h200.json``) once that format carries them; until then the defaults here are the
H200 fit and other GPUs use them as a lead (scaled through their own ``tensor_tflops``).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace
from functools import lru_cache

import numpy as np

from sim.core.hardware import GpuProfile

__all__ = [
    "GemmWaves",
    "H200_GEMM_WAVES",
    "GemmSpec",
    "gemm_spec",
    "schedule_tiles",
    "round_times",
    "standalone_gemm_us",
    "weight_bytes_per_elem",
]


@dataclass(frozen=True)
class GemmWaves:
    """Parameters of the waves model (module docstring); defaults: the H200 fit."""

    tile_efficiency: float = 1.101  # per-SM tile rate / (tensor_tflops / num_sms)
    tile_fixed_us: float = 0.342  # per tile: prologue + epilogue not hidden by the main loop
    fill_us: float = 33.5  # per GEMM as the standalone probe sees it (includes its launch)
    weight_gbps: float = 4927.0  # weight-streaming rate from HBM
    launch_us: float = 13.0  # part of fill_us that a standalone launch pays (the megakernel not)
    reference_hbm_gbps: float = 4800.0  # hbm_gbps of the fitted GPU: weight_gbps scales with it
    source: str = "fit on h200-probe-1gpu-2026-11-30.json (sim.app.gemm_fit)"

    @property
    def layer_fill_us(self) -> float:
        """Per-GEMM fill/drain inside the megakernel: ``fill_us`` less the launch."""
        return max(0.0, self.fill_us - self.launch_us)

    def replace(self, **kw) -> GemmWaves:
        return replace(self, **kw)

    def to_dict(self) -> dict:
        return asdict(self)


H200_GEMM_WAVES = GemmWaves()


def weight_bytes_per_elem(dtype: str) -> float:
    """Weight bytes per element: bf16 2; mxfp8 1 plus one e8m0 scale per 32 elements."""
    return 2.0 if dtype == "bf16" else 1.0 + 1.0 / 32


@dataclass(frozen=True)
class GemmSpec:
    """One GEMM of a round: ``tiles`` tiles of ``tile_us`` each (weight share included)."""

    tiles: int
    tile_us: float
    compute_tile_us: float
    weight_us: float


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
) -> GemmSpec:
    """Tiles and tile time of a grouped GEMM of ``row_tiles`` row tiles over ``experts``
    experts' weights ([N, K] each), output width ``n``, depth ``k``."""
    if compute_sms <= 0:
        raise ValueError(f"no compute SMs left (compute_sms={compute_sms})")
    if row_tiles <= 0 or n <= 0 or k <= 0:
        return GemmSpec(0, 0.0, 0.0, 0.0)
    tiles = row_tiles * math.ceil(n / gpu.gemm_n_tile)
    per_sm = gpu.tflops(dtype) * 1e6 / gpu.num_sms * p.tile_efficiency  # flops per us
    t_c = p.tile_fixed_us + 2.0 * row_tile * gpu.gemm_n_tile * k / per_sm
    bw = p.weight_gbps * gpu.hbm_gbps / p.reference_hbm_gbps
    t_w = max(1, experts) * n * k * weight_bytes_per_elem(dtype) / (bw * 1e3)
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


def standalone_gemm_us(
    gpu: GpuProfile,
    p: GemmWaves,
    experts: int,
    rows_per_expert: int,
    n: int,
    k: int,
    compute_sms: int,
    dtype: str = "bf16",
    row_tile: int = 128,
) -> float:
    """One grouped GEMM launched alone (the probe's ``torch._grouped_mm``): ``experts`` groups of
    ``rows_per_expert`` rows; ``fill_us`` (with the launch) plus the list schedule of its tiles."""
    row_tiles = experts * math.ceil(rows_per_expert / row_tile)
    s = gemm_spec(gpu, p, row_tiles, n, k, experts, compute_sms, dtype, row_tile)
    return round_times([s], compute_sms, p.fill_us)[1]
