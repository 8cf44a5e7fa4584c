"""The push-signalling parameters of a GPU profile from the probe's one-GPU signalling sections
(``python -m mok.bench probe --sections poll_cost,fence_cost,block_skew,signal_jitter``; see
:mod:`mok.bench.probe.signalling` and docs/sim-validation.md, "Push signalling").

What is fitted, each against the simulator's own formula:

* fence (``fence_cost``, the ``sc`` fence of the communication kernels, into the peer GPU where
  the probe has it, else local memory): ``t(n, b) = fence_us + n x min(b, W) / drain`` over the
  points of n SMs storing b bytes each; ``W`` (``fence_inflight_bytes_per_sm``) by a search over a
  geometric grid (32 points per octave) between the smallest and largest b, ``fence_us`` and
  ``1 / drain`` by least squares at each ``W`` (the least squared error wins);
* the same form on the ``release`` points (barrier, ``st.release.sys`` alone): its intercept is
  the release a flag store pays by itself, which the flag latencies of a profile (ping-pongs of
  ``st.release.sys`` / ``ld.acquire.sys``) already hold; ``fence_us_above_flag`` = the ``sc``
  intercept less it, the fixed part a profile's ``fence_us`` takes;
* polling (``poll_cost``, one warp at system scope): ``t(N) = o + a x ceil(N / L) + c x N``,
  the sweep term of :meth:`sim.core.hardware.Signalling.poll_us` (``L``: ``flag_poll_lanes``,
  ``a`` the load per lane and sweep) plus ``SimConfig.flag_poll_us_per_peer`` (``c``) and a
  once-per-wait overhead ``o`` (the vote and loop of the sweep that finds the last flag); ``L``
  over the powers of two up to the largest N with a > 0, ``o``, ``a`` and ``c`` (>= 0) by least
  squares. Without ``o`` (the form of the simulator alone) the fit on the H200 sweep picks
  ``L`` = 64 (``poll_lanes_without_overhead``): the 64-flag point costs one load more than the
  32-flag point, not one sweep more, and only a wider ``L`` lets the form pay the overhead
  once; a warp has 32 lanes;
* completion jitter (``signal_jitter``, system scope, two blocks of one GPU): the mean of one
  completion above the fastest, ``(mean - min) / 2`` of the recorded round trips (and the
  spread ``(max - min) / 2``: the measured delays are bounded, not exponential);
* ``block_skew``, where present, is reported (the start spread of a persistent grid, a lower
  bound of the per-sender jitter), not fitted.

:func:`fit_signalling` returns the values; :func:`sim.app.calibrate.with_signalling` writes
them into the ``h200`` profile (from :data:`sim.measured.SIGNALLING_FIT_PROBE`).
"""

from __future__ import annotations

import math
import statistics

import numpy as np

__all__ = ["MIN_RISE_US", "fit_fence", "fit_poll", "fit_signalling"]

_COMMAND = "python -m mok.bench probe --sections poll_cost,fence_cost,block_skew,signal_jitter"
# A drain term whose largest rise is below this is no term (the timer's resolution is coarser).
MIN_RISE_US = 0.01


def _results(probe: dict, key: str) -> dict:
    r = probe.get("results", {}).get(key)
    if not r:
        raise ValueError(f"the probe lacks results.{key} (run: {_COMMAND})")
    return r


def _lstsq(cols: list[np.ndarray], y: np.ndarray) -> tuple[np.ndarray, float]:
    a = np.stack(cols, axis=1)
    coef, *_ = np.linalg.lstsq(a, y, rcond=None)
    return coef, float(((a @ coef - y) ** 2).sum())


