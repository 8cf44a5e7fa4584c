"""One MoE layer forward as a task graph over the flow network, and the function that runs it.

Per rank r (EP ranks are the first ``ep`` GPUs of the topology):

* ``schedule``: counts all-gather and the schedule table (one global task);
* compute SMs, in order: shared expert (overlaps the first dispatch) -> expert FFN of round 0 ->
  round 1 -> ... -> final weighted sum of the k combine rows of each token. Each FFN (gate+up,
  handoff, down) is a persistent tile queue (:mod:`sim.core.gemm_waves`): a ``gemm`` task holds
  the compute SMs for the fluid occupancy (fractional waves), so the next round's tiles backfill
  the last partial wave, and a ``gemm_tail`` task (the rest of the last wave) delays only the
  round's combine and the final sum;
* comm SMs: the dispatch and combine transfers of the policies (:mod:`sim.layer.policies`), sharing
the
  rank's comm engine with max-min fairness;
* the receive ring has ``macrobatch_size / minibatch_size`` slots; round m reuses slot
  ``m % slots`` once round ``m - slots`` was combined (back-pressure).

Comm rates: by default each transfer's comm-engine rate is the probe's per-SM curve of the
mechanism (:meth:`LayerBuilder._set_sms`; 1024 threads x 16 B in flight per SM). With
``SimConfig.kernel_profile`` set, the dispatch and the combine transfers instead run at the rates
of the measured mok kernel that plays that role (:func:`kernel_knobs`, :meth:`LayerBuilder.
_kernel_rates`): the probe's per-SM rate times that kernel's fitted in-flight factor, the TMA
row-size scale of the dispatch copy rings, and the SM congestion ``1 / (1 + n / c[engine])``,
under the same ceilings. Assumption: the megakernel's comm SMs run the standalone kernels' copy
loops, so their per-SM efficiency carries over; the standalone kernels' per-call costs (launch,
fill/drain, host floor, handshakes) do not, since the megakernel is one launch whose signalling
the layer already models.

The backward (``SimConfig.direction="backward"``, opt-in) is :class:`BackwardBuilder`, this
builder with the backward's part (:class:`sim.layer.backward.BackwardPass`): its own rounds
(reverse-combine pull, dgrad GEMMs, reverse-dispatch push, weight gradients at the end) built
with the same helpers;
:func:`simulate` and :func:`simulate_many` pick the builder by the config's direction.
:data:`PASSES` lists the passes.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Iterator, Sequence
from functools import lru_cache
from itertools import chain, islice

import numpy as np

from sim.comm.profile import KernelProfile, load_kernel_profile
from sim.comm.rates import kernel_rates
from sim.config import DIRECTIONS, SimConfig, Workload
from sim.core.engine import DELAY, Graph, run_graph
from sim.core.gemm import reduce_us
from sim.core.gemm_waves import GemmWaves, gemm_spec, load_kernel_waves, round_times
from sim.core.transfer import Rates, TransferBuilder
from sim.layer.backward import BACKWARD_ROLES, BackwardPass, backward_config
from sim.layer.plan import RoutingPlan
from sim.layer.policies import get_combine, get_dispatch
from sim.layer.results import LayerResult

__all__ = [
    "LayerBuilder",
    "simulate",
    "simulate_many",
    "PASSES",
    "plan_for",
    "kernel_knobs",
    "check_kernel_profile",
    "layer_kernel_profile",
    "ROLES",
    "BACKWARD_ROLES",
    "builder_class",
    "BackwardBuilder",
    "forward_backward",
]

PASSES = DIRECTIONS


# -- measured kernel efficiency (opt-in) --------------------------------------------------------
# The transfers of the layer, by the ``phase`` the policies pass to LayerBuilder.transfer.
ROLES = ("dispatch", "combine")
# SimConfig.mechanism -> engine label of the kernel profile's knobs (and back to probe curves)
_ENGINE_OF_MECH = {"tma": "tma", "st": "vector"}


@lru_cache(maxsize=16)
def layer_kernel_profile(name_or_path: str) -> KernelProfile:
    """The KernelProfile behind ``SimConfig.kernel_profile`` (a name under sim/profiles or a JSON
    path), loaded once per process. Only its in-flight factors, congestion constants and row
    terms (``tma_item_us``, ``warp_lookup_rounds``) are used by the layer; its fixed per-call and
    host costs describe standalone launches and are ignored (the megakernel is one launch)."""
    try:
        return load_kernel_profile(name_or_path)
    except OSError as e:
        raise ValueError(
            f"kernel profile {name_or_path!r} not found ({e.strerror}); give a name under "
            "sim/profiles (e.g. mok-comm-h200x2) or a path to a mok-kernel-profile/1 JSON"
        ) from None


def _role_candidates(cfg: SimConfig) -> dict[str, tuple[str, ...]]:
    """Kernel knobs that may play each role of the fused layer, preferred first.

    ============================ ========================================================
    dispatch pull                ``dispatch.pull.<engine>``
    dispatch dedup_pull          ``dispatch.dedup_pull+fanout.<engine>``: the layer's dedup
                                 dispatch moves the unique rows over NVLink and fans the rest
                                 out locally in the same comm-SM transfer, as that kernel does
    dispatch push                ``dispatch.push.<engine>`` (only ``vector`` was measured)
    combine push                 ``combine.push.<engine>`` (only ``vector``)
    combine push after dedup     ``combine.dedup_push.<engine>`` (only ``vector``): fold the
                                 rank-local rows, push one row per (token, rank)
    combine pull                 ``combine.pull.<engine>`` (only ``vector``)
    ============================ ========================================================

    ``<engine>`` is ``tma`` for ``mechanism="tma"`` and ``vector`` for ``"st"``. When the profile
    has no kernel of that engine for a role, the role falls back to the other engine's kernel
    and then runs on that kernel's probe curves and congestion constant (the copy loop that was
    measured), not on the config's mechanism.
    """
    eng = _ENGINE_OF_MECH[cfg.mechanism]
    other = "vector" if eng == "tma" else "tma"
    disp = {
        "pull": "dispatch.pull",
        "dedup_pull": "dispatch.dedup_pull+fanout",
        "push": "dispatch.push",
    }[cfg.dispatch_mode]
    if cfg.direction == "backward":
        # MoK's backward: a pull reverse combine (dedup pull with local fan-out after a dedup
        # forward) and a push reverse dispatch (per-(token, k) slots; after a dedup forward the
        # dedup push of one partial per (token, rank)), whatever the forward's combine mode
        rev = "dispatch.dedup_pull+fanout" if cfg.dedup else "dispatch.pull"
        back = "combine.dedup_push" if cfg.dedup else "combine.push"
        return {
            "rev_combine": (f"{rev}.{eng}", f"{rev}.{other}"),
            "rev_dispatch": (f"{back}.{eng}", f"{back}.{other}"),
        }
    comb = "combine.dedup_push" if cfg.dedup else f"combine.{cfg.combine_mode}"
    return {
        "dispatch": (f"{disp}.{eng}", f"{disp}.{other}"),
        "combine": (f"{comb}.{eng}", f"{comb}.{other}"),
    }


def kernel_knobs(cfg: SimConfig) -> dict[str, str]:
    """Role ("dispatch" / "combine"; backward: :data:`BACKWARD_ROLES`) -> the kernel profile
    knob whose fitted efficiency sets that role's comm rates under ``cfg`` (see
    :func:`_role_candidates`); {} without a profile."""
    if cfg.kernel_profile is None:
        return {}
    prof = layer_kernel_profile(cfg.kernel_profile)
    out = {}
    for role, cands in _role_candidates(cfg).items():
        hit = next((k for k in cands if k in prof.inflight_factor), None)
        if hit is None:
            raise ValueError(
                f"kernel profile {cfg.kernel_profile!r} has no kernel for the {role} of "
                f"{cfg.dispatch_mode}/{cfg.combine_mode} (wanted one of {', '.join(cands)})"
            )
        out[role] = hit
    return out


def check_kernel_profile(cfg: SimConfig) -> SimConfig:
    """``cfg``, once checked against the kernel profile it names (if any): the profile loads and
    has a kernel for the dispatch and the combine role under ``cfg``, else ValueError (see
    :func:`kernel_knobs`). :class:`SimConfig` checks its own fields only and reads no file;
    this check runs where the profile is used: :class:`LayerBuilder`, :func:`sim.layer.sweep.grid`,
    :func:`sim.layer.sweep.sweep` and :func:`sim.layer.sweep.compare` (before any work starts) and
    the ``mok-sim`` config of the command line."""
    kernel_knobs(cfg)
    return cfg


class LayerBuilder(TransferBuilder):
    """Builds the forward task graph; policies call :meth:`transfer` and friends (the policies'
    builder interface: :class:`sim.layer.policies.Builder`)."""

    # the phases whose comm rates a kernel profile sets (``_roles``, :func:`kernel_knobs`)
    roles = ROLES

    def __init__(self, wl: Workload, cfg: SimConfig, plan: RoutingPlan) -> None:
        super().__init__(wl.topo, wl.ep, cfg.push_latency_fraction, cfg.flow_granularity)
        self.wl, self.cfg = wl, cfg
        self.shape = wl.model_shape
        if plan.row_tile != cfg.row_tile:
            raise ValueError(f"plan row_tile {plan.row_tile} != config row_tile {cfg.row_tile}")
        self.rc = plan.rounds(cfg.minibatch_size)
        self.plan = plan
        h = self.shape.hidden
        self.dispatch_row_bytes = float(h * 2 if cfg.dtype == "bf16" else h + h // 32)
        self.combine_row_bytes = float(h * 2)
        # the row size of the comm SMs' copy loops, for the kernel profile's row-size scale
        # (the backward moves two rows per dispatch slot, each of this size)
        self.copy_row_bytes = self.dispatch_row_bytes
        self._set_sms()
        self.flag_local = self.gpu.flag_latency_local_us
        self.combine_rows = self.rc.uniq_last if cfg.dedup else self.rc.rows
        self.slot_free: dict[tuple[int, int], int] = {}
        self.waves: GemmWaves = (
            self.gpu.waves()
            if cfg.gemm_profile is None
            else load_kernel_waves(self.gpu, cfg.gemm_profile)
        )
        # (busy task, tail task, row tiles, intermediate, experts)
        self._ffn: list[tuple[int, int, int, int, int]] = []
        # (busy, tail) of _ffn_us by (row tiles, intermediate, experts, compute SMs)
        self._ffn_cache: dict[tuple[int, int, int, int], tuple[float, float]] = {}
        # what the dispatch policy recorded as ring-dependent (sim.layer.policies.Builder; both
        # None: unknown, no ring variant is copied), and what for_ring copies: (config,
        # durations, flow coefficients) as build() left them
        self.ring_deps: list[tuple[int, int, int | None, int, int]] | None = None
        self.ring_credits: tuple | None = None
        self._fresh: tuple[SimConfig, list[float], np.ndarray] | None = None

    def _set_sms(self) -> None:
        gpu, cfg = self.gpu, self.cfg
        sms = cfg.sms_on(gpu.num_sms)  # the layer's SM budget (MoKConfig.num_sms)
        if cfg.num_comm_sms >= sms:
            raise ValueError(
                f"num_comm_sms={cfg.num_comm_sms} leaves no compute SMs on {gpu.name} "
                f"({sms} SMs{' of its budget' if sms < gpu.num_sms else ''})"
            )
        self.compute_sms = sms - cfg.num_comm_sms
        self.rates = self.probe_rates(cfg.num_comm_sms)
        self.kernel_knobs = kernel_knobs(cfg)
        if self.kernel_knobs:
            self._roles = {r: self._kernel_rates(k) for r, k in self.kernel_knobs.items()}
            self.rates = self._roles[self.roles[0]]

    def probe_rates(self, n: int) -> Rates:
        """Comm-engine rates (bytes/us) of ``n`` SMs running the probe's copy loop of the config's
        mechanism (its per-SM curves; remote bytes with the switch-hop latency factor)."""
        gpu, mech = self.gpu, self.cfg.mechanism
        lat_factor = self.topo.per_sm_latency_factor(gpu)

        def rate(name: str, remote: bool) -> float:
            c = gpu.curve(name)
            if remote:
                c = c.scaled(per_sm=lat_factor)
            return c.gbps(n) * 1e3  # bytes per us

        return Rates(
            push=rate(f"push_{mech}", True),
            pull=rate(f"pull_{'ld' if mech == 'st' else mech}", True),
            local=rate(f"local_{mech}", False),
        )

    def _kernel_rates(self, knob: str) -> Rates:
        """Comm-engine rates (bytes/us) of ``num_comm_sms`` SMs running the copy loop of the
        measured kernel ``knob`` (``SimConfig.kernel_profile``).

        Same form as the standalone kernel model (:func:`sim.comm.rates.phase_rates`; where the two
        differ: :mod:`sim.comm.rates`): per-SM rate = probe per-SM rate of the kernel's engine x
        in-flight factor ``f[knob]`` x row-size scale (:func:`sim.comm.rates.layer_row_scale`: the
        warp routine's rounds per row, or a bulk-copy ring's item-rate cap) x ``1 / (1 + n /
        sm_congestion_sms[engine])`` x the switch-hop latency factor for remote bytes; then the
        probe ceilings cap it, as for the probe rates. Assumption: the megakernel's comm SMs reuse
        the standalone kernels' copy loops, so their measured per-SM efficiency carries over to the
        fused layer. Nothing else of the profile is used: its per-call costs (``call_fixed_us``,
        ``handshake_us``, ``host_floor_us``, the schedule kernel's terms) belong to standalone
        launches; the megakernel is one launch and the layer models its own flags and fences.
        Caveat: the factors were fitted with the standalone model's byte accounting (the received
        rows' local writes, the slot reduce of the combine), which the layer does not charge to the
        comm engine; a factor above 1 (push dispatch) partly pays for those bytes and makes the
        layer's role faster than the probe at low SM counts.
        """
        return kernel_rates(
            self.gpu,
            self.topo,
            layer_kernel_profile(self.cfg.kernel_profile),
            knob,
            self.cfg.num_comm_sms,
            self.copy_row_bytes,
        )

    def _ffn_us(self, row_tiles: int, intermediate: int, experts: int) -> tuple[float, float]:
        """(busy, tail) of one SwiGLU FFN round over ``experts`` experts' weights: gate+up
        (N = 2 x intermediate, K = hidden), the GPU-scope handoff, down (N = hidden)."""
        if row_tiles <= 0:
            return 0.0, 0.0
        key = (row_tiles, intermediate, experts, self.compute_sms)
        out = self._ffn_cache.get(key)
        if out is None:
            out = self._ffn_cache[key] = self._ffn_us_uncached(row_tiles, intermediate, experts)
        return out

    def _ffn_us_uncached(self, row_tiles: int, intermediate: int, experts: int):
        gpu, w, cfg, h, sms = self.gpu, self.waves, self.cfg, self.shape.hidden, self.compute_sms
        up = gemm_spec(
            gpu, w, row_tiles, 2 * intermediate, h, experts, sms, cfg.dtype, cfg.row_tile
        )
        dn = gemm_spec(gpu, w, row_tiles, h, intermediate, experts, sms, cfg.dtype, cfg.row_tile)
        busy, done = round_times([up, dn], sms, w.layer_fill_us, gpu.flag_latency_local_us)
        # done >= busy but for rounding (a list schedule of whole waves ends where the fluid one
        # does), and a task's duration must not be negative
        return busy, max(0.0, done - busy)

    def experts_per_round(self) -> np.ndarray:
        """[R, max_rounds] local experts whose padded region overlaps each round (their weights
        stream once per round they appear in)."""
        plan, mb = self.plan, self.cfg.minibatch_size
        padded = -(-plan.expert_counts.sum(axis=1) // plan.row_tile) * plan.row_tile
        padded = padded.reshape(plan.num_ranks, plan.num_local_experts)
        lo = plan.region_starts
        hi = lo + padded
        m0 = np.arange(self.rc.row_tiles.shape[1])[None, None, :] * mb
        hit = (padded[..., None] > 0) & (lo[..., None] < m0 + mb) & (hi[..., None] > m0)
        return hit.sum(axis=1)

    def for_ring(self, cfg: SimConfig) -> LayerBuilder:
        """The builder of ``cfg``, made from this built one without building again (valid after
        any number of :meth:`retime`): ``cfg`` may differ from the config of the build only in
        its ring size. The graph is the one build() left with what the policies recorded as
        ring-dependent redone for ``cfg``: under pull dispatch the ring-slot dependency of each
        dispatch transfer (:attr:`ring_deps`), under push dispatch the credit tasks, which
        shifts the ids of every later task, and the credits each dispatch transfer waits on
        (:attr:`ring_credits`). The result has the same lists, flows and floats as a fresh build
        of ``cfg`` (tests/test_sim_fast_paths.py compares them)."""
        if not self.can_share_with(cfg):
            raise ValueError(f"{cfg.label()} is not a ring variant of this builder's build")
        _, dur, coef = self._fresh
        new = copy.copy(self)
        new.cfg = cfg
        src, g = self.g, Graph()
        g.flows = src.flows.copy(coef)
        new.g = g
        new.payload_bytes = dict(self.payload_bytes)
        new._set_sms()
        slots = cfg.ring_slots
        if self.ring_deps is not None:
            g.kind, g.duration = list(src.kind), list(dur)
            g.deps = list(src.deps)  # tuples
            g.flow_lo, g.flow_hi = list(src.flow_lo), list(src.flow_hi)
            g.rank, g.phase, g.round = list(src.rank), list(src.phase), list(src.round)
            g.payload_bytes = list(src.payload_bytes)
            for t, sched, prev, d, m in self.ring_deps:
                slot = self.slot_free.get((d, m - slots))
                g.deps[t] = tuple([x for x in (sched, prev, slot) if x is not None])
            return new
        # push dispatch: the credit tasks [cs, ce) are redone for cfg, later ids shift by shift
        cs, ce, sends = self.ring_credits
        rc, nr = self.rc, self.num_ranks
        keys = [
            (d, m)
            for m in range(max(0, rc.max_rounds - slots))
            for d in range(nr)
            if m < rc.num_rounds[d]
        ]
        shift = len(keys) - (ce - cs)
        credit = [[None] * nr for _ in range(max(0, rc.max_rounds - slots))]
        for i, (d, m) in enumerate(keys):
            credit[m][d] = cs + i

        def moved(x):
            return x + shift if x >= ce else x

        nc = len(keys)
        lo = src.flow_hi[cs - 1]  # flows before the credits (a credit owns none)
        g.kind = src.kind[:cs] + [DELAY] * nc + src.kind[ce:]
        g.duration = dur[:cs] + [float(self.flag_remote)] * nc + dur[ce:]
        g.flow_lo = src.flow_lo[:cs] + [lo] * nc + src.flow_lo[ce:]
        g.flow_hi = src.flow_hi[:cs] + [lo] * nc + src.flow_hi[ce:]
        g.rank = src.rank[:cs] + [d for d, _ in keys] + src.rank[ce:]
        g.phase = src.phase[:cs] + ["credit"] * nc + src.phase[ce:]
        g.round = src.round[:cs] + [m for _, m in keys] + src.round[ce:]
        g.payload_bytes = src.payload_bytes[:cs] + [0.0] * nc + src.payload_bytes[ce:]
        head = src.deps[:cs] + src.deps[ce:]
        if shift:  # every id past the credits moves: remap the flattened dependencies at once
            lens = list(map(len, head))
            flat = np.fromiter(chain.from_iterable(head), np.int64, sum(lens))
            flat[flat >= ce] += shift
            it = iter(flat.tolist())
            head = [tuple(islice(it, n)) for n in lens]
        credit_deps = [(self.slot_free[(d, m)],) for d, m in keys]
        g.deps = head[:cs] + credit_deps + head[cs:]
        for t, prev, _, m, dests in sends:
            deps = [self.sched, None if prev is None else moved(prev)]
            if m >= slots:
                cm = credit[m - slots]
                deps += [cm[d] for d in dests]
            g.deps[moved(t)] = tuple([x for x in deps if x is not None])
        new._ffn = [(moved(t), moved(tail), *rest) for t, tail, *rest in self._ffn]
        new._fences = [(moved(t), nbytes, extra) for t, nbytes, extra in self._fences]
        new.ring_credits = None  # ids of this copy's own build are not recorded
        return new

    def can_share_with(self, cfg: SimConfig) -> bool:
        """Whether :meth:`for_ring` can make the builder of ``cfg`` from this one."""
        if self._fresh is None or (self.ring_deps is None and self.ring_credits is None):
            return False
        built = self._fresh[0]
        one_slot = built.replace(macrobatch_size=built.minibatch_size)
        return cfg.replace(macrobatch_size=cfg.minibatch_size) == one_slot

    def retime(self, num_comm_sms: int) -> SimConfig:
        """Re-target the built graph to another comm/compute SM split: only the comm-engine
        coefficients and the GEMM durations depend on it, so a sweep over SMs reuses the graph."""
        self.cfg = self.cfg.replace(num_comm_sms=num_comm_sms)
        self._set_sms()
        self.retime_engine()
        dur = self.g.duration
        for t, tail, tiles, inter, experts in self._ffn:
            dur[t], dur[tail] = self._ffn_us(tiles, inter, experts)
        return self.cfg

    # -- combine helpers ----------------------------------------------------------------------
    def combine_local_bytes(self, d: int, m: int) -> float:
        """Dedup combine: local bytes to fold round m's rows into per-(token, rank) partials."""
        sent = self.rc.uniq_last[d, m].sum() - self.rc.uniq_last[d, m, d]
        folded = max(0.0, float(self.rc.rows[d, m].sum() - sent))
        return folded * self.shape.hidden * self.cfg.dedup_accumulate_bytes_per_elem

    def combine_bytes(self, d: int, m: int) -> tuple[np.ndarray, float]:
        """(peer bytes [R_home], local bytes) that owner d's round m sends back."""
        b = self.combine_rows[d, m].astype(np.float64) * self.combine_row_bytes
        if self.cfg.dedup:
            b[d] = 0.0  # the home-rank partial stays in the accumulator
            return b, self.combine_local_bytes(d, m)
        return b, 0.0

    # -- the layer ----------------------------------------------------------------------------
    def add_schedule(self) -> None:
        """The schedule task (:attr:`sched`) and one ``slot_free`` join per (rank, round)."""
        g, cfg, rc = self.g, self.cfg, self.rc
        rows_per_rank = self.wl.tokens_per_rank * self.shape.num_topk
        self.sched = g.delay(
            cfg.schedule_base_us
            + self.handshake_us(0)  # the routing exchange
            + self.handshake_us(1)  # x ready: the first rows may move
            + rows_per_rank * cfg.schedule_ns_per_row / 1e3,
            [],
            -1,
            "schedule",
        )
        for d in range(self.num_ranks):
            for m in range(int(rc.num_rounds[d])):
                self.slot_free[(d, m)] = g.join([], d, "slot_free", m)

    def finish(self, result: LayerResult) -> LayerResult:
        """What a pass adds to its result from the run (the forward: nothing)."""
        return result

    def build(self) -> Graph:
        g, cfg, rc, shape, gpu = self.g, self.cfg, self.rc, self.shape, self.gpu
        nr = self.num_ranks
        self.add_schedule()
        ready = get_dispatch(cfg.dispatch_mode).build(self)
        shared_tiles = -(-self.wl.tokens_per_rank // cfg.row_tile)
        gemm_done = {}
        chain = {}
        finals: dict[int, list[int]] = {}
        sh_tiles = shared_tiles if shape.shared_intermediate else 0
        experts = self.experts_per_round()

        def ffn(tiles, inter, n_exp, deps, r, phase, m=-1):
            busy, tail = self._ffn_us(tiles, inter, n_exp)
            t = g.delay(busy, deps, r, phase, m)
            done = g.delay(tail, [t], r, "gemm_tail", m)
            self._ffn.append((t, done, tiles, inter, n_exp))
            return t, done

        for r in range(nr):
            prev, sh_done = ffn(sh_tiles, shape.shared_intermediate, 1, [], r, "shared_expert")
            last = sh_done
            for m in range(int(rc.num_rounds[r])):
                tiles = int(rc.row_tiles[r, m])
                prev, last = ffn(
                    tiles,
                    shape.intermediate,
                    int(experts[r, m]),
                    [ready[(r, m)], prev],
                    r,
                    "gemm",
                    m,
                )
                gemm_done[(r, m)] = g.delay(self.flag_local, [last], r, "signal", m)
            chain[r] = prev
            finals[r] = [sh_done, last]
        arrivals = get_combine(cfg.combine_mode).build(self, gemm_done)
        rows_in = self.combine_rows.sum(axis=(0, 1))  # [R_home]
        for s in range(nr):
            dur = reduce_us(gpu, int(rows_in[s]), self.wl.tokens_per_rank, shape.hidden)
            g.delay(dur, [chain[s], *finals[s], *arrivals[s]], s, "reduce")
        if self.ring_deps is not None or self.ring_credits is not None:
            self._fresh = (cfg, list(g.duration), g.flows.arrays()[2].copy())
        return g


def plan_for(wl: Workload, row_tile: int = 128) -> RoutingPlan:
    return RoutingPlan(wl.make_trace(), row_tile)


def simulate(
    wl: Workload,
    cfg: SimConfig | None = None,
    plan: RoutingPlan | None = None,
    record_links: bool = False,
) -> LayerResult:
    """Simulate one layer pass (``cfg.direction``: the forward by default, or the backward).
    Pass ``plan`` to reuse the routing across configs."""
    return next(simulate_many(wl, [cfg or SimConfig()], plan, record_links))


class BackwardBuilder(BackwardPass, LayerBuilder):
    """Builds the backward task graph (:mod:`sim.layer.backward`) with this module's helpers."""


def builder_class(cfg: SimConfig) -> type[LayerBuilder]:
    """The builder of ``cfg``'s pass: :class:`LayerBuilder` for the forward,
    :class:`BackwardBuilder` for the backward."""
    return BackwardBuilder if cfg.direction == "backward" else LayerBuilder


def forward_backward(
    wl: Workload, cfg: SimConfig | None = None, plan: RoutingPlan | None = None
) -> tuple[LayerResult, LayerResult]:
    """(forward, backward) of ``cfg`` (its direction and ``recompute`` say nothing about the
    forward; the backward keeps ``cfg.recompute``): a training step's two passes of the layer,
    each simulated alone (other layers run between them)."""
    cfg = cfg or SimConfig()
    fwd = cfg.replace(
        direction="forward", recompute=False, serial_backward=False, gather_backward=False
    )
    plan = plan or plan_for(wl, cfg.row_tile)
    f, b = simulate_many(wl, [fwd, backward_config(cfg)], plan)
    return f, b


def _structure_key(cfg: SimConfig) -> SimConfig:
    return cfg.replace(num_comm_sms=1)


def simulate_many(
    wl: Workload,
    configs: Sequence[SimConfig],
    plan: RoutingPlan | None = None,
    record_links: bool = False,
) -> Iterator[LayerResult]:
    """Simulate several configs of one workload, yielding results in input order.

    Configs that differ only in ``num_comm_sms`` share one task graph: it is built once and
    re-timed (:meth:`LayerBuilder.retime`) for each SM split. A group whose first config is a
    ring-size variant of the last group built (:meth:`LayerBuilder.can_share_with`) copies
    that build (:meth:`LayerBuilder.for_ring`) instead of building its own.
    """
    configs = list(configs)
    groups: dict[SimConfig, list[int]] = {}
    for i, c in enumerate(configs):
        groups.setdefault(_structure_key(c), []).append(i)
    out: dict[int, LayerResult] = {}
    nxt = 0
    last: LayerBuilder | None = None  # the last build, for its ring variants
    for idx in groups.values():
        cfg0 = configs[idx[0]]
        t0 = time.perf_counter()
        if plan is None or plan.row_tile != cfg0.row_tile:
            plan = plan_for(wl, cfg0.row_tile)
        if last is not None and last.plan is plan and last.can_share_with(cfg0):
            b = last.for_ring(cfg0)
        else:
            b = last = builder_class(cfg0)(wl, cfg0, plan)
            b.build()
        graph = b.g
        caps = b.topo.capacities(b.gpu)
        build_s = time.perf_counter() - t0
        for n, i in enumerate(idx):
            t1 = time.perf_counter()
            cfg = b.retime(configs[i].num_comm_sms) if n else cfg0
            run = run_graph(graph, caps, record_series=record_links)
            t2 = time.perf_counter()
            out[i] = b.finish(
                LayerResult.from_run(
                    wl,
                    cfg,
                    graph,
                    run,
                    b.topo,
                    payload_bytes=b.payload_bytes,
                    build_s=build_s if n == 0 else 0.0,
                    run_s=t2 - t1,
                )
            )
        while nxt in out:
            yield out.pop(nxt)
            nxt += 1
