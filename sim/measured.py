"""Measured rows: where the measured files live, reading the measured CSVs, and the fit / hold-out
subsets of every fit.

Where: :func:`results_dir` (``mok/bench/results``, package data of ``mok``: every raw
measurement the benchmarks wrote, CSV and probe JSON, one copy each; its README says where each
came from) and :func:`measured_path` (one file there by name). ``sim/profiles`` holds only what
was fitted from them.

Readers: :func:`read_rows` (rows of any CSVs, tagged with their file name) and
:func:`read_measured` (one ``mok.bench comm`` or ``mok.bench layer`` / ``sweep`` CSV, checked:
:data:`MEASURED_COLUMNS`, :class:`MeasuredCSVError`); :func:`is_layer_csv` tells the two kinds
apart and :func:`row_tile_of` reads a layer row's ``row_tile`` (CSVs that predate the column ran
128).

Subsets (a row is a fit row or a validation row; the fits see only the fit rows):

* comm kernels (:mod:`sim.comm.fit`): :func:`is_fit_row`, by problem size (:data:`FIT_TOKENS`);
* the fused layer (:mod:`sim.fused.fit`): :func:`is_fused_fit_row`, by model, dispatch mode, comm
  SMs (:data:`FUSED_FIT_SMS`), routing, run (:data:`FUSED_FIT_SOURCES`) and row tile;
  :data:`FUSED_FIT_SUBSET` says it in words (written into the fitted profile).

Standard library only, and no other ``sim`` module: the fits, :mod:`sim.fused.model`,
:mod:`sim.app.validate` and the command line import this module.
"""

from __future__ import annotations

import csv
import io
import math
from collections.abc import Sequence
from importlib import resources
from pathlib import Path

__all__ = [
    "results_dir",
    "measured_path",
    "read_rows",
    "read_measured",
    "MeasuredCSVError",
    "MEASURED_COLUMNS",
    "MEASURED_KINDS",
    "is_layer_csv",
    "row_tile_of",
    "DEFAULT_ROW_TILE",
    "FIT_TOKENS",
    "is_fit_row",
    "FUSED_FIT_SMS",
    "FUSED_FIT_SOURCES",
    "FUSED_FIT_SUBSET",
    "is_fused_fit_row",
    "GEMM_WAVES_FIT_PROBES",
]


# -- where the measured files are --------------------------------------------------------------
def results_dir() -> Path:
    """``mok/bench/results``: the raw measurements of the benchmarks (``mok.bench comm`` /
    ``layer`` / ``sweep`` CSVs, ``mok.bench probe`` JSON), in this checkout or in the installed
    ``mok`` package (its package data)."""
    return Path(str(resources.files("mok").joinpath("bench", "results")))


def measured_path(name: str) -> Path:
    """The measured file ``name`` (e.g. ``h200x2-comm-grid-v4-2026-11-30.csv``) under
    :func:`results_dir`; FileNotFoundError, naming the files there, if there is none."""
    p = results_dir() / name
    if not p.is_file():
        have = ", ".join(sorted(q.name for q in results_dir().glob("*.*") if q.is_file()))
        raise FileNotFoundError(f"no measured file {name} under {results_dir()} (there: {have})")
    return p


# -- reading measured CSVs ----------------------------------------------------------------------
def read_rows(*paths: str | Path) -> list[dict]:
    """The rows of one or more measured CSVs, each tagged with its file name (``_source``)."""
    out = []
    for path in paths:
        with open(path, newline="") as f:
            out += [{**row, "_source": Path(path).name} for row in csv.DictReader(f)]
    return out