def fit_fence(points: dict) -> dict:
    """``points``: ``{num_sms: {bytes_per_sm: {"fence_us": ...}}}`` (one fence of fence_cost).
    Returns fence_us, fence_inflight_bytes_per_sm, drain_gbps (None and W = 0 without a drain
    term: one that adds less than MIN_RISE_US anywhere) and knee_reached (False when W is the
    largest b measured: a lower bound)."""
    rows = [
        (int(n), int(b), float(pt["fence_us"]))
        for n, pts in points.items()
        for b, pt in pts.items()
    ]
    if len(rows) < 3:
        raise ValueError(f"need >= 3 fence_cost points to fit (found {len(rows)})")
    n, b, t = (np.array(v, dtype=float) for v in zip(*rows, strict=True))
    positive = sorted({x for x in b if x > 0})
    best = None
    if positive:
        lo, hi = positive[0], positive[-1]
        steps = max(1, round(32 * math.log2(hi / lo)))
        grid = [lo * (hi / lo) ** (i / steps) for i in range(steps + 1)] if hi > lo else [lo]
        for w in grid:
            (f0, slope), sse = _lstsq([np.ones_like(t), n * np.minimum(b, w)], t)
            if slope > 0 and (best is None or sse < best[0] - 1e-15):
                best = (sse, w, f0, slope)
    if best is not None and best[3] * float((n * np.minimum(b, best[1])).max()) < MIN_RISE_US:
        best = None
    if best is None:  # no rise with the bytes: a constant fence
        return {
            "fence_us": float(t.mean()),
            "fence_inflight_bytes_per_sm": 0.0,
            "drain_gbps": None,
            "knee_reached": False,
        }
    _, w, f0, slope = best
    return {
        "fence_us": float(f0),
        "fence_inflight_bytes_per_sm": float(w),
        "drain_gbps": float(1.0 / slope / 1e3),  # bytes per us -> GB/s
        "knee_reached": bool(w < positive[-1] * (1 - 1e-9)),
    }


def fit_poll(points: dict, overhead: bool = False) -> dict:
    """``points``: ``{num_flags: ns per sweep}`` (one poll_cost mode). Returns flag_poll_lanes,
    sweep_load_us (a) and per_flag_us (c) of ``t(N) = a x ceil(N / L) + c x N``; with
    ``overhead``, of ``t(N) = o + a x ceil(N / L) + c x N`` and ``sweep_overhead_us`` (o: the
    vote and loop of the sweep that finds the last flag, paid once per wait), ``L`` only where
    a > 0 (a sweep term; none: the form without ``o``)."""
    items = sorted((int(k), float(v)) for k, v in points.items())
    if len(items) < 2:
        raise ValueError(f"need >= 2 poll_cost points to fit (found {len(items)})")
    k = np.array([x for x, _ in items], dtype=float)
    t = np.array([y for _, y in items]) / 1e3  # us
    ones = [np.ones_like(t)] if overhead else []
    best = None
    lanes = 1
    while lanes <= k.max():
        sweeps = np.ceil(k / lanes)
        cols = [*ones, sweeps] if lanes == 1 else [*ones, sweeps, k]
        coef, sse = _lstsq(cols, t)
        if lanes > 1 and coef[-1] < 0:  # no per-flag term: the sweeps alone
            coef, sse = _lstsq([*ones, sweeps], t)
        o = float(coef[0]) if overhead else 0.0
        a = float(coef[len(ones)])
        c = float(coef[len(ones) + 1]) if len(coef) > len(ones) + 1 else 0.0
        if (not overhead or (a > 1e-9 and o >= 0)) and (best is None or sse < best[0] - 1e-15):
            best = (sse, lanes, a, c, o)
        lanes *= 2
    if best is None:  # no step anywhere in the sweep: the form without the overhead
        return {**fit_poll(points), "sweep_overhead_us": 0.0}
    _, lanes, a, c, o = best
    out = {"flag_poll_lanes": lanes, "sweep_load_us": a, "per_flag_us": c}
    return {**out, "sweep_overhead_us": o} if overhead else out


