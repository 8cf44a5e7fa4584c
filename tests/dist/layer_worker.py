"""Worker of the fused-layer GPU tests; launched by tests/test_mok_layer_gpu.py through torchrun.

Every rank builds the whole problem (all ranks' tokens and routing, all experts' weights, seeded),
runs the fused layer (:func:`mok.functional.forward`) on its slice and checks it against the
reference of the whole problem: within the BF16 rule (docs/conventions.md; fp64 oracle, bf16 ref),
bitwise identical across repeats, and bitwise identical across configurations that keep the
reduction order (communication SMs, minibatch, ring size, pull vs dedup pull). Prints
``MOK-LAYER-OK rank=R``.

``--timeout``: rank 1 never enters the layer; rank 0 must raise MoKTimeoutError in time.
``--quick``: the first two shapes only.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch
import torch.distributed as dist

import mok
from mok import functional as mf
from mok.ranks import init_ranks, shared_gpu
from mok.spec.workload import ModelShape, make_routing
from reference.moe import moe_forward as ref_moe_forward
from reference.weights import MoEWeights
from tests import tolerances as tol

SEED = 2718
T0 = time.monotonic()

# (hidden, intermediate, experts, top-k, tokens per rank, shared intermediate, routing)
SHAPES = [
    (2048, 768, 64, 8, 1000, 768, "uniform"),
    (4096, 1536, 32, 6, 777, 0, "hot:0.5"),
    (7168, 2048, 16, 4, 130, 2048, "uniform"),
    (2048, 768, 384, 10, 300, 0, "zipf:1.2"),
    (2048, 1536, 64, 4, 513, 256, "hot:0.5"),
]
# Configurations that keep the reduction order (so outputs must be bitwise equal).
CONFIGS = [
    dict(dispatch_mode="pull", num_comm_sms=16, minibatch_size=4096),
    dict(dispatch_mode="dedup_pull", num_comm_sms=16, minibatch_size=4096),
    dict(dispatch_mode="pull", num_comm_sms=4, minibatch_size=512),
    # Ring wrap-around: two minibatch slots of 256 rows, far fewer than the routed rows.
    dict(dispatch_mode="pull", num_comm_sms=8, minibatch_size=256, macrobatch_size=512),
    dict(dispatch_mode="dedup_pull", num_comm_sms=32, minibatch_size=128, macrobatch_size=128),
    # Regions padded to 64 rows: blocks straddling two experts run as 64-row sub-tiles with other
    # MMA shapes (m64n64 gate/up), which keep each output element's k order.
    dict(dispatch_mode="dedup_pull", num_comm_sms=16, minibatch_size=4096, row_tile=64),
    dict(
        dispatch_mode="pull", num_comm_sms=8, minibatch_size=256, macrobatch_size=512, row_tile=64
    ),
]


def check(cond: bool, what: str) -> None:
    if not cond:
        raise AssertionError(f"rank {dist.get_rank()}: {what}")


def problem(hidden, inter, E, K, N, shared, skew, dev):
    world = dist.get_world_size()
    shape = ModelShape("layer-test", E, hidden, inter, K, shared_intermediate=shared)
    # Drawn on the GPU: the same weights on every rank, without minutes of CPU randn.
    w = MoEWeights.random(shape, seed=SEED + hidden + E, dtype=torch.float32, device=dev)
    w = w.to(torch.bfloat16)
    t = make_routing(N, E, K, world, skew, seed=SEED + K + N)
    g = torch.Generator().manual_seed(SEED + N)
    x = torch.randn(world * N, hidden, generator=g).to(torch.bfloat16)
    return shape, w, x, torch.from_numpy(t.topk_idx), torch.from_numpy(t.topk_weights)


def local_weights(w: MoEWeights, dev) -> MoEWeights:
    lw = w.shard(dist.get_rank(), dist.get_world_size())
    return MoEWeights(*(None if v is None else v.to(dev).contiguous() for v in vars(lw).values()))


def shape_case(case, dev, configs, repeats):
    rank, world = dist.get_rank(), dist.get_world_size()
    hidden, inter, E, K, N, shared, skew = case
    tag = f"[H={hidden} I={inter} E={E} K={K} N={N} Is={shared} {skew}]"
    t0 = time.monotonic()
    shape, w, x, idx, tw = problem(*case, dev)
    sl = slice(rank * N, (rank + 1) * N)
    # The references run on the GPU, where the weights are (fp64 and fp32 matmuls, TF32 off):
    # same arithmetic as on the CPU, seconds instead of minutes at the large shapes.
    xd, idxd, twd = x.to(dev), idx.to(dev), tw.to(dev)
    # NOTE: ranks sharing one GPU take turns (the fp64 temporaries of eight ranks at once
    # overflow an 80 GB GPU); with a GPU each, every rank computes at once.
    for turn in range(world if shared_gpu() else 1):
        if turn == rank or not shared_gpu():
            oracle = ref_moe_forward(
                xd.double(), idxd, twd.double(), w.to(torch.float64), torch.float64
            )
            ref_b = ref_moe_forward(xd, idxd, twd, w, torch.bfloat16)
            oracle, ref_b = oracle.cpu(), ref_b.cpu()
            torch.cuda.empty_cache()
        if shared_gpu():
            dist.barrier()
    t_ref = time.monotonic() - t0  # problem and references
    lw = local_weights(w, dev)
    xs, idxs, tws = xd[sl], idxd[sl], twd[sl]
    first = None
    for i, c in enumerate(configs):
        cfg = mok.MoKConfig(**c, wait_timeout_ms=10_000.0)
        ws = mok.get_workspace(N, hidden, K, E, torch.bfloat16, cfg, device=dev)
        sched = mf.build_schedule(idxs, tws, ws)
        out = mf.forward(xs, sched, lw)
        ws.check()
        out = out.cpu()
        if first is None:
            tol.assert_bf16_rule(out, ref_b[sl], oracle[sl])
            err = tol.max_abs_err(out, oracle[sl])
            ref_err = tol.max_abs_err(ref_b[sl], oracle[sl])
            print(f"rank {rank}: {tag} err {err:.3e} (bf16 reference {ref_err:.3e})", flush=True)
            first = out
            for r in range(repeats):
                again = mf.forward(xs, sched, lw).cpu()
                check(torch.equal(again, first), f"{tag} repeat {r} differs")
        else:
            check(torch.equal(out, first), f"{tag} config {c} differs from {configs[0]}")
    # The unfused path (communication kernels + torch grouped GEMM) agrees within the rule too.
    cfg = mok.MoKConfig(dispatch_mode="pull", num_comm_sms=16)
    ref_path = mf.moe_forward(xs, idxs, tws, lw, E, cfg).cpu()
    tol.assert_bf16_rule(ref_path, ref_b[sl], oracle[sl])
    t_all = time.monotonic() - t0
    print(
        f"rank {rank}: {tag} ok ({len(configs)} configs, ref {t_ref:.1f}s of {t_all:.1f}s)",
        flush=True,
    )
    mok.clear_workspaces()


def error_cases(dev):
    N, H, K, E = 256, 2048, 4, 16 * dist.get_world_size()
    shape = ModelShape("err", E, H, 768, K, shared_intermediate=0)
    w = local_weights(MoEWeights.random(shape, seed=1).to(torch.bfloat16), dev)
    idx = torch.stack([torch.randperm(E)[:K] for _ in range(N)]).to(dev)
    tw = torch.full((N, K), 0.25, device=dev)
    x = torch.randn(N, H, device=dev).to(torch.bfloat16)

    def expect(fn, err, msg):
        try:
            fn()
            check(False, f"no error for {msg}")
        except err as e:
            check(msg in str(e), f"{msg!r} not in {e}")

    cfg = mok.MoKConfig(combine_mode="pull", dispatch_mode="pull", num_comm_sms=8)
    ws = mok.get_workspace(N, H, K, E, torch.bfloat16, cfg, device=dev)
    s = mf.build_schedule(idx, tw, ws)
    expect(lambda: mf.forward(x, s, w), mok.MoKUnsupportedError, "combine_mode push")
    cfg = mok.MoKConfig(dispatch_mode="pull", num_comm_sms=8)
    ws = mok.get_workspace(N, H, K, E, torch.bfloat16, cfg, device=dev)
    s = mf.build_schedule(idx, tw, ws)
    expect(lambda: mf.forward(x.float(), s, w), mok.MoKInputError, "x must be bfloat16")
    bad = MoEWeights(
        w.w_gate[:, :700].contiguous(),
        w.w_up[:, :700].contiguous(),
        w.w_down[:, :, :700].contiguous(),
    )
    expect(lambda: mf.forward(x, s, bad), mok.MoKUnsupportedError, "intermediate % 128 == 0")
    for c, msg in (
        (dict(row_tile=32, minibatch_size=4096), "row_tile in (64, 128)"),
        (dict(row_tile=64, minibatch_size=192), "minibatch_size % 128 == 0"),
    ):
        cfg = mok.MoKConfig(dispatch_mode="pull", num_comm_sms=8, **c)
        ws = mok.get_workspace(N, H, K, E, torch.bfloat16, cfg, device=dev)
        s = mf.build_schedule(idx, tw, ws)
        expect(lambda: mf.forward(x, s, w), mok.MoKUnsupportedError, msg)
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    cfg = mok.MoKConfig(dispatch_mode="pull", num_comm_sms=sms)
    ws = mok.get_workspace(N, H, K, E, torch.bfloat16, cfg, device=dev)
    s = mf.build_schedule(idx, tw, ws)
    expect(lambda: mf.forward(x, s, w), mok.MoKUnsupportedError, "num_comm_sms")
    mok.clear_workspaces()


def timeout_case(dev):
    rank = dist.get_rank()
    N, H, K, E = 256, 2048, 4, 32
    shape = ModelShape("timeout", E, H, 768, K)
    w = local_weights(MoEWeights.random(shape, seed=1).to(torch.bfloat16), dev)
    cfg = mok.MoKConfig(dispatch_mode="pull", num_comm_sms=8, wait_timeout_ms=1000.0)
    ws = mok.get_workspace(N, H, K, E, torch.bfloat16, cfg, device=dev)
    dist.barrier()
    if rank == 0:
        t0 = time.monotonic()
        idx = torch.arange(K, device=dev).repeat(N, 1)
        tw = torch.full((N, K), 0.25, device=dev)
        s = mf.build_schedule(idx, tw, ws)
        mf.forward(torch.zeros(N, H, dtype=torch.bfloat16, device=dev), s, w)
        try:
            ws.check()
            check(False, "no timeout raised")
        except mok.MoKTimeoutError as e:
            dt = time.monotonic() - t0
            check(e.peer == 1, str(e))
            check(dt < 1.0 + 5.0, f"timeout took {dt:.1f}s")
            print(f"rank 0 raised after {dt:.2f}s: {e}", flush=True)
    dist.barrier()


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--timeout", action="store_true")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--repeats", type=int, default=20)
    args = ap.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False
    dev = init_ranks("layer_worker.py")  # one GPU per rank, or shared (MOK_SHARED_GPU=1)
    rank = dist.get_rank()
    print(f"rank {rank}: initialised {time.monotonic() - T0:.1f}s after start", flush=True)
    if args.timeout:
        timeout_case(dev)
    else:
        for case in SHAPES[: 2 if args.quick else None]:
            shape_case(case, dev, CONFIGS, args.repeats)
        error_cases(dev)
        print(f"rank {rank}: errors ok", flush=True)
    dist.barrier()
    print(f"MOK-LAYER-OK rank={rank} ({time.monotonic() - T0:.1f}s since start)", flush=True)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
