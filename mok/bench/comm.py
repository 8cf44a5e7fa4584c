"""Dispatch and combine: mok's modes vs NCCL all_to_all_single vs DeepEP V1 normal kernels.

Run with ``torchrun --nproc-per-node=2 -m mok.bench comm``. Each rank times back-to-back calls
with CUDA events (median, p20, p80 of per-call times after warm-up); reported times are the max
over ranks. NVLink bytes count only rows that cross NVLink (rows a rank sends to itself are
excluded), per rank and direction; GB/s = those bytes / time, compared with the one-direction
peer-copy ceiling measured on 2x H200 (``CEILING_GBPS``, docs/perf-notes.md). The process group,
the timer, the CSV recorder with its provenance columns and the routing draw are the benchmarks'
shared ones (mok.bench.common).

mok's dispatch reads x from the workspace x buffer (as the megakernel will) and pull combine
reads y from the workspace y buffer: no staging copies are timed. NCCL's dispatch includes the
count exchange, the permute into destination order and the host read of the split sizes; its
combine includes the reverse all_to_all, the unpermute and the weighted k-sum. DeepEP is timed
through its public API (dispatch without a cached handle, combine), for each SM count given.
"""

from __future__ import annotations

import argparse
import sys

import torch
import torch.distributed as dist

from mok.bench.common import (
    CEILING_GBPS,
    Recorder,
    close_dist,
    draw_routing,
    init_dist,
    max_over_ranks,
    provenance,
    time_cuda,
)
from mok.spec.rows import bench_routing_seed

__all__ = ["CEILING_GBPS", "MODELS", "CommRecorder", "build_parser", "main"]

MODELS = {"deepseek-v3": (7168, 256), "qwen3-30b-a3b": (2048, 128)}


def _print_stamps(what: str, t: tuple, split: dict[str, float]) -> None:
    if dist.get_rank() == 0:
        parts = ", ".join(f"{k} {v:.1f}" for k, v in split.items())
        print(f"  phases {what}: event median {t[0]:.1f} us; {parts} us", flush=True)


class CommRecorder(Recorder):
    def describe(self, row: dict) -> str:
        """The printed table line of a row."""
        return (
            f"{row['model']:>14} N={row['tokens_per_rank']:>5} {row['skew']:>8} "
            f"{row['what']:>8} {row['impl']:>6} {row['mode']:>18} {row['engine']:>6} "
            f"{row['scope']:>10} sms={row['sms']:>3} "
            f"{row['median_us']:>9.1f} us {row['nvlink_gbps']:>6.1f} GB/s "
            f"({row['frac_ceiling']:.2f})"
        )


def _remote_pull_dedup_combine(h: dict, rank: int, world: int) -> int:
    """Partial rows the home rank reads from peers: (token, owner != rank) pairs."""
    dst = h["dst_rank"]
    return sum(int((dst == d).any(dim=1).sum()) for d in range(world) if d != rank)


# Names of the four stamps' intervals: a dedup dispatch / dedup_sum (handshake with the peers,
# the copies or sums, exit) and the schedule (the routing exchange, the tables: histograms,
# scans and offsets, the positions walk).
COMM_PHASES = ("handshake", "stream", "exit")
SCHEDULE_PHASES = ("exchange", "tables", "positions")


def phase_split(
    t: torch.Tensor, names: tuple[str, str, str] = COMM_PHASES
) -> dict[str, torch.Tensor]:
    """Per-call phase split (us) from per-block stamps ``t`` [calls, blocks, 4] (us: entry,
    then the ends of three phases): each phase from the last block past the one before it to
    the last block past it (the first from the first block's entry), ``spread`` (first to last
    block ending the second phase), ``span`` (first entry to last exit) and ``gap`` (last exit
    of the previous call to this call's first entry, back to back). The first call is left
    out (it may wait for the peers' previous work)."""
    entry, ready, done, leave = (t[..., k] for k in range(4))
    return {
        names[0]: (ready.amax(1) - entry.amin(1))[1:],
        names[1]: (done.amax(1) - ready.amax(1))[1:],
        "spread": (done.amax(1) - done.amin(1))[1:],
        names[2]: (leave.amax(1) - done.amax(1))[1:],
        "span": (leave.amax(1) - entry.amin(1))[1:],
        "gap": entry.amin(1)[1:] - leave.amax(1)[:-1],
    }


