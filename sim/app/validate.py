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

Train CSVs (``mok.bench train``: ``fwd_us``, ``bwd_us``, ``step_us`` per training step on one
GPU; :func:`sim.measured.is_train_csv`) go through :func:`validate_train_rows`: three records per
row (``what`` = ``fwd`` / ``bwd`` / ``step``), the mok rows predicted by the layer model as one
rank with the row's experts (:func:`train_model_config`; the forward and the backward simulated
apart, the step their sum), :func:`summarise_train` and :func:`format_train_report` for the
errors per quantity and the ranking. The model's backward is mok's backward as it runs at one
rank (the serial backward of :mod:`sim.layer.backward`: its pieces one after another on every
SM), or with ``design=True`` the simulator's fused-backward design, which is not what mok runs
(:func:`train_model_notes`); the torch-best rows and the mok-unfused forward are baselines
(:data:`TRAIN_UNMODELLED`).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Sequence
from functools import lru_cache

import numpy as np

from mok.spec.config import MoKConfig
from mok.spec.rows import row_routing_seed
from mok.spec.workload import get_shape, make_routing
from sim.comm.model import predict_row
from sim.comm.profile import KernelProfile
from sim.config import SimConfig, Workload
from sim.fused.fit import is_profile_fit_row
from sim.fused.model import fused_row, row_num_experts
from sim.fused.profile import FusedProfile
from sim.layer.backward import backward_config
from sim.layer.plan import RoutingPlan
from sim.measured import gpu_profile_of, is_fit_row, row_tile_of

