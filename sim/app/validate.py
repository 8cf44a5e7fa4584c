"""Close the loop: predict every mok configuration of a measured sweep and score the predictions.

:func:`validate_rows` returns flat per-row records (measured, predicted and device us, whether
the prediction is host-bound, fit / validation role) and :func:`summarise` a summary dict:

* error per row: ``pred / measured - 1`` (median and max of the absolute value, over the
  validation rows, the fit rows and all rows separately: the fitted knobs are only honest on rows
  they were not fitted on);
* per group (rows sharing a workload: ``model, tokens_per_rank, skew, what, scope``), repeats of
  one configuration (same impl, mode, engine, sms) merged by their median; Spearman rank
  correlation of predicted vs measured over the configurations (ties get average ranks;
  undefined with < 3 configurations or constant predictions), and the gap
  ``measured(chosen) / measured(best) - 1`` where ``chosen`` has the smallest prediction. For
  the choice, exact ties (configurations on the same host floor) are broken by the predicted
  device time (among host-bound configurations the simulator picks the faster kernel); the
  Spearman ranks keep them as ties;
* the ranking metrics over all groups, the validation groups and the groups without a predicted
  host-bound configuration (host-bound groups rank run-to-run host noise);
* the targets (:data:`TARGETS`) on the validation rows and the validation groups.

Rows without a model (other libraries, unknown ``what`` / ``mode`` labels) are reported with a
``status`` and a reason, never scored. :func:`sim.comm.fit.fit_kernel_profile` refits
the kernel knobs of :mod:`sim.comm.model` on the fit subset (:func:`sim.measured.is_fit_row`). The
measured CSVs are read, and the fit / validation subsets defined, in :mod:`sim.measured`.

Layer CSVs (``mok.bench layer`` / ``sweep``: an ``impl`` and a ``minibatch`` column, no ``what``;
:func:`sim.measured.is_layer_csv`) go through :func:`validate_layer_rows` instead: every
``mok-fused`` row is predicted by the fused-kernel model (:mod:`sim.fused.model`, profile
``sim/profiles/mok-fused-h200x2.json``, or the one-GPU ``mok-fused-h200x1.json``), fit rows are
the rows of the fit the profile came from (:func:`sim.fused.fit.is_profile_fit_row`: the fit of
:data:`sim.measured.FUSED_FITS` it names, on the CSVs it records); the
``nccl`` and ``mok-unfused`` rows are listed as measured baselines (status ``baseline``), not
predicted. Their records have ``what = "layer"``, so groups are (model, tokens, skew) and
configurations (impl, mode, sms, minibatch, row_tile). A layer CSV's ``row_tile`` column (mok rows
64 or 128, other libraries 0) is the expert-region padding the fused model predicts with; CSVs
that predate it ran 128 (:func:`sim.measured.row_tile_of`). Every group also reports the measured
spread of its configurations and the median p20-p80 width of its rows: a ranking within a spread
no wider than the run-to-run noise is noise-limited.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Sequence

import numpy as np

from mok.spec.rows import row_routing_seed
from sim.comm.model import predict_row
from sim.comm.profile import KernelProfile
from sim.config import SimConfig, Workload
from sim.fused.fit import is_profile_fit_row
from sim.fused.model import fused_row
from sim.fused.profile import FusedProfile
from sim.measured import is_fit_row, row_tile_of

__all__ = [
    "rerun_spearman",
    "validate_rows",
    "summarise",
    "spearman",
    "chosen_gap",
    "format_report",
    "validate_layer_rows",
    "BASELINES",
    "GROUP_KEYS",
    "CONFIG_KEYS",
    "TARGETS",
]

# NOTE: `scope` (comparable unit / local step / end-to-end) keeps configurations that do
# different work out of one ranking; it is empty in CSVs that predate it.
GROUP_KEYS = ("model", "tokens_per_rank", "skew", "what", "scope")
# minibatch, row_tile: layer CSVs only
CONFIG_KEYS = ("impl", "mode", "engine", "sms", "minibatch", "row_tile")
TARGETS = {"median_abs_err": 0.05, "max_abs_err": 0.15, "spearman": 0.9, "gap": 0.03}


def _float(x) -> float:
    try:
        return float(x)
    except (TypeError, ValueError):
        return math.nan


def _record(i: int, row: dict, **over) -> dict:
    rec = {
        "row": i,
        **{k: row.get(k, "") for k in GROUP_KEYS},
        **{k: row.get(k, "-") for k in CONFIG_KEYS},
        "source": row.get("_source", ""),
        "measured_us": float(row["median_us"]),
        "p20_us": _float(row.get("p20_us")),
        "p80_us": _float(row.get("p80_us")),
        "predicted_us": math.nan,
        "device_us": math.nan,
        "host_bound": False,
        "err": math.nan,
        "kernel": "",
        "role": "",
        "status": "ok",
        "reason": "",
    }
    rec.update(over)
    return rec


def validate_rows(rows: Iterable[dict], prof: KernelProfile) -> list[dict]:
    """One flat record per input row: the row's identity, measured and predicted us, error,
    ``role`` (fit / validation) and ``status`` (ok / skipped / unsupported + ``reason``)."""
    out = []
    for i, row in enumerate(rows):
        rec = _record(i, row)
        try:
            us, name, dev = predict_row(row, prof)
        except LookupError as e:
            rec["status"] = "skipped" if row.get("impl", "mok") != "mok" else "unsupported"
            rec["reason"] = str(e)
        except ValueError as e:  # a workload the simulator rejects (e.g. unknown model)
            rec["status"], rec["reason"] = "unsupported", str(e)
        else:
            rec.update(predicted_us=us, device_us=dev, host_bound=bool(us > dev))
            rec.update(kernel=name, err=us / rec["measured_us"] - 1)
            rec["role"] = "fit" if is_fit_row(row) else "validation"
        out.append(rec)
    return out


# -- layer CSVs (mok.bench layer / sweep) -------------------------------------------------------
# impl -> why the simulator does not predict it
BASELINES = {
    "nccl": "NCCL all_to_all + torch._grouped_mm + host-read split sizes: no simulator model of "
    "NCCL's all_to_all or torch's grouped GEMM",
    "mok-unfused": "mok comm kernels + torch._grouped_mm experts (bf16 since 7cabc14; fp32 "
    "gate/up and shared-expert outputs before): the torch GEMMs are not modelled",
    "torch-best": "one GPU, torch parts only (argsort, gathers, torch._grouped_mm experts, bmm "
    "k-sum), eager or compiled: torch's kernels are not modelled",
    "torch-ffn": "one GPU, the torch experts alone on expert-sorted rows: torch's grouped GEMM "
    "is not modelled",
}


def _layer_records(rows: Iterable[dict], predict) -> list[dict]:
    """One record per layer row: ``mok-fused`` rows filled in by ``predict(row, rec)`` (status
    ``unsupported`` where it raises ValueError: an unknown model / mode, an EP that does not
    divide the experts, ...), other impls status ``baseline`` with the reason
    (:data:`BASELINES`)."""
    out = []
    for i, row in enumerate(rows):
        rec = _record(i, row, what="layer", scope="", engine="-", row_tile=str(row_tile_of(row)))
        impl = row.get("impl", "")
        if impl != "mok-fused":
            rec["status"] = "baseline"
            rec["reason"] = f"{impl}: " + BASELINES.get(impl, "not a mok fused-layer row")
        else:
            try:
                predict(row, rec)
            except ValueError as e:
                rec["status"], rec["reason"] = "unsupported", str(e)
        out.append(rec)
    return out


def validate_layer_rows(rows: Iterable[dict], prof: FusedProfile) -> list[dict]:
    """One flat record per layer row, as :func:`validate_rows`: ``mok-fused`` rows predicted by
    :func:`sim.fused.model.fused_layer` (with its terms as ``*_us`` columns; role ``fit`` for the
    rows ``prof`` was fitted on, :func:`sim.fused.fit.is_profile_fit_row`), other impls as status
    ``baseline`` with the reason (:data:`BASELINES`)."""

    def predict(row: dict, rec: dict) -> None:
        res = fused_row(row, prof)
        rec.update(predicted_us=res.layer_us, device_us=res.device_us)
        rec.update(host_bound=bool(res.layer_us > res.device_us), kernel=f"fused.{row['mode']}")
        rec.update(err=res.layer_us / rec["measured_us"] - 1, **res.terms)
        rec["role"] = "fit" if is_profile_fit_row(row, prof) else "validation"

    return _layer_records(rows, predict)


# the receive ring of a mok.bench layer run: the whole receive buffer (capacity_factor 2)
_BENCH_CAPACITY_FACTOR = 2


def layer_model_config(row: dict, gemm_profile: str | None = None) -> tuple[Workload, SimConfig]:
    """The layer model's workload and config for a two-GPU ``mok-fused`` row of a
    ``mok.bench layer`` / ``sweep`` CSV: h200x2, its model, tokens, skew and routing seed; its
    mode (push combine), comm SMs, minibatch and row tile; the ring the benchmark ran (the whole
    receive buffer). ValueError for rows of another rank count (the layer model runs preset
    shapes, so an emulated one-GPU row has no workload)."""
    ranks = int(row.get("num_ranks") or 2)
    if ranks != 2:
        raise ValueError(f"the layer model is checked on two-GPU rows (this row ran {ranks})")
    wl = Workload(
        row["model"], int(row["tokens_per_rank"]), 2, "h200x2", row["skew"], row_routing_seed(row)
    )
    rt, mb = row_tile_of(row), int(row["minibatch"])
    shape = wl.model_shape
    rows = _BENCH_CAPACITY_FACTOR * wl.tokens_per_rank * shape.num_topk
    rows += shape.num_experts // wl.ep * (rt - 1)
    ring = -(-(-(-rows // rt) * rt) // mb) * mb
    cfg = SimConfig(
        dispatch_mode=row["mode"],
        combine_mode="push",
        num_comm_sms=int(row["sms"]),
        minibatch_size=mb,
        macrobatch_size=ring,
        row_tile=rt,
        gemm_profile=gemm_profile,
    )
    return wl, cfg


def validate_layer_model_rows(rows: Iterable[dict], gemm_profile: str | None = None) -> list[dict]:
    """As :func:`validate_layer_rows`, with the layer model (:func:`sim.layer.model.simulate`,
    the push-vs-pull model of :mod:`sim.layer`) instead of the fused model: the two-GPU
    ``mok-fused`` rows predicted under :func:`layer_model_config`, every row role
    ``validation`` (the layer model is not fitted on layer rows). ``gemm_profile``: see
    :attr:`sim.config.SimConfig.gemm_profile`."""
    from sim.layer.model import simulate

    def predict(row: dict, rec: dict) -> None:
        res = simulate(*layer_model_config(row, gemm_profile))
        us = res.layer_us
        rec.update(predicted_us=us, device_us=us, kernel=f"layer.{row['mode']}")
        rec.update(err=us / rec["measured_us"] - 1, role="validation", **res.breakdown)

    return _layer_records(rows, predict)


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


def _lex_ranks(x: Sequence[float], tie: Sequence[float] | None) -> np.ndarray:
    """Ranks of ``x``, exact ties broken by ``tie`` (then averaged)."""
    if tie is None:
        return _ranks(x)
    pairs = sorted(set(zip(x, tie, strict=True)))
    pos = {p: i for i, p in enumerate(pairs)}
    return _ranks([pos[p] for p in zip(x, tie, strict=True)])


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


def chosen_gap(
    predicted: Sequence[float], measured: Sequence[float], tie: Sequence[float] | None = None
) -> tuple[int, int, float]:
    """(chosen index, best index, measured(chosen) / measured(best) - 1); the smallest
    prediction is chosen, exact ties broken by ``tie`` (the predicted device time: configs on
    the same host floor are told apart by their kernels), then by order."""
    c = int(np.argmin(_lex_ranks(predicted, tie)))
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
    mb = r.get("minibatch", "-")
    mb = f"/mb{mb}" if mb not in ("", "-") else ""
    # the row tile only where it is not the 128 of every CSV before the column
    rt = str(r.get("row_tile", "-"))
    rt = f"/rt{rt}" if rt not in ("", "-", "0", "128") else ""
    return f"{r['impl']}:{r['mode']}" + (f"/{eng}" if eng else "") + f"@{r['sms']}{mb}{rt}"


def rerun_spearman(
    measured: Sequence[float], rel_sigma: float, draws: int = 2000, seed: int = 0
) -> tuple[float, float]:
    """(median, 10th percentile) of the Spearman correlation between two re-measurements of a
    group whose configurations truly take ``measured`` us, each measurement off by Gaussian
    relative noise ``rel_sigma``: the best a perfect model can expect against one run."""
    rng = np.random.default_rng(seed)
    t = np.asarray(measured, dtype=float)
    rho = [
        spearman(
            t * (1 + rel_sigma * rng.standard_normal(t.size)),
            t * (1 + rel_sigma * rng.standard_normal(t.size)),
        )
        for _ in range(draws)
    ]
    return float(np.median(rho)), float(np.percentile(rho, 10))


def _band_overlap(bands: Sequence[tuple[float, float]]) -> float:
    """Fraction of configuration pairs whose measured p20-p80 bands overlap (their order is not
    resolved by the run); NaN with fewer than two configurations or no bands."""
    pairs = [
        (a, b) for i, a in enumerate(bands) for b in bands[i + 1 :] if not math.isnan(a[0] + b[0])
    ]
    if not pairs:
        return math.nan
    return sum(a[0] <= b[1] and b[0] <= a[1] for a, b in pairs) / len(pairs)


def _p2080(r: dict) -> float:
    """Width of a row's measured p20-p80 band relative to its median."""
    return (r["p80_us"] - r["p20_us"]) / r["measured_us"]


