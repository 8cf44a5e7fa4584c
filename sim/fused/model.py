"""The fused MoE layer forward (``csrc/layer.cuh``, one persistent kernel) as a timing model.

What one call of :func:`mok.functional.moe_forward` with ``fused=True`` costs on the device:

1. ``schedule_us``: the schedule kernel (routing all-gather + table), the comm-kernel profile's
   :func:`sim.comm.model.schedule_device_us`;
2. ``launch_us``: the layer kernel's launch, fill and final fence as CUDA events see it, the
   comm-kernel profile's ``call_fixed_us`` (one cooperative launch);
3. the kernel. Blocks ``[0, C)`` (``num_comm_sms``) stage ``x`` into the symmetric buffer, wait
   for every peer's staging (one remote flag), then pull-dispatch: ``pull`` copies each
   minibatch's rows (remote rows from the peer's ``x``, own rows locally); ``dedup_pull`` first
   pulls one row per (token, this rank) from the peers and then fans each minibatch out
   locally. ``ready[m]`` follows each minibatch (a GPU-scope flag). The other ``W = num_sms -
   C`` blocks run 128 x 256 GEMM tiles in the kernel's fixed order (shared gate/up, shared
   down, then ``GU(0), GU(1), DN(0), GU(2), DN(1), ..., DN(last)``), each tile in order on
   the worker that frees first (the kernel's workers claim tiles in order from one counter;
   :func:`sim.fused.tiles.tile_order`). Every expert region of the receive buffer is padded to
   ``row_tile`` rows (``MoKConfig.row_tile``: 64 or 128) and the padding rows are multiplied too.
   The routed tiles are enumerated per 128-row block of each minibatch's padded rows (``ceil(rows /
   128)`` blocks) whatever the row tile; with ``row_tile = 64`` a block that holds an expert
   boundary at its row 64, or whose upper half lies at or past the padded rows, is split
   (:func:`sim.fused.tiles.routed_halves`): it runs as 64-row sub-tiles, one per half that holds
   rows, each against its own expert's weights, one after the other on the worker that claimed the
   block. With ``row_tile = 128`` no block is split. A gate/up tile of minibatch m waits for
   ``ready[m]``, a down tile for the gate/up tiles of its row block (split or not). A full tile
   costs ``k_blocks x kblock_us + tile_fixed_us`` (:func:`sim.fused.tiles.kblock_us`: a smooth
   maximum of the worker's own k-loop rate and its share of the chip-wide operand ceiling, so the
   workers slow down before the ceiling binds); a 64-row sub-tile ``k_blocks x half_kblock_us +
   tile_fixed_us x half_fixed_factor``, where its k-block streams the same 48 KiB as a full tile's
   (the whole 128-row A box and the B box) for half the MMA work (:func:`sim.fused.tiles.kblock_us`
   with ``half=True``: the own-rate limit scaled by ``half_kblock_factor``, the operand share
   unchanged). The list schedule of :func:`sim.fused.tiles.run_tiles` gives each worker's end;
4. ``signal_us``: every block raises the peers' slots-filled flag and waits for all of them
   (the slowest rank's last down tile ends the GEMM phase of every rank; at one rank the flags,
   like the staged-x one, are local);
5. ``sum_us``: the fixed-order weighted sum on all SMs, local-HBM bound: read the
   ``num_tokens x num_topk`` slot rows (and the shared expert's row), write the output
   (:func:`sim.core.gemm.reduce_us`).

The device time is 1 + 2 + 3 + 4 + 5; the measured time of back-to-back calls is ``max(device,
host)`` with ``host_us`` the comm-kernel profile's host floors of the two Python calls
(``build_schedule``, ``forward``). The comm blocks copy every row, in both modes, with one
loop (``warp_copy_row``, one row per warp): a local row at ``comm_rate_factor`` of the probe's
per-SM local rate, a remote row at ``remote_rate_factor`` of that again on the probe's pull
curve (:func:`_comm_rates`). Neither depends on the row size: the standalone kernels'
latency-round model would make DeepSeek-V3's 14 KiB rows 0.70x as fast per byte as Qwen3's 4
KiB rows, and the fused rows do not show that. Remote pulls are also capped by the NVLink port
(payload plus request bytes, all ranks pulling at once). Grid-stride loops over the padded
receive rows pay their busiest warp (:func:`sim.comm.rows.busiest_share`).

One GPU: a ``mok.bench layer --emulate-ep N`` row (``num_ranks`` 1, ``num_experts`` the model's
/ N) is predicted as what ran (:func:`fused_row`): one rank, the row's experts all local, the
routing drawn over them (:func:`mok.spec.workload.make_routing` with the row's seed), no remote
row and no remote flag.

Not modelled: the down tiles' push-combine stores over NVLink (they ride in the epilogue, whose
cost is ``tile_fixed_us``), a receive ring smaller than the receive buffer (the benchmark's
``macrobatch_size = 0`` keeps every minibatch; ring reuse would add back-pressure waits), the
producer's prefetch across a dependency wait, and clock or power limits. The sub-tile knobs
(``half_kblock_factor``, ``half_fixed_factor``) are physical estimates, not fitted: the fit
rows were measured with 128-row padding.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import lru_cache

import numpy as np

from mok.spec.limits import FUSED_BLOCK_ROWS, FUSED_DISPATCH_MODES, FUSED_ROW_TILES
from mok.spec.rows import bench_routing_seed, row_routing_seed
from mok.spec.workload import ModelShape, get_shape, make_routing
from sim.comm.model import schedule_device_us
from sim.comm.rows import busiest_share
from sim.config import Workload
from sim.core.gemm import reduce_us
from sim.core.topology import get_topology
from sim.fused.profile import FusedProfile, load_fused_profile
from sim.fused.tiles import TILE_M, TileOrder, run_tiles, tile_order, tile_us
from sim.layer.model import layer_kernel_profile
from sim.layer.plan import RoutingPlan
from sim.measured import row_tile_of

__all__ = ["FusedResult", "fused_layer", "fused_row", "row_num_experts", "COMM_WARPS_PER_SM"]

COMM_WARPS_PER_SM = 12  # kLayerThreads = 384: one row per warp (standalone kernels: 16)
# probe curves of the comm blocks' 16-byte loads and stores (sim.core.hardware: vector engine)
LOCAL_CURVE, REMOTE_CURVE = "local_st", "pull_ld"


# -- the comm blocks ----------------------------------------------------------------------------
def _recv_layout(plan: RoutingPlan, d: int) -> np.ndarray:
    """[padded rows] bool: which receive rows of rank d hold a token row."""
    mask = np.zeros(int(plan.padded_rows[d]), dtype=bool)
    mask[plan.pos[plan.dest == d]] = True
    return mask


@dataclass(frozen=True)
class _Case:
    """Everything of one (workload, mode, SMs, minibatch, row tile) that no fused knob
    changes."""

    wl: Workload
    mode: str
    sms: int
    orders: tuple[TileOrder, ...]  # per rank
    # per rank, the comm blocks' phases in order: (remote bytes, local bytes, busiest-warp share,
    # minibatch it completes or -1, flag latency after it in us)
    comm: tuple[tuple[tuple[float, float, float, int, float], ...], ...]
    sum_us: float
    schedule_us: float
    launch_us: float
    host_us: float


def _peer_flag_us(wl: Workload) -> float:
    """Latency of a flag the kernel raises on every rank (the staged-x and slots-filled
    signals): a remote flag over NVLink (and the switch hop) with peers, a local one at EP1,
    where the symmetric buffers are this GPU's own memory."""
    gpu = wl.topo.gpu
    if wl.ep == 1:
        return gpu.flag_latency_local_us
    return gpu.flag_latency_remote_us + wl.topo.switch_hop_latency_us