__all__ = [
    "rerun_spearman",
    "validate_rows",
    "summarise",
    "applicable_targets",
    "missed_targets",
    "spearman",
    "chosen_gap",
    "format_report",
    "validate_layer_rows",
    "validate_train_rows",
    "train_model_config",
    "train_model_notes",
    "row_topology",
    "ROW_TOPOLOGIES",
    "train_piece_flops",
    "summarise_train",
    "format_train_report",
    "TRAIN_QUANTITIES",
    "TRAIN_MODEL_NOTES",
    "TRAIN_UNMODELLED",
    "TRAIN_GATHER_MAX_INTER",
    "MOK_SWIGLU_BWD_BYTES",
    "BASELINES",
    "GROUP_KEYS",
    "CONFIG_KEYS",
    "TARGETS",
    # shared with sim.app.validate_experts
    "validation_record",
    "abs_stats",
    "pct",
    "bench_ring",
    "train_plan",
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


def validation_record(i: int, row: dict, **over) -> dict:
    """One record of a validation report for CSV row ``i`` (its group and config keys, the
    measured times; nothing predicted yet), with the fields of ``over`` set."""
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
        rec = validation_record(i, row)
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
        rec = validation_record(
            i, row, what="layer", scope="", engine="-", row_tile=str(row_tile_of(row))
        )
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
    cfg = SimConfig(
        dispatch_mode=row["mode"],
        combine_mode="push",
        num_comm_sms=int(row["sms"]),
        minibatch_size=mb,
        macrobatch_size=bench_ring(
            wl.tokens_per_rank, shape.num_topk, shape.num_experts // wl.ep, rt, mb
        ),
        row_tile=rt,
        gemm_profile=gemm_profile,
    )
    return wl, cfg


def bench_ring(tokens: int, topk: int, local_experts: int, row_tile: int, minibatch: int) -> int:
    """The receive ring of a ``mok.bench`` run in whole minibatches: the whole receive buffer
    (``capacity_factor`` 2: ``2 x tokens x top-k`` rows plus each local expert's padding, in
    row tiles)."""
    rows = _BENCH_CAPACITY_FACTOR * tokens * topk + local_experts * (row_tile - 1)
    return -(-(-(-rows // row_tile) * row_tile) // minibatch) * minibatch


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


# -- train CSVs (mok.bench train) ---------------------------------------------------------------
# the quantities of a train row, each one record (``what``): the measured column is f"{q}_us"
TRAIN_QUANTITIES = ("fwd", "bwd", "step")
# the train rows the layer model predicts
TRAIN_MOK_IMPLS = ("mok-unfused", "mok-saved", "mok-fused", "mok-fused-saved")
# the train rows whose backward reads the forward's saved gate / up (no recompute)
TRAIN_SAVED_IMPLS = ("mok-saved", "mok-fused-saved")
# the train rows whose forward is the fused kernel (the layer model's overlapped layer)
TRAIN_FUSED_IMPLS = ("mok-fused", "mok-fused-saved")
# the comm SMs of the simulated backward: the rows' config's num_comm_sms_bwd (mok.bench train
# leaves it at MoKConfig's default; mok's backward today does not read it, its kernels run one
# after another on all SMs); minibatch and row tile: MoKConfig's, as the train rows ran them
TRAIN_BWD_COMM_SMS = MoKConfig().num_comm_sms_bwd
TRAIN_MINIBATCH = MoKConfig().minibatch_size
TRAIN_ROW_TILE = MoKConfig().row_tile
# mok's backward at one rank reads its dY and x rows from the tokens in its GEMMs (no row copies)
# where the experts' intermediate size is at most this: mok.autograd.GATHER_BACKWARD "auto" and
# GATHER_BACKWARD_MAX_INTER, since git 1fcfabc (before it every backward copied its rows)
TRAIN_GATHER_MAX_INTER = 256
# HBM bytes per intermediate element of mok's SwiGLU-backward epilogue (csrc/layer/sm90_bwd.cuh),
# by recompute: h w, dg and du written in bf16 (6) after the recomputed gate / up; from saved
# g / u the fp32 g and u read too (+8). The layer model's default
# (SimConfig.swiglu_bwd_bytes_per_elem, 8) is a bf16-saving design's.
MOK_SWIGLU_BWD_BYTES = {True: 6.0, False: 14.0}
# the topology whose first GPU runs a one-GPU row (train, experts), by the GPU profile of the
# device it ran on (its `gpu` column, sim.measured.gpu_profile_of); any other GPU, or a CSV
# without the column: h200x2 (one rank of a multi-GPU topology: at EP1 its links carry no rows)
ROW_TOPOLOGIES = {"h200": "h200x2", "h100": "hgx-h100"}
# why a quantity of a train row is not predicted
TRAIN_UNMODELLED = {
    "torch-best": "torch-best: one GPU, torch parts only under autograd (argsort, gathers, "
    "torch._grouped_mm experts and their autograd backward, bmm k-sum), eager or compiled: "
    "torch's kernels are not modelled",
    "mok-unfused": "mok-unfused forward (and so its step): mok's comm kernels and torch's "
    "grouped GEMMs one after another, each on all SMs; the layer model overlaps them on a split "
    "of comm and compute SMs (its backward is predicted: the same backward as the fused rows')",
    "mok-saved": "mok-saved forward (and so its step): mok-unfused's forward with the routed "
    "experts in mok's saving kernel (fp32 gate / up kept), one piece after another on all SMs "
    "(its backward is predicted: the backward without the routed recompute)",
}
# what the layer model represents of a train row, and what not (the report's header, the docs):
# the row, the forward, then the backward (train_model_notes: the serial one, or the design's)
_TRAIN_NOTES = (
    "one GPU as EP1, the one the row ran on (its gpu column: an H100 hgx-h100's first GPU, h100 "
    "profile; else h200x2's first, h200 profile), with the row's num_experts experts all "
    "local (the per-rank work of EP2: the model's / 2), routing make_routing(tokens, "
    "num_experts, top-k, 1 rank, skew, routing_seed); the forward and the backward simulated "
    "apart, step = their sum",
    "forward (mok-fused and mok-fused-saved rows): the layer model's overlapped layer, as the "
    f"fused kernel runs it: the row's comm SMs and mode, minibatch {TRAIN_MINIBATCH}, row tile "
    f"{TRAIN_ROW_TILE}, the whole receive buffer (mok-fused-saved's fp32 gate / up stores are "
    "not modelled)",
)
_TRAIN_SERIAL_NOTE = (
    "backward (every mok row): mok's backward as it runs at one rank, the serial backward of "
    "sim.layer.backward: one piece after another, each on every SM (the schedule; the dY and x "
    "row copies, none where the intermediate size is at most "
    f"{TRAIN_GATHER_MAX_INTER}, whose GEMMs read the rows from the tokens; each GEMM as its own "
    "launch over all the rows: the gate / up recompute except on the saving rows, mok-saved and "
    "mok-fused-saved, the down dgrad with mok's SwiGLU-backward epilogue bytes "
    f"({MOK_SWIGLU_BWD_BYTES[True]:g} per intermediate element, {MOK_SWIGLU_BWD_BYTES[False]:g} "
    "from saved g / u), the gate / up dgrad, the two weight gradients (depth: each expert's rows "
    "rounded up to 16, to the row tile on mok-fused-saved rows, whose regions are padded to it), "
    "the shared expert; the one-pass combine), every GEMM at the forward's rates. Not modelled: "
    "the padding rows' zero-fill, the router-weight gradient's staging and the small torch ops "
    "between the pieces"
)
_TRAIN_DESIGN_NOTE = (
    "backward (every mok row; --design-backward): the simulator's fused-backward design "
    "(sim.layer.backward), NOT what mok runs today: pull reverse combine and push reverse "
    "dispatch on "
    f"{TRAIN_BWD_COMM_SMS} comm SMs (MoKConfig.num_comm_sms_bwd) overlapping per-round dgrads "
    "(gate/up recomputed, except on the saving rows, mok-saved and mok-fused-saved; down "
    "dgrad with the SwiGLU backward; gate/up dgrad) and the weight gradients on the other SMs"
    " (depth: each expert's rows rounded up to 16, to the row tile on mok-fused-saved rows, "
    "whose regions are padded to it), every GEMM at the forward's rates. mok's backward "
    "(docs/backward.md) runs one piece after another on all SMs: the schedule again, two "
    "dispatches, the experts' backward kernel (down dgrad, with the gate/up recompute where "
    "not saved), mok's gate/up dgrad and weight-gradient GEMMs (one launch from saved g/u), "
    "the shared expert, a combine; each at its own measured rate, which no profile of the "
    "model holds. A backward error is the distance between that design at those rates and "
    "today's code"
)


def train_model_notes(design: bool = False) -> tuple[str, ...]:
    """What the layer model represents of a train row, and what not (the report's header): the
    row, the forward, and the backward (mok's serial one, or with ``design`` the fused
    design's)."""
    return (*_TRAIN_NOTES, _TRAIN_DESIGN_NOTE if design else _TRAIN_SERIAL_NOTE)


TRAIN_MODEL_NOTES = train_model_notes()


@lru_cache(maxsize=32)
def train_plan(
    model: str, tokens: int, skew: str, experts: int, seed: int, row_tile: int
) -> RoutingPlan:
    """The routing of a one-GPU train row as the benchmark drew it: ``experts`` experts, one
    rank."""
    shape = get_shape(model)
    return RoutingPlan(make_routing(tokens, experts, shape.num_topk, 1, skew, seed), row_tile)


def row_topology(row: dict) -> str:
    """The topology of the layer model's one rank for a one-GPU bench row (train, experts): by
    the GPU it ran on (its ``gpu`` column), :data:`ROW_TOPOLOGIES`; h200x2 for another GPU or
    a CSV without the column."""
    return ROW_TOPOLOGIES.get(gpu_profile_of(row.get("gpu")) or "", "h200x2")


def train_model_config(
    row: dict, gemm_profile: str | None = None, design: bool = False, gather: bool | None = None
) -> tuple[Workload, RoutingPlan, SimConfig | None, SimConfig]:
    """(workload, routing plan, forward config, backward config) of the layer model for a mok
    row of a ``mok.bench train`` CSV (:func:`train_model_notes`): one rank of
    :func:`row_topology` (the GPU the row ran on) with the row's experts (its ``num_experts``:
    the model's / ``emulated_ep``), all local, on the routing the benchmark drew
    (:func:`mok.spec.rows.row_routing_seed`); the forward config
    None for a ``mok-unfused`` or ``mok-saved`` row (:data:`TRAIN_UNMODELLED`); the backward
    with ``recompute`` (mok's backward saves only its inputs and computes the gate / up GEMMs
    again; not for a ``mok-saved`` row, :data:`TRAIN_SAVED_IMPLS`), whatever the forward ran:
    the serial backward (``serial_backward``: mok's at one rank, its rows read from the tokens
    where the intermediate size is at most :data:`TRAIN_GATHER_MAX_INTER`, mok's epilogue bytes
    :data:`MOK_SWIGLU_BWD_BYTES`; ``gather`` True / False: read from the tokens, or copied,
    whatever the size, as a run that forced ``mok.autograd.GATHER_BACKWARD`` did), or with
    ``design`` the fused design on :data:`TRAIN_BWD_COMM_SMS` comm SMs. ``gemm_profile``: both
    passes' GEMM rates (:attr:`sim.config.SimConfig.gemm_profile`). ValueError for a row of
    more than one GPU, an unknown impl or a workload the simulator rejects."""
    impl = row.get("impl", "")
    if impl not in TRAIN_MOK_IMPLS:
        raise ValueError(f"{impl!r} is not a mok row of a train CSV ({', '.join(TRAIN_MOK_IMPLS)})")
    ranks = int(row.get("num_ranks") or 1)
    if ranks != 1:
        raise ValueError(f"mok.bench train runs on one GPU (this row ran {ranks})")
    model, tokens, skew = row["model"], int(row["tokens_per_rank"]), row["skew"]
    seed = row_routing_seed(row)
    shape = get_shape(model)
    experts = row_num_experts(row) or shape.num_experts
    if experts < shape.num_topk:
        raise ValueError(f"{model}: num_experts={experts} is below its top-{shape.num_topk}")
    wl = Workload(model, tokens, 1, row_topology(row), skew, seed)
    rt, mb = TRAIN_ROW_TILE, TRAIN_MINIBATCH
    plan = train_plan(model, tokens, skew, experts, seed, rt)
    base = SimConfig(
        dispatch_mode=row["mode"],
        combine_mode="push",
        num_comm_sms=TRAIN_BWD_COMM_SMS,
        minibatch_size=mb,
        macrobatch_size=bench_ring(tokens, shape.num_topk, experts, rt, mb),
        row_tile=rt,
        gemm_profile=gemm_profile,
    )
    fused = impl in TRAIN_FUSED_IMPLS
    fwd = base.replace(num_comm_sms=int(row["sms"])) if fused else None
    recompute = impl not in TRAIN_SAVED_IMPLS
    bwd = backward_config(base, recompute=recompute)
    if not design:
        bwd = bwd.replace(
            serial_backward=True,
            gather_backward=(
                shape.intermediate <= TRAIN_GATHER_MAX_INTER if gather is None else gather
            ),
            swiglu_bwd_bytes_per_elem=MOK_SWIGLU_BWD_BYTES[recompute],
        )
    if fused and impl in TRAIN_SAVED_IMPLS:
        # its backward runs over the fused forward's rows, regions padded to the row tile, and
        # its weight gradients step over that padding (the others' regions are padded to 16)
        bwd = bwd.replace(wgrad_depth_step=rt)
    return wl, plan, fwd, bwd


def _train_record(i: int, row: dict, q: str, **over) -> dict:
    """The record of quantity ``q`` of train row ``i`` (its p20 / p80: the step's only)."""
    step = q == "step"
    meas = {
        "median_us": row[f"{q}_us"],
        "p20_us": row.get("p20_us") if step else "",
        "p80_us": row.get("p80_us") if step else "",
    }
    return validation_record(i, {**row, **meas}, what=q, scope="", engine="-", **over)


def validate_train_rows(
    rows: Iterable[dict], gemm_profile: str | None = None, design: bool = False
) -> list[dict]:
    """Three flat records per row of a ``mok.bench train`` CSV (``what`` = ``fwd`` / ``bwd`` /
    ``step``, measured ``fwd_us`` / ``bwd_us`` / ``step_us``), as :func:`validate_rows`: the
    mok rows predicted by the layer model under :func:`train_model_config` (forward and backward
    simulated apart, step their sum; ``design``: the backward by the fused design instead of
    mok's serial one; the model's breakdown terms as ``*_us`` columns, the
    backward's weight-gradient time as ``wgrad_us``; ``sim_sms`` the comm SMs it ran), every
    predicted record role ``validation`` (nothing is fitted on train rows); torch-best and the
    mok-unfused forward / step status ``baseline`` (:data:`TRAIN_UNMODELLED`), a row the
    simulator rejects ``unsupported`` with the reason."""
    from sim.layer.model import BackwardBuilder, simulate

    cache: dict[tuple, object] = {}

    def run(wl: Workload, plan: RoutingPlan, cfg: SimConfig):
        key = (wl, plan.trace.num_experts, cfg)
        if key not in cache:
            cache[key] = simulate(wl, cfg, plan)
        return cache[key]

    def pieces(wl: Workload, plan: RoutingPlan, cfg: SimConfig) -> dict[str, float]:
        key = ("pieces", wl, plan.trace.num_experts, cfg)
        if key not in cache:
            us = BackwardBuilder(wl, cfg, plan).piece_us(0)
            cache[key] = {f"piece_{k}_us": v for k, v in us.items()}
        return cache[key]

    out = []
    for i, row in enumerate(rows):
        recs = {q: _train_record(i, row, q) for q in TRAIN_QUANTITIES}
        impl = row.get("impl", "")
        if impl not in TRAIN_MOK_IMPLS:
            why = TRAIN_UNMODELLED.get(impl, f"{impl}: not a mok row")
            for r in recs.values():
                r.update(status="baseline", reason=why)
            out += recs.values()
            continue
        try:
            wl, plan, fcfg, bcfg = train_model_config(row, gemm_profile, design)
            bwd = run(wl, plan, bcfg)
            fwd = None if fcfg is None else run(wl, plan, fcfg)
        except ValueError as e:
            for r in recs.values():
                r.update(status="unsupported", reason=str(e))
            out += recs.values()
            continue
        parts = {"bwd": [bwd]} | ({} if fwd is None else {"fwd": [fwd], "step": [fwd, bwd]})
        for q, r in recs.items():
            if q not in parts:
                r.update(status="baseline", reason=TRAIN_UNMODELLED[impl])
                continue
            res = parts[q]
            us = sum(x.layer_us for x in res)
            terms = {k: sum(x.breakdown[k] for x in res) for k in res[0].breakdown}
            sms = "+".join(
                "serial" if x.config.serial_backward else str(x.config.num_comm_sms) for x in res
            )
            r.update(
                predicted_us=us, device_us=us, err=us / r["measured_us"] - 1, role="validation"
            )
            r.update(kernel=f"layer.{q}", sim_sms=sms, wgrad_us=bwd.wgrad_us if q != "fwd" else 0.0)
            r.update(terms)
        recs["bwd"].update(pieces(wl, plan, bcfg))
        out += recs.values()
    return out


def train_piece_flops(row: dict) -> dict[str, float]:
    """GEMM FLOPs of the real rows (no padding) of each backward piece of
    :meth:`sim.layer.backward.BackwardPass.piece_us` for a one-GPU train row, recompute
    included (``piece_<name>_us`` of :func:`validate_train_rows`; FLOPs / time = the rate the
    model gives that piece, comparable with the per-piece rates docs/backward.md measures)."""
    shape = get_shape(row["model"])
    tokens = int(row["tokens_per_rank"])
    h, i, si = shape.hidden, shape.intermediate, shape.shared_intermediate
    rows = tokens * shape.num_topk  # one GPU: every (token, k) row is local
    out = {"recompute": 4 * h * i * rows, "down_dgrad": 2 * h * i * rows}
    out.update(gate_up_dgrad=4 * h * i * rows, dw_down=2 * h * i * rows)
    out.update(dw_gate_up=4 * h * i * rows, shared=16 * h * si * tokens)
    return {k: float(v) for k, v in out.items()}


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


def abs_stats(errs: list[float]) -> dict:
    """n, median and max of the |errors| that are not NaN (NaN where there are none)."""
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
                **abs_stats([r["err"] for r in rows]),
                "validation": abs_stats([r["err"] for r in rows if r["role"] == "validation"]),
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
        "all": abs_stats([r["err"] for r in ok]),
        "validation": abs_stats([r["err"] for r in ok if r["role"] == "validation"]),
        "fit": abs_stats([r["err"] for r in ok if r["role"] == "fit"]),
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


def applicable_targets(summary: dict) -> list[str]:
    """The targets of a :func:`summarise` or :func:`summarise_train` summary that apply (a
    target without validation rows or ranked groups reads ``n/a`` in the report), named as the
    report names them (``max_abs_err``; a train summary's ``fwd max_abs_err``)."""
    t = summary["targets"]
    if all(isinstance(v, dict) for v in t.values()):  # per train quantity, None: no rows
        return [f"{q} {k}" for q, ks in t.items() for k, v in ks.items() if v is not None]
    v, vg = summary["validation"], summary["ranking"]["validation groups"]
    na = {"median_abs_err": v["n"] == 0, "max_abs_err": v["n"] == 0}
    na.update(spearman=math.isnan(vg["spearman_min"]), gap=math.isnan(vg["gap_max"]))
    return [k for k in t if not na.get(k, False)]


def missed_targets(summary: dict) -> list[str]:
    """The :func:`applicable_targets` of ``summary`` that it misses."""
    t = summary["targets"]
    nested = all(isinstance(v, dict) for v in t.values())
    return [
        name
        for name in applicable_targets(summary)
        if not (t[name.split()[0]][name.split()[1]] if nested else t[name])
    ]


# -- report -----------------------------------------------------------------------------------
def pct(x: float, digits: int = 1) -> str:
    """``x`` as a percentage for the reports (``n/a`` for NaN)."""
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
            f"{pct(g['median_abs_err']):>10}{pct(g['max_abs_err']):>10}"
            f"{_rho(g['spearman']):>9}{pct(g['gap']):>8}{pct(g['spread']):>8}"
            f"{pct(g['p2080_median']):>8}{pct(g['band_overlap'], 0):>7}  {g['chosen']}"
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
        x = abs_stats([r["err"] for r in rs])
        lines.append(
            f"  {name:<22}{x['n']:>5}{pct(x['median_abs_err']):>13}{pct(x['max_abs_err']):>10}"
        )
    lines += ["", f"  {'ranking':<22}{'groups':>7}{'spearman min':>14}{'mean':>8}{'gap max':>9}"]
    for name, x in s["ranking"].items():
        lines.append(
            f"  {name:<22}{x['groups']:>7}{_rho(x['spearman_min']):>14}"
            f"{_rho(x['spearman_mean']):>8}{pct(x['gap_max']):>9}"
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


# -- train report -------------------------------------------------------------------------------
_TRAIN_PIECES = (
    ("recompute", "recompute"),
    ("down_dgrad", "down dgrad"),
    ("gate_up_dgrad", "gate/up dgrad"),
    ("dw_down", "dW_down"),
    ("dw_gate_up", "dW_gate/up"),
    ("shared", "shared"),
)


def summarise_train(records: Sequence[dict]) -> dict:
    """Summary dict of :func:`validate_train_rows` records: per quantity (``fwd`` / ``bwd`` /
    ``step``) the |err| stats over its predicted records, overall and per impl; per (model,
    tokens, skew) group and quantity the ranking of its predicted configurations (Spearman with
    >= 3 of them, the chosen-vs-best gap), ranked only where the predictions differ; the
    targets (:data:`TARGETS`' |err| ones) per quantity."""
    ok = [r for r in records if r["status"] == "ok"]
    quantities, by_impl, targets = {}, {}, {}
    for q in TRAIN_QUANTITIES:
        rs = [r for r in ok if r["what"] == q]
        quantities[q] = abs_stats([r["err"] for r in rs])
        by_impl[q] = {
            impl: abs_stats([r["err"] for r in rs if r["impl"] == impl])
            for impl in dict.fromkeys(r["impl"] for r in rs)
        }
        x = quantities[q]
        targets[q] = {
            k: (None if x["n"] == 0 else x[k] <= TARGETS[k])
            for k in ("median_abs_err", "max_abs_err")
        }
    groups = []
    keys = dict.fromkeys((r["model"], r["tokens_per_rank"], r["skew"], r["what"]) for r in ok)
    for model, tokens, skew, q in keys:
        rs = [
            r
            for r in ok
            if (r["model"], r["tokens_per_rank"], r["skew"], r["what"]) == (model, tokens, skew, q)
        ]
        labels = [_config_label(r) for r in rs]
        meas = [r["measured_us"] for r in rs]
        pred = [r["predicted_us"] for r in rs]
        g = {"model": model, "tokens_per_rank": tokens, "skew": skew, "what": q}
        g.update(configs=len(rs), spread=max(meas) / min(meas) - 1, ranked=len(set(pred)) > 1)
        g.update(**abs_stats([r["err"] for r in rs]), spearman=math.nan, gap=math.nan)
        g.update(chosen="", best=labels[int(np.argmin(meas))])
        if g["ranked"]:
            c, _, gap = chosen_gap(pred, meas)
            g.update(chosen=labels[c], gap=gap)
            g["spearman"] = spearman(pred, meas) if len(rs) >= 3 else math.nan
        groups.append(g)
    ranking = {}
    for q in TRAIN_QUANTITIES:
        gs = [g for g in groups if g["what"] == q and g["ranked"]]
        rhos = [g["spearman"] for g in gs if not math.isnan(g["spearman"])]
        ranking[q] = {
            "groups": len(gs),
            "unranked": sum(1 for g in groups if g["what"] == q and not g["ranked"]),
            "chosen_is_best": sum(g["chosen"] == g["best"] for g in gs),
            "spearman_min": min(rhos) if rhos else math.nan,
            "gap_max": max((g["gap"] for g in gs), default=math.nan),
        }
    by_status: dict[str, int] = {}
    for r in records:
        by_status[r["status"]] = by_status.get(r["status"], 0) + 1
    return {
        "rows": len({r["row"] for r in records}),
        "by_status": by_status,
        "quantities": quantities,
        "by_impl": by_impl,
        "groups": groups,
        "ranking": ranking,
        "targets": targets,
        "unsupported": sorted({r["reason"] for r in records if r["status"] == "unsupported"}),
        "baselines": sorted({r["reason"] for r in records if r["status"] == "baseline"}),
    }


def _cell(r: dict | None) -> str:
    """measured, predicted, err of one record, 26 characters."""
    if r is None:
        return f"{'':>26}"
    if r["status"] != "ok":
        return f"{r['measured_us']:>10.1f}{'-':>9}{'-':>7}"
    return f"{r['measured_us']:>10.1f}{r['predicted_us']:>9.1f}{100 * r['err']:>6.1f}%"


def _pieces_line(rec: dict) -> str:
    """The model's backward pieces of a bwd record: busy ms on the compute SMs and the real
    rows' TFLOP/s."""
    flops = train_piece_flops(rec)
    parts = []
    for key, name in _TRAIN_PIECES:
        us = rec.get(f"piece_{key}_us")
        if us is None or us <= 0:
            continue
        parts.append(f"{name} {us / 1e3:.2f} ({flops[key] / (us * 1e6):.0f})")
    return "model's backward, ms (TFLOP/s of the real rows): " + ", ".join(parts)


def format_train_report(records: Sequence[dict], summary: dict) -> str:
    """Every row (fwd / bwd / step: measured, predicted, error) under its (model, skew) group
    with the model's backward pieces, the |err| per quantity (overall and per impl), the
    ranking per quantity, the baselines (torch-best: measured, with the measured and predicted
    speedup of the group's fastest predicted mok row) and the targets."""
    s = summary
    by_row: dict[int, dict[str, dict]] = {}
    for r in records:
        by_row.setdefault(r["row"], {})[r["what"]] = r
    head = "".join(f"{q + ' meas':>10}{'pred':>9}{'err':>7}" for q in TRAIN_QUANTITIES)
    lines = [
        "per row (us; err = predicted / measured - 1; '-': not predicted; sim: the comm SMs "
        "the model ran, forward + backward, 'serial' for mok's serial backward on every SM)",
        f"  {'model':<14}{'skew':<9}{'config':<27}{head}  sim",
    ]
    groups = dict.fromkeys((r["model"], r["tokens_per_rank"], r["skew"]) for r in records)
    for gk in groups:
        rows = [
            q
            for q in by_row.values()
            if (q["fwd"]["model"], q["fwd"]["tokens_per_rank"], q["fwd"]["skew"]) == gk
        ]
        for q in rows:
            first = q["fwd"]
            sims = [q[x].get("sim_sms", "") for x in TRAIN_QUANTITIES if q[x]["status"] == "ok"]
            lines.append(
                f"  {first['model']:<14}{first['skew']:<9}{_config_label(first):<27}"
                + "".join(_cell(q.get(x)) for x in TRAIN_QUANTITIES)
                + f"  {max(sims, key=len, default='')}"
            )
        bwd = next((q["bwd"] for q in rows if q["bwd"]["status"] == "ok"), None)
        if bwd is not None:
            lines.append(f"    {_pieces_line(bwd)}")
    lines += ["", "overall (|err| over the predicted rows)"]
    lines.append(f"  {'quantity':<10}{'n':>4}{'median|err|':>13}{'max|err|':>10}   per impl")
    for q in TRAIN_QUANTITIES:
        x = s["quantities"][q]
        per = ", ".join(
            f"{impl} {y['n']}: {pct(y['median_abs_err']).strip()} / {pct(y['max_abs_err']).strip()}"
            for impl, y in s["by_impl"][q].items()
        )
        med, top = pct(x["median_abs_err"]), pct(x["max_abs_err"])
        lines.append(f"  {q:<10}{x['n']:>4}{med:>13}{top:>10}   {per}")
    lines += ["", "ranking (per group, its predicted configurations; chosen = smallest prediction)"]
    for q in TRAIN_QUANTITIES:
        x = s["ranking"][q]
        gs = [g for g in s["groups"] if g["what"] == q]
        if not x["groups"]:
            spread = max((g["spread"] for g in gs), default=math.nan)
            lines.append(
                f"  {q}: not ranked ({x['unranked']} groups): one prediction for every "
                f"configuration of a group; measured spread of a group's configurations up to "
                f"{pct(spread).strip()}"
            )
            continue
        lines.append(
            f"  {q}: {x['groups']} groups, chosen = best in {x['chosen_is_best']}, gap max "
            f"{pct(x['gap_max']).strip()}, spearman min {_rho(x['spearman_min']).strip()}"
        )
        for g in gs:
            if not g["ranked"]:
                continue
            lines.append(
                f"    {g['model']:<14}{g['skew']:<9}chosen {g['chosen']:<26}best {g['best']:<26}"
                f"gap {pct(g['gap']).strip():>6}  measured spread {pct(g['spread']).strip()}"
            )
    lines += _train_baseline_lines(records)
    lines.append(f"  rows: {s['rows']}, records by status: {s['by_status']}")
    for reason in s["unsupported"]:
        lines.append(f"  unsupported: {reason}")
    t = s["targets"]
    lines.append(
        "  targets (|err| median <= 5%, max <= 15%, as the other validations): "
        + "; ".join(
            f"{q} "
            + ", ".join(
                f"{k.split('_')[0]} {'n/a' if v is None else 'met' if v else 'MISSED'}"
                for k, v in t[q].items()
            )
            for q in TRAIN_QUANTITIES
        )
    )
    return "\n".join(lines)


def _train_baseline_lines(records: Sequence[dict]) -> list[str]:
    """The torch-best rows of a train CSV (measured only), each with the measured and the
    predicted speedup (baseline step / mok step) of its group's fastest measured mok row with a
    predicted step, and the reasons of every baseline."""
    base = [r for r in records if r["status"] == "baseline" and r["what"] == "step"]
    if not base:
        return []
    lines = ["", "baselines (measured, not predicted; speedup = baseline step / mok step):"]
    fwd_bwd = {(r["row"], r["what"]): r["measured_us"] for r in records}
    for r in base:
        if r["impl"] in TRAIN_MOK_IMPLS:
            continue
        gk = (r["model"], r["tokens_per_rank"], r["skew"], r["source"])
        mok = [
            m
            for m in records
            if m["what"] == "step"
            and m["status"] == "ok"
            and (m["model"], m["tokens_per_rank"], m["skew"], m["source"]) == gk
        ]
        text = (
            f"  {r['model']:<14}{r['skew']:<9}{r['impl'] + ':' + r['mode']:<20} fwd "
            f"{fwd_bwd[(r['row'], 'fwd')]:>7.0f} + bwd {fwd_bwd[(r['row'], 'bwd')]:>7.0f} = "
            f"{r['measured_us']:>7.0f} us"
        )
        if mok:
            m = min(mok, key=lambda x: x["measured_us"])
            text += (
                f"   {_config_label(m)}: measured {r['measured_us'] / m['measured_us']:.2f}x, "
                f"predicted {r['measured_us'] / m['predicted_us']:.2f}x"
            )
        lines.append(text)
    for reason in sorted({r["reason"] for r in records if r["status"] == "baseline"}):
        lines.append(f"  {reason}")
    return lines
