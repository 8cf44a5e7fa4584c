"""Results of a simulated layer as flat records (-> CSV / DataFrame) and a time breakdown.

The breakdown splits the layer time into four terms that add up to it:

* ``exposed_comm_us``: layer time minus the layer time re-simulated with communication free
  (:func:`comm_free_run`: every dispatch / combine transfer takes zero time, flags, fences,
  credits, polls and compute keep theirs), i.e. what removing the transfers would save;
* ``gemm_us``, ``signalling_us``, ``schedule_us``: the critical path of that comm-free run,
  walked back from its last task (each task's "critical predecessor" is the dependency that ended
  last), summed by category: compute SMs (shared expert, expert FFNs and their last-wave tails,
  final weighted sum), flags / fences / credits / polls, and the schedule build. They add up to
  the comm-free layer time.

``path_comm_us`` keeps the older reading: the transfer time on the critical path of the real run
(what the combine chain waits for), which overstates what communication costs when the compute
would have waited anyway. ``compute_idle_frac`` is the mean fraction of the layer the compute SMs
of a rank sit idle.

Two per-mode terms that the layer time can hide: ``signal_rank_us`` (:meth:`LayerResult.
signalling_per_rank`), the time a rank spends in signalling tasks (push: fence with its drain,
jitter and flag, the poll sweep over one flag per sender, credits; pull: local completion flags,
the combine's ready flags and slot-release flags) summed over the layer, mean and max over
ranks, whether or not it is on the critical path; and ``nvl_util_mean`` / ``nvl_util_max``
(:meth:`LayerResult.nvlink_utilisation`), the wire bytes each NVLink port direction of an EP rank
carried over the layer divided by what it could carry in ``layer_us`` (incast losses count as
wire bytes, so a push port under incast reads busier for the same payload).
"""

from __future__ import annotations

import csv
import io
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from sim.config import SimConfig, Workload
from sim.core.engine import KIND_NAMES, Graph, RunResult, run_graph
from sim.core.topology import RES_PER_GPU, Topology

__all__ = ["LayerResult", "write_csv", "PHASE_CATEGORY", "comm_free_run", "critical_path"]

PHASE_CATEGORY = {
    "schedule": "schedule",
    "shared_expert": "gemm",
    "gemm": "gemm",
    "gemm_tail": "gemm",
    "reduce": "gemm",
    "dispatch": "exposed_comm",
    "combine": "exposed_comm",
    # the backward (sim.layer.backward): weight gradients, reverse combine / dispatch
    "wgrad": "gemm",
    "wgrad_tail": "gemm",
    "rev_combine": "exposed_comm",
    "rev_dispatch": "exposed_comm",
    "signal": "signalling",
    "credit": "signalling",
    "slot_free": "signalling",
}
COMPUTE_PHASES = ("shared_expert", "gemm", "reduce", "wgrad")
CATEGORIES = ("gemm", "exposed_comm", "signalling", "schedule")


def comm_free_run(graph: Graph) -> RunResult:
    """``graph`` run with communication free: every transfer becomes a zero-time delay (no
    latency, no flows); the other tasks keep their durations and dependencies."""
    return run_graph(graph, np.ones(1), free_transfers=True)


def critical_path(graph: Graph, run: RunResult) -> dict[str, float]:
    """Durations on the critical path of ``run``, by category (:data:`PHASE_CATEGORY`)."""
    end, start = run.end_us, run.start_us
    cats = dict.fromkeys(CATEGORIES, 0.0)
    t = int(np.argmax(end)) if len(end) else -1
    while t >= 0:
        cats[PHASE_CATEGORY.get(graph.phase[t], "signalling")] += float(end[t] - start[t])
        t = int(run.crit_pred[t])
    return cats


