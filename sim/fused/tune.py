"""``mok-sim tune --fused``: the best fused-layer config for one workload, by the fused model.

The fused layer (``csrc/layer.cuh``, :func:`mok.functional.moe_forward` with ``fused=True``) has
a smaller config space than the communication kernels: dispatch ``pull`` or ``dedup_pull``, the
push combine in the down tiles' epilogue, expert regions padded to ``row_tile`` 64 or 128 rows
(64: fewer padding rows, but a 128-row block that straddles two experts runs as two 64-row
sub-tiles; :mod:`sim.fused.model`), minibatches of whole 128-row blocks. The tuner searches row tile
x dispatch mode x communication SMs x minibatch with :func:`sim.fused.model.fused_layer` and ranks
by predicted layer time. ``macrobatch_size`` is not searched: the model (like ``mok.bench layer`` /
``sweep``, the rows it was fitted on) keeps the whole receive buffer as the ring (``macrobatch_size
= 0``), so that is what the emitted config asks for. The fused knobs were fitted on rows measured at
row tile 128; the 64-row sub-tiles' knobs are estimates (:class:`sim.fused.model.FusedProfile`), so
a pick of row tile 64 rests on them.

:func:`fused_limits` lists what rules the fused layer (or its fitted model) out for a workload:
the caller falls back to the unfused layer model (:func:`sim.layer.sweep.tune`).
:func:`pick_on_measured` replays the tuner on measured sweep groups, restricted to their grid.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import replace

from mok.spec.limits import (
    FUSED_BLOCK_ROWS,
    FUSED_DISPATCH_MODES,
    FUSED_ROW_TILES,
    expert_problems,
    shape_problems,
)
from mok.spec.rows import bench_routing_seed, row_routing_seed
from sim.config import Workload
from sim.core.topology import get_topology
from sim.fused.model import fused_layer, row_num_experts
from sim.fused.profile import FusedProfile
from sim.measured import row_tile_of

__all__ = [
    "FUSED_TUNE_SPACE",
    "fused_limits",
    "fused_space",
    "tune_fused",
    "TUNE_TERMS",
    "format_fused_table",
    "pick_on_measured",
]


FUSED_TUNE_SPACE = {
    "row_tile": FUSED_ROW_TILES,
    "dispatch_mode": FUSED_DISPATCH_MODES,
    "num_comm_sms": (8, 16, 24, 32, 48),
    "minibatch_size": (1024, 2048, 4096, 8192),
}

# the prediction's terms in every tuner row (and in the emitted config's breakdown)
TUNE_TERMS = (
    "schedule_us",
    "launch_us",
    "first_ready_us",
    "gemm_busy_us",
    "gemm_stall_us",
    "signal_us",
    "sum_us",
)


def _profile_for(wl: Workload, prof: FusedProfile) -> FusedProfile:
    """``prof`` on the workload's topology (the knobs stay; only the fabric and EP change)."""
    return prof if wl.topology == prof.topology else prof.replace(topology=wl.topology)


