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
dispatch dedup_pull_remote  NVLink in: remote D; local: write remote D (own rows stay in x)
dispatch fanout_remote      as fanout (own rows read from x): knob shared with fanout
combine dedup_pull_sum      gather engine (16-byte cp.async ring): vector curves, own knob
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

Designated fit subset (written down before any validation error of the broad grid was looked
at; :func:`sim.validate.is_fit_row`): a row is a FIT row iff (model=deepseek-v3, skew=uniform,
tokens_per_rank in {4096, 16384}) or its SM count is 8 or 16, from the snapshots
``sim/profiles/h200x2-comm-grid-2026-11-30.csv``, ``h200x2-comm-target-2026-11-30.csv`` and
``h200x2-comm-2026-11-30.csv``. Every other row (qwen3-30b-a3b, hot:0.5, 512 tokens) is
validation only.

Fixed costs and host floor (:class:`KernelProfile`): every kernel call pays ``call_fixed_us``
(launch, pipeline fill/drain, final fence + signal; fitted), every cross-GPU wait the probed flag
latency plus ``handshake_us`` (fitted); the schedule kernel is that plus
``schedule_us_per_token`` per token. The benchmark times back-to-back Python calls with CUDA
events: the start event sits right behind the previous kernel, so a call measures
max(calls x ``host_floor_us``, device time) (a priori, docs/perf-notes.md v3). Row size: the
dispatch TMA rings issue one bulk copy per row from one thread, each costing
``tma_row_issue_us`` besides its bytes (a priori from the probe's 2 KiB / 16 KiB points), which
halves the per-SM rate at Qwen3's 4 KiB rows. Skew: per-rank row counts come from
``make_routing`` with the benchmark's seed (= tokens per rank).

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
    "host_bound",
    "num_calls",
    "schedule_us",
    "KERNEL_PROFILE_FORMAT",
]

KERNEL_PROFILE_FORMAT = "mok-kernel-profile/1"


@dataclass(frozen=True)
class KernelProfile:
    """Kernel-specific knobs of the comm-phase model (units in the names)."""

    topology: str = "h200x2"
    # us per kernel call on the device, every kernel: launch as CUDA events see it, pipeline
    # fill and drain, the final system fence + done signal; fitted
    call_fixed_us: float = 5.0
    # us per cross-GPU wait (x-ready / partials-ready / route-ready handshake) on top of the
    # probed one-way flag latency: the two ranks' launches are not aligned, so the first to
    # arrive waits for the other; fitted
    handshake_us: float = 0.0
    # us of host (Python) time per kernel call of the benchmark's launch path (custom op, Params
    # packing, error-record read); a measured call is max(calls x this, device time). A priori
    # from docs/perf-notes.md v3 ("~140-150 us whatever the bytes"), not fitted
    host_floor_us: float = 0.0
    # us per bulk copy per SM the single issuing thread of a TMA copy ring spends besides the
    # bytes (row-rate bound at small rows); a priori from the probe's 2 KiB vs 16 KiB
    # cp.async.bulk points (tma_bulk_by_sms), not fitted
    tma_row_issue_us: float = 0.0
    # us per token per rank of the schedule kernel (64 blocks walk the tokens); fitted
    schedule_us_per_token: float = 0.0
    # per engine ("vector" / "tma"): per-SM rate x 1 / (1 + n / this); fitted
    sm_congestion_sms: dict[str, float] = field(default_factory=dict)
    inflight_factor: dict[str, float] = field(default_factory=dict)  # per kernel; fitted
    fit_subset: str = ""  # which rows the fitted values came from
    source: str = ""
    assumptions: tuple[str, ...] = ()
    fit: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        for k in (
            "call_fixed_us",
            "handshake_us",
            "host_floor_us",
            "tma_row_issue_us",
            "schedule_us_per_token",
        ):
            if not getattr(self, k) >= 0:
                raise ValueError(f"{k} must be >= 0 (found {getattr(self, k)})")
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
        # profiles of format 1 before the fixed-cost knobs: a launch and a constant schedule
        if "launch_us" in d:
            d.setdefault("call_fixed_us", float(d.pop("launch_us")))
        d.pop("schedule_us", None)
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
    """Counts of a generated routing (``mok.workload.make_routing``). The benchmark's routing is
    not stored, but ``mok.bench comm`` draws it with ``make_routing(n, E, 8, 2, skew, seed=n)``
    (n = tokens per rank), so the kernel predictions pass that seed: the same routing."""
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
        # v3 remote-only variants: same copy loops as their v2 units, so they share the knobs
        # (the remote-only dispatch moves fewer local bytes; the fan-out reads its own rows from x
        # instead of the dedup buffer: same bytes)
        k[("dispatch", "dedup_pull_remote", eng)] = KernelSpec(
            f"dispatch.dedup_pull_remote.{eng}",
            (PhaseSpec(_dedup_remote_dispatch, f"dispatch.dedup_pull.{eng}", 1),),
            "knob shared with dispatch.dedup_pull",
        )
        k[("dispatch", "fanout_remote", eng)] = KernelSpec(
            f"dispatch.fanout_remote.{eng}",
            (PhaseSpec(_fanout, f"dispatch.fanout.{eng}", 0),),
            "knob shared with dispatch.fanout",
        )
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
    # v3 cp.async gather ring of dedup_sum (16-byte copies: the vector curves, its own knob);
    # the end-to-end dedup pull combine of the grid run used it (engine label "vec+gather")
    k[("combine", "dedup_pull_sum", "gather")] = _one("combine.dedup_pull_sum.gather", _dedup_sum)
    k[("combine", "dedup_pull", "vec+gather")] = KernelSpec(
        "combine.dedup_pull.vec+gather",
        (
            PhaseSpec(_partials, "combine.dedup_partials.vector", 0),
            PhaseSpec(_dedup_sum, "combine.dedup_pull_sum.gather", 1, new_launch=True),
        ),
        "composite of vector dedup_partials + gather dedup_pull_sum: no knob of its own",
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
        engine = knob.rsplit(".", 1)[1]  # a composite's phases run their own kernels' engines
        engine = _CURVE_ENGINE.get(engine, engine)
        # row-size effect of the one-thread bulk-copy issuer (one row per copy in the dispatch
        # rings): the probe's per-SM rate is for 16 KiB copies
        rs = _row_scale(self.prof, self.wl.model_shape.hidden * 2) if knob in _ROW_COPY else 1.0
        f = self.prof.factor(knob) * rs * self.topo.per_sm_latency_factor(gpu)
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
            local=rate(f"local_{suffix[2]}", self.prof.factor(knob) * rs),
        )
        self._kind_rate = {"push": self.rates.push, "pull": self.rates.pull}


