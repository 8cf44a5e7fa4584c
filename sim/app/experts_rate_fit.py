"""A candidate of mok's own GEMM rates on one H100, fitted on the experts pieces and held out on
the train CSVs: ``python -m sim.app.experts_rate_fit``.

The H200's kernel rates (``sim/profiles/mok-fused-h200x1.json``) are fitted on fused-layer rows
(:func:`sim.fused.fit.fit_fused_profile`, fit ``ep1``). The H100 has one such row
(``h100x1-layer-sonic-1536x256-2026-12-07.csv``: one shape, one comm-SM count, so that fit
could fit ``gemm_efficiency`` alone, on one row, which the model misses by -50 % whatever the
efficiency). What the H100 has instead are mok's backward pieces timed alone
(``h100x1-experts-sonic-2026-12-07.csv``, git d3eea98: two SonicMoE shapes). This module fits the
three knobs that set the layer model's GEMM rates under ``--gemm-profile``
(:func:`sim.core.gemm_waves.kernel_waves`: ``gemm_efficiency``, ``tile_fixed_us``,
``operand_tbps``) on the ``mok`` rows of the pieces :data:`FIT_PIECES` (predicted as
``mok-sim validate`` predicts them, :func:`sim.app.validate_experts.validate_experts_rows`),
with the search of the fused fit (:func:`sim.fused.fit.pattern_search` on its fine grids, from
``mok-fused-h200x1``'s values), and reports:

- the fit rows' errors and the held-out experts rows (``bwd_saved_all``, a sum of the fitted
  pieces timed as one launch and as one launch per GEMM; with ``--models``, the other shape's
  pieces too);
- the held-out train rows (:data:`TRAIN_CSVS`), forward and backward per shape, at the GPU
  profile's rates (the default), at ``mok-fused-h200x1``'s and at the candidate's.

Nothing here is written under ``sim/profiles``: the holdout did not justify a profile
(docs/sim-validation.md, "mok's kernel rates on one H100: not fitted"). ``--save-profile``
writes the candidate elsewhere, for ``mok-sim validate --gemm-profile PATH``.
"""

from __future__ import annotations

import argparse
import math
import statistics
import tempfile
from collections.abc import Sequence
from pathlib import Path

from sim.app.validate import validate_train_rows
from sim.app.validate_experts import validate_experts_rows
from sim.fused.fit import FINE_GRIDS, pattern_search
from sim.fused.profile import FusedProfile, load_fused_profile
from sim.measured import measured_path, read_rows

__all__ = [
    "EXPERTS_CSV",
    "FIT_PIECES",
    "RATE_KNOBS",
    "TRAIN_CSVS",
    "experts_errors",
    "fit_experts_rates",
    "train_errors",
]

EXPERTS_CSV = "h100x1-experts-sonic-2026-12-07.csv"
TRAIN_CSVS = (
    "h100x1-train-sonicmoe-levers-2026-12-07.csv",
    "h100x1-train-models-ep2-2026-12-07.csv",
    "h100x1-train-models-ep8-2026-12-07.csv",
)
# the pieces that are one GEMM kernel each (bwd_recompute: the recomputed gate / up and the down
# dgrad in one launch); bwd_saved_all (their sum from saved g / u) is held out
FIT_PIECES = ("dW_gate_up", "dW_down", "gate_up_dgrad", "bwd_recompute", "bwd_from_saved")
RATE_KNOBS = ("gemm_efficiency", "tile_fixed_us", "operand_tbps")
START = "mok-fused-h200x1"


class _Profiles:
    """Writes each profile evaluated to its own file (``SimConfig.gemm_profile`` is a name or a
    path; a fresh path per profile keeps any cache keyed on it honest)."""

    def __init__(self) -> None:
        self._dir = tempfile.TemporaryDirectory(prefix="experts-rate-fit-")
        self._n = 0

    def path(self, prof: FusedProfile) -> str:
        self._n += 1
        p = Path(self._dir.name) / f"p{self._n}.json"
        prof.save(p)
        return str(p)


def experts_errors(rows: Sequence[dict], gemm_profile: str | None) -> list[tuple[dict, float]]:
    """(row, predicted / measured - 1) for each predicted row of an experts CSV."""
    recs = validate_experts_rows(rows, gemm_profile)
    return [(r, rec["err"]) for r, rec in zip(rows, recs, strict=True) if rec["status"] == "ok"]


