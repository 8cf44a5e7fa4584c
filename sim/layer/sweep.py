"""Seeded experiment driver: grids of configs, parallel sweeps, comparisons and the tuner.

Sweeps run in worker processes (``jobs``); each worker builds the routing plan of the workload
once (same seed -> same trace) and simulates its share of the configs. Rows come back in grid
order, so a sweep is deterministic whatever ``jobs`` is.
"""

from __future__ import annotations

import itertools
import multiprocessing as mp
import os
from collections.abc import Iterable, Sequence

from sim.config import COMBINE_MODES, DISPATCH_MODES, SimConfig, Workload
from sim.layer.model import check_kernel_profile, plan_for, simulate_many
from sim.layer.results import LayerResult

__all__ = ["grid", "sweep", "rank_rows", "compare", "tune", "COMPARE_POLICIES", "TUNE_SPACE"]


# (dispatch, combine) pairs of the comparison table: all-push (DeepEP-style), MoK (pull
# dispatch, push combine), all-pull, and our dedup-aware pull.
COMPARE_POLICIES = (("push", "push"), ("pull", "push"), ("pull", "pull"), ("dedup_pull", "push"))

TUNE_SPACE = {
    "dispatch_mode": DISPATCH_MODES,
    "combine_mode": COMBINE_MODES,
    "num_comm_sms": (8, 16, 24, 32, 48),
    "minibatch_size": (1024, 2048, 4096, 8192),
    "ring_slots": (2, 4),
}


def grid(
    dispatch_modes: Iterable[str] = DISPATCH_MODES,
    combine_modes: Iterable[str] = COMBINE_MODES,
    num_comm_sms: Iterable[int] = (16, 24, 32),
    minibatch_sizes: Iterable[int] = (2048, 4096),
    ring_slots: Iterable[int] = (2, 4),
    base: SimConfig | None = None,
) -> list[SimConfig]:
    """Cartesian product of the given values, in a fixed order; dedup_pull only with its push
    combine."""
    base = base or SimConfig()
    out = []
    for dm, cm, n, mb, rs in itertools.product(
        dispatch_modes, combine_modes, num_comm_sms, minibatch_sizes, ring_slots
    ):
        if dm == "dedup_pull" and cm != "push":
            continue
        cfg = base.replace(
            dispatch_mode=dm,
            combine_mode=cm,
            num_comm_sms=n,
            minibatch_size=mb,
            macrobatch_size=mb * rs,
        )
        out.append(check_kernel_profile(cfg))
    return out


_WORKER: dict = {}


def _init_worker(wl: Workload) -> None:
    _WORKER["wl"] = wl
    _WORKER["plans"] = {}


def _run_group(cfgs: list[SimConfig]) -> list[dict]:
    wl = _WORKER["wl"]
    plans = _WORKER["plans"]
    tile = cfgs[0].row_tile
    if tile not in plans:
        plans[tile] = plan_for(wl, tile)
    return [r.summary() for r in simulate_many(wl, cfgs, plans[tile])]


def _work_key(cfg: SimConfig) -> SimConfig:
    return cfg.replace(num_comm_sms=1, macrobatch_size=cfg.minibatch_size)


def sweep(
    wl: Workload,
    configs: Sequence[SimConfig],
    jobs: int | None = None,
    progress: bool = True,
) -> list[dict]:
    """Simulate every config on ``wl``; one summary row per config, in input order."""
    from tqdm import tqdm

    for c in configs:  # a bad kernel profile fails here, not in a worker
        check_kernel_profile(c)
    jobs = jobs or min(os.cpu_count() or 1, len(configs)) or 1
    # configs that differ only in comm SMs share a task graph, and those that differ only in
    # the ring size share its build (sim.layer.model.simulate_many): one work item
    groups: dict[SimConfig, list[int]] = {}
    for i, c in enumerate(configs):
        groups.setdefault(_work_key(c), []).append(i)
    items = [[configs[i] for i in idx] for idx in groups.values()]
    bar = tqdm(total=len(configs), disable=not progress, desc=wl.label(), unit="cfg")
    out: list[dict | None] = [None] * len(configs)
    order = list(groups.values())
    if jobs <= 1 or len(items) < 2:
        _init_worker(wl)
        results = map(_run_group, items)
        pool = None
    else:
        ctx = mp.get_context("fork" if "fork" in mp.get_all_start_methods() else "spawn")
        pool = ctx.Pool(jobs, initializer=_init_worker, initargs=(wl,))
        results = pool.imap(_run_group, items)
    try:
        for idx, rows in zip(order, results, strict=True):
            for i, r in zip(idx, rows, strict=True):
                out[i] = r
            bar.update(len(rows))
    finally:
        if pool is not None:
            pool.close()
            pool.join()
    bar.close()
    return [r for r in out if r is not None]


def compare(
    wl: Workload, base: SimConfig | None = None, policies=COMPARE_POLICIES, plan=None
) -> list[LayerResult]:
    """Simulate ``wl`` under each (dispatch, combine) pair with otherwise equal config."""
    base = base or SimConfig()
    plan = plan or plan_for(wl, base.row_tile)
    cfgs = [
        check_kernel_profile(base.replace(dispatch_mode=d, combine_mode=c)) for d, c in policies
    ]
    return list(simulate_many(wl, cfgs, plan))


# On a full tie (typically a dispatch hidden entirely behind the GEMMs) prefer pull: it needs
# no cross-GPU flags and its cost does not grow with the number of peers; then MoK's push combine.
_TIE_DISPATCH = ("pull", "dedup_pull", "push")
_TIE_COMBINE = ("push", "pull")


def _key(row: dict) -> tuple:
    # best layer time first; on a tie (the slowest rank is compute bound whatever the policy),
    # the config whose ranks finish earlier on average, then fewer comm SMs, a smaller ring and
    # the policy order above
    return (
        row["layer_us"],
        row["mean_rank_us"],
        row["num_comm_sms"],
        row["macrobatch_size"],
        row["minibatch_size"],
        _TIE_DISPATCH.index(row["dispatch_mode"]),
        _TIE_COMBINE.index(row["combine_mode"]),
    )


def rank_rows(rows: Sequence[dict]) -> list[dict]:
    """Sweep rows best first (layer time, then the tie-breaks of the tuner)."""
    return sorted(rows, key=_key)


def tune(
    wl: Workload,
    space: dict | None = None,
    jobs: int | None = None,
    progress: bool = True,
    base: SimConfig | None = None,
) -> tuple[SimConfig, list[dict]]:
    """Exhaustive search over ``space`` (default :data:`TUNE_SPACE`); returns the best config and
    all rows sorted best first."""
    space = dict(TUNE_SPACE, **(space or {}))
    configs = grid(
        space["dispatch_mode"],
        space["combine_mode"],
        space["num_comm_sms"],
        space["minibatch_size"],
        space["ring_slots"],
        base,
    )
    rows = rank_rows(sweep(wl, configs, jobs, progress))
    best = rows[0]
    cfg = (base or SimConfig()).replace(
        dispatch_mode=best["dispatch_mode"],
        combine_mode=best["combine_mode"],
        num_comm_sms=best["num_comm_sms"],
        minibatch_size=best["minibatch_size"],
        macrobatch_size=best["macrobatch_size"],
    )
    return cfg, rows
