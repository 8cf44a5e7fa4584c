"""The training-step benchmark (mok.bench train) on the CPU: its parser and refusals, the FLOP
accounting, the differentiable torch-best layer's output and every gradient against the
reference, and one whole case run with stand-ins for the GPU (CUDA-event timer, memory counters,
SM count, mok's layer)."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import torch

from mok.bench import sonicmoe, train
from mok.bench.common import Timing
from mok.errors import MoKUnsupportedError
from mok.experts import _halves_of_one
from mok.spec.rows import bench_routing_seed
from mok.spec.workload import ModelShape, get_shape, make_routing
from reference.moe import moe_backward, moe_forward
from reference.weights import MoEWeights
from tests import tolerances as tol

META = {"gpu": "NVIDIA H200", "num_ranks": 1, "torch": "2.11", "cuda": "13.0", "git_sha": "abc"}
TRAIN_COLUMNS = (
    "model,hidden,intermediate,num_experts,num_topk,skew,tokens_per_rank,routing_seed,emulated_ep,"
    "ep,impl,mode,sms,fwd_us,bwd_us,step_us,p20_us,p80_us,flops_fwd,flops_recompute,step_tflops,"
    "fwd_tflops,bwd_tflops,peak_mem_gib,step_mem_gib,sm_mhz,shared_gpu,note,gpu,num_ranks,torch,cuda,git_sha"
)
TINY = [
    ModelShape("shared", 8, 64, 32, 4, shared_intermediate=32),
    ModelShape("noshared", 8, 64, 32, 4),
]


# ---- command line ------------------------------------------------------------------------------
def test_parser_keeps_its_defaults():
    """On one GPU (a world of one) the resolved defaults are the one-GPU benchmark's."""
    ap = train.build_parser()
    a = train.resolve_args(ap, ap.parse_args([]), world=1, shared=False)
    assert (a.models, a.tokens, a.skews) == (
        "deepseek-v3,kimi-k2,qwen3-30b-a3b",
        "4096",
        "uniform,hot:0.5",
    )
    assert (a.impls, a.sms, a.iters, a.warmup, a.warm_s, a.emulate_ep) == (
        ("torch-best", "mok-unfused", "mok-saved", "mok-fused", "mok-fused-saved"),
        "8,16",
        10,
        3,
        1.0,
        2,
    )
    assert a.csv == "mok-bench-train.csv"
    assert train.build_parser().prog == "python -m mok.bench train"


def test_the_sonicmoe_suite_runs_its_shapes_at_its_token_counts():
    """--suite sonicmoe: SonicMoE's four shapes (E, d, n, K of its Fig. 14, no shared expert),
    every expert on the one GPU, uniform routing; refused under torchrun."""
    ap = train.build_parser()
    a = train.resolve_args(ap, ap.parse_args(["--suite", "sonicmoe"]), world=1, shared=False)
    assert (a.emulate_ep, a.skews) == (1, "uniform")
    shapes = [get_shape(m) for m in a.models.split(",")]
    assert [(s.num_experts, s.hidden, s.intermediate, s.num_topk) for s in shapes] == [
        (128, 1536, 256, 8),
        (128, 4096, 512, 8),
        (64, 4096, 1024, 4),
        (64, 4096, 2048, 4),
    ]
    assert all(s.shared_intermediate == 0 for s in shapes)
    assert [p.tokens for p in sonicmoe.SONICMOE_H100] == [24576, 32768, 32768, 32768]
    # SonicMoE's count is the layer's forward FLOPs where there is no shared expert
    for p, s in zip(sonicmoe.SONICMOE_H100, shapes, strict=True):
        fwd, bwd = sonicmoe.sonicmoe_flops(p.tokens, s.hidden, s.intermediate, s.num_topk)
        assert train.step_flops(s, p.tokens, recompute=False) == (fwd, 0) and bwd == 2 * fwd
    with pytest.raises(SystemExit):
        train.resolve_args(ap, ap.parse_args(["--suite", "sonicmoe"]), world=2, shared=False)


def test_the_sonicmoe_table_puts_each_row_beside_the_published_figures():
    p = sonicmoe.SONICMOE_H100[2]
    s = get_shape(p.model)
    row = dict(model=p.model, tokens_per_rank=p.tokens, hidden=s.hidden,
               intermediate=s.intermediate, num_experts=s.num_experts, num_topk=s.num_topk,
               impl="mok-saved", mode="pull", sms=24, fwd_tflops=440.0, bwd_tflops=555.0,
               sm_mhz=1755)  # fmt: skip
    other = dict(row, model="deepseek-v3")  # not one of SonicMoE's shapes: no line
    lines = sonicmoe.comparison_lines([row, other])
    assert len(lines) == 3
    assert lines[2] == (
        "| 32768, 4096, 1024, 64, 4 | 550 / 555 | mok-saved (pull, 24) | 440 / 555 | 0.80 / 1.00 "
        "| 1755 |"
    )


