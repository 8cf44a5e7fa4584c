"""The fused layer's GEMM side: the kernel's fixed tile order (csrc/layer.cuh ``TileOrder``), the
64-row sub-tiles of split routed blocks, the time of a k-block and of a tile, and the list
schedule of the tiles over the GEMM workers (the overview is in :mod:`sim.fused.model`)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from numba import njit

from sim.fused.profile import FusedProfile

__all__ = [
    "TileOrder",
    "tile_order",
    "routed_halves",
    "kblock_us",
    "tile_us",
    "run_tiles",
    "TILE_M",
    "HALF_M",
    "TILE_N",
    "TILE_K",
    "STAGE_BYTES",
]

# csrc/layer.cuh: 128 x 256 tiles, K = 64 per pipeline stage
TILE_M, TILE_N, TILE_K = 128, 256, 64
HALF_M = TILE_M // 2  # rows of a sub-tile of a split routed block (row_tile 64)
STAGE_BYTES = (TILE_M + TILE_N) * TILE_K * 2  # A and B boxes of one k-block (kStageBytes)
_KIND_SHARED_GU, _KIND_SHARED_DN, _KIND_GU, _KIND_DN = range(4)


# -- the tile order -----------------------------------------------------------------------------
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
def run_tiles(
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


def tile_us(
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
