"""Receive layout of every rank, following MoK's schedule table, and rows per round.

On destination rank d, local expert l owns a region starting at the prefix sum of the earlier
regions, each padded to ``row_tile`` rows. Inside a region the o-th token from source rank r goes
to position ``sum_r' min(M[l, r'], o) + #{r' < r : M[l, r'] > o}``: sources interleave round-robin,
one row each per level o. Minibatch (round) m of rank d is positions
``[m * minibatch_size, (m + 1) * minibatch_size)`` of the padded layout, so each round's GEMM
tiles never straddle two experts when ``minibatch_size`` is a multiple of ``row_tile``.

Everything the event model needs is reduced to counts:

* ``rows[d, m, s]``: (token, k) rows of source s landing in round m on d (non-dedup transfers);
* ``uniq_first[d, m, s]``: distinct (token, d) pairs of source s whose *first* row on d is in
  round m (dedup-pull moves these over NVLink, the other rows are local fan-out copies);
* ``uniq_last[d, m, s]``: distinct (token, d) pairs whose *last* row on d is in round m (dedup
  combine sends the rank-local partial sum once that row's expert output exists);
* ``row_tiles[d, m]``: GEMM row tiles of round m (padding rows count: partial tiles are full).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from numba import njit

from mok.spec.limits import expert_split_problem
from mok.spec.workload import RoutingTrace

__all__ = ["RoutingPlan", "RoundCounts"]


def _assign_positions(order, counts, region_start, pos_out) -> None:
    """pos_out[row] = position of flat (token, k) row in its destination's padded layout.

    order: [N*k] row ids sorted by expert (stable, so by source rank then token inside);
    counts: [E, R] rows of expert e from source r; region_start: [E]. Inside a region the
    positions enumerate (level o, source r) with counts[e, r] > o in lexicographic order, which
    is the schedule formula of the module docstring.
    """
    num_experts, num_ranks = counts.shape
    base = (np.cumsum(counts.reshape(-1)) - counts.reshape(-1)).reshape(counts.shape)
    for e in range(num_experts):
        c = counts[e]
        maxo = int(c.max()) if c.size else 0
        if maxo == 0:
            continue
        live = np.flatnonzero(c[None, :] > np.arange(maxo)[:, None])  # level-major (o, r)
        o, r = np.divmod(live, num_ranks)
        pos_out[order[base[e, r] + o]] = region_start[e] + np.arange(live.size)


@njit(cache=True)
def _dedup_rounds(dest, rnd, src, max_rounds, num_ranks):  # pragma: no cover - numba
    """Count distinct (token, dest) pairs by the round of their first and last row.

    dest, rnd: [num_tokens_total, num_topk] int64; src: [num_tokens_total] int64. Returns two
    flat [R_dst * max_rounds * R_src] count arrays. Each token's k rows are sorted by (dest,
    round); a pair's first row starts a run of equal dest, its last row ends one.
    """
    n, k = dest.shape
    size = num_ranks * max_rounds * num_ranks
    first = np.zeros(size, np.int64)
    last = np.zeros(size, np.int64)
    key = np.empty(k, np.int64)
    for t in range(n):
        for i in range(k):  # insertion sort of the token's (dest, round) keys
            x = dest[t, i] * max_rounds + rnd[t, i]
            j = i
            while j > 0 and key[j - 1] > x:
                key[j] = key[j - 1]
                j -= 1
            key[j] = x
        s = src[t]
        for i in range(k):
            d = key[i] // max_rounds
            if i == 0 or key[i - 1] // max_rounds != d:
                first[key[i] * num_ranks + s] += 1
            if i == k - 1 or key[i + 1] // max_rounds != d:
                last[key[i] * num_ranks + s] += 1
    return first, last


@dataclass
class RoundCounts:
    minibatch_size: int
    row_tile: int
    num_rounds: np.ndarray  # [R] rounds per destination rank
    rows: np.ndarray  # [R_dst, max_rounds, R_src] int64
    row_tiles: np.ndarray  # [R_dst, max_rounds] int64
    padded_rows: np.ndarray  # [R] padded layout length per destination
    _rnd: np.ndarray  # [N*k] round of every flat row
    _plan: RoutingPlan
    _dedup: tuple[np.ndarray, np.ndarray] | None = None

    @property
    def max_rounds(self) -> int:
        return self.rows.shape[1]

    def _dedup_counts(self) -> tuple[np.ndarray, np.ndarray]:
        if self._dedup is None:
            p, k, nr = self._plan, self._plan.num_topk, self._plan.num_ranks
            first, last = _dedup_rounds(
                p.dest.reshape(-1, k), self._rnd.reshape(-1, k), p.src[::k], self.max_rounds, nr
            )
            shape = (nr, self.max_rounds, nr)
            self._dedup = (first.reshape(shape), last.reshape(shape))
        return self._dedup

    @property
    def uniq_first(self) -> np.ndarray:
        """[R_dst, max_rounds, R_src] distinct (token, dst) pairs by round of their first row."""
        return self._dedup_counts()[0]

    @property
    def uniq_last(self) -> np.ndarray:
        """[R_dst, max_rounds, R_src] distinct (token, dst) pairs by round of their last row."""
        return self._dedup_counts()[1]


class RoutingPlan:
    """Positions of every (token, k) row for a trace on ``num_ranks`` EP ranks; rounds on demand."""

    def __init__(self, trace: RoutingTrace, row_tile: int = 128) -> None:
        if row_tile <= 0:
            raise ValueError(f"row_tile must be positive (found {row_tile})")
        self.trace = trace
        self.row_tile = row_tile
        self.num_ranks = trace.num_ranks
        self.num_tokens = trace.num_tokens
        self.num_topk = trace.num_topk
        e_total = trace.num_experts
        split = expert_split_problem(e_total, self.num_ranks)
        if split:
            raise ValueError(split)
        self.num_local_experts = e_total // self.num_ranks
        flat = trace.topk_idx.reshape(-1).astype(np.int64)  # [R*T*k]
        src = np.arange(flat.size, dtype=np.int64) // (self.num_tokens * self.num_topk)
        counts = np.bincount(flat * self.num_ranks + src, minlength=e_total * self.num_ranks)
        counts = counts.reshape(e_total, self.num_ranks).astype(np.int64)
        per_expert = counts.sum(axis=1)
        padded = -(-per_expert // row_tile) * row_tile
        padded_by_rank = padded.reshape(self.num_ranks, self.num_local_experts)
        starts = np.cumsum(padded_by_rank, axis=1) - padded_by_rank
        # NOTE: a stable sort of small integers is a radix sort in numpy: keep the keys narrow
        key = flat.astype(np.int16) if e_total < 2**15 else flat
        order = np.argsort(key, kind="stable").astype(np.int64)
        pos = np.empty(flat.size, dtype=np.int64)
        _assign_positions(order, counts, starts.reshape(-1).astype(np.int64), pos)
        self.dest = flat // self.num_local_experts
        self.src = src
        self.pos = pos
        self.padded_rows = padded_by_rank.sum(axis=1)
        self.region_starts = starts.astype(np.int64)  # [R, L] first padded row of each region
        self.expert_counts = counts
        self._rounds: dict[int, RoundCounts] = {}

    def rounds(self, minibatch_size: int) -> RoundCounts:
        if minibatch_size <= 0 or minibatch_size % self.row_tile:
            raise ValueError(
                f"minibatch_size={minibatch_size} must be a positive multiple of "
                f"row_tile={self.row_tile}"
            )
        if minibatch_size in self._rounds:
            return self._rounds[minibatch_size]
        nr = self.num_ranks
        num_rounds = -(-self.padded_rows // minibatch_size)
        max_rounds = max(1, int(num_rounds.max()))
        rnd = self.pos // minibatch_size
        key = (self.dest * max_rounds + rnd) * nr + self.src
        rows = np.bincount(key, minlength=nr * max_rounds * nr).reshape(nr, max_rounds, nr)
        m = np.arange(max_rounds)
        span = np.clip(self.padded_rows[:, None] - m[None, :] * minibatch_size, 0, minibatch_size)
        tiles = -(-span // self.row_tile)
        rc = RoundCounts(
            minibatch_size,
            self.row_tile,
            num_rounds.astype(np.int64),
            rows.astype(np.int64),
            tiles.astype(np.int64),
            self.padded_rows.astype(np.int64),
            rnd,
            self,
        )
        self._rounds[minibatch_size] = rc
        return rc