# engine label -> the probe curves / congestion constant it uses (gather: 16-byte cp.async)
_CURVE_ENGINE = {"gather": "vector"}
# knobs whose kernels issue one bulk copy per row (csrc/dispatch.cuh copy ring); the TMA reduce
# steps of the combine copy fixed-size chunks, so their rate does not depend on the row size
_ROW_COPY = {f"dispatch.{m}.tma" for m in ("pull", "dedup_pull", "fanout", "dedup_pull+fanout")}
_PROBE_COPY_BYTES = 16384.0  # chunk of the probe's per-SM TMA curve


def _row_scale(prof: KernelProfile, row_bytes: float) -> float:
    """Per-SM rate of ``row_bytes`` copies / that of the probe's 16 KiB copies, when every copy
    costs ``tma_row_issue_us`` plus its bytes at the streaming rate: t(b) = a + b * s with s set
    so that 16 KiB copies run at the probe's per-SM rate (44 GB/s: t(16 KiB) = 0.37 us)."""
    a = prof.tma_row_issue_us
    if a <= 0:
        return 1.0
    t16 = _PROBE_COPY_BYTES / 44.0e3  # us per 16 KiB copy at the probe's per-SM pull rate
    per_byte = (t16 - a) / _PROBE_COPY_BYTES
    return (row_bytes / (a + row_bytes * per_byte)) / (_PROBE_COPY_BYTES / t16)


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
    c = counts_for(model, tokens, num_ranks, skew, _bench_seed(tokens))
    row_bytes = float(wl.model_shape.hidden * 2)
    g = b.g
    prev: list[int | None] = [None] * num_ranks
    start = [g.delay(prof.call_fixed_us, [], r, "launch") for r in range(num_ranks)]
    for i, ph in enumerate(spec.phases):
        b.set_phase_rates(ph.knob, engine)
        # a phase waits for every rank's previous phase when it needs their signals
        barrier = [p for p in prev if p is not None] if ph.remote_waits else []
        for r in range(num_ranks):
            deps = [start[r], prev[r], *barrier]
            wait = ph.remote_waits * (b.flag_remote + prof.handshake_us)
            wait += prof.call_fixed_us if ph.new_launch else 0.0
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
    """Predicted time (us, the slowest rank) of one standalone kernel run as the benchmark times
    it: max(host floor x Python calls, device time) (see :func:`host_bound`)."""
    spec = KERNELS[key]
    b, g = build_kernel_graph(spec, key[2], model, tokens, num_ranks, skew, sms, prof)
    return host_bound(run_graph(g, b.topo.capacities(b.gpu)).makespan_us, spec, prof)


def num_calls(spec: KernelSpec) -> int:
    """Python calls (= kernel launches) of one measured run."""
    return 1 + sum(ph.new_launch for ph in spec.phases)


def host_bound(device_us: float, spec: KernelSpec | None, prof: KernelProfile) -> float:
    """What back-to-back CUDA-event timing sees: the start event is enqueued right behind the
    previous call's kernel and the host spends ~``host_floor_us`` per call before the next
    kernel reaches the GPU, so a call shorter than its host time measures the host time and a
    longer one its device time (not their sum: the host work overlaps the previous kernel)."""
    calls = 1 if spec is None else num_calls(spec)
    return max(device_us, calls * prof.host_floor_us)


def _bench_seed(tokens: int) -> int:
    """The routing seed of ``mok.bench comm`` (``_routing(..., seed=n)``, n = tokens/rank)."""
    return tokens


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


def schedule_us(tokens: int, prof: KernelProfile) -> float:
    """The schedule kernel: one call (fixed cost + the route-ready handshake with the peer)
    plus a per-token walk, behind the host floor."""
    dev = prof.call_fixed_us + prof.handshake_us + prof.schedule_us_per_token * tokens
    return host_bound(dev, None, prof)


def _schedule_row(row: dict, prof: KernelProfile) -> tuple[float, str]:
    return schedule_us(int(row["tokens_per_rank"]), prof), "schedule"


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
