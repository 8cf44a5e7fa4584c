"""DeepEP's normal-mode dispatch and combine as a rate law fitted on our measured rows: the
communication of the DeepEP + torch-best baseline (:mod:`sim.layer.baseline`).

What the kernels move, per rank: one ``hidden * 2``-byte row per distinct (token, destination
rank) pair (the dispatch sends a token once to every rank that holds one of its experts; the
combine sends back one row per such pair, the owner's sum over its local experts), so both
directions of a rank's NVLink port carry the dedup rows. The measured rows
(:data:`DEEPEP_SOURCE`, ``impl == "deepep"``: DeepEP's intranode normal kernels on two H200,
DeepSeek-V3 and Qwen3-30B-A3B, 512 / 4096 / 16384 tokens, uniform and hot:0.5) give, per kernel
and row size, a time ``fixed_us + bytes / rate`` over the row's ``nvlink_bytes`` (the remote
dedup bytes of one rank, one direction), fitted by least squares on the relative error
(:func:`fit_deepep`). At :data:`DEEPEP_SMS` (128), the fastest SM count measured: the baseline
runs its communication alone, so it may take the whole GPU.

Carried to another GPU and EP size (:meth:`DeepEPRates.phase_us`) with these assumptions:

* the fitted rate is kept as a fraction of the H200's NVLink payload ceiling
  (:func:`nvlink_payload_gbps`: the wire rate over the push protocol's bytes per payload byte);
  on another GPU the kernel reaches the same fraction of its own ceiling;
* a rank's time is ``fixed_us + max(bytes out, bytes in) / rate`` over its remote dedup bytes,
  and the phase ends with its slowest rank (a collective). The fixed part does not grow with
  the ranks. An NVSwitch fabric is non-blocking, so the port is the bound, as at EP2;
* a row size between the measured ones interpolates both terms linearly in ``hidden``, outside
  them it takes the nearest;
* DeepEP V1's intranode kernels stop at 8 NVLink peers (and 128 experts per rank): beyond that
  the law is applied as if one NVLink domain of any size ran them (at EP64 on an NVL72 a bound
  DeepEP does not reach as built, not a prediction of its internode kernels).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from sim.core.hardware import GpuProfile, load_gpu
from sim.measured import measured_path, read_rows

__all__ = [
    "DEEPEP_SOURCE",
    "DEEPEP_SMS",
    "DEEPEP_GPU",
    "DeepEPFit",
    "DeepEPRates",
    "fit_deepep",
    "deepep_rates",
    "nvlink_payload_gbps",
]

# the measured DeepEP rows: mok.bench comm on two H200 (the v4 grid, deepep at 24 and 128 SMs)
DEEPEP_SOURCE = "h200x2-comm-grid-v4-2026-11-30.csv"
DEEPEP_SMS = 128
DEEPEP_GPU = "h200"  # the GPU the rows ran on
PHASES = ("dispatch", "combine")


def nvlink_payload_gbps(gpu: GpuProfile) -> float:
    """Payload GB/s one direction of ``gpu``'s NVLink port carries at most: its usable wire rate
    over the push protocol's bytes on the wire per payload byte (DeepEP's intranode kernels
    store into the receiver's buffer)."""
    return gpu.nvlink_wire_gbps / gpu.protocol["push"].data_bytes_per_byte


@dataclass(frozen=True)
class DeepEPFit:
    """One kernel at one row size: ``fixed_us + bytes / (payload_frac x ceiling)``."""

    phase: str  # "dispatch" | "combine"
    hidden: int
    fixed_us: float
    payload_frac: float  # of nvlink_payload_gbps of the GPU the rows ran on
    num_rows: int
    max_abs_err: float  # relative, over the fit rows

    def us(self, nbytes, ceiling_gbps: float):
        """Time of a rank moving ``nbytes`` (scalar or array) at ``ceiling_gbps``."""
        return self.fixed_us + np.asarray(nbytes, dtype=np.float64) / (
            self.payload_frac * ceiling_gbps * 1e3
        )