def summarise(records: Sequence[dict]) -> dict:
    """Summary dict of :func:`validate_rows` records: |err| stats for validation / fit / all
    rows, one entry per group, Spearman and gap over all groups, over the validation groups
    and over the groups without a predicted host-bound config, and the targets (validation
    rows and groups)."""
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
        dev = [statistics.median(r["device_us"] for r in rs) for rs in cfgs.values()]
        rows = [r for rs in cfgs.values() for r in rs]
        rho = spearman(pred, meas) if len(meas) >= 3 else math.nan
        c, b, gap = chosen_gap(pred, meas, dev)
        widths = [w for w in map(_p2080, rows) if not math.isnan(w)]
        bands = [
            (min(r["p20_us"] for r in rs), max(r["p80_us"] for r in rs)) for rs in cfgs.values()
        ]
        gsum.append(
            {
                **dict(zip(GROUP_KEYS, gk, strict=True)),
                "configs": len(meas),
                "host_bound": sum(rs[0]["host_bound"] for rs in cfgs.values()),
                "role": "fit" if all(r["role"] == "fit" for r in rows) else "validation",
                **_abs_stats([r["err"] for r in rows]),
                "validation": _abs_stats([r["err"] for r in rows if r["role"] == "validation"]),
                "spearman": rho,
                "chosen": labels[c],
                "best": labels[b],
                "gap": gap,
                # measured: slowest / fastest configuration - 1, and the rows' p20-p80 widths
                "spread": max(meas) / min(meas) - 1,
                "p2080_median": statistics.median(widths) if widths else math.nan,
                "band_overlap": _band_overlap(bands),
            }
        )

    def ranking(sel) -> dict:
        gs = [g for g in gsum if sel(g)]
        rhos = [g["spearman"] for g in gs if not math.isnan(g["spearman"])]
        return {
            "groups": len(gs),
            "spearman_min": min(rhos) if rhos else math.nan,
            "spearman_mean": statistics.fmean(rhos) if rhos else math.nan,
            "gap_max": max((g["gap"] for g in gs), default=math.nan),
        }

    by_status: dict[str, int] = {}
    for r in records:
        by_status[r["status"]] = by_status.get(r["status"], 0) + 1
    everything = ranking(lambda g: True)
    s = {
        "rows": len(records),
        "by_status": by_status,
        "all": _abs_stats([r["err"] for r in ok]),
        "validation": _abs_stats([r["err"] for r in ok if r["role"] == "validation"]),
        "fit": _abs_stats([r["err"] for r in ok if r["role"] == "fit"]),
        **{k: everything[k] for k in ("spearman_min", "spearman_mean", "gap_max")},
        "ranking": {
            "all groups": everything,
            "validation groups": ranking(lambda g: g["role"] == "validation"),
            "device-bound groups": ranking(lambda g: g["host_bound"] == 0),
        },
        "groups": gsum,
        "unsupported": sorted({r["reason"] for r in records if r["status"] == "unsupported"}),
        "baselines": sorted({r["reason"] for r in records if r["status"] == "baseline"}),
    }
    v, vg = s["validation"], s["ranking"]["validation groups"]
    s["targets"] = {
        "median_abs_err": v["median_abs_err"] <= TARGETS["median_abs_err"],
        "max_abs_err": v["max_abs_err"] <= TARGETS["max_abs_err"],
        "spearman": vg["spearman_min"] >= TARGETS["spearman"],
        "gap": vg["gap_max"] <= TARGETS["gap"],
    }
    return s


