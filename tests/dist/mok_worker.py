"""Worker of the mok GPU tests; launched by tests/test_mok_gpu.py through torchrun (1 or 2 GPUs).

Every rank builds the whole problem (all ranks' routing, tokens and expert outputs, seeded per
rank), runs mok on its own slice and checks it against the reference computed on the CPU for
the whole problem (oracle anchor): the schedule table, the dispatched rows and the combined
outputs bitwise, the full layer within the BF16 rule. Prints ``MOK-WORKER-OK rank=R``.

``--timeout``: rank 1 never enters the layer; rank 0 must raise MoKTimeoutError in time.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import sys
import time

import torch
import torch.distributed as dist

import mok
from mok import functional as mf
from mok.ranks import init_ranks, shared_gpu
from mok.spec.arch import arch_paths
from mok.spec.workload import ModelShape, make_routing
from reference import ep as ref_ep
from reference.moe import combine as ref_combine
from reference.moe import moe_forward as ref_moe_forward
from reference.schedule import build_all_schedules
from reference.weights import MoEWeights
from tests import tolerances as tol

SEED = 4321
# Whether this GPU runs the fused layer and mok's expert kernels (mok.spec.arch; set in main):
# elsewhere the cases that need them are skipped and the communication / unfused ones run.
HOPPER = True
DISPATCH_VARIANTS = [
    ("pull", "tma"),
    ("pull", "vector"),
    ("dedup_pull", "tma"),
    ("dedup_pull", "vector"),
    ("push", "tma"),
]
COMBINE_VARIANTS = [("push", False), ("pull", False), ("push", True), ("pull", True)]
FIELDS = [
    "counts",
    "tokens_per_expert",
    "offsets",
    "src_rank",
    "src_index",
    "dst_rank",
    "dst_index",
    "dedup_src_rank",
    "dedup_src_token",
    "dedup_slot",
    "fanout",
]


def check(cond: bool, what: str) -> None:
    if not cond:
        raise AssertionError(f"rank {dist.get_rank()}: {what}")


def tokens(rank: int, n: int, hidden: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(SEED + rank)
    return torch.randn(n, hidden, generator=g).to(torch.bfloat16)


def expert_outputs(rank: int, rows: int, cap: int, hidden: int) -> torch.Tensor:
    """[cap, hidden] bf16: random rows for the schedule's rows, NaN poison past them."""
    g = torch.Generator().manual_seed(SEED + 1000 + rank)
    y = torch.full((cap, hidden), float("nan"), dtype=torch.bfloat16)
    y[:rows] = torch.randn(rows, hidden, generator=g).to(torch.bfloat16)
    return y


def ref_combines(scheds, ys, idx_all, w_all, shared, rank, K):
    """Reference outputs of `rank` for the plain and the dedup combine (bf16)."""
    s = scheds[rank]
    N, H = s.num_tokens, ys[0].shape[1]
    # Plain: slot (t, k) holds y of row dst_index on dst_rank (pure data movement).
    slots = torch.stack(ys)[s.dst_rank.reshape(-1), s.dst_index.reshape(-1)].float()
    plain = ref_combine(slots.view(N, K, H), w_all[rank], shared, torch.bfloat16)
    # Dedup: every owner's weighted partial per (token, rank), placed in slot t * K + j.
    dslots = torch.zeros(N * K, H)
    for d, sd in enumerate(scheds):
        part = ref_ep._dedup_partials(
            ys[d][: sd.num_rows].float(), sd, ref_ep._row_weights(sd, w_all), torch.bfloat16
        )
        mine = (sd.dedup_src_rank == rank).nonzero().squeeze(1)
        dslots[sd.dedup_slot[mine]] = part[mine]
    filled = torch.zeros(N * K)
    filled[ref_ep._dedup_slots_filled(s, idx_all[rank])] = 1.0
    dedup = ref_combine(dslots.view(N, K, H), filled.view(N, K), shared, torch.bfloat16)
    return plain.to(torch.bfloat16), dedup.to(torch.bfloat16)


