"""Fit the fused-layer knobs (:class:`sim.fused.model.FusedProfile`) on measured layer rows.

Fit rows (:func:`sim.measured.is_fused_fit_row`): ``mok-fused`` rows with uniform routing of
DeepSeek-V3 and Qwen3-30B-A3B with ``dedup_pull`` dispatch, and Qwen3's ``pull`` at 8 comm SMs, from
the committed snapshots of ``mok.bench layer`` (1 row per model) and ``mok.bench sweep`` (8 / 16 /
32 comm SMs x minibatch 2048 / 4096). Two shapes at three SM splits are what identify the five
knobs: the per-tile fixed cost (many short tiles at Qwen3, few long ones at DeepSeek-V3), the
worker efficiency and the chip-wide operand ceiling (DeepSeek-V3 moves less with the SM split
than Qwen3), the comm factor (Qwen3's dispatch is exposed at 8 SMs, DeepSeek-V3's dedup pull
too) and the remote factor (Qwen3's ``pull`` at 8 SMs is bound by its dispatch, which moves 4x
the remote bytes of its ``dedup_pull``). Validation rows: DeepSeek-V3 ``pull`` (where the 8-SM
configurations must hide their dispatch), Qwen3 ``pull`` at 16 and 32 SMs, Kimi-K2 (another
shape: 384 experts, 50 % padding rows), hot:0.5 routing (rank imbalance), and every row of
other CSVs (the DeepSeek-V3 re-runs). NOTE: the subset and the knobs were chosen
after every row had been looked at; the holdout is by mode, shape, skew and run, not a blind
one.

Every fit row ran expert regions padded to 128 rows (the snapshots predate the ``row_tile``
column; :func:`sim.measured.row_tile_of`). Rows at row tile 64 are never fit rows, and the two
knobs of the 64-row sub-tiles (``half_kblock_factor``, ``half_fixed_factor``) are not fitted:
they keep the profile's values (physical estimates, :class:`sim.fused.model.FusedProfile`), and
measured row-tile-64 rows validate them.

Fits (:data:`sim.measured.FUSED_FITS`, one per profile): the above is ``ep2``
(``mok-fused-h200x2``). ``ep1`` (``mok-fused-h200x1``) fits one-GPU rows (the per-rank work of
EP2 emulated: every expert local, no NVLink): uniform DeepSeek-V3 and Qwen3-30B-A3B at every
comm-SM count of the CSVs it is given; the profile records those files and its fit rows. A fit
fits only the knobs its rows can tell apart (:func:`fit_knobs`): ``remote_rate_factor`` needs
remote rows (none at EP1), ``operand_tbps`` and ``comm_rate_factor`` fit rows at two or more
comm-SM counts (one worker count cannot tell the operand ceiling from the worker's own rate, nor
the copy rate from the per-tile costs), ``tile_fixed_us`` two or more models (tile shapes); the
other knobs keep the values of the profile the refit starts from (``ep1``: the two-GPU profile),
and the fitted profile says which (``fit["knobs"]``, ``fit["fixed"]``).

Objective: sum over the fit rows of ``|log(predicted / measured)|`` (as :mod:`sim.comm.fit`).
Search: for each ``tile_fixed_us`` of a coarse grid, coordinate descent over the other knobs on
coarse grids; then a pattern search over all fitted knobs on fine grids from the best start
(:func:`pattern_search`). A few minutes (``mok-sim validate --refit`` on the layer CSVs; ``ep1`` on
the 2 fit rows of ``h200x1-layer-2026-12-01.csv``: seconds).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence

import numpy as np

from sim.fused.model import fused_row
from sim.fused.profile import FusedProfile
from sim.measured import FusedFit, fused_fit

__all__ = [
    "FINE_GRIDS",
    "FUSED_KNOBS",
    "fit_fused_profile",
    "fit_knobs",
    "profile_fit",
    "is_profile_fit_row",
    "objective",
    "pattern_search",
]

FUSED_KNOBS = (
    "gemm_efficiency",
    "tile_fixed_us",
    "operand_tbps",
    "comm_rate_factor",
    "remote_rate_factor",
)


def _log_grid(lo: float, hi: float, n: int) -> tuple[float, ...]:
    return tuple(np.round(np.exp(np.linspace(math.log(lo), math.log(hi), n)), 4))


_COARSE = {
    "tile_fixed_us": tuple(np.arange(0.0, 16.01, 1.0)),
    "gemm_efficiency": tuple(np.round(np.arange(0.40, 1.001, 0.02), 3)),
    "operand_tbps": tuple(np.round(np.arange(4.0, 20.01, 0.5), 2)),
    "comm_rate_factor": _log_grid(0.1, 2.0, 30),
    "remote_rate_factor": _log_grid(0.2, 2.0, 20),
}
# fine grids: steps of about 0.5 %; searched locally (:func:`pattern_search`), so their size costs
# little
FINE_GRIDS = {
    "tile_fixed_us": tuple(np.round(np.arange(0.0, 16.001, 0.05), 2)),
    "gemm_efficiency": tuple(np.round(np.arange(0.40, 1.0001, 0.005), 3)),
    "operand_tbps": tuple(np.round(np.arange(4.0, 20.001, 0.05), 2)),
    "comm_rate_factor": _log_grid(0.1, 2.0, 601),
    "remote_rate_factor": _log_grid(0.2, 2.0, 463),
}
_PATTERN_STEPS = (16, 8, 4, 2, 1)  # fine-grid points per move, coarse to fine
_MAX_SWEEPS = 8
# what each knob is, for the assumptions of a profile a fit writes afresh (FusedProfile has the
# long form)
_KNOB_MEANING = {
    "gemm_efficiency": "one worker's k-loop (128x256x64 wgmma per k-block) / its share of the "
    "dense bf16 rate (tensor_tflops / num_sms)",
    "tile_fixed_us": "us per tile outside the k-loop (epilogue: SwiGLU, staging, row stores incl. "
    "the down tiles' combine pushes; pipeline restart; counter release)",
    "operand_tbps": "chip-wide ceiling on the workers' operand loads (48 KiB of A + B boxes per "
    "k-block), approached smoothly (the 2-norm of the two limits)",
    "comm_rate_factor": "the fused comm blocks' per-SM copy rate on local rows / the probe's "
    "(local_st curve)",
    "remote_rate_factor": "their rate on remote rows (pull_ld curve) relative to local rows",
}


def _predict(row: dict, prof: FusedProfile) -> float:
    return fused_row(row, prof).layer_us


def objective(rows: Iterable[dict], prof: FusedProfile) -> float:
    """Sum of |log(predicted / measured)| over ``rows``."""
    return sum(abs(math.log(_predict(r, prof) / float(r["median_us"]))) for r in rows)


def _descend(rows, prof, grids, best, keys) -> tuple[FusedProfile, float]:
    for _ in range(_MAX_SWEEPS):
        moved = False
        for k in keys:
            o, v = min((objective(rows, prof.replace(**{k: float(v)})), float(v)) for v in grids[k])
            if o < best - 1e-12:
                best, prof, moved = o, prof.replace(**{k: v}), True
        if not moved:
            break
    return prof, best


def pattern_search(rows, prof, grids, best, keys, obj=None) -> tuple[FusedProfile, float]:
    """Pattern search on the fine grids from ``prof`` (snapped to them): move one knob by
    +-step grid points while that lowers the objective, for each step of
    :data:`_PATTERN_STEPS`. NOTE: small steps of one knob at a time follow the ridges that
    coupled knobs make (the comm and remote factors trade off on the 8-SM rows), which a line
    search over a whole grid per knob stalls on. ``obj``: the objective ``(rows, profile) ->
    float`` (None: :func:`objective`, the fused layer rows'; :mod:`sim.app.experts_rate_fit`
    passes the experts pieces')."""
    objective_ = objective if obj is None else obj
    idx = {k: int(np.argmin(np.abs(np.asarray(grids[k]) - getattr(prof, k)))) for k in keys}
    prof = prof.replace(**{k: float(grids[k][i]) for k, i in idx.items()})
    best = objective_(rows, prof)
    for step in _PATTERN_STEPS:
        moved = True
        while moved:
            moved = False
            for k in keys:
                for j in (idx[k] + step, idx[k] - step):
                    if not 0 <= j < len(grids[k]):
                        continue
                    p = prof.replace(**{k: float(grids[k][j])})
                    o = objective_(rows, p)
                    if o < best - 1e-12:
                        best, prof, idx[k], moved = o, p, j, True
                        break
    return prof, best


def profile_fit(prof: FusedProfile) -> tuple[FusedFit, tuple[str, ...] | None]:
    """(the fit ``prof`` came from, the CSVs its fit rows came from): the fit its ``fit["name"]``
    names (profiles that name none: :data:`sim.measured.DEFAULT_FUSED_FIT`, the two-GPU fit)
    and its ``fit["sources"]`` (None: the fit's own :attr:`~sim.measured.FusedFit.sources`)."""
    spec = fused_fit(prof.fit.get("name"))
    srcs = prof.fit.get("sources")
    return spec, (tuple(srcs) if srcs is not None and spec.sources is None else spec.sources)


def is_profile_fit_row(row: dict, prof: FusedProfile) -> bool:
    """Whether ``row`` is one of the rows ``prof`` was fitted on (:func:`profile_fit`)."""
    spec, srcs = profile_fit(prof)
    return spec.matches(row, srcs)


def fit_knobs(rows: Sequence[dict], spec: FusedFit) -> tuple[tuple[str, ...], dict[str, str]]:
    """(the knobs ``spec`` fits on its fit rows ``rows``, in :data:`FUSED_KNOBS` order; the others
    with why not): the fit's own fixed knobs (``spec.fixed``), ``remote_rate_factor`` without
    remote rows (one rank), ``operand_tbps`` and ``comm_rate_factor`` with fit rows at one
    comm-SM count only, ``tile_fixed_us`` with one model only."""
    fixed = dict(spec.fixed)
    sms = {str(r.get("sms")) for r in rows}
    models = {r.get("model") for r in rows}
    if spec.num_ranks == 1:
        fixed.setdefault("remote_rate_factor", "no remote rows at one rank")
    if len(sms) < 2:
        why = f"fit rows at one comm-SM count ({', '.join(sorted(sms))})"
        fixed.setdefault("operand_tbps", why + ": cannot tell the ceiling from the own rate")
        fixed.setdefault("comm_rate_factor", why + ": cannot tell the copy rate from the tiles")
    if len(models) < 2:
        fixed.setdefault("tile_fixed_us", "fit rows of one model (one tile shape)")
    return tuple(k for k in FUSED_KNOBS if k not in fixed), {
        k: fixed[k] for k in FUSED_KNOBS if k in fixed
    }


def _rows_text(rows: Sequence[dict]) -> str:
    """'the 2 fit rows of a.csv (16 comm SMs)' and so on, per source."""
    by: dict[str, list[dict]] = {}
    for r in rows:
        by.setdefault(r.get("_source", "rows without a source"), []).append(r)
    parts = []
    for src, rs in by.items():
        sms = sorted({int(r["sms"]) for r in rs})
        models = sorted({r["model"] for r in rs})
        parts.append(
            f"the {len(rs)} fit rows of {src} ({', '.join(models)}; "
            f"{'/'.join(map(str, sms))} comm SMs)"
        )
    return "; ".join(parts)


def _describe(
    spec: FusedFit,
    prof: FusedProfile,
    start: str,
    rows: Sequence[dict],
    fixed: dict[str, str],
) -> dict:
    """``fit_subset``, ``source`` and ``assumptions`` of a profile that ``spec`` writes afresh
    (a fit whose profile is not its base: its texts say which rows and knobs it fitted)."""
    runs = sorted({f"{r.get('gpu', '?')}, git {r.get('git_sha', '?')}" for r in rows})
    files = sorted({r.get("_source", "?") for r in rows})
    source = (
        f"fitted by sim.fused.fit.fit_fused_profile (fit {spec.name}: mok-sim validate CSV "
        f"--refit --fused-fit {spec.name}) on mok/bench/results/{', '.join(files)} "
        f"({'; '.join(runs)}), starting from {start}"
    )
    lines = []
    for k in FUSED_KNOBS:
        if k in fixed:
            lines.append(f"{k}: {_KNOB_MEANING[k]}; not fitted ({fixed[k]}): the value of {start}")
        else:
            lines.append(f"{k}: {_KNOB_MEANING[k]}; fitted")
    lines += list(spec.notes)
    # the start profile's other assumptions (sub-tiles, comm profile, routing, the sum) hold
    lines += [
        a for a in prof.assumptions if a.split(":")[0] not in FUSED_KNOBS and a not in spec.notes
    ]
    subset = f"{spec.subset} Fitted on {_rows_text(rows)}."
    return {"fit_subset": subset, "source": source, "assumptions": tuple(lines)}


def fit_fused_profile(
    rows: Iterable[dict],
    prof: FusedProfile,
    log: Callable[[str], None] | None = None,
    fit: FusedFit | str | None = None,
    start: str | None = None,
) -> FusedProfile:
    """``prof`` with the knobs of :data:`FUSED_KNOBS` that the fit rows among ``rows`` identify
    (:func:`fit_knobs`) refitted on them; the others keep ``prof``'s values. ``fit``: the fit (a
    :class:`sim.measured.FusedFit` or its name; None: the one ``prof`` came from,
    :func:`profile_fit`). ``start``: the name of ``prof`` for the texts (None: the fit's base).
    The result names the fit, the knobs it fitted and the fixed ones with why (``fit``), and the
    CSVs of its fit rows. A fit whose profile is its base (``ep2``) keeps ``prof``'s source and
    assumptions and writes its fixed subset text; the others (``ep1``) write all three from the
    fit rows and knobs."""
    spec = fit if isinstance(fit, FusedFit) else fused_fit(fit) if fit else profile_fit(prof)[0]
    fit_rows = [r for r in rows if spec.matches(r)]
    if not fit_rows:
        raise ValueError(
            f"no fit rows of fit {spec.name} among the measured rows (fit subset: {spec.subset})"
        )
    log = log or (lambda _m: None)
    knobs, fixed = fit_knobs(fit_rows, spec)
    for k, why in fixed.items():
        log(f"{k} not fitted ({why}): keeps {getattr(prof, k)}")
    start_prof, best = prof, objective(fit_rows, prof)
    if "tile_fixed_us" in knobs:
        others = tuple(k for k in knobs if k != "tile_fixed_us")
        start_prof, best = None, math.inf
        for c in _COARSE["tile_fixed_us"]:
            p0 = prof.replace(tile_fixed_us=float(c))
            p, o = _descend(fit_rows, p0, _COARSE, objective(fit_rows, p0), others)
            log(f"tile_fixed_us={c:5.2f}: objective {o:.4f}")
            if o < best:
                start_prof, best = p, o
    elif knobs:
        start_prof, best = _descend(fit_rows, prof, _COARSE, best, knobs)
    p, best = (
        pattern_search(fit_rows, start_prof, FINE_GRIDS, best, knobs) if knobs else (prof, best)
    )
    mean = best / len(fit_rows)
    log(f"fine: objective {best:.4f} (mean |log err| {mean:.4f} over {len(fit_rows)} rows)")
    out = {
        "name": spec.name,
        "num_rows": len(fit_rows),
        "objective": round(best, 5),
        "mean_abs_log_err": round(mean, 5),
        "knobs": list(knobs),
        "fixed": fixed,
        "sources": sorted({r.get("_source", "") for r in fit_rows} - {""}),
    }
    if spec.profile == spec.base:
        return p.replace(fit_subset=spec.subset, fit=out)
    return p.replace(fit=out, **_describe(spec, prof, start or spec.base, fit_rows, fixed))
