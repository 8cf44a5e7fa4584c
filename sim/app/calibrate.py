"""Fit a GPU profile from a probe JSON (the format of ``h200x2-probe-2026-11-29.json`` in
``mok/bench/results``).

What is fitted:

* each comm curve (``push_st``, ``pull_ld``, ``local_st`` from the 16-byte copy kernel,
  ``push_tma``, ``pull_tma``, ``local_tma`` from the 16 KiB TMA ring) as a per-SM rate from the
  points below saturation (least squares through the origin) and a log-linear ceiling from the
  saturated points (least squares), see :class:`sim.core.hardware.CommCurve`;
* the usable NVLink wire rate per direction from the *bidirectional* runs: with both directions
  busy each direction carries the payload of one GPU plus the protocol overhead of the other's
  traffic, so ``wire = per_direction_gbps * (data + reverse bytes per payload byte)``; the median
  over all saturated (>= 16 SM) points of both mechanisms;
* latencies (flags, remote and local loads), the bf16 GEMM rate and the HBM copy rate are taken
  as measured;
* where the probe holds grouped-GEMM timings (``grouped_gemm_by_rows``, and the
  ``grouped_gemm_by_sms`` sweeps whose SM limit took effect; written by ``python -m mok.bench
  probe``), ``gemm_efficiency`` is fitted: the median over points with at least
  ``GEMM_FIT_MIN_ROWS`` rows per expert of (time :func:`sim.core.gemm.gemm_us` predicts at
  efficiency 1) / (measured time). Otherwise it stays the stated guess. A probe's ``meta.num_sms`` /
  ``meta.l2_mb`` replace the H200 defaults.

The protocol bytes per payload byte come from the one-tile NVLink counter measurement recorded in
docs/design.md (131,072-byte tile; push 155.6 KB data + 2.9 KB back, pull 147.5 KB data + 24.6 KB of
requests); a probe may override them with a ``results.protocol_bytes`` block of the same shape.

The push-signalling terms (``fence_us`` and the ``signalling`` section) are not fitted from the
comm probe either: :func:`fit_h200_profile` adds them with :func:`with_signalling` from the fit of
:func:`sim.app.signalling_fit.fit_signalling` on :data:`sim.measured.SIGNALLING_FIT_PROBE` (the
one-H200 signalling sections); each term's reading is in the profile's ``assumptions`` and in
docs/sim-validation.md, "Push signalling". The ``incast`` section stays the stated assumption.

The ``gemm_waves`` section (:mod:`sim.core.gemm_waves`) is not fitted from the comm probe:
:func:`with_fitted_gemm_waves` adds the fit of :func:`sim.app.gemm_fit.fit` on the probes of the
profile's GPU in :data:`sim.measured.GEMM_WAVES_FIT_PROBES`, to the committed ``h200`` profile
(:func:`fit_h200_profile`) and to the derived ``h100`` one (the one-H100 dense sweep);
:func:`fit_gpu_profile` writes the section only when given one (``gemm_waves=``).

Derived (non-measured) profiles for H100, B200, GB200 and GB300 are built from the fitted H200
profile by :func:`derive_profiles`; each scaling step is recorded in the profile's
``assumptions``. The H100's GEMM waves are its own fit; the others carry the H200's.
``python -m sim.app.calibrate`` regenerates every committed profile.
"""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path

import numpy as np

from sim.app.gemm_fit import fit as fit_gemm_waves
from sim.app.gemm_fit import fit_probes
from sim.app.signalling_fit import fit_signalling
from sim.core.gemm import gemm_us
from sim.core.hardware import (
    CommCurve,
    GemmWaves,
    GpuProfile,
    Protocol,
    Signalling,
    profiles_dir,
)
from sim.measured import SIGNALLING_FIT_PROBE, measured_path

__all__ = [
    "fit_comm_curve",
    "fit_gpu_profile",
    "fit_h200_profile",
    "with_signalling",
    "with_gemm_waves",
    "with_fitted_gemm_waves",
    "predict_one_direction_gbps",
    "predict_bidirectional_gbps",
    "calibration_points",
    "grouped_gemm_points",
    "fit_gemm_efficiency",
    "derive_profiles",
    "PROTOCOL_TILE_BYTES",
]

