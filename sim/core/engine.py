"""Task graph and the lean discrete-event loop that runs it over a flow network.

A layer is a DAG of tasks. Each task starts when its last dependency ends and is one of

* ``delay``: a fixed duration (GEMM on the compute SMs, a flag crossing NVLink, a fence);
* ``join``: zero duration (a ring slot becoming free when several readers are done);
* ``transfer``: a latency, then a set of flows in the flow network; it ends when its last flow
  has moved its last byte.

Ordering on a shared server (the compute SMs of a rank run their GEMMs one after another; the comm
SMs walk their schedule in order) is expressed as a dependency on the previous task of that
server, so no task ever queues behind a busy resource: bandwidth contention is the flow
network's job.

The loop keeps a heap of delay completions and the set of active flows. Whenever the flow set
changes (a batch of simultaneous starts/ends) the max-min rates are re-solved once; between
changes every flow drains at a constant rate, so the next flow event is computed in closed form.
The solve is :func:`sim.core.flows.maxmin_dense` over dense rows of the routes when the routes
fill at least :data:`DENSE_MIN_FILL` of the (flow x touched resource) matrix, else
:func:`sim.core.flows.maxmin_sparse`; both give the bits of :func:`sim.core.flows.maxmin_rates`.
The dense path extends its demand sum while flows only start (summed afresh after one ends,
since a float sum cannot be undone exactly). The graph's successor lists and phase codes are
kept on the graph (:meth:`Graph.structure`), so re-running a graph (another SM split, the
comm-free run of the breakdown) does not rebuild them.

Why not SimPy: the process layer here is a static DAG, and a generator-per-task SimPy model of
the same graph runs several times slower (measured by ``python -m sim.app.bench``; see
:mod:`sim.core.simpy_engine`), while the flow solve is the same numba code in both.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import chain

import numpy as np
from numba import njit

from sim.core.flows import FlowTable, add_rows, maxmin_dense, maxmin_sparse

__all__ = ["Graph", "RunResult", "run_graph", "DELAY", "JOIN", "TRANSFER"]

DELAY, JOIN, TRANSFER = 0, 1, 2
# route entries per (flow x touched resource) from which the solver keeps dense rows
DENSE_MIN_FILL = 0.2
KIND_NAMES = ("delay", "join", "transfer")


class Graph:
    """Tasks with dependencies; transfers own a contiguous range of flows in ``flows``."""

    def __init__(self) -> None:
        self.kind: list[int] = []
        self.duration: list[float] = []
        # tuples: a tuple of ints leaves the garbage collector's lists, a list stays in them,
        # and a layer graph holds ~10^4 of them
        self.deps: list[tuple[int, ...]] = []
        self.flow_lo: list[int] = []
        self.flow_hi: list[int] = []
        self.rank: list[int] = []
        self.phase: list[str] = []
        self.round: list[int] = []
        self.payload_bytes: list[float] = []
        self.flows = FlowTable()
        # arrays derived from the lists above (structure(), phase_codes()); cleared by every
        # method that adds a task or a dependency
        self._derived: dict = {}

    def __len__(self) -> int:
        return len(self.kind)

    def _add(self, kind, duration, deps, rank, phase, rnd, payload=0.0, lo=0, hi=0) -> int:
        if self._derived:
            self._derived = {}
        self.kind.append(kind)
        self.duration.append(float(duration))
        self.deps.append(tuple([d for d in deps if d is not None]))
        self.flow_lo.append(lo)
        self.flow_hi.append(hi)
        self.rank.append(rank)
        self.phase.append(phase)
        self.round.append(rnd)
        self.payload_bytes.append(float(payload))
        return len(self.kind) - 1

    def delay(self, duration_us: float, deps=(), rank=-1, phase="", rnd=-1) -> int:
        if duration_us < 0:
            raise ValueError(f"negative duration {duration_us} for {phase}")
        return self._add(DELAY, duration_us, deps, rank, phase, rnd)

    def join(self, deps=(), rank=-1, phase="join", rnd=-1) -> int:
        return self._add(JOIN, 0.0, deps, rank, phase, rnd)

    def transfer(
        self,
        flows: list[tuple[float, dict[int, float]]],
        latency_us: float,
        deps=(),
        rank=-1,
        phase="",
        rnd=-1,
    ) -> int:
        """A transfer of ``flows`` ([(payload bytes, route)]) after ``latency_us``."""
        lo = len(self.flows)
        total = 0.0
        for size, route in flows:
            if size > 0:
                self.flows.add(size, route)
                total += size
        return self._add(TRANSFER, latency_us, deps, rank, phase, rnd, total, lo, len(self.flows))

    def transfer_filtered(self, flows, latency_us: float, deps=(), rank=-1, phase="", rnd=-1):
        """:meth:`transfer` of flows given as (payload bytes > 0, resources int64, coefficients
        float64 > 0): routes already in the flow table's form, added without re-checking."""
        fl = self.flows
        lo = len(fl)
        total = 0.0
        for size, res, coef in flows:
            fl.add_filtered(size, res, coef)
            total += size
        return self._add(TRANSFER, latency_us, deps, rank, phase, rnd, total, lo, len(fl))

    def add_dep(self, task: int, dep: int | None) -> None:
        if dep is not None:
            self.deps[task] = (*self.deps[task], dep)
            self._derived = {}

    def _cached(self, key: str, make):
        """``make()``, kept until a task or dependency is added through this class (and made
        again when the task count no longer matches, e.g. after lists were assigned directly;
        a list changed in place otherwise goes unnoticed)."""
        hit = self._derived.get(key)
        if hit is None or hit[0] != len(self.kind):
            hit = self._derived[key] = (len(self.kind), make())
        return hit[1]

    def structure(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """(kind, succ_ptr, succ_idx, indeg) as int64 arrays: the successors of each task in CSR
        order, sorted by successor id (callers must not modify them; the event loop gets a
        copy of indeg)."""
        return self._cached("structure", self._structure)

    def _structure(self):
        n = len(self.kind)
        indeg = np.fromiter(map(len, self.deps), dtype=np.int64, count=n)
        dst = np.fromiter(chain.from_iterable(self.deps), dtype=np.int64, count=int(indeg.sum()))
        succ_ptr, succ_idx = _successors(indeg, dst)
        return np.asarray(self.kind, dtype=np.int64), succ_ptr, succ_idx, indeg

    def flow_ranges(self) -> tuple[np.ndarray, np.ndarray]:
        """(flow_lo, flow_hi) as int64 arrays (cached as :meth:`structure`)."""
        return self._cached(
            "flow_ranges",
            lambda: (
                np.asarray(self.flow_lo, dtype=np.int64),
                np.asarray(self.flow_hi, dtype=np.int64),
            ),
        )

    def phase_codes(self) -> tuple[tuple[str, ...], np.ndarray, np.ndarray]:
        """(phase names, phase index of every task [n] int64, rank of every task [n] int64),
        names in order of first use (cached as :meth:`structure`)."""

        def make():
            names = {p: i for i, p in enumerate(dict.fromkeys(self.phase))}
            code = np.fromiter(map(names.__getitem__, self.phase), np.int64, len(self.phase))
            return tuple(names), code, np.asarray(self.rank, dtype=np.int64)

        return self._cached("phase_codes", make)

    def phase_mask(self, phases) -> np.ndarray:
        """[n] bool: the tasks whose phase is in ``phases`` (through :meth:`phase_codes`, which
        compares small ints instead of the strings of every task)."""
        names, code, _ = self.phase_codes()
        return np.isin(code, [i for i, p in enumerate(names) if p in phases])


@njit(cache=True)
def _successors(indeg, dst):  # pragma: no cover - numba
    """(succ_ptr, succ_idx): the successors of every task in CSR, each task's in increasing
    task order (a dependency listed twice, twice), from the dependencies ``dst`` of the tasks
    in order, ``indeg[t]`` of them for task t (a counting sort)."""
    n = indeg.shape[0]
    succ_ptr = np.zeros(n + 1, np.int64)
    for e in range(dst.shape[0]):
        succ_ptr[dst[e] + 1] += 1
    for t in range(n):
        succ_ptr[t + 1] += succ_ptr[t]
    fill = succ_ptr[:n].copy()
    succ_idx = np.empty(dst.shape[0], np.int64)
    e = 0
    for s in range(n):
        for _ in range(indeg[s]):
            d = dst[e]
            succ_idx[fill[d]] = s
            fill[d] += 1
            e += 1
    return succ_ptr, succ_idx


@dataclass
class RunResult:
    start_us: np.ndarray  # [num_tasks]
    end_us: np.ndarray  # [num_tasks]
    crit_pred: np.ndarray  # [num_tasks] dependency that finished last (-1: none)
    resource_bytes: np.ndarray  # [num_resources] capacity-units x us used (bytes for links)
    num_events: int
    num_solves: int
    link_series: list[tuple[float, np.ndarray]] = field(default_factory=list)

    @property
    def makespan_us(self) -> float:
        return float(self.end_us.max()) if self.end_us.size else 0.0


@njit(cache=True, error_model="numpy")
def _heap_push(ht, hc, size, t, code):  # pragma: no cover - numba
    """Binary min-heap on (time, insertion order) stored in arrays; returns the new size."""
    i = size
    ht[i] = t
    hc[i] = code
    while i > 0:
        p = (i - 1) // 2
        if ht[p] <= ht[i]:
            break
        ht[p], ht[i] = ht[i], ht[p]
        hc[p], hc[i] = hc[i], hc[p]
        i = p
    return size + 1


@njit(cache=True, error_model="numpy")
def _heap_pop(ht, hc, size):  # pragma: no cover - numba
    """Remove the top (read it before calling); returns the new size."""
    size -= 1
    ht[0] = ht[size]
    hc[0] = hc[size]
    i = 0
    while True:
        a = 2 * i + 1
        if a >= size:
            break
        b = a + 1
        c = b if b < size and ht[b] < ht[a] else a
        if ht[i] <= ht[c]:
            break
        ht[c], ht[i] = ht[i], ht[c]
        hc[c], hc[i] = hc[i], hc[c]
        i = c
    return size


@njit(cache=True, error_model="numpy")
def _event_loop(
    kind,
    dur,
    succ_ptr,
    succ_idx,
    indeg,
    flow_lo,
    flow_hi,
    ptr,
    res,
    coef,
    size,
    cap,
    start,
    end,
    crit,
    res_bytes,
    series_t,
    series_used,
    record,
    dense,
    cols,
    cres,
    nslots,
):  # pragma: no cover - numba
    n = kind.shape[0]
    nflows = size.shape[0]
    num_res = cap.shape[0]
    flow_task = np.empty(nflows, np.int64)
    for t in range(n):
        for f in range(flow_lo[t], flow_hi[t]):
            flow_task[f] = t
    pending = np.zeros(n, np.int64)
    rem = size.copy()
    act = np.empty(nflows, np.int64)
    rates = np.zeros(nflows)
    na = 0
    # the solver's resources: the compact columns (dense) or every resource (sparse)
    nc = cols.shape[0] if dense else num_res
    ccap = np.empty(nc)
    for c in range(nc):
        ccap[c] = cap[cols[c]] if dense else cap[c]
    used = np.zeros(nc)
    acc = np.zeros(nc)  # capacity x time per column, copied to res_bytes at the end
    demand = np.empty(nc)
    share = np.empty(nc)
    # dense: rows[f] is flow f's route over the columns; active flow a owns column aslot[a] of
    # hit (1 where its row is > 0; free columns are all 0, a finished flow clears its own).
    # total: the in-order sum of the rows of act[:ntotal]; extended while flows only start,
    # summed afresh after one ends
    rows = np.zeros((nflows if dense else 1, nc if dense else 1))
    if dense:
        for f in range(nflows):
            for j in range(ptr[f], ptr[f + 1]):
                rows[f, cres[j]] = coef[j]
    # slots: a multiple of 8 (hit is read 8 at a time); more active flows than slots stops the
    # loop (returns -1, the caller runs it again with more: no array changes size in the loop)
    hit = np.zeros((nc if dense else 1, nslots), np.uint8)
    work = np.empty(nslots + nflows + nc + 24, np.int64)
    mask = np.zeros(-(-nc // 8) * 8, np.uint8)
    total = np.zeros(nc)
    ntotal = 0
    free = np.empty(nslots, np.int64)
    for i in range(nslots):
        free[i] = nslots - 1 - i
    nfree = nslots if dense else 0
    aslot = np.empty(nflows, np.int64)
    left = np.empty(nflows, np.int64)
    # sparse work arrays
    ns_res = 1 if dense else num_res
    cnt = np.empty(ns_res + 1, np.int64)
    fill = np.empty(ns_res, np.int64)
    lst = np.empty(1 if dense else res.shape[0], np.int64)
    frozen = np.empty(1 if dense else nflows, np.bool_)
    sat = np.empty(ns_res, np.bool_)
    stack = np.empty(n, np.int64)  # tasks done at `now`, not yet propagated
    ns = 0
    ht = np.empty(n + 1)
    hc = np.empty(n + 1, np.int64)
    hn = 0
    now = 0.0
    dirty = False
    num_events = 0
    num_solves = 0
    for t in range(n):
        start[t] = np.nan
        end[t] = np.nan
        crit[t] = -1
    # tasks to start: reuse a queue
    queue = np.empty(n, np.int64)
    nq = 0
    for t in range(n):
        if indeg[t] == 0:
            queue[nq] = t
            nq += 1
    while True:
        # start queued tasks, propagate completions at `now`
        while nq > 0 or ns > 0:
            while nq > 0:
                nq -= 1
                t = queue[nq]
                start[t] = now
                k = kind[t]
                if k == JOIN:
                    stack[ns] = t
                    ns += 1
                elif k == DELAY or dur[t] > 0.0:
                    hn = _heap_push(ht, hc, hn, now + dur[t], t if k == DELAY else -1 - t)
                else:
                    if flow_hi[t] == flow_lo[t]:
                        stack[ns] = t
                        ns += 1
                    else:
                        pending[t] = flow_hi[t] - flow_lo[t]
                        for f in range(flow_lo[t], flow_hi[t]):
                            act[na] = f
                            aslot[na] = -1
                            na += 1
                        dirty = True
            while ns > 0:
                ns -= 1
                t = stack[ns]
                end[t] = now
                for i in range(succ_ptr[t], succ_ptr[t + 1]):
                    s = succ_idx[i]
                    indeg[s] -= 1
                    if indeg[s] == 0:
                        crit[s] = t
                        queue[nq] = s
                        nq += 1
        if dirty:
            if dense:
                for a in range(na):  # hit columns for the flows started since the last solve
                    if aslot[a] >= 0:
                        continue
                    if nfree == 0:
                        return -1, -1
                    nfree -= 1
                    sl = free[nfree]
                    aslot[a] = sl
                    f = act[a]
                    for j in range(ptr[f], ptr[f + 1]):
                        hit[cres[j], sl] = 1
                if ntotal < 0:
                    for c in range(nc):
                        total[c] = 0.0
                    ntotal = 0
                add_rows(act, ntotal, na, rows, total)
                ntotal = na
                maxmin_dense(
                    act,
                    aslot,
                    na,
                    rows,
                    hit,
                    ccap,
                    total,
                    rates,
                    used,
                    demand,
                    share,
                    left,
                    work,
                    mask,
                )
            else:
                maxmin_sparse(
                    act[:na], ptr, res, coef, cap, rates, used, demand, cnt, fill, lst, frozen, sat
                )
            if record and num_solves < series_t.shape[0] - 1:
                series_t[num_solves] = now
                for c in range(nc):
                    series_used[num_solves, cols[c] if dense else c] = used[c]
            num_solves += 1
            dirty = False
        t_flow = np.inf
        for a in range(na):
            r = rates[a]
            if r > 0.0:
                x = now + rem[act[a]] / r
                if x < t_flow:
                    t_flow = x
        t_heap = ht[0] if hn > 0 else np.inf
        if t_flow == np.inf and t_heap == np.inf:
            break
        t_next = t_flow if t_flow < t_heap else t_heap
        dt = t_next - now
        if na > 0 and dt > 0.0:
            for a in range(na):
                rem[act[a]] -= rates[a] * dt
            for c in range(nc):
                acc[c] += used[c] * dt
        now = t_next
        num_events += 1
        if na > 0 and t_flow <= t_heap:
            j = 0
            for a in range(na):
                f = act[a]
                if rem[f] <= 1e-9 * size[f] + 1e-6:
                    rem[f] = 0.0
                    t = flow_task[f]
                    pending[t] -= 1
                    if pending[t] == 0:
                        stack[ns] = t
                        ns += 1
                    dirty = True
                    sl = aslot[a]
                    if dense and sl >= 0:  # clear its hit column and free it
                        for q in range(ptr[f], ptr[f + 1]):
                            hit[cres[q], sl] = 0
                        free[nfree] = sl
                        nfree += 1
                        ntotal = -1  # total holds a finished flow
                else:
                    act[j] = f
                    rates[j] = rates[a]
                    aslot[j] = aslot[a]
                    j += 1
            na = j
        while hn > 0 and ht[0] <= now:
            code = hc[0]
            hn = _heap_pop(ht, hc, hn)
            if code >= 0:
                stack[ns] = code
                ns += 1
            else:
                t = -1 - code
                if flow_hi[t] == flow_lo[t]:
                    stack[ns] = t
                    ns += 1
                else:
                    pending[t] = flow_hi[t] - flow_lo[t]
                    for f in range(flow_lo[t], flow_hi[t]):
                        act[na] = f
                        aslot[na] = -1
                        na += 1
                    dirty = True
    for c in range(nc):
        res_bytes[cols[c] if dense else c] = acc[c]
    if record:
        series_t[num_solves] = now
    return num_events, num_solves


_NO_FLOWS = FlowTable()


def run_graph(
    graph: Graph,
    capacities,
    record_series: bool = False,
    free_transfers: bool = False,
) -> RunResult:
    """Run ``graph`` to completion; ``capacities`` [R] per flow-network resource.

    ``free_transfers``: run it with communication free instead, every transfer a zero-time
    delay (no latency, no flows, ``capacities`` unused; :func:`sim.layer.results.comm_free_run`).
    """
    n = len(graph)
    kind, succ_ptr, succ_idx, indeg0 = graph.structure()
    dur = np.asarray(graph.duration, dtype=np.float64)
    if free_transfers:
        is_transfer = kind == TRANSFER
        kind = np.where(is_transfer, DELAY, kind)
        dur[is_transfer] = 0.0
        capacities = np.ones(1)
        flow_lo = flow_hi = np.zeros(n, dtype=np.int64)
        table = _NO_FLOWS
    else:
        flow_lo, flow_hi = graph.flow_ranges()
        table = graph.flows
    cap = np.asarray(capacities, dtype=np.float64)
    ptr, res, coef, size = table.arrays()
    start = np.empty(n)
    end = np.empty(n)
    crit = np.empty(n, dtype=np.int64)
    res_bytes = np.zeros(cap.shape[0])
    max_series = 2 * len(size) + n + 2 if record_series else 1
    series_t = np.zeros(max_series)
    series_used = np.zeros((max_series, cap.shape[0]) if record_series else (1, 1))
    cols, cres, dup = table.columns()
    # dense rows unless the routes are sparse in the columns they touch (one flow per peer)
    dense = not dup and res.shape[0] >= DENSE_MIN_FILL * size.shape[0] * cols.shape[0]
    dense = dense and size.shape[0] > 0
    nslots = 128  # slots for the active flows of the dense solver, doubled until they suffice
    num_events = -1
    while num_events < 0:
        num_events, num_solves = _event_loop(
            kind,
            dur,
            succ_ptr,
            succ_idx,
            indeg0.copy(),
            flow_lo,
            flow_hi,
            ptr,
            res,
            coef,
            size,
            cap,
            start,
            end,
            crit,
            res_bytes,
            series_t,
            series_used,
            record_series,
            dense,
            cols,
            cres,
            nslots,
        )
        nslots *= 2
    series = []
    if record_series:
        series = [(float(series_t[i]), series_used[i]) for i in range(num_solves)]
        series.append((float(series_t[num_solves]), np.zeros(cap.shape[0])))
    if np.isnan(end).any():
        bad = int(np.flatnonzero(np.isnan(end))[0])
        raise RuntimeError(
            f"task graph deadlocked: task {bad} ({graph.phase[bad]}, rank {graph.rank[bad]}, "
            f"round {graph.round[bad]}) never ran; check ring capacity / dependencies"
        )
    return RunResult(start, end, crit, res_bytes, int(num_events), int(num_solves), series)