def fit_experts_rates(
    rows: Sequence[dict], start: FusedProfile, models: Sequence[str] | None = None
) -> tuple[FusedProfile, list[dict]]:
    """(``start`` with :data:`RATE_KNOBS` fitted on the fit rows, the fit rows): the ``mok``
    rows of :data:`FIT_PIECES` (of ``models``; None: every model), objective the sum of
    ``|log(predicted / measured)|`` (as the fused fit's)."""
    fit_rows = [
        r
        for r in rows
        if r["impl"] == "mok"
        and r["piece"] in FIT_PIECES
        and (models is None or r["model"] in models)
    ]
    if not fit_rows:
        raise ValueError(f"no fit rows (mok rows of {', '.join(FIT_PIECES)})")
    files = _Profiles()

    def obj(rs, prof):
        return sum(abs(math.log1p(e)) for _, e in experts_errors(rs, files.path(prof)))

    prof, best = pattern_search(fit_rows, start, FINE_GRIDS, math.inf, RATE_KNOBS, obj=obj)
    return prof.replace(
        source=f"fitted by sim.app.experts_rate_fit on the mok rows of {', '.join(FIT_PIECES)} "
        f"in mok/bench/results/{EXPERTS_CSV} ({', '.join(sorted({r['model'] for r in fit_rows}))};"
        f" NVIDIA H100 80GB HBM3, git d3eea98), starting from {START}; a candidate, not a "
        "committed profile",
        fit={
            "name": "h100-experts",
            "num_rows": len(fit_rows),
            "objective": round(best, 5),
            "mean_abs_log_err": round(best / len(fit_rows), 5),
            "knobs": list(RATE_KNOBS),
            "sources": [EXPERTS_CSV],
        },
    ), fit_rows


def train_errors(gemm_profile: str | None) -> dict[tuple[str, str, str], list[float]]:
    """(CSV, model, fwd / bwd) -> the errors of its predicted rows (mok-sim validate's)."""
    out: dict[tuple[str, str, str], list[float]] = {}
    for name in TRAIN_CSVS:
        for rec in validate_train_rows(read_rows(measured_path(name)), gemm_profile):
            if rec["status"] == "ok" and rec["what"] in ("fwd", "bwd"):
                out.setdefault((name, rec["model"], rec["what"]), []).append(rec["err"])
    return out


def _span(errs: Sequence[float]) -> str:
    med = statistics.median(abs(e) for e in errs)
    return f"{100 * min(errs):+.1f}..{100 * max(errs):+.1f} % ({100 * med:.1f})"


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m sim.app.experts_rate_fit", description=__doc__)
    ap.add_argument("--models", nargs="*", help="fit on these shapes only (default: both)")
    ap.add_argument("--no-train", action="store_true", help="skip the train CSVs' holdout")
    ap.add_argument("--save-profile", help="write the candidate profile here")
    a = ap.parse_args(argv)
    rows = read_rows(measured_path(EXPERTS_CSV))
    prof, fit_rows = fit_experts_rates(rows, load_fused_profile(START), a.models)
    knobs = ", ".join(f"{k} {getattr(prof, k)}" for k in RATE_KNOBS)
    print(f"fitted on {len(fit_rows)} rows: {knobs}; mean |log err| {prof.fit['mean_abs_log_err']}")
    files = _Profiles()
    path = files.path(prof)
    fit_ids = {id(r) for r in fit_rows}
    print(f"{'model':16s} {'piece':16s} {'impl':11s} {'role':8s} {'default':>8s} {START:>17s} fit")
    cols = [experts_errors(rows, p) for p in (None, START, path)]
    for (r, e0), (_, e1), (_, e2) in zip(*cols, strict=True):
        role = "fit" if id(r) in fit_ids else "holdout"
        print(
            f"{r['model']:16s} {r['piece']:16s} {r['impl']:11s} {role:8s} {100 * e0:+7.1f}% "
            f"{100 * e1:+16.1f}% {100 * e2:+6.1f}%"
        )
    if a.save_profile:
        prof.save(a.save_profile)
        print(f"wrote {a.save_profile}")
    if a.no_train:
        return
    print("held out: the train CSVs, signed range (median |err|) per shape")
    tabs = [train_errors(p) for p in (None, START, path)]
    print(f"{'CSV':44s} {'model':16s} q    {'default':22s} {START:22s} fit")
    for key in tabs[0]:
        print(
            f"{key[0]:44s} {key[1]:16s} {key[2]}  "
            + "  ".join(f"{_span(t[key]):22s}" for t in tabs)
        )
    for q in ("fwd", "bwd"):
        line = []
        for t in tabs:
            errs = [abs(e) for k, v in t.items() if k[2] == q for e in v]
            line.append(f"{100 * statistics.median(errs):.1f} / {100 * max(errs):.1f} %")
        print(f"all {q} rows, |err| median / max: " + "; ".join(line))


if __name__ == "__main__":
    main()