# -- report -----------------------------------------------------------------------------------
def _pct(x: float, digits: int = 1) -> str:
    return "   n/a" if math.isnan(x) else f"{100 * x:5.{digits}f}%"


def _rho(x: float) -> str:
    return "   n/a" if math.isnan(x) else f"{x:6.3f}"


def _row_lines(records: Sequence[dict], gk: tuple) -> list[str]:
    head = f"      {'config':<34}{'role':<11}{'measured':>10}{'predicted':>11}{'device':>9}"
    lines = [head + f"{'err':>8}"]
    for r in records:
        if r["status"] != "ok" or tuple(r[k] for k in GROUP_KEYS) != gk:
            continue
        lines.append(
            f"      {_config_label(r):<34}{r['role']:<11}{r['measured_us']:>10.1f}"
            f"{r['predicted_us']:>11.1f}{r['device_us']:>9.1f}{100 * r['err']:>7.1f}%"
            + ("  host-bound" if r["host_bound"] else "")
        )
    return lines


def _baseline_lines(records: Sequence[dict]) -> list[str]:
    """Measured baselines of layer CSVs, with the measured and the predicted speedup of the
    fused layer over each: the fused rows of the group that ran the unfused baseline's config
    (mode, sms, minibatch, row tile) in the same run (CSV; runs differ by a few %), else the
    group's only fused config of that run."""
    base = [r for r in records if r["status"] == "baseline"]
    if not base:
        return []
    lines = ["  baselines (measured, not predicted; speedup = baseline / fused):"]
    cfg = ("mode", "sms", "minibatch", "row_tile")
    for r in base:
        gk = tuple(r[k] for k in GROUP_KEYS)
        group = [
            f
            for f in records
            if tuple(f[k] for k in GROUP_KEYS) == gk and f["source"] == r["source"]
        ]
        fused = [f for f in group if f["status"] == "ok"]
        ref = {tuple(b[k] for k in cfg) for b in group if b["impl"] == "mok-unfused"}
        same = [f for f in fused if tuple(f[k] for k in cfg) in ref]
        fused = same or (fused if len({_config_label(f) for f in fused}) == 1 else [])
        text = (
            f"    {r['model']:<14}{r['skew']:<8} {r['impl'] + ':' + r['mode']:<24}"
            f"{r['measured_us']:>9.0f} us"
        )
        if fused:
            meas = statistics.median(f["measured_us"] for f in fused)
            pred = statistics.median(f["predicted_us"] for f in fused)
            text += (
                f"   fused {_config_label(fused[0])}: measured {r['measured_us'] / meas:.2f}x, "
                f"predicted {r['measured_us'] / pred:.2f}x"
            )
        lines.append(text)
    for reason in sorted({r["reason"] for r in base}):
        lines.append(f"    {reason}")
    return lines