def comm_case(hidden, K, E, N, skew, dev, repeat=0):
    rank, world = dist.get_rank(), dist.get_world_size()
    t = make_routing(N, E, K, world, skew, seed=SEED + hidden + K)
    idx_all = torch.from_numpy(t.topk_idx).view(world, N, K)
    w_all = torch.from_numpy(t.topk_weights).view(world, N, K)
    cfg = mok.MoKConfig(num_comm_sms=8, minibatch_size=512, wait_timeout_ms=20000.0)
    ws = mok.get_workspace(N, hidden, K, E, torch.bfloat16, cfg, device=dev)
    tag = f"[H={hidden} K={K} E={E} N={N} {skew}]"

    sched = mf.build_schedule(idx_all[rank].to(dev), w_all[rank].to(dev), ws)
    got = sched.to_host()
    refs = build_all_schedules(idx_all, E, cfg.row_tile)
    want = refs[rank]
    for f in FIELDS:
        check(torch.equal(got[f], getattr(want, f)), f"{tag} schedule.{f} differs")

    xs = [tokens(r, N, hidden) for r in range(world)]
    x_all = torch.cat(xs)
    real = (want.src_rank >= 0).nonzero().squeeze(1)
    expect_rows = x_all[want.src_rank[real] * N + want.src_index[real] // K]
    for mode, engine in DISPATCH_VARIANTS:
        recv = mf.dispatch(xs[rank].to(dev), sched, mode, engine=engine)
        ws.check()
        check(
            torch.equal(recv[real.to(dev)].cpu(), expect_rows),
            f"{tag} dispatch {mode} {engine} rows differ",
        )
    # Dedup dispatch without fan-out (one row per (token, rank)), then the local fan-out.
    D = want.dedup_src_rank.numel()
    expect_dedup = x_all[want.dedup_src_rank * N + want.dedup_src_token]
    for engine in ("tma", "vector"):
        ws.recv_buffer.fill_(float("nan"))
        ws.dedup_buffer.fill_(float("nan"))
        dd = mf.dispatch(xs[rank].to(dev), sched, "dedup_pull", fan_out=False, engine=engine)
        ws.check()
        check(torch.equal(dd[:D].cpu(), expect_dedup), f"{tag} dedup buffer {engine} differs")
        recv = mf.fanout(dd, sched, engine=engine)
        ws.check()
        check(torch.equal(recv[real.to(dev)].cpu(), expect_rows), f"{tag} fanout {engine} differs")
        # Remote rows only (own rows stay in the x buffer), then the fan-out reading them there.
        ws.recv_buffer.fill_(float("nan"))
        ws.dedup_buffer.fill_(float("nan"))
        dd = mf.dispatch(
            xs[rank].to(dev), sched, "dedup_pull", fan_out=False, engine=engine, skip_local=True
        )
        ws.check()
        own = want.dedup_src_rank == rank
        remote = (~own).nonzero().squeeze(1)
        check(
            torch.equal(dd[remote.to(dev)].cpu(), expect_dedup[remote]),
            f"{tag} dedup buffer {engine} skip_local differs",
        )
        check(
            bool(dd[own.nonzero().squeeze(1).to(dev)].isnan().all()),
            f"{tag} dedup buffer {engine} skip_local wrote own rows",
        )
        recv = mf.fanout(dd, sched, engine=engine, skip_local=True)
        ws.check()
        check(
            torch.equal(recv[real.to(dev)].cpu(), expect_rows),
            f"{tag} fanout {engine} skip_local differs",
        )

    ys = [expert_outputs(r, refs[r].num_rows, ws.capacity, hidden) for r in range(world)]
    g = torch.Generator().manual_seed(SEED + 7)
    shared = torch.randn(N * world, hidden, generator=g).to(torch.bfloat16)[
        rank * N : (rank + 1) * N
    ]
    for sh in (None, shared):
        plain, dedup = ref_combines(
            refs, ys, idx_all, w_all, None if sh is None else sh.float(), rank, K
        )
        y = ys[rank].to(dev)
        shd = None if sh is None else sh.to(dev)
        outs = {}
        for mode, dd in COMBINE_VARIANTS:
            outs[mode, dd] = mf.combine(y, sched, mode, shared_y=shd, dedup=dd).cpu()
            ws.check()
            want_out = dedup if dd else plain
            check(torch.equal(outs[mode, dd], want_out), f"{tag} combine {mode} dedup={dd} differs")
        check(torch.equal(outs["push", False], outs["pull", False]), f"{tag} push vs pull")
        # The two steps of the dedup pull combine, the sum run twice on one partials epoch.
        for pe in ("vector", "tma"):
            mf.dedup_partials(y, sched, engine=pe)
            for se in ("gather", "vector", "tma"):
                o = mf.dedup_sum(sched, shd, engine=se, release=se == "tma").cpu()
                ws.check()
                check(torch.equal(o, dedup), f"{tag} dedup_sum {pe}/{se} differs")
        # Phase stamps (diagnostics): each block writes entry <= ready <= done <= exit.
        ws.stamps = torch.zeros(ws.config.num_comm_sms, 4, dtype=torch.int64, device=dev)
        try:
            mf.dedup_sum(sched, shd)
            check(False, "a second releasing dedup_sum of one partials epoch was accepted")
        except mok.MoKInputError as e:
            check("run dedup_partials again" in str(e), str(e))
        mf.dedup_partials(y, sched)
        mf.dedup_sum(sched, shd, engine="tma")
        st, ws.stamps = ws.stamps.cpu(), None
        check(bool((st > 0).all() and (st.diff(dim=1) >= 0).all()), f"{tag} phase stamps {st}")
    for i in range(repeat):
        sched = mf.build_schedule(idx_all[rank].to(dev), w_all[rank].to(dev), ws)
        for mode, engine in DISPATCH_VARIANTS:
            recv = mf.dispatch(xs[rank].to(dev), sched, mode, engine=engine)
            check(torch.equal(recv[real.to(dev)].cpu(), expect_rows), f"{tag} repeat {i} {mode}")
        dd = mf.dispatch(xs[rank].to(dev), sched, "dedup_pull", fan_out=False)
        check(torch.equal(dd[:D].cpu(), expect_dedup), f"{tag} repeat {i} dedup buffer")
        for mode, dd in COMBINE_VARIANTS:
            o = mf.combine(y, sched, mode, shared_y=shd, dedup=dd).cpu()
            check(torch.equal(o, outs[mode, dd]), f"{tag} repeat {i} combine {mode} {dd}")
    ws.check()
    return ws


def layer_case(dev):
    rank, world = dist.get_rank(), dist.get_world_size()
    shape = ModelShape("mok-test", 32, 512, 256, 4, shared_intermediate=256)
    N, E = 300, shape.num_experts
    w64 = MoEWeights.random(shape, seed=SEED, dtype=torch.float64)
    t = make_routing(N, E, shape.num_topk, world, "hot:0.5", seed=SEED)
    idx = torch.from_numpy(t.topk_idx)
    tw = torch.from_numpy(t.topk_weights)
    x64 = torch.cat([tokens(r, N, shape.hidden) for r in range(world)]).double()
    xb, wb = x64.to(torch.bfloat16), w64.to(torch.bfloat16)
    oracle = ref_moe_forward(xb.double(), idx, tw.double(), wb.to(torch.float64), torch.float64)
    ref_b = ref_moe_forward(xb, idx, tw, wb, torch.bfloat16)
    sl = slice(rank * N, (rank + 1) * N)
    lw = wb.shard(rank, world)
    lw = MoEWeights(*(None if v is None else v.to(dev) for v in vars(lw).values()))
    outs = {}
    for dm, cm in (("pull", "push"), ("push", "push"), ("pull", "pull"), ("dedup_pull", "push")):
        cfg = mok.MoKConfig(dispatch_mode=dm, combine_mode=cm, num_comm_sms=16)
        out = mf.moe_forward(xb[sl].to(dev), idx[sl].to(dev), tw[sl].to(dev), lw, E, cfg)
        mok.get_workspace(N, shape.hidden, 4, E, torch.bfloat16, cfg, device=dev).check()
        outs[dm, cm] = out.cpu()
        tol.assert_bf16_rule(outs[dm, cm], ref_b[sl], oracle[sl])
    check(torch.equal(outs["pull", "push"], outs["push", "push"]), "layer: pull vs push dispatch")
    check(torch.equal(outs["pull", "push"], outs["pull", "pull"]), "layer: push vs pull combine")


def error_cases(dev):
    rank = dist.get_rank()
    # Experts 0..K-1 must all live on rank 0 (the capacity case below): >= K experts per rank.
    N, H, K = 200, 256, 4
    R = dist.get_world_size()
    E = max(16, K * R)
    # NOTE: every rank routes every token to experts 0..K-1, all on rank 0, which receives R * N
    # * K rows: a capacity factor of R holds them (the default, 2, overflows from EP3 on).
    cfg = mok.MoKConfig(
        num_comm_sms=4, wait_timeout_ms=5000.0, capacity_factor=float(max(R, 2)), max_tokens=N
    )
    ws = mok.get_workspace(N, H, K, E, torch.bfloat16, cfg, device=dev)
    idx = torch.arange(K, device=dev).repeat(N, 1)
    w = torch.full((N, K), 0.25, device=dev)
    for bad, msg in (
        (lambda: mf.build_schedule(idx[:, :2], w, ws), "topk_idx must have shape"),
        (lambda: mf.build_schedule(idx.float(), w, ws), "topk_idx must be int32, int64"),
        (lambda: mf.build_schedule(idx.cpu(), w, ws), "is on cpu"),
    ):
        try:
            bad()
            check(False, f"no error for {msg}")
        except mok.MoKInputError as e:
            check(msg in str(e), str(e))
    s = mf.build_schedule(idx, w, ws)
    try:
        mf.dispatch(torch.zeros(N, H, device=dev), s)
        check(False, "fp32 x accepted")
    except mok.MoKInputError as e:
        check("x must be bfloat16" in str(e), str(e))
    # Device-side routing check: rank 0 routes token 5 to expert E; every rank raises.
    bad_idx = idx.clone()
    if rank == 0:
        bad_idx[5, 2] = E
    good = s.to_host()
    mf.build_schedule(bad_idx, w, ws)
    try:
        ws.check()
        check(False, "out-of-range expert not detected")
    except mok.MoKInputError as e:
        check(
            f"rank 0 routes token 5 (k=2) to expert {E} outside [0, num_experts={E})" in str(e),
            str(e),
        )
        check("has recovered" in str(e), str(e))
    # Every rank recovered on its own: the next good call works everywhere.
    again = mf.build_schedule(idx, w, ws).to_host()
    for f in FIELDS:
        check(torch.equal(again[f], good[f]), f"schedule.{f} after recovery differs")
    # More tokens than the workspace holds on rank 0 only: every rank raises, then recovers.
    big = N + 1 if rank == 0 else N
    try:
        mf.build_schedule(idx[:1].repeat(big, 1), w[:1].repeat(big, 1), ws)
        ws.check()
        check(False, "too many tokens not detected")
    except mok.MoKCapacityError as e:
        check(f"rank 0 passed {N + 1} tokens but the workspace holds at most {N}" in str(e), str(e))
    again = mf.build_schedule(idx, w, ws).to_host()
    check(torch.equal(again["src_index"], good["src_index"]), "schedule after too many tokens")
    # Capacity: every token to experts 0..K-1 overflows a small receive buffer on rank 0 (row
    # tile 16 keeps the padding allowance small); every rank raises the same error.
    cfg2 = mok.MoKConfig(
        num_comm_sms=4, capacity_factor=0.1, row_tile=16, wait_timeout_ms=5000.0, max_tokens=N
    )
    ws2 = mok.get_workspace(N, H, K, E, torch.bfloat16, cfg2, device=dev)
    mf.build_schedule(idx, w, ws2)
    try:
        ws2.check()
        check(False, "capacity overflow not detected")
    except mok.MoKCapacityError as e:
        check("rank 0 must receive" in str(e) and "never drops tokens" in str(e), str(e))
        # the knob and by how much: the factor it names holds the rows it names
        m = re.search(r"must receive (\d+) rows .* to at least ([0-9.]+) for this", str(e))
        check(m is not None, str(e))
        enough = dataclasses.replace(cfg2, capacity_factor=float(m.group(2)))
        rows = enough.capacity_rows(N, K, E // R, R)
        check(rows >= int(m.group(1)), f"{m.group(2)} gives {rows} rows: {e}")


def varying_case(dev):
    """Ranks pass different token counts (zero on one rank at some steps) to one workspace: each
    rank's output meets the BF16 rule against the reference of its own tokens, and the fused
    layer's equals, bitwise, its rows of the call where every rank passes all tokens (the
    unfused path's torch GEMMs pick kernels by row count)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    mok.clear_workspaces()
    shape = ModelShape("mok-vary", 32, 512, 256, 4, shared_intermediate=256)
    N, E = 600, shape.num_experts
    w = MoEWeights.random(shape, seed=SEED, dtype=torch.float32, device=dev).to(torch.bfloat16)
    t = make_routing(N, E, shape.num_topk, world, "hot:0.5", seed=SEED + 5)
    sl = slice(rank * N, (rank + 1) * N)
    idx = torch.from_numpy(t.topk_idx)[sl].to(dev)
    tw = torch.from_numpy(t.topk_weights)[sl].to(dev)
    x = tokens(rank, N, shape.hidden).to(dev)
    lw = local_weights(w, dev)
    steps = [[N] * world, [0] + [N] * (world - 1), [N] + [0] * (world - 1), [0] * world]
    steps += [[(37 * (s + 1) * (r + 2)) % (N + 1) for r in range(world)] for s in range(8)]
    for fused, dm, cm in (
        (True, "dedup_pull", "push"),
        (True, "pull", "push"),
        (False, "pull", "pull"),
        (False, "dedup_pull", "push"),
    ):
        if fused and not HOPPER:
            continue
        cfg = mok.MoKConfig(
            dispatch_mode=dm,
            combine_mode=cm,
            num_comm_sms=8,
            max_tokens=N,
            minibatch_size=256,
            wait_timeout_ms=20000.0,
        )
        full = None
        for counts in steps:
            n = counts[rank]
            out = mf.moe_forward(x[:n], idx[:n], tw[:n], lw, E, cfg, fused=fused)
            mok.check()
            if full is None:
                full = out
                oracle = ref_moe_forward(
                    x.double(), idx, tw.double(), w.to(torch.float64), torch.float64
                ).cpu()
                ref_b = ref_moe_forward(x, idx, tw, w, torch.bfloat16).cpu()
            check(out.shape == (n, shape.hidden), f"varying {counts}: shape {tuple(out.shape)}")
            tol.assert_bf16_rule(out.cpu(), ref_b[:n], oracle[:n])
            if fused:
                check(torch.equal(out, full[:n]), f"varying {dm} fused {counts} differs")
        check(len(mok.cached_workspaces()) == 1, "one workspace for every count")
        mok.clear_workspaces()


def sizes_case(dev, quick: bool = False):
    """The default workspace size (max_tokens=0) at EP R: calls with 0, 1, 777, 1024 and 4096
    tokens per rank, in that order and reversed, on the forward's paths and under training
    (fused or not, recompute or not). Each call gives, bitwise, what it gives on a fresh
    workspace: a small first call caps nothing, and the history does not matter."""
    rank, world = dist.get_rank(), dist.get_world_size()
    counts = [0, 1, 777, 1024, 4096]
    shape = ModelShape("mok-sizes", 16, 512, 256, 4, shared_intermediate=256)
    N, E = max(counts), shape.num_experts
    w = MoEWeights.random(shape, seed=SEED, dtype=torch.float32, device=dev).to(torch.bfloat16)
    t = make_routing(N * world, E, shape.num_topk, world, "uniform", seed=SEED + 7)
    sl = slice(rank * N, (rank + 1) * N)
    idx = torch.from_numpy(t.topk_idx)[sl].to(dev)
    tw = torch.from_numpy(t.topk_weights)[sl].to(dev)
    x = tokens(rank, N, shape.hidden).to(dev)
    g = torch.Generator(device=dev).manual_seed(SEED + rank)
    grad_out = torch.randn(x.shape, device=dev, generator=g).to(torch.bfloat16)
    lw = local_weights(w, dev)

    def cfg(dm="dedup_pull", cm="push"):  # max_tokens left at 0
        return mok.MoKConfig(
            dispatch_mode=dm, combine_mode=cm, num_comm_sms=8, minibatch_size=256,
            wait_timeout_ms=60_000.0,
        )  # fmt: skip

    def forward(dm, cm, fused):
        def call(n):
            out = mf.moe_forward(x[:n], idx[:n], tw[:n], lw, E, cfg(dm, cm), fused=fused)
            mok.check()
            return [out]

        return call

    def train(fused, recompute):
        def call(n):
            leaves = {
                k: v.clone().requires_grad_(True) for k, v in vars(lw).items() if v is not None
            }
            ws = dataclasses.replace(lw, **leaves)
            xs, tws = x[:n].clone().requires_grad_(True), tw[:n].clone().requires_grad_(True)
            out = mf.moe(xs, idx[:n], tws, ws, E, cfg(), fused=fused, recompute=recompute)
            out.backward(grad_out[:n])
            mok.check()
            return [out.detach(), xs.grad, tws.grad, *(leaves[k].grad for k in sorted(leaves))]

        return call

    cases = [(f"forward {dm}/{cm} fused={f}", forward(dm, cm, f)) for dm, cm, f in (
        ("dedup_pull", "push", True), ("pull", "push", True),
        ("pull", "pull", False), ("dedup_pull", "push", False),
    )]  # fmt: skip
    cases += [
        (f"training fused={f} recompute={r}", train(f, r))
        for f in (True, False)
        for r in (True, False)
    ]
    if quick and world > 4:  # EP8 time-sliced: one fused and one unfused path of each
        cases = [cases[i] for i in (0, 3, 5, 6)]
    if not HOPPER:  # the fused layer and recompute=False's kernels are sm_90 only
        cases = [c for c in cases if "fused=True" not in c[0] and "recompute=False" not in c[0]]
    for what, call in cases:
        mok.clear_workspaces()
        fresh = {}
        for n in counts:
            fresh[n] = call(n)
            mok.clear_workspaces()
        for order in (counts, counts[::-1]):
            for n in order:
                for i, (a, b) in enumerate(zip(call(n), fresh[n], strict=True)):
                    check(
                        a.shape == b.shape and torch.equal(a, b),
                        f"{what}: {n} tokens after {order[: order.index(n)]} differ from a "
                        f"fresh workspace (tensor {i})",
                    )
            held = mok.cached_workspaces()
            check(
                all(ws.max_tokens >= N for ws in held),
                f"{what}: sizes {[ws.max_tokens for ws in held]}",
            )
            mok.clear_workspaces()


def local_weights(w: MoEWeights, dev) -> MoEWeights:
    lw = w.shard(dist.get_rank(), dist.get_world_size())
    return MoEWeights(*(None if v is None else v.to(dev).contiguous() for v in vars(lw).values()))


def concurrency_cases(dev):
    """Two or more ranks: unequal launch geometry is refused at workspace creation; back-to-back
    fused calls with changing x while a peer lags on the host give each call's own result; a
    collective on a side stream that the ranks order differently around the layer (the
    persistent kernel needs every SM) ends in a timeout on both ranks, not a hang."""
    rank, world = dist.get_rank(), dist.get_world_size()
    mok.clear_workspaces()
    shape = ModelShape("mok-conc", 16 * world, 512, 256, 4, shared_intermediate=256)
    N, E = 400, shape.num_experts
    # Unequal grids: rank 1 reports two SMs fewer.
    props = torch.cuda.get_device_properties
    if rank == 1:
        sms = props(dev).multi_processor_count - 2
        torch.cuda.get_device_properties = lambda *a, **k: _Props(props(*a, **k), sms)
    try:
        mok.get_workspace(N, shape.hidden, 4, E, torch.bfloat16, mok.MoKConfig(), device=dev)
        check(False, "unequal SM counts accepted")
    except mok.MoKInputError as e:
        check("SM count" in str(e), str(e))
    finally:
        torch.cuda.get_device_properties = props
    w = MoEWeights.random(shape, seed=SEED, dtype=torch.float32, device=dev).to(torch.bfloat16)
    lw = local_weights(w, dev)
    t = make_routing(N, E, 4, world, "uniform", seed=SEED + 9)
    sl = slice(rank * N, (rank + 1) * N)
    idx = torch.from_numpy(t.topk_idx)[sl].to(dev)
    tw = torch.from_numpy(t.topk_weights)[sl].to(dev)
    cfg = mok.MoKConfig(num_comm_sms=8, minibatch_size=256, wait_timeout_ms=20000.0)
    xs = [torch.randn(N, shape.hidden, device=dev).to(torch.bfloat16) for _ in range(6)]
    want = [mf.moe_forward(x, idx, tw, lw, E, cfg, fused=True) for x in xs]
    mok.check()
    dist.barrier()
    got = []
    for x in xs:
        if rank == 1:
            time.sleep(0.02)  # the host of rank 1 lags; its GPU queue runs dry between calls
        got.append(mf.moe_forward(x, idx, tw, lw, E, cfg, fused=True))
    mok.check()
    for i, (a, b) in enumerate(zip(got, want, strict=True)):
        check(torch.equal(a, b), f"back-to-back call {i} with a lagging peer differs")
    # A side-stream collective ordered differently around the layer on the two ranks.
    mok.clear_workspaces()
    if shared_gpu():
        # NOTE: gloo's all_reduce runs on the host (it holds no SM), so nothing competes with the
        # layer for the GPU: the case needs NCCL, one GPU per rank.
        print(f"rank {rank}: side-stream collective: skipped (gloo collectives hold no SMs)")
        return
    short = mok.MoKConfig(num_comm_sms=8, minibatch_size=256, wait_timeout_ms=3000.0)
    mf.moe_forward(xs[0], idx, tw, lw, E, short, fused=True)
    mok.check()
    side = torch.cuda.Stream(dev)
    buf = torch.ones(1 << 20, device=dev)
    dist.barrier()
    t0 = time.monotonic()
    raised = None
    try:
        if rank == 0:
            with torch.cuda.stream(side):
                dist.all_reduce(buf)
        mf.moe_forward(xs[1], idx, tw, lw, E, short, fused=True)
        if rank != 0:
            with torch.cuda.stream(side):
                dist.all_reduce(buf)
        torch.cuda.synchronize(dev)
        mok.check()
    except mok.MoKTimeoutError as e:
        raised = e
    dt = time.monotonic() - t0
    print(
        f"rank {rank}: side-stream collective: {type(raised).__name__} after {dt:.1f}s", flush=True
    )
    check(raised is not None, "a collective interleaved differently did not time out")
    check(dt < 60, f"the interleaved collective took {dt:.0f}s")
    mok.clear_workspaces()


class _Props:
    """Device properties with another SM count."""

    def __init__(self, props, sms: int):
        self._props, self.multi_processor_count = props, sms

    def __getattr__(self, name):
        return getattr(self._props, name)


def timeout_case(dev):
    rank = dist.get_rank()
    N, H, K, E = 256, 512, 4, 16
    cfg = mok.MoKConfig(num_comm_sms=4, wait_timeout_ms=1000.0)
    ws = mok.get_workspace(N, H, K, E, torch.bfloat16, cfg, device=dev)
    dist.barrier()
    if rank == 0:
        t0 = time.monotonic()
        idx = torch.arange(K, device=dev).repeat(N, 1)
        s = mf.build_schedule(idx, torch.full((N, K), 0.25, device=dev), ws)
        mf.dispatch(torch.zeros(N, H, dtype=torch.bfloat16, device=dev), s)
        try:
            ws.check()
            check(False, "no timeout raised")
        except mok.MoKTimeoutError as e:
            dt = time.monotonic() - t0
            check(e.peer == 1 and e.wait == "route_ready", str(e))
            check(dt < 1.0 + 5.0, f"timeout took {dt:.1f}s")
            print(f"rank 0 raised after {dt:.2f}s: {e}", flush=True)
        # Later calls keep raising the recorded error instead of hanging.
        try:
            mf.build_schedule(idx, torch.full((N, K), 0.25, device=dev), ws)
            check(False, "broken workspace accepted a call")
        except mok.MoKTimeoutError:
            pass
    dist.barrier()


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--timeout", action="store_true")
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    dev = init_ranks("mok_worker.py")  # one GPU per rank, or shared (MOK_SHARED_GPU=1)
    rank = dist.get_rank()
    global HOPPER
    paths = arch_paths(torch.cuda.get_device_capability(dev))
    HOPPER = paths.fused_forward and paths.expert_kernels
    if not HOPPER and rank == 0:
        print(f"{paths.describe()}: the fused layer's cases are skipped", flush=True)
    if args.timeout:
        timeout_case(dev)
    else:
        cases = [
            (2048, 8, 128, 1000, "uniform", 20),
            (4096, 6, 64, 777, "hot:0.5", 0),
            (7168, 8, 256, 512, "hot:0.5", 0),
            (7168, 10, 64, 300, "uniform", 0),
            (2048, 1, 32, 513, "uniform", 0),
        ]
        for hidden, K, E, N, skew, rep in cases[: 2 if args.quick else None]:
            comm_case(hidden, K, E, N, skew, dev, repeat=rep)
            print(f"rank {rank}: comm H={hidden} K={K} E={E} N={N} {skew} ok", flush=True)
            mok.clear_workspaces()
        layer_case(dev)
        print(f"rank {rank}: layer ok", flush=True)
        varying_case(dev)
        print(f"rank {rank}: varying token counts ok", flush=True)
        error_cases(dev)
        print(f"rank {rank}: errors ok", flush=True)
        sizes_case(dev, args.quick)
        print(f"rank {rank}: default workspace size, 0..4096 tokens both ways ok", flush=True)
        if dist.get_world_size() > 1 and HOPPER:  # the fused layer's cases
            concurrency_cases(dev)
            print(f"rank {rank}: concurrency ok", flush=True)
    dist.barrier()
    print(f"MOK-WORKER-OK rank={rank}", flush=True)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
