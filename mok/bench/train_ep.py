"""The torch-best training layer at expert parallelism R (``torchrun --nproc-per-node=R -m
mok.bench train``): the one-rank ``torch-best`` layer of :mod:`mok.bench.train` with its
(token, k) rows moved to their experts' owner ranks and back, under autograd.

- ``torch-best+nccl`` (:func:`nccl_train_layer`): the usual all-to-all pipeline, as the
  forward-only ``nccl`` layer of :mod:`mok.bench.layer`: the rows sorted by owner rank
  (:func:`dispatch_plan`), the per-rank row counts exchanged with an ``all_to_all_single`` and
  read by the host (the split sizes of the data exchanges: one device-to-host sync per layer call,
  as every all-to-all pipeline has), the rows and their local expert ids sent with NCCL
  ``all_to_all_single``; at the owner one stable argsort by local expert, gate and up as one
  ``torch._grouped_mm`` over the ``[L, 2I, H]`` weight, bf16 SwiGLU, the down grouped GEMM and
  the inverse gather (:func:`expert_rows`). It sends one row per (token, k), not one per
  (token, destination rank) as DeepEP does, and runs eager (its collectives are not compiled):
  the plain pipeline people build from NCCL. The rows are sent back by the reverse
  ``all_to_all_single``, put back in (token, k) order and summed over k with the routing weights
  by a ``bmm`` (:func:`combine_rows`); plus the bf16 shared expert. The backward is autograd's:
  the gathers' scatters and the grouped GEMMs' gradients, and :class:`AllToAll`, whose backward
  is the reverse exchange of the gradient (no host sync: the split sizes are the forward's).
- ``torch-best+deepep`` (:class:`DeepEPTrainLayer`, where ``deep_ep`` imports; **untested**: no
  GPU machine of the project has DeepEP installed): DeepEP V1 normal dispatch, the same local
  experts over the received (token, local expert) pairs, per-token partial sums weighted by the
  received routing weights, DeepEP combine, plus the shared expert (the forward of
  :class:`mok.bench.layer.DeepEPLayer`, on its Buffer); the backward of the dispatch is DeepEP's
  combine of the gradient (with the routing weights' gradient) and that of the combine is
  DeepEP's dispatch with the forward's handle, as DeepEP documents.

The pipeline's index logic (which rank each row goes to, the split sizes, the local sort and
every inverse) is in plain functions of tensors, so that tests run R simulated ranks in one
process (tests/test_bench_train_ep.py).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from mok.bench.layer import sort_by_expert
from mok.bench.train_layers import grouped_experts, shared_expert

__all__ = [
    "AllToAll",
    "DeepEPTrainLayer",
    "combine_rows",
    "dispatch_plan",
    "expert_rows",
    "inverse_permutation",
    "nccl_train_layer",
]

Experts = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


# ---- the index logic (no process group) --------------------------------------------------------
def dispatch_plan(
    topk_idx: torch.Tensor, num_local_experts: int, num_ranks: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(order, send_counts) of a home rank's (token, k) rows: ``topk_idx`` [n, K] int64 global
    expert ids, expert e owned by rank e // ``num_local_experts``. ``order`` [n K] int64: the
    flat (token, k) slots sorted stably by owner rank (the send buffer is ``x[order // K]``, each
    owner's rows in token order); ``send_counts`` [num_ranks] int64: the rows for each rank."""
    owner = topk_idx.reshape(-1) // num_local_experts
    order = torch.argsort(owner, stable=True)
    return order, torch.bincount(owner, minlength=num_ranks)


def inverse_permutation(order: torch.Tensor) -> torch.Tensor:
    """inv [m] int64 with ``inv[order[i]] = i`` for a permutation ``order`` [m]: gathering with
    ``inv`` undoes a gather with ``order``."""
    inv = torch.empty_like(order)
    inv[order] = torch.arange(order.numel(), device=order.device)
    return inv