@dataclass
class LayerResult:
    workload: Workload
    config: SimConfig
    layer_us: float
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
    path_comm_us: float = 0.0  # transfer time on the critical path of the real run
    # backward only (sim.layer.backward): the weight-gradient GEMMs per rank (mean, us), and
    # their tail: how long the slowest rank's dX sum waits for its wgrad after its last reverse
    # dispatch row arrived (max over ranks, us; 0 when the wgrad hides under the transfers)
    wgrad_us: float = 0.0
    wgrad_tail_us: float = 0.0
    graph: Graph | None = field(default=None, repr=False)
    run: RunResult | None = field(default=None, repr=False)
    _breakdown: dict[str, float] | None = field(default=None, repr=False)
    _signal_rank: tuple[float, float] | None = field(default=None, repr=False)

    def detach(self) -> LayerResult:
        """Compute what needs the task graph (the breakdown, the signalling per rank), then drop
        the graph and the run, so the result is small enough to send back from a worker process;
        returns ``self``."""
        self.breakdown  # noqa: B018 - computed and cached here, while the graph is still held
        self.signalling_per_rank()
        self.graph = self.run = None
        return self

    @property
    def breakdown(self) -> dict[str, float]:
        """The four terms of the module docstring (``<term>_us``), adding up to ``layer_us``.

        NOTE: computed on first use: it re-runs the graph with communication free, which costs
        as much as the simulation itself, and a tuner reading only ``layer_us`` never pays it."""
        if self._breakdown is None:
            free = comm_free_run(self.graph)
            cats = critical_path(self.graph, free)
            cats["exposed_comm"] = max(0.0, self.layer_us - free.makespan_us)
            self._breakdown = {f"{k}_us": v for k, v in cats.items()}
        return self._breakdown

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
        layer_us = float(end[last])
        path_comm = critical_path(graph, run)["exposed_comm"]
        busy = np.zeros(wl.ep)
        rank = graph.phase_codes()[2]
        dur = end - start
        for p in COMPUTE_PHASES:
            sel = graph.phase_mask((p,))
            np.add.at(busy, rank[sel], dur[sel])
        done = np.zeros(wl.ep)
        sel = graph.phase_mask(("reduce",))
        done[rank[sel]] = end[sel]
        return cls(
            workload=wl,
            config=cfg,
            layer_us=layer_us,
            path_comm_us=path_comm,
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

    def signalling_per_rank(self) -> tuple[float, float]:
        """(mean, max) over ranks of the summed duration of the rank's signalling tasks
        (:data:`PHASE_CATEGORY` "signalling"), in us; needs the graph."""
        if self._signal_rank is None:
            if self.graph is None or self.run is None:
                return (0.0, 0.0)
            rank = self.graph.phase_codes()[2]
            # a phase PHASE_CATEGORY does not list is not counted here (critical_path counts
            # it as signalling)
            sig = [p for p, c in PHASE_CATEGORY.items() if c == "signalling"]
            sel = self.graph.phase_mask(sig) & (rank >= 0)
            per = np.zeros(self.workload.ep)
            dur = self.run.end_us - self.run.start_us
            np.add.at(per, rank[sel], dur[sel])
            self._signal_rank = (float(per.mean()), float(per.max()))
        return self._signal_rank

    def nvlink_utilisation(self) -> tuple[float, float]:
        """(mean, max) over the NVLink tx and rx ports of the EP ranks of wire bytes carried /
        (port rate x layer time)."""
        if not self.layer_us:
            return (0.0, 0.0)
        caps = np.asarray(self.topology.capacities())
        ports = [
            g * RES_PER_GPU + k
            for g in range(min(self.workload.ep, self.topology.num_gpus))
            for k in (1, 2)
        ]
        ports = [p for p in ports if caps[p] > 0]
        if not ports:
            return (0.0, 0.0)
        util = np.asarray(self.link_bytes)[ports] / (caps[ports] * self.layer_us)
        return (float(util.mean()), float(util.max()))

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
        if self.config.direction != "forward":  # forward rows keep their columns
            row["direction"] = self.config.direction
            row["recompute"] = self.config.recompute
        row["layer_us"] = round(self.layer_us, 3)
        row["mean_rank_us"] = round(float(self.rank_done_us.mean()), 3)
        row.update({k: round(v, 3) for k, v in self.breakdown.items()})
        row["path_comm_us"] = round(self.path_comm_us, 3)
        if self.config.direction != "forward":
            row["wgrad_us"] = round(self.wgrad_us, 3)
            row["wgrad_tail_us"] = round(self.wgrad_tail_us, 3)
        row["compute_idle_frac"] = round(self.compute_idle_frac, 4)
        row["nvlink_payload_mb"] = round(self.payload_bytes["nvlink"] / 1e6, 3)
        row["nic_payload_mb"] = round(self.payload_bytes["nic"] / 1e6, 3)
        row["nvlink_gbps_per_rank"] = round(self.nvlink_payload_gbps_per_rank, 2)
        sig_mean, sig_max = self.signalling_per_rank()
        row["signal_rank_us"] = round(sig_mean, 3)
        row["signal_rank_max_us"] = round(sig_max, 3)
        util_mean, util_max = self.nvlink_utilisation()
        row["nvl_util_mean"] = round(util_mean, 4)
        row["nvl_util_max"] = round(util_max, 4)
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
