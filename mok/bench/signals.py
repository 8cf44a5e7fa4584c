"""``torchrun --nproc-per-node=R -m mok.bench signals``: the flag operations one call of each
layer path sends between ranks, counted on the signal pad, and the time of a call.

The signal pad of rank d holds, for every signal kind and peer p, either the number of atomic
adds p made on d (the added kinds) or the last epoch p stored (the stored kinds,
:data:`mok._ext.STORED_SIGNALS`). For each path the pad is read before and after ``--calls``
calls: an added kind's increase is counted as that many flag operations, a stored kind that
moved as one store per call (its value says that it came, not how often: the kernels store it
once per call by construction, see csrc/common/waits.cuh). Per rank and call the command
reports the flags received from other ranks (each one crossed NVLink) and from itself, and the
number of signal kinds that every rank raised on every rank (all-rank handshakes, each a
round of R flags into every rank followed by a wait for the last of them). The counts are a
property of the code, the same on ranks that share one GPU as on R GPUs; the times on shared
ranks are the time-sliced GPU's and say nothing about NVLink (the output and the CSV say so).

Paths: the unfused forward (pull/push, dedup/push), the fused forward, and one training step
(the fused forward, saved activations, the backward's transfers inside its launch). Tiny rows;
``--experts-per-rank`` experts on each rank, so EP64 runs on one GPU.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys

import torch
import torch.distributed as dist

from mok import _ext
from mok.bench.common import (
    OneGpuRecorder,
    close_dist,
    draw_routing,
    init_dist,
    max_over_ranks,
    provenance,
    time_cuda_local,
)
from mok.ranks import shared_gpu
from mok.spec.rows import bench_routing_seed

__all__ = [
    "PATHS",
    "FlagCount",
    "SignalRecorder",
    "build_parser",
    "count_flags",
    "flags_per_peer",
    "main",
]

# name -> (MoKConfig fields, fused forward, training step with the backward in its launch)
PATHS: dict[str, tuple[dict, bool, bool]] = {
    "pull/push": (dict(dispatch_mode="pull", combine_mode="push"), False, False),
    "dedup/push": (dict(dispatch_mode="dedup_pull", combine_mode="push"), False, False),
    "fused": (dict(dispatch_mode="pull", combine_mode="push"), True, False),
    "train in-launch": (dict(dispatch_mode="pull", combine_mode="push"), True, True),
}


def flags_per_peer(path: str, comm_blocks: int, x_consumed_per_block: bool = False) -> int:
    """The flags one call of ``path`` sends from each rank to each rank, by construction:
    the unfused forward's five handshakes (routing, x ready, slots free; x consumed and slots
    filled stored once per call by the last block); the fused forward's five (x consumed stored
    once per call by its last communication block); the training step adds the backward's
    schedule build and its three (staged, slots free, slots filled).
    ``x_consumed_per_block``: the fused layer before 2026-12-07 (git 99fe444 and earlier), whose
    ``comm_blocks`` communication blocks each raised x consumed (4 + ``comm_blocks``)."""
    _, fused, train = PATHS[path]
    forward = 4 + comm_blocks if fused and x_consumed_per_block else 5
    return forward + (4 if train else 0)


@dataclasses.dataclass(frozen=True)
class FlagCount:
    """Flags one rank received per call: from the other ranks (``remote``, each crossed the
    link), from itself (``own``), and the kinds raised by every rank (``handshakes``, named in
    ``kinds``)."""

    remote: float
    own: float
    handshakes: int
    kinds: tuple[str, ...] = ()


def count_flags(before: torch.Tensor, after: torch.Tensor, rank: int, ranks: int,
                calls: int) -> FlagCount:  # fmt: skip
    """Per-call flags from two snapshots of one rank's signal pad (int64 [kinds, max ranks])."""
    delta = (after - before)[:, :ranks].to(torch.float64)
    stored = torch.zeros(delta.shape[0], dtype=torch.bool)
    stored[list(_ext.STORED_SIGNALS)] = True
    moved = delta != 0
    if (delta < 0).any():
        raise RuntimeError("mok.bench signals: a signal of the pad went backwards")
    per_call = torch.where(stored[:, None], moved.to(torch.float64), delta / calls)
    own = float(per_call[:, rank].sum())
    remote = float(per_call.sum()) - own
    every = moved.all(dim=1).tolist()
    kinds = tuple(n for n, e in zip(_ext.SIGNALS, every, strict=False) if e)
    return FlagCount(remote, own, len(kinds), kinds)


