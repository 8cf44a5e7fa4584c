"""The whole MoE layer forward: the fused layer vs the unfused alternatives, same inputs, same run.

Run with ``torchrun --nproc-per-node=N -m mok.bench layer`` (N = 1 works too). Implementations:

- ``torch-best`` (one rank only: every expert is local): the best layer we build from torch
  parts: a stable argsort of the (token, k) pairs by expert, one ``index_select`` gather, the
  experts of :func:`torch_experts`, the inverse-permutation gather and a ``bmm`` weighted k-sum,
  plus the shared expert; timed eager (mode ``eager``) and ``torch.compile``d (``compile``);
- ``torch-ffn``: the experts of :func:`torch_experts` alone on the same expert-sorted rows (the
  floor of any unfused design);
- ``nccl``:  count exchange + permute + NCCL ``all_to_all_single``, local sort by expert,
  the experts of :func:`torch_experts`, NCCL back, unpermute, weighted k-sum (+ shared expert);
- ``mok-unfused``: mok's schedule, dispatch and combine kernels with the bf16 experts of
  :mod:`mok.experts`, as the torch rows use them (:func:`mok.functional.moe_forward` with
  ``fused=False``, which runs under :func:`mok.functional.unfused_config`: all SMs for the
  kernels, regions padded to 16 rows; the row records those);
- ``mok-fused``: the fused layer (:func:`mok.functional.moe_forward` with ``fused=True``);
- ``deepep``: DeepEP V1 normal dispatch, the experts of :func:`torch_experts` over the received
  (token, local expert) pairs, per-token weighted partials, DeepEP combine (+ shared expert),
  for each ``--deepep-sms`` (optional: runs when ``deep_ep`` imports and there are >= 2 ranks).

The torch experts are built as well as we know how: gate and up as one ``torch._grouped_mm``
over the ``[L, 2I, H]`` weight prepared once (its transposed view is the column-major layout the
grouped GEMM is fastest on; :mod:`mok.experts`), bf16 outputs, SwiGLU in bf16 in place, the
down projection as a second grouped GEMM; the shared expert the same way with ``torch.mm``.

``--emulate-ep N`` on one GPU runs the per-rank work of EP N: the model's experts / N, all on
this rank, and the same tokens per rank (so the same rows per expert as a rank of EP N gets).

Every implementation includes its routing bookkeeping (mok: the schedule build). Times are CUDA
event medians of back-to-back calls after warm-up, max over ranks. TFLOP/s counts the real rows
only (no padding): received rows x 6 H I + tokens x 6 H Is. NVLink bytes are the rows that cross
NVLink per rank (dispatch + combine). The process group, the timer, the CSV recorder with its
provenance columns and the routing draw are the benchmarks' shared ones (mok.bench.common).

``python -m mok.bench sweep`` times the fused layer over communication SMs x minibatch x dispatch
mode and writes the CSV the simulator is validated against.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import sys

import torch
import torch.distributed as dist

from mok.bench.common import (
    Recorder,
    case_jobs,
    compiled,
    draw_routing,
    init_dist,
    one_rank_gather,
    provenance,
    run_cases,
    time_cuda,
)
from mok.experts import clear_cache, dense_swiglu, gate_up_weight, grouped_swiglu
from mok.spec.rows import bench_routing_seed

MODELS = ("deepseek-v3", "kimi-k2", "qwen3-30b-a3b")


class LayerRecorder(Recorder):
    def describe(self, row: dict) -> str:
        return (
            f"{row['model']:>14} N={row['tokens_per_rank']:>5} {row['skew']:>8} "
            f"{row['impl']:>12} {row['mode']:>10} sms={row['sms']:>3} mb={row['minibatch']:>5} "
            f"rt={row['row_tile']:>3} "
            f"{row['median_us']:>9.1f} us {row['tflops']:>6.1f} TFLOP/s "
            f"{row['nvlink_gbps']:>6.1f} GB/s"
        )


def _weights(shape, world: int, seed: int):
    """This rank's bf16 weights, drawn on the GPU (variance 1/fan_in)."""
    from reference.weights import MoEWeights

    g = torch.Generator(device="cuda").manual_seed(seed + dist.get_rank())
    L, H, inter = shape.num_experts // world, shape.hidden, shape.intermediate
    si = shape.shared_intermediate

    def rnd(*size):
        t = torch.randn(*size, generator=g, device="cuda", dtype=torch.bfloat16)
        return t.mul_(size[-1] ** -0.5)

    return MoEWeights(
        rnd(L, inter, H),
        rnd(L, inter, H),
        rnd(L, H, inter),
        rnd(si, H) if si else None,
        rnd(si, H) if si else None,
        rnd(H, si) if si else None,
    )