def fit_signalling(probe: dict) -> dict:
    """The ``signalling`` section (:class:`sim.core.hardware.Signalling` keyword arguments),
    ``fence_us`` (the release sequence's fixed part), ``fence_us_above_flag`` (the part of it a
    flag store does not already pay: what a profile's ``fence_us`` takes, since its flag
    latencies are ping-pongs of ``st.release.sys``; None without the ``release`` points),
    ``flag_poll_us_per_peer`` (the SimConfig term) and the fit's details from a probe JSON with
    poll_cost, fence_cost and signal_jitter (block_skew optional)."""
    fence_all = _results(probe, "fence_cost")
    target = "peer" if "peer" in fence_all else "local"
    if "sc" not in fence_all.get(target, {}):
        raise ValueError(f"the probe lacks results.fence_cost.{target}.sc (run: {_COMMAND})")
    fence = fit_fence(fence_all[target]["sc"])
    release = fit_fence(fence_all[target]["release"]) if "release" in fence_all[target] else None
    poll_all = _results(probe, "poll_cost")
    if "warp" not in poll_all.get("sys", {}):
        raise ValueError(f"the probe lacks results.poll_cost.sys.warp (run: {_COMMAND})")
    poll = fit_poll(poll_all["sys"]["warp"], overhead=True)
    bare_poll = fit_poll(poll_all["sys"]["warp"])
    jitter_all = _results(probe, "signal_jitter")
    jitter = jitter_all.get("sys", {}).get("0<->0")
    if not jitter:
        raise ValueError(f"the probe lacks results.signal_jitter.sys.0<->0 (run: {_COMMAND})")
    thread = poll_all["sys"].get("thread", {})
    rt = jitter["round_trip_us"]
    fit = {
        "fence_target": target,
        "fence_drain_gbps": fence["drain_gbps"],
        "fence_knee_reached": fence["knee_reached"],
        "fence_us_empty": _empty_fence(fence_all[target]["sc"]),
        "fence_release_us": release["fence_us"] if release else None,
        "poll_sweep_load_us": poll["sweep_load_us"],
        "poll_sweep_overhead_us": poll["sweep_overhead_us"],
        "poll_lanes_without_overhead": int(bare_poll["flag_poll_lanes"]),
        "one_way_min_us": rt["min"] / 2,
        "one_way_spread_us": (rt["max"] - rt["min"]) / 2,
        "jitter_samples": jitter["samples"],
    }
    if "gpu" in jitter_all and "0<->0" in jitter_all["gpu"]:
        fit["completion_jitter_gpu_scope_us"] = float(
            jitter_all["gpu"]["0<->0"]["one_way_jitter_mean_us"]
        )
    if len(thread) >= 2:  # one thread sweeping the flags in turn: its cost per flag
        ks = sorted(int(x) for x in thread)
        slope = np.polyfit(ks, [thread[str(x)] / 1e3 for x in ks], 1)[0]
        fit["poll_thread_us_per_flag"] = float(slope)
    skew = probe["results"].get("block_skew", {})
    if "1" in skew:
        fit["start_skew_us"] = float(skew["1"]["spread_us"])
        fit["start_skew_p90_us"] = float(skew["1"]["p90_us"])
    if "2" in skew:
        fit["start_skew_2_per_sm_us"] = float(skew["2"]["spread_us"])
    notes = []
    if target == "local":
        notes.append("fence fitted on local stores (no peer GPU in the probe): drain is HBM/L2's")
    if not fence["knee_reached"]:
        notes.append("fence_inflight_bytes_per_sm: no knee within the measured bytes per SM")
    if release is None:
        notes.append(f"no fence_cost.{target}.release points: fence_us_above_flag unknown")
    return {
        "signalling": {
            "fence_inflight_bytes_per_sm": fence["fence_inflight_bytes_per_sm"],
            "flag_poll_lanes": int(poll["flag_poll_lanes"]),
            "completion_jitter_us": float(jitter["one_way_jitter_mean_us"]),
        },
        "fence_us": fence["fence_us"],
        "fence_us_above_flag": fence["fence_us"] - release["fence_us"] if release else None,
        "flag_poll_us_per_peer": poll["per_flag_us"],
        "fit": fit,
        "notes": notes,
    }


def _empty_fence(points: dict) -> float | None:
    """Median fence_us of the points that stored nothing (None if there are none)."""
    zero = [float(pts["0"]["fence_us"]) for pts in points.values() if "0" in pts]
    return statistics.median(zero) if zero else None
