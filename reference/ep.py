"""The expert-parallel MoE layer over torch.distributed (gloo on CPU, NCCL on GPU).

The same algorithm the kernels run, written with collectives so it can be read and checked:

1. all-gather the routing (topk_idx, topk_weights) of every rank;
2. build this rank's :class:`~reference.schedule.Schedule` from it;
3. dispatch — ``pull``: the expert owner requests exactly the rows its schedule lists from each
   source and places them at their rows; ``push``: each source sends its (token, k) rows to
   ``(dst_rank, dst_index)``; ``dedup_pull``: one row per (token, destination rank), then a
   local fan-out into the expert-contiguous rows;
4. the local experts run on their contiguous, tile-padded regions;
5. combine — ``push``: each output row goes to slot ``src_index = token * num_topk + k`` of its
   home rank; ``pull``: the home rank requests its slots from the expert owners; with dedup the
   owner first sums its rank-local rows of a token (k order) and pushes one row per
   (token, rank) into slot ``token * num_topk + j`` (``j``: ordinal of the rank among the
   token's destination ranks), and the home rank sums those in ascending rank order;
6. ``out = shared(x) + fixed-order sum`` (:func:`reference.moe.combine`).

Ranks may hold different numbers of tokens, zero included; the all-gathered routing is padded to
the largest count (see :func:`reference.schedule.build_schedule`). ``num_topk`` may be 0 (the
layer is then the shared expert alone).

Point-to-point exchanges are written as ``all_to_all_single`` of raw bytes, so data that only
moves arrives bitwise identical. Pull is modelled as request-then-reply: the requester decides
which rows travel and where they land, which is what distinguishes pull from push.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

from reference.moe import (
    MoEGrads,
    combine,
    expert_ffn,
    expert_ffn_backward,
    finish_backward,
    output_dtype,
    shared_forward,
)
from reference.numerics import Mode, carrier, check_mode, store
from reference.schedule import Schedule, build_schedule, required_rows
from reference.validation import validate_layer_inputs
from reference.weights import MoEWeights

__all__ = [
    "DISPATCH_MODES",
    "COMBINE_MODES",
    "CapacityError",
    "EPForward",
    "ep_forward",
    "ep_backward",
]

DISPATCH_MODES = ("pull", "push", "dedup_pull")
COMBINE_MODES = ("push", "pull")


class CapacityError(RuntimeError):
    """A rank would receive more rows than its receive buffer holds. Tokens are never dropped."""


@dataclass
class EPForward:
    """Result of :func:`ep_forward` with the intermediate buffers (for tests and debugging)."""

    out: torch.Tensor  # [num_tokens, hidden]
    schedule: Schedule
    recv: torch.Tensor  # [P, hidden] dispatched rows in schedule order (input dtype)
    y: torch.Tensor  # [P, hidden] expert outputs (carrier dtype; padding rows zero)
    slots: torch.Tensor  # [num_tokens * num_topk, hidden] combine slots on the home rank
    topk_weights_all: torch.Tensor  # [num_ranks, max num_tokens, num_topk], zero padded
    num_tokens_all: torch.Tensor  # [num_ranks] token count of each rank


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    """Rows of ``t`` as raw bytes, [rows, bytes per row] (also for zero rows)."""
    row_bytes = math.prod(t.shape[1:]) * t.element_size()
    return t.contiguous().view(torch.uint8).reshape(t.shape[0], row_bytes)


def _exchange(
    send: torch.Tensor, dest: torch.Tensor, group: dist.ProcessGroup | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Send row ``i`` of ``send`` to rank ``dest[i]``; rows keep their order per destination.

    Returns (received rows grouped by source rank in rank order, source rank of each row).
    """
    world = dist.get_world_size(group)
    order = torch.sort(dest, stable=True).indices
    send_counts = torch.bincount(dest, minlength=world)
    recv_counts = torch.empty_like(send_counts)
    dist.all_to_all_single(recv_counts, send_counts, group=group)
    payload = _as_bytes(send[order])
    out = torch.empty(int(recv_counts.sum()), payload.shape[1], dtype=torch.uint8)
    dist.all_to_all_single(out, payload, recv_counts.tolist(), send_counts.tolist(), group=group)
    src = torch.repeat_interleave(torch.arange(world), recv_counts)
    out = out.view(send.dtype).reshape(out.shape[0], *send.shape[1:])
    return out, src