def torch_experts(a: torch.Tensor, w, offs: torch.Tensor, wgu=None) -> torch.Tensor:
    """The baselines' routed experts: a [rows, hidden] bf16 grouped by local expert (``offs``:
    int32 group ends) -> [rows, hidden] bf16 (:func:`mok.experts.grouped_swiglu`, bf16).
    ``wgu``: the prepared [L, 2I, H] gate/up weight (None: :func:`mok.experts.gate_up_weight`)."""
    return grouped_swiglu(a, w.w_gate, w.w_up, w.w_down, offs, exact=False, w_gate_up=wgu)


def _shared(x: torch.Tensor, w, swgu=None) -> torch.Tensor | None:
    if w.shared_w_gate is None:
        return None
    return dense_swiglu(
        x, w.shared_w_gate, w.shared_w_up, w.shared_w_down, exact=False, w_gate_up=swgu
    )


def prepare(w) -> tuple:
    """The fused gate/up weights of the routed and shared experts, built once per model."""
    shared = None if w.shared_w_gate is None else gate_up_weight(w.shared_w_gate, w.shared_w_up)
    return gate_up_weight(w.w_gate, w.w_up), shared


def sort_by_expert(idx: torch.Tensor, num_local: int):
    """(order, offs) of the (token, k) pairs of idx [n, K] (local expert ids) sorted by expert:
    order [n K] int64 (stable), offs [num_local] int32 group ends."""
    flat = idx.reshape(-1)
    order = torch.argsort(flat, stable=True)
    offs = torch.cumsum(torch.bincount(flat, minlength=num_local), 0).to(torch.int32)
    return order, offs