def test_without_a_gpu_it_refuses_and_names_the_command(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(MoKUnsupportedError, match=r"^mok.bench train needs a CUDA GPU \(torch"):
        train.main(["--models", "tiny"])


@pytest.mark.parametrize(
    ("argv", "env", "why"),
    [
        (["--impls", "torch-best,nope"], {}, "unknown --impls nope"),
        (["--emulate-ep", "-2"], {}, "--emulate-ep must be >= 0"),
        (["--emulate-ep", "2"], {"WORLD_SIZE": "2"}, "under torchrun the EP size is the world"),
        (["--impls", "torch-best+nccl"], {}, "torch-best+nccl: EP > 1 only, under torchrun"),
        (["--models", "deepseek-v3", "--emulate-ep", "3"], {}, "do not split over EP3"),
        (["--models", "nope"], {}, "unknown model shape 'nope'"),
        (["--kernels"], {"WORLD_SIZE": "2"}, "--kernels profiles one GPU's step"),
    ],
)
def test_bad_arguments_stop_before_any_gpu_work(argv, env, why, monkeypatch, capsys):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setattr(train, "init_dist", lambda *a: pytest.fail("started the process group"))
    with pytest.raises(SystemExit) as e:
        train.main(argv)
    assert e.value.code == 2 and why in capsys.readouterr().err


# ---- FLOPs -------------------------------------------------------------------------------------
def test_step_flops_counts_the_forward_gemms_and_the_recompute():
    dsv3 = get_shape("deepseek-v3")  # 7168 x 2048, top-8, shared expert 2048
    fwd, again = train.step_flops(dsv3, 4096, recompute=True)
    assert fwd == 4096 * 8 * 6 * 7168 * 2048 + 4096 * 6 * 7168 * 2048
    assert fwd == 4096 * (dsv3.routed_flops_per_token() + dsv3.shared_flops_per_token())
    # mok's backward runs the gate / up GEMMs again (4 of the 6 H I per routed row and shared)
    assert again == 4096 * 8 * 4 * 7168 * 2048 + 4096 * 4 * 7168 * 2048
    assert train.step_flops(dsv3, 4096, recompute=False) == (fwd, 0)
    # the experts' count (emulated EP) changes nothing: every routed row is computed once
    half = dataclasses.replace(dsv3, num_experts=128)
    assert train.step_flops(half, 4096, recompute=True) == (fwd, again)
    qwen = get_shape("qwen3-30b-a3b")  # no shared expert
    assert train.step_flops(qwen, 100, recompute=False) == (100 * 8 * 6 * 2048 * 768, 0)


# ---- the differentiable torch-best layer -------------------------------------------------------
def _case(shape: ModelShape, skew: str, seed: int = 5, num_routed: int | None = None):
    """bf16 weights, x, grad_out and a routing of 40 tokens (over the first ``num_routed``
    experts only, when given)."""
    w = MoEWeights.random(shape, seed=seed, dtype=torch.bfloat16)
    g = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(40, shape.hidden, generator=g).to(torch.bfloat16)
    grad_out = torch.randn(40, shape.hidden, generator=g).to(torch.bfloat16)
    e = shape.num_experts if num_routed is None else num_routed
    t = make_routing(40, e, shape.num_topk, 1, skew, seed=40)
    return w, x, grad_out, torch.from_numpy(t.topk_idx), torch.from_numpy(t.topk_weights).float()


def _torch_best_grads(w: MoEWeights, x, grad_out, idx, tw, dtype):
    """(output, {gradient name: gradient}) of torch_best_train_layer on ``dtype`` leaves in the
    fused layout; the names are the reference's (gate_up's gradient split into its halves)."""
    i = w.intermediate

    def leaf(t):
        return t.detach().to(dtype).clone().requires_grad_()

    gate_up, down = leaf(torch.cat([w.w_gate, w.w_up], 1)), leaf(w.w_down)
    shared = ()
    if w.has_shared:
        shared = (leaf(torch.cat([w.shared_w_gate, w.shared_w_up], 0)), leaf(w.shared_w_down))
    xs, tws = leaf(x), tw.detach().clone().requires_grad_()
    out = train.torch_best_train_layer(xs, idx, tws, gate_up, down, *shared)
    out.backward(grad_out.to(dtype))
    assert (out.dtype, xs.grad.dtype, gate_up.grad.dtype, tws.grad.dtype) == (dtype,) * 3 + (
        torch.float32,
    )
    got = {"dx": xs.grad, "d_topk_weights": tws.grad, "dw_down": down.grad}
    got.update(dw_gate=gate_up.grad[:, :i], dw_up=gate_up.grad[:, i:])
    if shared:
        si = w.shared_w_gate.shape[0]
        got.update(d_shared_w_gate=shared[0].grad[:si], d_shared_w_up=shared[0].grad[si:])
        got.update(d_shared_w_down=shared[1].grad)
    return out.detach(), got


def _reference(w: MoEWeights, x, grad_out, idx, tw, mode):
    if mode == torch.float64:
        w, x, grad_out, tw = w.to(torch.float64), x.double(), grad_out.double(), tw.double()
    return moe_forward(x, idx, tw, w, mode), moe_backward(grad_out, x, idx, tw, w, mode)


def _names(shape: ModelShape) -> list[str]:
    names = ["dx", "d_topk_weights", "dw_gate", "dw_up", "dw_down"]
    if shape.shared_intermediate:
        names += ["d_shared_w_gate", "d_shared_w_up", "d_shared_w_down"]
    return names


@pytest.mark.parametrize("shape", TINY, ids=[s.name for s in TINY])
@pytest.mark.parametrize("skew", ["uniform", "hot:0.5"])
def test_torch_best_train_layer_in_fp32_is_the_reference_layer_and_its_backward(shape, skew):
    """Run in fp32 (torch._grouped_mm's CPU path takes fp32 as well as bf16), the layer and every
    gradient are the reference's fp64 oracle up to fp32 rounding: the construction (sort,
    gathers, fused gate/up weight, k-sum, shared expert) is the layer's and autograd
    differentiates all of it."""
    w, x, grad_out, idx, tw = _case(shape, skew)
    out, got = _torch_best_grads(w, x, grad_out, idx, tw, torch.float32)
    want_out, want = _reference(w, x, grad_out, idx, tw, torch.float64)
    torch.testing.assert_close(out.double(), want_out, rtol=tol.FP32_RTOL, atol=tol.FP32_ATOL)
    for name in _names(shape):
        torch.testing.assert_close(
            got[name].double(),
            getattr(want, name),
            rtol=tol.FP32_RTOL,
            atol=tol.FP32_ATOL,
            msg=lambda m, name=name: f"{name}: {m}",
        )


@pytest.mark.parametrize("shape", TINY, ids=[s.name for s in TINY])
@pytest.mark.parametrize("skew", ["uniform", "hot:0.5"])
def test_torch_best_train_layer_in_bf16_against_the_reference(shape, skew):
    """In bf16, as it is timed: the output and dx under the bf16 rule against the bf16
    reference; the routing-weight and weight gradients within BF16_REF_REL_ERR of their scale
    (the baseline rounds g, u and its SwiGLU to bf16 and sums the k slots in a bf16 bmm, as a
    bf16 torch model does; measured 2-3x the bf16 reference's error there, which the reference
    keeps in fp32, at ~5e-3 of the scale), as tests/test_mok_autograd_gpu.py holds mok's."""
    w, x, grad_out, idx, tw = _case(shape, skew)
    out, got = _torch_best_grads(w, x, grad_out, idx, tw, torch.bfloat16)
    oracle_out, oracle = _reference(w, x, grad_out, idx, tw, torch.float64)
    ref_out, ref = _reference(w, x, grad_out, idx, tw, torch.bfloat16)
    tol.assert_bf16_rule(out, ref_out, oracle_out)
    tol.assert_bf16_rule(got["dx"], ref.dx, oracle.dx)
    for name in _names(shape)[1:]:
        tol.assert_bf16_ref_bound(got[name].double(), getattr(oracle, name), name)


def test_an_expert_without_rows_gets_a_zero_gradient():
    shape = TINY[0]
    w, x, grad_out, idx, tw = _case(shape, "uniform", num_routed=shape.num_experts - 2)
    _, got = _torch_best_grads(w, x, grad_out, idx, tw, torch.bfloat16)
    for name in ("dw_gate", "dw_up", "dw_down"):
        assert torch.count_nonzero(got[name][-2:]) == 0, name
        assert torch.count_nonzero(got[name][0]) > 0, name


def test_swiglu_is_differentiable_and_leaves_its_input_alone():
    gu = torch.randn(5, 6, dtype=torch.float64, requires_grad=True)
    keep = gu.detach().clone()
    assert torch.autograd.gradcheck(train.swiglu, (gu,))
    h = train.swiglu(gu)
    assert torch.equal(gu.detach(), keep)
    torch.testing.assert_close(h, torch.nn.functional.silu(keep[:, :3]) * keep[:, 3:])


# ---- one case end to end, the GPU replaced ------------------------------------------------------
@pytest.fixture
def no_gpu(monkeypatch):
    """Stand-ins for what run_model needs of a GPU: the routing draw (CPU tensors), the timer
    (one call; forward 1000 us, step 3000 us), the memory counters (1 GiB before, 3 GiB peak),
    the SM count and mok's layer (the reference layer in fp32, which autograd differentiates;
    it records the weights and config it got)."""
    import mok.functional as mf

    calls = {"moe": [], "timed": 0}

    def draw(n, e, k, skew, seed=None):
        t = make_routing(n, e, k, 1, skew, seed=seed)
        return torch.from_numpy(t.topk_idx), torch.from_numpy(t.topk_weights), t

    def moe(x, idx, tw, w, num_experts, config=None, group=None, fused=False, recompute=True):
        calls["moe"].append((w, config, fused, num_experts, recompute))
        return moe_forward(x, idx, tw, w, torch.float32).to(x.dtype)

    monkeypatch.setattr(train, "draw_routing", draw)
    monkeypatch.setattr(train, "compiled", lambda fn: fn)  # compile mode runs eager here
    monkeypatch.setattr(mf, "moe", moe)
    stub_timer_and_memory(monkeypatch, calls)
    return calls


def stub_timer_and_memory(monkeypatch, calls: dict) -> None:
    """train's timer (one call: forward 1000 us, step 3000 us, counted in ``calls["timed"]``),
    the memory counters (1 GiB before a step, 3 GiB peak) and the SM count (132), no GPU."""
    gib = 2**30

    def time_cuda(fn, iters, warmup, then=None, warm_s=0.0, clocks=False):
        fn()
        calls["timed"] += 1
        step = calls["timed"] % 2 == 0  # each row times its forward, then its step
        return Timing(3000.0, 2900.0, 3300.0) if step else Timing(1000.0, 900.0, 1100.0)

    monkeypatch.setattr(train, "time_cuda", time_cuda)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda *a: gib)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda *a: None)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda *a: 3 * gib)
    monkeypatch.setattr(
        torch.cuda, "get_device_properties", lambda *a: SimpleNamespace(multi_processor_count=132)
    )