def _request(
    wanted_rank: torch.Tensor,
    wanted_index: torch.Tensor,
    serve: torch.Tensor,
    group: dist.ProcessGroup | None,
) -> torch.Tensor:
    """Pull: fetch row ``wanted_index[i]`` of ``serve`` on rank ``wanted_rank[i]`` for every i.

    Each rank answers the requests it receives from its own ``serve`` tensor. Returns the rows in
    the order they were asked for.
    """
    req, req_src = _exchange(wanted_index, wanted_rank, group)
    reply, _ = _exchange(serve[req], req_src, group)
    # Replies come back grouped by the rank that served them, in request order per rank.
    order = torch.sort(wanted_rank, stable=True).indices
    out = torch.empty_like(reply)
    out[order] = reply
    return out


def _push(
    rows: torch.Tensor,
    dest: torch.Tensor,
    index: torch.Tensor,
    into: torch.Tensor,
    group: dist.ProcessGroup | None,
) -> torch.Tensor:
    """Push: row ``i`` of ``rows`` lands at ``into[index[i]]`` on rank ``dest[i]``. The sender
    decides where each row goes (what distinguishes push from pull). Returns ``into``."""
    payload = torch.cat([_as_bytes(rows), _as_bytes(index.to(torch.int64)[:, None])], dim=1)
    got, _ = _exchange(payload, dest, group)
    nb = math.prod(into.shape[1:]) * into.element_size()  # rows have into's dtype and width
    # NOTE: a copy, not .contiguous(): with one row (or none) the slice is already contiguous
    # at byte offset nb, which an int64 view rejects unless nb is a multiple of 8.
    where = got[:, nb:].clone(memory_format=torch.contiguous_format).view(torch.int64).squeeze(1)
    into[where] = got[:, :nb].contiguous().view(into.dtype).reshape(len(got), *into.shape[1:])
    return into


def _gather_signature(t: torch.Tensor, group, what: list[str]) -> None:
    world = dist.get_world_size(group)
    sig = torch.tensor(t, dtype=torch.int64)
    all_sig = [torch.empty_like(sig) for _ in range(world)]
    dist.all_gather(all_sig, sig, group=group)
    ref = all_sig[0]
    for r, s in enumerate(all_sig):
        if not torch.equal(s, ref):
            diff = [
                f"{n}: rank 0 has {int(a)}, rank {r} has {int(b)}"
                for n, a, b in zip(what, ref, s, strict=True)
                if a != b
            ]
            raise ValueError("ranks disagree on the layer's shapes: " + "; ".join(diff))


def _check_capacity(
    topk_all: torch.Tensor,
    tokens: torch.Tensor,
    num_experts: int,
    row_tile: int,
    max_recv_rows: int | None,
) -> None:
    if max_recv_rows is None:
        return
    offsets = required_rows(topk_all, num_experts, row_tile, tokens)  # [R, L + 1]
    num_local = offsets.shape[1] - 1
    for r in range(offsets.shape[0]):
        if int(offsets[r, -1]) > max_recv_rows:
            lx = int((offsets[r, 1:] > max_recv_rows).nonzero()[0])
            raise CapacityError(
                f"rank {r} must receive {int(offsets[r, -1])} rows (padded to row_tile="
                f"{row_tile}) but its receive buffer holds max_recv_rows={max_recv_rows}; "
                f"the overflow starts at expert {r * num_local + lx} (local {lx}), whose region "
                f"ends at row {int(offsets[r, lx + 1])}. Raise the capacity; mok never drops "
                "tokens"
            )


def _all_gather(t: torch.Tensor, group) -> torch.Tensor:
    world = dist.get_world_size(group)
    parts = [torch.empty_like(t) for _ in range(world)]
    dist.all_gather(parts, t.contiguous(), group=group)
    return torch.stack(parts)


