"""Close the loop: predict every mok configuration of a measured sweep and score the predictions.

:func:`validate_rows` returns flat per-row records and :func:`summarise` a summary dict:

* error per row: ``pred / measured - 1`` (median and max of the absolute value, over the
  validation rows, the fit rows and all rows separately: the fitted knobs are only honest on rows
  they were not fitted on);
* per group (rows sharing a workload: ``model, tokens_per_rank, skew, what``), repeats of one
  configuration (same impl, mode, engine, sms) merged by their median;
  Spearman rank correlation of predicted vs measured over the configurations (ties get average
  ranks; undefined with < 3 configurations or constant predictions), and the gap
  ``measured(chosen) / measured(best) - 1`` where ``chosen`` has the smallest prediction.

Rows without a model (other libraries, unknown ``what`` / ``mode`` labels) are reported with a
``status`` and a reason, never scored. :func:`fit_kernel_profile` refits the kernel knobs of
:mod:`sim.phases` from the designated fit subset (:func:`is_fit_row`).
"""

from __future__ import annotations

import csv
import math
import statistics
from collections.abc import Iterable, Sequence
from pathlib import Path

import numpy as np

from sim.engine import run_graph
from sim.phases import (
    KERNELS,
    KernelProfile,
    build_kernel_graph,
    kernel_key,
    num_calls,
    predict_row,
    schedule_us,
)

__all__ = [
    "read_rows",
    "validate_rows",
    "summarise",
    "spearman",
    "chosen_gap",
    "fit_kernel_profile",
    "format_report",
    "GROUP_KEYS",
    "CONFIG_KEYS",
    "FIT_SMS",
    "FIT_WORKLOADS",
    "is_fit_row",
    "TARGETS",
]

# NOTE: `scope` (comparable unit / local step / end-to-end) keeps configurations that do
# different work out of one ranking; it is empty in CSVs that predate it.
GROUP_KEYS = ("model", "tokens_per_rank", "skew", "what", "scope")
CONFIG_KEYS = ("impl", "mode", "engine", "sms")
# The designated calibration subset, written down before any validation error of the broad grid
# was looked at: a mok row is a FIT row iff its SM count is in FIT_SMS or its workload
# (model, skew, tokens_per_rank) is in FIT_WORKLOADS (one model, one skew, two sizes). Every
# other row (qwen3-30b-a3b, hot:0.5, 512 tokens, other SM counts of other workloads) is
# validation only.
FIT_SMS = (8, 16)
FIT_WORKLOADS = (("deepseek-v3", "uniform", 4096), ("deepseek-v3", "uniform", 16384))
TARGETS = {"median_abs_err": 0.05, "max_abs_err": 0.15, "spearman": 0.9, "gap": 0.03}


def read_rows(path: str | Path) -> list[dict]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def is_fit_row(row: dict) -> bool:
    """Whether a measured row belongs to the designated fit subset (:data:`FIT_SMS`,
    :data:`FIT_WORKLOADS`)."""
    wl = (row.get("model"), row.get("skew"), int(row.get("tokens_per_rank") or 0))
    return int(row.get("sms") or 0) in FIT_SMS or wl in FIT_WORKLOADS


def validate_rows(rows: Iterable[dict], prof: KernelProfile) -> list[dict]:
    """One flat record per input row: the row's identity, measured and predicted us, error,
    ``role`` (fit / validation) and ``status`` (ok / skipped / unsupported + ``reason``)."""
    out = []
    for i, row in enumerate(rows):
        rec = {
            "row": i,
            **{k: row.get(k, "") for k in GROUP_KEYS},
            **{k: row.get(k, "-") for k in CONFIG_KEYS},
            "measured_us": float(row["median_us"]),
            "predicted_us": math.nan,
            "err": math.nan,
            "kernel": "",
            "role": "",
            "status": "ok",
            "reason": "",
        }
        try:
            us, name = predict_row(row, prof)
        except LookupError as e:
            rec["status"] = "skipped" if row.get("impl", "mok") != "mok" else "unsupported"
            rec["reason"] = str(e)
        except ValueError as e:  # a workload the simulator rejects (e.g. unknown model)
            rec["status"], rec["reason"] = "unsupported", str(e)
        else:
            rec.update(predicted_us=us, kernel=name, err=us / rec["measured_us"] - 1)
            rec["role"] = "fit" if is_fit_row(row) else "validation"
        out.append(rec)
    return out