def test_one_case_gives_a_row_per_implementation(no_gpu, tmp_path, capsys):
    rec = train.TrainRecorder(str(tmp_path / "train.csv"), META)
    impls = ("torch-best", "mok-unfused", "mok-fused")
    train.run_model(rec, "tiny", 40, "hot:0.5", impls, (8, 16), 2, 1, 2, device="cpu")
    got = [(r["impl"], r["mode"], r["sms"]) for r in rec.rows]
    assert got == [
        ("torch-best", "eager", 0),
        ("torch-best", "compile", 0),
        ("mok-unfused", "dedup_pull", 132),  # what ran: unfused_config's SMs
        ("mok-fused", "dedup_pull", 8),
        ("mok-fused", "dedup_pull", 16),
    ]
    tiny = get_shape("tiny")  # 16 experts, 256 x 128, top-4, shared 128; EP2 emulated: 8 here
    fwd = 40 * 4 * 6 * 256 * 128 + 40 * 6 * 256 * 128
    again = 40 * 4 * 4 * 256 * 128 + 40 * 4 * 256 * 128
    for r in rec.rows:
        assert (r["model"], r["num_experts"], r["hidden"], r["intermediate"]) == (
            "tiny",
            8,
            256,
            128,
        )
        assert (r["num_topk"], r["skew"], r["tokens_per_rank"]) == (tiny.num_topk, "hot:0.5", 40)
        assert (r["routing_seed"], r["emulated_ep"], r["ep"]) == (bench_routing_seed(40), 2, 1)
        assert (r["shared_gpu"], r["note"]) == (False, "")
        assert (r["fwd_us"], r["bwd_us"], r["step_us"], r["p20_us"], r["p80_us"]) == (
            1000.0,
            2000.0,
            3000.0,
            2900.0,
            3300.0,
        )
        mok_row = r["impl"].startswith("mok")
        assert (r["flops_fwd"], r["flops_recompute"]) == (fwd, again if mok_row else 0)
        assert r["step_tflops"] == round(3 * fwd / 3000e6, 1)
        assert r["fwd_tflops"] == round(fwd / 1000e6, 1)
        assert r["bwd_tflops"] == round(2 * fwd / 2000e6, 1)
        assert (r["peak_mem_gib"], r["step_mem_gib"]) == (3.0, 2.0)
    # mok saw the fused layout (mok.MoE's gate_up halves), fused kernel or not
    unfused = [c for c in no_gpu["moe"] if not c[2]]
    fused = [c for c in no_gpu["moe"] if c[2]]
    assert unfused and fused
    assert all(_halves_of_one(w.w_gate, w.w_up) is not None for w, *_ in no_gpu["moe"])
    assert all(c[1] is None and c[3] == 8 for c in unfused)  # the default config
    assert {c[1].num_comm_sms for c in fused} == {8, 16}
    assert all(w.has_shared for w, *_ in no_gpu["moe"])
    out = capsys.readouterr().out
    assert "tiny EP1  N=   40  hot:0.5        torch-best      eager sms=  0" in out
    assert "fwd   1000.0 bwd   2000.0 step   3000.0 us" in out and "mem +2.00 of 3.00 GiB" in out
    rec.write()
    lines = (tmp_path / "train.csv").read_text().splitlines()
    assert lines[0] == TRAIN_COLUMNS and len(lines) == 1 + len(rec.rows)


