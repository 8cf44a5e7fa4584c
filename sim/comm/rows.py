"""How mok's comm kernels walk their rows: per-rank row counts of a routing, the padded receive
layout, which warp / block gets which row, and the row-size terms of the two copy engines.

Used by :mod:`sim.comm.model` (standalone kernel graphs) and, through
:func:`sim.comm.rates.layer_row_scale`, by the layer model's opt-in kernel profile.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from mok.spec.workload import get_shape, make_routing

__all__ = [
    "Counts",
    "counts_for",
    "ROW_TILE",
    "WARPS_PER_SM",
    "STAGE_BUDGET_BYTES",
    "MIN_STAGES",
    "loop_rows",
    "busiest_share",
    "ring_items",
    "ring_split",
    "ring_stores",
    "sum_ring_stages",
    "sum_ring_turns",
    "warp_row_scale",
]


@dataclass(frozen=True)
class Counts:
    """Row counts of one workload (see the table of :mod:`sim.comm.model`)."""

    tokens: int
    topk: int
    recv: np.ndarray  # [R_dst, R_src] (token, k) rows
    dedup: np.ndarray  # [R_dst, R_src] distinct (token, dst) pairs
    expert_rows: np.ndarray  # [R_dst, num_local_experts] (token, k) rows of each local expert

    @property
    def num_ranks(self) -> int:
        return self.recv.shape[0]

    def recv_layout(self, r: int) -> np.ndarray:
        """[num_rows] bool: which rows of rank ``r``'s receive buffer hold a token row; every
        local expert's region is padded to :data:`ROW_TILE` rows (the schedule's num_rows)."""
        n = self.expert_rows[r]
        padded = -(-n // ROW_TILE) * ROW_TILE
        start = np.concatenate(([0], np.cumsum(padded)[:-1]))
        pos = np.arange(int(padded.sum())) - np.repeat(start, padded)
        return pos < np.repeat(n, padded)


# MoKConfig.row_tile (= the default of mok.bench comm): every expert region of the receive
# buffer is padded to a multiple of it, and the pull dispatch / push combine walk the padding.
ROW_TILE = 128


@lru_cache(maxsize=64)
def counts_for(model: str, tokens: int, num_ranks: int, skew: str, seed: int = 0) -> Counts:
    """Counts of a generated routing (``mok.spec.workload.make_routing``). The benchmark's routing
    is not stored, but ``mok.bench comm`` draws it with ``make_routing`` and the seed
    :func:`mok.spec.rows.bench_routing_seed` (recorded in each row), so the prediction of a
    measured row passes the row's seed (:func:`mok.spec.rows.row_routing_seed`): the same
    routing."""
    shape = get_shape(model)
    tr = make_routing(tokens, shape.num_experts, shape.num_topk, num_ranks, skew, seed)
    experts = tr.per_rank()  # [R_src, T, K]
    num_local = shape.num_experts // num_ranks
    dest = experts // num_local
    recv = np.zeros((num_ranks, num_ranks), dtype=np.int64)
    dedup = np.zeros_like(recv)
    for s in range(num_ranks):
        for d in range(num_ranks):
            hit = dest[s] == d
            recv[d, s] = int(hit.sum())
            dedup[d, s] = int(hit.any(axis=1).sum())
    per_expert = np.bincount(experts.ravel(), minlength=shape.num_experts)
    return Counts(tokens, shape.num_topk, recv, dedup, per_expert.reshape(num_ranks, num_local))


WARPS_PER_SM = 16  # kCommThreads = 512: the 16-byte path moves one row per warp
# csrc/tma.cuh: dynamic shared memory of a ring's stages, and the fewest stages a ring runs with
STAGE_BUDGET_BYTES = 200 * 1024
MIN_STAGES = 3
_PROBE_ROW_BYTES = 16384  # row size at which the probe's per-SM curves are taken


def loop_rows(c: Counts, r: int, loop: str) -> np.ndarray | int:
    """The rows rank ``r``'s grid walks in a phase with ``loop``
    (:class:`sim.comm.catalog.PhaseSpec`): the receive layout (bool mask, padding rows False) or a
    count."""
    if loop == "recv":
        return c.recv_layout(r)
    if loop == "dedup":
        return int(c.dedup[r].sum())
    if loop == "dedup_remote":
        return int(c.dedup[r].sum() - c.dedup[r, r])
    if loop == "tokens":
        return c.tokens
    raise ValueError(f"unknown loop {loop!r} (recv, dedup, dedup_remote, tokens)")


def busiest_share(rows: np.ndarray | int, workers: int) -> float:
    """(rows of the busiest worker) / (mean rows per worker), >= 1, when row i goes to worker
    i mod ``workers`` (grid-stride loops). On the padded receive layout the workers whose
    offset in the 128-row tiles is small get a real row from every tile while the others skip
    padding (nwarps is a multiple of 128 at 8/16/24 SMs): 4x at 512 tokens for DeepSeek-V3."""
    if isinstance(rows, np.ndarray):
        n = int(rows.sum())
        per = np.bincount(np.arange(rows.size) % workers, weights=rows, minlength=workers)
        busiest = float(per.max())
    else:
        n, busiest = int(rows), float(-(-int(rows) // workers))
    return busiest * workers / n if n else 1.0


def ring_items(rows: np.ndarray | int, blocks: int) -> int:
    """Items of the busiest block of a copy ring: item i goes to block i mod ``blocks``, and a
    padding row of the receive layout is an item too."""
    size = rows.size if isinstance(rows, np.ndarray) else int(rows)
    return -(-size // blocks)


def ring_split(rows: np.ndarray | int, blocks: int) -> tuple[int, int]:
    """(row items, padding items) of the busiest block of a copy ring (:func:`ring_items`).
    Padding items (a receive-layout row with no token: no load, no store) come in runs, the
    tail of every 128-row expert region, which all blocks reach together, so the ring moves no
    bytes while it walks them (see ``tma_pad_us``)."""
    items = ring_items(rows, blocks)
    if not isinstance(rows, np.ndarray):
        return items, 0
    block = np.arange(rows.size) % blocks
    real = np.bincount(block, weights=rows, minlength=blocks)
    busiest = np.flatnonzero(np.bincount(block, minlength=blocks) == items)
    b = int(busiest[np.argmax(real[busiest])])
    return int(real[b]), items - int(real[b])


def sum_ring_stages(row_bytes: float, num_ranks: int) -> int:
    """Stages of dedup_sum's row ring (csrc/combine.cuh ``sum_stages``): a stage holds one whole
    row per peer term (128-byte aligned), and each stage has its own consumer warp (at most
    ``WARPS_PER_SM - 1``). Below :data:`MIN_STAGES` the kernel runs the chunked reduce pipeline
    instead (many ranks, long rows). 14 for DeepSeek-V3 on 2 ranks, 15 for Qwen3."""
    stage = -(-int(row_bytes) // 128) * 128 * max(num_ranks - 1, 1)
    return min(WARPS_PER_SM - 1, STAGE_BUDGET_BYTES // stage)


def sum_ring_turns(tokens: int, blocks: int, stages: int) -> float:
    """Stage turnovers of the busiest block of dedup_sum's row ring: its items (output rows;
    token t goes to block t mod ``blocks``) over the ``stages`` it keeps in flight, at least
    one turnover when it has any item (the ring is not full)."""
    items = -(-int(tokens) // blocks)
    return max(items / stages, 1.0) if items else 0.0


def _data_rounds(routine: str, n16: int) -> int:
    """Memory-latency rounds of one warp per row of ``n16`` 16-byte vectors (csrc/rows.cuh:
    kUnroll = 8 vectors per lane, 256 per warp, in flight per round)."""
    if routine == "copy":  # whole unrolled batches, then a tail loop of one vector per lane
        return n16 // 256 + -(-(n16 % 256) // 32)
    if routine == "fan":  # guarded batches, no tail loop
        return -(-n16 // 256)
    if routine == "sum":  # one vector per lane and term group per round
        return -(-n16 // 32)
    if routine == "seg":  # segments of 4 vectors per lane (kSegVecs), 4 terms in flight
        return -(-n16 // 128)
    raise ValueError(f"unknown warp routine {routine!r} (copy, fan, sum, seg)")


def warp_row_scale(routine: str, row_bytes: float, lookup_rounds: float = 0.0) -> float:
    """Per-SM rate of the 16-byte warp ``routine`` on rows of ``row_bytes`` / on the probe's
    16 KiB rows: a warp spends ``lookup_rounds`` (the profile's ``warp_lookup_rounds``) + data
    rounds per row, each a loaded memory latency, so bytes per round set the rate.
    DeepSeek-V3's 14 KiB rows take 3 unrolled rounds + 4 tail rounds in warp_copy_row, Qwen3's
    4 KiB rows one round."""
    lam = lookup_rounds
    ref = _PROBE_ROW_BYTES / (_data_rounds(routine, _PROBE_ROW_BYTES // 16) + lam)
    return row_bytes / (_data_rounds(routine, int(row_bytes) // 16) + lam) / ref


def ring_stores(c: Counts, r: int, routine: str) -> float:
    """Bulk stores per copy-ring item: 1, or the mean fan-out (receive rows per dedup row)."""
    if routine != "fan":
        return 1.0
    d = c.dedup[r].sum()
    return float(c.recv[r].sum() / d) if d else 1.0
