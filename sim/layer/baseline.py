"""A training step of the layer as DeepEP + torch-best would run it: standalone kernels one after
another on one stream, the baseline ``mok-sim compare --pass both`` prints beside mok's rows.

Per rank, in order (N = the (token, k) rows the rank's experts receive, D = the distinct (token,
rank) pairs it receives, T = its tokens, H / I / Is = hidden / expert / shared intermediate):

* forward: **dispatch** (DeepEP normal mode, a collective: :mod:`sim.comm.deepep`) -> permute
  (gather the received rows into expert order) -> grouped GEMM gate / up -> SwiGLU -> grouped
  GEMM down -> unpermute (weight each row, sum the rank's rows of a token: one row per (token,
  rank)) -> **combine** (DeepEP, a collective) -> the shared expert (gate / up, SwiGLU, down) ->
  the sum of the two outputs;
* backward (autograd of the forward, activations saved: nothing recomputed, x not moved again):
  **dispatch of dY** (the combine's transpose) -> the unpermute's transpose (dY per (token, k)
  row, weighted, and the router-weight gradient from the saved rows) -> down dgrad -> dW_down ->
  the SwiGLU backward -> gate / up dgrad -> dW_gate/up -> the permute's transpose (the rank's
  rows of a token summed into one per (token, rank)) -> **combine of dX** (the dispatch's
  transpose) -> the shared expert's backward (two dgrads, two weight gradients, its SwiGLU) ->
  the sum of the input gradients.

No overlap: the communication and the GEMMs never run at once. A collective starts when the
last rank reaches it, and each rank then takes its own time (:meth:`DeepEPRates.phase_us`);
between collectives each rank runs its own pieces. A pass ends with its slowest rank.

Rates: the GEMMs are the standalone grouped GEMM's (``torch._grouped_mm``, the calibrated
:func:`sim.core.gemm_waves.standalone_gemm_us` tiling: 128 x 256 CUTLASS tiles in clusters of
two, the fill of a launch, the host floor of a call) on every SM of the GPU, each expert's rows
its own (the dense shared-expert GEMMs as a group of one). The weight gradients are grouped
GEMMs over the token axis: per expert an ``[N_out, K_out]`` output in those tiles, depth = the
mean rows per expert, the gradient written once. The glue (permute, SwiGLU, sums) moves its
ideal HBM bytes at the GPU's copy rate, read + written / 2 (as :func:`sim.core.gemm.reduce_us`).
Known optimism: torch's weight gradients measure 15-23 % slower than this tile rate
(docs/sim-validation.md, "The backward's GEMM pieces alone"), and DeepEP's dispatch layout and
its host-side wait for the receive counts are not counted. bf16 throughout, whatever mok's
``dtype``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from sim.comm.deepep import DeepEPRates, deepep_rates
from sim.config import Workload
from sim.core.gemm_waves import (
    PROBE_CLUSTER_M,
    PROBE_SMALL_MAX,
    PROBE_SMALL_TILE,
    PROBE_TILE,
    gemm_spec,
    load_kernel_waves,
    round_times,
)
from sim.core.hardware import GemmWaves, GpuProfile
from sim.layer.plan import RoutingPlan

__all__ = [
    "BASELINE_NAME",
    "Stage",
    "BaselineStep",
    "deepep_torch_step",
    "pair_rows",
    "format_baseline_table",
]

BASELINE_NAME = "DeepEP + torch-best"
BF16_BYTES = 2
KINDS = ("comm", "gemm", "glue")


@dataclass(frozen=True)
class Stage:
    """One piece of a pass: its per-rank time [R] (us) and whether it is a collective."""

    name: str
    kind: str  # "comm" | "gemm" | "glue"
    rank_us: np.ndarray
    collective: bool = False

    @property
    def us(self) -> float:
        """The slowest rank's time."""
        return float(self.rank_us.max()) if self.rank_us.size else 0.0


def run_stages(stages: list[Stage]) -> float:
    """End of the slowest rank after ``stages`` one after another: a collective starts when
    the last rank reaches it."""
    t = np.zeros_like(stages[0].rank_us) if stages else np.zeros(1)
    for s in stages:
        if s.collective:
            t = np.full_like(t, t.max())
        t = t + s.rank_us
    return float(t.max())


@dataclass
class BaselineStep:
    """The baseline's forward and backward (:func:`deepep_torch_step`)."""

    workload: Workload
    forward: list[Stage]
    backward: list[Stage]
    fwd_us: float = 0.0
    bwd_us: float = 0.0
    # NVLink payload bytes per pass ("forward" / "backward"), all ranks together
    nvlink_bytes: dict[str, float] = field(default_factory=dict)

    @property
    def step_us(self) -> float:
        return self.fwd_us + self.bwd_us

    def by_kind(self, which: str) -> dict[str, float]:
        """us by kind of a pass ("forward" / "backward"), the slowest rank of each stage."""
        out = dict.fromkeys(KINDS, 0.0)
        for s in getattr(self, which):
            out[s.kind] += s.us
        return out

    def summary(self) -> dict:
        row = {"impl": BASELINE_NAME, **self.workload.to_dict()}
        for which, tag, total in (
            ("forward", "fwd", self.fwd_us),
            ("backward", "bwd", self.bwd_us),
        ):
            row[f"{tag}_us"] = round(total, 3)
            row.update({f"{tag}_{k}_us": round(v, 3) for k, v in self.by_kind(which).items()})
            mb = self.nvlink_bytes.get(which, 0.0) / self.workload.ep / 1e6
            row[f"{tag}_nvlink_mb_per_rank"] = round(mb, 3)
        row["step_us"] = round(self.step_us, 3)
        return row


