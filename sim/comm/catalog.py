"""The standalone mok comm kernels as data: what each moves per rank (:class:`Bytes`), its
grid-wide phases (:class:`PhaseSpec`: the knob, the cross-rank waits, the rows its grid walks and
the row routine) and the Python entry points of one measured run (:class:`KernelSpec`), keyed by
the measured CSV's (what, mode, engine) in :data:`KERNELS` (:func:`kernel_key`).

:mod:`sim.comm.model` builds these kernels' task graphs (the byte table of every kernel is in its
docstring); :mod:`sim.comm.rates` reads the row routine of a knob (:func:`knob_routine`) for the
layer model's opt-in kernel profile.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from mok.spec.limits import TMA_MIN_ROW_BYTES
from sim.comm.rows import Counts

__all__ = [
    "Bytes",
    "PhaseSpec",
    "KernelSpec",
    "KERNELS",
    "ENTRY_POINTS",
    "kernel_key",
    "kernel_engine",
    "knob_routine",
]


# -- what the kernels move --------------------------------------------------------------------
@dataclass(frozen=True)
class Bytes:
    """One phase on one rank: rows from (``nv_in``) or to (``nv_out``) each peer [R], and local
    rows read / written by the comm SMs."""

    nv_in: np.ndarray
    nv_out: np.ndarray
    local_read: float
    local_write: float


def _eye(c: Counts, r: int) -> np.ndarray:
    return np.arange(c.num_ranks) == r


def _b(c: Counts, r: int, nv_in=None, nv_out=None, rd=0.0, wr=0.0) -> Bytes:
    z = np.zeros(c.num_ranks)
    nin = z if nv_in is None else np.where(_eye(c, r), 0.0, nv_in).astype(float)
    nout = z if nv_out is None else np.where(_eye(c, r), 0.0, nv_out).astype(float)
    return Bytes(nin, nout, float(rd), float(wr))


def _pull_dispatch(c, r):
    return _b(c, r, nv_in=c.recv[r], rd=c.recv[r, r], wr=c.recv[r].sum())


def _dedup_dispatch(c, r):
    return _b(c, r, nv_in=c.dedup[r], rd=c.dedup[r, r], wr=c.dedup[r].sum())


def _dedup_remote_dispatch(c, r):
    # kFlagSkipLocal: only other ranks' dedup rows are pulled and written; own rows stay in x
    return _b(c, r, nv_in=c.dedup[r], wr=c.dedup[r].sum() - c.dedup[r, r])


def _fanout(c, r):
    return _b(c, r, rd=c.dedup[r].sum(), wr=c.recv[r].sum())


def _dedup_fan_dispatch(c, r):
    return _b(c, r, nv_in=c.dedup[r], rd=c.dedup[r, r], wr=c.recv[r].sum())


def _push_dispatch(c, r):
    return _b(c, r, nv_out=c.recv[:, r], rd=c.tokens, wr=c.recv[r, r])


def _push_combine_send(c, r):
    return _b(c, r, nv_out=c.recv[r], rd=c.recv[r].sum(), wr=c.recv[r, r])


def _slot_reduce(c, r):
    return _b(c, r, rd=c.tokens * c.topk, wr=c.tokens)


def _pull_combine(c, r):
    return _b(c, r, nv_in=c.recv[:, r], rd=c.recv[r, r], wr=c.tokens)


def _dedup_push_send(c, r):
    return _b(c, r, nv_out=c.dedup[r], rd=c.recv[r].sum(), wr=c.dedup[r, r])


def _dedup_slot_reduce(c, r):
    return _b(c, r, rd=c.dedup[:, r].sum(), wr=c.tokens)


def _partials(c, r):
    return _b(c, r, rd=c.recv[r].sum(), wr=c.dedup[r].sum())


def _dedup_sum(c, r):
    return _b(c, r, nv_in=c.dedup[:, r], rd=c.dedup[r, r], wr=c.tokens)


@dataclass(frozen=True)
class PhaseSpec:
    """One grid-wide phase: its bytes, the knob (kernel name) whose in-flight factor sets its
    per-SM rate, and the cross-rank waits before it (remote flags)."""

    bytes_fn: Callable[[Counts, int], Bytes]
    knob: str
    remote_waits: int = 0
    # whether the waits meet the peers' launches of the same call (their signal is raised in
    # that call: dispatch x-ready, combine y-ready / slots, ...), so that the launch skew between
    # the ranks shows (handshake_us); False: the flag was raised earlier (the benchmark's
    # repeated dedup_sum reads partials published once before its loop): the flag read only
    rendezvous: bool = True
    new_launch: bool = False  # a separate kernel launch (composite measurements)
    # the rows the grid walks, one per warp (16-byte path) or per ring item (bulk copies):
    # "recv" (receive rows, padding included), "dedup" / "dedup_remote" (the rank's dedup rows,
    # all / other ranks' only) or "tokens"
    loop: str = "dedup"
    # the 16-byte warp routine per row: "copy" (warp_copy_row), "fan" (warp_fan_row: one load,
    # n stores), "sum" (warp_weighted_sum: v1 reduces) or "seg" (warp_reduce_rows: v2 reduces,
    # one lane gathers the row's terms, then 2 KiB segments); with bulk copies "copy" / "fan"
    # run the copy ring (tma_copy_rows, item-rate bound), "sum" / "seg" the reduce pipeline,
    # "ring_sum" dedup_sum's row ring (tma_sum_rows, turnover bound)
    routine: str = "copy"


@dataclass(frozen=True)
class KernelSpec:
    name: str
    phases: tuple[PhaseSpec, ...]
    doc: str = ""
    # the Python calls (mok.functional entry points) of one measured run
    calls: tuple[str, ...] = ("dispatch",)

    @property
    def knobs(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(p.knob for p in self.phases))


def _one(name, fn, waits=1, doc="", loop="dedup", routine="copy", calls=None, rendezvous=True):
    calls = calls or (_entry(name),)
    ph = PhaseSpec(fn, name, waits, rendezvous, loop=loop, routine=routine)
    return KernelSpec(name, (ph,), doc, calls)


# the Python entry points of mok.functional the benchmark times (host_floor_us keys)
ENTRY_POINTS = ("schedule", "dispatch", "fanout", "dedup_partials", "dedup_sum", "combine")


def _entry(kernel: str) -> str:
    what, mode = kernel.split(".")[:2]
    if mode.startswith("fanout"):
        return "fanout"
    if mode in ("dedup_partials", "dedup_pull_sum"):
        return "dedup_sum" if mode == "dedup_pull_sum" else "dedup_partials"
    return what


def _dedup_pull_combine(name, partials_knob, sum_knob, sum_routine, doc) -> KernelSpec:
    """The two-launch dedup pull combine: the partials, then the transfer + sum."""
    return KernelSpec(
        name,
        (
            PhaseSpec(_partials, partials_knob, 0, routine="seg"),
            PhaseSpec(_dedup_sum, sum_knob, 1, new_launch=True, loop="tokens", routine=sum_routine),
        ),
        doc,
        ("dedup_partials", "dedup_sum"),
    )


# dedup_sum's routine per engine: a warp per row in 2 KiB segments, or the row ring
_SUM_ROUTINE = {"vector": "seg", "tma": "ring_sum"}


def _kernels() -> dict[tuple[str, str, str], KernelSpec]:
    k: dict[tuple[str, str, str], KernelSpec] = {}
    for eng in ("vector", "tma"):
        k[("dispatch", "pull", eng)] = _one(f"dispatch.pull.{eng}", _pull_dispatch, loop="recv")
        k[("dispatch", "dedup_pull", eng)] = _one(f"dispatch.dedup_pull.{eng}", _dedup_dispatch)
        k[("dispatch", "fanout", eng)] = _one(f"dispatch.fanout.{eng}", _fanout, 0, routine="fan")
        # v3 remote-only variants: same copy loops as their v2 units, so they share the knobs
        # (the remote-only dispatch moves fewer local bytes; the fan-out reads its own rows from x
        # instead of the dedup buffer: same bytes)
        k[("dispatch", "dedup_pull_remote", eng)] = KernelSpec(
            f"dispatch.dedup_pull_remote.{eng}",
            (
                PhaseSpec(
                    _dedup_remote_dispatch, f"dispatch.dedup_pull.{eng}", 1, loop="dedup_remote"
                ),
            ),
            "knob shared with dispatch.dedup_pull",
            ("dispatch",),
        )
        k[("dispatch", "fanout_remote", eng)] = KernelSpec(
            f"dispatch.fanout_remote.{eng}",
            (PhaseSpec(_fanout, f"dispatch.fanout.{eng}", 0, routine="fan"),),
            "knob shared with dispatch.fanout",
            ("fanout",),
        )
        k[("dispatch", "dedup_pull+fanout", eng)] = _one(
            f"dispatch.dedup_pull+fanout.{eng}", _dedup_fan_dispatch, routine="fan"
        )
        k[("combine", "dedup_partials", eng)] = _one(
            f"combine.dedup_partials.{eng}", _partials, 0, routine="seg"
        )
        sum_routine = _SUM_ROUTINE[eng]
        # standalone dedup_sum: the partials were published before the benchmark's loop
        k[("combine", "dedup_pull_sum", eng)] = _one(
            f"combine.dedup_pull_sum.{eng}",
            _dedup_sum,
            loop="tokens",
            routine=sum_routine,
            rendezvous=False,
        )
        # two launches: the partials then the transfer + sum; both knobs come from the parts
        k[("combine", "dedup_pull", eng)] = _dedup_pull_combine(
            f"combine.dedup_pull.{eng}",
            f"combine.dedup_partials.{eng}",
            f"combine.dedup_pull_sum.{eng}",
            sum_routine,
            "composite of dedup_partials + dedup_pull_sum: no knob of its own",
        )
    # vector partials + the row ring of dedup_sum: mok.bench comm's end-to-end row on rows of
    # at least 8 KiB (dedup_sum engine "auto", see kernel_key)
    k[("combine", "dedup_pull", "vec+tma")] = _dedup_pull_combine(
        "combine.dedup_pull.vec+tma",
        "combine.dedup_partials.vector",
        "combine.dedup_pull_sum.tma",
        "ring_sum",
        "composite of vector dedup_partials + tma dedup_pull_sum: no knob of its own",
    )
    # v3 cp.async gather ring of dedup_sum (16-byte copies: the vector curves, its own knob);
    # the end-to-end dedup pull combine of the grid run used it (engine label "vec+gather")
    k[("combine", "dedup_pull_sum", "gather")] = _one(
        "combine.dedup_pull_sum.gather", _dedup_sum, loop="tokens", routine="sum", rendezvous=False
    )
    k[("combine", "dedup_pull", "vec+gather")] = _dedup_pull_combine(
        "combine.dedup_pull.vec+gather",
        "combine.dedup_partials.vector",
        "combine.dedup_pull_sum.gather",
        "sum",
        "composite of vector dedup_partials + gather dedup_pull_sum: no knob of its own",
    )
    # push dispatch: one warp per token stores its row to its k receive rows (warp_fan_row)
    k[("dispatch", "push", "vector")] = _one(
        "dispatch.push.vector", _push_dispatch, loop="tokens", routine="fan"
    )
    k[("combine", "push", "vector")] = KernelSpec(
        "combine.push.vector",
        (
            PhaseSpec(_push_combine_send, "combine.push.vector", 1, loop="recv"),
            PhaseSpec(_slot_reduce, "combine.push.vector", 1, loop="tokens", routine="sum"),
        ),
        calls=("combine",),
    )
    k[("combine", "dedup_push", "vector")] = KernelSpec(
        "combine.dedup_push.vector",
        (
            PhaseSpec(_dedup_push_send, "combine.dedup_push.vector", 1, routine="sum"),
            PhaseSpec(
                _dedup_slot_reduce, "combine.dedup_push.vector", 1, loop="tokens", routine="sum"
            ),
        ),
        calls=("combine",),
    )
    k[("combine", "pull", "vector")] = _one(
        "combine.pull.vector", _pull_combine, loop="tokens", routine="sum"
    )
    return k


KERNELS = _kernels()


def kernel_key(row: dict) -> tuple[str, str, str] | None:
    """(what, mode, engine) of a measured row in :data:`KERNELS` terms, or None.

    Legacy CSVs (no ``engine`` / ``scope`` column, kernels v1) only had the 16-byte vector path,
    and their dispatch ``dedup_pull`` included the fan-out.

    The end-to-end dedup pull combine of ``mok.bench comm`` calls ``dedup_partials`` (engine
    ``vector``) and ``dedup_sum`` with its default engine ``auto``, which takes the row ring for
    rows of at least :data:`TMA_MIN_ROW_BYTES` (``mok.spec.limits``); its row is labelled with the
    partials' engine, ``vector``. Such a row with a ``hidden`` column is mapped by its row size.
    NOTE: CSVs measured before ``auto`` (git 7aad92b .. a67a81b) ran the vector sum there; they
    are history, not predicted by this model of the current kernels.
    """
    what, mode = row.get("what", ""), row.get("mode", "")
    eng = row.get("engine")
    legacy = eng is None and row.get("scope") is None
    if eng in (None, "", "-"):
        eng = "vector"
    if legacy and what == "dispatch" and mode == "dedup_pull":
        mode = "dedup_pull+fanout"
    if (what, mode, eng) == ("combine", "dedup_pull", "vector") and row.get("hidden"):
        eng = "vec+tma" if int(row["hidden"]) * 2 >= TMA_MIN_ROW_BYTES else eng
    key = (what, mode, eng)
    return key if key in KERNELS else None


def kernel_engine(knob: str) -> str:
    """The engine label of a kernel knob (its last dotted part): vector / tma / gather."""
    return knob.rsplit(".", 1)[1]


def knob_routine(knob: str) -> str:
    """The row routine of the kernel behind ``knob`` (its first phase with that knob)."""
    for spec in KERNELS.values():
        for ph in spec.phases:
            if ph.knob == knob:
                return ph.routine
    raise ValueError(f"no kernel phase runs knob {knob!r}")
