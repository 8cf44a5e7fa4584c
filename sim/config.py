"""What to simulate: the workload (model shape, tokens, EP, topology, skew) and the kernel config.

``SimConfig`` mirrors ``mok.MoKConfig`` (dispatch/combine mode, comm SMs, minibatch, macrobatch,
row tile) plus the simulator's own knobs, each documented where it is declared.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace

from mok.spec.config import COMBINE_MODES, MoKConfig
from mok.spec.config import DISPATCH_MODES as KERNEL_DISPATCH_MODES
from mok.spec.workload import ModelShape, RoutingTrace, Skew, get_shape, make_routing
from sim.core.topology import Topology, get_topology

__all__ = ["Workload", "SimConfig", "DISPATCH_MODES", "COMBINE_MODES", "DIRECTIONS"]

# the kernel's dispatch modes (mok.spec.config) in the order the simulator's sweeps, tables and
# --help list them: the all-push baseline first
DISPATCH_MODES = ("push", *(m for m in KERNEL_DISPATCH_MODES if m != "push"))
# the passes of the layer the simulator builds a task graph for (SimConfig.direction); forward +
# backward is the two results together (sim.layer.backward.forward_backward)
DIRECTIONS = ("forward", "backward")


@dataclass(frozen=True)
class Workload:
    shape: str = "deepseek-v3"
    tokens_per_rank: int = 4096
    ep: int = 8
    topology: str = "hgx-h200"
    skew: str = "uniform"
    seed: int = 0

    def __post_init__(self) -> None:
        shape = self.model_shape  # validates the name
        topo = self.topo
        if self.tokens_per_rank <= 0:
            raise ValueError(f"tokens_per_rank must be positive (found {self.tokens_per_rank})")
        if not 1 <= self.ep <= topo.num_gpus:
            raise ValueError(
                f"EP{self.ep} does not fit {topo.name} ({topo.num_gpus} GPUs); use a multi-domain "
                f"topology such as {topo.name}x2 for EP beyond one NVLink domain"
                if topo.num_gpus < self.ep
                else f"ep must be >= 1 (found {self.ep})"
            )
        if shape.num_experts % self.ep:
            raise ValueError(
                f"{shape.name} has {shape.num_experts} experts, not divisible by EP{self.ep}"
            )
        Skew.parse(self.skew)

    @property
    def model_shape(self) -> ModelShape:
        return get_shape(self.shape)

    @property
    def topo(self) -> Topology:
        return get_topology(self.topology)

    def make_trace(self) -> RoutingTrace:
        s = self.model_shape
        return make_routing(
            self.tokens_per_rank, s.num_experts, s.num_topk, self.ep, self.skew, self.seed
        )

    def label(self) -> str:
        return f"{self.shape} T{self.tokens_per_rank} EP{self.ep} {self.topology} {self.skew}"

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class SimConfig:
    dispatch_mode: str = "pull"
    combine_mode: str = "push"
    num_comm_sms: int = 24
    minibatch_size: int = 4096  # received (token, expert) rows per destination rank per round
    macrobatch_size: int = 16384  # rows in each rank's receive ring (multiple of minibatch)
    row_tile: int = 128  # GEMM row tile; expert regions are padded to it
    mechanism: str = "tma"  # "tma" (bulk copies) or "st" (16-byte loads/stores)
    dtype: str = "bf16"  # dispatch rows and GEMMs: "bf16" or "mxfp8"; combine rows are bf16
    flow_granularity: str = "round"  # "round": one flow per transfer, "peer": one per peer
    # store -> remote visibility as a fraction of a dependent remote load (one way vs round trip)
    push_latency_fraction: float = 0.5
    # cost of checking one more peer's completion flag (push dispatch waits on every sender)
    flag_poll_us_per_peer: float = 0.005
    # dedup combine: extra local bytes per element for each rank-local row folded into the
    # per-(token, rank) fp32 partial sum (read bf16 2 + read fp32 4 + write fp32 4)
    dedup_accumulate_bytes_per_elem: float = 10.0
    # schedule build (counts all-gather + prefix sums on the GPU): fixed part + per-row part
    schedule_base_us: float = 2.0
    schedule_ns_per_row: float = 0.05
    # opt-in measured copy-loop efficiency: name (sim/profiles/<name>.json) or path of a
    # KernelProfile JSON (format mok-kernel-profile/1, e.g. "mok-comm-h200x2"). None: the
    # per-SM comm rates are the probe's curves. Set: the dispatch and combine transfers run at
    # the probe rates times the fitted in-flight factor and SM congestion of the mok kernel
    # that plays each role (sim.layer.model.kernel_knobs; no per-call costs are added). Checked
    # against the profile where it is used (sim.layer.model.check_kernel_profile), not here: a
    # SimConfig validates its own fields and reads no file
    kernel_profile: str | None = None
    # opt-in measured GEMM rates of the megakernel: name or path of a fused profile
    # (format mok-fused-profile/1, e.g. "mok-fused-h200x2"). None: the GPU profile's GEMM
    # waves, the standalone grouped GEMM's rates (sim.core.gemm_waves). Set: the expert GEMMs
    # run at that kernel's k-loop efficiency, per-tile fixed cost and operand ceiling
    # (sim.fused.profile.FusedProfile.gemm_waves); read where it is used, not here
    gemm_profile: str | None = None
    # the pass to simulate: "forward" (default) or "backward" (opt-in, sim.layer.backward: pull
    # reverse combine of dY and x rows, dgrad GEMMs, push reverse dispatch of dX rows with the
    # router-weight gradient, weight gradients at the end; dispatch_mode / combine_mode keep
    # naming the forward's policies, and only dedup_pull changes the backward: one dY and one x
    # row per (token, rank) plus local fan-out, one dX partial per (token, rank) back)
    direction: str = "forward"
    # backward only: recompute the forward's gate/up GEMM in every round (activations not saved)
    recompute: bool = False
    # backward only: the SwiGLU backward in the down dgrad's epilogue, HBM bytes per element of
    # the intermediate (read the saved g, u in bf16: 4; write dG, dU in bf16: 4)
    swiglu_bwd_bytes_per_elem: float = 8.0
    # backward only: the weight gradients' depth step (rows): each expert's rows rounded up to
    # it. mok's weight-gradient kernel steps 16 rows at a time and stops at its group's end: 16
    # where the regions are padded to 16 (the unfused path's backward), the row tile where the
    # backward runs over regions padded to it (from the fused forward's kept g / u)
    wgrad_depth_step: int = 16
    # backward only: the backward as mok runs it at one rank (sim.layer.backward, "The serial
    # backward"): its pieces one after another, each on every SM of the budget (the schedule, the
    # dY and x row copies, each GEMM as its own launch, the shared expert, the one-pass combine),
    # instead of the fused design's overlap of transfers and GEMMs on a comm / compute SM split;
    # num_comm_sms and the rounds then play no part
    serial_backward: bool = False
    # serial backward only: the GEMMs read their dY and x rows from the tokens
    # (mok.autograd.GATHER_BACKWARD), so no row copies run
    gather_backward: bool = False
    # the layer's SM budget (MoKConfig.num_sms): the SMs its kernels use, communication and GEMMs
    # together; 0: every SM of the GPU. The rest are left to other work (not modelled).
    num_sms: int = 0

    def __post_init__(self) -> None:
        if self.dispatch_mode not in DISPATCH_MODES:
            raise ValueError(
                f"unknown dispatch_mode {self.dispatch_mode!r}; supported: "
                f"{', '.join(DISPATCH_MODES)}"
            )
        if self.combine_mode not in COMBINE_MODES:
            raise ValueError(
                f"unknown combine_mode {self.combine_mode!r}; supported: {', '.join(COMBINE_MODES)}"
            )
        if self.dispatch_mode == "dedup_pull" and self.combine_mode != "push":
            raise ValueError(
                "dispatch_mode='dedup_pull' pairs with the dedup push combine (rank-local "
                f"reduction, one row per (token, rank)); found combine_mode={self.combine_mode!r}"
            )
        if self.num_comm_sms < 1:
            raise ValueError(f"num_comm_sms must be >= 1 (found {self.num_comm_sms})")
        if self.row_tile <= 0 or self.minibatch_size % self.row_tile or self.minibatch_size <= 0:
            raise ValueError(
                f"minibatch_size={self.minibatch_size} must be a positive multiple of "
                f"row_tile={self.row_tile}"
            )
        if self.macrobatch_size < self.minibatch_size or self.macrobatch_size % self.minibatch_size:
            raise ValueError(
                f"macrobatch_size={self.macrobatch_size} must be a multiple of "
                f"minibatch_size={self.minibatch_size} (>= 1 ring slot)"
            )
        if self.mechanism not in ("tma", "st"):
            raise ValueError(f"mechanism must be 'tma' or 'st' (found {self.mechanism!r})")
        if self.dtype not in ("bf16", "mxfp8"):
            raise ValueError(f"dtype must be 'bf16' or 'mxfp8' (found {self.dtype!r})")
        if self.flow_granularity not in ("round", "peer"):
            raise ValueError(
                f"flow_granularity must be 'round' or 'peer' (found {self.flow_granularity!r})"
            )
        if self.direction not in DIRECTIONS:
            raise ValueError(
                f"unknown direction {self.direction!r}; supported: {', '.join(DIRECTIONS)}"
            )
        if not isinstance(self.recompute, bool):
            raise ValueError(f"recompute must be True or False (found {self.recompute!r})")
        if self.recompute and self.direction != "backward":
            raise ValueError("recompute=True applies to direction='backward' only")
        if isinstance(self.num_sms, bool) or not isinstance(self.num_sms, int) or self.num_sms < 0:
            raise ValueError(
                f"num_sms must be an int >= 0, 0 for every SM (found {self.num_sms!r})"
            )
        if self.num_sms and self.num_comm_sms >= self.num_sms:
            raise ValueError(
                f"num_comm_sms={self.num_comm_sms} leaves no GEMM SMs in the budget "
                f"num_sms={self.num_sms}"
            )
        if not isinstance(self.wgrad_depth_step, int) or self.wgrad_depth_step < 1:
            raise ValueError(
                f"wgrad_depth_step must be a positive int (found {self.wgrad_depth_step!r})"
            )
        if self.swiglu_bwd_bytes_per_elem < 0:
            raise ValueError(
                f"swiglu_bwd_bytes_per_elem must be >= 0 (found {self.swiglu_bwd_bytes_per_elem})"
            )
        for name in ("serial_backward", "gather_backward"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False (found {getattr(self, name)!r})")
        if self.serial_backward and self.direction != "backward":
            raise ValueError("serial_backward=True applies to direction='backward' only")
        if self.gather_backward and not self.serial_backward:
            raise ValueError("gather_backward=True applies to the serial backward only")

    def sms_on(self, gpu_sms: int) -> int:
        """The SMs the layer uses on a GPU of ``gpu_sms``: the budget, at most the GPU's."""
        return min(gpu_sms, self.num_sms) if self.num_sms else gpu_sms

    @property
    def ring_slots(self) -> int:
        return self.macrobatch_size // self.minibatch_size

    @property
    def dedup(self) -> bool:
        return self.dispatch_mode == "dedup_pull"

    def label(self) -> str:
        kp = f" kernels={self.kernel_profile}" if self.kernel_profile is not None else ""
        if self.direction != "forward":
            kp += f" {self.direction}{' recompute' if self.recompute else ''}"
            kp += " serial" if self.serial_backward else ""
            kp += " gather" if self.gather_backward else ""
        if self.num_sms:
            kp += f" budget={self.num_sms}"
        return (
            f"{self.dispatch_mode}/{self.combine_mode} sms={self.num_comm_sms} "
            f"mb={self.minibatch_size} ring={self.ring_slots}{kp}"
        )

    def replace(self, **kw) -> SimConfig:
        return replace(self, **kw)

    def to_dict(self) -> dict:
        return asdict(self)

    def mok_config(self) -> MoKConfig:
        """The kernel's configuration for this simulated one (validated by MoKConfig)."""
        return MoKConfig(
            dispatch_mode=self.dispatch_mode,
            combine_mode=self.combine_mode,
            num_comm_sms=self.num_comm_sms,
            # one comm SM count for both passes: the simulator's backward (direction="backward")
            # runs on the same split as the forward
            num_comm_sms_bwd=self.num_comm_sms,
            minibatch_size=self.minibatch_size,
            macrobatch_size=self.macrobatch_size,
            row_tile=self.row_tile,
            num_sms=self.num_sms,
        )
