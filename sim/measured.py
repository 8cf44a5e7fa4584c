"""Measured rows: where the measured files live, reading the measured CSVs, and the fit / hold-out
subsets of every fit.

Where: :func:`results_dir` (``mok/bench/results``, package data of ``mok``: every raw
measurement the benchmarks wrote, CSV and probe JSON, one copy each; its README says where each
came from) and :func:`measured_path` (one file there by name). ``sim/profiles`` holds only what
was fitted from them.

Readers: :func:`read_rows` (rows of any CSVs, tagged with their file name) and
:func:`read_measured` (one ``mok.bench comm``, ``mok.bench layer`` / ``sweep``, ``mok.bench
train`` or ``mok.bench experts`` CSV, checked: :data:`MEASURED_COLUMNS`,
:class:`MeasuredCSVError`); :func:`is_layer_csv`
and :func:`is_train_csv` tell the kinds apart by their columns and :func:`row_tile_of` reads a
layer row's ``row_tile`` (CSVs that predate the column ran 128).
:func:`gpu_profile_of` names the GPU profile of the device a measurement ran on (a probe's
``meta.gpu``, a CSV's ``gpu`` column).

Subsets (a row is a fit row or a validation row; the fits see only the fit rows):

* comm kernels (:mod:`sim.comm.fit`): :func:`is_fit_row`, by problem size (:data:`FIT_TOKENS`);
* the fused layer (:mod:`sim.fused.fit`): one :class:`FusedFit` per fused profile, in
  :data:`FUSED_FITS` (profile name -> its fit: ranks, models and dispatch modes with their comm
  SMs, routing, run, row tile, the knobs it never fits): ``ep2`` (:data:`FUSED_FIT_SMS`,
  :data:`FUSED_FIT_SOURCES`, :data:`FUSED_FIT_SUBSET`: ``mok-fused-h200x2``) and ``ep1``
  (one-GPU rows, ``mok-fused-h200x1``); :func:`fused_fit` looks one up by either name and
  :func:`is_fused_fit_row` says whether a row is one of its fit rows. The subset text
  (``subset``) is written into the fitted profile.

Standard library only, and no other ``sim`` module: the fits, :mod:`sim.fused.model`,
:mod:`sim.app.validate` and the command line import this module.
"""

from __future__ import annotations

import csv
import io
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
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
    "is_train_csv",
    "row_tile_of",
    "DEFAULT_ROW_TILE",
    "MEASURED_GPUS",
    "gpu_profile_of",
    "FIT_TOKENS",
    "is_fit_row",
    "FUSED_FIT_SMS",
    "FUSED_FIT_SOURCES",
    "FUSED_FIT_SUBSET",
    "FUSED_FIT_EP1_SUBSET",
    "FusedFit",
    "FUSED_FITS",
    "DEFAULT_FUSED_FIT",
    "fused_fit",
    "is_fused_fit_row",
    "GEMM_WAVES_FIT_PROBES",
    "SIGNALLING_FIT_PROBE",
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
# column (schedule / dispatch / combine); a train CSV (`mok.bench train`) the step's `fwd_us`,
# `bwd_us` and `step_us` and no `median_us` (as :func:`is_train_csv`); a layer CSV an `impl` and
# a `minibatch` column, no `what` (as :func:`is_layer_csv`); an experts CSV (`mok.bench experts`)
# a `piece` column.
MEASURED_COLUMNS = {
    "comm": ("model", "tokens_per_rank", "skew", "what", "impl", "mode", "sms", "median_us"),
    "layer": ("model", "tokens_per_rank", "skew", "impl", "mode", "sms", "minibatch", "median_us"),
    "train": (
        "model",
        "tokens_per_rank",
        "skew",
        "impl",
        "mode",
        "sms",
        "fwd_us",
        "bwd_us",
        "step_us",
    ),
    "experts": ("model", "tokens_per_rank", "skew", "num_experts", "piece", "impl", "median_us"),
}
MEASURED_KINDS = (
    "comm kernel rows (the CSV of `mok.bench comm`: columns "
    + ", ".join(MEASURED_COLUMNS["comm"])
    + "), fused-layer rows (the CSVs of `mok.bench layer` / `sweep`: columns "
    + ", ".join(MEASURED_COLUMNS["layer"])
    + "), training-step rows (the CSV of `mok.bench train`: columns "
    + ", ".join(MEASURED_COLUMNS["train"])
    + ") and expert GEMM pieces (the CSV of `mok.bench experts`: columns "
    + ", ".join(MEASURED_COLUMNS["experts"])
    + ")"
)
# integer columns of every row (other libraries' rows hold 0 where a knob does not apply)
_INT_COLUMNS = {
    "comm": ("tokens_per_rank", "sms"),
    "layer": ("tokens_per_rank", "sms", "minibatch"),
    "train": ("tokens_per_rank", "sms"),
    "experts": ("tokens_per_rank", "num_experts"),
}
# the measured times of every row: positive finite numbers (a train row's backward is its step
# less its forward)
_TIME_COLUMNS = {
    "comm": ("median_us",),
    "layer": ("median_us",),
    "train": ("fwd_us", "bwd_us", "step_us"),
    "experts": ("median_us",),
}