# the two-GPU probe the committed h200 profile is fitted from (fit_h200_profile)
H200_PROBE = "h200x2-probe-2026-11-29.json"

# docs/design.md, NVLink counters while moving one 256 x 256 bf16 tile (KB = 1000 bytes).
PROTOCOL_TILE_BYTES = {
    "payload": 131_072,
    "push": {"data": 155_600, "reverse": 2_900},
    "pull": {"data": 147_500, "reverse": 24_600},
}

# Inputs a probe does not measure, for an H200 SXM (datasheet or stated guess).
H200_DEFAULTS = {
    "num_sms": 132,
    "l2_mb": 60.0,
    "hbm_gbps": 4800.0,  # datasheet HBM3e
    "nvlink_gbps_per_direction": 450.0,  # NVLink4, 18 links x 25 GB/s per direction
    "gemm_efficiency": 0.9,  # grouped-GEMM tiles vs a large dense torch GEMM (guess)
    "gemm_n_tile": 256,  # 128 x 256 wgmma tile per SM (DeepGEMM-style)
    "fence_us": 0.5,  # membar.sys before a remote flag (not probed; guess)
    "mxfp8_over_bf16": 1.8,  # Hopper fp8 tensor rate 2x bf16, minus block-scale epilogue cost
}

# (curve name, probe key path, mechanism kind)
_CURVE_SOURCES = {
    "push_st": ("p2p_bandwidth_by_sms", "push"),
    "pull_ld": ("p2p_bandwidth_by_sms", "pull"),
    "local_st": ("p2p_bandwidth_by_sms", "local"),
    "push_tma": ("tma_bulk_by_sms", "push_onedir_chunk16384"),
    "pull_tma": ("tma_bulk_by_sms", "pull_onedir_chunk16384"),
    "local_tma": ("tma_bulk_by_sms", "local_onedir_chunk16384"),
}

# Grouped-GEMM points with fewer rows per expert are dominated by per-expert overheads the
# tile-wave model leaves out; they inform the simulator's users, not the fitted efficiency.
GEMM_FIT_MIN_ROWS = 512

# Results a probe must hold for the comm fit (a one-GPU probe lacks the peer parts).
_REQUIRED = (
    ("p2p_bandwidth_by_sms", "push"),
    ("p2p_bandwidth_by_sms", "pull"),
    ("p2p_bandwidth_by_sms", "local"),
    ("p2p_bidirectional_by_sms", "push"),
    ("p2p_bidirectional_by_sms", "pull"),
    *(
        ("tma_bulk_by_sms", f"{k}_{d}_chunk16384")
        for k in ("push", "pull")
        for d in ("onedir", "bidir")
    ),
    ("tma_bulk_by_sms", "local_onedir_chunk16384"),
    ("signal_latency", "0<->0"),
    ("signal_latency", "0<->1"),
    ("remote_load_latency",),
    ("bf16_gemm_and_copy", "bf16_tflops"),
    ("bf16_gemm_and_copy", "d2d_copy_GBps_rw"),
)

# A point belongs to the linear (per-SM-bound) part while its per-SM rate is at least this
# fraction of the 1-SM rate; below it the curve has saturated.
_LINEAR_FRACTION = 0.93


def _points(d: dict) -> tuple[np.ndarray, np.ndarray]:
    items = sorted((float(k), float(v)) for k, v in d.items())
    return np.array([a for a, _ in items]), np.array([b for _, b in items])


def fit_comm_curve(points: dict, ceiling_if_unsaturated_gbps: float | None = None) -> CommCurve:
    """Fit ``min(per_sm * n, ceiling(n))`` to ``{num_sms: GB/s}``.

    If no point is saturated, the ceiling is ``ceiling_if_unsaturated_gbps`` (or the largest
    measured rate when not given).
    """
    n, bw = _points(points)
    if n.size < 2:
        raise ValueError(f"need >= 2 points to fit a comm curve (found {n.size})")
    rate1 = bw[0] / n[0]
    linear = bw / n >= _LINEAR_FRACTION * rate1
    # the linear part is a prefix: stop at the first saturated point
    first_sat = int(np.argmin(linear)) if not linear.all() else n.size
    lin_n, lin_bw = n[:first_sat], bw[:first_sat]
    per_sm = float((lin_n * lin_bw).sum() / (lin_n * lin_n).sum())
    sat_n, sat_bw = n[first_sat:], bw[first_sat:]
    if sat_n.size == 0:
        ceil = ceiling_if_unsaturated_gbps or float(bw.max())
        return CommCurve(per_sm, float(n[-1]), ceil, float(n[-1]), ceil)
    knee, top = float(sat_n[0]), float(sat_n[-1])
    if sat_n.size == 1 or top == knee:
        c = float(sat_bw.mean())
        return CommCurve(per_sm, knee, c, max(top, knee), c)
    x = np.log(sat_n / knee) / math.log(top / knee)
    a = np.stack([1 - x, x], axis=1)
    (c_knee, c_top), *_ = np.linalg.lstsq(a, sat_bw, rcond=None)
    return CommCurve(per_sm, knee, float(c_knee), top, float(c_top))


