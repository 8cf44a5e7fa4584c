"""The fused MoE layer forward (``csrc/layer.cuh``, one persistent kernel) as a timing model.

What one call of :func:`mok.functional.moe_forward` with ``fused=True`` costs on the device:

1. ``schedule_us``: the schedule kernel (routing all-gather + table), the comm-kernel profile's
   :func:`sim.phases.schedule_device_us`;
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
   :func:`tile_order`). Every expert region of the receive buffer is padded to ``row_tile``
   rows (``MoKConfig.row_tile``: 64 or 128) and the padding rows are multiplied too. The routed
   tiles are enumerated per 128-row block of each minibatch's padded rows (``ceil(rows / 128)``
   blocks) whatever the row tile; with ``row_tile = 64`` a block that holds an expert boundary
   at its row 64, or whose upper half lies at or past the padded rows, is split
   (:func:`routed_halves`): it runs as 64-row sub-tiles, one per half that holds rows, each
   against its own expert's weights, one after the other on the worker that claimed the block.
   With ``row_tile = 128`` no block is split. A gate/up tile of minibatch m waits for
   ``ready[m]``, a down tile for the gate/up tiles of its row block (split or not). A full tile
   costs ``k_blocks x kblock_us + tile_fixed_us`` (:func:`kblock_us`: a smooth maximum of the
   worker's own k-loop rate and its share of the chip-wide operand ceiling, so the workers slow
   down before the ceiling binds); a 64-row sub-tile ``k_blocks x half_kblock_us +
   tile_fixed_us x half_fixed_factor``, where its k-block streams the same 48 KiB as a full
   tile's (the whole 128-row A box and the B box) for half the MMA work (:func:`kblock_us` with
   ``half=True``: the own-rate limit scaled by ``half_kblock_factor``, the operand share
   unchanged). The list schedule of :func:`_run_tiles` gives each worker's end;
4. ``signal_us``: every block raises the peers' slots-filled flag and waits for all of them
   (the slowest rank's last down tile ends the GEMM phase of every rank);
5. ``sum_us``: the fixed-order weighted sum on all SMs, local-HBM bound: read the
   ``num_tokens x num_topk`` slot rows (and the shared expert's row), write the output
   (:func:`sim.gemm.reduce_us`).

The device time is 1 + 2 + 3 + 4 + 5; the measured time of back-to-back calls is ``max(device,
host)`` with ``host_us`` the comm-kernel profile's host floors of the two Python calls
(``build_schedule``, ``forward``). The comm blocks copy every row, in both modes, with one
loop (``warp_copy_row``, one row per warp): a local row at ``comm_rate_factor`` of the probe's
per-SM local rate, a remote row at ``remote_rate_factor`` of that again on the probe's pull
curve (:func:`_comm_rates`). Neither depends on the row size: the standalone kernels'
latency-round model would make DeepSeek-V3's 14 KiB rows 0.70x as fast per byte as Qwen3's 4
KiB rows, and the fused rows do not show that. Remote pulls are also capped by the NVLink port
(payload plus request bytes, all ranks pulling at once). Grid-stride loops over the padded
receive rows pay their busiest warp (:func:`sim.kernel_rows.busiest_share`).

Not modelled: the down tiles' push-combine stores over NVLink (they ride in the epilogue, whose
cost is ``tile_fixed_us``), a receive ring smaller than the receive buffer (the benchmark's
``macrobatch_size = 0`` keeps every minibatch; ring reuse would add back-pressure waits), the
producer's prefetch across a dependency wait, and clock or power limits. The sub-tile knobs
(``half_kblock_factor``, ``half_fixed_factor``) are physical estimates, not fitted: the fit
rows were measured with 128-row padding.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import asdict, dataclass, field
from functools import lru_cache
from importlib import resources
from pathlib import Path

import numpy as np
from numba import njit

from mok.spec.limits import FUSED_BLOCK_ROWS, FUSED_DISPATCH_MODES, FUSED_ROW_TILES
from mok.spec.rows import bench_routing_seed, row_routing_seed
from sim.config import Workload
from sim.gemm import reduce_us
from sim.kernel_rows import busiest_share
from sim.measured import row_tile_of
from sim.model import layer_kernel_profile
from sim.phases import schedule_device_us
from sim.schedule import RoutingPlan

__all__ = [
    "FusedProfile",
    "FusedResult",
    "FUSED_PROFILE_FORMAT",
    "DEFAULT_FUSED_PROFILE",
    "load_fused_profile",
    "fused_layer",
    "fused_row",
    "tile_order",
    "routed_halves",
    "kblock_us",
    "COMM_WARPS_PER_SM",
    "TILE_M",
    "HALF_M",
    "TILE_N",
    "TILE_K",
    "STAGE_BYTES",
]

FUSED_PROFILE_FORMAT = "mok-fused-profile/1"
DEFAULT_FUSED_PROFILE = "mok-fused-h200x2"
# csrc/layer.cuh: 128 x 256 tiles, K = 64 per pipeline stage, 384 threads per block
TILE_M, TILE_N, TILE_K = 128, 256, 64
HALF_M = TILE_M // 2  # rows of a sub-tile of a split routed block (row_tile 64)
STAGE_BYTES = (TILE_M + TILE_N) * TILE_K * 2  # A and B boxes of one k-block (kStageBytes)
COMM_WARPS_PER_SM = 12  # kLayerThreads = 384: one row per warp (standalone kernels: 16)
# probe curves of the comm blocks' 16-byte loads and stores (sim.hardware: vector engine)
LOCAL_CURVE, REMOTE_CURVE = "local_st", "pull_ld"
_KIND_SHARED_GU, _KIND_SHARED_DN, _KIND_GU, _KIND_DN = range(4)


@dataclass(frozen=True)
class FusedProfile:
    """Fused-kernel knobs (units in the names); the comm side and the fixed per-call costs come
    from the comm-kernel profile ``comm_profile`` (:mod:`sim.kernel_profile`)."""

    topology: str = "h200x2"
    # comm-kernel profile (name under sim/profiles or a path): copy-loop rates, schedule kernel,
    # launch (call_fixed_us) and host floors
    comm_profile: str = "mok-comm-h200x2"
    # one worker's k-loop rate (128 x 256 x 64 wgmma per k-block, wait_group 0 between
    # k-blocks) / its share of the measured dense bf16 rate (tensor_tflops / num_sms); fitted
    gemm_efficiency: float = 0.75
    # us per tile outside the k-loop: SwiGLU / staging epilogue and row stores (the down tiles'
    # pushes to the home rank), pipeline restart, counter release; fitted
    tile_fixed_us: float = 0.0
    # chip-wide ceiling (TB/s) on the workers' operand loads (TMA A + B boxes, 48 KiB per
    # k-block, through L2), approached smoothly (kblock_us); fitted (inf: none)
    operand_tbps: float = math.inf
    # fused comm blocks' per-SM rate on local rows / the probe's (local_st): the GEMMs load
    # the memory system the copies go through; fitted
    comm_rate_factor: float = 1.0
    # their rate on remote rows (probe: pull_ld) relative to local rows: a remote load also
    # waits on the peer's memory, which the peer's GEMMs load too; fitted
    remote_rate_factor: float = 1.0
    # a 64-row sub-tile (row_tile 64: a block split at an expert boundary, or its lower half
    # alone at the end) streams the same 48 KiB per k-block as a full tile for half its MMA work
    # (64 x 256 outputs): its k-block is the 2-norm of the worker's own k-block time x this
    # factor and the unchanged operand share (kblock_us), i.e. 0.5x (own rate binds) to 1x
    # (operand ceiling binds) a full tile's. 1.0, measured, not fitted: per-tile traces on 2x
    # H200 (docs/perf-notes.md, 64-row sub-tiles) show a sub-tile's k-loop as long as a full
    # tile's, so the k-loop is bound by the delivery of its operand stages, not by the MMAs
    half_kblock_factor: float = 1.0
    # its part outside the k-loop / tile_fixed_us. The epilogue's SwiGLU staging and row stores
    # scale with its 64 rows (0.5x); its barriers, destination loads, fence and the pipeline
    # hand-over do not, and the block's counter release follows its last sub-tile only. The
    # per-tile trace of DeepSeek-V3 (docs/perf-notes.md, v2: 7.7 us of epilogue per tile, the
    # fitted tile_fixed_us is 7.95) has stores and staging at 100 of its 120 worker-ms (84 %):
    # 0.5 x 0.84 + 0.16 = 0.58, rounded up to 0.6; not fitted
    half_fixed_factor: float = 0.6
    fit_subset: str = ""  # which rows the fitted values came from
    source: str = ""
    assumptions: tuple[str, ...] = ()
    fit: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        for k in ("gemm_efficiency", "operand_tbps", "comm_rate_factor", "remote_rate_factor"):
            if not getattr(self, k) > 0:
                raise ValueError(f"{k} must be > 0 (found {getattr(self, k)})")
        if not self.tile_fixed_us >= 0:
            raise ValueError(f"tile_fixed_us must be >= 0 (found {self.tile_fixed_us})")
        if not 0 < self.half_kblock_factor <= 1:
            raise ValueError(
                f"half_kblock_factor must be in (0, 1]: a 64-row sub-tile's share of a full "
                f"tile's MMA work per k-block (found {self.half_kblock_factor})"
            )
        if not 0 <= self.half_fixed_factor <= 1:
            raise ValueError(
                f"half_fixed_factor must be in [0, 1]: a 64-row sub-tile's share of "
                f"tile_fixed_us (found {self.half_fixed_factor})"
            )

    def replace(self, **kw) -> FusedProfile:
        # NOTE: fields are shared with self, not copied: profiles are never changed in place.
        return dataclasses.replace(self, **kw)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["assumptions"] = list(self.assumptions)
        d["operand_tbps"] = None if math.isinf(self.operand_tbps) else self.operand_tbps
        return {"format": FUSED_PROFILE_FORMAT, **d}

    @classmethod
    def from_dict(cls, d: dict) -> FusedProfile:
        d = dict(d)
        fmt = d.pop("format", FUSED_PROFILE_FORMAT)
        if fmt != FUSED_PROFILE_FORMAT:
            raise ValueError(
                f"unsupported fused profile format {fmt!r} (want {FUSED_PROFILE_FORMAT})"
            )
        if d.get("operand_tbps") is None:
            d["operand_tbps"] = math.inf
        d["assumptions"] = tuple(d.get("assumptions", ()))
        return cls(**d)

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=1) + "\n")


def load_fused_profile(name_or_path: str | Path = DEFAULT_FUSED_PROFILE) -> FusedProfile:
    """A fused profile by name (``sim/profiles/<name>.json``) or path."""
    p = Path(str(name_or_path))
    if not p.suffix:
        p = Path(str(resources.files("sim") / "profiles")) / f"{name_or_path}.json"
    try:
        return FusedProfile.from_dict(json.loads(p.read_text()))
    except OSError as e:
        raise ValueError(
            f"fused profile {str(name_or_path)!r} not found ({e.strerror}); give a name under "
            f"sim/profiles (e.g. {DEFAULT_FUSED_PROFILE}) or a path to a "
            f"{FUSED_PROFILE_FORMAT} JSON"
        ) from None


# -- the GEMM tiles -----------------------------------------------------------------------------
@dataclass(frozen=True)
class TileOrder:
    """One rank's tiles in the kernel's order (csrc/layer.cuh TileOrder), as flat arrays."""

    kind: np.ndarray  # [tiles] int64: 0 shared GU, 1 shared DN, 2 GU, 3 DN
    k_blocks: np.ndarray  # [tiles] int64: K / 64
    wait_mb: np.ndarray  # [tiles] int64: minibatch whose ready flag a GU tile waits on, else -1
    wait_group: np.ndarray  # [tiles] int64: row block whose GU tiles a DN tile waits on, else -1
    group: np.ndarray  # [tiles] int64: row block a GU tile belongs to, else -1
    num_groups: int
    num_minibatches: int
    # [tiles] int64: 0 one 128-row tile; else the 64-row sub-tiles its routed block runs as
    # (1 or 2, :func:`routed_halves`)
    halves: np.ndarray

    def __len__(self) -> int:
        return int(self.kind.size)


def routed_halves(num_rows: int, region_starts: np.ndarray, row0: np.ndarray) -> np.ndarray:
    """[blocks] int64: how the routed 128-row blocks starting at receive rows ``row0`` run
    (csrc/layer.cuh ``routed_halves``): 0 as one 128-row tile; 1 as one 64-row sub-tile of its
    lower half (the upper half at or past the ``num_rows`` padded rows); 2 as two 64-row
    sub-tiles (rows ``row0`` and ``row0 + 64`` belong to different experts). ``region_starts``
    [num_local_experts]: the first padded row of each expert region (non-decreasing; an empty
    region starts where the next one does). Regions padded to 128 rows never split a block."""
    row0 = np.asarray(row0, dtype=np.int64)
    # NOTE: the kernel's expert_of_row: the last expert whose region starts at or before the row
    e0 = np.searchsorted(region_starts, row0, side="right")
    e1 = np.searchsorted(region_starts, row0 + HALF_M, side="right")
    return np.where(row0 + HALF_M >= num_rows, 1, np.where(e0 != e1, 2, 0)).astype(np.int64)


def tile_order(
    num_rows: int,
    minibatch_rows: int,
    num_tokens: int,
    hidden: int,
    intermediate: int,
    shared_intermediate: int,
    interleave: bool = True,
    region_starts: np.ndarray | None = None,
) -> TileOrder:
    """The fixed tile order of one rank: shared gate/up and down over ``ceil(num_tokens / 128)``
    row blocks, then per minibatch of the ``num_rows`` padded receive rows its gate/up tiles
    (``intermediate / 128`` per row block, K = hidden) and down tiles (``hidden / 256``, K =
    intermediate), interleaved ``GU(0), GU(1), DN(0), GU(2), DN(1), ...`` when the ring holds two
    or more minibatches, else ``GU(0), DN(0), GU(1), ...``. Within a segment tile i is row block
    i // columns, column block i % columns. A minibatch has ``ceil(rows / 128)`` row blocks.

    ``region_starts`` [num_local_experts]: the first padded row of each local expert's region;
    with it ``num_rows`` and the starts may be multiples of 64 (``row_tile`` 64) and ``halves``
    marks the split routed blocks (:func:`routed_halves`). None: regions padded to 128 rows (no
    block is split)."""
    pad = TILE_M if region_starts is None else HALF_M
    if num_rows % pad or minibatch_rows <= 0 or minibatch_rows % TILE_M:
        raise ValueError(
            f"num_rows={num_rows} must be a multiple of {pad} (the region padding) and "
            f"minibatch_rows={minibatch_rows} a positive multiple of {TILE_M}"
        )
    if region_starts is None:
        region_starts = np.zeros(1, dtype=np.int64)
    region_starts = np.asarray(region_starts, dtype=np.int64)
    if np.any(region_starts % HALF_M) or np.any(np.diff(region_starts) < 0):
        raise ValueError(
            f"region_starts must be non-decreasing multiples of {HALF_M} (found {region_starts})"
        )
    n_gu, n_dn = intermediate // 128, hidden // TILE_N
    shared_rbs = -(-num_tokens // TILE_M) if shared_intermediate else 0
    n_sgu = shared_intermediate // 128
    num_mbs = -(-num_rows // minibatch_rows)
    mb_rbs = [
        -(-min(minibatch_rows, num_rows - m * minibatch_rows) // TILE_M) for m in range(num_mbs)
    ]
    mb_rb0 = np.concatenate(([0], np.cumsum(mb_rbs))).astype(np.int64)
    # [routed row blocks]: sub-tiles of each block (0: one full tile)
    rb_halves = routed_halves(num_rows, region_starts, np.arange(mb_rb0[-1]) * TILE_M)
    segs = []  # (kind, first group, row blocks, columns, k_blocks, minibatch)
    if shared_rbs:
        segs.append((_KIND_SHARED_GU, 0, shared_rbs, n_sgu, hidden // TILE_K, -1))
        segs.append((_KIND_SHARED_DN, 0, shared_rbs, n_dn, shared_intermediate // TILE_K, -1))

    def gu(m):
        return (_KIND_GU, shared_rbs + mb_rb0[m], mb_rbs[m], n_gu, hidden // TILE_K, m)

    def dn(m):
        return (_KIND_DN, shared_rbs + mb_rb0[m], mb_rbs[m], n_dn, intermediate // TILE_K, m)

    if interleave:
        routed = [gu(0)] + [s for m in range(1, num_mbs) for s in (gu(m), dn(m - 1))]
        routed.append(dn(num_mbs - 1))
    else:
        routed = [s for m in range(num_mbs) for s in (gu(m), dn(m))]
    segs += routed if num_mbs else []
    parts = {k: [] for k in ("kind", "kb", "wait_mb", "wait_group", "group", "halves")}
    for kind, g0, rbs, cols, kb, m in segs:
        n = rbs * cols
        grp = g0 + np.arange(n, dtype=np.int64) // cols
        is_gu = kind in (_KIND_SHARED_GU, _KIND_GU)
        parts["kind"].append(np.full(n, kind, dtype=np.int64))
        parts["kb"].append(np.full(n, kb, dtype=np.int64))
        parts["wait_mb"].append(np.full(n, m if kind == _KIND_GU else -1, dtype=np.int64))
        parts["wait_group"].append(np.full(n, -1, dtype=np.int64) if is_gu else grp)
        parts["group"].append(grp if is_gu else np.full(n, -1, dtype=np.int64))
        routed_tile = kind in (_KIND_GU, _KIND_DN)
        parts["halves"].append(rb_halves[grp - shared_rbs] if routed_tile else np.zeros_like(grp))
    cat = {k: np.concatenate(v) if v else np.zeros(0, np.int64) for k, v in parts.items()}
    return TileOrder(
        cat["kind"],
        cat["kb"],
        cat["wait_mb"],
        cat["wait_group"],
        cat["group"],
        shared_rbs + int(mb_rb0[-1]),
        num_mbs,
        cat["halves"],
    )


def kblock_us(
    prof: FusedProfile,
    tflops: float,
    num_sms: int,
    workers: int,
    mean_k_blocks: float,
    half: bool = False,
) -> float:
    """us per k-block of one worker: the 2-norm of two limits, its own k-loop at
    ``gemm_efficiency`` of its share of the dense rate (``tflops`` over ``num_sms``) and its
    share of the chip-wide operand ceiling. The ceiling is shared by the workers inside a k-loop
    (48 KiB per k-block); the others run a tile's fixed part. With ``mean_k_blocks`` k-blocks per
    fixed part on average (a 64-row sub-tile's fixed part counts ``half_fixed_factor``), a phase
    on the ceiling alone would stream ``workers x 48 KiB`` per ``kblock_us + tile_fixed_us /
    mean_k_blocks``, i.e. its operand bytes / ``operand_tbps`` in all.

    ``half``: a k-block of a 64-row sub-tile: its own limit x ``half_kblock_factor`` (half the
    MMA work), its operand share unchanged (it streams the whole 128-row A box and the B box).

    NOTE: the 2-norm, not the maximum: far from the ceiling it is the larger limit, at the knee
    1.41x either. Measured, 124 workers are faster than 116 (DeepSeek-V3, 8 vs 16 comm SMs) and
    a trace shows the same MMA time per k-block at both: a hard maximum would have them equal."""
    flops = 2.0 * TILE_M * TILE_N * TILE_K
    own = flops / (tflops * 1e6 / num_sms * prof.gemm_efficiency)
    if half:
        own *= prof.half_kblock_factor
    shared = workers * STAGE_BYTES / (prof.operand_tbps * 1e6) - prof.tile_fixed_us / mean_k_blocks
    return math.hypot(own, max(shared, 0.0))


@njit(cache=True)
def _sift_down(heap, free, i):  # pragma: no cover - numba
    """Restore the min-heap of worker ids ordered by (free time, id) below position i."""
    n = heap.size
    while True:
        c = 2 * i + 1
        if c >= n:
            return
        if c + 1 < n:
            a, b = heap[c], heap[c + 1]
            if free[b] < free[a] or (free[b] == free[a] and b < a):
                c += 1
        w, x = heap[i], heap[c]
        if free[w] < free[x] or (free[w] == free[x] and w < x):
            return
        heap[i], heap[c] = x, w
        i = c


@njit(cache=True)
def _run_tiles(
    dur, wait_mb, wait_group, group, num_groups, workers, ready, flag_us
):  # pragma: no cover - numba
    """List schedule of the tile order: each tile in order on the worker that frees first
    (the kernel's in-order claims; ties to the lowest worker id); it starts when that worker
    is free and its dependency is met (``ready[m]`` for a GU tile of minibatch m, the last GU
    tile of its row block + a GPU-scope flag for a DN tile) and takes ``dur[t]`` us (a split
    block: its sub-tiles back to back). Returns (end of the last tile, busy time of the worker
    that ends last)."""
    free = np.zeros(workers)
    busy = np.zeros(workers)
    done = np.zeros(num_groups)
    # NOTE: a heap of worker ids by (free time, id), the order argmin(free) picks in
    heap = np.arange(workers)
    for t in range(dur.size):
        w = heap[0]
        s = free[w]
        if wait_mb[t] >= 0:
            s = max(s, ready[wait_mb[t]])
        elif wait_group[t] >= 0:
            s = max(s, done[wait_group[t]] + flag_us)
        d = dur[t]
        free[w] = s + d
        busy[w] += d
        _sift_down(heap, free, 0)
        g = group[t]
        if g >= 0 and free[w] > done[g]:
            done[g] = free[w]
    last = int(np.argmax(free))
    return free[last], busy[last]


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


@lru_cache(maxsize=32)
def _plan(
    model: str, tokens: int, num_ranks: int, topology: str, skew: str, row_tile: int, seed: int
) -> tuple[Workload, RoutingPlan]:
    wl = Workload(model, tokens, num_ranks, topology, skew, seed=seed)
    return wl, RoutingPlan(wl.make_trace(), row_tile)


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
) -> _Case:
    wl, plan = _plan(model, tokens, num_ranks, topology, skew, row_tile, seed)
    shape, gpu, topo = wl.model_shape, wl.topo.gpu, wl.topo
    kprof = layer_kernel_profile(comm_profile)
    rc = plan.rounds(minibatch)
    row_bytes = float(shape.hidden * 2)
    nw = sms * COMM_WARPS_PER_SM
    f_local, f_remote = (
        gpu.flag_latency_local_us,
        gpu.flag_latency_remote_us + topo.switch_hop_latency_us,
    )
    # ring: the whole receive buffer (macrobatch_size = 0; MoKConfig.capacity_rows at the
    # default capacity_factor 2), so >= 2 slots and no reuse
    capacity = (
        -(-(2 * tokens * shape.num_topk + plan.num_local_experts * (row_tile - 1)) // row_tile)
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
        ph = [(0.0, tokens * row_bytes, busiest_share(tokens, nw), -1, f_local + f_remote)]
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


def _tile_us(
    o: TileOrder, prof: FusedProfile, tflops: float, num_sms: int, workers: int
) -> np.ndarray:
    """[tiles] us of each tile of ``o`` on one worker: ``k_blocks x kblock_us + tile_fixed_us``
    for a full tile, ``halves x (k_blocks x half kblock_us + tile_fixed_us x
    half_fixed_factor)`` for a split block (its sub-tiles one after the other)."""
    if not len(o):
        return np.zeros(0)
    split = o.halves > 0
    if split.any():
        # k-blocks streamed per fixed part (a sub-tile's fixed part counts half_fixed_factor)
        streamed = float((o.k_blocks * np.where(split, o.halves, 1)).sum())
        parts = float((~split).sum()) + prof.half_fixed_factor * float(o.halves[split].sum())
        mean_kb = streamed / parts if parts > 0 else math.inf  # inf: no fixed parts at all
    else:
        mean_kb = float(o.k_blocks.mean())
    kb_us = kblock_us(prof, tflops, num_sms, workers, mean_kb)
    dur = o.k_blocks * kb_us + prof.tile_fixed_us
    if split.any():
        half_us = kblock_us(prof, tflops, num_sms, workers, mean_kb, half=True)
        sub = o.k_blocks * half_us + prof.tile_fixed_us * prof.half_fixed_factor
        dur = np.where(split, o.halves * sub, dur)
    return dur


def _run(case: _Case, prof: FusedProfile) -> FusedResult:
    gpu = case.wl.topo.gpu
    workers = gpu.num_sms - case.sms
    ends, exposed, busy = [], [], []
    for d, o in enumerate(case.orders):
        ready, comm_end = _comm_ready(case, prof, d)
        end, b = _run_tiles(
            _tile_us(o, prof, gpu.tflops("bf16"), gpu.num_sms, workers),
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
    f_remote = gpu.flag_latency_remote_us + case.wl.topo.switch_hop_latency_us
    terms = {
        "schedule_us": case.schedule_us,
        "launch_us": case.launch_us,
        "first_ready_us": exposed[d],
        "gemm_busy_us": busy[d],
        "gemm_stall_us": ends[d] - busy[d],
        "signal_us": f_remote,
        "sum_us": case.sum_us,
    }
    device = case.schedule_us + case.launch_us + ends[d] + f_remote + case.sum_us
    return FusedResult(max(device, case.host_us), device, case.host_us, terms)


def _gpu_sms(prof: FusedProfile) -> int:
    """SMs of the GPU of the profile's topology."""
    from sim.topology import get_topology

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
) -> FusedResult:
    """Predicted time of one fused layer forward (``mok.bench layer`` / ``sweep`` row) with the
    expert regions padded to ``row_tile`` rows (64 or 128), on the routing trace of ``seed``
    (None: the one the benchmarks draw for this batch size,
    :func:`mok.spec.rows.bench_routing_seed`)."""
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
    )
    return _run(case, prof)


def fused_row(row: dict, prof: FusedProfile | None = None) -> FusedResult:
    """:func:`fused_layer` for one row of a ``mok.bench layer`` / ``sweep`` CSV (its row tile:
    :func:`sim.measured.row_tile_of`)."""
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
    )
