"""The training-step benchmark at EP R (``torchrun --nproc-per-node=R -m mok.bench train``) on the
CPU: the refusals and defaults of the EP and shared-GPU modes, the torch-best+nccl pipeline's index
bookkeeping with R ranks simulated in one process (the all_to_all as split / concatenate) against
the dense reference in fp64, forward and backward, the pipeline itself over two gloo processes
(its all_to_all and that exchange's backward), and one EP case's rows with the world and the GPU
replaced by stand-ins."""

from __future__ import annotations

import datetime
import re
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

from mok.bench import train, train_ep
from mok.spec import limits
from mok.spec.workload import ModelShape, make_routing
from reference.moe import moe_backward, moe_forward
from reference.weights import MoEWeights
from tests import tolerances as tol
from tests.test_bench_train import stub_timer_and_memory

META = {"gpu": "NVIDIA H100", "num_ranks": 4, "torch": "2.11", "cuda": "13.0", "git_sha": "abc"}
SHAPE = ModelShape("ep-train", 8, 16, 8, 3, shared_intermediate=8)
# weight -> its gradient's name in reference.moe.MoEGrads
GRAD_NAMES = {"w_gate": "dw_gate", "w_up": "dw_up", "w_down": "dw_down"}
GRAD_NAMES.update({n: f"d_{n}" for n in ("shared_w_gate", "shared_w_up", "shared_w_down")})


# ---- command line ------------------------------------------------------------------------------
def _resolve(argv, world, shared=False):
    ap = train.build_parser()
    return train.resolve_args(ap, ap.parse_args(argv), world, shared)


def test_ep_defaults_and_csv_names():
    a = _resolve([], world=8)
    assert a.impls == (
        "torch-best+nccl",
        "torch-best+deepep",
        "mok-unfused",
        "mok-saved",
        "mok-fused",
        "mok-fused-saved",
    )
    assert (a.tokens, a.iters, a.warmup, a.warm_s, a.emulate_ep) == ("4096", 10, 3, 1.0, 0)
    assert (a.csv, a.deepep_sms) == ("mok-bench-train-ep8.csv", "24")


def test_shared_gpu_ranks_default_to_a_small_smoke_run_unless_told_otherwise():
    a = _resolve([], world=4, shared=True)
    assert (a.tokens, a.iters, a.warmup, a.warm_s) == ("512", 3, 1, 0.0)
    assert a.csv == "mok-bench-train-ep4-shared.csv"
    b = _resolve(["--tokens", "128", "--iters", "5", "--warm-s", "0.5"], world=4, shared=True)
    assert (b.tokens, b.iters, b.warmup, b.warm_s) == ("128", 5, 1, 0.5)


def test_nearest_ep_sizes():
    assert train.nearest_ep_sizes is limits.nearest_ep_sizes  # one rule (mok.spec.limits)
    assert limits.expert_split_problem(256, 8) is None
    # only EP sizes the kernels run (at most 72 ranks)
    assert limits.expert_split_problem(256, 72).endswith("the nearest EP sizes that do: EP64")
    assert limits.expert_split_problem(384, 60).endswith("sizes that do: EP48 / EP64")
    assert train.nearest_ep_sizes(256, 6) == [4, 8]
    assert train.nearest_ep_sizes(384, 5) == [4, 6]
    assert train.nearest_ep_sizes(16, 32) == [16]