def _ranks(x: Sequence[float]) -> np.ndarray:
    """1-based ranks, ties get the average of the ranks they span."""
    a = np.asarray(x, dtype=float)
    order = np.argsort(a, kind="stable")
    r = np.empty(len(a))
    i = 0
    while i < len(a):
        j = i
        while j + 1 < len(a) and a[order[j + 1]] == a[order[i]]:
            j += 1
        r[order[i : j + 1]] = (i + j) / 2 + 1
        i = j + 1
    return r


def spearman(x: Sequence[float], y: Sequence[float]) -> float:
    """Spearman rank correlation (Pearson of average ranks); NaN if undefined."""
    if len(x) != len(y):
        raise ValueError("spearman needs two sequences of equal length")
    if len(x) < 2:
        return math.nan
    rx, ry = _ranks(x), _ranks(y)
    rx, ry = rx - rx.mean(), ry - ry.mean()
    den = math.sqrt(float((rx * rx).sum() * (ry * ry).sum()))
    return float((rx * ry).sum() / den) if den > 0 else math.nan


def chosen_gap(predicted: Sequence[float], measured: Sequence[float]) -> tuple[int, int, float]:
    """(chosen index, best index, measured(chosen) / measured(best) - 1); the first smallest
    prediction is chosen."""
    c = int(np.argmin(predicted))
    b = int(np.argmin(measured))
    return c, b, measured[c] / measured[b] - 1


def _abs_stats(errs: list[float]) -> dict:
    a = [abs(e) for e in errs if not math.isnan(e)]
    return {
        "n": len(a),
        "median_abs_err": statistics.median(a) if a else math.nan,
        "max_abs_err": max(a) if a else math.nan,
    }


def _config_label(r: dict) -> str:
    eng = r["engine"] if r["engine"] not in ("", "-") else ""
    return f"{r['impl']}:{r['mode']}" + (f"/{eng}" if eng else "") + f"@{r['sms']}"


def summarise(records: Sequence[dict]) -> dict:
    ok = [r for r in records if r["status"] == "ok"]
    groups: dict[tuple, dict[tuple, list[dict]]] = {}
    for r in ok:
        g = groups.setdefault(tuple(r[k] for k in GROUP_KEYS), {})
        g.setdefault(tuple(r[k] for k in CONFIG_KEYS), []).append(r)
    gsum = []
    for gk, cfgs in groups.items():
        labels = [_config_label(rs[0]) for rs in cfgs.values()]
        meas = [statistics.median(r["measured_us"] for r in rs) for rs in cfgs.values()]
        pred = [statistics.median(r["predicted_us"] for r in rs) for rs in cfgs.values()]
        rows = [r for rs in cfgs.values() for r in rs]
        rho = spearman(pred, meas) if len(meas) >= 3 else math.nan
        c, b, gap = chosen_gap(pred, meas)
        gsum.append(
            {
                **dict(zip(GROUP_KEYS, gk, strict=True)),
                "configs": len(meas),
                **_abs_stats([r["err"] for r in rows]),
                "validation": _abs_stats([r["err"] for r in rows if r["role"] == "validation"]),
                "spearman": rho,
                "chosen": labels[c],
                "best": labels[b],
                "gap": gap,
            }
        )
    rhos = [g["spearman"] for g in gsum if not math.isnan(g["spearman"])]
    by_status: dict[str, int] = {}
    for r in records:
        by_status[r["status"]] = by_status.get(r["status"], 0) + 1
    s = {
        "rows": len(records),
        "by_status": by_status,
        "all": _abs_stats([r["err"] for r in ok]),
        "validation": _abs_stats([r["err"] for r in ok if r["role"] == "validation"]),
        "fit": _abs_stats([r["err"] for r in ok if r["role"] == "fit"]),
        "spearman_min": min(rhos) if rhos else math.nan,
        "spearman_mean": statistics.fmean(rhos) if rhos else math.nan,
        "gap_max": max((g["gap"] for g in gsum), default=math.nan),
        "groups": gsum,
        "unsupported": sorted({r["reason"] for r in records if r["status"] == "unsupported"}),
    }
    v = s["validation"]
    s["targets"] = {
        "median_abs_err": v["median_abs_err"] <= TARGETS["median_abs_err"],
        "max_abs_err": v["max_abs_err"] <= TARGETS["max_abs_err"],
        "spearman": bool(rhos) and s["spearman_min"] >= TARGETS["spearman"],
        "gap": s["gap_max"] <= TARGETS["gap"],
    }
    return s


