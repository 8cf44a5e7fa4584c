"""Chrome-trace JSON export of a simulated layer (open in https://ui.perfetto.dev).

One process per rank; threads are the rank's lanes: compute SMs, dispatch, combine and signals
(flags, fences, polls, credits: category ``signalling``, lane "flags / fences").
Link utilisation (when the run recorded it) becomes counter tracks per NVLink/NIC direction.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from sim.core.topology import RES_PER_GPU
from sim.layer.results import LayerResult

__all__ = ["chrome_trace", "write_chrome_trace", "LANES"]

LANES = {
    "schedule": 0,
    "shared_expert": 0,
    "gemm": 0,
    "reduce": 0,
    "dispatch": 1,
    "combine": 2,
    "signal": 3,
    "credit": 3,
    # the backward (sim.layer.backward): its transfers in the lanes of the forward's roles
    "wgrad": 0,
    "rev_combine": 1,
    "rev_dispatch": 2,
}
LANE_NAMES = ("compute SMs", "dispatch (comm SMs)", "combine (comm SMs)", "flags / fences")


def chrome_trace(result: LayerResult, max_counter_points: int = 20000) -> dict:
    events: list[dict] = []
    ranks = sorted({r["rank"] for r in result.records()} - {-1})
    for r in ranks:
        events.append({"ph": "M", "name": "process_name", "pid": r, "args": {"name": f"rank {r}"}})
        for i, name in enumerate(LANE_NAMES):
            events.append(
                {"ph": "M", "name": "thread_name", "pid": r, "tid": i, "args": {"name": name}}
            )
    for rec in result.records():
        if rec["duration_us"] <= 0:
            continue
        pids = ranks if rec["rank"] < 0 else [rec["rank"]]
        for pid in pids:
            events.append(
                {
                    "ph": "X",
                    "name": rec["phase"] + (f" {rec['round']}" if rec["round"] >= 0 else ""),
                    "cat": rec["category"],
                    "pid": pid,
                    "tid": LANES.get(rec["phase"], 3),
                    "ts": rec["start_us"],
                    "dur": rec["duration_us"],
                    "args": {"payload_bytes": rec["payload_bytes"], "round": rec["round"]},
                }
            )
    events += _link_counters(result, max_counter_points)
    return {
        "traceEvents": events,
        "displayTimeUnit": "ns",
        "otherData": {
            "workload": result.workload.label(),
            "config": result.config.label(),
            "layer_us": result.layer_us,
            "signal_rank_us": result.signalling_per_rank()[0],
            "nvl_util_mean": result.nvlink_utilisation()[0],
            "nvl_util_max": result.nvlink_utilisation()[1],
        },
    }


def _link_counters(result: LayerResult, max_points: int) -> list[dict]:
    """Counter events whenever a port's utilisation changes (NVLink / NIC, per direction)."""
    run, topo = result.run, result.topology
    if run is None or not run.link_series:
        return []
    caps = np.asarray(topo.capacities())
    ports = [
        r
        for r in range(topo.num_gpus * RES_PER_GPU)
        if r % RES_PER_GPU != 0 and r // RES_PER_GPU < result.workload.ep and caps[r] > 0
    ]
    prev = np.full(len(ports), -1.0)
    out: list[dict] = []
    for t, used in run.link_series:
        util = np.round(used[ports] / caps[ports], 4)
        for i in np.flatnonzero(util != prev):
            r = ports[i]
            out.append(
                {
                    "ph": "C",
                    "name": topo.resource_name(r).split(".")[1],
                    "pid": r // RES_PER_GPU,
                    "ts": t,
                    "args": {"utilisation": float(util[i])},
                }
            )
        prev = util
        if len(out) >= max_points:
            break
    return out


def write_chrome_trace(result: LayerResult, path: str | Path) -> Path:
    path = Path(path)
    path.write_text(json.dumps(chrome_trace(result)))
    return path
