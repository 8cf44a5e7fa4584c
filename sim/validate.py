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
:mod:`sim.phases` from the designated fit subset (:data:`FIT_SMS`).
"""

from __future__ import annotations

import csv
import math
import statistics
from collections.abc import Iterable, Sequence
from pathlib import Path

import numpy as np

from sim.phases import (
    KERNELS,
    KernelProfile,
    kernel_key,
    predict_kernel_us,
    predict_row,
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
    "TARGETS",
]

# NOTE: `scope` (comparable unit / local step / end-to-end) keeps configurations that do
# different work out of one ranking; it is empty in CSVs that predate it.
GROUP_KEYS = ("model", "tokens_per_rank", "skew", "what", "scope")
CONFIG_KEYS = ("impl", "mode", "engine", "sms")
# The designated calibration subset: comm-kernel rows at these SM counts fit the in-flight
# factors and the congestion constant; rows at every other SM count are validation only.
FIT_SMS = (8, 16)
TARGETS = {"median_abs_err": 0.05, "max_abs_err": 0.15, "spearman": 0.9, "gap": 0.03}


def read_rows(path: str | Path) -> list[dict]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def _is_fit_row(row: dict, key) -> bool:
    return key is not None and int(row["sms"]) in FIT_SMS


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
            key = kernel_key(row)
            rec["role"] = (
                "fit"
                if _is_fit_row(row, key)
                or (row.get("what") == "schedule" and "schedule" in prof.fit_subset)
                else "validation"
            )
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
def _fit_points(rows: Iterable[dict]) -> list[tuple[tuple, dict, float]]:
    pts = []
    for row in rows:
        if row.get("impl", "mok") != "mok":
            continue
        key = kernel_key(row)
        if _is_fit_row(row, key):
            pts.append((key, row, float(row["median_us"])))
    return pts


def _predict(key, row, prof) -> float:
    return predict_kernel_us(
        key,
        row["model"],
        int(row["tokens_per_rank"]),
        int(row.get("num_ranks") or 2),
        row["skew"],
        int(row["sms"]),
        prof,
    )


def _fit_factors(pts, prof: KernelProfile) -> tuple[KernelProfile, float]:
    """Per-kernel in-flight factors for a fixed congestion: each kernel's own knob is set so the
    geometric mean of pred / measured over its fit rows is 1 (bisection on log f; composite
    kernels have no knob of their own and are fitted after their parts)."""
    own = {}
    for key, row, us in pts:
        spec = KERNELS[key]
        if len(spec.knobs) == 1 and spec.knobs[0] == spec.name:
            own.setdefault(spec.name, []).append((key, row, us))
    factors = dict(prof.inflight_factor)
    for name, kp in own.items():
        lo, hi = math.log(1e-3), math.log(1e2)
        for _ in range(40):
            mid = (lo + hi) / 2
            p = prof.replace(inflight_factor={**factors, name: math.exp(mid)})
            m = statistics.fmean(math.log(_predict(k, r, p) / u) for k, r, u in kp)
            if m > 0:  # too slow: more in flight
                lo = mid
            else:
                hi = mid
        factors[name] = round(math.exp((lo + hi) / 2), 5)
    prof = prof.replace(inflight_factor=factors)
    loss = statistics.fmean(abs(math.log(_predict(k, r, prof) / u)) for k, r, u in pts)
    return prof, loss


def fit_kernel_profile(
    rows: Iterable[dict],
    prof: KernelProfile,
    congestion_grid: Sequence[float] = (40, 60, 80, 100, 150, 200, 300, 500, 1000, math.inf),
) -> KernelProfile:
    """Refit ``inflight_factor`` and ``sm_congestion_sms`` on the fit subset of ``rows``."""
    pts = _fit_points(rows)
    if not pts:
        raise ValueError(f"no fit rows (mok comm kernels at sms in {FIT_SMS})")
    # the knobs of one engine never touch the other's rows: fit the engines one at a time
    engines = sorted({k[2] for k, _, _ in pts})
    factors, cong, losses = dict(prof.inflight_factor), dict(prof.sm_congestion_sms), {}
    for eng in engines:
        sub = [x for x in pts if x[0][2] == eng]
        best = None
        for nc in congestion_grid:
            trial = prof.replace(sm_congestion_sms={**cong, eng: nc}, inflight_factor=factors)
            p, loss = _fit_factors(sub, trial)
            if best is None or loss < best[1]:
                best = (p, loss)
        factors, cong = dict(best[0].inflight_factor), dict(best[0].sm_congestion_sms)
        losses[eng] = round(best[1], 5)
    p = prof.replace(inflight_factor=factors, sm_congestion_sms=cong)
    return p.replace(
        fit={"num_rows": len(pts), "mean_abs_log_err_by_engine": losses},
        fit_subset=f"mok dispatch/combine rows at sms in {list(FIT_SMS)}",
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
