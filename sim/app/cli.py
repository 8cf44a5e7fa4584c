"""``mok-sim``, the simulator's command line; no arguments runs the default job.

mok-sim                                  # default comparison + build/mok-sim-default.png
mok-sim compare --shape kimi-k2 --ep 64 --topology gb300-nvl72 --skew zipf:1.2
mok-sim sweep --ep 8 --topology hgx-h200 --sms 8,16,24,32 --minibatch 2048,4096 --out build/s.csv
mok-sim tune --ep 8 --topology hgx-h200 --emit-config build/mok-config.json
mok-sim tune --ep 8 --topology hgx-h200 --kernel-profile mok-comm-h200x2   # measured kernels
mok-sim tune --fused --shape qwen3-30b-a3b --emit-config build/fused.json    # the fused layer
mok-sim trace --ep 8 --topology hgx-h200 --out build/trace.json
mok-sim calibrate probe.json --out build/h200.json
mok-sim validate mok/bench/results/h200x2-comm-grid-v4-2026-11-30.csv --plot build/p.png --strict
mok-sim validate mok/bench/results/h200x2-layer-2026-11-30.csv \
        mok/bench/results/h200x2-layer-sweep-2026-11-30.csv
mok-sim validate mok/bench/results/h200x1-layer-2026-12-01.csv --fused-fit ep1   # one GPU
mok-sim validate mok/bench/results/h200x1-layer-2026-12-01.csv --fused-fit ep1 --refit \
        --save-profile sim/profiles/mok-fused-h200x1.json                     # refit EP1
mok-sim validate mok/bench/results/h200x1-train.csv --gemm-profile mok-fused-h200x1  # training
mok-sim validate mok/bench/results/h200x1-experts.csv   # the backward's GEMM pieces alone
mok-sim bench

Each command imports the models it runs inside its own function: the argument and path checks
run, and ``--help`` answers, without loading the numba-compiled layer, comm and fused models or
matplotlib (a second or more each). A first run, whose compiled functions are not yet in numba's
cache, says so in one line (:mod:`sim.app.jit_cache`). Every file a command writes by default
goes under ``build/`` (created on demand), so a run from the repository root leaves nothing
untracked; ``validate --strict`` exits 1 when a target is missed.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import sys
import time
from pathlib import Path

from sim.app.cli_args import (
    PROBE_KINDS,
    CliError,
    check_paths,
    combine_modes_arg,
    dispatch_modes_arg,
    int_arg,
    int_list,
    positive_float,
    read_probe,
    skew_arg,
)
from sim.app.jit_cache import FUSED_MODULES, LAYER_MODULES, PLAN_MODULES, say_if_compiling
from sim.app.labels import FUSED_TABLE_LEGEND, SWEEP_LEGEND, TABLE_LEGEND
from sim.comm.profile import load_kernel_profile
from sim.config import COMBINE_MODES, DISPATCH_MODES, SimConfig, Workload
from sim.fused.profile import DEFAULT_FUSED_PROFILE, load_fused_profile
from sim.measured import FUSED_FITS, fused_fit

__all__ = ["main", "build_parser", "DEFAULT_JOBS", "format_table", "legend"]

# The embedded default job: the same question on the rack we design for and on the box we rent.
DEFAULT_JOBS = (
    Workload("deepseek-v3", 4096, 64, "gb300-nvl72", "zipf:0.2", seed=0),
    Workload("deepseek-v3", 4096, 8, "hgx-h200", "zipf:0.2", seed=0),
)
DEFAULT_CONFIG = SimConfig(num_comm_sms=24, minibatch_size=4096, macrobatch_size=16384)


def _add_workload(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("workload")
    g.add_argument(
        "--shape", default="deepseek-v3", help="model preset (mok.spec.workload.PRESETS)"
    )
    g.add_argument("--tokens", type=int_arg(1), default=4096, help="tokens per rank")
    g.add_argument("--ep", type=int_arg(1), default=8, help="expert-parallel ranks")
    g.add_argument("--topology", default="hgx-h200", help="topology preset, e.g. gb300-nvl72x2")
    g.add_argument(
        "--skew",
        type=skew_arg,
        default="uniform",
        help="uniform | zipf:A | hot:SHARE[:N], each with an optional @CORR | aligned",
    )
    g.add_argument("--seed", type=int_arg(0), default=0)


def _add_config(p: argparse.ArgumentParser, single: bool = True) -> None:
    g = p.add_argument_group("kernel config")
    if single:
        g.add_argument("--dispatch", default="pull", choices=DISPATCH_MODES)
        g.add_argument("--combine", default="push", choices=COMBINE_MODES)
        g.add_argument("--sms", type=int_arg(1), default=24, help="communication SMs")
        g.add_argument("--minibatch", type=int_arg(1), default=4096, help="rows per rank per round")
        g.add_argument("--ring-slots", type=int_arg(1), default=4, help="macrobatch / minibatch")
    g.add_argument(
        "--pass",
        dest="pass_",
        default="fwd",
        choices=("fwd", "bwd", "both") if single else ("fwd", "bwd"),
        help="the layer pass to simulate: forward (default), backward (SimConfig.direction="
        "'backward', sim.layer.backward)"
        + (
            ", or both (two tables, their sum, and the DeepEP + torch-best step of "
            "sim.layer.baseline beside them)"
            if single
            else ""
        ),
    )
    g.add_argument("--backward", action="store_true", help="same as --pass bwd")
    g.add_argument(
        "--recompute",
        action="store_true",
        help="backward: recompute the forward's gate/up GEMM per round (default: saved)",
    )
    g.add_argument("--row-tile", type=int_arg(1), default=128)
    g.add_argument("--mechanism", default="tma", choices=("tma", "st"))
    g.add_argument("--dtype", default="bf16", choices=("bf16", "mxfp8"))
    g.add_argument("--granularity", default="round", choices=("round", "peer"))
    g.add_argument(
        "--kernel-profile",
        metavar="NAME|PATH",
        default=None,
        help="scale the per-SM comm rates by the measured mok kernels' fitted efficiency "
        "(kernel profile name under sim/profiles, e.g. mok-comm-h200x2, or a JSON path); "
        "default: the probe curves",
    )
    g.add_argument(
        "--gemm-profile",
        metavar="NAME|PATH",
        default=None,
        help="run the expert GEMMs at a fused profile's measured megakernel rates (e.g. "
        f"{DEFAULT_FUSED_PROFILE}; SimConfig.gemm_profile); default: the GPU profile's "
        "(standalone grouped GEMM)",
    )


def legend(text: str) -> str:
    """A table legend (:mod:`sim.app.labels`) wrapped to 100 columns, its later lines indented
    (so no line of it starts like a table row)."""
    import textwrap

    return textwrap.fill(text, 100, subsequent_indent="  ")


def _workload(a) -> Workload:
    return Workload(a.shape, a.tokens, a.ep, a.topology, a.skew, a.seed)


def _passes(a) -> tuple[str, ...]:
    """The passes the command line asks for: ("fwd",), ("bwd",) or ("fwd", "bwd")."""
    p = "bwd" if getattr(a, "backward", False) else getattr(a, "pass_", "fwd")
    if getattr(a, "backward", False) and getattr(a, "pass_", "fwd") not in ("fwd", "bwd"):
        raise ValueError(f"--backward contradicts --pass {a.pass_}")
    if getattr(a, "recompute", False) and p == "fwd":
        raise ValueError("--recompute applies to the backward: add --pass bwd (or both)")
    return ("fwd", "bwd") if p == "both" else (p,)


def _base_config(a, single: bool = True) -> SimConfig:
    kw = {
        "row_tile": a.row_tile,
        "mechanism": a.mechanism,
        "dtype": a.dtype,
        "flow_granularity": a.granularity,
        "kernel_profile": a.kernel_profile,
        "gemm_profile": a.gemm_profile,
        "direction": "backward" if _passes(a) == ("bwd",) else "forward",
        "recompute": bool(a.recompute) and _passes(a) == ("bwd",),
    }
    if single:
        kw.update(
            dispatch_mode=a.dispatch,
            combine_mode=a.combine,
            num_comm_sms=a.sms,
            minibatch_size=a.minibatch,
            macrobatch_size=a.minibatch * a.ring_slots,
        )
    from sim.layer.model import check_kernel_profile

    return check_kernel_profile(SimConfig(**kw))


def format_table(results, title: str = "") -> str:
    """A readable comparison table of LayerResults (first row is the speedup reference).

    ``gemm``, ``exp.comm``, ``signal`` and ``sched`` (not shown) add up to the layer time (the
    breakdown of :mod:`sim.layer.results`); ``sig/rank`` is the signalling time a rank spends
    over the layer (mean over ranks), on the critical path or not; ``NVL util`` the mean / max
    NVLink port utilisation over the layer (wire bytes / port rate x layer time)."""
    head = (
        f"{'dispatch/combine':<18}{'layer us':>10}{'vs first':>9}{'gemm':>8}{'exp.comm':>9}"
        f"{'signal':>8}{'sig/rank':>9}{'idle%':>7}{'NVL util%':>10}{'NVL MB/rank':>12}"
    )
    lines = [title, head, "-" * len(head)] if title else [head, "-" * len(head)]
    ref = results[0].layer_us
    for r in results:
        b = r.breakdown
        sig, _ = r.signalling_per_rank()
        um, ux = r.nvlink_utilisation()
        util = f"{100 * um:.0f}/{100 * ux:.0f}"
        lines.append(
            f"{r.config.dispatch_mode + '/' + r.config.combine_mode:<18}"
            f"{r.layer_us:>10.1f}{ref / r.layer_us:>8.3f}x{b['gemm_us']:>8.1f}"
            f"{b['exposed_comm_us']:>9.1f}{b['signalling_us']:>8.1f}{sig:>9.1f}"
            f"{100 * r.compute_idle_frac:>6.1f}%{util:>10}"
            f"{r.payload_bytes['nvlink'] / r.workload.ep / 1e6:>12.1f}"
        )
    return "\n".join(lines)


def format_sum_table(fwd, bwd, title: str = "") -> str:
    """Forward, backward and their sum per policy (``fwd`` / ``bwd``: LayerResults in the same
    policy order), with the exposed communication of each (:mod:`sim.layer.results`)."""
    head = (
        f"{'dispatch/combine':<18}{'fwd us':>10}{'bwd us':>10}{'sum us':>10}{'fwd exp':>9}"
        f"{'bwd exp':>9}{'sum exp':>9}{'wgrad tail':>11}"
    )
    lines = [title, head, "-" * len(head)] if title else [head, "-" * len(head)]
    for f, b in zip(fwd, bwd, strict=True):
        ef, eb = f.breakdown["exposed_comm_us"], b.breakdown["exposed_comm_us"]
        lines.append(
            f"{f.config.dispatch_mode + '/' + f.config.combine_mode:<18}{f.layer_us:>10.1f}"
            f"{b.layer_us:>10.1f}{f.layer_us + b.layer_us:>10.1f}{ef:>9.1f}{eb:>9.1f}"
            f"{ef + eb:>9.1f}{b.wgrad_tail_us:>11.1f}"
        )
    return "\n".join(lines)


def format_mode_bests(ranked: list[dict]) -> str:
    """The best sweep row of each dispatch/combine mode (``ranked``: best first), with its
    signalling (exposed; per rank over the layer, mean) and NVLink port utilisation (mean /
    max), the terms that separate the modes."""
    head = (
        f"{'dispatch/combine':<18}{'layer us':>10}{'sms':>5}{'mb':>6}{'ring':>7}{'signal':>8}"
        f"{'sig/rank':>9}{'NVL util%':>10}"
    )
    lines, seen = ["best per mode:", head], set()
    for r in ranked:
        mode = f"{r['dispatch_mode']}/{r['combine_mode']}"
        if mode in seen:
            continue
        seen.add(mode)
        util = f"{100 * r['nvl_util_mean']:.0f}/{100 * r['nvl_util_max']:.0f}"
        lines.append(
            f"{mode:<18}{r['layer_us']:>10.1f}{r['num_comm_sms']:>5}{r['minibatch_size']:>6}"
            f"{r['macrobatch_size'] // r['minibatch_size']:>7}{r['signalling_us']:>8.1f}"
            f"{r['signal_rank_us']:>9.1f}"
            f"{util:>10}"
        )
    return "\n".join(lines)


def _default_job(wl: Workload) -> list:
    from sim.layer.model import plan_for
    from sim.layer.sweep import compare

    res = compare(wl, DEFAULT_CONFIG, plan=plan_for(wl, DEFAULT_CONFIG.row_tile))
    return [r.detach() for r in res]  # only the summary travels back from a worker


def _cmd_default(a) -> int:
    t0 = time.perf_counter()
    say_if_compiling(LAYER_MODULES)
    if (os.cpu_count() or 1) > 1:
        # the big workload in a worker, the small one here, then the PNG code while we wait
        ctx = mp.get_context("fork" if "fork" in mp.get_all_start_methods() else "spawn")
        with ctx.Pool(1) as pool:
            pending = pool.map_async(_default_job, DEFAULT_JOBS[:1])
            rest = [_default_job(wl) for wl in DEFAULT_JOBS[1:]]
            from sim.app.plots import compare_bars

            results = pending.get() + rest
    else:
        from sim.app.plots import compare_bars

        results = [_default_job(wl) for wl in DEFAULT_JOBS]
    groups = {}
    for wl, res in zip(DEFAULT_JOBS, results, strict=True):
        groups[wl.label()] = res
        print(format_table(res, f"\n{wl.label()}  ({DEFAULT_CONFIG.label().split(' ', 1)[1]})"))
        best = min(res, key=lambda r: r.layer_us)
        print(
            f"fastest: {best.config.dispatch_mode}/{best.config.combine_mode} "
            f"({best.layer_us:.1f} us per layer forward)"
        )
    print("\n" + legend(TABLE_LEGEND))
    fig = compare_bars(groups)
    out = Path(a.out)
    fig.savefig(out, dpi=110)
    print(f"\nwrote {out.resolve()}  ({time.perf_counter() - t0:.1f} s)")
    print(
        "next: mok-sim tune --shape deepseek-v3 --ep 8 --topology hgx-h200 --emit-config "
        "build/mok-config.json"
    )
    return 0


def _cmd_compare(a) -> int:
    from sim.layer.results import write_csv
    from sim.layer.sweep import compare

    wl, base = _workload(a), _base_config(a)
    say_if_compiling(LAYER_MODULES)
    if _passes(a) == ("fwd", "bwd"):
        from sim.layer.backward import backward_config
        from sim.layer.model import plan_for

        plan = plan_for(wl, base.row_tile)
        fwd = compare(wl, base, plan=plan)
        bwd = compare(wl, backward_config(base, a.recompute), plan=plan)
        for res, cfg in ((fwd, base), (bwd, bwd[0].config)):
            print(format_table(res, f"{wl.label()}  ({cfg.label().split(' ', 1)[1]})") + "\n")
        print(format_sum_table(fwd, bwd, "forward + backward"))
        from sim.layer.baseline import deepep_torch_step, format_baseline_table

        base_step = deepep_torch_step(wl, plan, gemm_profile=base.gemm_profile)
        rc = " rc" if a.recompute else ""  # mok's backward recomputes, torch-best's saves
        mok = {
            f"{f.config.dispatch_mode}/{f.config.combine_mode}{rc}": (f.layer_us, b.layer_us)
            for f, b in zip(fwd, bwd, strict=True)
        }
        print("\n" + format_baseline_table(base_step, mok))
        res = fwd + bwd
    else:
        res = compare(wl, base)
        print(format_table(res, f"{wl.label()}  ({base.label().split(' ', 1)[1]})"))
    print(legend(TABLE_LEGEND))
    if a.csv:
        write_csv([r.summary() for r in res], a.csv)
        print(f"wrote {a.csv}")
    return 0


def _cmd_sweep(a) -> int:
    from sim.layer.results import write_csv
    from sim.layer.sweep import grid, rank_rows, sweep

    wl, base = _workload(a), _base_config(a, single=False)
    configs = grid(a.dispatch, a.combine, a.sms, a.minibatch, a.ring_slots, base)
    if not configs:
        raise ValueError(
            f"no configuration to sweep: --dispatch {','.join(a.dispatch)} x --combine "
            f"{','.join(a.combine)} (dedup_pull runs only with the push combine)"
        )
    say_if_compiling(LAYER_MODULES)
    t0 = time.perf_counter()
    rows = sweep(wl, configs, jobs=a.jobs, progress=not a.quiet)
    dt = time.perf_counter() - t0
    write_csv(rows, a.out)
    ranked = rank_rows(rows)
    best = ranked[0]
    print(f"{len(rows)} configs in {dt:.1f} s -> {a.out}")
    print(
        f"best: {best['dispatch_mode']}/{best['combine_mode']} sms={best['num_comm_sms']} "
        f"mb={best['minibatch_size']} ring={best['macrobatch_size'] // best['minibatch_size']} "
        f"-> {best['layer_us']:.1f} us"
    )
    print(format_mode_bests(ranked))
    print(legend(SWEEP_LEGEND))
    if a.heatmap:
        from sim.app.plots import sweep_heatmap

        sweep_heatmap(rows).savefig(a.heatmap, dpi=110)
        print(f"wrote {a.heatmap}")
    return 0


def _cmd_tune(a) -> int:
    if a.fused:
        return _tune_fused(a)
    a.topology, a.ep = a.topology or "hgx-h200", a.ep or 8
    a.row_tile = a.row_tile or 128
    return _tune_unfused(a)


def _tune_space(a) -> dict[str, list]:
    """The config axes the user narrowed with --sms / --minibatch / --dispatch."""
    space = {}
    if a.sms:
        space["num_comm_sms"] = list(a.sms)
    if a.minibatch:
        space["minibatch_size"] = list(a.minibatch)
    if a.dispatch:
        space["dispatch_mode"] = list(a.dispatch)
    return space


def _tune_unfused(a, fused_unsupported: list[str] | None = None) -> int:
    from sim.app.emit import tune_document, write_json
    from sim.layer.model import simulate
    from sim.layer.sweep import tune

    wl, base = _workload(a), _base_config(a, single=False)
    space = _tune_space(a)
    say_if_compiling(LAYER_MODULES)
    cfg, rows = tune(wl, space, jobs=a.jobs, progress=not a.quiet, base=base)
    doc = tune_document(wl, cfg, simulate(wl, cfg))
    if fused_unsupported:
        doc["workload"]["layer"] = "unfused"
        doc["workload"]["fused_unsupported"] = fused_unsupported
    text = json.dumps(doc, indent=1)
    print(text)
    print(
        f"searched {len(rows)} configs; runner-up: "
        + ", ".join(
            f"{r['dispatch_mode']}/{r['combine_mode']} sms={r['num_comm_sms']} "
            f"mb={r['minibatch_size']} {r['layer_us']:.1f} us"
            for r in rows[1:3]
        )
    )
    if a.emit_config:
        write_json(doc, a.emit_config)
        print(f"wrote {a.emit_config}")
    return 0


def _tune_fused(a) -> int:
    from sim.app.emit import fused_tune_document, write_json
    from sim.core.topology import get_topology
    from sim.fused.fit import profile_fit
    from sim.fused.tune import format_fused_table, fused_limits, tune_fused

    prof = load_fused_profile(a.fused_profile)
    ptopo = get_topology(prof.topology)
    fitted_ep = profile_fit(prof)[0].num_ranks  # the ranks of the rows it was fitted on
    # default workload: the fused profile's own machine (h200x2: EP2)
    a.ep = a.ep or (ptopo.num_gpus if a.topology is None else 8)
    a.topology = a.topology or prof.topology
    wl = _workload(a)
    why = fused_limits(wl, prof, a.dtype, a.row_tile)
    if why:
        print(
            "mok-sim tune --fused: the fused layer does not apply to "
            f"{wl.label()}:\n  - " + "\n  - ".join(why) + "\ntuning the unfused layer instead "
            "(communication kernels + grouped GEMM: run it with moe_forward(..., fused=False))",
            file=sys.stderr,
        )
        a.row_tile = a.row_tile or 128
        return _tune_unfused(a, fused_unsupported=why)
    if a.topology != prof.topology or a.ep != fitted_ep:
        print(
            f"note: the fused profile {a.fused_profile} was fitted at EP{fitted_ep} on "
            f"{prof.topology}; EP{a.ep} on {a.topology} extrapolates it (same GPU)",
            file=sys.stderr,
        )
    space = _tune_space(a)
    if a.row_tile:
        space["row_tile"] = [a.row_tile]
    say_if_compiling(FUSED_MODULES)
    rows = tune_fused(wl, prof, space)
    title = (
        f"fused layer, {wl.label()} (routing seed {wl.tokens_per_rank}), profile "
        f"{a.fused_profile}: best {min(a.top, len(rows))} of {len(rows)} configs, combine push, "
        "macrobatch 0 (whole receive buffer)"
    )
    print(format_fused_table(rows, a.top, title))
    print(legend(FUSED_TABLE_LEGEND))
    doc = fused_tune_document(wl, rows[0], prof, str(a.fused_profile), len(rows))
    print(json.dumps(doc, indent=1))
    if a.emit_config:
        write_json(doc, a.emit_config)
        print(f"wrote {a.emit_config} (run it with moe_forward(..., fused=True))")
    return 0


def _cmd_trace(a) -> int:
    from sim.app.trace import write_chrome_trace
    from sim.layer.model import simulate
    from sim.layer.results import write_csv

    if _passes(a) == ("fwd", "bwd"):
        raise ValueError("trace takes one pass: --pass fwd or --pass bwd")
    wl, cfg = _workload(a), _base_config(a)
    say_if_compiling(LAYER_MODULES)
    res = simulate(wl, cfg, record_links=True)
    p = write_chrome_trace(res, a.out)
    b, (sig, _), (um, ux) = res.breakdown, res.signalling_per_rank(), res.nvlink_utilisation()
    print(
        f"{wl.label()} | {cfg.label()}: {res.layer_us:.1f} us (exposed signalling "
        f"{b['signalling_us']:.1f} us, signalling {sig:.1f} us per rank, NVLink util "
        f"{100 * um:.0f}% mean / {100 * ux:.0f}% max); wrote {p} (open in Perfetto)"
    )
    if a.csv:
        write_csv(res.records(), a.csv)
        print(f"wrote {a.csv}")
    if a.gantt:
        from sim.app.plots import gantt

        gantt(res).savefig(a.gantt, dpi=110)
        print(f"wrote {a.gantt}")
    if a.links:
        from sim.app.plots import link_utilisation

        link_utilisation(res).savefig(a.links, dpi=110)
        print(f"wrote {a.links}")
    return 0


def _cmd_calibrate(a) -> int:
    from sim.app.calibrate import fit_gpu_profile

    probe = read_probe(a.probe)
    over = {}
    if a.num_sms:
        over["num_sms"] = a.num_sms
    if a.nvlink_gbps:
        over["nvlink_gbps_per_direction"] = a.nvlink_gbps
    try:
        prof = fit_gpu_profile(probe, a.name, Path(a.probe).name, **over)
    except (KeyError, TypeError, AttributeError, IndexError) as e:
        raise CliError(
            f"cannot fit {a.probe}: a malformed probe JSON ({type(e).__name__}: {e}); {PROBE_KINDS}"
        ) from None
    prof.save(a.out)
    fit = prof.fit
    print(
        f"fitted {a.name}: wire {fit['wire_gbps_per_direction']:.1f} GB/s per direction, "
        f"{fit['num_points']} probe points, max error {100 * fit['max_rel_error']:.2f}% "
        f"(mean {100 * fit['mean_rel_error']:.2f}%)"
    )
    for name, c in prof.comm_curves.items():
        print(
            f"  {name:<10} {c.per_sm_gbps:6.1f} GB/s per SM, ceiling "
            f"{c.ceiling_knee_gbps:7.1f} @ {c.sm_knee:g} SMs -> {c.ceiling_max_gbps:7.1f} @ "
            f"{c.sm_max:g} SMs"
        )
    print(f"wrote {a.out}")
    return 0


# the measured kinds of sim.measured.read_measured, as validate names them
_KIND_NAMES = {
    "layer": "layer CSVs (mok.bench layer / sweep)",
    "comm": "comm CSVs (mok.bench comm)",
    "train": "train CSVs (mok.bench train)",
    "experts": "experts CSVs (mok.bench experts)",
}


def _cmd_validate(a) -> int:
    from sim.app.validate import format_report, format_train_report, summarise, summarise_train
    from sim.layer.results import write_csv
    from sim.measured import MeasuredCSVError, read_measured

    tables = []
    for path in a.measured:
        try:
            tables.append(read_measured(path))
        except MeasuredCSVError as e:
            raise CliError(str(e)) from None
    kinds = list(dict.fromkeys(kind for kind, _ in tables))
    if len(kinds) > 1:
        mixed = " and ".join(v for k, v in _KIND_NAMES.items() if k in kinds)
        raise ValueError(f"mix of {mixed}: validate them in separate runs")
    layer, train, experts = kinds == ["layer"], kinds == ["train"], kinds == ["experts"]
    rows = [r for _, t in tables for r in t]
    names = ", ".join(map(str, a.measured))
    if a.layer_model and not layer:
        raise CliError(
            "--layer-model checks the layer model on layer CSVs (mok.bench layer)"
            + ("; a train CSV is always predicted by the layer model" if train else "")
        )
    if a.design_backward and not train:
        raise CliError("--design-backward applies to train CSVs (mok.bench train)")
    summary = None  # an experts CSV has no targets
    if train:
        records = _validate_train(a, rows)
        summary = summarise_train(records)
        print(f"{names}: {len(rows)} rows")
        print(format_train_report(records, summary))
    elif experts:
        records = _validate_experts(a, rows, f"{names}: {len(rows)} rows")
    else:
        if a.layer_model:
            records = _validate_layer_model(a, rows)
        else:
            records = _validate_layer(a, rows) if layer else _validate_comm(a, rows)
        summary = summarise(records)
        print(f"{names}: {len(rows)} rows")
        print(format_report(records, summary, rows=a.rows))
    if a.csv:
        write_csv(records, a.csv)
        print(f"wrote {a.csv}")
    if a.plot:
        from sim.app.plots import layer_validation, validation_scatter

        fig = layer_validation(records) if layer else validation_scatter(records)
        fig.savefig(a.plot, dpi=110)
        print(f"wrote {a.plot}")
    return _targets_verdict(summary, a.strict)


def _targets_verdict(summary: dict | None, strict: bool) -> int:
    """Print one line on the targets of a validation ``summary``; the exit status: 1 when
    ``strict`` and a target is missed, else 0."""
    from sim.app.validate import applicable_targets, missed_targets

    if summary is None:
        print("targets: none for this CSV" + (" (--strict has nothing to check)" if strict else ""))
        return 0
    missed, n = missed_targets(summary), len(applicable_targets(summary))
    if not missed:
        print(f"targets: all {n} that apply are met")
        return 0
    print(
        f"targets: {len(missed)} of {n} MISSED ({', '.join(missed)}); "
        + ("--strict: exit status 1" if strict else "exit status 0 (--strict exits 1)")
    )
    return 1 if strict else 0


def _validate_comm(a, rows: list[dict]) -> list[dict]:
    from sim.app.validate import validate_rows
    from sim.comm.fit import fit_kernel_profile

    prof = load_kernel_profile(a.profile)
    if a.refit:
        print("refitting the kernel profile on the fit rows (a few minutes)", flush=True)
        prof = fit_kernel_profile(rows, prof, log=lambda m: print(f"  {m}", flush=True))
        print(f"refitted kernel knobs on {prof.fit_subset}: {prof.fit}")
        if a.save_profile:
            prof.save(a.save_profile)
            print(f"wrote {a.save_profile}")
    print(f"comm-kernel model, profile {a.profile} fitted on: {prof.fit_subset}")
    say_if_compiling(LAYER_MODULES)
    return validate_rows(rows, prof)


def _fused_profile_arg(a) -> str:
    """The fused profile validate starts from: ``--fused-profile``; else with ``--refit`` the
    base of ``--fused-fit`` (the knobs the fit does not fit keep its values; ep1: the two-GPU
    profile), without it the profile ``--fused-fit`` writes; else the default."""
    if a.fused_profile is not None:
        return a.fused_profile
    if a.fused_fit is None:
        return DEFAULT_FUSED_PROFILE
    spec = fused_fit(a.fused_fit)
    return spec.base if a.refit else spec.profile


def _validate_layer(a, rows: list[dict]) -> list[dict]:
    from sim.app.validate import validate_layer_rows
    from sim.fused.fit import FUSED_KNOBS, fit_fused_profile, profile_fit

    name = _fused_profile_arg(a)
    prof = load_fused_profile(name)
    if a.refit:
        spec = fused_fit(a.fused_fit) if a.fused_fit else profile_fit(prof)[0]
        print(
            f"refitting the fused-layer knobs on the fit rows of fit {spec.name} (profile "
            f"{spec.profile}), starting from {name} (a few minutes)",
            flush=True,
        )
        prof = fit_fused_profile(
            rows, prof, log=lambda m: print(f"  {m}", flush=True), fit=spec, start=name
        )
        print("refitted: " + ", ".join(f"{k}={getattr(prof, k)}" for k in FUSED_KNOBS), prof.fit)
        if a.save_profile:
            prof.save(a.save_profile)
            print(f"wrote {a.save_profile}")
        name = a.save_profile or f"{name} refitted ({spec.name})"
    spec = profile_fit(prof)[0]
    ranks = sorted({int(r.get("num_ranks") or 2) for r in rows if r.get("impl") == "mok-fused"})
    if ranks and ranks != [spec.num_ranks]:
        others = [f.name for f in FUSED_FITS.values() if f.num_ranks in ranks]
        print(
            f"note: the fused rows ran at {'/'.join(f'EP{n}' for n in ranks)} and profile {name} "
            f"was fitted at EP{spec.num_ranks} (fit {spec.name})"
            + (f"; --fused-fit {' / '.join(others)} picks a profile fitted there" if others else "")
        )
    print(f"fused-layer model, profile {name} fitted on: {prof.fit_subset}")
    say_if_compiling(FUSED_MODULES)
    return validate_layer_rows(rows, prof)


def _validate_layer_model(a, rows: list[dict]) -> list[dict]:
    from sim.app.validate import validate_layer_model_rows

    if a.refit:
        raise CliError(
            "--layer-model has nothing to refit (its GEMM rates come from --gemm-profile)"
        )
    rates = (
        f"GEMM rates of fused profile {a.gemm_profile}"
        if a.gemm_profile
        else ("GEMM rates of the GPU profile (the standalone grouped GEMM's)")
    )
    print(f"layer model (sim.layer), {rates}; two-GPU mok-fused rows, all held out")
    say_if_compiling(LAYER_MODULES)
    return validate_layer_model_rows(rows, a.gemm_profile)


def _validate_train(a, rows: list[dict]) -> list[dict]:
    import textwrap

    from sim.app.validate import train_model_notes, validate_train_rows

    if a.refit:
        raise CliError(
            "a train CSV has nothing to refit (the layer model is not fitted on train rows; its "
            "GEMM rates come from --gemm-profile)"
        )
    if a.fused_profile is not None or a.fused_fit is not None:
        raise CliError(
            "--fused-profile / --fused-fit apply to layer CSVs (the fused model); a train CSV is "
            "predicted by the layer model, whose GEMM rates --gemm-profile sets"
        )
    rates = (
        f"the GEMM rates of fused profile {a.gemm_profile} (the fused forward kernel's)"
        if a.gemm_profile
        else "the GPU profile's GEMM rates (the standalone grouped GEMM's)"
    )
    print(
        f"layer model (sim.layer), forward and backward at {rates}, one set for every GEMM of "
        "both passes; train rows, all held out (nothing is fitted on them):"
    )
    for note in train_model_notes(a.design_backward):
        print(textwrap.fill(note, 100, initial_indent="  - ", subsequent_indent="    "))
    say_if_compiling(LAYER_MODULES)
    return validate_train_rows(rows, a.gemm_profile, a.design_backward)


def _validate_experts(a, rows: list[dict], title: str) -> list[dict]:
    from sim.app.validate_experts import (
        format_experts_report,
        summarise_experts,
        validate_experts_rows,
    )

    if a.refit or a.fused_profile is not None or a.fused_fit is not None or a.plot:
        raise CliError(
            "an experts CSV is predicted by the layer model's backward pieces, at the GEMM rates "
            "--gemm-profile sets: --refit, --fused-profile / --fused-fit and --plot do not apply"
        )
    rates = (
        f"the GEMM rates of fused profile {a.gemm_profile}"
        if a.gemm_profile
        else "the GPU profile's GEMM rates (the standalone grouped GEMM's)"
    )
    print(f"layer model's backward pieces (sim.layer.backward), each alone, at {rates}:")
    say_if_compiling(PLAN_MODULES)
    records = validate_experts_rows(rows, a.gemm_profile)
    print(title)
    print(format_experts_report(records, summarise_experts(records)))
    return records


def _cmd_bench(a) -> int:
    from sim.app.bench import main as bench_main

    say_if_compiling(LAYER_MODULES)
    return bench_main(["--sweep-configs", str(a.sweep_configs)] + (["--quick"] if a.quick else []))


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="mok-sim",
        description="Discrete-event model of push vs pull MoE dispatch/combine on NVLink "
        "topologies. With no subcommand: the default comparison (a table per workload and a "
        "PNG). Files a command writes by default go under build/ (created on demand).",
        epilog=TABLE_LEGEND,
    )
    p.add_argument("--out", default="build/mok-sim-default.png", help="PNG of the default run")
    sub = p.add_subparsers(dest="cmd")

    c = sub.add_parser(
        "compare", help="push vs pull vs dedup-pull for one workload", epilog=TABLE_LEGEND
    )
    _add_workload(c)
    _add_config(c)
    c.add_argument("--csv", help="also write the rows as CSV")

    s = sub.add_parser(
        "sweep", help="grid over policy x comm SMs x minibatch x ring size", epilog=SWEEP_LEGEND
    )
    _add_workload(s)
    _add_config(s, single=False)
    s.add_argument("--dispatch", type=dispatch_modes_arg, default=",".join(DISPATCH_MODES))
    s.add_argument("--combine", type=combine_modes_arg, default=",".join(COMBINE_MODES))
    s.add_argument("--sms", type=int_list(1), default="16,24,32")
    s.add_argument("--minibatch", type=int_list(1), default="2048,4096")
    s.add_argument("--ring-slots", type=int_list(1), default="2,4")
    s.add_argument("--jobs", type=int_arg(1), default=None, help="worker processes (default: CPUs)")
    s.add_argument("--out", default="build/mok-sim-sweep.csv", help="CSV of every config")
    s.add_argument("--heatmap", help="PNG heatmap of comm SMs x minibatch")
    s.add_argument("--quiet", action="store_true")

    t = sub.add_parser(
        "tune",
        help="best config for a workload, as mok-config/1 JSON",
        epilog="with --fused, the table's " + FUSED_TABLE_LEGEND,
        description="Search the config space of one MoE layer forward and print the best "
        "config as mok-config/1 JSON (mok.MoKConfig.from_json loads --emit-config). Default: "
        "the unfused layer (communication kernels + grouped GEMM, moe_forward(..., "
        "fused=False)) with the layer model; topology hgx-h200, EP8. --fused: the fused layer "
        "(one kernel, moe_forward(..., fused=True)) with the fused model (sim/fused/model.py, "
        "--fused-profile): row tile 64|128 (--row-tile pins one) x dispatch pull|dedup_pull x "
        "comm SMs x minibatch, combine push, macrobatch 0 (the whole receive buffer, as the "
        "model was fitted); topology and EP default to the profile's (h200x2, EP2). It prints "
        "the best --top configs. Where the fused layer does not apply (hidden %% 256, "
        "intermediate %% 128, bf16 only, a row tile other than 64 or 128, "
        "a GPU the profile was not fitted on, EP across NVLink domains) it says why and tunes "
        "the unfused layer instead.",
    )
    _add_workload(t)
    _add_config(t, single=False)
    # resolved per layer: see the description (row tile: 128 unfused, searched fused)
    t.set_defaults(topology=None, ep=None, row_tile=None)
    t.add_argument("--sms", type=int_list(1), help="comm SMs to try (default 8,16,24,32,48)")
    t.add_argument(
        "--minibatch", type=int_list(1), help="minibatch sizes to try (default 1024..8192)"
    )
    t.add_argument(
        "--dispatch",
        type=dispatch_modes_arg,
        help="dispatch modes to try (default: all; with --fused pull,dedup_pull)",
    )
    t.add_argument("--emit-config", help="write the JSON here (mok.MoKConfig.from_json)")
    t.add_argument("--jobs", type=int_arg(1), default=None, help="worker processes (unfused model)")
    t.add_argument("--quiet", action="store_true")
    f = t.add_argument_group("fused layer")
    f.add_argument(
        "--fused",
        action="store_true",
        help="tune the fused layer with the fused model (routing seed = tokens, as mok.bench "
        "layer draws it; --seed, --mechanism, --granularity and --kernel-profile apply to the "
        "unfused model only)",
    )
    f.add_argument(
        "--fused-profile",
        metavar="NAME|PATH",
        default="mok-fused-h200x2",
        help="fused-layer profile name under sim/profiles or a JSON path",
    )
    f.add_argument("--top", type=int_arg(1), default=5, help="with --fused: rows of the table")

    tr = sub.add_parser("trace", help="Chrome trace (Perfetto) of one run")
    _add_workload(tr)
    _add_config(tr)
    tr.add_argument("--out", default="build/mok-sim-trace.json", help="Chrome trace JSON")
    tr.add_argument("--csv", help="timeline records as CSV")
    tr.add_argument("--gantt", help="Gantt PNG")
    tr.add_argument("--links", help="link utilisation PNG")

    cal = sub.add_parser("calibrate", help="fit a GPU profile from a probe JSON")
    cal.add_argument("probe", help="probe JSON (python -m mok.bench probe)")
    cal.add_argument("--name", default="h200")
    cal.add_argument("--out", default="build/gpu-profile.json", help="GPU profile JSON")
    cal.add_argument("--num-sms", type=int_arg(1), default=None)
    cal.add_argument(
        "--nvlink-gbps", type=positive_float, default=None, help="datasheet, per direction"
    )

    v = sub.add_parser("validate", help="predict a measured mok kernel sweep and score it")
    v.add_argument(
        "measured",
        nargs="+",
        help="CSV(s) of mok.bench comm, of mok.bench layer / sweep (fused layer rows), of "
        "mok.bench train (training steps: the layer model's forward and backward against fwd_us, "
        "bwd_us, step_us) or of mok.bench experts (the backward's GEMM pieces alone); told apart "
        "by their columns",
    )
    v.add_argument("--profile", default="mok-comm-h200x2", help="kernel profile name or JSON")
    v.add_argument(
        "--fused-profile",
        metavar="NAME|PATH",
        default=None,
        help="fused-layer profile name or JSON (layer CSVs; default: the profile of --fused-fit, "
        f"with --refit its base; without --fused-fit {DEFAULT_FUSED_PROFILE})",
    )
    v.add_argument(
        "--fused-fit",
        choices=[f.name for f in FUSED_FITS.values()],
        default=None,
        help="fused-layer fit (sim.measured.FUSED_FITS): "
        + ", ".join(f"{f.name} ({f.profile}, EP{f.num_ranks} rows)" for f in FUSED_FITS.values())
        + ". With --refit: the rows and knobs to fit (default: the fit the profile came from). "
        "Without: validate with that fit's profile unless --fused-profile names one. Fit and "
        "validation roles are always those of the profile used",
    )
    v.add_argument(
        "--layer-model",
        action="store_true",
        help="predict the layer CSV's two-GPU fused rows with the layer model (sim.layer, the "
        "push-vs-pull model) instead of the fused model",
    )
    v.add_argument(
        "--gemm-profile",
        metavar="NAME|PATH",
        default=None,
        help="with --layer-model or a train CSV: run the layer model's GEMMs (both passes) at "
        f"this fused profile's rates (e.g. {DEFAULT_FUSED_PROFILE}, or mok-fused-h200x1 for the "
        "one-GPU train rows; SimConfig.gemm_profile); default: the GPU profile's",
    )
    v.add_argument(
        "--design-backward",
        action="store_true",
        help="a train CSV: predict the backward by the simulator's fused-backward design (comm "
        "and compute SMs overlapped, sim.layer.backward) instead of mok's serial backward as it "
        "runs at one rank (SimConfig.serial_backward, the default)",
    )
    v.add_argument("--csv", help="write the per-row predictions here")
    v.add_argument("--plot", help="PNG scatter of predicted vs measured")
    v.add_argument("--rows", action="store_true", help="list every row under its group")
    v.add_argument("--refit", action="store_true", help="refit the knobs on the CSVs' fit rows")
    v.add_argument("--save-profile", help="with --refit: write the refitted profile here")
    v.add_argument(
        "--strict",
        action="store_true",
        help="exit with status 1 when a target of the report is missed (the last line names "
        "them; without --strict a missed target still exits 0)",
    )

    b = sub.add_parser("bench", help="simulator speed benchmark (same as python -m sim.app.bench)")
    b.add_argument("--sweep-configs", type=int_arg(1), default=500)
    b.add_argument("--quick", action="store_true")
    return p


_COMMANDS = {
    None: _cmd_default,
    "compare": _cmd_compare,
    "sweep": _cmd_sweep,
    "tune": _cmd_tune,
    "trace": _cmd_trace,
    "calibrate": _cmd_calibrate,
    "bench": _cmd_bench,
    "validate": _cmd_validate,
}


def main(argv: list[str] | None = None) -> int:
    """Run one command; bad arguments exit 2 (argparse), a bad path or input file and a
    workload or config the simulator rejects print one line on stderr and return 2."""
    args = build_parser().parse_args(argv)
    try:
        check_paths(args)
        return _COMMANDS[args.cmd](args)
    except CliError as e:
        print(f"mok-sim: {e}", file=sys.stderr)
    except OSError as e:  # a file that went away or a disk that filled up after the checks
        name = e.filename if e.filename is not None else "a file"
        print(f"mok-sim: cannot access {name}: {e.strerror or e}", file=sys.stderr)
    except ValueError as e:
        print(f"mok-sim: error: {e}", file=sys.stderr)
    return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