def test_kernels_profiles_each_row_and_prints_the_largest(no_gpu, tmp_path, capsys):
    from mok.bench.kernel_times import KernelRecorder

    rec = train.TrainRecorder(str(tmp_path / "train.csv"), META)
    krec = KernelRecorder(str(tmp_path / "train-kernels.csv"), META)
    impls = ("torch-best", "mok-saved")
    train.run_model(rec, "tiny", 40, "uniform", impls, (8,), 2, 1, 2, "cpu", kernels=krec)
    rows = [(r["impl"], r["mode"]) for r in rec.rows]
    profiled = list(dict.fromkeys((r["impl"], r["mode"]) for r in krec.rows))
    assert profiled == rows  # every train row, in order; the CPU's ops stand in for kernels
    for impl, mode in rows:
        mine = [r for r in krec.rows if (r["impl"], r["mode"]) == (impl, mode)]
        assert sum(r["share"] for r in mine) == pytest.approx(1.0, abs=1e-3)
        assert all(r["us_per_step"] >= 0 and r["model"] == "tiny" for r in mine)
        assert any(r["short"] in ("aten::mm", "aten::bmm", "aten::addmm") for r in mine)
    out = capsys.readouterr().out
    assert out.count("us/step calls  share  kernel") == len(rows)


def test_a_failing_compile_drops_its_row_and_says_why(no_gpu, monkeypatch, capsys):
    def broken(fn):
        def run(*a):
            raise RuntimeError("no inductor here")

        return run

    monkeypatch.setattr(train, "compiled", broken)
    rec = train.TrainRecorder(None, META)
    train.run_model(rec, "qwen3-30b-a3b", 16, "uniform", ("torch-best",), (), 1, 0, 16, "cpu")
    assert [(r["impl"], r["mode"]) for r in rec.rows] == [("torch-best", "eager")]
    assert rec.rows[0]["num_experts"] == 8  # 128 experts over EP16
    assert "torch.compile of torch-best failed (RuntimeError: no inductor here)" in (
        capsys.readouterr().out
    )


