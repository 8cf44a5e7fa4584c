"""The experts' pieces benchmark (mok.bench experts) on the CPU: its parser and refusals, the
padded groups and FLOP counts, and one whole case run with stand-ins for the GPU (the timer, the
routing draw and mok's kernels; torch's pieces run for real on CPU tensors)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import mok
from mok import experts as me
from mok import ops
from mok.bench import experts
from mok.bench.common import Timing
from mok.errors import MoKUnsupportedError
from mok.layer import unfused_row_tile
from mok.spec.rows import bench_routing_seed
from mok.spec.workload import get_shape, make_routing

META = {"gpu": "NVIDIA H200", "num_ranks": 1, "torch": "2.11", "cuda": "13.0", "git_sha": "abc"}


def test_parser_keeps_its_defaults():
    a = experts.build_parser().parse_args([])
    assert (a.models, a.tokens, a.skews) == (
        "deepseek-v3,kimi-k2,qwen3-30b-a3b",
        "4096",
        "uniform,hot:0.5",
    )
    assert a.pieces == ",".join(experts.PIECES)
    assert (a.emulate_ep, a.iters, a.warmup, a.csv) == (2, 10, 3, "mok-bench-experts.csv")


def test_without_a_gpu_it_refuses_and_names_the_command(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(MoKUnsupportedError, match=r"^mok.bench experts needs a CUDA GPU"):
        experts.main(["--models", "tiny"])


@pytest.mark.parametrize(
    ("argv", "env", "why"),
    [
        (["--pieces", "dW_down,nope"], {}, "unknown --pieces nope"),
        (["--emulate-ep", "-1"], {}, "--emulate-ep must be >= 0"),
        ([], {"WORLD_SIZE": "2"}, "runs on one GPU"),
    ],
)
def test_bad_arguments_stop_before_any_gpu_work(argv, env, why, monkeypatch, capsys):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setattr(experts, "init_dist", lambda *a: pytest.fail("started the process group"))
    with pytest.raises(SystemExit) as e:
        experts.main(argv)
    assert e.value.code == 2 and why in capsys.readouterr().err


def test_groups_are_padded_to_the_row_tile():
    # top-1 routing: 5 tokens to expert 0, none to 1, 64 to 2, 65 to 3
    idx = torch.tensor([0] * 5 + [2] * 64 + [3] * 65, dtype=torch.int32)[:, None]
    ends, total, _ = experts.gathered_rows(idx, 4, 64)
    assert ends.tolist() == [64, 64, 128, 256] and ends.dtype == torch.int32 and total == 256


def test_piece_flops_count_the_routed_rows_gemms():
    g = 2 * 10 * 7168 * 2048
    want = dict(dW_gate_up=2 * g, dW_down=g, gate_up_dgrad=2 * g, bwd_recompute=3 * g)
    want.update(bwd_from_saved=g, bwd_saved_all=6 * g, fwd_saving=3 * g)
    want.update(fwd_gate_up=2 * g, fwd_down=g)
    assert {p: experts.piece_flops(p, 10, 7168, 2048) for p in experts.PIECES} == want


def test_one_case_gives_a_row_per_piece_and_implementation(monkeypatch, tmp_path, capsys):
    calls = {"mok": []}
    default = ops.WGRAD_GU_TRANSPOSED

    def draw(n, e, k, skew, seed=None):
        t = make_routing(n, e, k, 1, skew, seed=seed)
        return torch.from_numpy(t.topk_idx), torch.from_numpy(t.topk_weights), t

    def time_cuda(fn, iters, warmup, then=None, warm_s=0.0, clocks=False):
        fn()  # torch's pieces for real; mok's through the stand-ins below
        return Timing(100.0, 90.0, 120.0)

    def wgrad(a, b, ends, c, accumulate=False, transposed=False):
        calls["mok"].append(("wgrad", a.shape, b.shape, ends.tolist(), c.shape, transposed))

    def wgrad_gather(other, tokens, row_src, topk, operand, ends, c, accumulate, transposed=False):
        calls["mok"].append(("gather", operand, tokens.shape, row_src.shape, c.shape, transposed))

    def bwd(a, wgu, wd, dy, row_w, offs, saved=None):
        calls["mok"].append(("bwd", saved is not None, offs.tolist()))

    def dgrad(dgu, wgu, offs):
        calls["mok"].append(("dgrad", dgu.shape, wgu.shape))

    def whole(a, wgu, wd, dy, row_w, offs, fused=None, group_align=1, saved_gu=None):
        calls["mok"].append(("whole", fused, group_align, saved_gu, ops.WGRAD_GU_TRANSPOSED))

    def saving(a, wgu, wd, offs):
        calls["mok"].append(("saving", offs.tolist()))
        return None, "saved"

    monkeypatch.setattr(experts, "draw_routing", draw)
    monkeypatch.setattr(experts, "time_cuda", time_cuda)
    monkeypatch.setattr(ops, "wgrad_sm90", wgrad)
    monkeypatch.setattr(ops, "wgrad_gather_sm90", wgrad_gather)

    def dh_gather(x, dy, src, topk, wgu, wd, ends, row_w, hw, dgu, part, gu32):
        calls["mok"].append(("dh gather", x.shape, src.shape, hw.shape, gu32 is not None))

    def whole_gather(x, dy, src, topk, rows, wgu, wd, row_w, ends, into, saved):
        calls["mok"].append(("whole gather", x.shape, rows, saved, ops.WGRAD_GU_TRANSPOSED))

    monkeypatch.setattr(ops, "swiglu_backward_gather_sm90", dh_gather)
    monkeypatch.setattr(me, "swiglu_backward_gathered", whole_gather)
    monkeypatch.setattr(me, "_swiglu_backward_sm90", bwd)
    monkeypatch.setattr(me, "grouped_swiglu_saving", saving)

    def saving_kernel(a, wgu, wd, ends):
        calls["mok"].append(("saving kernel", a.shape, ends.tolist()))

    monkeypatch.setattr(me, "_saving", saving_kernel)
    monkeypatch.setattr(me, "gate_up_dgrad", dgrad)
    monkeypatch.setattr(me, "swiglu_backward", whole)
    rec = experts.ExpertsRecorder(str(tmp_path / "experts.csv"), META)
    experts.run_case(rec, "tiny", 40, "uniform", experts.PIECES, 2, 1, 2, "cpu")
    got = [(r["piece"], r["impl"]) for r in rec.rows]
    assert got == [
        ("dW_gate_up", "mok"),
        ("dW_gate_up", "torch"),
        ("dW_gate_up", "mok-gather"),
        ("dW_gate_up", "mok-t"),
        ("dW_gate_up", "mok-gather-t"),
        ("dW_gate_up", "mok-ts"),
        ("dW_gate_up", "mok-gather-ts"),
        ("dW_down", "mok"),
        ("dW_down", "torch"),
        ("dW_down", "mok-gather"),
        ("gate_up_dgrad", "mok"),
        ("gate_up_dgrad", "torch"),
        ("bwd_recompute", "mok"),
        ("bwd_recompute", "torch"),
        ("bwd_recompute", "mok-gather"),
        ("bwd_from_saved", "mok"),
        ("bwd_from_saved", "mok-gather"),
        ("bwd_saved_all", "mok"),
        ("bwd_saved_all", "mok-serial"),
        ("bwd_saved_all", "mok-gather"),
        ("bwd_saved_all", "mok-ts"),
        ("bwd_saved_all", "mok-gather-ts"),
        ("fwd_saving", "mok"),
        ("fwd_saving", "torch"),
        ("fwd_gate_up", "mok"),
        ("fwd_gate_up", "torch"),
        ("fwd_gate_up", "torch-dense"),
        ("fwd_down", "torch"),
        ("fwd_down", "torch-dense"),
    ]
    tiny = get_shape("tiny")  # 16 experts (8 at EP2), 256 x 128, top-4
    E, H, inter = tiny.num_experts // 2, tiny.hidden, tiny.intermediate
    idx = draw(40, E, tiny.num_topk, "uniform", bench_routing_seed(40))[0]
    ends, total, _ = experts.gathered_rows(idx, E, unfused_row_tile(mok.MoKConfig()))
    for r in rec.rows:
        assert (r["model"], r["num_experts"], r["hidden"], r["intermediate"]) == (
            "tiny",
            E,
            H,
            inter,
        )
        assert (r["rows"], r["padded_rows"], r["emulated_ep"]) == (40 * tiny.num_topk, total, 2)
        assert r["routing_seed"] == bench_routing_seed(40) and r["git_sha"] == "abc"
        assert (r["median_us"], r["p20_us"], r["p80_us"]) == (100.0, 90.0, 120.0)
        assert r["flops"] == experts.piece_flops(r["piece"], 40 * tiny.num_topk, H, inter)
        assert r["tflops"] == round(r["flops"] / 100e6, 1)
    # mok's kernels got the padded groups, the weight gradients their [L, M, N] outputs
    got = calls["mok"]
    gu, hd, gu_t = (E, 2 * inter, H), (E, H, inter), (E, H, 2 * inter)
    assert ("wgrad", (total, 2 * inter), (total, H), ends.tolist(), gu, False) in got
    assert ("wgrad", (total, H), (total, inter), ends.tolist(), hd, False) in got
    # the gathering kernels: x's rows (operand B) and dy's (operand A) from 40 tokens
    assert ("gather", 1, (40, H), (total,), gu, False) in got
    assert ("gather", 0, (40, H), (total,), hd, False) in got
    # dW_gate_up's transpose: x's rows the operand A, [L, H, 2I] out
    assert ("wgrad", (total, H), (total, 2 * inter), ends.tolist(), gu_t, False) in got
    assert ("gather", 0, (40, H), (total,), gu_t, False) in got
    # and stored transposed: the same operands, [L, 2I, H] out
    assert ("wgrad", (total, H), (total, 2 * inter), ends.tolist(), gu, True) in got
    assert ("gather", 0, (40, H), (total,), gu, True) in got
    for kept in (False, True):  # the gathering experts' kernel, g / u recomputed or read back
        assert ("dh gather", (40, H), (total,), (total, inter), kept) in got
    # the whole gathered backward, with the transposed dW_gate_up switch off and on (and back
    # off after its rows)
    for switch in (False, True):
        assert ("whole gather", (40, H), total, "saved", switch) in got
    assert ops.WGRAD_GU_TRANSPOSED is default  # each row's setting undone after it
    assert ("bwd", True, ends.tolist()) in calls["mok"]  # from the saved g / u
    assert ("saving kernel", (total, H), ends.tolist()) in calls["mok"]
    assert ("dgrad", (total, 2 * inter), (E, 2 * inter, H)) in calls["mok"]
    tile = unfused_row_tile(mok.MoKConfig())
    for fused in (True, False):  # the whole backward, from the saved g / u, aligned groups
        assert ("whole", fused, tile, "saved", False) in calls["mok"]  # mok, mok-serial: off
    assert ("whole", True, tile, "saved", True) in calls["mok"]  # mok-ts: the switch on
    assert "tiny  uniform      dW_gate_up        mok     100.0 us" in capsys.readouterr().out
    rec.write()
    lines = (tmp_path / "experts.csv").read_text().splitlines()
    assert lines[0].startswith("model,hidden,intermediate,num_experts,num_topk,skew,")
    assert lines[0].endswith(",tflops,sm_mhz,gpu,num_ranks,torch,cuda,git_sha")
    assert len(lines) == 1 + len(rec.rows)


@settings(max_examples=30, deadline=None)
@given(
    tokens=st.integers(0, 40),
    experts_=st.integers(1, 9),
    topk=st.integers(1, 4),
    align=st.sampled_from([1, 4, 16]),
    seed=st.integers(0, 2**16),
)
def test_gathered_rows_list_each_experts_entries_in_token_order(
    tokens, experts_, topk, align, seed
):
    topk = min(topk, experts_)
    g = torch.Generator().manual_seed(seed)
    rows = [torch.randperm(experts_, generator=g)[:topk] for _ in range(tokens)]
    idx = (torch.stack(rows) if rows else torch.zeros(0, topk, dtype=torch.long)).to(torch.int32)
    ends, total, row_src = experts.gathered_rows(idx, experts_, align)
    assert row_src.shape == (total,) and row_src.dtype == torch.int32
    flat = idx.reshape(-1).tolist()
    start = 0
    for e, end in enumerate(ends.tolist()):
        group = row_src[start:end].tolist()
        want = [i for i, x in enumerate(flat) if x == e]  # flat index order = token order
        assert group[: len(want)] == want
        assert all(v == -1 for v in group[len(want) :])  # the padding rows
        start = end