def _protocols(probe: dict) -> dict[str, Protocol]:
    tile = probe.get("results", {}).get("protocol_bytes", PROTOCOL_TILE_BYTES)
    pay = float(tile["payload"])
    return {k: Protocol(tile[k]["data"] / pay, tile[k]["reverse"] / pay) for k in ("push", "pull")}


def predict_one_direction_gbps(prof: GpuProfile, kind: str, mech: str, num_sms: float) -> float:
    """Payload GB/s of one GPU copying to/from its peer over the direct NV18 link."""
    p = prof.protocol[kind]
    wire = prof.nvlink_wire_gbps / p.data_bytes_per_byte
    return min(prof.curve(f"{kind}_{mech}").gbps(num_sms), wire)


def predict_bidirectional_gbps(prof: GpuProfile, kind: str, mech: str, num_sms: float) -> float:
    """Per-direction payload GB/s with both GPUs copying towards (push) / from (pull) each other."""
    p = prof.protocol[kind]
    wire = prof.nvlink_wire_gbps / (p.data_bytes_per_byte + p.reverse_bytes_per_byte)
    return min(prof.curve(f"{kind}_{mech}").gbps(num_sms), wire)


def calibration_points(probe: dict) -> list[tuple[str, str, str, float, float]]:
    """(family, kind, mechanism, num_sms, measured GB/s) of every point the model must reproduce.

    Leaves out the latency-bound 2 KiB TMA runs (they set no curve the simulator uses).
    """
    r = probe["results"]
    out = []
    for kind in ("push", "pull"):
        mech = "st" if kind == "push" else "ld"
        for n, v in r["p2p_bandwidth_by_sms"][kind].items():
            out.append(("one_direction", kind, mech, float(n), float(v)))
        for n, v in r["p2p_bidirectional_by_sms"][kind].items():
            out.append(("bidirectional", kind, mech, float(n), float(v["per_direction_GBps"])))
        for n, v in r["tma_bulk_by_sms"][f"{kind}_onedir_chunk16384"].items():
            out.append(("one_direction", kind, "tma", float(n), float(v)))
        for n, v in r["tma_bulk_by_sms"][f"{kind}_bidir_chunk16384"].items():
            out.append(("bidirectional", kind, "tma", float(n), float(v)))
    return out


def _check_probe(probe: dict) -> None:
    r = probe.get("results", {})
    missing = []
    for path in _REQUIRED:
        d = r
        for key in path:
            d = d.get(key) if isinstance(d, dict) else None
        if not d:
            missing.append(".".join(path))
    lat = r.get("remote_load_latency", {})
    for who in ("reader0_mem0", "reader1_mem0"):
        if not any(k.startswith(who) for k in lat):
            missing.append(f"remote_load_latency.{who}_*")
    if missing:
        why = "; ".join(f"{k}: {v}" for k, v in probe.get("skipped", {}).items())
        raise ValueError(
            f"the probe lacks {', '.join(missing)} (the comm fit needs a two-GPU probe: torchrun "
            "--nproc-per-node=2 -m mok.bench probe)" + (f"; the probe skipped {why}" if why else "")
        )