class MeasuredCSVError(ValueError):
    """A file that is not a measured CSV :func:`read_measured` reads (:data:`MEASURED_KINDS`)."""


def _columns_text(cols: Sequence[str], most: int = 8) -> str:
    shown = ", ".join(repr(c) for c in cols[:most])
    return shown + (f", ... ({len(cols)} columns)" if len(cols) > most else "")


def read_measured(path: str | Path) -> tuple[str, list[dict]]:
    """(kind, rows) of one measured CSV: kind ``comm`` (``mok.bench comm``), ``layer``
    (``mok.bench layer`` / ``sweep``), ``train`` (``mok.bench train``: ``fwd_us``, ``bwd_us``
    and ``step_us``, no ``median_us``; never taken for a layer CSV, though it has ``impl`` and
    ``mode``) or ``experts`` (``mok.bench experts``: a ``piece`` column), rows tagged with the
    file name (``_source``) as :func:`read_rows`. Raises :class:`MeasuredCSVError` (one line:
    the file, what is wrong, :data:`MEASURED_KINDS`) for a
    file it cannot read, that is not a CSV of these kinds, has no rows, or has a row whose times
    (``median_us``; a train row's three) are not positive finite numbers or whose integer columns
    are not integers."""
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
    elif "piece" in cols and "median_us" in cols:
        kind = "experts"
    elif "median_us" not in cols and "step_us" in cols and "fwd_us" in cols:
        kind = "train"
    elif "impl" in cols and "minibatch" in cols:
        kind = "layer"
    else:
        raise bad(f"is not a measured CSV (its columns: {_columns_text(cols)})")
    missing = [c for c in MEASURED_COLUMNS[kind] if c not in cols]
    if missing:
        article = "an" if kind[0] in "aeiou" else "a"
        raise bad(f"looks like {article} {kind} CSV but lacks the columns {', '.join(missing)}")
    if not rows:
        raise bad("has a header but no rows")
    for i, row in enumerate(rows):
        where = f"row {i + 1}"
        if None in row or None in row.values():
            more = "more" if None in row else "fewer"
            raise bad(f"{where} has {more} fields than its header ({len(cols)})")
        for c in _TIME_COLUMNS[kind]:
            v = row[c]
            try:
                ok = math.isfinite(float(v)) and float(v) > 0
            except ValueError:
                ok = False
            if not ok:
                raise bad(f"{where}: {c} {v!r} is not a positive finite number")
        for c in _INT_COLUMNS[kind]:
            try:
                int(row[c])
            except ValueError:
                raise bad(f"{where}: {c} {row[c]!r} is not an integer") from None
    source = Path(path).name
    return kind, [{**row, "_source": source} for row in rows]


def is_layer_csv(rows: Sequence[dict]) -> bool:
    """Whether measured rows come from ``mok.bench layer`` / ``sweep`` (an ``impl`` and a
    ``minibatch`` column, no ``what``, not a train CSV's step times) rather than ``mok.bench
    comm`` or ``train``."""
    return (
        bool(rows)
        and "minibatch" in rows[0]
        and "impl" in rows[0]
        and "what" not in rows[0]
        and not is_train_csv(rows)
    )


def is_train_csv(rows: Sequence[dict]) -> bool:
    """Whether measured rows come from ``mok.bench train`` (one training step per row: ``fwd_us``,
    ``bwd_us``, ``step_us``, no ``median_us`` and no ``what``)."""
    return (
        bool(rows)
        and all(c in rows[0] for c in ("fwd_us", "bwd_us", "step_us"))
        and "median_us" not in rows[0]
        and "what" not in rows[0]
    )


# the row tile of layer CSVs that predate the `row_tile` column: 128-row expert regions (the
# fused kernel's full tile, sim.fused.model.TILE_M)
DEFAULT_ROW_TILE = 128


