"""The layer's backward as a task graph (opt-in: ``SimConfig.direction="backward"``).

MoK's backward design (docs/backward.md), per rank, in the forward's round structure with the
roles reversed:

* ``schedule``: the forward's schedule task (the backward builds it again from the saved routing);
* comm SMs, before the GEMMs of round m: the **reverse combine**, a *pull* by the expert owner of
  the dY rows of the tokens routed to its experts in round m, from their home ranks (bf16 rows;
  the forward combine's rows, direction reversed), and of the same tokens' x rows (bf16, the
  layer input: ``dW_gate/up`` reads them, and ``recompute`` runs gate / up on them again; mok
  dispatches x a second time, as it does dY), so ``REV_COMBINE_ROWS`` = 2 rows per slot. After a
  dedup forward it pulls one row of each per (token, rank) and fans the others out locally, as
  the dedup dispatch does. The rows land in a buffer of every round, not in the forward's ring,
  since the weight gradients read them again (no back-pressure);
* compute SMs, in order: the shared expert's backward (dgrad and wgrad, overlapping the first
  reverse combine) -> the dgrads of round 0 -> round 1 -> ... -> the weight gradients of the local
  experts -> the home rank's sum. A round is, as one persistent tile queue
  (:func:`sim.core.gemm_waves.round_times`): [the recomputed gate/up GEMM, ``recompute=True``
  only] -> dgrad of down (``[rows, H] x [H, I]``: the forward down's FLOPs), with the SwiGLU
  backward and the router-weight gradient in its epilogue (``swiglu_bwd_bytes_per_elem`` HBM bytes
  per intermediate element, added to each tile) -> dgrad of gate/up (``[rows, 2I] x [2I, H]``:
  the forward gate/up's FLOPs);
* comm SMs, after the dgrads of round m: the **reverse dispatch**, a *push* of the dX rows into the
  home rank's per-(token, k) slots (the forward dispatch's rows in bf16, direction reversed),
  with the forward push combine's fence, jitter, flags and polls; the home rank sums each
  token's k rows and its shared expert's dX in fixed k order (the forward's final sum). After a
  dedup forward it is the forward's dedup combine: the owner folds its rows of a token into one
  partial per (token, rank) and pushes that. Each (token, k) row's **router-weight gradient**
  (one fp32, ``ROUTER_GRAD_BYTES``) goes home in the same transfer: mok stages it in the owner's
  symmetric memory and the home rank pulls it after the combine, 4 bytes per row on the same
  owner -> home direction, so the model adds its bytes to the push (its pull's read requests,
  a few bytes per row on the other direction, are left out). Each receive row's router weight
  itself comes from the schedule's all-gathered routing: no bytes of its own;
* the weight gradients: per local expert ``dW_down = dY^T H`` and ``dW_gate/up = [dG dU]^T X``
  over its whole token axis (the forward GEMMs' FLOPs again, so the backward's GEMM FLOPs are
  2x the forward's, plus one forward gate/up with ``recompute``), as two GEMMs on all
  compute SMs after the last dgrad round, overlapping the last reverse dispatches. Their
  ``[N_out, K_out]`` tiles have the expert's rows rounded up to ``wgrad_depth_step`` as
  depth (the weight-gradient kernel's k step, 16 by default: its region's padding to the row
  tile is then not computed); the model gives every local expert the mean depth (the FLOPs
  are exact; an uneven split over the experts is not seen).

MoK's choice, modelled whatever the forward's policies: pull reverse combine, push reverse
dispatch (``dispatch_mode`` / ``combine_mode`` keep naming the forward; only ``dedup_pull``
changes the backward's bytes). Bytes per rank and direction, N = (token, k) rows, D = distinct
(token, rank) pairs, H = hidden: home -> owner 2 x 2H per N row (D with dedup, plus the local
fan-out); owner -> home 2H per N row (D with dedup) + 4 per N row. As built (mok/autograd.py,
EP > 1) the same transfers run one after another with the GEMMs between them; the model
overlaps them in rounds, the design. The GEMMs run at the forward's rates and ``dtype``;
nothing of it is fitted. ``mok-sim validate`` on the train CSV of ``python -m mok.bench train``
compares it with mok's backward as it runs today, which runs its pieces one after another
instead (:func:`sim.app.validate.validate_train_rows`; docs/sim-validation.md).

The serial backward (``SimConfig.serial_backward``, opt-in, one rank): mok's backward as it runs
at one rank today (docs/backward.md, "What runs"), a chain of pieces each on every SM of the
layer's budget, none overlapping the next (a ``mok.bench train --kernels`` profile's kernels add
up to the step), in place of the design above:

* ``schedule``: the schedule task, as in the design;
* ``rev_combine``: two copies of every (token, k) slot's bf16 row, dY then x, each a local
  transfer at the probe's copy rate of all the budget's SMs (``REV_COMBINE_ROWS`` rows per slot,
  the design's bytes); none with ``gather_backward`` (the GEMMs read the rows from the tokens,
  ``mok.autograd.GATHER_BACKWARD``);
* the GEMMs, each as its own launch over all the rows (one round): [the recomputed gate / up],
  the down dgrad with the SwiGLU backward in its epilogue (``swiglu_bwd_bytes_per_elem``), the
  gate / up dgrad, ``dW_down``, ``dW_gate/up`` (the design's specs on every SM); each pays the
  standalone launch's fill (``fill_us``, not the megakernel's ``layer_fill_us``) and ends with
  its last tile (the list schedule's ``done``, tail included); then the shared expert's, the
  same way;
* ``reduce``: the one-pass combine, each token's k dX rows read and summed into its bf16 row
  (:func:`sim.core.gemm.reduce_us` of every (token, k) row in and every token out: what mok's
  one-rank combine moves, ``warp_weighted_sum_one_rank``).

Not modelled: the zero-fill of the receive buffers' padding rows, the router-weight gradient's
staging and the small torch ops between the pieces, and the one launch that runs the four GEMMs
from saved g / u (each GEMM pays its own fill here: 3 fills too many, ~40 us). The GEMM rates are
the design's (the GPU profile's or ``gemm_profile``'s).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from sim.config import SimConfig, Workload
from sim.core.engine import Graph
from sim.core.gemm import reduce_us
from sim.core.gemm_waves import GemmSpec, gemm_spec, round_times
from sim.layer.plan import RoutingPlan
from sim.layer.policies import DedupPullDispatch, PullDispatch, PushCombine
from sim.layer.results import LayerResult

__all__ = [
    "BackwardPass",
    "BACKWARD_ROLES",
    "REV_COMBINE_ROWS",
    "ROUTER_GRAD_BYTES",
    "backward_config",
]

# the phases whose comm rates a kernel profile sets in the backward (sim.layer.model.
# kernel_knobs): the reverse combine (a pull, in the dispatch's place before the GEMMs) and the
# reverse dispatch (a push, in the combine's)
BACKWARD_ROLES = ("rev_combine", "rev_dispatch")
# bf16 rows the reverse combine pulls per slot: dY (the output gradient) and x (the layer input,
# which dW_gate/up reads and recompute=True runs gate / up on again), same rows, same pattern
REV_COMBINE_ROWS = 2
# the router-weight gradient of one (token, k) row: one fp32, owner -> home rank
ROUTER_GRAD_BYTES = 4.0


def backward_config(cfg: SimConfig, recompute: bool | None = None) -> SimConfig:
    """``cfg`` for the backward pass (``recompute`` as given, else as in ``cfg``)."""
    rc = cfg.recompute if recompute is None else recompute
    return cfg.replace(direction="backward", recompute=rc)


class BackwardPass:
    """The backward's part of :class:`sim.layer.model.BackwardBuilder` (``BackwardPass`` before
    the forward's ``LayerBuilder`` in its bases): builds the backward task graph (module
    docstring) with the forward builder's helpers. A mixin, so that this module does not import
    the layer model (which picks the builder by the config's direction)."""

    roles = BACKWARD_ROLES

    def __init__(self, wl: Workload, cfg: SimConfig, plan: RoutingPlan) -> None:
        if cfg.direction != "backward":
            raise ValueError(
                f"BackwardBuilder needs direction='backward' (found {cfg.direction!r})"
            )
        if cfg.serial_backward and (wl.ep != 1 or cfg.kernel_profile is not None):
            raise ValueError(
                "serial_backward models mok's backward at one rank, its copies at the probe's "
                f"rates (found EP{wl.ep}, kernel_profile={cfg.kernel_profile!r})"
            )
        super().__init__(wl, cfg, plan)
        bf16_row = float(self.shape.hidden * 2)
        # the policies' row sizes: the reverse combine (the dispatch role) pulls the dY row and
        # the x row of every slot (REV_COMBINE_ROWS bf16 rows), the reverse dispatch (the combine
        # role) pushes one bf16 dX row per slot; the copy loops move bf16 rows either way
        self.copy_row_bytes = bf16_row
        self.dispatch_row_bytes = REV_COMBINE_ROWS * bf16_row
        self.combine_row_bytes = bf16_row
        # one dX row per (token, k) slot; after a dedup forward one partial per (token, rank),
        # the forward's dedup combine (rank-local rows folded first)
        self.combine_rows = self.rc.uniq_last if cfg.dedup else self.rc.rows
        self._set_sms()  # the kernel-profile rates scale with the row size
        # (busy task, tail task, key of _bwd_us) of every compute task, for retime
        self._bwd: list[tuple[int, int, tuple]] = []
        self._bwd_cache: dict[tuple, tuple[float, float]] = {}
        self.wgrad_tasks: dict[int, tuple[int, int]] = {}
        self.arrivals: dict[int, list[int]] = {}

    def _set_sms(self) -> None:
        super()._set_sms()
        if self.cfg.serial_backward:
            # each piece runs alone on every SM of the budget: the copies at that many SMs' rate
            sms = self.cfg.sms_on(self.gpu.num_sms)
            self.compute_sms = sms
            self.rates = self.probe_rates(sms)

    def combine_bytes(self, d: int, m: int) -> tuple[np.ndarray, float]:
        """(peer bytes [R_home], local bytes) of owner d's reverse dispatch of round m: the
        forward combine's (dX rows; after a dedup forward its partials and fold bytes) plus
        the router-weight gradient, ``ROUTER_GRAD_BYTES`` per (token, k) row of the round."""
        peer, local = super().combine_bytes(d, m)
        return peer + self.rc.rows[d, m] * ROUTER_GRAD_BYTES, local

    # -- GEMMs ----------------------------------------------------------------------------------
    def _spec(self, row_tiles, n, k, experts, weight_elems=None) -> GemmSpec:
        cfg = self.cfg
        return gemm_spec(
            self.gpu,
            self.waves,
            row_tiles,
            n,
            k,
            experts,
            self.compute_sms,
            cfg.dtype,
            cfg.row_tile,
            weight_elems=weight_elems,
        )

    def dgrad_specs(self, row_tiles: int, intermediate: int, experts: int) -> list[GemmSpec]:
        """The GEMMs of one backward round: [recompute gate/up], dgrad of down with the SwiGLU
        backward in its epilogue, dgrad of gate/up."""
        h = self.shape.hidden
        specs = []
        if self.cfg.recompute:
            specs.append(self._spec(row_tiles, 2 * intermediate, h, experts))
        dn = self._spec(row_tiles, intermediate, h, experts)
        specs.append(self._with_swiglu(dn))
        specs.append(self._spec(row_tiles, h, 2 * intermediate, experts))
        return specs

    def _with_swiglu(self, dn: GemmSpec) -> GemmSpec:
        """The down dgrad's tiles with the SwiGLU backward in their epilogue: each tile of
        ``row_tile x n_tile`` intermediate elements moves ``swiglu_bwd_bytes_per_elem`` HBM
        bytes per element at its SM's share of the copy rate (read + write, as the final sum)."""
        if dn.tiles == 0 or self.cfg.swiglu_bwd_bytes_per_elem == 0:
            return dn
        gpu, cfg = self.gpu, self.cfg
        nbytes = cfg.row_tile * gpu.gemm_n_tile * cfg.swiglu_bwd_bytes_per_elem
        extra = nbytes * self.compute_sms / (2.0 * gpu.hbm_copy_gbps * 1e3)
        return dataclasses.replace(
            dn, tile_us=dn.tile_us + extra, compute_tile_us=dn.compute_tile_us + extra
        )

    def wgrad_specs(self, experts: int, rows: float, intermediate: int) -> list[GemmSpec]:
        """The weight gradients of ``experts`` experts with ``rows`` rows in all (each
        expert's rounded up to ``cfg.wgrad_depth_step``):
        ``dW_down [H, I]`` and ``dW_gate/up [2I, H]`` per expert, depth = the mean rows per
        expert; each writes its gradient once (the weight-streaming term)."""
        if experts <= 0 or rows <= 0:
            return []
        h, rt = self.shape.hidden, self.cfg.row_tile
        depth = rows / experts
        dn = self._spec(
            experts * -(-h // rt), intermediate, depth, experts, experts * h * intermediate
        )
        gu_rows = experts * -(-2 * intermediate // rt)
        gu = self._spec(gu_rows, h, depth, experts, experts * 2 * intermediate * h)
        return [dn, gu]

    def _bwd_us(self, key: tuple) -> tuple[float, float]:
        """(busy, tail) of a backward compute task: ``("dgrad", row tiles, intermediate,
        experts)``, ``("wgrad", experts, rows, intermediate)`` or ``("shared", row tiles,
        intermediate)`` (the shared expert's dgrads and weight gradients in one queue)."""
        ck = (key, self.compute_sms)
        out = self._bwd_cache.get(ck)
        if out is not None:
            return out
        kind = key[0]
        if kind == "dgrad":
            specs, handoff = self.dgrad_specs(*key[1:]), self.gpu.flag_latency_local_us
        elif kind == "wgrad":
            specs, handoff = self.wgrad_specs(*key[1:]), 0.0
        else:
            tiles, inter = key[1:]
            specs = self.dgrad_specs(tiles, inter, 1) if tiles > 0 else []
            specs += self.wgrad_specs(1, tiles * self.cfg.row_tile, inter)
            handoff = self.gpu.flag_latency_local_us
        if not specs or all(s.tiles == 0 for s in specs):
            out = (0.0, 0.0)
        else:
            busy, done = round_times(specs, self.compute_sms, self.waves.layer_fill_us, handoff)
            out = (busy, max(0.0, done - busy))  # >= 0 but for rounding, as the forward's
        self._bwd_cache[ck] = out
        return out

    def piece_us(self, r: int = 0) -> dict[str, float]:
        """Rank ``r``'s backward GEMMs by piece, in us of the compute SMs' fluid occupancy (each
        GEMM's fill and handoff, then its tiles over the compute SMs; the busy time of
        :func:`sim.core.gemm_waves.round_times` split by GEMM, tails left out): ``recompute``
        (the gate/up GEMM again, with ``recompute``), ``down_dgrad`` (with the SwiGLU backward),
        ``gate_up_dgrad``, summed over the rounds; ``dw_down`` and ``dw_gate_up``; ``shared`` (the
        shared expert's whole backward). The serial backward's: :meth:`serial_piece_us`."""
        if self.cfg.serial_backward:
            return self.serial_piece_us(r)
        rc, inter = self.rc, self.shape.intermediate
        fill, handoff, p = (
            self.waves.layer_fill_us,
            self.gpu.flag_latency_local_us,
            self.compute_sms,
        )

        def busy(specs: list[GemmSpec], handoff_us: float) -> list[float]:
            # as round_times: a GEMM with tiles pays the fill, and the handoff after the first
            return [
                fill + (handoff_us if i else 0.0) + s.tiles * s.tile_us / p if s.tiles > 0 else 0.0
                for i, s in enumerate(specs)
            ]

        names = (("recompute",) if self.cfg.recompute else ()) + ("down_dgrad", "gate_up_dgrad")
        out = dict.fromkeys(names, 0.0)
        experts = self.experts_per_round()
        for m in range(int(rc.num_rounds[r])):
            specs = self.dgrad_specs(int(rc.row_tiles[r, m]), inter, int(experts[r, m]))
            for name, us in zip(names, busy(specs, handoff), strict=True):
                out[name] += us
        depth = self._wgrad_depth_rows()[r]
        wg = self.wgrad_specs(int((depth > 0).sum()), float(depth.sum()), inter)
        out.update(zip(("dw_down", "dw_gate_up"), busy(wg, 0.0) if wg else (0.0, 0.0), strict=True))
        out["shared"] = self._bwd_us(
            ("shared", self._shared_tiles(), self.shape.shared_intermediate)
        )[0]
        return out

    def serial_piece_us(self, r: int = 0) -> dict[str, float]:
        """The serial backward's GEMMs (module docstring) by piece, :meth:`piece_us`'s names:
        each one launch over rank ``r``'s rows on :attr:`compute_sms` SMs, from its fill
        (``fill_us``) to its last tile; ``shared`` the shared expert's GEMMs one after another."""
        cfg, inter, p = self.cfg, self.shape.intermediate, self.compute_sms
        fill = self.waves.fill_us

        def done(specs: list[GemmSpec]) -> list[float]:
            return [round_times([s], p, fill)[1] if s.tiles > 0 else 0.0 for s in specs]

        plan = self.plan
        regions = plan.expert_counts.sum(axis=1).reshape(plan.num_ranks, plan.num_local_experts)
        tiles = -(-int(plan.padded_rows[r]) // cfg.row_tile)
        names = (("recompute",) if cfg.recompute else ()) + ("down_dgrad", "gate_up_dgrad")
        experts = int((regions[r] > 0).sum())
        out = dict(zip(names, done(self.dgrad_specs(tiles, inter, experts)), strict=True))
        depth = self._wgrad_depth_rows()[r]
        wg = self.wgrad_specs(int((depth > 0).sum()), float(depth.sum()), inter)
        out.update(zip(("dw_down", "dw_gate_up"), done(wg) if wg else (0.0, 0.0), strict=True))
        sh_tiles, sh_inter = self._shared_tiles(), self.shape.shared_intermediate
        shared = []
        if sh_tiles > 0:
            shared = self.dgrad_specs(sh_tiles, sh_inter, 1)
            shared += self.wgrad_specs(1, sh_tiles * cfg.row_tile, sh_inter)
        out["shared"] = sum(done(shared))
        return out

    def _wgrad_depth_rows(self) -> np.ndarray:
        """[R, local experts] the weight gradients' depth of each expert: its rows rounded up
        to ``cfg.wgrad_depth_step`` (mok's weight-gradient kernel reduces an expert's rows in
        16-row k steps up to its group's end: with regions padded to 16 rows that is the last
        step that holds its rows, so the padding to the GEMM row tile is not part of the depth;
        over regions padded to the row tile it is)."""
        plan = self.plan
        step = self.cfg.wgrad_depth_step
        rows = -(-plan.expert_counts.sum(axis=1) // step) * step
        return rows.reshape(plan.num_ranks, plan.num_local_experts)

    def _shared_tiles(self) -> int:
        """Row tiles of the shared expert (0 without one)."""
        if not self.shape.shared_intermediate:
            return 0
        return -(-self.wl.tokens_per_rank // self.cfg.row_tile)

    def _task(self, key, deps, r, phase, m=-1, tail_phase="gemm_tail") -> tuple[int, int]:
        busy, tail = self._bwd_us(key)
        t = self.g.delay(busy, deps, r, phase, m)
        done = self.g.delay(tail, [t], r, tail_phase, m)
        self._bwd.append((t, done, key))
        return t, done

    def retime(self, num_comm_sms: int) -> SimConfig:
        cfg = super().retime(num_comm_sms)
        dur = self.g.duration
        for t, tail, key in self._bwd:
            dur[t], dur[tail] = self._bwd_us(key)
        return cfg

    def can_share_with(self, cfg: SimConfig) -> bool:
        return False  # no ring variants: the backward has no ring

    # -- the layer ------------------------------------------------------------------------------
    def build(self) -> Graph:
        if self.cfg.serial_backward:
            return self._build_serial()
        g, cfg, rc, shape, gpu = self.g, self.cfg, self.rc, self.shape, self.gpu
        nr = self.num_ranks
        self.add_schedule()
        rev_combine = DedupPullDispatch if cfg.dedup else PullDispatch
        ready = rev_combine(phase="rev_combine", ring=False).build(self)
        self.ring_deps = None  # nothing ring-dependent to copy (can_share_with: False)
        experts = self.experts_per_round()
        depth = self._wgrad_depth_rows()
        sh_tiles = self._shared_tiles()
        gemm_done, chain, finals = {}, {}, {}
        for r in range(nr):
            prev, sh_done = self._task(
                ("shared", sh_tiles, shape.shared_intermediate), [], r, "shared_expert"
            )
            last = sh_done
            for m in range(int(rc.num_rounds[r])):
                key = ("dgrad", int(rc.row_tiles[r, m]), shape.intermediate, int(experts[r, m]))
                prev, last = self._task(key, [ready[(r, m)], prev], r, "gemm", m)
                gemm_done[(r, m)] = g.delay(self.flag_local, [last], r, "signal", m)
            n_exp = int((depth[r] > 0).sum())
            key = ("wgrad", n_exp, float(depth[r].sum()), shape.intermediate)
            w, w_done = self._task(key, [prev, last], r, "wgrad", tail_phase="wgrad_tail")
            self.wgrad_tasks[r] = (w, w_done)
            chain[r] = w
            finals[r] = [sh_done, w_done]
        self.arrivals = PushCombine(phase="rev_dispatch").build(self, gemm_done)
        rows_in = self.combine_rows.sum(axis=(0, 1))  # [R_home]
        for s in range(nr):
            dur = reduce_us(gpu, int(rows_in[s]), self.wl.tokens_per_rank, shape.hidden)
            g.delay(dur, [chain[s], *finals[s], *self.arrivals[s]], s, "reduce")
        return g

    def _build_serial(self) -> Graph:
        """The serial backward's chain on rank 0 (module docstring)."""
        g, cfg, shape = self.g, self.cfg, self.shape
        self.add_schedule()
        rows = int(self.plan.expert_counts.sum())  # every (token, k) slot: one rank
        prev = self.sched
        if not cfg.gather_backward:
            for _ in range(REV_COMBINE_ROWS):  # dY, then x
                row_bytes = rows * self.copy_row_bytes
                prev = self.transfer(0, "pull", True, [0.0], row_bytes, [prev], 0, "rev_combine", 0)
        phases = {"dw_down": "wgrad", "dw_gate_up": "wgrad", "shared": "shared_expert"}
        wgrad, ready = [], prev
        for name, us in self.serial_piece_us(0).items():
            if name.startswith("dw_") and not wgrad:
                ready = prev  # the combine's dX rows are complete here
            prev = g.delay(us, [prev], 0, phases.get(name, "gemm"))
            if name.startswith("dw_"):
                wgrad.append(prev)
        # the weight gradients run between the last dgrad and the combine: all of them delay it
        self.arrivals = {0: [ready]}
        self.wgrad_tasks = {0: (wgrad[0], wgrad[-1])}
        tokens = self.wl.tokens_per_rank
        g.delay(reduce_us(self.gpu, rows, tokens, shape.hidden), [prev], 0, "reduce")
        return g

    def finish(self, result: LayerResult) -> LayerResult:
        """Adds the weight gradients' time and tail (:class:`LayerResult` ``wgrad_us``,
        ``wgrad_tail_us``) from the run."""
        end, start = result.run.end_us, result.run.start_us
        spans, tails = [], []
        for s, (w, w_done) in self.wgrad_tasks.items():
            spans.append(float(end[w_done] - start[w]))
            arr = self.arrivals.get(s) or []
            last_in = max((float(end[t]) for t in arr), default=0.0)
            tails.append(max(0.0, float(end[w_done]) - last_in))
        result.wgrad_us = float(np.mean(spans)) if spans else 0.0
        result.wgrad_tail_us = max(tails, default=0.0)
        return result
