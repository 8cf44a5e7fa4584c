"""Dispatch and combine policies: interchangeable classes chosen by name.

Each policy adds its transfers and signals to the layer's task graph through a builder ``b``
(:class:`Builder`: what the policies use of :class:`sim.layer.model.LayerBuilder`, which knows
the topology, the comm-engine rates and the per-round row counts). Keys are ``(rank, round)``.

Dispatch produces ``ready[(d, m)]``: the task after which the GEMM of round m on rank d may start.

* push: every source stores its rows into the destination's ring, fences, then raises one flag
  per destination; the destination polls one flag per sender. A source may only write ring slot
  m once the destination freed slot m - ring_slots and told it so (a remote credit). The fence
  drains the source's outstanding stores (``b.fence_us``), each source's completion carries a
  seeded jitter (``b.completion_jitter``), so the destination's wait for the last of N sources
  grows with N, and the destination sweeps its N flags (``b.poll_us``); the N sources' stores
  into one destination port share it with the incast efficiency (``writers``).
* pull: the destination loads the rows it needs from the sources' symmetric buffers by the
  schedule; completion is local (mbarrier) and reaches the compute SMs through a GPU-scope flag.
* dedup_pull: like pull, but one NVLink row per (token, destination rank); the other rows of
  that token are local fan-out copies.

Combine consumes ``gemm_done[(d, m)]`` and produces the tasks each home rank waits on before its
final weighted sum, and frees ring slots (``b.slot_free``).

* push: the expert owner stores each output row into its unique slot on the home rank, fences,
  flags; ring slot m is free as soon as its rows are sent. Fence, jitter, polling and incast as
  for push dispatch (the home rank waits for the last of its owners).
* pull: the owner flags "outputs of round m ready"; each home rank loads them; the ring slot is
  free only after every reader says so (a remote flag back).
* with dedup_pull dispatch, the (push) combine first folds the rank-local rows of a token into
  one fp32 partial sum and moves one row per (token, rank); dedup_pull pairs only with push
  combine (as in ``mok.MoKConfig``).

The backward (:mod:`sim.layer.backward`) reuses two of them with its own phase names: the pull
(or dedup pull) dispatch as the reverse combine (``phase="rev_combine"``, no ring: the owner
keeps every round's dY and x rows for the weight gradients) and the push combine (the dedup
combine after a dedup forward) as the reverse dispatch (``phase="rev_dispatch"``). The
transfers' phase names select their kernel-profile rates (``roles``) and their breakdown
category (:data:`sim.layer.results.PHASE_CATEGORY`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import numpy as np

from sim.config import SimConfig
from sim.core.engine import Graph
from sim.layer.plan import RoundCounts

__all__ = [
    "Builder",
    "DISPATCH_POLICIES",
    "COMBINE_POLICIES",
    "get_dispatch",
    "get_combine",
    "FOLD_COPY_BYTES_PER_TRAFFIC_BYTE",
    "remote_writers",
]

# the local copy curve counts a copied byte once (one read + one write); the dedup fold's bytes
# are read + written traffic, so one traffic byte is half a copied byte (as the standalone comm
# model charges local bytes: (reads + writes) / 2)
FOLD_COPY_BYTES_PER_TRAFFIC_BYTE = 0.5


def remote_writers(rows: np.ndarray) -> np.ndarray:
    """[R_dst, rounds] number of other ranks that write rows into each destination per round,
    from ``rows`` [R_dst, rounds, R_src] (the incast count of the destination's port)."""
    has = rows > 0
    nr = has.shape[0]
    own = has[np.arange(nr), :, np.arange(nr)]  # [R, rounds]: a rank's rows to itself
    return has.sum(axis=2) - own


class Builder(Protocol):
    """What a policy reads and calls on the layer's builder (:class:`sim.layer.model.
    LayerBuilder`); a protocol, so this module does not import the layer model."""

    cfg: SimConfig
    g: Graph
    rc: RoundCounts
    num_ranks: int
    sched: int  # the schedule task
    slot_free: dict[tuple[int, int], int]  # (rank, round) -> join task that frees its ring slot
    # What the ring size (cfg.ring_slots) changes in the graph, for
    # :meth:`sim.layer.model.LayerBuilder.for_ring`, which copies a build for another ring
    # size; a dispatch policy records one of them and the combine policies do not depend on
    # the ring (a policy that does must leave both None). ring_deps (pull): (transfer, schedule
    # task, previous transfer, rank, round) of every dispatch transfer, whose ring slot is the
    # one ring-dependent input. ring_credits (push): (first credit task, end of the credit
    # tasks, (transfer, previous transfer, sender, round, destinations) of every dispatch
    # transfer).
    ring_deps: list[tuple[int, int, int | None, int, int]] | None
    ring_credits: tuple[int, int, list[tuple[int, int | None, int, int, tuple[int, ...]]]] | None
    dispatch_row_bytes: float
    combine_row_bytes: float
    combine_rows: np.ndarray  # [R_owner, max_rounds, R_home] rows the combine sends back
    flag_local: float
    flag_remote: float
    fence: float

    def transfer(
        self,
        issuer: int,
        kind: str,
        into: bool,
        peer_bytes: np.ndarray,
        local_bytes: float,
        deps: Sequence[int | None],
        rank: int,
        phase: str,
        rnd: int,
        writers: np.ndarray | None = None,
    ) -> int: ...

    def fence_delay(
        self,
        remote_bytes: float,
        extra_us: float,
        deps: Sequence[int | None],
        rank: int,
        phase: str,
        rnd: int,
    ) -> int: ...

    def poll_us(self, num_flags: int) -> float: ...

    def completion_jitter(self, tag: int, shape: tuple[int, ...]) -> np.ndarray: ...

    def combine_bytes(self, d: int, m: int) -> tuple[np.ndarray, float]: ...


class PullDispatch:
    name = "pull"
    dedup = False

    def __init__(self, phase: str = "dispatch", ring: bool = True) -> None:
        # phase: the transfers' phase name; ring: whether round m waits for ring slot
        # m - ring_slots to be free (False: the rows land in a buffer of every round)
        self.phase, self.ring = phase, ring

    def build(self, b: Builder) -> dict:
        rc = b.rc
        ready = {}
        b.ring_deps = []
        for d in range(b.num_ranks):
            prev = None
            for m in range(int(rc.num_rounds[d])):
                peer, local = self.parts(b, d, m)
                slot = b.slot_free.get((d, m - b.cfg.ring_slots)) if self.ring else None
                deps = [b.sched, prev, slot]
                t = b.transfer(d, "pull", True, peer, local, deps, d, self.phase, m)
                b.ring_deps.append((t, b.sched, prev, d, m))
                ready[(d, m)] = b.g.delay(b.flag_local, [t], d, "signal", m)
                prev = t
        return ready

    def parts(self, b: Builder, d: int, m: int) -> tuple:
        """(payload bytes from each source [R], local bytes) of round m on rank d."""
        return b.rc.rows[d, m] * b.dispatch_row_bytes, 0.0


class DedupPullDispatch(PullDispatch):
    name = "dedup_pull"
    dedup = True

    def parts(self, b: Builder, d: int, m: int) -> tuple:
        uniq = b.rc.uniq_first[d, m].copy()
        uniq[d] = 0
        local_rows = float(b.rc.rows[d, m].sum() - uniq.sum())
        return uniq * b.dispatch_row_bytes, local_rows * b.dispatch_row_bytes


class PushDispatch:
    name = "push"
    dedup = False

    def build(self, b: Builder) -> dict:
        rc = b.rc
        nr, slots = b.num_ranks, b.cfg.ring_slots
        has = rc.rows > 0  # [R_dst, max_rounds, R_src]
        first_credit = len(b.g)
        # the destination tells every sender that ring slot m is free again (remote flag)
        credit = [
            [
                b.g.delay(b.flag_remote, [b.slot_free[(d, m)]], d, "credit", m)
                if m < rc.num_rounds[d]
                else None
                for d in range(nr)
            ]
            for m in range(max(0, rc.max_rounds - slots))
        ]
        sends: list[tuple[int, int | None, int, int, tuple[int, ...]]] = []
        b.ring_credits = (first_credit, len(b.g), sends)
        sig: list[list[int | None]] = [[None] * nr for _ in range(rc.max_rounds)]
        writers = remote_writers(rc.rows)  # [R_dst, rounds]
        jitter = b.completion_jitter(0, (nr, rc.max_rounds))
        for s in range(nr):
            prev = None
            for m in range(rc.max_rounds):
                dests = np.flatnonzero(has[:, m, s]).tolist()
                if not dests:
                    continue
                deps = [b.sched, prev]
                if m >= slots:
                    cm = credit[m - slots]
                    deps += [cm[d] for d in dests]
                peer = rc.rows[:, m, s] * b.dispatch_row_bytes
                w = writers[:, m]
                t = b.transfer(s, "push", False, peer, 0.0, deps, s, "dispatch", m, writers=w)
                sends.append((t, prev, s, m, tuple(dests)))
                remote = float(peer.sum() - peer[s])
                extra = b.flag_remote + float(jitter[s, m])
                sig[m][s] = b.fence_delay(remote, extra, [t], s, "signal", m)
                prev = t
        ready = {}
        poll_us = b.cfg.flag_poll_us_per_peer  # per-flag loop cost on top of the sweep
        for d in range(nr):
            for m in range(int(rc.num_rounds[d])):
                sm = sig[m]
                deps = [sm[s] for s in np.flatnonzero(has[d, m]).tolist()]
                n = len(deps)
                ready[(d, m)] = b.g.delay(poll_us * n + b.poll_us(n), deps, d, "signal", m)
        return ready


class PushCombine:
    name = "push"

    def __init__(self, phase: str = "combine") -> None:
        self.phase = phase

    def build(self, b: Builder, gemm_done: dict) -> dict[int, list[int]]:
        rc = b.rc
        nr = b.num_ranks
        cr = b.combine_rows  # [R_owner, max_rounds, R_home]
        # writers into home s in round m: the other owners with rows for s in that round
        writers = remote_writers(np.transpose(cr, (2, 1, 0)))  # [R_home, rounds]
        fold = FOLD_COPY_BYTES_PER_TRAFFIC_BYTE if b.cfg.dedup else 1.0
        last = {}
        last_remote = {}
        for d in range(nr):
            prev = None
            for m in range(int(rc.num_rounds[d])):
                peer, local = b.combine_bytes(d, m)
                deps = [gemm_done[(d, m)], prev]
                w = writers[:, m]
                t = b.transfer(
                    d, "push", False, peer, local * fold, deps, d, self.phase, m, writers=w
                )
                b.g.add_dep(b.slot_free[(d, m)], t)
                prev = t
                last_remote[d] = float(peer.sum() - peer[d])
            last[d] = prev
        # each owner fences and flags every home rank after its last combine store
        jitter = b.completion_jitter(1, (nr,))
        done = {
            d: b.fence_delay(last_remote[d], b.flag_remote + float(jitter[d]), [t], d, "signal", -1)
            for d, t in last.items()
            if t is not None
        }
        waits: dict[int, list[int]] = {s: [] for s in range(nr)}
        sent = cr.sum(axis=1)  # [R_owner, R_home]
        for d, t in done.items():
            for s in np.flatnonzero(sent[d]).tolist():
                waits[s].append(t)
        # the home rank sweeps one flag per owner
        arrivals: dict[int, list[int]] = {}
        for s, deps in waits.items():
            poll = b.poll_us(len(deps))
            arrivals[s] = [b.g.delay(poll, deps, s, "signal", -1)] if deps and poll > 0 else deps
        return arrivals


class PullCombine:
    name = "pull"

    def build(self, b: Builder, gemm_done: dict) -> dict[int, list[int]]:
        rc = b.rc
        nr = b.num_ranks
        cr = b.combine_rows  # [R_owner, max_rounds, R_home]
        out_ready: list[list[int | None]] = [[None] * nr for _ in range(rc.max_rounds)]
        for d in range(nr):
            for m in range(int(rc.num_rounds[d])):
                deps = [gemm_done[(d, m)]]
                out_ready[m][d] = b.g.delay(b.fence + b.flag_remote, deps, d, "signal", m)
        has = cr > 0
        arrivals: dict[int, list[int]] = {s: [] for s in range(nr)}
        comb: list[list[int | None]] = [[None] * nr for _ in range(rc.max_rounds)]
        for s in range(nr):
            prev = None
            for m in range(rc.max_rounds):
                owners = np.flatnonzero(has[:, m, s]).tolist()
                if not owners:
                    continue
                peer = cr[:, m, s] * b.combine_row_bytes
                om = out_ready[m]
                deps = [om[d] for d in owners]
                deps.append(prev)
                t = b.transfer(s, "pull", True, peer, 0.0, deps, s, "combine", m)
                comb[m][s] = t
                prev = t
            if prev is not None:
                arrivals[s].append(b.g.delay(b.flag_local, [prev], s, "signal", -1))
        # every reader of owner d's round m tells d it is done; then the ring slot is free
        for d in range(nr):
            for m in range(int(rc.num_rounds[d])):
                cm = comb[m]
                readers = [cm[s] for s in np.flatnonzero(has[d, m]).tolist()]
                # a round whose outputs nobody reads frees its slot after the GEMM
                rel = b.g.delay(b.flag_remote, readers, d, "credit", m) if readers else None
                b.g.add_dep(b.slot_free[(d, m)], rel if readers else gemm_done[(d, m)])
        return arrivals


DISPATCH_POLICIES = {c.name: c for c in (PushDispatch, PullDispatch, DedupPullDispatch)}
COMBINE_POLICIES = {c.name: c for c in (PushCombine, PullCombine)}


def get_dispatch(name: str):
    try:
        return DISPATCH_POLICIES[name]()
    except KeyError:
        raise ValueError(
            f"unknown dispatch policy {name!r}; supported: {', '.join(DISPATCH_POLICIES)}"
        ) from None


def get_combine(name: str):
    try:
        return COMBINE_POLICIES[name]()
    except KeyError:
        raise ValueError(
            f"unknown combine policy {name!r}; supported: {', '.join(COMBINE_POLICIES)}"
        ) from None