def _all_gather_padded(t: torch.Tensor, tokens: torch.Tensor, group) -> torch.Tensor:
    """Every rank's ``t`` ([its num_tokens, ...]), zero padded to the largest count:
    [num_ranks, max(tokens), ...]."""
    padded = torch.zeros(int(tokens.max()), *t.shape[1:], dtype=t.dtype)
    padded[: t.shape[0]] = t
    return _all_gather(padded, group)


_DTYPE_CODES = {torch.float64: 0, torch.float32: 1, torch.bfloat16: 2, torch.float16: 3}


def _dispatch(
    x: torch.Tensor, s: Schedule, mode: str, group
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Rows of ``x`` (this rank's tokens) to the expert owners. Returns (recv [P, H], dedup
    buffer [D, H] or None) on this rank."""
    num_topk, hidden = s.num_topk, x.shape[1]
    recv = torch.zeros(s.num_rows, hidden, dtype=x.dtype)
    real = (s.src_rank >= 0).nonzero().squeeze(1)
    if mode == "pull":
        rows = _request(s.src_rank[real], s.src_index[real] // num_topk, x, group)
        recv[real] = rows
        return recv, None
    if mode == "push":
        tokens = torch.arange(s.num_tokens).repeat_interleave(num_topk)
        _push(x[tokens], s.dst_rank.reshape(-1), s.dst_index.reshape(-1), recv, group)
        return recv, None
    dedup = _request(s.dedup_src_rank, s.dedup_src_token, x, group)
    recv[real] = dedup[s.fanout[real]]  # local fan-out, no NVLink traffic
    return recv, dedup


def _expert_compute(
    recv: torch.Tensor, s: Schedule, w: MoEWeights, mode: Mode
) -> tuple[torch.Tensor, list]:
    y = torch.zeros(s.num_rows, recv.shape[1], dtype=carrier(mode))
    saved = []
    for lx in range(s.num_local_experts):
        a, n = int(s.offsets[lx]), int(s.tokens_per_expert[lx])
        if n:
            yl, sv = expert_ffn(recv[a : a + n], w.w_gate[lx], w.w_up[lx], w.w_down[lx], mode)
            y[a : a + n] = yl
        else:
            sv = None
        saved.append(sv)
    return y, saved


def _row_weights(s: Schedule, topk_weights_all: torch.Tensor) -> torch.Tensor:
    """Router weight of every receive row ([P], zero for padding)."""
    real = s.src_rank >= 0
    w = torch.zeros(s.num_rows, dtype=topk_weights_all.dtype)
    flat = topk_weights_all.reshape(s.num_ranks, -1)
    w[real] = flat[s.src_rank[real], s.src_index[real]]
    return w


def _dedup_partials(y: torch.Tensor, s: Schedule, row_w: torch.Tensor, mode: Mode) -> torch.Tensor:
    """Per dedup row, the sum over this rank's rows of that token, in k order, of w * y."""
    c = carrier(mode)
    part = torch.zeros(s.num_dedup_rows, y.shape[1], dtype=c)
    real = s.src_rank >= 0
    for k in range(s.num_topk):
        # NOTE: each (token, k) is one row, so within one k no two rows share a dedup row and
        # the index_add below has no colliding, order-dependent sums.
        rows = (real & (s.src_index % s.num_topk == k)).nonzero().squeeze(1)
        part.index_add_(0, s.fanout[rows], row_w[rows, None].to(c) * y[rows])
    return store(part, mode)


def _combine_to_slots(
    y: torch.Tensor, s: Schedule, mode: str, group, dedup_rows: torch.Tensor | None = None
) -> torch.Tensor:
    """Expert-side rows back to their home rank's slots ([num_tokens * num_topk, H])."""
    slots = torch.zeros(s.num_tokens * s.num_topk, y.shape[1], dtype=y.dtype)
    if dedup_rows is not None:
        return _push(dedup_rows, s.dedup_src_rank, s.dedup_slot, slots, group)
    real = (s.src_rank >= 0).nonzero().squeeze(1)
    if mode == "push":
        return _push(y[real], s.src_rank[real], s.src_index[real], slots, group)
    # pull: the home rank asks each expert owner for the rows of its own (token, k).
    return _request(s.dst_rank.reshape(-1), s.dst_index.reshape(-1), y, group)


def _check_modes(dispatch_mode: str, combine_mode: str) -> None:
    if dispatch_mode not in DISPATCH_MODES:
        raise ValueError(
            f"unknown dispatch_mode {dispatch_mode!r}; supported: {', '.join(DISPATCH_MODES)}"
        )
    if combine_mode not in COMBINE_MODES:
        raise ValueError(
            f"unknown combine_mode {combine_mode!r}; supported: {', '.join(COMBINE_MODES)}"
        )
    if dispatch_mode == "dedup_pull" and combine_mode != "push":
        raise ValueError("dedup_pull dispatch pairs with the dedup push combine: use 'push'")


def _prologue(x, topk_idx, topk_weights, local_weights, num_experts, row_tile, mode, group):
    """Shared checks + routing all-gather + schedule of forward and backward."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    if num_experts % world:
        raise ValueError(f"num_experts={num_experts} is not divisible by num_ranks={world}")
    if local_weights.num_experts != num_experts // world:
        raise ValueError(
            f"rank {rank} holds {local_weights.num_experts} experts, expected "
            f"num_experts / num_ranks = {num_experts // world}"
        )
    names = ["hidden", "num_topk", "num_experts", "x dtype", "row_tile", "shared"]
    sig = [x.shape[1], topk_idx.shape[1], num_experts, _DTYPE_CODES.get(x.dtype, -1)]
    _gather_signature(sig + [row_tile, int(local_weights.has_shared)], group, names)
    validate_layer_inputs(x, topk_idx, topk_weights, local_weights, num_experts)
    tokens = _all_gather(torch.tensor(x.shape[0], dtype=torch.int64), group)  # [R]
    topk_all = _all_gather_padded(topk_idx.to(torch.int64), tokens, group)
    weights_all = _all_gather_padded(topk_weights.to(carrier(mode)), tokens, group)
    return rank, topk_all, weights_all, tokens


def ep_forward(
    x: torch.Tensor,
    topk_idx: torch.Tensor,
    topk_weights: torch.Tensor,
    local_weights: MoEWeights,
    num_experts: int,
    *,
    dispatch_mode: str = "pull",
    combine_mode: str = "push",
    row_tile: int = 128,
    compute_dtype: Mode = torch.float32,
    max_recv_rows: int | None = None,
    group: dist.ProcessGroup | None = None,
) -> EPForward:
    """Expert-parallel forward on this rank.

    x: [num_tokens, hidden] this rank's tokens (the count may differ between ranks, 0
    included); topk_idx, topk_weights: [num_tokens, num_topk]
    local_weights: this rank's experts (``MoEWeights.shard``) plus the replicated shared expert.
    ``max_recv_rows`` bounds the receive buffer (rows, padding included); exceeding it raises
    :class:`CapacityError` on every rank alike.
    """
    mode = check_mode(compute_dtype)
    _check_modes(dispatch_mode, combine_mode)
    rank, topk_all, weights_all, tokens = _prologue(
        x, topk_idx, topk_weights, local_weights, num_experts, row_tile, mode, group
    )
    _check_capacity(topk_all, tokens, num_experts, row_tile, max_recv_rows)
    s = build_schedule(topk_all, num_experts, rank, row_tile, tokens)
    recv, _ = _dispatch(x, s, dispatch_mode, group)
    y, _ = _expert_compute(recv, s, local_weights, mode)
    if dispatch_mode == "dedup_pull":
        partial = _dedup_partials(y, s, _row_weights(s, weights_all), mode)
        slots = _combine_to_slots(y, s, combine_mode, group, dedup_rows=partial)
        # Slot j holds an already weighted partial; unfilled slots are zero.
        filled = torch.zeros(s.num_tokens * s.num_topk, dtype=carrier(mode))
        filled[_dedup_slots_filled(s, topk_idx)] = 1.0
        weights = filled.view(s.num_tokens, s.num_topk)
    else:
        slots = _combine_to_slots(y, s, combine_mode, group)
        weights = topk_weights
    shared_y = shared_forward(x, local_weights, mode)
    out = combine(slots.view(s.num_tokens, s.num_topk, x.shape[1]), weights, shared_y, mode)
    return EPForward(out.to(output_dtype(mode)), s, recv, y, slots, weights_all, tokens)


def _dedup_slots_filled(s: Schedule, topk_idx: torch.Tensor) -> torch.Tensor:
    """Slots token * num_topk + j, j < number of distinct destination ranks of the token."""
    dst = (topk_idx.to(torch.int64) // s.num_local_experts).sort(dim=1).values
    distinct = 1 + (dst[:, 1:] != dst[:, :-1]).sum(dim=1)
    j = torch.arange(s.num_topk)
    mask = j[None, :] < distinct[:, None]
    return mask.reshape(-1).nonzero().squeeze(1)


def ep_backward(
    grad_out: torch.Tensor,
    x: torch.Tensor,
    topk_idx: torch.Tensor,
    topk_weights: torch.Tensor,
    local_weights: MoEWeights,
    num_experts: int,
    *,
    row_tile: int = 128,
    compute_dtype: Mode = torch.float32,
    group: dist.ProcessGroup | None = None,
) -> MoEGrads:
    """Expert-parallel backward over the same schedule, transfers reversed.

    Reverse combine: the expert owner *pulls* ``grad_out`` rows of its (token, k) rows (the
    dispatch pull applied to grad_out). Reverse dispatch: it *pushes* each row's dx and
    d_topk_weight into slot ``token * num_topk + k`` of the home rank, which sums dx in fixed
    order (shared first, then k).
    """
    mode = check_mode(compute_dtype)
    rank, topk_all, weights_all, tokens = _prologue(
        x, topk_idx, topk_weights, local_weights, num_experts, row_tile, mode, group
    )
    s = build_schedule(topk_all, num_experts, rank, row_tile, tokens)
    recv, _ = _dispatch(x, s, "pull", group)  # replay of the forward dispatch
    drecv, _ = _dispatch(grad_out, s, "pull", group)  # reverse combine
    row_w = _row_weights(s, weights_all)
    _, saved = _expert_compute(recv, s, local_weights, mode)
    c = carrier(mode)
    lw = local_weights
    dx_rows = torch.zeros(s.num_rows, x.shape[1], dtype=c)
    dw_rows = torch.zeros(s.num_rows, 1, dtype=c)
    dw_gate = torch.zeros(lw.w_gate.shape, dtype=c)
    dw_up = torch.zeros(lw.w_up.shape, dtype=c)
    dw_down = torch.zeros(lw.w_down.shape, dtype=c)
    for lx in range(s.num_local_experts):
        a, n = int(s.offsets[lx]), int(s.tokens_per_expert[lx])
        if not n:
            continue
        r = slice(a, a + n)
        dx, dw, dwg, dwu, dwd = expert_ffn_backward(
            drecv[r], row_w[r], recv[r], saved[lx], lw.w_gate[lx], lw.w_up[lx], lw.w_down[lx], mode
        )
        dx_rows[r], dw_rows[r, 0] = dx, dw
        dw_gate[lx], dw_up[lx], dw_down[lx] = dwg, dwu, dwd
    dx_slots = _combine_to_slots(dx_rows, s, "push", group)
    dw_slots = _combine_to_slots(dw_rows, s, "push", group)
    grads = MoEGrads(
        dx=dx_slots,  # replaced by finish_backward
        d_topk_weights=dw_slots.view(s.num_tokens, s.num_topk),
        dw_gate=dw_gate,
        dw_up=dw_up,
        dw_down=dw_down,
    )
    return finish_backward(grads, dx_slots, grad_out, x, lw, mode)