def grouped_gemm_points(probe: dict) -> list[tuple[int, int, int, int, int, float]]:
    """(num_experts, rows_per_expert, n, k, compute_sms, measured us) of every grouped-GEMM point
    of the probe: the all-SM rows sweeps, and the SM sweeps whose SM limit took effect."""
    r = probe.get("results", {})
    out = []

    def ops(entry):
        h, i = int(entry["hidden"]), int(entry["intermediate"])
        return (("gate_up", 2 * i, h), ("down", h, i))

    for entry in r.get("grouped_gemm_by_rows", {}).values():
        for op, n, k in ops(entry):
            for rows, pt in entry.get(op, {}).items():
                out.append(
                    (int(entry["num_experts"]), int(rows), n, k, int(entry["num_sms"]), pt["us"])
                )
    for entry in r.get("grouped_gemm_by_sms", {}).values():
        if not entry.get("sm_limit_effective", False):
            continue
        rows = int(entry["rows_per_expert"])
        for op, n, k in ops(entry):
            for sms, pt in entry.get(op, {}).items():
                out.append((int(entry["num_experts"]), rows, n, k, int(sms), pt["us"]))
    return [(e, m, n, k, sms, float(us)) for e, m, n, k, sms, us in out]


def fit_gemm_efficiency(prof: GpuProfile, probe: dict) -> dict | None:
    """Median (model time at efficiency 1) / (measured time) over the grouped-GEMM points with
    >= GEMM_FIT_MIN_ROWS rows per expert, capped at 1; None when the probe has none."""
    unit = GpuProfile(**{**prof.__dict__, "gemm_efficiency": 1.0})
    ratios = [
        gemm_us(unit, e * math.ceil(m / 128), n, k, sms) / us
        for e, m, n, k, sms, us in grouped_gemm_points(probe)
        if m >= GEMM_FIT_MIN_ROWS and us > 0
    ]
    if not ratios:
        return None
    return {
        "gemm_efficiency": min(1.0, float(statistics.median(ratios))),
        "gemm_efficiency_points": len(ratios),
        "gemm_efficiency_min": float(min(ratios)),
        "gemm_efficiency_max": float(max(ratios)),
    }