# The measured CSVs validate reads, by kind, and the columns each needs. A comm CSV has a `what`
# column (schedule / dispatch / combine); a layer CSV an `impl` and a `minibatch` column, no
# `what` (as :func:`is_layer_csv`).
MEASURED_COLUMNS = {
    "comm": ("model", "tokens_per_rank", "skew", "what", "impl", "mode", "sms", "median_us"),
    "layer": ("model", "tokens_per_rank", "skew", "impl", "mode", "sms", "minibatch", "median_us"),
}
MEASURED_KINDS = (
    "comm kernel rows (the CSV of `mok.bench comm`: columns "
    + ", ".join(MEASURED_COLUMNS["comm"])
    + ") and fused-layer rows (the CSVs of `mok.bench layer` / `sweep`: columns "
    + ", ".join(MEASURED_COLUMNS["layer"])
    + ")"
)
# integer columns of every row (other libraries' rows hold 0 where a knob does not apply)
_INT_COLUMNS = {
    "comm": ("tokens_per_rank", "sms"),
    "layer": ("tokens_per_rank", "sms", "minibatch"),
}


class MeasuredCSVError(ValueError):
    """A file that is not a measured CSV :func:`read_measured` reads (:data:`MEASURED_KINDS`)."""


def _columns_text(cols: Sequence[str], most: int = 8) -> str:
    shown = ", ".join(repr(c) for c in cols[:most])
    return shown + (f", ... ({len(cols)} columns)" if len(cols) > most else "")


def read_measured(path: str | Path) -> tuple[str, list[dict]]:
    """(kind, rows) of one measured CSV: kind ``comm`` (``mok.bench comm``) or ``layer``
    (``mok.bench layer`` / ``sweep``), rows tagged with the file name (``_source``) as
    :func:`read_rows`. Raises :class:`MeasuredCSVError` (one line: the file, what is wrong,
    :data:`MEASURED_KINDS`) for a file it cannot read, that is not a CSV of either kind, has no
    rows, or has a row whose ``median_us`` is not a positive finite number or whose integer
    columns are not integers."""
    name = str(path)

    def bad(why: str) -> MeasuredCSVError:
        return MeasuredCSVError(f"{name} {why}; mok-sim validate reads {MEASURED_KINDS}")

    try:
        text = Path(path).read_text()
    except UnicodeDecodeError:
        raise bad("is not a text file (not UTF-8)") from None
    except OSError as e:
        raise MeasuredCSVError(
            f"cannot read {name}: {e.strerror or e}; mok-sim validate reads {MEASURED_KINDS}"
        ) from None
    if not text.strip():
        raise bad("is empty")
    if text.lstrip()[0] in "{[":
        raise bad("is JSON, not a measured CSV")
    try:
        reader = csv.DictReader(io.StringIO(text, newline=""))
        cols = list(reader.fieldnames or [])
        rows = list(reader)
    except csv.Error as e:
        raise bad(f"is not a readable CSV ({e})") from None
    if "median_us" not in cols and ("layer_us" in cols or "predicted_us" in cols):
        raise bad(
            "is a mok-sim output CSV (predictions, not measurements; its columns: "
            f"{_columns_text(cols)})"
        )
    if "what" in cols:
        kind = "comm"
    elif "impl" in cols and "minibatch" in cols:
        kind = "layer"
    else:
        raise bad(f"is not a measured CSV (its columns: {_columns_text(cols)})")
    missing = [c for c in MEASURED_COLUMNS[kind] if c not in cols]
    if missing:
        raise bad(f"looks like a {kind} CSV but lacks the columns {', '.join(missing)}")
    if not rows:
        raise bad("has a header but no rows")
    for i, row in enumerate(rows):
        where = f"row {i + 1}"
        if None in row or None in row.values():
            more = "more" if None in row else "fewer"
            raise bad(f"{where} has {more} fields than its header ({len(cols)})")
        v = row["median_us"]
        try:
            ok = math.isfinite(float(v)) and float(v) > 0
        except ValueError:
            ok = False
        if not ok:
            raise bad(f"{where}: median_us {v!r} is not a positive finite number")
        for c in _INT_COLUMNS[kind]:
            try:
                int(row[c])
            except ValueError:
                raise bad(f"{where}: {c} {row[c]!r} is not an integer") from None
    source = Path(path).name
    return kind, [{**row, "_source": source} for row in rows]


def is_layer_csv(rows: Sequence[dict]) -> bool:
    """Whether measured rows come from ``mok.bench layer`` / ``sweep`` (an ``impl`` and a
    ``minibatch`` column, no ``what``) rather than ``mok.bench comm``."""
    return bool(rows) and "minibatch" in rows[0] and "impl" in rows[0] and "what" not in rows[0]


