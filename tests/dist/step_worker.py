"""Times training steps of a small layer at EP R: how fast shared-GPU ranks run under each way of
sharing the GPU (time-slicing, MPS, an SM budget), the measurement behind the choice in
docs/backward.md ("Several ranks on one GPU"). Not an NVLink benchmark.

``torchrun --nproc-per-node=R tests/dist/step_worker.py [--num-sms N] [--steps S]``; prints
``STEP-TIMING ep=R num_sms=N median_ms=... p90_ms=...`` on rank 0 (the max over ranks of each
step's wall time, after warm-up) and ``MOK-STEP-OK rank=r``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch
import torch.distributed as dist

import mok
import mok.sms
from mok import functional as mf
from mok.ranks import init_ranks
from mok.spec.workload import ModelShape, make_routing
from reference.weights import MoEWeights


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--num-sms", type=int, default=0)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--timeout-ms", type=float, default=20_000.0)
    args = ap.parse_args()
    dev = init_ranks("step_worker.py")
    rank, R = dist.get_rank(), dist.get_world_size()
    shape = ModelShape("step", 64, 1024, 512, 8, shared_intermediate=512)
    n = args.tokens
    w = MoEWeights.random(shape, seed=1, dtype=torch.bfloat16, device=dev).shard(rank, R)
    w = MoEWeights(**{k: None if t is None else t.clone().requires_grad_(True)
                      for k, t in vars(w).items()})  # fmt: skip
    t = make_routing(n, shape.num_experts, shape.num_topk, R, "uniform", seed=2)
    idx = torch.from_numpy(t.topk_idx)[rank * n : (rank + 1) * n].to(dev)
    tw = torch.from_numpy(t.topk_weights)[rank * n : (rank + 1) * n].to(dev)
    x = torch.randn(n, shape.hidden, device=dev).to(torch.bfloat16).requires_grad_(True)
    cfg = mok.MoKConfig(dispatch_mode="pull", num_comm_sms=8, num_sms=args.num_sms,
                        wait_timeout_ms=args.timeout_ms)  # fmt: skip
    times = []
    for step in range(args.steps + 3):
        dist.barrier()
        t0 = time.perf_counter()
        out = mf.moe(x, idx, tw, w, shape.num_experts, cfg)
        out.float().square().mean().backward()
        torch.cuda.synchronize(dev)
        mok.check()
        dt = torch.tensor([time.perf_counter() - t0])
        dist.all_reduce(dt, op=dist.ReduceOp.MAX)
        if step >= 3:
            times.append(dt.item() * 1e3)
    if rank == 0:
        q = statistics.quantiles(times, n=10)
        print(
            f"STEP-TIMING ep={R} num_sms={args.num_sms} median_ms={statistics.median(times):.2f} "
            f"p90_ms={q[-1]:.2f} sms_seen={mok.sms.device_sms(dev)}",
            flush=True,
        )
    dist.barrier()
    print(f"MOK-STEP-OK rank={rank}", flush=True)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