def expert_rows(
    recv: torch.Tensor, recv_expert: torch.Tensor, num_local_experts: int, experts: Experts
) -> torch.Tensor:
    """The owner's side: ``recv`` [m, H] (the rows received, by source rank) and ``recv_expert``
    [m] (their local expert ids) -> [m, H], each row through its expert, in ``recv``'s order:
    one stable sort by expert (:func:`mok.bench.layer.sort_by_expert`), ``experts(rows, offs)``
    on the expert-sorted rows (``offs`` [L] int32 group ends), the inverse gather."""
    order, offs = sort_by_expert(recv_expert.view(-1, 1), num_local_experts)
    y = experts(recv.index_select(0, order), offs)
    return y.index_select(0, inverse_permutation(order))


def combine_rows(
    back: torch.Tensor, order: torch.Tensor, topk_weights: torch.Tensor
) -> torch.Tensor:
    """The home rank's side: ``back`` [n K, H] (its rows' outputs, in ``order``, the send
    order of :func:`dispatch_plan`) -> [n, H] in ``back``'s dtype: the rows put back in (token,
    k) order and summed over k with ``topk_weights`` [n, K] (rounded to that dtype) by a
    ``bmm``, as the one-rank layer sums them."""
    (n, k), hidden = topk_weights.shape, back.shape[1]
    slots = back.index_select(0, inverse_permutation(order)).view(n, k, hidden)
    return torch.bmm(topk_weights.to(back.dtype).view(n, 1, k), slots).view(n, hidden)