# -- fitting ----------------------------------------------------------------------------------
_F_GRID = np.exp(np.linspace(math.log(0.05), math.log(3.0), 40))  # in-flight factors tabulated
_F_FINE = np.exp(np.linspace(math.log(0.05), math.log(3.0), 4000))


def _fit_points(rows: Iterable[dict]) -> tuple[list[tuple[tuple, dict, float]], list[dict]]:
    """(comm-kernel fit rows as (key, row, measured us), schedule fit rows)."""
    pts, sched = [], []
    for row in rows:
        if row.get("impl", "mok") != "mok" or not is_fit_row(row):
            continue
        if row.get("what") == "schedule":
            sched.append(row)
            continue
        key = kernel_key(row)
        if key is not None:
            pts.append((key, row, float(row["median_us"])))
    return pts, sched


def _device_us(key, row, prof) -> float:
    spec = KERNELS[key]
    b, g = build_kernel_graph(
        spec,
        key[2],
        row["model"],
        int(row["tokens_per_rank"]),
        int(row.get("num_ranks") or 2),
        row["skew"],
        int(row["sms"]),
        prof,
    )
    return run_graph(g, b.topo.capacities(b.gpu)).makespan_us


def fit_kernel_profile(
    rows: Iterable[dict],
    prof: KernelProfile,
    call_fixed_grid: Sequence[float] = tuple(range(0, 41)),
    handshake_grid: Sequence[float] = tuple(range(0, 41)),
) -> KernelProfile:
    """Refit the in-flight factors, ``call_fixed_us``, ``handshake_us`` and
    ``schedule_us_per_token`` on the designated fit subset of ``rows`` (:func:`is_fit_row`).

    The fixed costs are pure delays on every rank's critical path, so a prediction is
    host_bound(T(f) + launches x call_fixed + waits x handshake) with T(f) the graph's makespan
    without them: T is tabulated once per fit row on a grid of the row's own in-flight factor
    (log-interpolated), then (call_fixed, handshake) is a grid search in which each kernel knob
    takes the factor with the least sum of |log(pred / measured)| over its rows. Composite kernels
    have no knob of their own and are not fitted. ``sm_congestion_sms``, ``host_floor_us`` and
    ``tma_row_issue_us`` are kept as they are (fitted on 8/16-SM rows before / a priori)."""
    rows = list(rows)
    pts, sched = _fit_points(rows)
    own: dict[str, list] = {}
    for key, row, us in pts:
        spec = KERNELS[key]
        if len(spec.knobs) == 1:
            own.setdefault(spec.knobs[0], []).append((key, row, us))
    if not own:
        raise ValueError("no fit rows (see sim.validate.is_fit_row)")
    zero = prof.replace(call_fixed_us=0.0, handshake_us=0.0, host_floor_us=0.0)
    tables = {}  # knob -> (T [rows, F_GRID] us, launches [rows], waits [rows], floor [rows], us)
    for knob, kp in own.items():
        t = np.array(
            [
                [
                    _device_us(
                        k, r, zero.replace(inflight_factor={**prof.inflight_factor, knob: f})
                    )
                    for f in _F_GRID
                ]
                for k, r, _ in kp
            ]
        )
        fine = np.exp(np.array([np.interp(np.log(_F_FINE), np.log(_F_GRID), np.log(x)) for x in t]))
        specs = [KERNELS[k] for k, _, _ in kp]
        tables[knob] = (
            fine,
            np.array([num_calls(sp) for sp in specs], dtype=float),
            np.array([sum(ph.remote_waits for ph in sp.phases) for sp in specs], dtype=float),
            np.array([u for _, _, u in kp]),
        )
    best = None
    for cf in call_fixed_grid:
        for hs in handshake_grid:
            loss, n, fs = 0.0, 0, {}
            for knob, (fine, calls, waits, us) in tables.items():
                dev = fine + (calls * cf + waits * hs)[:, None]
                pred = np.maximum(dev, (calls * prof.host_floor_us)[:, None])
                err = np.abs(np.log(pred / us[:, None])).sum(axis=0)
                j = int(np.argmin(err))
                fs[knob] = round(float(_F_FINE[j]), 5)
                loss += float(err[j])
                n += len(us)
            if best is None or loss / n < best[0]:
                best = (loss / n, float(cf), float(hs), fs)
    loss, cf, hs, fs = best
    p = prof.replace(
        call_fixed_us=cf, handshake_us=hs, inflight_factor={**prof.inflight_factor, **fs}
    )
    if sched:  # the schedule's per-token walk, on its fit rows
        grid = np.linspace(0.0, 0.05, 5001)
        err = [
            sum(
                abs(
                    math.log(
                        schedule_us(
                            int(r["tokens_per_rank"]), p.replace(schedule_us_per_token=float(x))
                        )
                        / float(r["median_us"])
                    )
                )
                for r in sched
            )
            for x in grid
        ]
        p = p.replace(schedule_us_per_token=round(float(grid[int(np.argmin(err))]), 6))
    return p.replace(
        fit={
            "num_rows": len(pts) + len(sched),
            "num_kernel_rows_fitted": sum(len(v) for v in own.values()),
            "mean_abs_log_err": round(loss, 5),
        },
    )