def format_report(records: Sequence[dict], summary: dict, rows: bool = False) -> str:
    """Per-group table (``rows``: with every row under its group), overall |err| by role and
    by tokens per rank, the ranking metrics and the targets."""
    s = summary
    lines = [
        "per group (cfg: configurations, host: predicted host-bound ones; |err| over all rows of "
        "the group; spread: measured slowest / fastest config - 1; p20-80: median measured "
        "p20-p80 width of its rows; ovl: config pairs whose p20-p80 bands overlap; chosen = "
        "smallest prediction, ties broken by predicted device time)",
        f"  {'model':<14}{'tokens':>7} {'skew':<8} {'what':<9}{'scope':<11}{'role':<11}"
        f"{'cfg':>4}{'host':>5}{'med|err|':>10}{'max|err|':>10}{'spearman':>9}{'gap':>8}"
        f"{'spread':>8}{'p20-80':>8}{'ovl':>7}  chosen / best",
    ]
    for g in s["groups"]:
        gk = tuple(g[k] for k in GROUP_KEYS)
        lines.append(
            f"  {g['model']:<14}{g['tokens_per_rank']:>7} {g['skew']:<8} {g['what']:<9}"
            f"{g['scope'] or '-':<11}{g['role']:<11}{g['configs']:>4}{g['host_bound']:>5}"
            f"{_pct(g['median_abs_err']):>10}{_pct(g['max_abs_err']):>10}"
            f"{_rho(g['spearman']):>9}{_pct(g['gap']):>8}{_pct(g['spread']):>8}"
            f"{_pct(g['p2080_median']):>8}{_pct(g['band_overlap'], 0):>7}  {g['chosen']}"
            + ("" if g["chosen"] == g["best"] else f" / {g['best']}")
        )
        if rows:
            lines += _row_lines(records, gk)
    ok = [r for r in records if r["status"] == "ok"]
    lines += ["", "overall", f"  {'rows':<22}{'n':>5}{'median|err|':>13}{'max|err|':>10}"]
    parts = [(p, [r for r in ok if r["role"] == p]) for p in ("validation", "fit")]
    parts.append(("all", ok))
    for t in sorted({int(r["tokens_per_rank"] or 0) for r in ok}):
        parts.append((f"tokens {t}", [r for r in ok if int(r["tokens_per_rank"] or 0) == t]))
    if any(r["what"] == "layer" for r in ok):
        keys = ("model", "skew", "mode", "sms")
        keys += ("row_tile",) if len({str(r["row_tile"]) for r in ok}) > 1 else ()
        for key in keys:
            for v in sorted({str(r[key]) for r in ok}):
                parts.append((f"{key} {v}", [r for r in ok if str(r[key]) == v]))
    for name, rs in parts:
        x = _abs_stats([r["err"] for r in rs])
        lines.append(
            f"  {name:<22}{x['n']:>5}{_pct(x['median_abs_err']):>13}{_pct(x['max_abs_err']):>10}"
        )
    lines += ["", f"  {'ranking':<22}{'groups':>7}{'spearman min':>14}{'mean':>8}{'gap max':>9}"]
    for name, x in s["ranking"].items():
        lines.append(
            f"  {name:<22}{x['groups']:>7}{_rho(x['spearman_min']):>14}"
            f"{_rho(x['spearman_mean']):>8}{_pct(x['gap_max']):>9}"
        )
    lines.append(f"  rows by status: {s['by_status']}")
    for reason in s["unsupported"]:
        lines.append(f"  unsupported: {reason}")
    lines += _baseline_lines(records)
    v, vg = s["validation"], s["ranking"]["validation groups"]
    t = s["targets"]
    na = {"median_abs_err": v["n"] == 0, "max_abs_err": v["n"] == 0}
    na.update(spearman=math.isnan(vg["spearman_min"]), gap=math.isnan(vg["gap_max"]))
    lines.append(
        "  targets (validation rows: |err| median <= 5%, max <= 15%; validation groups: "
        "spearman >= 0.9, gap <= 3%): "
        + ", ".join(f"{k} {'n/a' if na[k] else 'met' if v_ else 'MISSED'}" for k, v_ in t.items())
    )
    return "\n".join(lines)