# ---- NCCL all_to_all ---------------------------------------------------------------------------
class AllToAll(torch.autograd.Function):
    """``dist.all_to_all_single`` of rows under autograd: rows [sum(in_splits), ...] -> [sum(
    out_splits), ...] (``in_splits[r]`` rows to rank r, ``out_splits[r]`` from it); the backward
    sends the gradient the reverse way (the splits swapped)."""

    @staticmethod
    def forward(ctx, rows, out_splits: list[int], in_splits: list[int], group):
        ctx.splits, ctx.group = (out_splits, in_splits), group
        out = rows.new_empty((sum(out_splits), *rows.shape[1:]))
        dist.all_to_all_single(out, rows.contiguous(), out_splits, in_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        out_splits, in_splits = ctx.splits
        back = grad.new_empty((sum(in_splits), *grad.shape[1:]))
        dist.all_to_all_single(back, grad.contiguous(), in_splits, out_splits, group=ctx.group)
        return back, None, None, None


def nccl_train_layer(
    x: torch.Tensor,
    idx: torch.Tensor,
    tw: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    shared_gate_up: torch.Tensor | None,
    shared_down: torch.Tensor | None,
    num_experts: int,
    group=None,
) -> torch.Tensor:
    """The ``torch-best+nccl`` layer (module docstring) on this rank: x [n, H], idx [n, K]
    global expert ids, tw [n, K], this rank's experts ``gate_up`` [L, 2I, H] / ``down`` [L, H,
    I] (L = num_experts / ranks of ``group``, None: the default group) and its shared expert's
    ``shared_gate_up`` [2Is, H] / ``shared_down`` [H, Is] (or None) -> [n, H] in x's dtype.
    Collective over ``group``."""
    world = dist.get_world_size(group)
    num_local = gate_up.shape[0]
    if num_local * world != num_experts:
        raise ValueError(
            f"{num_local} local experts on each of {world} ranks do not make num_experts="
            f"{num_experts}"
        )
    k = idx.shape[1]
    order, send_counts = dispatch_plan(idx, num_local, world)
    recv_counts = torch.empty_like(send_counts)
    dist.all_to_all_single(recv_counts, send_counts, group=group)
    # NOTE: the host reads the split sizes here: one sync per call, as in every all_to_all
    # pipeline (the data exchanges need them on the host)
    sc, rc = send_counts.tolist(), recv_counts.tolist()
    recv = AllToAll.apply(x.index_select(0, order // k), rc, sc, group)
    recv_expert = idx.new_empty(sum(rc))
    sent_expert = (idx.reshape(-1)[order] % num_local).contiguous()
    dist.all_to_all_single(recv_expert, sent_expert, rc, sc, group=group)
    y = expert_rows(recv, recv_expert, num_local, grouped_experts(gate_up, down))
    out = combine_rows(AllToAll.apply(y, sc, rc, group), order, tw)
    if shared_gate_up is None:
        return out
    return out + shared_expert(x, shared_gate_up, shared_down)


# ---- DeepEP (untested: not installed on the project's GPU machines) ----------------------------
class _DeepEPDispatch(torch.autograd.Function):
    """DeepEP dispatch: (x [n, H] bf16, tw [n, K] fp32) -> (recv_x [m, H], recv_tw [m, K],
    recv_idx [m, K], not differentiable; -1 where a slot's expert is another rank's); the
    handle goes to ``state``. Backward: DeepEP combine of the gradients with that handle."""

    @staticmethod
    def forward(ctx, x, tw, idx, buf, state: dict):
        ntr, _, nte, in_rank, _ = buf.get_dispatch_layout(idx, state["num_experts"])
        recv_x, recv_idx, recv_tw, _, handle, _ = buf.dispatch(
            x, num_tokens_per_rank=ntr, is_token_in_rank=in_rank, num_tokens_per_expert=nte,
            topk_idx=idx, topk_weights=tw,
        )  # fmt: skip
        ctx.buf, ctx.handle = buf, handle
        state["handle"] = handle
        ctx.mark_non_differentiable(recv_idx)
        return recv_x, recv_tw, recv_idx

    @staticmethod
    def backward(ctx, grad_x, grad_tw, _):
        gx, gtw, _ = ctx.buf.combine(
            grad_x.contiguous(), ctx.handle, topk_weights=grad_tw.float().contiguous()
        )
        return gx, gtw, None, None, None


class _DeepEPCombine(torch.autograd.Function):
    """DeepEP combine of per-received-token partial sums [m, H] -> [n, H] with the dispatch's
    handle; backward: DeepEP dispatch of the gradient with that handle."""

    @staticmethod
    def forward(ctx, part, buf, handle):
        ctx.buf, ctx.handle = buf, handle
        out, _, _ = buf.combine(part, handle)
        return out

    @staticmethod
    def backward(ctx, grad):
        grad_part, *_ = ctx.buf.dispatch(grad.contiguous(), handle=ctx.handle)
        return grad_part, None, None


class DeepEPTrainLayer:
    """The ``torch-best+deepep`` layer (module docstring) on a DeepEP Buffer of ``sms`` SMs (that
    of :class:`mok.bench.layer.DeepEPLayer`, on the default group). Raises ImportError where
    ``deep_ep`` does not import; DeepEP's intranode dispatch takes at most
    :data:`mok.bench.layer.DEEPEP_MAX_LOCAL_EXPERTS` experts per rank."""

    def __init__(self, hidden: int, num_experts: int, sms: int):
        from mok.bench.layer import DeepEPLayer

        self.comm = DeepEPLayer(hidden, num_experts, sms)  # its Buffer and deep_ep module
        self.num_experts = num_experts

    def __call__(self, x, idx, tw, gate_up, down, shared_gate_up=None, shared_down=None):
        """x [n, H] bf16, idx [n, K] global expert ids, tw [n, K] fp32, this rank's weights as
        :func:`nccl_train_layer` takes them -> [n, H] bf16."""
        buf, num_local = self.comm.buf, gate_up.shape[0]
        state = {"num_experts": self.num_experts}
        recv_x, recv_tw, recv_idx = _DeepEPDispatch.apply(
            x, tw, idx.to(self.comm.ep.topk_idx_t), buf, state
        )
        # received (token, k) pairs of this rank's experts (-1: another rank's expert); the
        # modulo maps global or local expert ids to local ones
        loc = torch.where(recv_idx >= 0, recv_idx % num_local, -1)
        tok, kk = (loc >= 0).nonzero(as_tuple=True)
        order, offs = sort_by_expert(loc[tok, kk].view(-1, 1), num_local)
        tok, kk = tok[order], kk[order]
        y = grouped_experts(gate_up, down)(recv_x.index_select(0, tok), offs).float()
        part = torch.zeros(recv_x.shape[0], x.shape[1], dtype=torch.float32, device=x.device)
        part = part.index_add(0, tok, y * recv_tw[tok, kk].float().unsqueeze(1))
        out = _DeepEPCombine.apply(part.to(x.dtype), buf, state["handle"])
        if shared_gate_up is None:
            return out
        return out + shared_expert(x, shared_gate_up, shared_down)