def fit_gpu_profile(
    probe: dict,
    name: str = "h200",
    probe_file: str | None = None,
    gemm_waves: GemmWaves | None = None,
    **overrides,
) -> GpuProfile:
    """Fit a :class:`GpuProfile` from a probe dict; ``overrides`` replace :data:`H200_DEFAULTS`
    (and what the probe's ``meta`` or grouped-GEMM timings give). ``probe_file``: the name of
    the probe JSON, written into the profile's ``source``. ``gemm_waves``: the profile's GEMM
    waves section (none without)."""
    _check_probe(probe)
    meta = probe.get("meta", {})
    cfg = dict(H200_DEFAULTS)
    cfg.update({k: meta[k] for k in ("num_sms", "l2_mb") if meta.get(k)})
    cfg.update(overrides)
    r = probe["results"]
    protocol = _protocols(probe)
    hbm_copy = float(r["bf16_gemm_and_copy"]["d2d_copy_GBps_rw"]) / 2.0
    curves: dict[str, CommCurve] = {}
    for cname, (group, key) in _CURVE_SOURCES.items():
        cap = hbm_copy if cname.startswith("local") else None
        curves[cname] = fit_comm_curve(r[group][key], ceiling_if_unsaturated_gbps=cap)
    # a local TMA curve measured only up to 32 SMs saturates where the 16-byte copy does
    if curves["local_tma"].ceiling_knee_gbps == hbm_copy and "local_st" in curves:
        st = curves["local_st"]
        curves["local_tma"] = CommCurve(
            curves["local_tma"].per_sm_gbps,
            st.sm_knee,
            st.ceiling_knee_gbps,
            st.sm_max,
            st.ceiling_max_gbps,
        )
    # usable wire rate from both-directions-busy plateaus
    wires = []
    bidir = [("st", r["p2p_bidirectional_by_sms"])]
    tma = r["tma_bulk_by_sms"]
    for kind in ("push", "pull"):
        p = protocol[kind]
        per_byte = p.data_bytes_per_byte + p.reverse_bytes_per_byte
        for n, v in bidir[0][1][kind].items():
            if float(n) >= 16:
                wires.append(float(v["per_direction_GBps"]) * per_byte)
        for n, v in tma[f"{kind}_bidir_chunk16384"].items():
            if float(n) >= 16:
                wires.append(float(v) * per_byte)
    wire_gbps = statistics.median(wires)
    sig = r["signal_latency"]
    lat = r["remote_load_latency"]
    remote_ns = [v for k, v in lat.items() if k.startswith("reader1_mem0")]
    local_ns = [v for k, v in lat.items() if k.startswith("reader0_mem0")]
    bf16 = float(r["bf16_gemm_and_copy"]["bf16_tflops"])
    prof = GpuProfile(
        name=name,
        num_sms=int(cfg["num_sms"]),
        l2_mb=float(cfg["l2_mb"]),
        hbm_gbps=float(cfg["hbm_gbps"]),
        hbm_copy_gbps=hbm_copy,
        tensor_tflops={"bf16": bf16, "mxfp8": bf16 * cfg["mxfp8_over_bf16"]},
        gemm_efficiency=float(cfg["gemm_efficiency"]),
        gemm_n_tile=int(cfg["gemm_n_tile"]),
        flag_latency_remote_us=float(sig["0<->1"]["one_way_us"]),
        flag_latency_local_us=float(sig["0<->0"]["one_way_us"]),
        remote_load_latency_us=float(np.mean(remote_ns)) / 1000.0,
        local_load_latency_us=float(np.mean(local_ns)) / 1000.0,
        nvlink_gbps_per_direction=float(cfg["nvlink_gbps_per_direction"]),
        nvlink_wire_efficiency=min(1.0, wire_gbps / float(cfg["nvlink_gbps_per_direction"])),
        protocol=protocol,
        comm_curves=curves,
        fence_us=float(cfg["fence_us"]),
        source=f"fitted by sim.app.calibrate from{' ' + probe_file if probe_file else ''}: "
        + probe.get("what", "a probe JSON")[:200],
        assumptions=(
            f"gemm_efficiency={cfg['gemm_efficiency']}: grouped-GEMM tiles reach this fraction "
            "of the measured 8192^3 torch bf16 rate (not probed)",
            f"mxfp8 rate = {cfg['mxfp8_over_bf16']} x bf16 (Hopper fp8 is 2x bf16; block-scale "
            "handling costs the rest; not probed)",
            f"fence_us={cfg['fence_us']}: membar.sys before a remote flag (not probed)",
            "protocol bytes per payload byte from the one-tile NVLink counter measurement "
            "(docs/design.md); assumed equal for 16-byte and TMA copies",
            "hbm_copy_gbps = measured d2d copy (read+write counted) / 2",
            f"hbm_gbps={cfg['hbm_gbps']}, nvlink_gbps_per_direction="
            f"{cfg['nvlink_gbps_per_direction']} are datasheet values",
        ),
        fit={},
    )
    gemm_fit = None if "gemm_efficiency" in overrides else fit_gemm_efficiency(prof, probe)
    if gemm_fit:
        eff = gemm_fit["gemm_efficiency"]
        note = (
            f"gemm_efficiency={eff:.3f}: fitted, median of {gemm_fit['gemm_efficiency_points']} "
            f"grouped-GEMM points (>= {GEMM_FIT_MIN_ROWS} rows per expert; range "
            f"{gemm_fit['gemm_efficiency_min']:.3f}-{gemm_fit['gemm_efficiency_max']:.3f}) of "
            "(sim.core.gemm tile-wave time at efficiency 1) / (measured torch._grouped_mm time)"
        )
        prof = GpuProfile(
            **{
                **prof.__dict__,
                "gemm_efficiency": eff,
                "assumptions": (note, *prof.assumptions[1:]),
            }
        )
    resid = []
    for fam, kind, mech, n, meas in calibration_points(probe):
        f = predict_one_direction_gbps if fam == "one_direction" else predict_bidirectional_gbps
        pred = f(prof, kind, mech, n)
        resid.append(abs(pred - meas) / meas)
    fit = {
        "wire_gbps_per_direction": wire_gbps,
        "num_points": len(resid),
        "max_rel_error": float(max(resid)),
        "mean_rel_error": float(np.mean(resid)),
        **(gemm_fit or {}),
    }
    prof = GpuProfile(**{**prof.__dict__, "fit": fit})
    return with_gemm_waves(prof, gemm_waves) if gemm_waves else prof


