"""Train notebook 05's small MoE language model at expert parallelism R: ``torchrun
--nproc-per-node=R -m mok.bench lm`` (``python -m mok.bench lm``: R = 1).

Every rank builds the model from the seed (:func:`mok.bench.tiny_lm.build`: rank r holds experts
``r E / R`` .. ``(r + 1) E / R - 1`` of every MoE layer, the rest is replicated) and draws the
same global batch each step ([batch, seq + 1] token ids, seeded); rank r takes sequences ``r B /
R`` .. ``(r + 1) B / R - 1`` (so its tokens follow those of ranks < r, the order
``MoKConfig(row_order="source")`` keeps). A step:

* forward and backward of the local loss ``L_r`` (mean cross-entropy over the rank's tokens);
  mok's backward gives each rank the gradient of its experts over every rank's rows, i.e. of
  ``sum_r L_r``;
* gradients of the global loss ``L = sum_r L_r / R`` (the mean over all tokens, as one rank over
  the whole batch): the replicated Parameters' gradients all-reduced (sum, in fp32) and divided
  by R, the experts' divided by R without communication;
* the same AdamW step (weight decay 0) on every rank, so the replicated Parameters stay equal
  (checked bitwise at the end).

Each step's global loss (the all-reduced local losses / R) is a row of the CSV (rank 0). On CUDA
the model is bf16 and the MoE layers run mok's kernels with ``MoKConfig(dispatch_mode="pull",
row_order="source")``, with which the layer is bitwise the same at every EP size; the loss curves
of EP R and EP1 still differ slightly, since the replicated Parameters' gradients are summed over
ranks (a different summation order than one GEMM over the whole batch). On CPU (``--device cpu``,
or no GPU) the model is fp32 and the layers are mok's reference (``reference.ep`` over a gloo
group at R > 1). ``MOK_SHARED_GPU=1`` runs the R ranks on one GPU (:mod:`mok.ranks`).
"""

from __future__ import annotations

import argparse
import gc
import os
import time

import torch
import torch.distributed as dist

from mok.bench.common import OneGpuRecorder, close_dist, is_rank0, provenance
from mok.bench.tiny_lm import (
    SIZES,
    LMShape,
    LMTraining,
    batches,
    build,
    chain_entropy,
    lm_loss,
    markov_chain,
)
from mok.ranks import init_ranks, shared_gpu
from mok.spec.config import MoKConfig
from mok.spec.rows import PROVENANCE_COLUMNS, git_sha
from mok.workspace import clear_workspaces

__all__ = ["LossRecorder", "build_parser", "main", "mok_config"]


class LossRecorder(OneGpuRecorder):
    """The rows of the lm CSV (one per step); rank 0 prints one row in ``every``."""

    times = ()

    def __init__(self, path: str | None, meta: dict, steps: int):
        super().__init__(path, meta)
        self.steps, self.every, self.t0 = steps, max(1, steps // 10), time.perf_counter()

    def add(self, **row) -> None:
        self.rows.append({**row, **self.meta})
        last = row["step"] + 1 == self.steps
        if is_rank0() and (row["step"] % self.every == 0 or last):
            print(self.describe(row), flush=True)

    def describe(self, row: dict) -> str:
        s = time.perf_counter() - self.t0
        return f"step {row['step'] + 1:>5}/{self.steps} loss {row['loss']:.4f} ({s:.1f} s)"


def mok_config(ranks: int, tokens_per_rank: int, shared: bool) -> MoKConfig:
    """The layer's config on CUDA: pull dispatch, push combine, rows in source order (bitwise the
    same layer at every EP size); receive buffers for every rank's rows on one rank (no routing
    can overflow them); a long wait bound where ranks share a GPU (they time-slice)."""
    return MoKConfig(
        dispatch_mode="pull", combine_mode="push", row_order="source",
        capacity_factor=float(ranks), max_tokens=tokens_per_rank,
        wait_timeout_ms=120_000.0 if shared else 10_000.0,
    )  # fmt: skip


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m mok.bench lm",
        description="Train notebook 05's MoE language model at EP = the torchrun world size; "
        "one CSV row per step (the global loss).",
    )
    ap.add_argument("--size", choices=sorted(SIZES), default=None,
                    help="model and batch (default: gpu on CUDA, tiny on CPU)")  # fmt: skip
    ap.add_argument("--steps", type=int, default=None, help="default: the size's (150 / 300)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto",
                    help="auto: cuda where a GPU is visible (bf16, mok's kernels), else cpu "
                    "(fp32, the reference layer over gloo)")  # fmt: skip
    ap.add_argument("--csv", default=None, help="write the per-step losses here (rank 0)")
    return ap


def _cuda_wanted(device: str) -> bool:
    return device == "cuda" or (device == "auto" and torch.cuda.is_available())


def _check(ap, shape: LMShape, run: LMTraining, ranks: int, steps: int) -> None:
    """Refusals before the process group starts (every rank exits with the message)."""
    if steps < 1:
        ap.error(f"--steps must be >= 1 (found {steps})")
    if run.batch % ranks or shape.num_experts % ranks:
        ap.error(
            f"EP{ranks} needs the batch ({run.batch} sequences) and the experts "
            f"({shape.num_experts}) to split evenly over {ranks} ranks; use a world size that "
            "divides both"
        )


def _all_reduce_sum(t: torch.Tensor) -> torch.Tensor:
    """``t`` summed over the ranks (through the host on a gloo group, which may hold CUDA
    tensors only at some torch builds)."""
    if dist.get_world_size() == 1:
        return t
    if t.is_cuda and dist.get_backend() == "gloo":
        host = t.cpu()
        dist.all_reduce(host)
        return host.to(t.device)
    dist.all_reduce(t)
    return t