def test_a_step_that_leaves_a_leaf_without_gradient_is_an_error(no_gpu, monkeypatch):
    import mok.functional as mf

    def detached(x, idx, tw, w, *a, **kw):
        return (x + 0 * tw.sum()).detach().requires_grad_()  # no gradient reaches the weights

    monkeypatch.setattr(mf, "moe", detached)
    rec = train.TrainRecorder(None, META)
    with pytest.raises(RuntimeError, match=r"mok-unfused \(dedup_pull\): the step left no grad"):
        train.run_model(rec, "tiny", 8, "uniform", ("mok-unfused",), (), 1, 0, 0, "cpu")


def test_saving_rows_recompute_nothing(no_gpu, tmp_path):
    """mok-saved and mok-fused-saved call the layer with recompute=False (the fused one per comm-SM
    count) and count no recomputed FLOPs: the tiny shape's shared expert is kept too."""
    rec = train.TrainRecorder(str(tmp_path / "train.csv"), META)
    impls = ("mok-saved", "mok-fused-saved")
    train.run_model(rec, "tiny", 40, "uniform", impls, (8, 16), 2, 1, 2, device="cpu")
    got = [(r["impl"], r["sms"], r["flops_recompute"]) for r in rec.rows]
    assert got == [("mok-saved", 132, 0), ("mok-fused-saved", 8, 0), ("mok-fused-saved", 16, 0)]
    assert {(c[2], c[4]) for c in no_gpu["moe"]} == {(False, False), (True, False)}
