"""Fit of the GEMM waves model (:mod:`sim.core.gemm_waves`) on the probe's grouped GEMMs.

Points: ``grouped_gemm_by_rows`` (all SMs, rows per expert) and ``grouped_gemm_by_sms`` (SM
carveout at 2048 rows per expert) of every probe JSON under ``mok/bench/results`` that has them;
each point is ``torch._grouped_mm`` over 8 experts, gate+up (N = 2 x intermediate, K = hidden) or
down (N = hidden, K = intermediate), timed with :func:`sim.core.gemm_waves.standalone_gemm_us`.
Fit subset: every point of :data:`sim.measured.GEMM_WAVES_FIT_PROBES` (the dense one-H200 sweep,
by rows and by SMs); every other point is held out. The fit minimises the squared log error over
``tile_efficiency``, ``sustained_efficiency``, ``tile_fixed_us``, ``fill_us``, ``host_us`` and
``weight_gbps`` (coordinate search with shrinking steps, numpy only); ``launch_us``
(:data:`LAUNCH_US`) is not identified by these points and is an assumption.
:func:`dense_probe_command` is the probe run of the fit points.

``python -m sim.app.calibrate`` writes the result into the ``gemm_waves`` section of
``sim/profiles/h200.json``; ``python -m sim.app.gemm_fit`` prints the fitted values and the error
of every point.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass

import numpy as np

from sim.core.gemm_waves import GemmWaves, standalone_gemm_us
from sim.core.hardware import GpuProfile, load_gpu
from sim.measured import GEMM_WAVES_FIT_PROBES, results_dir

__all__ = [
    "GemmPoint",
    "probe_points",
    "predict",
    "fit",
    "errors",
    "dense_probe_command",
    "DENSE_GEMM_ROWS",
    "LAUNCH_US",
    "FIT_PARAMS",
]

# The part of a standalone launch's fill that the megakernel does not pay: the per-launch cost of
# the comm kernels as back-to-back CUDA events see it (call_fixed_us of
# sim/profiles/mok-comm-h200x2.json). Not identified by the probe's GEMMs: an assumption.
LAUNCH_US = 13.0

# Rows per expert of a dense one-H200 sweep: every multiple of 128 up to 1024 (the one- and
# two-wave region where partial waves matter), then coarser up to 4096.
DENSE_GEMM_ROWS = (*range(128, 1025, 128), 1280, 1536, 1792, 2048, 2560, 3072, 3584, 4096)


def dense_probe_command(out: str = "h200-probe-gemm-dense.json") -> str:
    """The ``python -m mok.bench probe`` command of a dense one-H200 sweep of grouped GEMMs by
    rows per expert (both shapes, 8 experts, all SMs) plus the carveout sweep; every other
    section skipped."""
    rows = ",".join(map(str, DENSE_GEMM_ROWS))
    return (
        f"python -m mok.bench probe --out {out} --csv {out.removesuffix('.json')}.csv "
        f"--sections grouped --gemm-rows {rows} "
        "--gemm-sms 8,16,32,48,66,100,116,132 --iters 20 --warmup 5"
    )


@dataclass(frozen=True)
class GemmPoint:
    source: str  # probe file name
    section: str  # "by_rows" or "by_sms"
    shape: str
    op: str  # gate_up / down
    experts: int
    rows: int  # rows per expert
    n: int
    k: int
    sms: int
    us: float

    @property
    def is_fit(self) -> bool:
        return self.source in GEMM_WAVES_FIT_PROBES


def probe_points(names: tuple[str, ...] | None = None) -> list[GemmPoint]:
    """The grouped-GEMM points of the probe JSONs ``names`` (default: the H200's under
    results_dir, the GPU this fit is for)."""
    paths = (
        [results_dir() / n for n in names]
        if names
        else sorted(results_dir().glob("h200*probe*.json"))
    )
    out = []
    for path in paths:
        res = json.loads(path.read_text()).get("results", {})
        for section, key in (
            ("by_rows", "grouped_gemm_by_rows"),
            ("by_sms", "grouped_gemm_by_sms"),
        ):
            for shape, v in res.get(key, {}).items():
                h, i, e = v["hidden"], v["intermediate"], v["num_experts"]
                for op in ("gate_up", "down"):
                    k, n = (h, 2 * i) if op == "gate_up" else (i, h)
                    for x, pt in v.get(op, {}).items():
                        rows = int(x) if section == "by_rows" else int(v["rows_per_expert"])
                        sms = int(v["num_sms"]) if section == "by_rows" else int(x)
                        out.append(
                            GemmPoint(path.name, section, shape, op, e, rows, n, k, sms, pt["us"])
                        )
    return out


def predict(gpu: GpuProfile, p: GemmWaves, pt: GemmPoint) -> float:
    return standalone_gemm_us(gpu, p, pt.experts, pt.rows, pt.n, pt.k, pt.sms)


def _loss(gpu: GpuProfile, p: GemmWaves, pts: list[GemmPoint]) -> float:
    return float(sum(math.log(predict(gpu, p, q) / q.us) ** 2 for q in pts))


# fitted parameters: start, first step, lower bound, rounding (decimals) of the committed value
FIT_PARAMS = {
    "tile_efficiency": (1.0, 0.1, 0.3, 3),
    "sustained_efficiency": (1.0, 0.1, 0.3, 3),
    "tile_fixed_us": (1.0, 1.0, 0.0, 3),
    "fill_us": (15.0, 8.0, 0.0, 2),
    "host_us": (40.0, 8.0, 0.0, 2),  # from 0 the floor is flat: no descent
    "weight_gbps": (4000.0, 400.0, 500.0, 0),
}


def fit(gpu: GpuProfile | None = None, pts: list[GemmPoint] | None = None) -> GemmWaves:
    """Fitted :class:`GemmWaves` on the fit points (default: the fit subset of all probes) for
    ``gpu`` (default: the h200 profile; only its rates, SM count, N tile and HBM bandwidth are
    read)."""
    gpu = gpu or load_gpu("h200")
    pts = [q for q in (pts or probe_points()) if q.is_fit] or list(pts or [])
    if not pts:
        raise ValueError("no fit points (sim.measured.GEMM_WAVES_FIT_PROBES)")
    p = GemmWaves(
        **{k: v[0] for k, v in FIT_PARAMS.items()},
        launch_us=LAUNCH_US,
        reference_hbm_gbps=gpu.hbm_gbps,
    )
    step = {k: v[1] for k, v in FIT_PARAMS.items()}
    best = _loss(gpu, p, pts)
    for _ in range(400):
        moved = False
        for name, s in step.items():
            for sign in (1.0, -1.0):
                v = max(FIT_PARAMS[name][2], getattr(p, name) + sign * s)
                q = p.replace(**{name: v})
                lq = _loss(gpu, q, pts)
                if lq < best - 1e-12:
                    p, best, moved = q, lq, True
                    break
        if not moved:
            step = {k: v / 2 for k, v in step.items()}
            if step["tile_efficiency"] < 1e-4:
                break
    names = ", ".join(GEMM_WAVES_FIT_PROBES)
    return p.replace(
        **{k: round(getattr(p, k), v[3]) for k, v in FIT_PARAMS.items()},
        source=f"sim.app.gemm_fit on the grouped GEMMs (by rows and by SMs) of {names}; "
        f"launch_us={LAUNCH_US:g} assumed (sim.app.gemm_fit.LAUNCH_US)",
    )


def errors(gpu: GpuProfile, p: GemmWaves, pts: list[GemmPoint]) -> dict[str, np.ndarray]:
    """Relative errors (model / measured - 1) of the fit and the held-out points."""
    out = {"fit": [], "holdout": []}
    for q in pts:
        out["fit" if q.is_fit else "holdout"].append(predict(gpu, p, q) / q.us - 1.0)
    return {k: np.asarray(v) for k, v in out.items()}


def main() -> int:
    gpu = load_gpu("h200")
    pts = probe_points()
    p = fit(gpu, pts)
    print(p)
    if p != gpu.gemm_waves:
        print(f"(sim/profiles/h200.json holds {gpu.gemm_waves}: python -m sim.app.calibrate)")
    for q in pts:
        m = predict(gpu, p, q)
        tag = "fit " if q.is_fit else "hold"
        print(
            f"{tag} {q.source:<36}{q.section:<8}{q.shape:<12}{q.op:<8}{q.rows:>5}{q.sms:>5}"
            f"{q.us:>10.1f}{m:>10.1f}{100 * (m / q.us - 1):>+8.1f}%"
        )
    for k, e in errors(gpu, p, pts).items():
        a = np.abs(e)
        print(f"{k}: {a.size} points, median |err| {np.median(a):.3f}, max {a.max():.3f}")
    print(dense_probe_command())
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
