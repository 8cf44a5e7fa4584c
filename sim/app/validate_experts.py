"""``mok-sim validate`` of an experts CSV (``python -m mok.bench experts``): the layer model's
backward GEMMs piece by piece, each alone, against the same pieces timed alone on the GPU.

The bench times each routed-expert GEMM of a training step on its own (mok's kernel and torch's
grouped GEMM on the same operands, every SM). The layer model has the same pieces in its
backward (:meth:`sim.layer.backward.BackwardPass.piece_us`: the compute SMs' busy time of each
GEMM, its fill included): ``dW_gate_up`` / ``dW_down`` are its weight gradients,
``gate_up_dgrad`` its gate / up dgrad, ``bwd_from_saved`` its down dgrad with the SwiGLU
backward, ``bwd_recompute`` that plus the recomputed gate / up GEMM, ``bwd_saved_all`` (the
whole backward from saved g / u, fused in one launch or not) the down dgrad, the gate / up dgrad
and both weight gradients one after the other. Each row is predicted on
the routing the bench drew (its ``routing_seed``, its ``num_experts``) with the expert regions
padded to the kernels' 128-row tile, one round (the whole receive buffer), at the GPU profile's
GEMM rates or a fused profile's (``--gemm-profile``). So an error here is the GEMM model's own,
per shape and per implementation, without the schedule, the transfers and the serial pieces
that the train CSV's backward adds (``validate_train_rows``). ``fwd_saving`` rows (a forward
piece) are listed as baselines.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from mok.spec.config import MoKConfig
from mok.spec.rows import row_routing_seed
from mok.spec.workload import get_shape
from sim.app.validate import (
    MOK_SWIGLU_BWD_BYTES,
    abs_stats,
    bench_ring,
    pct,
    row_topology,
    train_plan,
    validation_record,
)
from sim.config import SimConfig, Workload
from sim.layer.backward import backward_config

__all__ = [
    "EXPERTS_PIECES",
    "experts_model_config",
    "format_experts_report",
    "summarise_experts",
    "validate_experts_rows",
]

# the bench's pieces -> the layer model's backward pieces (BackwardPass.piece_us) they time
EXPERTS_PIECES = {
    "dW_gate_up": ("dw_gate_up",),
    "dW_down": ("dw_down",),
    "gate_up_dgrad": ("gate_up_dgrad",),
    "bwd_recompute": ("recompute", "down_dgrad"),
    "bwd_from_saved": ("down_dgrad",),
    # the whole backward from saved g / u (fused in one launch, or one launch per GEMM): the
    # model's pieces one after the other, no overlap between them
    "bwd_saved_all": ("down_dgrad", "gate_up_dgrad", "dw_gate_up", "dw_down"),
}
EXPERTS_UNMODELLED = {
    "fwd_saving": "fwd_saving: a forward piece (the layer model times the forward's GEMMs "
    "inside its schedule, not alone)",
    "fwd_gate_up": "fwd_gate_up: a forward piece (as fwd_saving)",
    "fwd_down": "fwd_down: a forward piece (as fwd_saving)",
}
# (piece, impl) rows the model's piece does not describe
EXPERTS_UNMODELLED_IMPL = {
    ("bwd_recompute", "torch"): "bwd_recompute torch: two bf16 grouped GEMMs and the SwiGLU "
    "backward as separate elementwise passes (the model's piece is one kernel with the SwiGLU "
    "backward in the down dgrad's epilogue)",
}
# (recompute, HBM bytes per intermediate element of mok's SwiGLU-backward epilogue) a piece is
# modelled with (sim.app.validate.MOK_SWIGLU_BWD_BYTES): h w, dg and du written in bf16 (6)
# after the recomputed gate / up; from saved g / u (bwd_from_saved, bwd_saved_all) no recompute
# and the fp32 g and u read too (+8). The layer model's default
# (SimConfig.swiglu_bwd_bytes_per_elem) is a bf16 design's.
EXPERTS_EPILOGUE = {
    "bwd_from_saved": (False, MOK_SWIGLU_BWD_BYTES[False]),
    "bwd_saved_all": (False, MOK_SWIGLU_BWD_BYTES[False]),
}
EXPERTS_EPILOGUE_DEFAULT = (True, MOK_SWIGLU_BWD_BYTES[True])
# the row tile the pieces' GEMMs run (mok's kernels and torch's grouped GEMM: 128-row tiles; the
# bench pads each group to 16 rows, the weight gradients' depth step)
EXPERTS_ROW_TILE = 128
# the layer model keeps >= 1 communication SM: 131 compute SMs of the 132 the bench ran on
EXPERTS_COMM_SMS = 1


def experts_model_config(row: dict, gemm_profile: str | None = None):
    """(workload, routing plan, backward config) of the layer model for a row of an experts
    CSV: one GPU (:func:`sim.app.validate.row_topology`: the one the row ran on) with the row's
    ``num_experts``, all local, on the routing the bench drew,
    regions padded to :data:`EXPERTS_ROW_TILE`, one round; the backward with ``recompute``
    except for the pieces from saved g / u, with mok's epilogue bytes (:data:`EXPERTS_EPILOGUE`).
    ValueError for a workload the simulator rejects."""
    model, tokens, skew = row["model"], int(row["tokens_per_rank"]), row["skew"]
    shape, experts, seed = get_shape(model), int(row["num_experts"]), row_routing_seed(row)
    if experts < shape.num_topk:
        raise ValueError(f"{model}: num_experts={experts} is below its top-{shape.num_topk}")
    rt = EXPERTS_ROW_TILE
    wl = Workload(model, tokens, 1, row_topology(row), skew, seed)
    plan = train_plan(model, tokens, skew, experts, seed, rt)
    ring = bench_ring(tokens, shape.num_topk, experts, rt, tokens)
    recompute, epilogue_bytes = EXPERTS_EPILOGUE.get(row["piece"], EXPERTS_EPILOGUE_DEFAULT)
    base = SimConfig(
        dispatch_mode=MoKConfig().dispatch_mode,
        combine_mode="push",
        num_comm_sms=EXPERTS_COMM_SMS,
        minibatch_size=tokens,
        macrobatch_size=ring,
        row_tile=rt,
        gemm_profile=gemm_profile,
        swiglu_bwd_bytes_per_elem=epilogue_bytes,
    )
    return wl, plan, backward_config(base, recompute=recompute)


def validate_experts_rows(rows: Iterable[dict], gemm_profile: str | None = None) -> list[dict]:
    """One record per row of an experts CSV (``what`` = the piece), as the other validations'
    records: predicted = the sum of the model's pieces :data:`EXPERTS_PIECES` names, role
    ``validation`` (nothing is fitted on these rows); a ``fwd_saving`` row and torch's
    ``bwd_recompute`` (:data:`EXPERTS_UNMODELLED_IMPL`) status ``baseline``, a row the
    simulator rejects ``unsupported`` with the reason."""
    from sim.layer.model import BackwardBuilder

    cache: dict[tuple, dict[str, float]] = {}
    out = []
    for i, row in enumerate(rows):
        piece = row["piece"]
        rec = validation_record(i, row, what=piece, scope="", engine="-")
        if piece not in EXPERTS_PIECES or (piece, row["impl"]) in EXPERTS_UNMODELLED_IMPL:
            why = EXPERTS_UNMODELLED_IMPL.get((piece, row["impl"])) or EXPERTS_UNMODELLED.get(
                piece, f"{piece}: not a piece of the backward model"
            )
            rec.update(status="baseline", reason=why)
            out.append(rec)
            continue
        try:
            wl, plan, cfg = experts_model_config(row, gemm_profile)
            key = (wl, plan.trace.num_experts, cfg)
            if key not in cache:
                cache[key] = BackwardBuilder(wl, cfg, plan).piece_us(0)
        except ValueError as e:
            rec.update(status="unsupported", reason=str(e))
            out.append(rec)
            continue
        us = sum(cache[key][p] for p in EXPERTS_PIECES[piece])
        rec.update(predicted_us=us, device_us=us, err=us / rec["measured_us"] - 1)
        rec.update(role="validation", kernel=f"bwd.{'+'.join(EXPERTS_PIECES[piece])}")
        out.append(rec)
    return out


def summarise_experts(records: Sequence[dict]) -> dict:
    """|err| stats of the predicted records: over all, per impl, and per (piece, impl)."""
    ok = [r for r in records if r["status"] == "ok"]
    impls = list(dict.fromkeys(r["impl"] for r in ok))
    pieces = list(dict.fromkeys(r["what"] for r in ok))
    return {
        "rows": len(records),
        "all": abs_stats([r["err"] for r in ok]),
        "by_impl": {m: abs_stats([r["err"] for r in ok if r["impl"] == m]) for m in impls},
        "by_piece": {
            (p, m): abs_stats([r["err"] for r in ok if (r["what"], r["impl"]) == (p, m)])
            for p in pieces
            for m in impls
        },
        "baselines": sorted({r["reason"] for r in records if r["status"] == "baseline"}),
        "unsupported": sorted({r["reason"] for r in records if r["status"] == "unsupported"}),
    }


def format_experts_report(records: Sequence[dict], summary: dict) -> str:
    """The rows (measured / predicted ms and the signed error), then the |err| stats per piece
    and implementation."""
    lines = [
        f"{'model':<14} {'skew':<8} {'piece':<15} {'impl':<6} {'measured':>9} "
        f"{'predicted':>9} {'err':>7}"
    ]
    for r in records:
        if r["status"] != "ok":
            continue
        lines.append(
            f"{r['model']:<14} {r['skew']:<8} {r['what']:<15} {r['impl']:<6} "
            f"{r['measured_us'] / 1e3:8.3f}m {r['predicted_us'] / 1e3:8.3f}m "
            f"{100 * r['err']:+6.1f}%"
        )
    lines.append("")
    lines.append("|err| median / max (rows):")
    for (piece, impl), s in summary["by_piece"].items():
        if s["n"]:
            lines.append(
                f"  {piece:<15} {impl:<6} {pct(s['median_abs_err'])} / "
                f"{pct(s['max_abs_err'])} ({s['n']})"
            )
    for impl, s in summary["by_impl"].items():
        lines.append(
            f"  {'all pieces':<15} {impl:<6} {pct(s['median_abs_err'])} / "
            f"{pct(s['max_abs_err'])} ({s['n']})"
        )
    for why in summary["baselines"] + summary["unsupported"]:
        lines.append(f"  not predicted: {why}")
    return "\n".join(lines)