def _phase_stamps(ws, fn, calls: int = 20, blocks: int | None = None, names=COMM_PHASES):
    """Median per-call phase split (us, :func:`phase_split`) of a kernel that writes per-block
    globaltimer stamps into ``ws.stamps`` (a dedup dispatch or dedup_sum on the communication
    SMs, or the schedule on ``blocks`` blocks), max over ranks."""
    from mok import _ext

    blocks = ws.config.num_comm_sms if blocks is None else blocks
    stamps = torch.zeros(calls, blocks, _ext.NUM_STAMPS, dtype=torch.int64, device="cuda")
    for i in range(calls):
        ws.stamps = stamps[i]
        fn()
    ws.stamps = None
    torch.cuda.synchronize()
    split = phase_split(stamps.cpu().double() / 1e3, names)
    return dict(zip(split, max_over_ranks([v.median() for v in split.values()]), strict=True))


def bench_mok(
    rec, base, x, idx, w, num_experts, sms, iters, warmup, engines=("tma", "vector"), stamps=False
):
    import mok
    from mok import functional as mf

    rank, world = dist.get_rank(), dist.get_world_size()
    n, hidden = x.shape
    topk = idx.shape[1]
    cfg = mok.MoKConfig(num_comm_sms=sms, capacity_factor=1.5, wait_timeout_ms=30000.0)
    ws = mok.get_workspace(n, hidden, topk, num_experts, torch.bfloat16, cfg)
    ws.x_buffer.copy_(x)
    s = mf.build_schedule(idx, w, ws)
    h = s.to_host()
    rb = hidden * 2
    remote_rows = int((h["src_rank"] >= 0).logical_and(h["src_rank"] != rank).sum())
    remote_dedup = int((h["dedup_src_rank"] != rank).sum())
    remote_pull_combine = int((h["dst_rank"] != rank).sum())
    remote_dedup_combine = _remote_pull_dedup_combine(h, rank, world)
    y = ws.y_buffer
    y.copy_(torch.randn(y.shape, device="cuda", dtype=torch.bfloat16))

    def add(what, mode, engine, scope, t, nb, nsms=sms):
        rec.add(
            **base,
            what=what,
            impl="mok",
            mode=mode,
            engine=engine,
            scope=scope,
            sms=nsms,
            median_us=t[0],
            p20_us=t[1],
            p80_us=t[2],
            nvlink_bytes=nb,
        )

    sch = mf.build_schedule
    t = time_cuda(lambda: sch(idx, w, ws), iters, warmup)
    add("schedule", "-", "-", "local", t, 0, ws.schedule_blocks())
    if stamps:
        split = _phase_stamps(
            ws, lambda: sch(idx, w, ws), blocks=ws.schedule_blocks(), names=SCHEDULE_PHASES
        )
        _print_stamps("schedule", t, split)
    xb = ws.x_buffer
    for eng in engines:
        # Comparable unit: one row per (token, destination rank) into the dedup buffer.
        t = time_cuda(lambda e=eng: mf.dispatch(xb, s, "dedup_pull", False, e), iters, warmup)
        add("dispatch", "dedup_pull", eng, "comparable", t, remote_dedup * rb)
        dd = mf.dispatch(xb, s, "dedup_pull", False, eng)
        t = time_cuda(lambda e=eng, b=dd: mf.fanout(b, s, e), iters, warmup)
        add("dispatch", "fanout", eng, "local", t, 0)
        # Same unit without this rank's own rows (they stay in x; the fan-out reads them there).
        t = time_cuda(
            lambda e=eng: mf.dispatch(xb, s, "dedup_pull", False, e, skip_local=True), iters, warmup
        )
        add("dispatch", "dedup_pull_remote", eng, "comparable", t, remote_dedup * rb)
        if stamps:
            split = _phase_stamps(
                ws, lambda e=eng: mf.dispatch(xb, s, "dedup_pull", False, e, skip_local=True)
            )
            _print_stamps(f"dedup_pull_remote {eng}", t, split)
        dd = mf.dispatch(xb, s, "dedup_pull", False, eng, skip_local=True)
        t = time_cuda(lambda e=eng, b=dd: mf.fanout(b, s, e, skip_local=True), iters, warmup)
        add("dispatch", "fanout_remote", eng, "local", t, 0)
        t = time_cuda(lambda e=eng: mf.dispatch(xb, s, "dedup_pull", True, e), iters, warmup)
        add("dispatch", "dedup_pull+fanout", eng, "end-to-end", t, remote_dedup * rb)
        t = time_cuda(lambda e=eng: mf.dispatch(xb, s, "pull", True, e), iters, warmup)
        add("dispatch", "pull", eng, "end-to-end", t, remote_rows * rb)
    t = time_cuda(lambda: mf.dispatch(x, s, "push"), iters, warmup)
    add("dispatch", "push", "vector", "end-to-end", t, remote_rows * rb)

    # Dedup pull combine: partials (expert epilogue, local), then the transfer + sum.
    # NOTE: partials of epoch e wait until every rank read epoch e - 1: a sum runs in between.
    full = torch.cuda.get_device_properties(0).multi_processor_count
    # NOTE: repeated sums of one set of partials keep them (release=False); the one releasing
    # sum after each timing loop lets the next dedup_partials overwrite them.
    mf.dedup_partials(y, s)
    t = time_cuda(lambda: mf.dedup_sum(s, engine="gather", release=False), iters, warmup)
    mf.dedup_sum(s)
    add("combine", "dedup_pull_sum", "gather", "comparable", t, remote_dedup_combine * rb)
    for eng in engines:
        t = time_cuda(
            lambda e=eng: mf.dedup_partials(y, s, engine=e),
            iters,
            warmup,
            then=lambda: mf.dedup_sum(s),
        )
        add("combine", "dedup_partials", eng, "local", t, 0)
        t = time_cuda(
            lambda e=eng: mf.dedup_partials(y, s, grid=full, engine=e),
            iters,
            warmup,
            then=lambda: mf.dedup_sum(s),
        )
        add("combine", "dedup_partials", eng, "local", t, 0, full)
        mf.dedup_partials(y, s)
        # NOTE: no shared-expert term in the combines (as in DeepEP's combine and v1's numbers).
        t = time_cuda(lambda e=eng: mf.dedup_sum(s, engine=e, release=False), iters, warmup)
        add("combine", "dedup_pull_sum", eng, "comparable", t, remote_dedup_combine * rb)
        if stamps:
            split = _phase_stamps(ws, lambda e=eng: mf.dedup_sum(s, engine=e, release=False))
            _print_stamps(f"dedup_sum {eng}", t, split)
        mf.dedup_sum(s)

    def dedup_pull_e2e():
        mf.dedup_partials(y, s)
        mf.dedup_sum(s)

    t = time_cuda(dedup_pull_e2e, iters, warmup)
    add("combine", "dedup_pull", "vector", "end-to-end", t, remote_dedup_combine * rb)
    for mode, dd_, nb in (
        ("push", False, remote_rows),
        ("pull", False, remote_pull_combine),
        ("push", True, remote_dedup),
    ):
        t = time_cuda(lambda m=mode, d=dd_: mf.combine(y, s, m, dedup=d), iters, warmup)
        add("combine", ("dedup_" if dd_ else "") + mode, "vector", "end-to-end", t, nb * rb)
    ws.check()
    mok.clear_workspaces()
    return remote_dedup