def with_gemm_waves(prof: GpuProfile, gw: GemmWaves) -> GpuProfile:
    """``prof`` with the GEMM waves section ``gw`` and its assumption line."""
    note = (
        f"gemm_waves: fitted by {gw.source}; the megakernel pays fill_us - launch_us per GEMM "
        "(docs/sim-validation.md, 'Layer model: GEMM waves')"
    )
    return GpuProfile(
        **{**prof.__dict__, "gemm_waves": gw, "assumptions": (*prof.assumptions, note)}
    )


def with_fitted_gemm_waves(prof: GpuProfile) -> GpuProfile:
    """``prof`` with the GEMM waves fitted for its GPU (:func:`sim.app.gemm_fit.fit` on the
    probes of :func:`sim.app.gemm_fit.fit_probes` of ``prof.name``, at ``prof``'s tensor rate and
    HBM bandwidth; :func:`with_gemm_waves`). ValueError for a GPU without fit probes."""
    fit_probes(prof.name)
    return with_gemm_waves(prof, fit_gemm_waves(prof))


def with_signalling(prof: GpuProfile, sig: dict, probe_file: str) -> GpuProfile:
    """``prof`` with the push-signalling terms of ``sig`` (:func:`fit_signalling` of the probe
    ``probe_file``) and their assumption lines, which replace the stated ``fence_us`` line:

    * ``fence_us``: ``fence_us_above_flag``, the kernels' release sequence (every thread
      ``fence.sc.sys``, a barrier, thread 0's fence and ``st.release.sys``) less the
      ``st.release.sys`` alone, which the flag latencies already hold;
    * ``fence_inflight_bytes_per_sm``: fitted only from stores into a peer; from local stores
      (the drain is HBM/L2's, not NVLink's) the profile keeps its value;
    * ``flag_poll_lanes``: the fit with a once-per-wait overhead (:func:`fit_poll`);
    * ``completion_jitter_us``: the measured one-GPU mean, system scope.
    """
    f = sig["fit"]
    above = sig.get("fence_us_above_flag")
    if above is None:
        raise ValueError(
            f"{probe_file}: no fence_cost release points, so no fence_us above the flag's own "
            "release (run the probe's fence_cost section)"
        )
    peer = f["fence_target"] == "peer"
    old = prof.signalling
    window = (
        sig["signalling"]["fence_inflight_bytes_per_sm"]
        if peer
        else (old.fence_inflight_bytes_per_sm)
    )
    new = Signalling(
        fence_inflight_bytes_per_sm=float(window),
        flag_poll_lanes=int(sig["signalling"]["flag_poll_lanes"]),
        completion_jitter_us=float(sig["signalling"]["completion_jitter_us"]),
    )
    drain = f["fence_drain_gbps"]
    lines = (
        f"fence_us={above:.3f}: measured on one H200 ({probe_file}, fence_cost.{f['fence_target']}"
        f"): the comm kernels' release sequence after stores (every thread fence.sc.sys, "
        f"barrier, thread 0 fence.sc.sys + st.release.sys; intercept {sig['fence_us']:.3f} us) "
        f"less st.release.sys alone ({f['fence_release_us']:.3f} us), which the flag latencies "
        "(ping-pongs of st.release.sys / ld.acquire.sys) already hold",
        (
            f"fence_inflight_bytes_per_sm={window:g}: fitted on stores into the peer "
            f"(drain {drain:.0f} GB/s)"
            if peer
            else f"fence_inflight_bytes_per_sm={window:g} (1024 threads x 16 B per comm SM) and "
            "the NVLink drain (wire rate / push data bytes) assumed: the probe stored into local "
            f"memory only (window {sig['signalling']['fence_inflight_bytes_per_sm']:.0f} B per "
            f"SM at {drain:.0f} GB/s, HBM/L2's drain, not NVLink's)"
        ),
        f"flag_poll_lanes={new.flag_poll_lanes}: one warp, one flag per lane, measured sweep "
        f"{f['poll_sweep_overhead_us']:.3f} us + {f['poll_sweep_load_us']:.3f} us x "
        f"ceil(N / {new.flag_poll_lanes}) ({probe_file}, poll_cost.sys.warp); the model charges "
        "local_load_latency_us per lane load and no per-wait overhead",
        f"completion_jitter_us={new.completion_jitter_us:g}: one-way (mean - min) / 2 of "
        f"{f['jitter_samples']} flag round trips between two blocks of one H200 at system "
        f"scope ({probe_file}, signal_jitter); a lower bound for completions across GPUs; "
        "the measured delays are bounded (spread "
        f"{f['one_way_spread_us']:.3f} us one way), the model draws them exponential",
        f"incast efficiency_min={prof.incast.efficiency_min:g}, writers_half="
        f"{prof.incast.writers_half:g}: assumed (no measurement of many writers into one port)",
    )
    kept = tuple(a for a in prof.assumptions if not a.startswith("fence_us="))
    at = next((i for i, a in enumerate(prof.assumptions) if a.startswith("fence_us=")), len(kept))
    fit = {
        **prof.fit,
        "signalling": {
            "probe": probe_file,
            "fence_sequence_us": sig["fence_us"],
            **{k: v for k, v in f.items() if k != "jitter_samples"},
            "fence_inflight_bytes_per_sm_fitted": sig["signalling"]["fence_inflight_bytes_per_sm"],
            "flag_poll_us_per_peer": sig["flag_poll_us_per_peer"],
        },
    }
    return GpuProfile(
        **{
            **prof.__dict__,
            "fence_us": float(above),
            "signalling": new,
            "assumptions": kept[:at] + lines + kept[at:],
            "fit": fit,
        }
    )


