"""Standalone communication-kernel phases of mok (schedule, dispatch, combine) as task graphs.

``mok-sim validate`` predicts every row of a measured kernel sweep (``mok.bench comm``) with this
module: one kernel launch on the ``h200x2`` topology (``num_ranks`` ranks run it at once), its
``sms`` blocks all moving rows (no GEMMs), built from the same flow machinery as the layer model
(:meth:`sim.model.LayerBuilder.transfer`: max-min sharing of the issuing GPU's comm engine and of
the per-direction NVLink ports, protocol bytes on the data and the reverse direction).

What each kernel moves, per rank, in rows of ``hidden * 2`` bytes (csrc/dispatch.cuh,
csrc/combine.cuh; N = rows received, D = dedup rows = distinct (token, destination) pairs, T =
tokens per rank, K = top-k; "self" = rows whose source and destination are the same rank):

=========================== =============================================================
dispatch pull               NVLink in: remote N; local: read self N, write N
dispatch dedup_pull         NVLink in: remote D; local: read self D, write D (no fan-out)
dispatch fanout             local: read D, write N
dispatch dedup_pull+fanout  NVLink in: remote D; local: read self D, write N
dispatch push               NVLink out: remote rows sent; local: read T, write self rows
combine push                owner: read N y rows, NVLink out remote rows, write self rows;
                            all-ranks barrier; reduce: read T*K slot rows, write T
combine pull                reduce: NVLink in remote (token, k) rows, read self rows, write T
combine dedup_push          owner: read N y rows, NVLink out remote D, write self D; barrier;
                            reduce: read the home's D slot rows, write T
combine dedup_partials      read N y rows, write D partial rows (local only)
combine dedup_pull_sum      NVLink in: remote partials of my tokens; read self partials; write T
combine dedup_pull          dedup_partials, then dedup_pull_sum (two launches, no new knob)
=========================== =============================================================

Comm-engine cost: remote bytes use the calibrated per-SM curve of the mechanism (``pull_ld`` /
``push_st`` for the 16-byte ``vector`` path, ``pull_tma`` / ``push_tma`` for bulk copies), local
bytes the ``local_*`` curve counted as bytes copied ((reads + writes) / 2, the unit of the probe's
local copy). The probe kernel keeps 1024 threads x 16 B in flight per SM; mok's kernels run 512
threads, one warp per row (or one elected TMA thread per block), and their loads are dependent
on schedule lookups, so their per-SM rate differs per kernel. Each kernel therefore has one
dimensionless **in-flight factor** ``f`` (its per-SM rate / the probe's), and all kernels share
one **congestion** constant ``sm_congestion_sms``: the loaded latency grows with the number of
issuing SMs, per-SM rate x ``1 / (1 + n / sm_congestion_sms)``. Rates are capped by the curve's
ceiling (the probe's saturation), the NVLink ports by the wire rate. ``f`` and the congestion are
fitted by :func:`sim.validate.fit_kernel_profile` on a designated subset of rows (the profile says
which) and stored in ``sim/profiles/mok-comm-h200x2.json``; everything else is validation.

Row -> prediction mapping: :data:`PREDICTORS` is keyed by the CSV's ``what``; a megakernel layer
sweep adds a ``"layer"`` entry that maps its row to :func:`sim.model.simulate`.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from functools import lru_cache
from importlib import resources
from pathlib import Path

import numpy as np

from mok.workload import get_shape, make_routing
from sim.config import SimConfig, Workload
from sim.engine import Graph, run_graph
from sim.model import LayerBuilder, _Rates

__all__ = [
    "KernelProfile",
    "KernelSpec",
    "PhaseSpec",
    "KERNELS",
    "PREDICTORS",
    "Counts",
    "counts_for",
    "kernel_key",
    "predict_kernel_us",
    "predict_row",
    "load_kernel_profile",
    "KERNEL_PROFILE_FORMAT",
]

KERNEL_PROFILE_FORMAT = "mok-kernel-profile/1"


@dataclass(frozen=True)
class KernelProfile:
    """Kernel-specific knobs of the comm-phase model (units in the names)."""

    topology: str = "h200x2"
    launch_us: float = 5.0  # one kernel launch as CUDA events see it (assumption, not fitted)
    schedule_us: float = 160.0  # schedule kernel, 64 blocks (docs/perf-notes.md v1 table)
    # per engine ("vector" / "tma"): per-SM rate x 1 / (1 + n / this); fitted
    sm_congestion_sms: dict[str, float] = field(default_factory=dict)
    inflight_factor: dict[str, float] = field(default_factory=dict)  # per kernel; fitted
    fit_subset: str = ""  # which rows the fitted values came from
    source: str = ""
    assumptions: tuple[str, ...] = ()
    fit: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.launch_us < 0 or self.schedule_us < 0:
            raise ValueError(f"launch_us and schedule_us must be >= 0 (found {self})")
        if any(not v > 0 for v in self.sm_congestion_sms.values()):
            raise ValueError(f"sm_congestion_sms must be > 0 (found {self.sm_congestion_sms})")
        bad = {k: v for k, v in self.inflight_factor.items() if not v > 0}
        if bad:
            raise ValueError(f"inflight_factor values must be > 0 (found {bad})")

    def factor(self, kernel: str) -> float:
        try:
            return self.inflight_factor[kernel]
        except KeyError:
            raise ValueError(
                f"kernel profile has no in-flight factor for {kernel!r}; refit with "
                "`mok-sim validate --refit` (known: "
                + ", ".join(sorted(self.inflight_factor))
                + ")"
            ) from None

    def replace(self, **kw) -> KernelProfile:
        d = asdict(self)
        d.update(kw)
        d["assumptions"] = tuple(d["assumptions"])
        return KernelProfile(**d)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["assumptions"] = list(self.assumptions)
        d["sm_congestion_sms"] = {
            k: (None if math.isinf(v) else v) for k, v in d["sm_congestion_sms"].items()
        }
        return {"format": KERNEL_PROFILE_FORMAT, **d}

    @classmethod
    def from_dict(cls, d: dict) -> KernelProfile:
        d = dict(d)
        fmt = d.pop("format", KERNEL_PROFILE_FORMAT)
        if fmt != KERNEL_PROFILE_FORMAT:
            raise ValueError(f"unsupported kernel profile format {fmt!r}")
        d["sm_congestion_sms"] = {
            k: (math.inf if v is None else float(v))
            for k, v in d.get("sm_congestion_sms", {}).items()
        }
        d["inflight_factor"] = {k: float(v) for k, v in d.get("inflight_factor", {}).items()}
        d["assumptions"] = tuple(d.get("assumptions", ()))
        return cls(**d)

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=1) + "\n")


DEFAULT_KERNEL_PROFILE = "mok-comm-h200x2"


def load_kernel_profile(name_or_path: str | Path = DEFAULT_KERNEL_PROFILE) -> KernelProfile:
    p = Path(str(name_or_path))
    if not p.suffix:
        p = Path(str(resources.files("sim") / "profiles")) / f"{name_or_path}.json"
    return KernelProfile.from_dict(json.loads(p.read_text()))


# -- what the kernels move --------------------------------------------------------------------
@dataclass(frozen=True)
class Counts:
    """Row counts of one workload, each [R] indexed by rank (see the module table)."""

    tokens: int
    topk: int
    recv: np.ndarray  # [R_dst, R_src] (token, k) rows
    dedup: np.ndarray  # [R_dst, R_src] distinct (token, dst) pairs

    @property
    def num_ranks(self) -> int:
        return self.recv.shape[0]


@lru_cache(maxsize=64)
def counts_for(model: str, tokens: int, num_ranks: int, skew: str, seed: int = 0) -> Counts:
    """Counts of a generated routing (``mok.workload.make_routing``; the benchmark's own routing
    is not stored, so the same distribution with our seed stands in for it)."""
    shape = get_shape(model)
    tr = make_routing(tokens, shape.num_experts, shape.num_topk, num_ranks, skew, seed)
    dest = tr.per_rank() // (shape.num_experts // num_ranks)  # [R_src, T, K]
    recv = np.zeros((num_ranks, num_ranks), dtype=np.int64)
    dedup = np.zeros_like(recv)
    for s in range(num_ranks):
        for d in range(num_ranks):
            hit = dest[s] == d
            recv[d, s] = int(hit.sum())
            dedup[d, s] = int(hit.any(axis=1).sum())
    return Counts(tokens, shape.num_topk, recv, dedup)


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
    new_launch: bool = False  # a separate kernel launch (composite measurements)


@dataclass(frozen=True)
class KernelSpec:
    name: str
    phases: tuple[PhaseSpec, ...]
    doc: str = ""

    @property
    def knobs(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(p.knob for p in self.phases))


def _one(name, fn, waits=1, doc=""):
    return KernelSpec(name, (PhaseSpec(fn, name, waits),), doc)


def _kernels() -> dict[tuple[str, str, str], KernelSpec]:
    k: dict[tuple[str, str, str], KernelSpec] = {}
    for eng in ("vector", "tma"):
        k[("dispatch", "pull", eng)] = _one(f"dispatch.pull.{eng}", _pull_dispatch)
        k[("dispatch", "dedup_pull", eng)] = _one(f"dispatch.dedup_pull.{eng}", _dedup_dispatch)
        k[("dispatch", "fanout", eng)] = _one(f"dispatch.fanout.{eng}", _fanout, 0)
        k[("dispatch", "dedup_pull+fanout", eng)] = _one(
            f"dispatch.dedup_pull+fanout.{eng}", _dedup_fan_dispatch
        )
        k[("combine", "dedup_partials", eng)] = _one(f"combine.dedup_partials.{eng}", _partials, 0)
        k[("combine", "dedup_pull_sum", eng)] = _one(f"combine.dedup_pull_sum.{eng}", _dedup_sum)
        # two launches: the partials then the transfer + sum; both knobs come from the parts
        k[("combine", "dedup_pull", eng)] = KernelSpec(
            f"combine.dedup_pull.{eng}",
            (
                PhaseSpec(_partials, f"combine.dedup_partials.{eng}", 0),
                PhaseSpec(_dedup_sum, f"combine.dedup_pull_sum.{eng}", 1, new_launch=True),
            ),
            "composite of dedup_partials + dedup_pull_sum: no knob of its own",
        )
    k[("dispatch", "push", "vector")] = _one("dispatch.push.vector", _push_dispatch)
    k[("combine", "push", "vector")] = KernelSpec(
        "combine.push.vector",
        (
            PhaseSpec(_push_combine_send, "combine.push.vector", 1),
            PhaseSpec(_slot_reduce, "combine.push.vector", 1),
        ),
    )
    k[("combine", "dedup_push", "vector")] = KernelSpec(
        "combine.dedup_push.vector",
        (
            PhaseSpec(_dedup_push_send, "combine.dedup_push.vector", 1),
            PhaseSpec(_dedup_slot_reduce, "combine.dedup_push.vector", 1),
        ),
    )
    k[("combine", "pull", "vector")] = _one("combine.pull.vector", _pull_combine)
    return k


KERNELS = _kernels()


def kernel_key(row: dict) -> tuple[str, str, str] | None:
    """(what, mode, engine) of a measured row in :data:`KERNELS` terms, or None.

    Legacy CSVs (no ``engine`` / ``scope`` column, kernels v1) only had the 16-byte vector path,
    and their dispatch ``dedup_pull`` included the fan-out.
    """
    what, mode = row.get("what", ""), row.get("mode", "")
    eng = row.get("engine")
    legacy = eng is None and row.get("scope") is None
    if eng in (None, "", "-"):
        eng = "vector"
    if legacy and what == "dispatch" and mode == "dedup_pull":
        mode = "dedup_pull+fanout"
    key = (what, mode, eng)
    return key if key in KERNELS else None


# -- the graph --------------------------------------------------------------------------------
class PhaseBuilder(LayerBuilder):
    """A :class:`LayerBuilder` without the layer: only the transfer machinery, with the comm
    rates of one kernel phase at a time (:meth:`set_phase_rates`)."""

    def __init__(self, wl: Workload, cfg: SimConfig, prof: KernelProfile) -> None:
        self.wl, self.cfg, self.prof = wl, cfg, prof
        self.topo = wl.topo
        self.gpu = self.topo.gpu
        self.num_ranks = wl.ep
        gpu, topo = self.gpu, self.topo
        self.flag_remote = gpu.flag_latency_remote_us + topo.switch_hop_latency_us
        self.fence = gpu.fence_us
        self.g = Graph()
        self.payload_bytes = {"nvlink": 0.0, "nic": 0.0, "local": 0.0}
        self._eng = []
        self._proto = {
            k: (gpu.protocol[k].data_bytes_per_byte, gpu.protocol[k].reverse_bytes_per_byte)
            for k in ("push", "pull")
        }
        dom = np.arange(self.num_ranks) // topo.gpus_per_domain
        self._same_domain = dom[:, None] == dom[None, :]
        self._routes = {}
        self._remote_lat = topo.remote_latency_us(gpu)
        self.rates = _Rates(1.0, 1.0, 1.0)
        self._kind_rate = {"push": 1.0, "pull": 1.0}

    def _set_sms(self) -> None:  # the layer's compute/comm split does not apply
        pass

    def set_phase_rates(self, knob: str, engine: str) -> None:
        """Comm-engine payload rates (bytes/us) of ``num_comm_sms`` SMs running kernel ``knob``."""
        gpu, n = self.gpu, float(self.cfg.num_comm_sms)
        f = self.prof.factor(knob) * self.topo.per_sm_latency_factor(gpu)
        cong = 1.0 / (1.0 + n / self.prof.sm_congestion_sms.get(engine, math.inf))
        suffix = {"vector": ("st", "ld", "st"), "tma": ("tma", "tma", "tma")}[engine]

        def rate(mech: str, scale: float, capped: bool = True) -> float:
            c = gpu.curve(mech)
            r = c.per_sm_gbps * scale * cong * n
            return (min(r, c.ceiling_gbps(n)) if capped else r) * 1e3

        # Remote loads overlap the local copies and are capped by the NVLink port resources
        # (wire rate, protocol both ways); remote stores come from the same instruction stream
        # as the local ones, so the engine serialises them at the probe's push ceiling.
        self.rates = _Rates(
            push=rate(f"push_{suffix[0]}", f),
            pull=rate(f"pull_{suffix[1]}", f, capped=False),
            local=rate(f"local_{suffix[2]}", self.prof.factor(knob)),
        )
        self._kind_rate = {"push": self.rates.push, "pull": self.rates.pull}


def _workload(model: str, tokens: int, num_ranks: int, skew: str, prof: KernelProfile):
    return Workload(model, tokens, num_ranks, prof.topology, skew)


def build_kernel_graph(
    spec: KernelSpec,
    engine: str,
    model: str,
    tokens: int,
    num_ranks: int,
    skew: str,
    sms: int,
    prof: KernelProfile,
) -> tuple[PhaseBuilder, Graph]:
    wl = _workload(model, tokens, num_ranks, skew, prof)
    if sms < 1 or sms > wl.topo.gpu.num_sms:
        raise ValueError(f"sms={sms} outside 1..{wl.topo.gpu.num_sms}")
    cfg = SimConfig(num_comm_sms=sms, mechanism="tma" if engine == "tma" else "st")
    b = PhaseBuilder(wl, cfg, prof)
    c = counts_for(model, tokens, num_ranks, skew)
    row_bytes = float(wl.model_shape.hidden * 2)
    g = b.g
    prev: list[int | None] = [None] * num_ranks
    start = [g.delay(prof.launch_us, [], r, "launch") for r in range(num_ranks)]
    for i, ph in enumerate(spec.phases):
        b.set_phase_rates(ph.knob, engine)
        # a phase waits for every rank's previous phase when it needs their signals
        barrier = [p for p in prev if p is not None] if ph.remote_waits else []
        for r in range(num_ranks):
            deps = [start[r], prev[r], *barrier]
            wait = ph.remote_waits * b.flag_remote + (prof.launch_us if ph.new_launch else 0.0)
            if i and ph.remote_waits:
                wait += b.fence
            pre = g.delay(wait, deps, r, "signal", i) if wait > 0 else g.join(deps, r, "join", i)
            x = ph.bytes_fn(c, r)
            local = (x.local_read + x.local_write) / 2 * row_bytes
            if x.nv_in.any():
                t = b.transfer(r, "pull", True, x.nv_in * row_bytes, local, [pre], r, "phase", i)
            else:
                t = b.transfer(r, "push", False, x.nv_out * row_bytes, local, [pre], r, "phase", i)
            prev[r] = t
    return b, g


def predict_kernel_us(
    key: tuple[str, str, str],
    model: str,
    tokens: int,
    num_ranks: int,
    skew: str,
    sms: int,
    prof: KernelProfile,
) -> float:
    """Predicted time (us, the slowest rank) of one standalone kernel run."""
    spec = KERNELS[key]
    b, g = build_kernel_graph(spec, key[2], model, tokens, num_ranks, skew, sms, prof)
    return run_graph(g, b.topo.capacities(b.gpu)).makespan_us


# -- row -> prediction ------------------------------------------------------------------------
def _comm_row(row: dict, prof: KernelProfile) -> tuple[float, str]:
    key = kernel_key(row)
    if key is None:
        raise LookupError(
            f"no kernel model for what={row.get('what')!r} mode={row.get('mode')!r} "
            f"engine={row.get('engine', '-')!r}"
        )
    us = predict_kernel_us(
        key,
        row["model"],
        int(row["tokens_per_rank"]),
        int(row.get("num_ranks") or 2),
        row["skew"],
        int(row["sms"]),
        prof,
    )
    return us, KERNELS[key].name


def _schedule_row(row: dict, prof: KernelProfile) -> tuple[float, str]:
    return prof.schedule_us, "schedule"


# what -> predictor(row, profile) -> (predicted us, kernel name); LookupError = not modelled.
# A megakernel layer CSV registers "layer" here (row -> Workload + SimConfig -> simulate()).
PREDICTORS: dict[str, Callable[[dict, KernelProfile], tuple[float, str]]] = {
    "schedule": _schedule_row,
    "dispatch": _comm_row,
    "combine": _comm_row,
}


def predict_row(row: dict, prof: KernelProfile) -> tuple[float, str]:
    """(predicted us, kernel name) of a measured row; LookupError if no model covers it."""
    if row.get("impl", "mok") != "mok":
        raise LookupError(f"impl={row.get('impl')!r} is not a mok kernel")
    fn = PREDICTORS.get(row.get("what", ""))
    if fn is None:
        raise LookupError(f"no predictor for what={row.get('what')!r}")
    return fn(row, prof)
