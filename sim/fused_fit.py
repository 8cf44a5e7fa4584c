"""Fit the fused-layer knobs (:class:`sim.fused.FusedProfile`) on measured layer rows.

Fit rows (:func:`is_fused_fit_row`): ``mok-fused`` rows of DeepSeek-V3 and Qwen3-30B-A3B with
uniform routing and ``dedup_pull`` dispatch, from ``mok.bench layer`` (1 row per model) and
``mok.bench sweep`` (8 / 16 / 32 comm SMs x minibatch 2048 / 4096). Two shapes at three SM
splits are what identify the four knobs: the per-tile fixed cost (many short tiles at Qwen3,
few long ones at DeepSeek-V3), the worker efficiency and the chip-wide operand ceiling
(DeepSeek-V3 barely moves with the SM split, Qwen3 does), and the comm factor (Qwen3's
dispatch is exposed at 8 SMs). Validation rows: ``pull`` dispatch (another copy pattern:
remote rows per minibatch), Kimi-K2 (another shape: 384 experts, 50 % padding rows) and
hot:0.5 routing (rank imbalance). NOTE: the subset and the knobs were chosen after every row had
been looked at; the holdout is by mode, shape and skew, not a blind one.

Objective: sum over the fit rows of ``|log(predicted / measured)|`` (as :mod:`sim.kernel_fit`).
Search: for each ``tile_fixed_us`` of a coarse grid, coordinate descent over the other knobs on
coarse grids; then coordinate descent over all four on fine grids from the best start, until
no knob moves. About a minute (``mok-sim validate --refit`` on the layer CSVs).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable

import numpy as np

from sim.fused import FusedProfile, fused_row

__all__ = ["FUSED_FIT_MODELS", "is_fused_fit_row", "fit_fused_profile", "objective", "FIT_SUBSET"]

FUSED_FIT_MODELS = ("deepseek-v3", "qwen3-30b-a3b")
FIT_SUBSET = (
    "mok-fused rows of deepseek-v3 and qwen3-30b-a3b, uniform routing, dedup_pull dispatch "
    "(sim.fused_fit.is_fused_fit_row): the 2 matching rows of h200x2-layer-2026-11-30.csv and "
    "the 12 of h200x2-layer-sweep-2026-11-30.csv (8/16/32 SMs x minibatch 2048/4096). "
    "Validation: pull dispatch, kimi-k2, hot:0.5. Chosen after all rows had been looked at: a "
    "holdout by mode, shape and skew, not a blind one."
)

_COARSE = {
    "tile_fixed_us": tuple(np.arange(0.0, 16.01, 1.0)),
    "gemm_efficiency": tuple(np.round(np.arange(0.40, 1.001, 0.02), 3)),
    "operand_tbps": tuple(np.round(np.arange(3.0, 10.01, 0.1), 2)),
    "comm_rate_factor": tuple(np.round(np.exp(np.linspace(math.log(0.1), math.log(2.0), 30)), 4)),
}
_FINE = {
    "tile_fixed_us": tuple(np.round(np.arange(0.0, 16.01, 0.25), 2)),
    "gemm_efficiency": tuple(np.round(np.arange(0.40, 1.001, 0.01), 3)),
    "operand_tbps": tuple(np.round(np.arange(3.0, 10.01, 0.05), 2)),
    "comm_rate_factor": tuple(np.round(np.exp(np.linspace(math.log(0.1), math.log(2.0), 90)), 4)),
}
_MAX_SWEEPS = 8


def is_fused_fit_row(row: dict) -> bool:
    """Whether a measured layer row belongs to the fused fit subset (:data:`FIT_SUBSET`)."""
    return (
        row.get("impl") == "mok-fused"
        and row.get("model") in FUSED_FIT_MODELS
        and row.get("skew") == "uniform"
        and row.get("mode") == "dedup_pull"
    )


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


def fit_fused_profile(
    rows: Iterable[dict], prof: FusedProfile, log: Callable[[str], None] | None = None
) -> FusedProfile:
    """``prof`` with its four knobs refitted on the fit rows among ``rows``."""
    fit = [r for r in rows if is_fused_fit_row(r)]
    if not fit:
        raise ValueError(f"no fit rows among the measured rows (fit subset: {FIT_SUBSET})")
    log = log or (lambda _m: None)
    others = ("gemm_efficiency", "operand_tbps", "comm_rate_factor")
    start, best = None, math.inf
    for c in _COARSE["tile_fixed_us"]:
        p0 = prof.replace(tile_fixed_us=float(c))
        p, o = _descend(fit, p0, _COARSE, objective(fit, p0), others)
        log(f"tile_fixed_us={c:5.2f}: objective {o:.4f}")
        if o < best:
            start, best = p, o
    p, best = _descend(fit, start, _FINE, best, ("tile_fixed_us",) + others)
    mean = best / len(fit)
    log(f"fine: objective {best:.4f} (mean |log err| {mean:.4f} over {len(fit)} rows)")
    return p.replace(
        fit_subset=FIT_SUBSET,
        fit={"num_rows": len(fit), "objective": round(best, 5), "mean_abs_log_err": round(mean, 5)},
    )