def bench_nccl(rec, base, x, idx, w, num_experts, iters, warmup):
    world, rank = dist.get_world_size(), dist.get_rank()
    n, hidden = x.shape
    topk = idx.shape[1]
    dst = (idx // (num_experts // world)).reshape(-1)
    order = torch.argsort(dst, stable=True)
    remote = int((dst != rank).sum())
    state = {}

    def dispatch():
        send_counts = torch.bincount(dst, minlength=world)
        recv_counts = torch.empty_like(send_counts)
        dist.all_to_all_single(recv_counts, send_counts)
        rows = x.index_select(0, order // topk)
        sc, rc = send_counts.tolist(), recv_counts.tolist()
        out = torch.empty(sum(rc), hidden, dtype=x.dtype, device=x.device)
        dist.all_to_all_single(out, rows, rc, sc)
        state.update(out=out, sc=sc, rc=rc)

    t = time_cuda(dispatch, iters, warmup)
    rec.add(
        **base,
        what="dispatch",
        impl="nccl",
        mode="a2a",
        engine="-",
        scope="end-to-end",
        sms=0,
        median_us=t[0],
        p20_us=t[1],
        p80_us=t[2],
        nvlink_bytes=remote * hidden * 2,
    )
    back = torch.empty(n * topk, hidden, dtype=x.dtype, device=x.device)
    wf = w.reshape(-1)

    def combine():
        dist.all_to_all_single(back, state["out"], state["sc"], state["rc"])
        slots = torch.empty_like(back)
        slots[order] = back
        out = (slots.view(n, topk, hidden).float() * wf.view(n, topk, 1)).sum(1)
        return out.to(torch.bfloat16)

    t = time_cuda(combine, iters, warmup)
    rec.add(
        **base,
        what="combine",
        impl="nccl",
        mode="a2a",
        engine="-",
        scope="end-to-end",
        sms=0,
        median_us=t[0],
        p20_us=t[1],
        p80_us=t[2],
        nvlink_bytes=remote * hidden * 2,
    )


def bench_deepep(rec, base, x, idx, w, num_experts, sms_list, remote_dedup, iters, warmup):
    try:
        import deep_ep
    except ImportError as e:
        if dist.get_rank() == 0:
            print(f"DeepEP not importable ({e}); skipped", flush=True)
        return
    world = dist.get_world_size()
    hidden = x.shape[1]
    deep_ep.Buffer.set_num_sms(max(sms_list))
    nvl = max(
        deep_ep.Buffer.get_dispatch_config(world).get_nvl_buffer_size_hint(hidden * 2, world),
        deep_ep.Buffer.get_combine_config(world).get_nvl_buffer_size_hint(hidden * 2, world),
    )
    buf = deep_ep.Buffer(dist.group.WORLD, num_nvl_bytes=nvl)
    idx64 = idx.to(deep_ep.topk_idx_t)
    for sms in sms_list:
        deep_ep.Buffer.set_num_sms(sms)
        _deepep_one(rec, base, buf, x, idx64, w, num_experts, sms, remote_dedup, iters, warmup)


def _deepep_one(rec, base, buf, x, idx64, w, num_experts, sms, remote_dedup, iters, warmup):
    hidden = x.shape[1]
    ntr, _, nte, in_rank, _ = buf.get_dispatch_layout(idx64, num_experts)
    state = {}

    def dispatch():
        state["recv"] = buf.dispatch(
            x,
            num_tokens_per_rank=ntr,
            is_token_in_rank=in_rank,
            num_tokens_per_expert=nte,
            topk_idx=idx64,
            topk_weights=w,
        )

    t = time_cuda(dispatch, iters, warmup)
    rec.add(
        **base,
        what="dispatch",
        impl="deepep",
        mode="normal",
        engine="-",
        scope="comparable",
        sms=sms,
        median_us=t[0],
        p20_us=t[1],
        p80_us=t[2],
        nvlink_bytes=remote_dedup * hidden * 2,
    )
    recv_x, _, recv_w, _, handle, _ = state["recv"]
    t = time_cuda(lambda: buf.combine(recv_x, handle, topk_weights=recv_w), iters, warmup)
    rec.add(
        **base,
        what="combine",
        impl="deepep",
        mode="normal",
        engine="-",
        scope="comparable",
        sms=sms,
        median_us=t[0],
        p20_us=t[1],
        p80_us=t[2],
        nvlink_bytes=remote_dedup * hidden * 2,
    )


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m mok.bench comm")
    ap.add_argument("--models", default="deepseek-v3,qwen3-30b-a3b")
    ap.add_argument("--tokens", default="512,1024,2048,4096,8192,16384")
    ap.add_argument("--skews", default="uniform,hot:0.5")
    ap.add_argument("--topk", type=int, default=8)
    ap.add_argument("--sms", default="24", help="mok communication SMs (comma list)")
    ap.add_argument("--deepep-sms", default="24,48,64,96,128")
    ap.add_argument("--no-nccl", action="store_true")
    ap.add_argument("--no-deepep", action="store_true")
    ap.add_argument("--engines", default="tma,vector", help="mok row-copy engines (comma list)")
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--csv", default="mok-bench-comm.csv")
    ap.add_argument(
        "--stamps",
        action="store_true",
        help="print the dedup kernels' and the schedule's per-phase split (us)",
    )
    return ap


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)

    init_dist("mok.bench comm")
    rec = CommRecorder(args.csv, provenance())
    for model in args.models.split(","):
        hidden, num_experts = MODELS[model]
        for skew in args.skews.split(","):
            for n in (int(v) for v in args.tokens.split(",")):
                base = dict(
                    model=model,
                    hidden=hidden,
                    num_experts=num_experts,
                    num_topk=args.topk,
                    skew=skew,
                    tokens_per_rank=n,
                    routing_seed=bench_routing_seed(n),  # which trace the row ran on
                )
                idx, w, _ = draw_routing(n, num_experts, args.topk, skew, seed=base["routing_seed"])
                g = torch.Generator(device="cuda").manual_seed(1 + dist.get_rank())
                x = torch.randn(n, hidden, device="cuda", generator=g).to(torch.bfloat16)
                remote_dedup = 0
                for sms in (int(v) for v in args.sms.split(",")):
                    remote_dedup = bench_mok(
                        rec,
                        base,
                        x,
                        idx,
                        w,
                        num_experts,
                        sms,
                        args.iters,
                        args.warmup,
                        tuple(args.engines.split(",")),
                        args.stamps,
                    )
                if not args.no_nccl:
                    bench_nccl(rec, base, x, idx, w, num_experts, args.iters, args.warmup)
                if not args.no_deepep:
                    sms_list = [int(v) for v in args.deepep_sms.split(",")]
                    bench_deepep(
                        rec,
                        base,
                        x,
                        idx,
                        w,
                        num_experts,
                        sms_list,
                        remote_dedup,
                        args.iters,
                        args.warmup,
                    )
                rec.write()
    rec.write()
    return close_dist()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