def fused_limits(
    wl: Workload, prof: FusedProfile, dtype: str = "bf16", row_tile: int | None = None
) -> list[str]:
    """Why the fused layer, or the fused model fitted in ``prof``, does not apply to ``wl``
    (empty: it applies). Mirrors ``mok.functional._check_fused`` where the simulator can.
    ``row_tile``: a pinned row tile (None: the tuner searches :data:`FUSED_ROW_TILES`)."""
    why = []
    topo, ptopo = wl.topo, get_topology(prof.topology)
    if topo.gpu_name != ptopo.gpu_name:
        why.append(
            f"the fused profile was fitted on {ptopo.gpu_name} (topology {ptopo.name}) and "
            f"{topo.name} has {topo.gpu_name}; the fused layer has a Hopper (sm_90a) path only, "
            "and another Hopper GPU needs a fused profile fitted on it (--fused-profile)"
        )
    if wl.ep > topo.gpus_per_domain:
        why.append(
            f"EP{wl.ep} spans {-(-wl.ep // topo.gpus_per_domain)} NVLink domains of {topo.name}; "
            "the fused layer reaches its peers over NVLink only"
        )
    s = wl.model_shape
    why += shape_problems(s.hidden, s.intermediate, s.shared_intermediate, dtype, s.name)
    why += expert_problems(s.num_experts // wl.ep)
    if row_tile is not None and row_tile not in FUSED_ROW_TILES:
        why.append(f"the fused layer needs row_tile in {FUSED_ROW_TILES} (found {row_tile})")
    return why


def fused_space(space: dict | None, num_sms: int) -> dict:
    """:data:`FUSED_TUNE_SPACE` updated with ``space``, checked against the fused layer's limits
    (row tile 64 or 128, ``1 <= num_comm_sms < num_sms``, minibatch a multiple of the 128-row
    block). The default comm SMs that leave no GEMM worker are dropped; given ones raise."""
    given = dict(space or {})
    out = dict(FUSED_TUNE_SPACE, **given)
    bad = [m for m in out["dispatch_mode"] if m not in FUSED_DISPATCH_MODES]
    if bad:
        raise ValueError(
            f"the fused layer pulls its dispatch: dispatch modes {bad} are not supported "
            f"(supported: {', '.join(FUSED_DISPATCH_MODES)})"
        )
    sms = [int(n) for n in out["num_comm_sms"]]
    if "num_comm_sms" in given:
        bad = [n for n in sms if not 1 <= n < num_sms]
        if bad:
            raise ValueError(
                f"comm SMs {bad} leave no GEMM workers: the fused layer needs "
                f"1 <= num_comm_sms < {num_sms}"
            )
    out["num_comm_sms"] = tuple(n for n in sms if 1 <= n < num_sms)
    bad = [m for m in out["minibatch_size"] if m < FUSED_BLOCK_ROWS or m % FUSED_BLOCK_ROWS]
    if bad:
        raise ValueError(
            f"minibatch sizes {bad} are not positive multiples of the fused layer's "
            f"{FUSED_BLOCK_ROWS}-row blocks"
        )
    bad = [t for t in out["row_tile"] if t not in FUSED_ROW_TILES]
    if bad:
        raise ValueError(
            f"row tiles {bad} are not supported by the fused layer (supported: "
            f"{', '.join(map(str, FUSED_ROW_TILES))})"
        )
    if not all(out[k] for k in FUSED_TUNE_SPACE):
        raise ValueError(f"empty fused search space: {out}")
    return out


def _key(row: dict) -> tuple:
    # best layer time; on a tie (host-bound, or the GEMMs hide the dispatch in several
    # configs), the lower device time, then the earlier first minibatch (more slack before a
    # gate/up tile would wait), fewer comm SMs, the smaller minibatch, pull before dedup_pull,
    # row tile 128 before 64 (no split blocks)
    return (
        row["layer_us"],
        row["device_us"],
        row["first_ready_us"],
        row["num_comm_sms"],
        row["minibatch_size"],
        FUSED_DISPATCH_MODES.index(row["dispatch_mode"]),
        -row["row_tile"],
    )


def _row(
    wl: Workload,
    prof: FusedProfile,
    mode: str,
    sms: int,
    minibatch: int,
    row_tile: int,
    num_experts: int | None = None,
) -> dict:
    r = fused_layer(
        wl.shape,
        wl.tokens_per_rank,
        wl.ep,
        wl.skew,
        mode,
        sms,
        minibatch,
        _profile_for(wl, prof),
        row_tile,
        wl.seed,
        num_experts,
    )
    return {
        "row_tile": int(row_tile),
        "dispatch_mode": mode,
        "combine_mode": "push",
        "num_comm_sms": int(sms),
        "minibatch_size": int(minibatch),
        "macrobatch_size": 0,
        "layer_us": r.layer_us,
        "device_us": r.device_us,
        "host_us": r.host_us,
        **{k: r.terms[k] for k in TUNE_TERMS},
    }


def tune_fused(wl: Workload, prof: FusedProfile, space: dict | None = None) -> list[dict]:
    """Every config of the fused space (:func:`fused_space`) on ``wl``, predicted by the fused
    model, best first, on the routing trace the benchmarks draw for this batch size
    (:func:`mok.spec.rows.bench_routing_seed`; ``wl.seed`` is not used). Raises ValueError if
    :func:`fused_limits` is not empty."""
    wl = replace(wl, seed=bench_routing_seed(wl.tokens_per_rank))
    why = fused_limits(wl, prof)
    if why:
        raise ValueError("the fused model does not apply: " + "; ".join(why))
    sp = fused_space(space, wl.topo.gpu.num_sms)
    rows = [
        _row(wl, prof, m, n, mb, rt)
        for rt in sp["row_tile"]
        for m in sp["dispatch_mode"]
        for n in sp["num_comm_sms"]
        for mb in sp["minibatch_size"]
    ]
    return sorted(rows, key=_key)


def format_fused_table(rows: Sequence[dict], top: int = 5, title: str = "") -> str:
    """The ``top`` best tuner rows as a text table (first row is the reference)."""
    head = (
        f"{'#':>2} {'dispatch':<11}{'sms':>4}{'minibatch':>10}{'row tile':>9}{'layer us':>10}"
        f"{'vs best':>9}{'1st ready':>10}{'gemm':>9}{'stall':>8}{'sum':>7}"
    )
    lines = ([title] if title else []) + [head, "-" * len(head)]
    ref = rows[0]["layer_us"]
    for i, r in enumerate(rows[:top], 1):
        lines.append(
            f"{i:>2} {r['dispatch_mode']:<11}{r['num_comm_sms']:>4}{r['minibatch_size']:>10}"
            f"{r['row_tile']:>9}{r['layer_us']:>10.1f}{100 * (r['layer_us'] / ref - 1):>+8.1f}%"
            f"{r['first_ready_us']:>10.1f}{r['gemm_busy_us']:>9.1f}{r['gemm_stall_us']:>8.1f}"
            f"{r['sum_us']:>7.1f}"
        )
    return "\n".join(lines)


def _cfg_label(cfg: tuple) -> str:
    mode, sms, mb, rt = cfg
    return f"{mode} {sms} SMs mb {mb}" + ("" if rt == FUSED_BLOCK_ROWS else f" rt {rt}")


def pick_on_measured(measured: Iterable[dict], prof: FusedProfile) -> list[dict]:
    """The tuner replayed on measured ``mok-fused`` rows (``mok.bench layer`` / ``sweep`` CSV
    rows): per workload group, the config the fused model ranks first among the group's
    measured configs, its measured time, and the measured best. One record per group. A config
    is (mode, comm SMs, minibatch, row tile); its label names the row tile when it is not 128.
    A group is also its ranks and the experts that ran (:func:`sim.fused.model.row_num_experts`:
    a one-GPU emulation of EP N runs the model's experts / N on one rank)."""
    groups: dict[tuple, dict[tuple, float]] = {}
    for r in measured:
        if r.get("impl") != "mok-fused":
            continue
        g = (
            r["model"],
            int(r["tokens_per_rank"]),
            int(r.get("num_ranks") or 2),
            r["skew"],
            row_routing_seed(r),
            row_num_experts(r),
        )
        cfg = (r["mode"], int(r["sms"]), int(r["minibatch"]), row_tile_of(r))
        groups.setdefault(g, {})[cfg] = float(r["median_us"])
    out = []
    for (model, tokens, ranks, skew, seed, experts), meas in groups.items():
        wl = Workload(model, tokens, ranks, prof.topology, skew, seed=seed)
        rows = sorted((_row(wl, prof, *c, experts) for c in meas), key=_key)
        pick = rows[0]
        pc = (pick["dispatch_mode"], pick["num_comm_sms"], pick["minibatch_size"], pick["row_tile"])
        best = min(meas, key=meas.get)
        out.append(
            {
                "model": model,
                "tokens_per_rank": tokens,
                "num_ranks": ranks,
                "skew": skew,
                "configs": len(meas),
                "picked": _cfg_label(pc),
                "picked_pred_us": pick["layer_us"],
                "picked_measured_us": meas[pc],
                "best": _cfg_label(best),
                "best_measured_us": meas[best],
                "gap": meas[pc] / meas[best] - 1,
            }
        )
    return out