class SignalRecorder(OneGpuRecorder):
    """Rows of ``mok.bench signals``: one per (EP size, path)."""

    times = ("median_us",)

    def describe(self, row: dict) -> str:
        return (
            f"EP{row['ep']:<3} {row['path']:<16} flags per call from peers "
            f"{row['remote_flags']:>7.1f} (max over ranks; by construction {row['expected']}), "
            f"own {row['own_flags']:>4.1f}, "
            f"all-rank handshakes {row['handshakes']:>2}, {row['median_us']:>10.1f} us per call"
        )


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="mok.bench signals", description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--paths", default=",".join(PATHS), help="comma-separated, of: " + ", ".join(PATHS)
    )
    ap.add_argument("--tokens", type=int, default=16, help="tokens per rank")
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--intermediate", type=int, default=256)
    ap.add_argument("--topk", type=int, default=4)
    ap.add_argument("--experts-per-rank", type=int, default=None,
                    help="default: the fewest that give every token its top-k experts")  # fmt: skip
    ap.add_argument("--calls", type=int, default=8, help="counted and timed calls per path")
    ap.add_argument("--comm-sms", type=int, default=2, help="communication SMs of each rank")
    ap.add_argument("--timeout-ms", type=float, default=None,
                    help="every wait's bound (default 60 s per 8 ranks: shared-GPU ranks "
                    "time-slice the GPU, so a hop waits for the peers' slices)")  # fmt: skip
    ap.add_argument("--csv", default=None, help="rows of every path (rank 0 writes)")
    return ap


def _snapshot() -> torch.Tensor:
    """The sum of this rank's signal pads over mok's workspaces (int64 [kinds, max ranks])."""
    from mok.workspace import cached_workspaces

    shape = (_ext.NUM_SIGNALS, _ext.MAX_RANKS)
    total = torch.zeros(shape, dtype=torch.int64)
    for ws in cached_workspaces():
        total += ws.sym_view("signals", torch.int64, shape).cpu()
    return total


def _step(args, path: str, dev):
    """One call of ``path`` on this rank's tokens (a closure over fixed operands)."""
    import mok
    import mok.autograd as ma
    from mok import functional as mf
    from mok.spec.workload import ModelShape
    from reference.weights import MoEWeights

    rank, ranks = dist.get_rank(), dist.get_world_size()
    experts = (args.experts_per_rank or -(-args.topk // ranks)) * ranks
    shape = ModelShape("signals", experts, args.hidden, args.intermediate, args.topk)
    w = MoEWeights.random(shape, seed=rank, dtype=torch.bfloat16, device=dev).shard(rank, ranks)
    idx, tw, _ = draw_routing(args.tokens, experts, args.topk, "uniform")
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(args.tokens, args.hidden, generator=g).to(torch.bfloat16).to(dev)
    fields, fused, train = PATHS[path]
    bound = args.timeout_ms or 60_000.0 * max(1, ranks // 8)
    cfg = mok.MoKConfig(num_comm_sms=args.comm_sms, wait_timeout_ms=bound, **fields)

    def forward():
        with torch.no_grad():
            mf.moe(x, idx, tw, w, experts, cfg, None, fused, True)

    if train:  # leaves once: the gradients accumulate across calls, which the count ignores
        for t in vars(w).values():
            if t is not None:
                t.requires_grad_(True)
        x.requires_grad_(True)

    def step():
        out = mf.moe(x, idx, tw, w, experts, cfg, None, fused, False)
        ma.TRANSFERS_IN_LAUNCH = True
        try:
            out.backward(torch.ones_like(out))
        finally:
            ma.TRANSFERS_IN_LAUNCH = False

    return step if train else forward


def _measure(args, path: str, dev) -> tuple[FlagCount, float]:
    import mok

    rank, ranks = dist.get_rank(), dist.get_world_size()
    fn = _step(args, path, dev)
    fn()  # the workspaces exist from here on
    torch.cuda.synchronize()
    dist.barrier()
    before = _snapshot()
    # NOTE: every rank's snapshot before any rank's first counted call, whose first signals
    # would otherwise land in a slower rank's "before" (seen from EP16 up: a rank short of a
    # few flags over the calls)
    dist.barrier()
    us = time_cuda_local(fn, args.calls, 0)  # ends with a device synchronise
    dist.barrier()
    count = count_flags(before, _snapshot(), rank, ranks, args.calls)
    mok.clear_workspaces()
    return count, us


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    paths = [p for p in args.paths.split(",") if p]
    bad = [p for p in paths if p not in PATHS]
    if bad:
        print(f"mok.bench signals: unknown paths {bad}; known: {', '.join(PATHS)}", file=sys.stderr)
        return 2
    dev = init_dist("mok.bench signals")
    rank, ranks = dist.get_rank(), dist.get_world_size()
    where = (
        "ranks sharing one GPU (times are the time-sliced GPU's)"
        if shared_gpu()
        else "one GPU per rank"
    )
    rec = SignalRecorder(args.csv, provenance())
    if rank == 0:
        print(f"mok.bench signals: EP{ranks} on {where}, {args.tokens} tokens/rank", flush=True)
    for path in paths:
        count, us = _measure(args, path, dev)
        remote, own, hs, low, us = max_over_ranks(
            [count.remote, count.own, count.handshakes, -count.remote, us]
        )
        want = flags_per_peer(path, args.comm_sms)
        rec.add(ep=ranks, path=path, expected=want * (ranks - 1), remote_flags=remote,
                remote_flags_min=-low, own_flags=own,
                handshakes=int(hs), kinds="+".join(count.kinds), median_us=us,
                shared_gpu=int(shared_gpu()), tokens=args.tokens, calls=args.calls,
                routing_seed=bench_routing_seed(args.tokens))  # fmt: skip
    rec.write()
    return close_dist()
