"""The push-signalling parameters of a GPU profile from the probe's one-GPU signalling sections
(``python -m mok.bench probe --sections poll_cost,fence_cost,block_skew,signal_jitter``; see
:mod:`mok.bench.probe.signalling` and docs/sim-validation.md, "Push signalling").

What is fitted, each against the simulator's own formula:

* fence (``fence_cost``, the ``sc`` fence of the communication kernels, into the peer GPU where
  the probe has it, else local memory): ``t(n, b) = fence_us + n x min(b, W) / drain`` over the
  points of n SMs storing b bytes each; ``W`` (``fence_inflight_bytes_per_sm``) by a search over a
  geometric grid (32 points per octave) between the smallest and largest b, ``fence_us`` and
  ``1 / drain`` by least squares at each ``W`` (the least squared error wins);
* polling (``poll_cost``, one warp at system scope): ``t(N) = a x ceil(N / L) + c x N``, the
  sweep term of :meth:`sim.core.hardware.Signalling.poll_us` (``L``: ``flag_poll_lanes``, ``a``
  the load per sweep) plus ``SimConfig.flag_poll_us_per_peer`` (``c``); ``L`` over the powers of
  two up to the largest N, ``a`` and ``c`` by least squares;
* completion jitter (``signal_jitter``, system scope, two blocks of one GPU): the mean of one
  completion above the fastest, ``(mean - min) / 2`` of the recorded round trips;
* ``block_skew``, where present, is reported (the start spread of a persistent grid, a lower
  bound of the per-sender jitter), not fitted.

:func:`fit_signalling` returns the values; it changes no committed profile.
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


def fit_poll(points: dict) -> dict:
    """``points``: ``{num_flags: ns per sweep}`` (one poll_cost mode). Returns flag_poll_lanes,
    sweep_load_us (a) and per_flag_us (c) of ``t(N) = a x ceil(N / L) + c x N``."""
    items = sorted((int(k), float(v)) for k, v in points.items())
    if len(items) < 2:
        raise ValueError(f"need >= 2 poll_cost points to fit (found {len(items)})")
    k = np.array([x for x, _ in items], dtype=float)
    t = np.array([y for _, y in items]) / 1e3  # us
    best = None
    lanes = 1
    while lanes <= k.max():
        sweeps = np.ceil(k / lanes)
        cols = [sweeps] if lanes == 1 else [sweeps, k]
        coef, sse = _lstsq(cols, t)
        a = float(coef[0])
        c = float(coef[1]) if lanes > 1 else 0.0
        if c < 0:  # no per-flag term: the sweeps alone
            (a,), sse = _lstsq([sweeps], t)
            c = 0.0
        if best is None or sse < best[0] - 1e-15:
            best = (sse, lanes, float(a), c)
        lanes *= 2
    _, lanes, a, c = best
    return {"flag_poll_lanes": lanes, "sweep_load_us": a, "per_flag_us": c}


def fit_signalling(probe: dict) -> dict:
    """The ``signalling`` section (:class:`sim.core.hardware.Signalling` keyword arguments),
    ``fence_us``, ``flag_poll_us_per_peer`` (the SimConfig term) and the fit's details from a
    probe JSON with poll_cost, fence_cost and signal_jitter (block_skew optional)."""
    fence_all = _results(probe, "fence_cost")
    target = "peer" if "peer" in fence_all else "local"
    if "sc" not in fence_all.get(target, {}):
        raise ValueError(f"the probe lacks results.fence_cost.{target}.sc (run: {_COMMAND})")
    fence = fit_fence(fence_all[target]["sc"])
    poll_all = _results(probe, "poll_cost")
    if "warp" not in poll_all.get("sys", {}):
        raise ValueError(f"the probe lacks results.poll_cost.sys.warp (run: {_COMMAND})")
    poll = fit_poll(poll_all["sys"]["warp"])
    jitter_all = _results(probe, "signal_jitter")
    jitter = jitter_all.get("sys", {}).get("0<->0")
    if not jitter:
        raise ValueError(f"the probe lacks results.signal_jitter.sys.0<->0 (run: {_COMMAND})")
    thread = poll_all["sys"].get("thread", {})
    fit = {
        "fence_target": target,
        "fence_drain_gbps": fence["drain_gbps"],
        "fence_knee_reached": fence["knee_reached"],
        "fence_us_empty": _empty_fence(fence_all[target]["sc"]),
        "poll_sweep_load_us": poll["sweep_load_us"],
        "one_way_min_us": jitter["round_trip_us"]["min"] / 2,
        "jitter_samples": jitter["samples"],
    }
    if len(thread) >= 2:  # one thread sweeping the flags in turn: its cost per flag
        ks = sorted(int(x) for x in thread)
        slope = np.polyfit(ks, [thread[str(x)] / 1e3 for x in ks], 1)[0]
        fit["poll_thread_us_per_flag"] = float(slope)
    skew = probe["results"].get("block_skew", {})
    if "1" in skew:
        fit["start_skew_us"] = float(skew["1"]["spread_us"])
        fit["start_skew_p90_us"] = float(skew["1"]["p90_us"])
    notes = []
    if target == "local":
        notes.append("fence fitted on local stores (no peer GPU in the probe): drain is HBM/L2's")
    if not fence["knee_reached"]:
        notes.append("fence_inflight_bytes_per_sm: no knee within the measured bytes per SM")
    return {
        "signalling": {
            "fence_inflight_bytes_per_sm": fence["fence_inflight_bytes_per_sm"],
            "flag_poll_lanes": int(poll["flag_poll_lanes"]),
            "completion_jitter_us": float(jitter["one_way_jitter_mean_us"]),
        },
        "fence_us": fence["fence_us"],
        "flag_poll_us_per_peer": poll["per_flag_us"],
        "fit": fit,
        "notes": notes,
    }


def _empty_fence(points: dict) -> float | None:
    """Median fence_us of the points that stored nothing (None if there are none)."""
    zero = [float(pts["0"]["fence_us"]) for pts in points.values() if "0" in pts]
    return statistics.median(zero) if zero else None