def average_gradients(replicated: list, experts: list, ranks: int) -> None:
    """Gradients of the mean of the ranks' local losses: the replicated Parameters' gradients
    summed over ranks (one fp32 all-reduce) / R, the experts' (already summed over every rank's
    rows by mok's backward) / R."""
    if ranks == 1:
        return
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in replicated]
    flat = _all_reduce_sum(torch.cat([g.float().reshape(-1) for g in grads])) / ranks
    for p, piece in zip(replicated, flat.split([g.numel() for g in grads]), strict=True):
        p.grad = piece.view_as(p).to(p.dtype)
    for p in experts:
        if p.grad is not None:
            p.grad.div_(ranks)


def replicas_equal(params: list) -> bool:
    """Whether every rank holds bitwise the same ``params`` (max and min over ranks agree)."""
    if dist.get_world_size() == 1:
        return True
    flat = torch.cat([p.detach().float().reshape(-1) for p in params])
    hi, lo = _all_reduce_max(flat.clone()), -_all_reduce_max(-flat)
    return bool(torch.equal(hi, lo))


def _all_reduce_max(t: torch.Tensor) -> torch.Tensor:
    host = t.cpu() if dist.get_backend() == "gloo" else t
    dist.all_reduce(host, op=dist.ReduceOp.MAX)
    return host


def _meta(dev: torch.device) -> dict:
    """The provenance columns (:func:`mok.bench.common.provenance`; on CPU ``gpu`` is ``cpu``)."""
    if dev.type == "cuda":
        return provenance()
    cpu = {"gpu": "cpu", "num_ranks": dist.get_world_size(), "torch": torch.__version__,
           "cuda": torch.version.cuda, "git_sha": git_sha()}  # fmt: skip
    return {c: cpu[c] for c in PROVENANCE_COLUMNS if c in cpu}


def main(argv: list[str]) -> int:
    ap = build_parser()
    args = ap.parse_args(argv)
    size = args.size or ("gpu" if _cuda_wanted(args.device) else "tiny")
    shape, run = SIZES[size]
    steps = run.steps if args.steps is None else args.steps
    _check(ap, shape, run, int(os.environ.get("WORLD_SIZE", "1")), steps)
    dev = init_ranks("mok.bench lm", device=args.device)
    ranks, rank = dist.get_world_size(), dist.get_rank()
    cuda = dev.type == "cuda"
    shared = cuda and shared_gpu()
    if not cuda:
        torch.set_num_threads(1)  # a small model, R processes: threads only contend
    per_rank = run.batch // ranks
    config = mok_config(ranks, per_rank * run.seq, shared) if cuda else None
    dtype = torch.bfloat16 if cuda else torch.float32
    trans = markov_chain(shape.vocab, args.seed)
    floor = chain_entropy(trans)
    if is_rank0():
        where = f"{ranks} ranks on one GPU" if shared and ranks > 1 else str(dev)
        print(
            f"mok.bench lm: size {size}, EP{ranks} ({where}, {str(dtype)[6:]}), {steps} steps of "
            f"{run.tokens} tokens, seed {args.seed}; loss floor {floor:.3f} nats",
            flush=True,
        )
        if shared and ranks > 1:
            print(
                "ranks share one GPU (MOK_SHARED_GPU=1): their kernels time-slice, so step times "
                "say nothing about NVLink; this run reports losses only",
                flush=True,
            )
    group = dist.group.WORLD if ranks > 1 else None
    model = build(shape, seed=args.seed, device=dev, dtype=dtype, group=group, config=config)
    replicated, experts = model.replicated_parameters(), model.expert_parameters()
    opt = torch.optim.AdamW(model.parameters(), lr=run.lr, weight_decay=0.0)
    data = batches(trans, run.batch, run.seq, args.seed + 2)
    mine = slice(rank * per_rank, (rank + 1) * per_rank)
    run_cols = dict(
        size=size, ep=ranks, device=dev.type, shared_gpu=int(shared), dtype=str(dtype)[6:],
        layer="mok" if cuda else "reference", dispatch_mode=config.dispatch_mode if cuda else "-",
        row_order=config.row_order if cuda else "-", seed=args.seed, lr=run.lr, batch=run.batch,
        seq=run.seq, tokens_per_step=run.tokens, vocab=shape.vocab, hidden=shape.hidden,
        num_experts=shape.num_experts, num_topk=shape.num_topk, intermediate=shape.intermediate,
        shared_intermediate=shape.shared_intermediate, blocks=shape.blocks,
        loss_floor=round(floor, 6),
    )  # fmt: skip
    rec = LossRecorder(args.csv, {**run_cols, **_meta(dev)}, steps)
    for step in range(steps):
        seq = next(data)[mine].to(dev)
        loss = lm_loss(model, seq)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        average_gradients(replicated, experts, ranks)
        opt.step()
        total = _all_reduce_sum(loss.detach().double().reshape(1))
        rec.add(step=step, loss=float(total) / ranks)
    same = replicas_equal(replicated)
    if is_rank0():
        print(f"replicated parameters bitwise equal on all {ranks} ranks: {same}", flush=True)
    rec.write()
    # NOTE: nothing may keep the process group alive past its destruction. A gloo group whose
    # last reference goes only at interpreter exit can abort the process there (its worker
    # threads' tensors reach for the GIL while Python finalizes: "terminate called without an
    # active exception", seen once in CI after a complete run). The model and mok's workspaces
    # hold the group.
    del model, opt, replicated, experts, loss, seq
    if cuda:
        clear_workspaces()
    gc.collect()
    close_dist()
    return 0 if same else 1