def row_tile_of(row: dict) -> int:
    """The row tile of a ``mok.bench layer`` / ``sweep`` CSV row: its ``row_tile`` column (mok
    rows 64 or 128, other libraries 0); CSVs that predate the column ran 128."""
    v = row.get("row_tile")
    return DEFAULT_ROW_TILE if v is None or str(v).strip() == "" else int(v)


# -- which GPU a measurement ran on --------------------------------------------------------------
# a word of the device name as torch reports it -> the GPU profile (sim/profiles/<name>.json)
MEASURED_GPUS = {"H200": "h200", "H100": "h100"}


def gpu_profile_of(device: str | None) -> str | None:
    """The GPU profile name of ``device``, a device name as torch reports it (a probe JSON's
    ``meta.gpu``, a bench CSV's ``gpu`` column), by its words (:data:`MEASURED_GPUS`):
    ``NVIDIA H100 80GB HBM3`` -> ``h100``; None for another GPU or no name."""
    words = set(str(device or "").upper().split())
    return next((prof for w, prof in MEASURED_GPUS.items() if w in words), None)


# -- the comm-kernel fit subset (sim.comm.fit) -------------------------------------------------
# GEMM waves (sim.app.gemm_fit), per GPU profile: fit on every grouped GEMM of its probes (by rows
# per expert at all SMs, and by SM count through the carveout: the layer runs its GEMMs on 100-128
# of the 132 SMs, and only the carveout sweep measures how the rate depends on the SM count); the
# grouped GEMMs of the other probes of the same GPU are held out (h200:
# h200-probe-1gpu-2026-11-30.json, h200x2-mok-probe-2026-11-30.json and the 4 grouped GEMMs of
# h200-probe-gemm-sustained-2026-12-03.json: other runs, other days; h100: none), and those of
# another GPU are neither (gpu_profile_of the probe's meta.gpu)
GEMM_WAVES_FIT_PROBES = {
    "h200": ("h200-probe-gemm-dense-2026-12-01.json",),
    "h100": ("h100-probe-gemm-dense-2026-12-07.json",),
}

# Push signalling (sim.app.signalling_fit, written into the h200 profile by sim.app.calibrate):
# the one-H200 run of the probe's poll_cost, fence_cost, block_skew and signal_jitter sections
# (local stores only: its fence_cost.peer needs two GPUs in one process and was skipped). The
# only probe with these sections; nothing is held out
SIGNALLING_FIT_PROBE = "h200-probe-signalling-2026-12-01.json"


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


@dataclass(frozen=True)
class FusedFit:
    """One fit of the fused-layer knobs (:func:`sim.fused.fit.fit_fused_profile`): which rows it
    fits and which profile it writes.

    A fit row is a ``mok-fused`` row of ``num_ranks`` ranks whose (model, dispatch mode) is a
    key of ``sms`` (value: its comm SMs as text, None: every count), with routing in ``skews``,
    row tile 128 (:data:`DEFAULT_ROW_TILE`; the 64-row sub-tiles' knobs are never fitted) and
    from one of ``sources`` (CSV file names). ``sources`` None: from any CSV the fit is given;
    the fitted profile then records the files its fit rows came from (``fit["sources"]``) and
    only rows of those count as its fit rows afterwards (:func:`is_fused_fit_row` with
    ``sources``). ``fixed``: knobs this fit never fits (name -> why), kept at the values of the
    profile the refit starts from, ``base`` by default. ``notes``: what the fitted profile adds
    to its assumptions (a fit whose profile is not its base rewrites those)."""

    name: str  # short name (mok-sim validate --fused-fit)
    profile: str  # the profile it writes (name under sim/profiles)
    base: str  # the profile a refit starts from by default
    num_ranks: int
    sms: dict[tuple[str, str], tuple[str, ...] | None]
    sources: tuple[str, ...] | None
    subset: str  # the subset in words (the fitted profile's fit_subset)
    skews: tuple[str, ...] = ("uniform",)
    fixed: dict[str, str] = field(default_factory=dict)
    # written into the assumptions of the profile it fits, where that is not its base
    notes: tuple[str, ...] = ()

    def matches(self, row: dict, sources: Iterable[str] | None = None) -> bool:
        """Whether ``row`` is a fit row: by content, and by source (``sources``, else
        :attr:`sources`; a row without ``_source`` counts by content alone)."""
        key = (row.get("model"), row.get("mode"))
        if key not in self.sms or row.get("impl") != "mok-fused":
            return False
        sms = self.sms[key]
        srcs = tuple(sources) if sources is not None else self.sources
        return (
            row.get("skew") in self.skews
            and int(row.get("num_ranks") or 2) == self.num_ranks
            and (sms is None or str(row.get("sms")) in sms)
            and (srcs is None or "_source" not in row or row["_source"] in srcs)
            and row_tile_of(row) == DEFAULT_ROW_TILE
        )