def pair_rows(plan: RoutingPlan) -> np.ndarray:
    """[R_src, R_dst] distinct (token, destination rank) pairs of each source rank's tokens."""
    nr, k = plan.num_ranks, plan.num_topk
    dest = plan.dest.reshape(-1, k)  # [R * T, K]
    hit = np.zeros((dest.shape[0], nr), dtype=bool)
    hit[np.arange(dest.shape[0])[:, None], dest] = True
    return hit.reshape(nr, plan.num_tokens, nr).sum(axis=1).astype(np.int64)


def grouped_us(
    gpu: GpuProfile, w: GemmWaves, counts: np.ndarray, n: int, k: float, sms: int
) -> float:
    """One ``torch._grouped_mm`` over groups of ``counts`` rows, output width ``n``, depth
    ``k``, on ``sms`` SMs, launched alone: :func:`sim.core.gemm_waves.standalone_gemm_us` with
    each group's own row tiles (the tile shape by the mean rows of the non-empty groups)."""
    counts = np.asarray(counts)
    live = counts[counts > 0]
    if live.size == 0 or n <= 0 or k <= 0:
        return 0.0
    small = float(live.mean()) <= PROBE_SMALL_MAX or n <= PROBE_SMALL_MAX
    tm, tn = PROBE_SMALL_TILE if small else PROBE_TILE
    tiles = -(-live // tm)  # each group's row tiles, rounded up to whole clusters
    per = -(-tiles // PROBE_CLUSTER_M) * PROBE_CLUSTER_M
    s = gemm_spec(gpu, w, int(per.sum()), n, k, int(live.size), sms, "bf16", tm, tn)
    return max(w.host_us, round_times([s], sms, w.fill_us)[1])


def wgrad_us(
    gpu: GpuProfile, w: GemmWaves, counts: np.ndarray, n_out: int, k_out: int, sms: int
) -> float:
    """The weight gradients ``[n_out, k_out]`` of the groups of ``counts`` rows as one grouped
    GEMM over the token axis: per group ``n_out`` rows of output in 128 x 256 tiles (clusters
    of two), depth the mean rows per group, each gradient written once."""
    live = np.asarray(counts)
    live = live[live > 0]
    if live.size == 0:
        return 0.0
    tm, tn = PROBE_TILE
    per = -(-math.ceil(n_out / tm) // PROBE_CLUSTER_M) * PROBE_CLUSTER_M
    e = int(live.size)
    s = gemm_spec(
        gpu, w, e * per, k_out, float(live.mean()), e, sms, "bf16", tm, tn, e * n_out * k_out
    )
    return max(w.host_us, round_times([s], sms, w.fill_us)[1])


def _glue(gpu: GpuProfile, traffic_bytes) -> np.ndarray:
    """us of memory-bound passes of ``traffic_bytes`` (read + written) at the copy rate."""
    return np.asarray(traffic_bytes, dtype=np.float64) / (2.0 * gpu.hbm_copy_gbps * 1e3)


def deepep_torch_step(
    wl: Workload,
    plan: RoutingPlan | None = None,
    gemm_profile: str | None = None,
    rates: DeepEPRates | None = None,
) -> BaselineStep:
    """The baseline's forward and backward on ``wl`` (module docstring). ``plan``: the routing
    (any row tile; only its counts are read), else ``wl``'s; ``gemm_profile``: GEMM rates of a
    fused profile instead of the GPU's standalone ones (as ``SimConfig.gemm_profile``);
    ``rates``: DeepEP's fitted rates (default: :func:`sim.comm.deepep.deepep_rates`)."""
    plan = plan or RoutingPlan(wl.make_trace())
    rates = rates or deepep_rates()
    gpu, shape, nr = wl.topo.gpu, wl.model_shape, wl.ep
    w = gpu.waves() if gemm_profile is None else load_kernel_waves(gpu, gemm_profile)
    sms = gpu.num_sms
    h, inter, si = shape.hidden, shape.intermediate, shape.shared_intermediate
    t_rank = plan.num_tokens
    counts = plan.expert_counts.sum(axis=1).reshape(nr, plan.num_local_experts)  # [R, L]
    n_rows = counts.sum(axis=1).astype(np.float64)  # [R] N
    pairs = pair_rows(plan)
    d_rows = pairs.sum(axis=0).astype(np.float64)  # [R] D received
    ones = np.ones(nr)

    def per_rank(fn, *args) -> np.ndarray:
        return np.array([fn(gpu, w, counts[r], *args, sms) for r in range(nr)])

    # the shared expert: every token of the rank, as a group of one (none: no time)
    shared_rows = np.array([t_rank if si else 0])

    def dense(n: int, k: int) -> np.ndarray:
        return ones * grouped_us(gpu, w, shared_rows, n, k, sms)

    def dense_wgrad(n_out: int, k_out: int) -> np.ndarray:
        return ones * wgrad_us(gpu, w, shared_rows, n_out, k_out, sms)

    def deepep(phase: str, name: str) -> Stage:
        if nr == 1:  # one rank: no DeepEP call at all
            return Stage(name, "comm", 0 * ones, collective=True)
        return Stage(name, "comm", rates.phase_us(phase, h, gpu, pairs), collective=True)

    row = h * BF16_BYTES
    fwd = [
        deepep("dispatch", "dispatch"),
        Stage("permute", "glue", _glue(gpu, 2 * n_rows * row)),
        Stage("gate_up", "gemm", per_rank(grouped_us, 2 * inter, h)),
        Stage("swiglu", "glue", _glue(gpu, n_rows * 3 * inter * BF16_BYTES)),
        Stage("down", "gemm", per_rank(grouped_us, h, inter)),
        Stage("unpermute", "glue", _glue(gpu, (n_rows + d_rows) * row)),
        deepep("combine", "combine"),
        Stage("shared_gate_up", "gemm", dense(2 * si, h)),
        Stage("shared_swiglu", "glue", _glue(gpu, ones * t_rank * 3 * si * BF16_BYTES)),
        Stage("shared_down", "gemm", dense(h, si)),
        Stage("sum", "glue", _glue(gpu, ones * 3 * t_rank * row)),
    ]
    bwd = [
        deepep("dispatch", "dispatch_dy"),
        # dY to every (token, k) row, weighted; the router-weight gradient reads the saved
        # expert outputs and the dY rows again
        Stage("unpermute_bwd", "glue", _glue(gpu, (d_rows + n_rows) * row + 2 * n_rows * row)),
        Stage("down_dgrad", "gemm", per_rank(grouped_us, inter, h)),
        Stage("dw_down", "gemm", per_rank(wgrad_us, h, inter)),
        Stage("swiglu_bwd", "glue", _glue(gpu, n_rows * 5 * inter * BF16_BYTES)),
        Stage("gate_up_dgrad", "gemm", per_rank(grouped_us, h, 2 * inter)),
        Stage("dw_gate_up", "gemm", per_rank(wgrad_us, 2 * inter, h)),
        Stage("permute_bwd", "glue", _glue(gpu, (n_rows + d_rows) * row)),
        deepep("combine", "combine_dx"),
        Stage("shared_down_dgrad", "gemm", dense(si, h)),
        Stage("shared_dw_down", "gemm", dense_wgrad(h, si)),
        Stage("shared_swiglu_bwd", "glue", _glue(gpu, ones * t_rank * 5 * si * BF16_BYTES)),
        Stage("shared_gate_up_dgrad", "gemm", dense(h, 2 * si)),
        Stage("shared_dw_gate_up", "gemm", dense_wgrad(2 * si, h)),
        Stage("sum_dx", "glue", _glue(gpu, ones * 3 * t_rank * row)),
    ]
    remote = pairs.sum() - np.trace(pairs)
    per_pass = 2.0 * float(remote) * row  # one DeepEP dispatch and one combine per pass
    return BaselineStep(
        wl,
        fwd,
        bwd,
        run_stages(fwd),
        run_stages(bwd),
        {"forward": per_pass, "backward": per_pass},
    )


def format_baseline_table(step: BaselineStep, mok: dict[str, tuple[float, float]]) -> str:
    """The baseline's forward, backward and step (us, and by kind) beside mok's rows (``mok``:
    label -> (forward us, backward us)), with mok's speedup over the baseline per step."""
    head = (
        f"{'':<22}{'fwd us':>10}{'bwd us':>10}{'step us':>10}{'DeepEP':>9}{'gemm':>9}"
        f"{'glue':>8}{'vs base':>9}"
    )
    f, b = step.by_kind("forward"), step.by_kind("backward")
    lines = [
        f"{BASELINE_NAME} (sim.layer.baseline: standalone kernels one after another, "
        "no overlap; bf16)",
        head,
        "-" * len(head),
        f"{BASELINE_NAME:<22}{step.fwd_us:>10.1f}{step.bwd_us:>10.1f}{step.step_us:>10.1f}"
        f"{f['comm'] + b['comm']:>9.1f}{f['gemm'] + b['gemm']:>9.1f}{f['glue'] + b['glue']:>8.1f}"
        f"{1.0:>8.3f}x",
    ]
    for label, (fu, bu) in mok.items():
        lines.append(
            f"{'mok ' + label:<22}{fu:>10.1f}{bu:>10.1f}{fu + bu:>10.1f}{'':>9}{'':>9}{'':>8}"
            f"{step.step_us / (fu + bu):>8.3f}x"
        )
    return "\n".join(lines)