def _run_shape(model: str, num_experts: int | None) -> ModelShape:
    """The model's shape with the run's experts (None: the model's)."""
    shape = get_shape(model)
    if num_experts is None or num_experts == shape.num_experts:
        return shape
    return replace(shape, num_experts=int(num_experts))


@lru_cache(maxsize=32)
def _plan(
    model: str,
    tokens: int,
    num_ranks: int,
    topology: str,
    skew: str,
    row_tile: int,
    seed: int,
    num_experts: int | None = None,
) -> tuple[Workload, RoutingPlan]:
    wl = Workload(model, tokens, num_ranks, topology, skew, seed=seed)
    shape = _run_shape(model, num_experts)
    if shape.num_experts == wl.model_shape.num_experts:
        return wl, RoutingPlan(wl.make_trace(), row_tile)
    # as mok.bench layer draws it: make_routing over the experts that ran
    trace = make_routing(tokens, shape.num_experts, shape.num_topk, num_ranks, skew, seed)
    return wl, RoutingPlan(trace, row_tile)


@lru_cache(maxsize=128)
def _case(
    model: str,
    tokens: int,
    num_ranks: int,
    skew: str,
    mode: str,
    sms: int,
    minibatch: int,
    comm_profile: str,
    topology: str,
    row_tile: int,
    seed: int,
    num_experts: int | None = None,
) -> _Case:
    wl, plan = _plan(model, tokens, num_ranks, topology, skew, row_tile, seed, num_experts)
    shape = _run_shape(model, num_experts)
    gpu = wl.topo.gpu
    kprof = layer_kernel_profile(comm_profile)
    rc = plan.rounds(minibatch)
    row_bytes = float(shape.hidden * 2)
    nw = sms * COMM_WARPS_PER_SM
    f_local, f_peer = gpu.flag_latency_local_us, _peer_flag_us(wl)
    # ring: the whole receive buffer (macrobatch_size = 0; MoKConfig.capacity_rows at the
    # default capacity_factor 2, capped at the number of ranks), so no reuse
    factor = min(2, plan.num_ranks)
    capacity = (
        -(-(factor * tokens * shape.num_topk + plan.num_local_experts * (row_tile - 1)) // row_tile)
        * row_tile
    )
    interleave = -(-capacity // minibatch) >= 2
    orders, comm = [], []
    for d in range(wl.ep):
        n_rows = int(plan.padded_rows[d])
        orders.append(
            tile_order(
                n_rows,
                minibatch,
                tokens,
                shape.hidden,
                shape.intermediate,
                shape.shared_intermediate,
                interleave,
                plan.region_starts[d],
            )
        )
        layout = _recv_layout(plan, d)
        ph = [(0.0, tokens * row_bytes, busiest_share(tokens, nw), -1, f_local + f_peer)]
        if mode == "dedup_pull":
            uniq = rc.uniq_first[d].sum(axis=0)
            remote = int(uniq.sum() - uniq[d])
            ph.append((remote * row_bytes, 0.0, busiest_share(remote, nw), -1, f_local))
        for m in range(-(-n_rows // minibatch)):
            rows = rc.rows[d, m]
            seg = layout[m * minibatch : (m + 1) * minibatch]
            share = busiest_share(seg, nw)
            if mode == "dedup_pull":
                ph.append((0.0, float(rows.sum()) * row_bytes, share, m, f_local))
            else:
                remote = float(rows.sum() - rows[d])
                ph.append((remote * row_bytes, float(rows[d]) * row_bytes, share, m, f_local))
        comm.append(tuple(ph))
    rows_in = tokens * shape.num_topk + (tokens if shape.shared_intermediate else 0)
    return _Case(
        wl,
        mode,
        sms,
        tuple(orders),
        tuple(comm),
        sum_us=reduce_us(gpu, rows_in, tokens, shape.hidden),
        schedule_us=schedule_device_us(tokens, kprof),
        launch_us=kprof.call_fixed_us,
        host_us=kprof.host_us("schedule") + kprof.host_us("default"),
    )


@dataclass(frozen=True)
class FusedResult:
    """Predicted time of one fused layer call and its terms (us; the busiest rank's)."""

    layer_us: float  # what back-to-back calls measure: max(device_us, host_us)
    device_us: float  # schedule + launch + kernel
    host_us: float  # host floors of build_schedule + forward
    # schedule_us, launch_us, first_ready_us (minibatch 0 dispatched), gemm_busy_us (the last
    # worker's tiles), gemm_stall_us (its waits for dispatch / gate-up tiles), signal_us, sum_us
    terms: dict[str, float]


def _comm_rates(case: _Case, prof: FusedProfile) -> tuple[float, float]:
    """(remote, local) copy rates of the comm blocks, bytes per us: the probe curves at
    ``case.sms`` SMs with the per-SM rate scaled by the fitted factors (the curves' ceilings
    stay). One loop copies every row in both modes (``warp_copy_row``), so the mode does not
    enter. A switch hop scales the remote rate as in the comm model (bytes in flight / latency)."""
    gpu, topo = case.wl.topo.gpu, case.wl.topo
    local = prof.comm_rate_factor
    remote = local * prof.remote_rate_factor * topo.per_sm_latency_factor(gpu)
    return (
        gpu.curve(REMOTE_CURVE).scaled(per_sm=remote).gbps(case.sms) * 1e3,
        gpu.curve(LOCAL_CURVE).scaled(per_sm=local).gbps(case.sms) * 1e3,
    )


def _comm_ready(case: _Case, prof: FusedProfile, d: int) -> tuple[np.ndarray, float]:
    """(ready time of each minibatch, end of the comm blocks) on rank d, us from kernel start."""
    gpu = case.wl.topo.gpu
    r_remote, r_local = _comm_rates(case, prof)
    a = gpu.protocol["pull"].data_bytes_per_byte + gpu.protocol["pull"].reverse_bytes_per_byte
    wire = gpu.nvlink_gbps_per_direction * gpu.nvlink_wire_efficiency * 1e3  # bytes per us
    t = 0.0
    ready = np.zeros(case.orders[d].num_minibatches)
    for remote, local, share, m, flag in case.comm[d]:
        engine = remote / r_remote + local / r_local
        t += max(engine * share, remote * a / wire) + flag
        if m >= 0:
            ready[m] = t
    return ready, t


def _run(case: _Case, prof: FusedProfile) -> FusedResult:
    gpu = case.wl.topo.gpu
    workers = gpu.num_sms - case.sms
    ends, exposed, busy = [], [], []
    for d, o in enumerate(case.orders):
        ready, comm_end = _comm_ready(case, prof, d)
        end, b = run_tiles(
            tile_us(o, prof, gpu.tflops("bf16"), gpu.num_sms, workers),
            o.wait_mb,
            o.wait_group,
            o.group,
            max(o.num_groups, 1),
            workers,
            ready,
            gpu.flag_latency_local_us,
        )
        ends.append(max(end, comm_end))
        busy.append(b)
        exposed.append(float(ready[0]) if o.num_minibatches else 0.0)
    d = int(np.argmax(ends))
    f_peer = _peer_flag_us(case.wl)
    terms = {
        "schedule_us": case.schedule_us,
        "launch_us": case.launch_us,
        "first_ready_us": exposed[d],
        "gemm_busy_us": busy[d],
        "gemm_stall_us": ends[d] - busy[d],
        "signal_us": f_peer,
        "sum_us": case.sum_us,
    }
    device = case.schedule_us + case.launch_us + ends[d] + f_peer + case.sum_us
    return FusedResult(max(device, case.host_us), device, case.host_us, terms)


def _gpu_sms(prof: FusedProfile) -> int:
    """SMs of the GPU of the profile's topology."""
    return get_topology(prof.topology).gpu.num_sms


def fused_layer(
    model: str,
    tokens_per_rank: int,
    num_ranks: int,
    skew: str,
    mode: str,
    num_comm_sms: int,
    minibatch: int,
    prof: FusedProfile | None = None,
    row_tile: int = TILE_M,
    seed: int | None = None,
    num_experts: int | None = None,
) -> FusedResult:
    """Predicted time of one fused layer forward (``mok.bench layer`` / ``sweep`` row) with the
    expert regions padded to ``row_tile`` rows (64 or 128), on the routing trace of ``seed``
    (None: the one the benchmarks draw for this batch size,
    :func:`mok.spec.rows.bench_routing_seed`). ``num_experts``: the experts of the run over
    all ``num_ranks`` ranks (None: the model's); a one-GPU emulation of EP N
    (``mok.bench layer --emulate-ep N``) ran ``num_ranks = 1`` with the model's experts / N, and
    is predicted as that: one rank, every expert local, no NVLink."""
    prof = prof or load_fused_profile()
    if seed is None:
        seed = bench_routing_seed(tokens_per_rank)
    if mode not in FUSED_DISPATCH_MODES:
        raise ValueError(
            f"the fused layer pulls its dispatch: mode must be pull or dedup_pull (found {mode!r})"
        )
    if int(row_tile) not in FUSED_ROW_TILES:
        raise ValueError(f"the fused layer needs row_tile in {FUSED_ROW_TILES} (found {row_tile})")
    if int(minibatch) <= 0 or int(minibatch) % FUSED_BLOCK_ROWS:
        raise ValueError(
            f"the fused layer needs minibatch % {FUSED_BLOCK_ROWS} == 0 (its GEMM row blocks "
            f"must not straddle minibatches; found {minibatch})"
        )
    num_sms = _gpu_sms(prof)
    if not 1 <= int(num_comm_sms) < num_sms:
        raise ValueError(
            f"num_comm_sms={num_comm_sms} must leave GEMM workers: 1 <= num_comm_sms < {num_sms}"
        )
    shape = get_shape(model)
    experts = shape.num_experts if num_experts is None else int(num_experts)
    if experts < shape.num_topk or experts % max(int(num_ranks), 1):
        raise ValueError(
            f"{model}: num_experts={experts} must be >= its top-{shape.num_topk} and a multiple "
            f"of num_ranks={num_ranks}"
        )
    case = _case(
        model,
        int(tokens_per_rank),
        int(num_ranks),
        skew,
        mode,
        int(num_comm_sms),
        int(minibatch),
        prof.comm_profile,
        prof.topology,
        int(row_tile),
        int(seed),
        None if experts == shape.num_experts else experts,
    )
    return _run(case, prof)


def row_num_experts(row: dict) -> int | None:
    """The experts a ``mok.bench layer`` / ``sweep`` row ran with, over all its ranks: its
    ``num_experts`` column (the model's experts, or the model's / N for a one-GPU emulation of
    EP N, ``emulated_ep``), None where the CSV has no such column. ValueError if the row's
    ``hidden``, ``intermediate`` or ``num_topk`` columns are not the model preset's (a layer the
    simulator does not know)."""
    shape = get_shape(row["model"])
    for col in ("hidden", "intermediate", "num_topk"):
        v = row.get(col)
        if v not in (None, "") and int(v) != getattr(shape, col):
            raise ValueError(
                f"{row['model']}: the row's {col} is {v}, the preset's {getattr(shape, col)}"
            )
    v = row.get("num_experts")
    return None if v in (None, "") else int(v)


def fused_row(row: dict, prof: FusedProfile | None = None) -> FusedResult:
    """:func:`fused_layer` for one row of a ``mok.bench layer`` / ``sweep`` CSV: its ranks
    (``num_ranks``; 2 where the CSV has no such column), the experts that ran
    (:func:`row_num_experts`), its row tile (:func:`sim.measured.row_tile_of`) and routing seed
    (:func:`mok.spec.rows.row_routing_seed`). A row with ``emulated_ep`` N ran one rank of
    ``num_experts`` local experts and is predicted as that; ``emulated_ep`` itself is not read."""
    return fused_layer(
        row["model"],
        int(row["tokens_per_rank"]),
        int(row.get("num_ranks") or 2),
        row["skew"],
        row["mode"],
        int(row["sms"]),
        int(row["minibatch"]),
        prof,
        row_tile_of(row),
        row_routing_seed(row),
        row_num_experts(row),
    )
