"""The same task graph run by SimPy processes: a cross-check of :mod:`sim.core.engine` and the
measurement behind choosing the lean loop (``python -m sim.app.bench`` prints both).

Every task is a SimPy process that waits for ``AllOf`` its dependencies; transfers hand their
flows to :class:`FlowNet`, which re-solves the max-min rates (the same numba solver) whenever a
flow starts or ends and arms one timer for the next completion.
"""

from __future__ import annotations

import numpy as np
import simpy

from sim.core.engine import DELAY, JOIN, Graph, RunResult
from sim.core.flows import maxmin_rates

__all__ = ["run_graph_simpy"]


class FlowNet:
    def __init__(self, env: simpy.Environment, graph: Graph, cap: np.ndarray) -> None:
        self.env = env
        self.ptr, self.res, self.coef, self.size = graph.flows.arrays()
        self.cap = cap
        self.rem = self.size.copy()
        self.flow_task = np.empty(self.size.shape[0], dtype=np.int64)
        for t in range(len(graph)):
            self.flow_task[graph.flow_lo[t] : graph.flow_hi[t]] = t
        self.active = np.empty(0, dtype=np.int64)
        self.rates = np.empty(0)
        self.used = np.zeros(cap.shape[0])
        self.res_bytes = np.zeros(cap.shape[0])
        self.pending: dict[int, int] = {}
        self.events: dict[int, simpy.Event] = {}
        self.t_last = 0.0
        self.version = 0
        self.num_solves = 0
        self.num_events = 0

    def _advance(self) -> None:
        dt = self.env.now - self.t_last
        if dt > 0 and self.active.size:
            self.rem[self.active] -= self.rates * dt
            self.res_bytes += self.used * dt
        self.t_last = self.env.now

    def _resolve(self) -> None:
        self.version += 1
        self.rates = np.zeros(self.active.size)
        if not self.active.size:
            return
        maxmin_rates(self.active, self.ptr, self.res, self.coef, self.cap, self.rates, self.used)
        self.num_solves += 1
        with np.errstate(divide="ignore"):
            dt = float(np.min(self.rem[self.active] / self.rates))
        if np.isfinite(dt):
            ev = self.env.timeout(max(dt, 0.0))
            v = self.version
            ev.callbacks.append(lambda _e, v=v: self._on_timer(v))

    def _on_timer(self, version: int) -> None:
        if version != self.version:
            return  # the flow set changed since this timer was armed
        self.num_events += 1
        self._advance()
        act = self.active
        fin = self.rem[act] <= 1e-9 * self.size[act] + 1e-6
        self.rem[act[fin]] = 0.0
        self.active = act[~fin]
        for f in act[fin].tolist():
            t = int(self.flow_task[f])
            self.pending[t] -= 1
            if self.pending[t] == 0:
                self.events.pop(t).succeed()
        self._resolve()

    def transfer(self, task: int, lo: int, hi: int) -> simpy.Event:
        self._advance()
        ev = self.env.event()
        self.events[task] = ev
        self.pending[task] = hi - lo
        self.active = np.concatenate([self.active, np.arange(lo, hi, dtype=np.int64)])
        self._resolve()
        return ev


def run_graph_simpy(graph: Graph, capacities) -> RunResult:
    env = simpy.Environment()
    cap = np.asarray(capacities, dtype=np.float64)
    net = FlowNet(env, graph, cap)
    n = len(graph)
    done = [env.event() for _ in range(n)]
    start = np.full(n, np.nan)
    end = np.full(n, np.nan)
    crit = np.full(n, -1, dtype=np.int64)

    def task(t: int):
        deps = graph.deps[t]
        if deps:
            yield simpy.AllOf(env, [done[d] for d in deps])
            crit[t] = max(deps, key=lambda d: (end[d], d))
        start[t] = env.now
        k = graph.kind[t]
        if k == DELAY:
            yield env.timeout(graph.duration[t])
        elif k != JOIN:
            if graph.duration[t] > 0:
                yield env.timeout(graph.duration[t])
            lo, hi = graph.flow_lo[t], graph.flow_hi[t]
            if hi > lo:
                yield net.transfer(t, lo, hi)
        end[t] = env.now
        done[t].succeed()

    for t in range(n):
        env.process(task(t))
    env.run()
    return RunResult(start, end, crit, net.res_bytes, net.num_events, net.num_solves)
