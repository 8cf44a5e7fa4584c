"""Results of a simulated layer as flat records (-> CSV / DataFrame) and a time breakdown.

The breakdown walks the critical path back from the last task to finish: each task's
"critical predecessor" is the dependency that ended last (the one it actually waited for), so the
path's durations add up exactly to the layer time. They are summed by category:

* ``gemm_us``: compute SMs busy (shared expert, expert FFNs, final weighted sum);
* ``exposed_comm_us``: dispatch/combine transfers nothing could hide;
* ``signalling_us``: flags, fences, credits and polls;
* ``schedule_us``: the schedule build at the start.

``compute_idle_frac`` is the mean fraction of the layer the compute SMs of a rank sit idle.
"""

from __future__ import annotations

import csv
import io
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from sim.config import SimConfig, Workload
from sim.core.engine import KIND_NAMES, Graph, RunResult
from sim.core.topology import RES_PER_GPU, Topology

__all__ = ["LayerResult", "write_csv", "PHASE_CATEGORY"]

PHASE_CATEGORY = {
    "schedule": "schedule",
    "shared_expert": "gemm",
    "gemm": "gemm",
    "reduce": "gemm",
    "dispatch": "exposed_comm",
    "combine": "exposed_comm",
    "signal": "signalling",
    "credit": "signalling",
    "slot_free": "signalling",
}
COMPUTE_PHASES = ("shared_expert", "gemm", "reduce")
CATEGORIES = ("gemm", "exposed_comm", "signalling", "schedule")