@pytest.mark.parametrize(
    ("argv", "world", "why"),
    [
        (["--emulate-ep", "2"], 2, r"--emulate-ep 2 runs the per-rank work of an EP size on one "),
        (["--emulate-ep", "0"], 4, r"under torchrun the EP size is the world size \(4\)"),
        (["--impls", "torch-best,mok-fused"], 2, r"torch-best runs at one rank .* at EP2 its rows"),
        (["--impls", "torch-best+deepep"], 1, r"torch-best\+deepep: EP > 1 only, under torchrun"),
        (["--models", "kimi-k2"], 5, r"kimi-k2: 384 experts do not split over EP5; .*: EP4 / EP6$"),
        (["--models", "qwen3-30b-a3b"], 48, r"128 experts do not split over EP48; .*: EP32 / EP64"),
        (["--models", "qwen3-30b-a3b"], 256, r"support 1 to 72 ranks .*; found 256$"),
    ],
)
def test_ep_refusals_name_what_works(argv, world, why, capsys):
    with pytest.raises(SystemExit) as e:
        _resolve(argv, world)
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert re.search(why, err), err


def test_refusals_come_before_the_process_group(monkeypatch, capsys):
    monkeypatch.setenv("WORLD_SIZE", "6")
    monkeypatch.setattr(train, "init_dist", lambda *a: pytest.fail("started the process group"))
    with pytest.raises(SystemExit):
        train.main(["--models", "deepseek-v3"])
    assert "256 experts do not split over EP6; the nearest EP sizes that do: EP4 / EP8" in (
        capsys.readouterr().err
    )


def test_headers_say_what_the_run_is():
    assert train.header_lines(1, False, train.DEFAULT_IMPLS[0].split(",")) == []
    (real,) = train.header_lines(8, False, train.DEFAULT_IMPLS[1].split(","))
    assert "EP8, one GPU per rank" in real and "max over ranks" in real
    smoke, skipped = train.header_lines(4, True, train.DEFAULT_IMPLS[1].split(","))
    assert "shared-GPU ranks" in smoke and "smoke test" in smoke
    assert "not NVLink measurements" in smoke
    assert skipped.startswith("torch-best+nccl / torch-best+deepep skipped: they need NCCL")
    assert train.header_lines(4, True, ("mok-fused",)) == [smoke]


# ---- the pipeline's index logic, R ranks simulated ---------------------------------------------
def _problem(counts, seed=3, skew="hot:0.5"):
    """fp64 global weights, and per rank: x [n_r, H], idx [n_r, K] (global ids), tw, grad_out."""
    w = MoEWeights.random(SHAPE, seed=seed, dtype=torch.float64)
    g = torch.Generator().manual_seed(seed + 1)
    t = make_routing(max(counts), SHAPE.num_experts, SHAPE.num_topk, len(counts), skew, seed=seed)
    idx = torch.from_numpy(t.topk_idx).view(len(counts), max(counts), -1)
    tw = torch.from_numpy(t.topk_weights).double().view(len(counts), max(counts), -1)
    ranks = []
    for r, n in enumerate(counts):
        x = torch.randn(n, SHAPE.hidden, generator=g, dtype=torch.float64)
        go = torch.randn(n, SHAPE.hidden, generator=g, dtype=torch.float64)
        ranks.append(SimpleNamespace(x=x, idx=idx[r, :n], tw=tw[r, :n], grad_out=go))
    return w, ranks


def _loop_experts(gate_up, down):
    """Expert by expert over ``offs``' groups, in the rows' dtype (fp64: grouped_mm has none)."""

    def run(rows, offs):
        out, start = [], 0
        for e, end in enumerate(offs.tolist()):
            g, u = (rows[start:end] @ gate_up[e].T).chunk(2, dim=-1)
            out.append((F.silu(g) * u) @ down[e].T)
            start = end
        return torch.cat(out) if out else rows.new_zeros(0, down.shape[1])

    return run


def _exchange(bufs, counts):
    """all_to_all_single of R ranks at once: rank d receives, from each rank s in rank order, the
    ``counts[s][d]`` rows of ``bufs[s]`` that s sends to d (``bufs[s]`` grouped by destination)."""
    parts = [list(b.split([int(c) for c in cs])) for b, cs in zip(bufs, counts, strict=True)]
    return [torch.cat([parts[s][d] for s in range(len(bufs))]) for d in range(len(bufs))]


