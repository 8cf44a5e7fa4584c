"""The schedule table: where every routed (token, k) row lives on the rank that owns its expert.

One table serves all four transfers. Read by the destination (expert owner) it is a *pull*
schedule: row ``p`` of the receive buffer holds ``(src_rank, src_index = token * num_topk + k)``.
Read by the source it is a *push* schedule: (token, k) of this rank goes to ``(dst_rank,
dst_index)``. Backward reverses both directions over the same rows.

Layout on destination rank ``d`` (``L = num_experts // num_ranks`` local experts, global expert
``e = d * L + l``):

* ``M[l, r]``: rows that source rank ``r`` sends to local expert ``l``; ``T[l] = sum_r M[l, r]``.
* Expert regions start at ``S[l]`` = prefix sum of ``T`` with every region padded up to a multiple
  of ``row_tile`` (the GEMM row tile), so each expert's rows are contiguous and tile aligned.
* The ``o``-th row (in increasing src_index order) from rank ``r`` for expert ``l`` sits at
  ``S[l] + sum_r' min(M[l, r'], o) + #{r' < r : M[l, r'] > o}``: round-robin over source ranks,
  which is the same as sorting the expert's rows by (o, r). Padding rows hold -1.

The dedup variant moves one row per (token, destination rank) instead of one per (token, k):
destination ``d`` keeps a dedup buffer with one row per distinct (src_rank, token) that has any
expert on ``d``, ordered round-robin over source ranks the same way, plus a fan-out map from each
expert-contiguous row to its dedup row. Its combine pushes one partial sum per (token, rank) into
slot ``token * num_topk + j`` of the home rank, ``j`` being the ordinal of ``d`` among the token's
distinct destination ranks in ascending order.

Ranks may hold different numbers of tokens, zero included (``num_tokens_all``): the routing is
then padded to the largest count and the padding rows are ignored. Everything here is
vectorised: no Python loop over tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

__all__ = [
    "Schedule",
    "build_schedule",
    "build_all_schedules",
    "required_rows",
    "validate_routing",
]


@dataclass
class Schedule:
    """The schedule seen from one rank (as destination for pull, as source for push).

    Shapes (``L`` local experts, ``R`` ranks, ``N`` tokens of this rank, ``K`` = num_topk,
    ``P`` padded receive rows on this rank, ``D`` dedup rows on this rank). All int64 on CPU.
    """

    rank: int
    num_ranks: int
    num_experts: int
    num_tokens: int
    num_topk: int
    row_tile: int
    counts: torch.Tensor  # [L, R] rows from each source rank per local expert (M)
    tokens_per_expert: torch.Tensor  # [L] (T)
    offsets: torch.Tensor  # [L + 1] padded region starts (S); offsets[L] == P
    src_rank: torch.Tensor  # [P] source rank of each receive row, -1 for padding
    src_index: torch.Tensor  # [P] token * K + k on the source rank, -1 for padding
    dst_rank: torch.Tensor  # [N, K] rank owning the expert of this rank's (token, k)
    dst_index: torch.Tensor  # [N, K] receive row of (token, k) on dst_rank
    dedup_src_rank: torch.Tensor  # [D] source rank of each dedup row
    dedup_src_token: torch.Tensor  # [D] token index on that source rank
    dedup_slot: torch.Tensor  # [D] home-rank combine slot token * K + j of each dedup row
    fanout: torch.Tensor  # [P] dedup row feeding each receive row, -1 for padding

    @property
    def num_local_experts(self) -> int:
        return self.num_experts // self.num_ranks

    @property
    def num_rows(self) -> int:
        return int(self.offsets[-1])

    @property
    def num_dedup_rows(self) -> int:
        return int(self.dedup_src_rank.numel())


def validate_routing(topk_idx: torch.Tensor, num_experts: int, what: str = "topk_idx") -> None:
    """Raise ValueError unless ``topk_idx`` holds in-range experts, distinct within each token."""
    if topk_idx.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"{what} must be int32 or int64 (found {topk_idx.dtype})")
    if topk_idx.numel() == 0:
        return
    lo, hi = int(topk_idx.min()), int(topk_idx.max())
    if lo < 0 or hi >= num_experts:
        bad = lo if lo < 0 else hi
        where = (topk_idx == bad).nonzero()[0].tolist()
        raise ValueError(
            f"{what} holds expert {bad} at {where}, outside [0, {num_experts}) "
            f"(num_experts={num_experts})"
        )
    s = topk_idx.reshape(-1, topk_idx.shape[-1]).sort(dim=1).values
    dup = (s[:, 1:] == s[:, :-1]).any(dim=1)
    if bool(dup.any()):
        row = int(dup.nonzero()[0])
        raise ValueError(
            f"{what} routes token {row} (flat index over leading dims) to the same expert twice: "
            f"{topk_idx.reshape(-1, topk_idx.shape[-1])[row].tolist()}; each token's top-k "
            "experts must be distinct"
        )


def _round_up(x: torch.Tensor, m: int) -> torch.Tensor:
    return (x + m - 1) // m * m


def _occurrence(group: torch.Tensor, num_groups: int) -> torch.Tensor:
    """For entries listed in their natural order, the index of each entry within its group."""
    order = torch.sort(group, stable=True).indices
    counts = torch.bincount(group, minlength=num_groups)
    starts = torch.cumsum(counts, 0) - counts
    occ = torch.empty_like(group)
    occ[order] = torch.arange(group.numel()) - starts[group[order]]
    return occ


def _round_robin_position(
    group: torch.Tensor, occ: torch.Tensor, src: torch.Tensor, counts: torch.Tensor
) -> torch.Tensor:
    """Position inside its group of the ``occ``-th entry from source ``src``, the group's sources
    taking turns: ``sum_r' min(counts[g, r'], occ) + #{r' < src : counts[g, r'] > occ}``.

    group, occ, src: [n] int64; counts: [num_groups, num_ranks] int64. Evaluated in chunks so
    the [n, num_ranks] intermediate stays small.
    """
    num_ranks = counts.shape[1]
    ranks = torch.arange(num_ranks)
    out = torch.empty_like(occ)
    chunk = max(1, (1 << 22) // max(num_ranks, 1))
    for i in range(0, occ.numel(), chunk):
        g, o, r = group[i : i + chunk], occ[i : i + chunk, None], src[i : i + chunk, None]
        m = counts[g]  # [c, R]
        before = torch.minimum(m, o).sum(dim=1)
        same_round = ((m > o) & (ranks < r)).sum(dim=1)
        out[i : i + chunk] = before + same_round
    return out


def _source_order_position(
    group: torch.Tensor, occ: torch.Tensor, src: torch.Tensor, counts: torch.Tensor
) -> torch.Tensor:
    """Position inside its group of the ``occ``-th entry from source ``src`` when the group holds
    source 0's entries, then source 1's, ...: ``sum_{r' < src} counts[g, r'] + occ``.

    group, occ, src: [n] int64; counts: [num_groups, num_ranks] int64.
    """
    before = torch.cumsum(counts, dim=1) - counts  # [num_groups, R]: entries of lower sources
    return before[group, src] + occ


ROW_ORDERS = {"interleaved": _round_robin_position, "source": _source_order_position}


@dataclass
class _Routing:
    """All-gathered routing flattened to (source rank, src_index) entries, plus global counts."""

    num_ranks: int
    num_tokens: int  # N, the largest token count of any rank (the padded width)
    num_topk: int
    num_local: int
    expert: torch.Tensor  # [R, N * K] global expert of each entry (0 in padding)
    real: torch.Tensor  # [R, N * K] bool, False for the padding past a rank's token count
    tokens: torch.Tensor  # [R] token count of each rank
    counts: torch.Tensor  # [E, R] rows from source r for expert e
    offsets: torch.Tensor  # [R, L + 1] padded region starts on each destination


def _prepare(
    topk_idx_all: torch.Tensor, num_experts: int, row_tile: int, tokens: torch.Tensor
) -> _Routing:
    num_ranks, num_tokens, num_topk = topk_idx_all.shape
    num_local = num_experts // num_ranks
    real = (torch.arange(num_tokens) < tokens[:, None]).repeat_interleave(num_topk, dim=1)
    e = topk_idx_all.reshape(num_ranks, num_tokens * num_topk).to(torch.int64)
    e = torch.where(real, e, 0)
    src = torch.arange(num_ranks).unsqueeze(1)
    counts = torch.bincount((e * num_ranks + src)[real], minlength=num_experts * num_ranks)
    counts = counts.reshape(num_experts, num_ranks)
    padded = _round_up(counts.sum(dim=1), row_tile).reshape(num_ranks, num_local)
    offsets = torch.zeros(num_ranks, num_local + 1, dtype=torch.int64)
    offsets[:, 1:] = torch.cumsum(padded, dim=1)
    return _Routing(num_ranks, num_tokens, num_topk, num_local, e, real, tokens, counts, offsets)


def _rank_view(
    g: _Routing, rank: int, num_experts: int, row_tile: int, row_order: str = "interleaved"
) -> Schedule:
    position = ROW_ORDERS[row_order]
    num_ranks, num_tokens, num_topk, num_local = g.num_ranks, g.num_tokens, g.num_topk, g.num_local
    own_tokens = int(g.tokens[rank])

    # Push side: where each of this rank's (token, k) rows lands.
    own = g.expert[rank, : own_tokens * num_topk]
    own_occ = _occurrence(own, num_experts)  # entries are in src_index order
    own_dst = own // num_local
    own_pos = position(own, own_occ, torch.full_like(own, rank), g.counts)
    own_index = g.offsets[own_dst, own % num_local] + own_pos

    # Pull side: every entry of any source whose expert lives here.
    here = (g.expert // num_local == rank) & g.real
    src_r, src_i = here.nonzero(as_tuple=True)  # source-major order
    e = g.expert[src_r, src_i]
    occ = _occurrence(e * num_ranks + src_r, num_experts * num_ranks)
    rows = g.offsets[rank, e % num_local] + position(e, occ, src_r, g.counts)
    num_rows = int(g.offsets[rank, -1])
    src_rank = torch.full((num_rows,), -1, dtype=torch.int64)
    src_index = torch.full((num_rows,), -1, dtype=torch.int64)
    src_rank[rows] = src_r
    src_index[rows] = src_i

    # Dedup: one row per distinct (source rank, token) with an expert here, round-robin over
    # source ranks in token order.
    pair, inv = torch.unique(src_r * num_tokens + src_i // num_topk, return_inverse=True)
    d_src, d_tok = pair // num_tokens, pair % num_tokens
    d_counts = torch.bincount(d_src, minlength=num_ranks).unsqueeze(0)
    d_occ = _occurrence(d_src, num_ranks)
    d_pos = _round_robin_position(torch.zeros_like(d_src), d_occ, d_src, d_counts)
    fanout = torch.full((num_rows,), -1, dtype=torch.int64)
    fanout[rows] = d_pos[inv]
    # Ordinal of this rank among the token's distinct destination ranks (ascending).
    dsts = (g.expert.reshape(num_ranks, num_tokens, num_topk)[d_src, d_tok] // num_local).sort(1)
    dsts = dsts.values
    new = torch.ones_like(dsts, dtype=torch.bool)
    new[:, 1:] = dsts[:, 1:] != dsts[:, :-1]
    ordinal = (new & (dsts < rank)).sum(dim=1)
    num_dedup = pair.numel()
    dedup_src_rank = torch.empty(num_dedup, dtype=torch.int64)
    dedup_src_token = torch.empty(num_dedup, dtype=torch.int64)
    dedup_slot = torch.empty(num_dedup, dtype=torch.int64)
    dedup_src_rank[d_pos] = d_src
    dedup_src_token[d_pos] = d_tok
    dedup_slot[d_pos] = d_tok * num_topk + ordinal

    counts = g.counts[rank * num_local : (rank + 1) * num_local]
    return Schedule(
        rank=rank,
        num_ranks=num_ranks,
        num_experts=num_experts,
        num_tokens=own_tokens,
        num_topk=num_topk,
        row_tile=row_tile,
        counts=counts,
        tokens_per_expert=counts.sum(dim=1),
        offsets=g.offsets[rank],
        src_rank=src_rank,
        src_index=src_index,
        dst_rank=own_dst.reshape(own_tokens, num_topk),
        dst_index=own_index.reshape(own_tokens, num_topk),
        dedup_src_rank=dedup_src_rank,
        dedup_src_token=dedup_src_token,
        dedup_slot=dedup_slot,
        fanout=fanout,
    )


def _check_args(
    topk_idx_all: torch.Tensor,
    num_experts: int,
    row_tile: int,
    num_tokens_all: Sequence[int] | torch.Tensor | None,
) -> torch.Tensor:
    """Check the arguments; returns the token count of every rank, [num_ranks] int64."""
    if topk_idx_all.ndim != 3:
        raise ValueError(
            "topk_idx_all must be [num_ranks, num_tokens, num_topk] (found shape "
            f"{tuple(topk_idx_all.shape)})"
        )
    num_ranks, width = topk_idx_all.shape[:2]
    if num_experts % num_ranks:
        raise ValueError(
            f"num_experts={num_experts} is not divisible by num_ranks={num_ranks}; expert "
            "parallelism needs the same number of experts on every rank"
        )
    if row_tile < 1:
        raise ValueError(f"row_tile must be >= 1 (found {row_tile})")
    if num_tokens_all is None:
        validate_routing(topk_idx_all, num_experts, "topk_idx_all")
        return torch.full((num_ranks,), width, dtype=torch.int64)
    tokens = torch.as_tensor(num_tokens_all, dtype=torch.int64).reshape(-1).cpu()
    if tokens.numel() != num_ranks or bool(((tokens < 0) | (tokens > width)).any()):
        raise ValueError(
            f"num_tokens_all must hold one count in [0, {width}] per rank for topk_idx_all of "
            f"shape {tuple(topk_idx_all.shape)} (found {tokens.tolist()})"
        )
    for r in range(num_ranks):  # the padding past each rank's count is not routing
        validate_routing(topk_idx_all[r, : int(tokens[r])], num_experts, f"topk_idx_all[{r}]")
    return tokens


def build_all_schedules(
    topk_idx_all: torch.Tensor,
    num_experts: int,
    row_tile: int = 128,
    num_tokens_all: Sequence[int] | torch.Tensor | None = None,
    row_order: str = "interleaved",
) -> list[Schedule]:
    """Schedules of every rank from the all-gathered routing.

    topk_idx_all: [num_ranks, num_tokens, num_topk] int — routing of every rank's tokens.
    num_tokens_all: token count of each rank when they differ (rank ``r``'s tokens are the first
    ``num_tokens_all[r]`` rows of ``topk_idx_all[r]``, the rest is padding and ignored); None:
    every rank has ``num_tokens``.
    row_order: ``interleaved`` (the source ranks take turns in each expert region) or
    ``source`` (source 0's rows, then source 1's, ...), as ``MoKConfig.row_order``.
    """
    tokens = _check_args(topk_idx_all, num_experts, row_tile, num_tokens_all)
    g = _prepare(topk_idx_all.cpu(), num_experts, row_tile, tokens)
    R = topk_idx_all.shape[0]
    return [_rank_view(g, r, num_experts, row_tile, row_order) for r in range(R)]


def build_schedule(
    topk_idx_all: torch.Tensor,
    num_experts: int,
    rank: int,
    row_tile: int = 128,
    num_tokens_all: Sequence[int] | torch.Tensor | None = None,
    row_order: str = "interleaved",
) -> Schedule:
    """The schedule of one rank from the all-gathered routing.

    topk_idx_all: [num_ranks, num_tokens, num_topk] int — routing of every rank's tokens;
    num_tokens_all, row_order: as in :func:`build_all_schedules`.
    """
    tokens = _check_args(topk_idx_all, num_experts, row_tile, num_tokens_all)
    if not 0 <= rank < topk_idx_all.shape[0]:
        raise ValueError(f"rank {rank} outside [0, num_ranks={topk_idx_all.shape[0]})")
    g = _prepare(topk_idx_all.cpu(), num_experts, row_tile, tokens)
    return _rank_view(g, rank, num_experts, row_tile, row_order)


def required_rows(
    topk_idx_all: torch.Tensor,
    num_experts: int,
    row_tile: int = 128,
    num_tokens_all: Sequence[int] | torch.Tensor | None = None,
) -> torch.Tensor:
    """Padded region starts of every rank, [num_ranks, num_local_experts + 1]; the last column
    is the receive-buffer rows each rank needs. Cheap: counts only, no positions.

    topk_idx_all: [num_ranks, num_tokens, num_topk] int; num_tokens_all: as in
    :func:`build_all_schedules`.
    """
    tokens = _check_args(topk_idx_all, num_experts, row_tile, num_tokens_all)
    return _prepare(topk_idx_all.cpu(), num_experts, row_tile, tokens).offsets