# the row tile of layer CSVs that predate the `row_tile` column: 128-row expert regions (the
# fused kernel's full tile, sim.fused.model.TILE_M)
DEFAULT_ROW_TILE = 128


def row_tile_of(row: dict) -> int:
    """The row tile of a ``mok.bench layer`` / ``sweep`` CSV row: its ``row_tile`` column (mok
    rows 64 or 128, other libraries 0); CSVs that predate the column ran 128."""
    v = row.get("row_tile")
    return DEFAULT_ROW_TILE if v is None or str(v).strip() == "" else int(v)


# -- the comm-kernel fit subset (sim.comm.fit) -------------------------------------------------
# GEMM waves (sim.app.gemm_fit): fit on these probes' grouped GEMMs by rows; the rest held out
GEMM_WAVES_FIT_PROBES = ("h200-probe-1gpu-2026-11-30.json",)


# The calibration subset: a mok row is a FIT row iff its tokens_per_rank is in FIT_TOKENS. The
# committed comm profile is fitted on the 4096-token rows of the v4 grid
# (mok/bench/results/h200x2-comm-grid-v4-2026-11-30.csv, both models, both skews); its 512- and
# 16384-token rows are validation only (a holdout in problem size: host-time-bound calls,
# padding-dominated receive buffers and NVLink-bound streams). NOTE: chosen after earlier
# models' errors had been looked at; it is a holdout by size, not a blind one.
FIT_TOKENS = (4096,)


def is_fit_row(row: dict) -> bool:
    """Whether a measured row belongs to the fit subset (:data:`FIT_TOKENS`)."""
    return int(row.get("tokens_per_rank") or 0) in FIT_TOKENS


# -- the fused-layer fit subset (sim.fused.fit) --------------------------------------------------
# (model, dispatch mode) -> comm SMs of its fit rows (None: all)
FUSED_FIT_SMS = {
    ("deepseek-v3", "dedup_pull"): None,
    ("qwen3-30b-a3b", "dedup_pull"): None,
    ("qwen3-30b-a3b", "pull"): ("8",),
}
# the committed snapshots the fit rows come from; rows of other CSVs (re-runs) are held out
FUSED_FIT_SOURCES = ("h200x2-layer-2026-11-30.csv", "h200x2-layer-sweep-2026-11-30.csv")
# NOTE: the committed fused profile holds this text (its fit_subset)
FUSED_FIT_SUBSET = (
    "mok-fused rows with uniform routing (sim.measured.is_fused_fit_row): deepseek-v3 and "
    "qwen3-30b-a3b dedup_pull, qwen3-30b-a3b pull at 8 SMs; the 2 matching rows of "
    "h200x2-layer-2026-11-30.csv and the 14 of h200x2-layer-sweep-2026-11-30.csv (8/16/32 SMs x "
    "minibatch 2048/4096). Validation: deepseek-v3 pull, qwen3-30b-a3b pull at 16/32 SMs, "
    "kimi-k2, hot:0.5, and every row of other CSVs (the deepseek-v3 sweep re-runs). Chosen "
    "after all rows had been looked at: a holdout by mode, shape, skew and run, not a blind one."
)


def is_fused_fit_row(row: dict) -> bool:
    """Whether a measured layer row belongs to the fused fit subset (:data:`FUSED_FIT_SUBSET`;
    row tile 128 only). A row without a source (``_source``, set by :func:`read_rows`) counts by
    content."""
    key = (row.get("model"), row.get("mode"))
    if key not in FUSED_FIT_SMS:
        return False
    sms = FUSED_FIT_SMS[key]
    return (
        row.get("impl") == "mok-fused"
        and row.get("skew") == "uniform"
        and (sms is None or str(row.get("sms")) in sms)
        and row.get("_source", FUSED_FIT_SOURCES[0]) in FUSED_FIT_SOURCES
        and row_tile_of(row) == DEFAULT_ROW_TILE
    )