def _simulated_layer(w: MoEWeights, ranks, R: int):
    """The torch-best+nccl pipeline's stages of every rank, the exchanges simulated: each rank's
    output (autograd records through all of it)."""
    L, K = SHAPE.num_experts // R, SHAPE.num_topk
    gate_up = torch.cat([w.w_gate, w.w_up], 1)
    sgu = torch.cat([w.shared_w_gate, w.shared_w_up], 0)
    plans = [train_ep.dispatch_plan(p.idx, L, R) for p in ranks]
    counts = [sc for _, sc in plans]
    send = [p.x.index_select(0, order // K) for p, (order, _) in zip(ranks, plans, strict=True)]
    eids = [p.idx.reshape(-1)[order] % L for p, (order, _) in zip(ranks, plans, strict=True)]
    recv, recv_eid = _exchange(send, counts), _exchange(eids, counts)
    y = []
    for o in range(R):
        mine = slice(o * L, (o + 1) * L)
        experts = _loop_experts(gate_up[mine], w.w_down[mine])
        y.append(train_ep.expert_rows(recv[o], recv_eid[o], L, experts))
    back = _exchange(y, [[counts[s][o] for s in range(R)] for o in range(R)])
    return [
        train_ep.combine_rows(back[s], plans[s][0], ranks[s].tw)
        + train.shared_expert(ranks[s].x, sgu, w.shared_w_down)
        for s in range(R)
    ], (plans, recv_eid)


@pytest.mark.parametrize("R", [2, 4])
@pytest.mark.parametrize("counts", [(12, 12, 12, 12), (9, 0, 14, 5)], ids=["even", "uneven"])
def test_bookkeeping_routes_every_row_to_its_owner_and_back(R, counts):
    """The send order groups each rank's (token, k) slots by owner, in slot order; the split
    sizes count them; each owner receives exactly the slots of its experts with their local ids;
    the inverse permutation undoes the order."""
    counts = counts[:R]
    w, ranks = _problem(counts)
    L, K = SHAPE.num_experts // R, SHAPE.num_topk
    _, (plans, recv_eid) = _simulated_layer(w, ranks, R)
    for p, (order, send_counts) in zip(ranks, plans, strict=True):
        owner = p.idx.reshape(-1) // L
        assert torch.equal(send_counts, torch.bincount(owner, minlength=R))
        assert torch.equal(torch.sort(order).values, torch.arange(p.idx.numel()))
        assert torch.equal(owner[order], torch.sort(owner, stable=True).values)
        for d in range(R):  # within an owner's group: slot order
            mine = order[owner[order] == d]
            assert torch.equal(mine, torch.sort(mine).values)
        inv = train_ep.inverse_permutation(order)
        assert torch.equal(order[inv], torch.arange(order.numel()))
    for o in range(R):
        want = torch.cat([p.idx.reshape(-1)[order][p.idx.reshape(-1)[order] // L == o] % L
                          for p, (order, _) in zip(ranks, plans, strict=True)])  # fmt: skip
        assert torch.equal(recv_eid[o], want)
    assert sum(len(e) for e in recv_eid) == K * sum(counts)


@pytest.mark.parametrize("R", [1, 2, 4, 8])
@pytest.mark.parametrize("counts", [(12,) * 8, (9, 0, 14, 5, 1, 7, 3, 12)], ids=["even", "uneven"])
def test_simulated_pipeline_is_the_dense_layer_and_its_backward_in_fp64(R, counts):
    """R simulated ranks reproduce the dense layer over their concatenated tokens to 1e-10,
    and autograd through the pipeline (the exchanges' backward: the reverse split / concatenate)
    gives the reference backward's dx, d_topk_weights and routed weight gradients; each rank's
    shared expert gets the gradient of its own tokens (summed here over ranks)."""
    counts = counts[:R]
    w, ranks = _problem(counts)
    w = MoEWeights(*(t.clone().requires_grad_() for t in vars(w).values()))
    for p in ranks:
        p.x.requires_grad_()
        p.tw.requires_grad_()
    outs, _ = _simulated_layer(w, ranks, R)
    x = torch.cat([p.x for p in ranks]).detach()
    idx, tw = torch.cat([p.idx for p in ranks]), torch.cat([p.tw for p in ranks]).detach()
    go = torch.cat([p.grad_out for p in ranks])
    ref_w = MoEWeights(*(t.detach() for t in vars(w).values()))
    want = moe_forward(x, idx, tw, ref_w, torch.float64)
    fp64 = dict(rtol=tol.FP64_RTOL, atol=tol.FP64_ATOL)
    torch.testing.assert_close(torch.cat(outs), want, **fp64)
    torch.autograd.backward(outs, [p.grad_out for p in ranks])
    grads = moe_backward(go, x, idx, tw, ref_w, torch.float64)
    torch.testing.assert_close(torch.cat([p.x.grad for p in ranks]), grads.dx, **fp64)
    torch.testing.assert_close(torch.cat([p.tw.grad for p in ranks]), grads.d_topk_weights, **fp64)
    for leaf, grad in GRAD_NAMES.items():
        torch.testing.assert_close(getattr(w, leaf).grad, getattr(grads, grad), **fp64)


# ---- the pipeline over two gloo processes ------------------------------------------------------
def _gloo_rank(rank: int, world: int, init: str, counts) -> None:
    """One rank of the real pipeline (AllToAll, count exchange, host-read splits) in fp32 on a
    gloo group; checks its slice against the fp64 reference of the whole problem."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))  # fmt: skip
    try:
        w64, ranks = _problem(counts)
        L = SHAPE.num_experts // world
        mine = slice(rank * L, (rank + 1) * L)
        p = ranks[rank]

        def leaf(t):
            return t.detach().float().clone().requires_grad_()

        gate_up, down = leaf(torch.cat([w64.w_gate, w64.w_up], 1)[mine]), leaf(w64.w_down[mine])
        sgu, sd = leaf(torch.cat([w64.shared_w_gate, w64.shared_w_up], 0)), leaf(w64.shared_w_down)
        x, tw = leaf(p.x), leaf(p.tw)
        out = train_ep.nccl_train_layer(x, p.idx, tw, gate_up, down, sgu, sd, SHAPE.num_experts)
        out.backward(p.grad_out.float())
        fp32 = dict(rtol=tol.FP32_RTOL, atol=tol.FP32_ATOL)
        start = sum(counts[:rank])
        here = slice(start, start + counts[rank])
        gx = torch.cat([q.x for q in ranks])
        gi, gtw = torch.cat([q.idx for q in ranks]), torch.cat([q.tw for q in ranks])
        ggo = torch.cat([q.grad_out for q in ranks])
        want = moe_backward(ggo, gx, gi, gtw, w64, torch.float64)
        want_out = moe_forward(gx, gi, gtw, w64, torch.float64)[here]
        torch.testing.assert_close(out.double(), want_out, **fp32)
        torch.testing.assert_close(x.grad.double(), want.dx[here], **fp32)
        torch.testing.assert_close(tw.grad.double(), want.d_topk_weights[here], **fp32)
        i = SHAPE.intermediate
        torch.testing.assert_close(gate_up.grad[:, :i].double(), want.dw_gate[mine], **fp32)
        torch.testing.assert_close(gate_up.grad[:, i:].double(), want.dw_up[mine], **fp32)
        torch.testing.assert_close(down.grad.double(), want.dw_down[mine], **fp32)
        own = moe_backward(p.grad_out, p.x, p.idx, p.tw, w64, torch.float64)  # its own tokens
        si = SHAPE.shared_intermediate
        torch.testing.assert_close(sgu.grad[:si].double(), own.d_shared_w_gate, **fp32)
        torch.testing.assert_close(sd.grad.double(), own.d_shared_w_down, **fp32)
    finally:
        dist.destroy_process_group()


def test_nccl_pipeline_over_two_gloo_processes(tmp_path):
    """The pipeline as it runs under torchrun, its collectives on gloo instead of NCCL: each
    rank's output and every gradient against the whole problem's fp64 reference (oracle
    anchor), ranks with different token counts."""
    mp.spawn(_gloo_rank, args=(2, f"file://{tmp_path / 'store'}", (10, 6)), nprocs=2, join=True)


# ---- one EP case end to end, the world and the GPU replaced -------------------------------------
R_FAKE, RANK_FAKE = 4, 1
GROUP = object()  # the world's group, as run_model passes it on


@pytest.fixture
def fake_ep(monkeypatch):
    """Rank 1 of a world of 4 with stand-ins for the GPU and the collectives: the routing draw
    (this rank's slice of a 4-rank draw: global expert ids), the timer, the memory counters, the
    max over ranks (this rank's values), mok's layer and the NCCL pipeline (both the one-rank
    torch-best layer on the local experts, ids taken modulo L, recording what they got); DeepEP
    absent."""
    import sys

    import mok.functional as mf

    calls = {"moe": [], "nccl": [], "timed": 0}
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: R_FAKE)
    monkeypatch.setattr(dist, "get_rank", lambda group=None: RANK_FAKE)
    monkeypatch.setattr(train, "max_over_ranks", lambda values: [float(v) for v in values])
    monkeypatch.setitem(sys.modules, "deep_ep", None)  # `import deep_ep` raises ImportError

    def draw(n, e, k, skew, seed=None):
        t = make_routing(n, e, k, R_FAKE, skew, seed=seed)
        idx, w = t.rank_slice(RANK_FAKE)
        return torch.from_numpy(idx), torch.from_numpy(w), t

    def moe(x, idx, tw, w, num_experts, config=None, group=None, fused=False, recompute=True):
        calls["moe"].append(SimpleNamespace(w=w, config=config, group=group, fused=fused,
                                            num_experts=num_experts))  # fmt: skip
        sgu = torch.cat([w.shared_w_gate, w.shared_w_up])  # tiny has a shared expert
        gate_up = torch.cat([w.w_gate, w.w_up], 1)
        local = idx % gate_up.shape[0]  # (not distinct: the reference would refuse it)
        return train.torch_best_train_layer(x, local, tw, gate_up, w.w_down, sgu, w.shared_w_down)

    def nccl(x, idx, tw, gate_up, down, sgu, sd, num_experts, group=None):
        calls["nccl"].append((num_experts, group, gate_up.shape[0]))
        return train.torch_best_train_layer(x, idx % gate_up.shape[0], tw, gate_up, down, sgu, sd)

    monkeypatch.setattr(train, "draw_routing", draw)
    monkeypatch.setattr(mf, "moe", moe)
    monkeypatch.setattr(train, "nccl_train_layer", nccl)
    stub_timer_and_memory(monkeypatch, calls)
    return calls


def _run(rec, impls, shared=False, sms=(8,)):
    train.run_model(rec, "tiny", 40, "uniform", impls, sms, 2, 1, 0, "cpu", 0.0, GROUP, (24,),
                    shared)  # fmt: skip


def test_an_ep_case_gives_labelled_rows_of_the_real_model_shape(fake_ep, tmp_path, capsys):
    rec = train.TrainRecorder(str(tmp_path / "ep.csv"), META)
    _run(rec, tuple(train.DEFAULT_IMPLS[1].split(",")))
    got = [(r["impl"], r["mode"], r["sms"]) for r in rec.rows]
    assert got == [
        ("torch-best+nccl", "eager", 0),
        ("mok-unfused", "dedup_pull", 132),
        ("mok-saved", "dedup_pull", 132),
        ("mok-fused", "dedup_pull", 8),
        ("mok-fused-saved", "dedup_pull", 8),
    ]
    fwd = 40 * 4 * 6 * 256 * 128 + 40 * 6 * 256 * 128  # tiny: top-4, 256 x 128, shared 128
    for r in rec.rows:
        assert (r["num_experts"], r["ep"], r["emulated_ep"]) == (16, 4, 4)  # the model's experts
        assert (r["shared_gpu"], r["note"], r["flops_fwd"]) == (False, "", fwd)
        assert (r["peak_mem_gib"], r["step_mem_gib"]) == (3.0, 2.0)
    # each rank holds 16 / 4 experts; mok got the world's group and the global expert count
    assert set(fake_ep["nccl"]) == {(16, GROUP, 4)}
    assert all(c.w.w_gate.shape[0] == 4 and c.group is GROUP for c in fake_ep["moe"])
    assert all(c.num_experts == 16 for c in fake_ep["moe"])
    assert all(c.config is None for c in fake_ep["moe"] if not c.fused)  # the default config
    out = capsys.readouterr().out
    assert "DeepEP not importable" in out and "torch-best+deepep skipped" in out
    assert "tiny EP4  N=   40  uniform   torch-best+nccl      eager" in out
    rec.write()
    header = (tmp_path / "ep.csv").read_text().splitlines()[0].split(",")
    assert header[header.index("emulated_ep") + 1] == "ep"
    assert header[header.index("sm_mhz") + 1 : header.index("sm_mhz") + 3] == ["shared_gpu", "note"]


def test_shared_gpu_ranks_run_only_mok_labelled_as_a_smoke_test(fake_ep, capsys):
    rec = train.TrainRecorder(None, META)
    _run(rec, tuple(train.DEFAULT_IMPLS[1].split(",")), shared=True, sms=(8, 16))
    assert [r["impl"] for r in rec.rows] == [
        "mok-unfused", "mok-saved", "mok-fused", "mok-fused", "mok-fused-saved", "mok-fused-saved"
    ]  # fmt: skip
    assert fake_ep["nccl"] == []  # no NCCL on gloo ranks
    for r in rec.rows:
        assert r["shared_gpu"] is True and "not NVLink measurements" in r["note"]
    # every wait across ranks gets the long bound: the ranks time-slice the GPU
    assert {c.config.wait_timeout_ms for c in fake_ep["moe"]} == {train.SHARED_GPU_WAIT_MS}
    assert "[shared-GPU smoke test]" in capsys.readouterr().out


def test_a_step_that_is_not_repeatable_fails(fake_ep, monkeypatch):
    import mok.functional as mf

    calls = {"n": 0}
    stub = mf.moe

    def drifting(x, idx, tw, w, *a, **kw):
        calls["n"] += 1
        return stub(x, idx, tw, w, *a, **kw) * (1 + calls["n"] * 2.0**-6)

    monkeypatch.setattr(mf, "moe", drifting)
    with pytest.raises(RuntimeError, match=r"mok-unfused \(dedup_pull\): dx / d_topk_weights"):
        _run(train.TrainRecorder(None, META), ("mok-unfused",))


def test_a_non_finite_gradient_fails(fake_ep, monkeypatch):
    import mok.functional as mf

    stub = mf.moe
    monkeypatch.setattr(mf, "moe", lambda *a, **kw: stub(*a, **kw) * float("inf"))
    with pytest.raises(RuntimeError, match=r"mok-saved \(dedup_pull\): the step left non-finite"):
        _run(train.TrainRecorder(None, META), ("mok-saved",))


def test_a_failure_on_another_rank_stops_this_one_too(fake_ep, monkeypatch):
    monkeypatch.setattr(train, "max_over_ranks", lambda values: [1.0] * len(values))  # one failed
    with pytest.raises(RuntimeError, match=r"torch-best\+nccl \(eager\): failed on another rank"):
        _run(train.TrainRecorder(None, META), ("torch-best+nccl",))