@dataclass(frozen=True)
class DeepEPRates:
    """The fits of both kernels at every measured row size, and where they came from."""

    fits: tuple[DeepEPFit, ...]
    source: str
    sms: int

    def _at(self, phase: str, hidden: int) -> tuple[float, float]:
        """(fixed_us, payload_frac) of ``phase`` at ``hidden``, interpolated in hidden."""
        fs = sorted((f for f in self.fits if f.phase == phase), key=lambda f: f.hidden)
        if not fs:
            raise ValueError(f"no DeepEP {phase} rows in {self.source} at {self.sms} SMs")
        hs = [f.hidden for f in fs]
        return (
            float(np.interp(hidden, hs, [f.fixed_us for f in fs])),
            float(np.interp(hidden, hs, [f.payload_frac for f in fs])),
        )

    def phase_us(self, phase: str, hidden: int, gpu: GpuProfile, pair_rows: np.ndarray):
        """[R] time of each rank in ``phase`` ("dispatch" / "combine"), all ranks at once, from
        ``pair_rows`` [R_src, R_dst]: the distinct (token, destination rank) pairs of the
        tokens of each source rank (the diagonal stays on the rank: no NVLink bytes). The
        dispatch sends them source -> destination, the combine destination -> source: each
        rank's port carries the same bytes both ways, its busier direction sets its time."""
        if phase not in PHASES:
            raise ValueError(f"unknown DeepEP phase {phase!r}; supported: {', '.join(PHASES)}")
        fixed, frac = self._at(phase, hidden)
        remote = np.asarray(pair_rows, dtype=np.float64).copy()
        np.fill_diagonal(remote, 0.0)
        row_bytes = 2.0 * hidden
        busier = np.maximum(remote.sum(axis=1), remote.sum(axis=0)) * row_bytes
        return fixed + busier / (frac * nvlink_payload_gbps(gpu) * 1e3)


def fit_deepep(rows: list[dict], sms: int = DEEPEP_SMS, gpu: str = DEEPEP_GPU) -> DeepEPRates:
    """Fit :class:`DeepEPFit` per (phase, hidden) on the ``impl == "deepep"`` rows at ``sms``
    SMs of a ``mok.bench comm`` CSV: least squares of ``fixed_us + bytes x inv_rate`` on the
    relative error (every row weighs alike, small and large)."""
    ceiling = nvlink_payload_gbps(load_gpu(gpu))
    fits = []
    for phase in PHASES:
        mine = [r for r in rows if r["impl"] == "deepep" and r["what"] == phase]
        mine = [r for r in mine if int(r["sms"]) == sms]
        for hidden in sorted({int(r["hidden"]) for r in mine}):
            sel = [r for r in mine if int(r["hidden"]) == hidden]
            b = np.array([float(r["nvlink_bytes"]) for r in sel])
            t = np.array([float(r["median_us"]) for r in sel])
            if len(sel) < 2 or np.ptp(b) <= 0:
                raise ValueError(
                    f"DeepEP {phase} at hidden {hidden}, {sms} SMs: need rows of two sizes or "
                    f"more to fit a fixed cost and a rate (found {len(sel)})"
                )
            a = np.c_[np.ones_like(b), b]
            (fixed, inv), *_ = np.linalg.lstsq(a / t[:, None], np.ones_like(t), rcond=None)
            err = float(np.max(np.abs(a @ (fixed, inv) / t - 1.0)))
            frac = 1.0 / (inv * ceiling * 1e3)
            fits.append(DeepEPFit(phase, hidden, float(fixed), float(frac), len(sel), err))
    if not fits:
        raise ValueError(f"no DeepEP rows at {sms} SMs to fit")
    return DeepEPRates(tuple(fits), DEEPEP_SOURCE, sms)


@lru_cache(maxsize=1)
def deepep_rates() -> DeepEPRates:
    """:func:`fit_deepep` on :data:`DEEPEP_SOURCE` (read and fitted once per process)."""
    return fit_deepep(read_rows(measured_path(DEEPEP_SOURCE)))
