"""Simulator speed benchmark: ``python -m sim.app.bench`` (also ``mok-sim bench``).

1. one forward layer of Kimi-K2 (384 experts, top-8), 4096 tokens per rank, EP64 on gb300-nvl72,
   minibatch 2048: routing trace, routing plan, graph build and event loop timed separately; the
   first simulation in the process includes loading (or compiling) the numba functions;
2. the same graph run by the SimPy engine (:mod:`sim.core.simpy_engine`), for the lean-loop choice;
3. a sweep of N configs (default 500: 5 policy pairs x 5 comm-SM counts x 4 minibatches x 5 ring
   sizes) of the same workload over all CPUs (``--jobs 1``: in this process), with events per
   second. Configs that differ only in comm SMs share one task graph (re-timed), and those that
   differ only in the ring size one build (copied, see :func:`sim.layer.model.simulate_many`).

Prints a table; ``--csv`` appends machine-readable rows. The models are imported inside
:func:`main`, after its clock starts, so that the first timing includes loading them.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time

from sim.app.cli_args import int_arg, skew_arg

__all__ = ["main"]

WORKLOAD = dict(shape="kimi-k2", tokens_per_rank=4096, ep=64, topology="gb300-nvl72")


def _sweep_configs(n: int):
    from sim.layer.sweep import grid

    # 5 policy pairs x 5 comm-SM counts x 4 minibatches x 5 ring sizes = 500
    cfgs = grid(
        ("pull", "push", "dedup_pull"),
        ("push", "pull"),
        (8, 16, 24, 32, 48),
        (1024, 2048, 4096, 8192),
        (1, 2, 3, 4, 6),
    )
    while len(cfgs) < n:  # more than the grid: repeat it with a 64-row GEMM tile
        cfgs += [c.replace(row_tile=64) for c in cfgs[: n - len(cfgs)]]
    return cfgs[:n]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m sim.app.bench", description=__doc__.split("\n")[0])
    p.add_argument("--sweep-configs", type=int_arg(1), default=500)
    p.add_argument("--jobs", type=int_arg(1), default=None, help="sweep workers (default: CPUs)")
    p.add_argument("--skew", type=skew_arg, default="uniform")
    p.add_argument("--quick", action="store_true", help="skip the SimPy run, 40-config sweep")
    p.add_argument("--csv", help="append result rows to this CSV")
    a = p.parse_args(argv)

    t0 = time.perf_counter()
    from sim.config import SimConfig, Workload
    from sim.core.engine import run_graph
    from sim.layer.model import LayerBuilder, simulate
    from sim.layer.plan import RoutingPlan
    from sim.layer.sweep import sweep

    t_import = time.perf_counter() - t0
    wl = Workload(**WORKLOAD, skew=a.skew)
    cfg = SimConfig(minibatch_size=2048, macrobatch_size=8192, num_comm_sms=24)
    rows = []

    def row(what: str, seconds: float, note: str = "") -> None:
        rows.append({"what": what, "seconds": round(seconds, 4), "note": note})
        print(f"  {what:<46}{seconds:>9.3f} s  {note}")

    print(f"mok-sim bench on {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs")
    print(f"workload: {wl.label()}, config: {cfg.label()}")
    row("import sim", t_import)
    t = time.perf_counter()
    trace = wl.make_trace()
    row("routing trace (mok.spec.workload.make_routing)", time.perf_counter() - t)
    t = time.perf_counter()
    plan = RoutingPlan(trace, cfg.row_tile)
    plan.rounds(cfg.minibatch_size)
    row("routing plan (positions, rows per round)", time.perf_counter() - t)
    t = time.perf_counter()
    first = simulate(wl, cfg, plan)
    row("first layer simulation (incl. numba load/JIT)", time.perf_counter() - t)
    warm, builds, runs = [], [], []
    for _ in range(3):
        t = time.perf_counter()
        r = simulate(wl, cfg, plan)
        warm.append(time.perf_counter() - t)
        builds.append(r.build_s)
        runs.append(r.run_s)
    med = statistics.median(warm)
    ev_rate = r.num_events / statistics.median(runs)
    row(
        "one layer, warm (median of 3)",
        med,
        f"build {statistics.median(builds):.3f} s + event loop {statistics.median(runs):.3f} s; "
        f"{r.num_tasks} tasks, {r.num_flows} flows, {r.num_events} events, "
        f"{r.num_solves} max-min solves, {ev_rate:,.0f} events/s; target < 0.1 s",
    )
    row(
        "one layer end to end (trace+plan+warm sim)",
        rows[1]["seconds"] + rows[2]["seconds"] + med,
        "target < 2 s",
    )
    print(f"  predicted layer time {first.layer_us:.1f} us")

    if not a.quick:
        from sim.core.simpy_engine import run_graph_simpy

        b = LayerBuilder(wl, cfg, plan)
        g = b.build()
        caps = b.topo.capacities(b.gpu)
        t = time.perf_counter()
        lean = run_graph(g, caps)
        t_lean = time.perf_counter() - t
        t = time.perf_counter()
        sp = run_graph_simpy(g, caps)
        t_simpy = time.perf_counter() - t
        same = abs(sp.makespan_us - lean.makespan_us) <= 1e-6 * lean.makespan_us
        row("same graph, lean numba event loop", t_lean)
        row(
            "same graph, SimPy processes",
            t_simpy,
            f"{t_simpy / t_lean:.0f}x slower; same layer time: {same}",
        )

    n = 40 if a.quick else a.sweep_configs
    cfgs = _sweep_configs(n)
    jobs = a.jobs or os.cpu_count() or 1
    t = time.perf_counter()
    res = sweep(wl, cfgs, jobs=jobs, progress=True)
    dt = time.perf_counter() - t
    events = sum(x["events"] for x in res)
    row(
        f"sweep of {len(cfgs)} configs, {jobs} workers",
        dt,
        f"{dt / len(cfgs) * jobs:.3f} s per config per worker, {events / dt:,.0f} events/s "
        f"overall; target < 20 s for 500 on 2 cores",
    )
    best = min(res, key=lambda x: x["layer_us"])
    print(
        f"  sweep best: {best['dispatch_mode']}/{best['combine_mode']} "
        f"sms={best['num_comm_sms']} mb={best['minibatch_size']} "
        f"ring={best['macrobatch_size']} -> {best['layer_us']:.1f} us"
    )
    if a.csv:
        from sim.layer.results import write_csv

        write_csv(rows, a.csv)
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