@dataclass
class LayerResult:
    workload: Workload
    config: SimConfig
    layer_us: float
    breakdown: dict[str, float]
    compute_busy_us: np.ndarray  # [ep]
    rank_done_us: np.ndarray  # [ep] when each rank's output is complete
    payload_bytes: dict[str, float]  # payload moved over nvlink / nic / locally
    link_bytes: np.ndarray  # [num_resources] wire bytes per resource (engine: busy us)
    topology: Topology
    num_tasks: int
    num_flows: int
    num_events: int
    num_solves: int
    build_s: float
    run_s: float
    graph: Graph | None = field(default=None, repr=False)
    run: RunResult | None = field(default=None, repr=False)

    @classmethod
    def from_run(
        cls,
        wl: Workload,
        cfg: SimConfig,
        graph: Graph,
        run: RunResult,
        topo: Topology,
        payload_bytes: dict[str, float],
        build_s: float,
        run_s: float,
    ) -> LayerResult:
        end, start = run.end_us, run.start_us
        last = int(np.argmax(end))
        cats = dict.fromkeys(CATEGORIES, 0.0)
        t = last
        while t >= 0:
            cat = PHASE_CATEGORY.get(graph.phase[t], "signalling")
            cats[cat] += float(end[t] - start[t])
            t = int(run.crit_pred[t])
        busy = np.zeros(wl.ep)
        phase = np.asarray(graph.phase)
        rank = np.asarray(graph.rank)
        dur = end - start
        for p in COMPUTE_PHASES:
            sel = phase == p
            np.add.at(busy, rank[sel], dur[sel])
        done = np.zeros(wl.ep)
        sel = phase == "reduce"
        done[rank[sel]] = end[sel]
        return cls(
            workload=wl,
            config=cfg,
            layer_us=float(end[last]),
            breakdown={f"{k}_us": v for k, v in cats.items()},
            compute_busy_us=busy,
            rank_done_us=done,
            payload_bytes=dict(payload_bytes),
            link_bytes=run.resource_bytes,
            topology=topo,
            num_tasks=len(graph),
            num_flows=len(graph.flows),
            num_events=run.num_events,
            num_solves=run.num_solves,
            build_s=build_s,
            run_s=run_s,
            graph=graph,
            run=run,
        )

    @property
    def compute_idle_frac(self) -> float:
        return float(1.0 - self.compute_busy_us.mean() / self.layer_us) if self.layer_us else 0.0

    @property
    def nvlink_payload_gbps_per_rank(self) -> float:
        """NVLink payload bytes (not protocol, not self copies) per rank per layer second."""
        if not self.layer_us:
            return 0.0
        return self.payload_bytes["nvlink"] / self.workload.ep / (self.layer_us * 1e3)

    def summary(self) -> dict:
        """One flat row: workload, config, layer time and its breakdown."""
        row = {**self.workload.to_dict()}
        row.update(
            {
                k: v
                for k, v in self.config.to_dict().items()
                if k
                in (
                    "dispatch_mode",
                    "combine_mode",
                    "num_comm_sms",
                    "minibatch_size",
                    "macrobatch_size",
                    "row_tile",
                    "mechanism",
                    "dtype",
                )
            }
        )
        row["layer_us"] = round(self.layer_us, 3)
        row["mean_rank_us"] = round(float(self.rank_done_us.mean()), 3)
        row.update({k: round(v, 3) for k, v in self.breakdown.items()})
        row["compute_idle_frac"] = round(self.compute_idle_frac, 4)
        row["nvlink_payload_mb"] = round(self.payload_bytes["nvlink"] / 1e6, 3)
        row["nic_payload_mb"] = round(self.payload_bytes["nic"] / 1e6, 3)
        row["nvlink_gbps_per_rank"] = round(self.nvlink_payload_gbps_per_rank, 2)
        row["events"] = self.num_events
        row["sim_wall_s"] = round(self.build_s + self.run_s, 4)
        return row

    def records(self) -> list[dict]:
        """Per-rank, per-phase timeline rows (one per task with a rank and a duration)."""
        g, r = self.graph, self.run
        out = []
        for t in range(len(g)):
            if g.kind[t] == 1:  # joins carry no time
                continue
            out.append(
                {
                    "rank": g.rank[t],
                    "phase": g.phase[t],
                    "category": PHASE_CATEGORY.get(g.phase[t], "signalling"),
                    "round": g.round[t],
                    "kind": KIND_NAMES[g.kind[t]],
                    "start_us": float(r.start_us[t]),
                    "end_us": float(r.end_us[t]),
                    "duration_us": float(r.end_us[t] - r.start_us[t]),
                    "payload_bytes": g.payload_bytes[t],
                }
            )
        return out

    def link_records(self) -> list[dict]:
        """Link utilisation per direction over time (needs ``record_links=True``): one row per
        interval and NVLink/NIC port with non-zero load."""
        if not self.run or not self.run.link_series:
            return []
        caps = np.asarray(self.topology.capacities())
        out = []
        series = self.run.link_series
        for (t0, used), (t1, _) in zip(series[:-1], series[1:], strict=True):
            if t1 <= t0:
                continue
            for res in np.flatnonzero(used > 0):
                if res < self.topology.num_gpus * RES_PER_GPU and res % RES_PER_GPU == 0:
                    continue  # engines are not links
                out.append(
                    {
                        "resource": self.topology.resource_name(int(res)),
                        "start_us": float(t0),
                        "end_us": float(t1),
                        "utilisation": float(used[res] / caps[res]) if caps[res] else 0.0,
                    }
                )
        return out

    def link_bytes_by_name(self) -> dict[str, float]:
        return {
            self.topology.resource_name(i): float(b)
            for i, b in enumerate(self.link_bytes)
            if b > 0 and not (i < self.topology.num_gpus * RES_PER_GPU and i % RES_PER_GPU == 0)
        }


def write_csv(rows: list[dict], path: str | Path | None = None) -> str:
    """Write flat records as CSV (to ``path`` if given); returns the CSV text."""
    buf = io.StringIO()
    if rows:
        keys = list(rows[0])
        for r in rows[1:]:
            for k in r:
                if k not in keys:
                    keys.append(k)
        w = csv.DictWriter(buf, fieldnames=keys)
        w.writeheader()
        w.writerows(rows)
    text = buf.getvalue()
    if path is not None:
        Path(path).write_text(text)
    return text