# -- report -----------------------------------------------------------------------------------
def _pct(x: float) -> str:
    return "   n/a" if math.isnan(x) else f"{100 * x:5.1f}%"


def format_report(records: Sequence[dict], summary: dict) -> str:
    lines = []
    ok = [r for r in records if r["status"] == "ok"]
    for g in summary["groups"]:
        gk = tuple(g[k] for k in GROUP_KEYS)
        lines.append(f"\n{' '.join(str(x) for x in gk)}")
        head = f"  {'config':<34}{'role':<11}{'measured':>10}{'predicted':>11}{'err':>8}"
        lines += [head, "  " + "-" * (len(head) - 2)]
        for r in ok:
            if tuple(r[k] for k in GROUP_KEYS) != gk:
                continue
            lines.append(
                f"  {_config_label(r):<34}{r['role']:<11}{r['measured_us']:>10.1f}"
                f"{r['predicted_us']:>11.1f}{100 * r['err']:>7.1f}%"
            )
        v = g["validation"]
        lines.append(
            f"  |err| median {_pct(g['median_abs_err'])} max {_pct(g['max_abs_err'])} (validation "
            f"rows {v['n']}: median {_pct(v['median_abs_err'])} max {_pct(v['max_abs_err'])}); "
            f"spearman {g['spearman']:.3f} over {g['configs']} configs; chosen {g['chosen']} "
            f"best {g['best']} gap {_pct(g['gap'])}"
        )
    s = summary
    lines.append("\nsummary")
    for part in ("validation", "fit", "all"):
        x = s[part]
        lines.append(
            f"  {part:<11} rows {x['n']:>3}  median |err| {_pct(x['median_abs_err'])}  "
            f"max |err| {_pct(x['max_abs_err'])}"
        )
    lines.append(
        f"  spearman min {s['spearman_min']:.3f} mean {s['spearman_mean']:.3f}; "
        f"chosen-vs-best gap max {_pct(s['gap_max'])}"
    )
    lines.append(f"  rows by status: {s['by_status']}")
    for reason in s["unsupported"]:
        lines.append(f"  unsupported: {reason}")
    t = s["targets"]
    lines.append(
        "  targets (validation |err| median <= 5%, max <= 15%; spearman >= 0.9; gap <= 3%): "
        + ", ".join(f"{k} {'met' if v else 'MISSED'}" for k, v in t.items())
    )
    return "\n".join(lines)