# One GPU (num_ranks 1): the per-rank work of EP2 emulated (mok.bench layer --emulate-ep 2:
# the model's experts / 2, all local; the dispatch is local copying, no NVLink). Fit: uniform
# DeepSeek-V3 and Qwen3-30B-A3B (the two tile shapes: few long tiles, many short ones) at every
# comm-SM count; held out: Kimi-K2 (a third shape, 50 % padding rows), hot:0.5, aligned (no
# padding at DeepSeek-V3 and Qwen3). NOTE: chosen after the rows of h200x1-layer-2026-12-01.csv
# had been looked at (with the EP2 profile's predictions): a holdout by shape and skew, not a
# blind one.
_EP1_MODES = ("dedup_pull", "pull")
FUSED_FIT_EP1_SUBSET = (
    "mok-fused rows of one GPU (num_ranks 1; the per-rank work of EP2 emulated, emulated_ep 2: "
    "the model's experts / 2, all local) with uniform routing and row tile 128 "
    "(sim.measured.is_fused_fit_row, fit ep1): deepseek-v3 and qwen3-30b-a3b, pull or "
    "dedup_pull (both copy locally at EP1), every comm-SM count. Validation: kimi-k2, hot:0.5, "
    "aligned, row tile 64, and every row of CSVs the fit did not read. Chosen after the rows "
    "had been looked at: a holdout by shape and skew, not a blind one."
)

# profile name -> its fit; the first is the default (profiles that do not name their fit)
FUSED_FITS = {
    "mok-fused-h200x2": FusedFit(
        name="ep2",
        profile="mok-fused-h200x2",
        base="mok-fused-h200x2",
        num_ranks=2,
        sms=FUSED_FIT_SMS,
        sources=FUSED_FIT_SOURCES,
        subset=FUSED_FIT_SUBSET,
    ),
    "mok-fused-h200x1": FusedFit(
        name="ep1",
        profile="mok-fused-h200x1",
        base="mok-fused-h200x2",
        num_ranks=1,
        sms={(m, d): None for m in ("deepseek-v3", "qwen3-30b-a3b") for d in _EP1_MODES},
        sources=None,
        subset=FUSED_FIT_EP1_SUBSET,
        fixed={
            "remote_rate_factor": "no remote rows at EP1 (every expert is local): the rows "
            "cannot tell it",
        },
        notes=(
            "rows: one H200, the per-rank work of EP2 (mok.bench layer --emulate-ep 2), "
            "predicted as what ran (sim.fused.model.fused_row): one rank with the row's "
            "num_experts experts (the model's / 2), all local, routing make_routing(tokens, "
            "num_experts, top-k, 1 rank, skew, routing_seed); the dispatch copies local rows "
            "only and every flag (staged x, slots filled) is local",
        ),
    ),
}
DEFAULT_FUSED_FIT = "ep2"


def fused_fit(name: str | None = None) -> FusedFit:
    """The fit of :data:`FUSED_FITS` by short name (``ep2``, ``ep1``) or by the name of the
    profile it writes; None: :data:`DEFAULT_FUSED_FIT`. ValueError naming them otherwise."""
    name = DEFAULT_FUSED_FIT if name is None else name
    for f in FUSED_FITS.values():
        if name in (f.name, f.profile):
            return f
    names = ", ".join(f"{f.name} ({f.profile})" for f in FUSED_FITS.values())
    raise ValueError(f"unknown fused fit {name!r}; the fits: {names}")


def is_fused_fit_row(
    row: dict, fit: FusedFit | str | None = None, sources: Iterable[str] | None = None
) -> bool:
    """Whether a measured layer row belongs to the fit subset of ``fit`` (a :class:`FusedFit`
    or its name; None: the two-GPU fit, :data:`FUSED_FIT_SUBSET`; row tile 128 only). A row
    without a source (``_source``, set by :func:`read_rows`) counts by content. ``sources``: the
    CSV names the fit rows may come from, instead of the fit's own (a fitted profile's
    ``fit["sources"]``)."""
    if not isinstance(fit, FusedFit):
        fit = fused_fit(fit)
    return fit.matches(row, sources)