def fit_h200_profile(probe_path: Path | None = None) -> GpuProfile:
    """The committed ``h200`` profile: the comm fit of the two-GPU probe (default
    :data:`H200_PROBE`), the push-signalling terms fitted on
    :data:`sim.measured.SIGNALLING_FIT_PROBE` (:func:`with_signalling`) and the GEMM waves fit on
    :data:`sim.measured.GEMM_WAVES_FIT_PROBES` (:func:`with_fitted_gemm_waves`)."""
    path = Path(probe_path) if probe_path else measured_path(H200_PROBE)
    h200 = fit_gpu_profile(json.loads(path.read_text()), "h200", path.name)
    sig_path = measured_path(SIGNALLING_FIT_PROBE)
    sig = fit_signalling(json.loads(sig_path.read_text()))
    h200 = with_signalling(h200, sig, sig_path.name)
    return with_fitted_gemm_waves(h200)


def derive_profiles(h200: GpuProfile) -> dict[str, GpuProfile]:
    """Datasheet-led profiles scaled from the fitted H200 profile (every step in assumptions);
    the H100's GEMM waves fitted on its own probe (:func:`with_fitted_gemm_waves`), the others'
    the H200's."""
    base = h200.__dict__
    sig, inc = h200.signalling, h200.incast
    common = (
        "derived from the fitted h200 profile; flag and load latencies, protocol overhead per "
        "payload byte and the NVLink wire efficiency are assumed equal to the H200 measurement",
    )
    # (after each profile's own lines)
    measured = any(a.startswith("completion_jitter_us=") for a in h200.assumptions)
    where = (
        f"measured on one H200 ({h200.fit.get('signalling', {}).get('probe', 'the probe')}) and "
        "assumed equal on this GPU"
        if measured
        else "the H200 values, none of them probed"
    )
    tail = (
        f"signalling and incast: {where} (docs/sim-validation.md, 'Push signalling' and "
        f"'Incast'): fence_us {h200.fence_us:.3f} us"
        + (" above the flag's own release" if measured else "")
        + f", {sig.flag_poll_lanes} flags per polling sweep, exponential per-sender completion "
        f"jitter of mean {sig.completion_jitter_us:g} us; assumed on every GPU: "
        f"{sig.fence_inflight_bytes_per_sm / 1024:g} KiB of stores in flight per comm SM at a "
        "fence, drained at this GPU's NVLink rate, incast efficiency "
        f"{inc.efficiency_min:g} for many writers (half-way at {1 + inc.writers_half:g}); none of "
        "them probed on this GPU",
    )
    carried = ()  # the GEMM waves line of a profile that keeps the H200's
    if (gw := h200.gemm_waves) is not None:
        carried = (
            f"gemm_waves: the H200 fit, rates as the same fractions of this GPU's tensor_tflops "
            f"(tile_efficiency {gw.tile_efficiency:g} per SM, sustained_efficiency "
            f"{gw.sustained_efficiency:g} for the chip), weight streaming x hbm_gbps / "
            f"{gw.reference_hbm_gbps:g}, per-tile, fill, host and launch costs as measured on "
            "H200; not probed on this GPU",
        )
    bf16 = h200.tensor_tflops["bf16"]
    eff = bf16 / 989.0  # measured fraction of the H100/H200 dense bf16 datasheet peak
    out = {}
    h100 = GpuProfile(
        **{
            **base,
            "name": "h100",
            "l2_mb": 50.0,
            "hbm_gbps": 3350.0,
            "hbm_copy_gbps": h200.hbm_copy_gbps * 3350.0 / 4800.0,
            "comm_curves": dict(h200.comm_curves),
            "gemm_waves": None,
            "source": "datasheet lead (H100 SXM) + h200 fit + gemm_waves fitted on "
            + ", ".join(fit_probes("h100")),
            "assumptions": common
            + (
                "same SMs, tensor cores and NVLink4 as H200: comm curves and GEMM rate "
                "(tensor_tflops, gemm_efficiency) copied; the gemm_waves rates are fractions of "
                "that tensor_tflops fitted on this GPU",
                "HBM3 3.35 TB/s: copy rate scaled by 3350/4800",
            )
            + tail,
            "fit": {},
        }
    )
    out["h100"] = with_fitted_gemm_waves(h100)

    def blackwell(name: str, sms: int, bf16_peak: float, fp8_peak: float, l2: float, note: str):
        # NVLink5 doubles the per-direction rate; the per-SM rate is set by bytes in flight /
        # latency, assumed unchanged, so only the ceilings scale.
        curves = {
            k: (c if k.startswith("local") else c.scaled(ceiling=2.0))
            for k, c in h200.comm_curves.items()
        }
        curves = {
            k: CommCurve(c.per_sm_gbps, c.sm_knee, c.ceiling_knee_gbps, sms, c.ceiling_max_gbps)
            if c.sm_max < sms
            else c
            for k, c in curves.items()
        }
        local_scale = 8000.0 / 4800.0
        for k in ("local_st", "local_tma"):
            curves[k] = curves[k].scaled(ceiling=local_scale)
        return GpuProfile(
            **{
                **base,
                "name": name,
                "num_sms": sms,
                "l2_mb": l2,
                "hbm_gbps": 8000.0,
                "hbm_copy_gbps": h200.hbm_copy_gbps * local_scale,
                "tensor_tflops": {"bf16": bf16_peak * eff, "mxfp8": fp8_peak * eff},
                "nvlink_gbps_per_direction": 900.0,
                "comm_curves": curves,
                "source": f"datasheet lead ({note}) + h200 fit",
                "assumptions": common
                + (
                    f"{sms} SMs, {l2:g} MB L2 (datasheet lead, not measured)",
                    f"dense bf16 {bf16_peak:g} / fp8 {fp8_peak:g} TFLOP/s datasheet, achieved "
                    f"fraction {eff:.3f} as measured on H200",
                    "NVLink5 900 GB/s per direction: remote comm-curve ceilings x2, per-SM "
                    "rates unchanged (bytes in flight / latency)",
                    "HBM3e 8 TB/s: local copy ceilings and copy rate x 8000/4800",
                )
                + tail
                + carried,
                "fit": {},
            }
        )

    out["b200"] = blackwell("b200", 148, 2250.0, 4500.0, 126.0, "HGX B200, 1000 W")
    out["gb200"] = blackwell("gb200", 148, 2500.0, 5000.0, 126.0, "GB200 NVL72 per GPU")
    out["gb300"] = blackwell("gb300", 160, 2500.0, 5000.0, 126.0, "GB300 NVL72 per GPU")
    return out


def regenerate(probe_path: Path, out_dir: Path) -> list[Path]:
    """Fit ``h200`` from the probe JSON (:func:`fit_h200_profile`) and derive the other presets
    (:func:`derive_profiles`: the h100 with its own GEMM waves fit); write them to ``out_dir``."""
    h200 = fit_h200_profile(probe_path)
    written = []
    for prof in (h200, *derive_profiles(h200).values()):
        p = out_dir / f"{prof.name}.json"
        prof.save(p)
        written.append(p)
    return written


if __name__ == "__main__":  # pragma: no cover - maintenance entry point
    for p in regenerate(measured_path(H200_PROBE), profiles_dir()):
        print(f"wrote {p}")
