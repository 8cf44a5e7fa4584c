"""Fit of the GEMM waves model (:mod:`sim.core.gemm_waves`) on the probe's grouped GEMMs.

Points: ``grouped_gemm_by_rows`` (all SMs, rows per expert) and ``grouped_gemm_by_sms`` (SM
carveout at 2048 rows per expert) of every probe JSON under ``mok/bench/results`` that has them;
each point is ``torch._grouped_mm`` over 8 experts, gate+up (N = 2 x intermediate, K = hidden) or
down (N = hidden, K = intermediate), timed with :func:`sim.core.gemm_waves.standalone_gemm_us`,
and belongs to the GPU profile of the device its probe ran on (``meta.gpu``,
:func:`sim.measured.gpu_profile_of`). Fit subset of a GPU: every point of its probes in
:data:`sim.measured.GEMM_WAVES_FIT_PROBES` (the dense one-GPU sweep, by rows and by SMs: h200 and
h100); every other point of that GPU is held out, the points of other GPUs are neither. The fit
minimises the squared log error over ``tile_efficiency``, ``sustained_efficiency``,
``tile_fixed_us``, ``fill_us``, ``host_us`` and ``weight_gbps`` (coordinate search with
shrinking steps, numpy only), the rates as fractions of the GPU profile's ``tensor_tflops`` and
``weight_gbps`` at its ``hbm_gbps``; ``launch_us`` (:data:`LAUNCH_US`) is not identified by these
points and is an assumption, the same on every GPU. :func:`dense_probe_command` is the probe
run of the fit points.

``python -m sim.app.calibrate`` writes the result into the ``gemm_waves`` section of
``sim/profiles/h200.json`` and ``sim/profiles/h100.json``; ``python -m sim.app.gemm_fit [GPU]``
(default h200) prints the fitted values and the error of every point of that GPU.
"""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import dataclass

import numpy as np

from sim.core.gemm_waves import GemmWaves, standalone_gemm_us
from sim.core.hardware import GpuProfile, load_gpu
from sim.measured import GEMM_WAVES_FIT_PROBES, gpu_profile_of, results_dir

__all__ = [
    "GemmPoint",
    "probe_points",
    "fit_probes",
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

# Rows per expert of a dense one-GPU sweep: every multiple of 128 up to 1024 (the one- and
# two-wave region where partial waves matter), then coarser up to 4096.
DENSE_GEMM_ROWS = (*range(128, 1025, 128), 1280, 1536, 1792, 2048, 2560, 3072, 3584, 4096)


def dense_probe_command(out: str = "h200-probe-gemm-dense.json") -> str:
    """The ``python -m mok.bench probe`` command of a dense one-GPU sweep of grouped GEMMs by
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
    gpu: str  # GPU profile of the device the probe ran on ("" if none)
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
        """Whether the point is a fit point of its own GPU (:func:`fit_probes`)."""
        return self.source in GEMM_WAVES_FIT_PROBES.get(self.gpu, ())


def fit_probes(gpu: str) -> tuple[str, ...]:
    """The probe files the GEMM waves of GPU profile ``gpu`` are fitted on
    (:data:`sim.measured.GEMM_WAVES_FIT_PROBES`); ValueError for a GPU that has none."""
    try:
        return GEMM_WAVES_FIT_PROBES[gpu]
    except KeyError:
        have = ", ".join(GEMM_WAVES_FIT_PROBES)
        raise ValueError(
            f"no GEMM waves fit probes for GPU {gpu!r} (there are for {have})"
        ) from None


def probe_points(names: tuple[str, ...] | None = None, gpu: str | None = None) -> list[GemmPoint]:
    """The grouped-GEMM points of the probe JSONs ``names`` (default: all under results_dir);
    with ``gpu``, only those of probes run on that GPU profile's device."""
    paths = (
        [results_dir() / n for n in names] if names else sorted(results_dir().glob("*probe*.json"))
    )
    out = []
    for path in paths:
        doc = json.loads(path.read_text())
        on = gpu_profile_of(doc.get("meta", {}).get("gpu")) or ""
        if gpu is not None and on != gpu:
            continue
        res = doc.get("results", {})
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
                            GemmPoint(
                                path.name, on, section, shape, op, e, rows, n, k, sms, pt["us"]
                            )
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
    """Fitted :class:`GemmWaves` for ``gpu`` (default: the h200 profile; only its name, rates,
    SM count, N tile and HBM bandwidth are read) on the fit points of that GPU among ``pts``
    (default: all probes; :attr:`GemmPoint.is_fit`), or on all of ``pts`` if none of them is
    one. Its ``source`` names the probe files of the points fitted."""
    gpu = gpu or load_gpu("h200")
    given = probe_points(gpu=gpu.name) if pts is None else list(pts)
    pts = [q for q in given if q.is_fit and q.gpu == gpu.name] or given
    if not pts:
        raise ValueError(f"no fit points for {gpu.name} (sim.measured.GEMM_WAVES_FIT_PROBES)")
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
    names = ", ".join(dict.fromkeys(q.source for q in pts))
    return p.replace(
        **{k: round(getattr(p, k), v[3]) for k, v in FIT_PARAMS.items()},
        source=f"sim.app.gemm_fit on the grouped GEMMs (by rows and by SMs) of {names}; "
        f"launch_us={LAUNCH_US:g} assumed (sim.app.gemm_fit.LAUNCH_US)",
    )


def errors(gpu: GpuProfile, p: GemmWaves, pts: list[GemmPoint]) -> dict[str, np.ndarray]:
    """Relative errors (model / measured - 1) of the fit and the held-out points of ``gpu``
    among ``pts`` (the points of other GPUs are skipped)."""
    out = {"fit": [], "holdout": []}
    for q in pts:
        if q.gpu == gpu.name:
            out["fit" if q.is_fit else "holdout"].append(predict(gpu, p, q) / q.us - 1.0)
    return {k: np.asarray(v) for k, v in out.items()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m sim.app.gemm_fit",
        description="fit the GEMM waves of a GPU profile on its probes and print every point",
    )
    ap.add_argument("gpu", nargs="?", default="h200", choices=list(GEMM_WAVES_FIT_PROBES))
    name = ap.parse_args(argv).gpu
    gpu = load_gpu(name)
    pts = probe_points(gpu=name)
    p = fit(gpu, pts)
    print(p)
    if p != gpu.gemm_waves:
        print(f"(sim/profiles/{name}.json holds {gpu.gemm_waves}: python -m sim.app.calibrate)")
    for q in pts:
        m = predict(gpu, p, q)
        tag = "fit " if q.is_fit else "hold"
        print(
            f"{tag} {q.source:<40}{q.section:<8}{q.shape:<22}{q.op:<8}{q.rows:>5}{q.sms:>5}"
            f"{q.us:>10.1f}{m:>10.1f}{100 * (m / q.us - 1):>+8.1f}%"
        )
    for k, e in errors(gpu, p, pts).items():
        a = np.abs(e)
        if a.size:
            print(f"{k}: {a.size} points, median |err| {np.median(a):.3f}, max {a.max():.3f}")
        else:
            print(f"{k}: no points")
    print(dense_probe_command(f"{name}-probe-gemm-dense.json"))
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