def permuted_layer(x, idx, tw, num_local: int, experts):
    """The routed part of the one-rank torch layers: the (token, k) pairs of idx [n, K] (local
    expert ids) sorted by expert (:func:`sort_by_expert`), one gather of x, ``experts(rows,
    offs)`` on the expert-sorted rows, the inverse-permutation gather and a ``bmm`` weighted
    k-sum -> [n, H] in the experts' output dtype."""
    n, k = idx.shape
    order, offs = sort_by_expert(idx, num_local)
    y = experts(x.index_select(0, order // k), offs)  # expert-sorted rows
    inv = torch.empty_like(order)
    inv[order] = torch.arange(order.numel(), device=order.device)
    slots = y.index_select(0, inv).view(n, k, -1)  # (token, k) order
    return torch.bmm(tw.to(y.dtype).view(n, 1, k), slots).view(n, -1)


def torch_best_layer(x, idx, tw, w, wgu, swgu):
    """The whole layer on one rank from torch parts (every expert local; see the module
    docstring); ``wgu`` / ``swgu``: :func:`prepare`'s weights."""
    out = permuted_layer(
        x, idx, tw, w.w_gate.shape[0], lambda rows, offs: torch_experts(rows, w, offs, wgu)
    )
    sh = _shared(x, w, swgu)
    return out if sh is None else out + sh


def nccl_layer(x, idx, tw, w, num_experts):
    """The usual all_to_all layer (host reads the split sizes)."""
    world = dist.get_world_size()
    n, hidden = x.shape
    topk = idx.shape[1]
    L = num_experts // world
    flat = idx.reshape(-1)
    dst = flat // L
    order = torch.argsort(dst, stable=True)
    send_counts = torch.bincount(dst, minlength=world)
    recv_counts = torch.empty_like(send_counts)
    dist.all_to_all_single(recv_counts, send_counts)
    sc, rc = send_counts.tolist(), recv_counts.tolist()
    rows = x.index_select(0, order // topk)
    recv = torch.empty(sum(rc), hidden, dtype=x.dtype, device=x.device)
    dist.all_to_all_single(recv, rows, rc, sc)
    eid = torch.empty(sum(rc), dtype=flat.dtype, device=x.device)
    dist.all_to_all_single(eid, (flat[order] % L).contiguous(), rc, sc)
    by_expert = torch.argsort(eid, stable=True)
    offs = torch.cumsum(torch.bincount(eid, minlength=L), 0).to(torch.int32)
    y = torch_experts(recv.index_select(0, by_expert), w, offs)
    back_rows = torch.empty_like(y)
    back_rows[by_expert] = y
    back = torch.empty(n * topk, hidden, dtype=x.dtype, device=x.device)
    dist.all_to_all_single(back, back_rows, sc, rc)
    slots = torch.empty_like(back)
    slots[order] = back
    out = torch.bmm(tw.to(torch.bfloat16).view(n, 1, topk), slots.view(n, topk, hidden))
    out = out.view(n, hidden)
    sh = _shared(x, w)
    return out if sh is None else out + sh


# DeepEP V1's intranode dispatch asserts num_experts / num_ranks <= its 128 threads per block.
DEEPEP_MAX_LOCAL_EXPERTS = 128


class DeepEPLayer:
    """DeepEP dispatch + grouped GEMM + DeepEP combine (one Buffer per model shape)."""

    def __init__(self, hidden: int, num_experts: int, sms: int):
        import deep_ep

        world = dist.get_world_size()
        self.ep, self.num_experts = deep_ep, num_experts
        deep_ep.Buffer.set_num_sms(sms)
        nvl = max(
            deep_ep.Buffer.get_dispatch_config(world).get_nvl_buffer_size_hint(hidden * 2, world),
            deep_ep.Buffer.get_combine_config(world).get_nvl_buffer_size_hint(hidden * 2, world),
        )
        self.buf = deep_ep.Buffer(dist.group.WORLD, num_nvl_bytes=nvl)

    def __call__(self, x, idx, tw, w):
        L = self.num_experts // dist.get_world_size()
        idx64 = idx.to(self.ep.topk_idx_t)
        ntr, _, nte, in_rank, _ = self.buf.get_dispatch_layout(idx64, self.num_experts)
        recv_x, ridx, rw, _, handle, _ = self.buf.dispatch(
            x,
            num_tokens_per_rank=ntr,
            is_token_in_rank=in_rank,
            num_tokens_per_expert=nte,
            topk_idx=idx64,
            topk_weights=tw,
        )
        # Received (token, k) pairs on this rank's experts (-1: another rank's expert); the
        # modulo maps global or local expert ids to local ones.
        loc = torch.where(ridx >= 0, ridx % L, -1)
        tok, kk = (loc >= 0).nonzero(as_tuple=True)
        e = loc[tok, kk]
        order = torch.argsort(e, stable=True)
        tok, kk, e = tok[order], kk[order], e[order]
        offs = torch.cumsum(torch.bincount(e, minlength=L), 0).to(torch.int32)
        y = torch_experts(recv_x.index_select(0, tok), w, offs).float()
        part = torch.zeros(recv_x.shape[0], x.shape[1], dtype=torch.float32, device=x.device)
        part.index_add_(0, tok, y * rw[tok, kk].float().unsqueeze(1))
        out, _, _ = self.buf.combine(part.to(torch.bfloat16), handle)
        sh = _shared(x, w)
        return out if sh is None else (out.float() + sh.float()).to(torch.bfloat16)


def _counts(t, rank: int, world: int, num_experts: int, topk: int) -> tuple[int, int, int]:
    """(rows this rank's experts receive, rows crossing NVLink per rank and direction for
    per-(token, k) pull, for dedup pull)."""
    idx = torch.from_numpy(t.topk_idx).view(world, -1, topk)
    L = num_experts // world
    owner = idx // L
    received = int((owner == rank).sum())
    remote = sum(int((owner[s] == rank).sum()) for s in range(world) if s != rank)
    remote_dedup = sum(int((owner[s] == rank).any(1).sum()) for s in range(world) if s != rank)
    return received, remote, remote_dedup


def _trace_one(trace_dir, model, skew, cfg, x, idx, tw, w, num_experts) -> None:
    """One traced fused call (after the timed ones): Chrome trace per rank + printed split."""
    from pathlib import Path

    import mok
    from mok import functional as mf
    from mok import layer_trace

    n, hidden = x.shape
    ws = mok.get_workspace(
        n, hidden, idx.shape[1], num_experts, x.dtype, cfg, device=x.device, fused=True
    )
    buf = layer_trace.new_trace(ws)
    mf.forward(x, mf.build_schedule(idx, tw, ws), w, trace=buf)
    ws.check()
    events = layer_trace.decode(buf)
    tag = f"{model}-{skew.replace(':', '')}-{cfg.dispatch_mode}-sms{cfg.num_comm_sms}"
    tag += f"-mb{cfg.minibatch_size}-rt{cfg.row_tile}-rank{dist.get_rank()}"
    Path(trace_dir).mkdir(parents=True, exist_ok=True)
    layer_trace.to_chrome(events, Path(trace_dir) / f"{tag}.json")
    torch.save(buf.cpu(), Path(trace_dir) / f"{tag}.pt")  # raw events, for layer_trace.decode
    split = layer_trace.summary(events)
    if dist.get_rank() == 0:
        print(f"trace {tag}: " + ", ".join(f"{k}={v:.0f}us" for k, v in split.items()), flush=True)


def emulated_shape(shape, world: int, emulate_ep: int):
    """``shape`` with the experts of this world's ranks when they run the per-rank work of EP
    ``emulate_ep`` (its experts / ``emulate_ep`` on each rank, so that each rank holds the
    experts, and gets the rows per expert, of one rank of EP ``emulate_ep``); 0: ``shape``."""
    if not emulate_ep:
        return shape
    if shape.num_experts % emulate_ep:
        raise ValueError(
            f"{shape.name}: {shape.num_experts} experts do not split over EP{emulate_ep}"
        )
    return dataclasses.replace(shape, num_experts=shape.num_experts * world // emulate_ep)


def run_model(
    rec,
    model,
    n,
    skew,
    impls,
    configs,
    iters,
    warmup,
    deepep_sms=(),
    trace_dir=None,
    emulate_ep=0,
):
    import mok
    from mok import functional as mf
    from mok.spec.workload import get_shape

    world, rank = dist.get_world_size(), dist.get_rank()
    shape = emulated_shape(get_shape(model), world, emulate_ep)
    E, H, inter, si, K = (
        shape.num_experts,
        shape.hidden,
        shape.intermediate,
        shape.shared_intermediate,
        shape.num_topk,
    )
    w = _weights(shape, world, seed=7)
    seed = bench_routing_seed(n)  # recorded in every row
    idx, tw, t = draw_routing(n, E, K, skew, seed=seed)
    g = torch.Generator(device="cuda").manual_seed(11 + rank)
    x = torch.randn(n, H, device="cuda", generator=g).to(torch.bfloat16)
    received, remote, remote_dedup = _counts(t, rank, world, E, K)
    flops = received * 6 * H * inter + n * 6 * H * si
    base = dict(model=model, hidden=H, intermediate=inter, num_experts=E, num_topk=K, skew=skew)
    base.update(tokens_per_rank=n, routing_seed=seed, emulated_ep=emulate_ep or world)

    def add(impl, mode, sms, mb, fn, nvlink_rows, row_tile=0):
        if fn is None:
            return
        ts = time_cuda(fn, iters, warmup)
        rec.add(
            **base,
            impl=impl,
            mode=mode,
            sms=sms,
            minibatch=mb,
            row_tile=row_tile,
            median_us=ts[0],
            p20_us=ts[1],
            p80_us=ts[2],
            tflops=round(flops / (ts[0] * 1e6), 1),
            nvlink_bytes=2 * nvlink_rows * H * 2,
        )

    prep = prepare(w)  # before any timing: the layout is prepared once, as a model would
    wgu = prep[0]
    if world == 1 and ("torch-best" in impls or "torch-ffn" in impls):
        if "torch-ffn" in impls:
            order, offs = sort_by_expert(idx, E)
            rows = x.index_select(0, order // K)
            add("torch-ffn", "ffn", 0, 0, lambda: torch_experts(rows, w, offs, wgu), 0)
        if "torch-best" in impls:
            add("torch-best", "eager", 0, 0, lambda: torch_best_layer(x, idx, tw, w, *prep), 0)
            best = compiled(torch_best_layer)
            try:  # torch.compile builds on the first call
                best is not None and best(x, idx, tw, w, *prep)
            except Exception as e:  # noqa: BLE001 - a compile failure drops the row, says why
                if rank == 0:
                    print(f"torch.compile of torch-best failed ({type(e).__name__}: {e})")
                best = None
            add("torch-best", "compile", 0, 0, best and (lambda: best(x, idx, tw, w, *prep)), 0)
    if "nccl" in impls:
        add("nccl", "a2a", 0, 0, lambda: nccl_layer(x, idx, tw, w, E), remote)
    if "deepep" in impls and world >= 2:
        try:
            import deep_ep  # noqa: F401
        except ImportError as e:
            if rank == 0:
                print(f"DeepEP not importable ({e}); its layer baseline is skipped", flush=True)
        else:
            if E // world > DEEPEP_MAX_LOCAL_EXPERTS:
                if rank == 0:
                    print(
                        f"DeepEP's intranode dispatch supports at most {DEEPEP_MAX_LOCAL_EXPERTS}"
                        f" experts per rank; {model} has {E // world} at EP{world}: skipped",
                        flush=True,
                    )
                deepep_sms = ()
            for sms in deepep_sms:
                layer = DeepEPLayer(H, E, sms)
                add("deepep", "normal", sms, 0, lambda f=layer: f(x, idx, tw, w), remote_dedup)
    for c in configs:
        cfg = mok.MoKConfig(**c)
        rows = remote_dedup if cfg.dispatch_mode == "dedup_pull" else remote
        for impl, fused in (("mok-unfused", False), ("mok-fused", True)):
            if impl not in impls:
                continue
            # the row says what ran: the unfused path's own SMs and row tile (unfused_config)
            sms_count = torch.cuda.get_device_properties(x.device).multi_processor_count
            ran = cfg if fused else mf.unfused_config(cfg, sms_count)
            add(
                impl,
                ran.dispatch_mode,
                ran.num_comm_sms,
                ran.minibatch_size,
                lambda fused=fused, cfg=cfg: mf.moe_forward(x, idx, tw, w, E, cfg, fused=fused),
                rows,
                ran.row_tile,
            )
        if trace_dir and "mok-fused" in impls:
            _trace_one(trace_dir, model, skew, cfg, x, idx, tw, w, E)
        mok.clear_workspaces()
    clear_cache()  # the next model's weights replace these


def build_parser(sweep: bool = False) -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog=f"python -m mok.bench {'sweep' if sweep else 'layer'}")
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--tokens", default="4096")
    ap.add_argument("--skews", default="uniform,hot:0.5")
    ap.add_argument("--impls", default="torch-ffn,torch-best,nccl,deepep,mok-unfused,mok-fused")
    ap.add_argument(
        "--emulate-ep",
        type=int,
        default=0,
        help="run the per-rank work of this EP size (the model's experts / N on each of this "
        "world's ranks, same tokens per rank; 0: the world size)",
    )
    ap.add_argument("--deepep-sms", default="24,64,128", help="DeepEP SMs to try (comma list)")
    ap.add_argument("--modes", default="dedup_pull" if not sweep else "pull,dedup_pull")
    ap.add_argument("--sms", default="16" if not sweep else "8,16,24,32")
    ap.add_argument("--minibatch", default="4096" if not sweep else "1024,2048,4096,8192")
    ap.add_argument(
        "--row-tiles", default="128", help="mok's expert-region padding (MoKConfig.row_tile)"
    )
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--csv", default=f"mok-bench-{'sweep' if sweep else 'layer'}.csv")
    ap.add_argument("--trace-dir", default=None, help="also trace one fused call per config")
    return ap


def main(argv: list[str], sweep: bool = False) -> int:
    ap = build_parser(sweep)
    args = ap.parse_args(argv)
    init_dist(f"mok.bench {'sweep' if sweep else 'layer'}")
    world = dist.get_world_size()
    if args.emulate_ep and (args.emulate_ep < world or args.emulate_ep % world):
        ap.error(f"--emulate-ep {args.emulate_ep} must be a multiple of the world size {world}")
    rec = LayerRecorder(args.csv, provenance())
    impls = ("mok-fused",) if sweep else tuple(args.impls.split(","))
    configs = [
        dict(dispatch_mode=m, combine_mode="push", num_comm_sms=s, minibatch_size=b, row_tile=r)
        for r, m, s, b in itertools.product(
            (int(v) for v in args.row_tiles.split(",")),
            args.modes.split(","),
            (int(v) for v in args.sms.split(",")),
            (int(v) for v in args.minibatch.split(",")),
        )
    ]
    deepep_sms = tuple(int(v) for v in args.deepep_sms.split(","))

    def run(model, n, skew):
        with one_rank_gather(args.emulate_ep or world):
            _run(model, n, skew)

    def _run(model, n, skew):
        run_model(
            rec,
            model,
            n,
            skew,
            impls,
            configs,
            args.iters,
            args.warmup,
            deepep_sms,
            args.trace_dir,
            args.emulate_ep,
        )

    return run_cases(rec, case_jobs(args), "layer", run)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
