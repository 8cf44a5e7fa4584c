"""The experts' backward from saved g / u in one launch (``mok.ops.bwd_fused_sm90``,
csrc/layer/sm90_bwd_fused.cuh) on one GPU: bitwise the unfused kernels' results (dh with the
SwiGLU backward, mok's gate / up dgrad, the weight gradients), mok's gate / up dgrad against an
fp64 oracle under the bf16 rule of torch's grouped GEMM, fp32 weight gradients added into
``main_grad`` buffers, bitwise repeatable, and a dependency that never completes reported as a
timeout instead of a hang."""

from __future__ import annotations

import pytest
import torch

from mok import ops, record
from mok.errors import MoKTimeoutError
from mok.experts import gate_up_dgrad, grouped_swiglu_saving, swiglu_backward
from tests import tolerances as tol
from tests.layer_problem import expert_operands

pytestmark = [pytest.mark.gpu, pytest.mark.sm90]

# (hidden, intermediate, rows per group: multiples of 16, empty groups, groups shorter than a
# tile and straddling tiles); 48 nonzero rows follow the last group.
CASES = [
    (256, 256, [16, 0, 144, 128, 32]),
    (2048, 768, [48, 0, 304, 64, 16, 128, 208, 0]),
    (7168, 2048, [256, 192, 272]),
]
TAIL = 48


def _operands(hidden, inter, sizes, seed=0):
    a, wgu, wd, dy, row_w, offs = expert_operands(hidden, inter, sizes, TAIL, seed)
    _, gu32 = grouped_swiglu_saving(a, wgu, wd, offs)
    return a, wgu, wd, dy, row_w, offs, gu32


@pytest.mark.parametrize(("hidden", "inter", "sizes"), CASES)
def test_fused_backward_is_the_unfused_kernels(hidden, inter, sizes):
    """One launch gives every output of the kernel-per-GEMM backward bitwise, twice."""
    a, wgu, wd, dy, row_w, offs, gu32 = _operands(hidden, inter, sizes)
    n = sum(sizes)
    kw = dict(group_align=16, saved_gu=gu32)
    got = swiglu_backward(a, wgu, wd, dy, row_w, offs, fused=True, **kw)
    want = swiglu_backward(a, wgu, wd, dy, row_w, offs, fused=False, **kw)
    again = swiglu_backward(a, wgu, wd, dy, row_w, offs, fused=True, **kw)
    names = ("d_a", "d_row_weight", "d_w_gate_up", "d_w_down")
    for i, (name, g, w, g2) in enumerate(zip(names, got, want, again, strict=True)):
        g, w, g2 = (g[:n], w[:n], g2[:n]) if i < 2 else (g, w, g2)
        assert torch.isfinite(g).all(), name
        assert torch.equal(g, w), f"{name}: fused != unfused"
        assert torch.equal(g, g2), f"{name}: two fused runs differ"
    for e, k in enumerate(sizes):
        if k == 0:  # an expert without rows: zero weight gradients
            assert not got[2][e].any() and not got[3][e].any()


@pytest.mark.parametrize(("hidden", "inter", "sizes"), CASES)
def test_staged_d_a_epilogue_is_the_direct_one(hidden, inter, sizes, monkeypatch):
    """``mok.ops.STAGED_DA`` (d_a staged in shared memory and stored by TMA) gives every output
    bitwise as each thread storing its own words does, rows past the last group untouched."""
    a, wgu, wd, dy, row_w, offs, gu32 = _operands(hidden, inter, sizes, seed=4)
    n = sum(sizes)
    runs = {}
    for staged in (False, True):
        monkeypatch.setattr(ops, "STAGED_DA", staged)
        # the d_a tiles alone (gate_up_dgrad's launch), into a filled buffer
        d_a = torch.full((a.shape[0], hidden), 7.0, dtype=torch.bfloat16, device="cuda")
        ops.bwd_fused_sm90(
            None, None, wgu, None, offs, None, None, None, gu32.to(torch.bfloat16), None, d_a,
            None, None, False, ops.BWD_RUN_DA, -1,
        )  # fmt: skip
        runs[staged] = (
            swiglu_backward(a, wgu, wd, dy, row_w, offs, group_align=16, saved_gu=gu32),
            d_a,
        )
    (off, d_off), (on, d_on) = runs[False], runs[True]
    names = ("d_a", "d_row_weight", "d_w_gate_up", "d_w_down")
    for i, (name, o, p) in enumerate(zip(names, off, on, strict=True)):
        o, p = (o[:n], p[:n]) if i < 2 else (o, p)
        assert torch.equal(o, p), f"{name} differs with the staged d_a epilogue"
    assert torch.equal(d_off, d_on), "gate_up_dgrad's d_a differs with the staged epilogue"
    assert (d_on[n:] == 7.0).all(), "the staged epilogue wrote rows past the last group"


@pytest.mark.parametrize(
    ("hidden", "inter", "sizes"),
    [(256, 256, [1, 17, 0, 100, 3]), (2048, 768, [40, 300, 0, 64, 65, 129, 192, 200])],
)
def test_staged_d_a_keeps_to_group_ends_off_the_box(hidden, inter, sizes, monkeypatch):
    """gate_up_dgrad takes group ends that are not multiples of the staged epilogue's 16-row
    box: with ``STAGED_DA`` its d_a is bitwise the direct stores', and the rows after the last
    group's end (mid-box) keep their values, so no box crosses into the next expert's rows."""
    a, wgu, _, _, _, offs = expert_operands(hidden, inter, sizes, TAIL, 6)
    g = torch.Generator(device="cuda").manual_seed(8)
    dgu = torch.randn(a.shape[0], 2 * inter, device="cuda", generator=g).to(torch.bfloat16)
    n, runs = sum(sizes), {}
    for staged in (False, True):
        monkeypatch.setattr(ops, "STAGED_DA", staged)
        d_a = torch.full((a.shape[0], hidden), 7.0, dtype=torch.bfloat16, device="cuda")
        ops.bwd_fused_sm90(
            None, None, wgu, None, offs, None, None, None, dgu, None, d_a, None, None, False,
            ops.BWD_RUN_DA, -1,
        )  # fmt: skip
        runs[staged] = d_a
    assert torch.equal(runs[True][:n], runs[False][:n]), "staged d_a differs from the direct"
    assert (runs[True][n:] == 7.0).all(), "the staged epilogue wrote rows past the group end"


@pytest.mark.parametrize(("hidden", "inter", "sizes"), CASES)
def test_gate_up_dgrad_against_fp64(hidden, inter, sizes):
    """mok's d_a = dgu @ w_gate_up per group within the bf16 rule of torch's grouped GEMM against
    fp64; rows past the last group are not written."""
    g = torch.Generator(device="cuda").manual_seed(1)
    rows = sum(sizes) + TAIL
    n = sum(sizes)
    dgu = torch.randn(rows, 2 * inter, device="cuda", generator=g).bfloat16()
    wgu = (torch.randn(len(sizes), 2 * inter, hidden, device="cuda", generator=g) * 0.05).bfloat16()
    offs = torch.tensor(sizes, device="cuda").cumsum(0).to(torch.int32)
    got = gate_up_dgrad(dgu, wgu, offs)
    ref = torch._grouped_mm(dgu, wgu, offs=offs)
    oracle, r = [], 0
    for e, k in enumerate(sizes):
        oracle.append(dgu[r : r + k].double() @ wgu[e].double())
        r += k
    tol.assert_bf16_rule(got[:n].double().cpu(), ref[:n].double().cpu(), torch.cat(oracle).cpu())
    sentinel = torch.full_like(got, float("nan"))
    ops.bwd_fused_sm90(
        None, None, wgu, None, offs, None, None, None, dgu, None, sentinel, None, None, False,
        ops.BWD_RUN_DA, -1,
    )  # fmt: skip
    assert torch.equal(sentinel[:n], got[:n]) and sentinel[n:].isnan().all()


def test_fused_backward_adds_fp32_weight_gradients_into_main_grad():
    """wgrad_into: each fp32 buffer becomes bitwise its start plus the unfused kernels' fp32
    sums, and the other outputs are the plain fused call's."""
    a, wgu, wd, dy, row_w, offs, gu32 = _operands(2048, 768, CASES[1][2], seed=2)
    kw = dict(group_align=16, saved_gu=gu32)
    plain = swiglu_backward(a, wgu, wd, dy, row_w, offs, fused=True, **kw)
    g = torch.Generator(device="cuda").manual_seed(3)
    start = tuple(torch.randn(w.shape, device="cuda", generator=g) for w in (wgu, wd))
    fused_acc = tuple(t.clone() for t in start)
    serial_acc = tuple(t.clone() for t in start)
    got = swiglu_backward(a, wgu, wd, dy, row_w, offs, fused=True, wgrad_into=fused_acc, **kw)
    swiglu_backward(a, wgu, wd, dy, row_w, offs, fused=False, wgrad_into=serial_acc, **kw)
    n = sum(CASES[1][2])  # rows past the last group are unspecified
    assert torch.equal(got[0][:n], plain[0][:n]) and torch.equal(got[1][:n], plain[1][:n])
    for f, s in zip(fused_acc, serial_acc, strict=True):
        assert torch.equal(f, s)


@pytest.mark.parametrize(("hidden", "inter", "sizes"), CASES)
def test_fused_weight_gradients_transposed_are_the_standalone_kernels(
    hidden, inter, sizes, monkeypatch
):
    """``mok.ops.WGRAD_GU_TRANSPOSED`` on: the fused launch's dW_gate_up tiles compute a^T dgu
    and store each tile transposed (its problem 0; dW_down's tiles, problem 1, as they are, in
    the same consumers and store warps). Its weight-gradient tasks alone (BWD_RUN_WGRAD, hw and
    dgu as inputs), bf16, fp32 and fp32 added onto the outputs: dW_gate_up is bitwise the
    standalone kernel's transposed form (``wgrad_sm90(a, dgu, ..., transposed=True)``) and
    dW_down bitwise its plain form, every element written, empty groups zeros; bitwise the
    whole launch's (BWD_RUN_ALL from saved g / u) as well."""
    a, wgu, wd, dy, row_w, offs, gu32 = _operands(hidden, inter, sizes, seed=7)
    rows = a.shape[0]
    g = torch.Generator(device="cuda").manual_seed(9)
    hw = torch.randn(rows, inter, device="cuda", generator=g).bfloat16()
    dgu = torch.randn(rows, 2 * inter, device="cuda", generator=g).bfloat16()
    monkeypatch.setattr(ops, "WGRAD_GU_TRANSPOSED", True)
    bases = tuple(torch.randn(w.shape, device="cuda", generator=g) for w in (wgu, wd))

    def fresh(i, dtype, add):  # weight gradient i's output: NaNs, or the base to add onto
        if add:
            return bases[i].clone()
        return torch.full(bases[i].shape, float("nan"), dtype=dtype, device="cuda")

    for out in ("bf16", "fp32", "fp32-add"):
        dtype, add = (torch.bfloat16, False) if out == "bf16" else (torch.float32, out != "fp32")
        d_wgu, d_wd = fresh(0, dtype, add), fresh(1, dtype, add)
        ops.bwd_fused_sm90(
            a, dy, wgu, None, offs, None, None, hw, dgu, None, None, d_wgu, d_wd, add,
            ops.BWD_RUN_WGRAD, -1,
        )  # fmt: skip
        want_gu, want_d = fresh(0, dtype, add), fresh(1, dtype, add)
        ops.wgrad_sm90(a, dgu, offs, want_gu, add, True)
        ops.wgrad_sm90(dy, hw, offs, want_d, add)
        assert torch.equal(d_wgu, want_gu), f"{out}: dW_gate_up != the transposed kernel's"
        assert torch.equal(d_wd, want_d), f"{out}: dW_down != the plain kernel's"
        for e, k in enumerate(sizes):
            if k == 0 and not add:
                assert not d_wgu[e].any() and not d_wd[e].any(), f"{out}: group {e} not zeros"
    # the whole launch: its dW_gate_up the transposed kernel's on its own dgu
    got = swiglu_backward(a, wgu, wd, dy, row_w, offs, group_align=16, saved_gu=gu32, fused=True)
    serial = swiglu_backward(a, wgu, wd, dy, row_w, offs, group_align=16, saved_gu=gu32,
                             fused=False)  # fmt: skip
    assert torch.equal(got[2], serial[2]) and torch.equal(got[3], serial[3])


def test_fused_backward_refuses_what_it_does_not_take():
    """fused=True with operands the kernel does not take raises, saying why."""
    a, wgu, wd, dy, row_w, offs, gu32 = _operands(256, 256, CASES[0][2], seed=4)
    with pytest.raises(ValueError, match="multiples of 16"):
        swiglu_backward(a, wgu, wd, dy, row_w, offs, saved_gu=gu32, fused=True)
    with pytest.raises(ValueError, match="saved g / u"):
        swiglu_backward(a, wgu, wd, dy, row_w, offs, group_align=16, fused=True)


def test_a_dependency_that_never_completes_times_out_instead_of_hanging(monkeypatch):
    """A dh tile that never reports done (a test fault): the tiles waiting for it give up after
    the bound, the launch ends, and the next call raises MoKTimeoutError naming the wait; after
    record.clear() the backward runs normally again."""
    a, wgu, wd, dy, row_w, offs, gu32 = _operands(256, 256, CASES[0][2], seed=5)
    rows, inter, hidden = a.shape[0], wd.shape[-1], a.shape[1]
    monkeypatch.setattr(record, "TIMEOUT_MS", 300.0)
    record.clear()

    def call(fault):
        outs = (
            torch.empty(rows, inter, dtype=a.dtype, device="cuda"),
            torch.empty(rows, 2 * inter, dtype=a.dtype, device="cuda"),
            torch.empty(inter // 128, rows, device="cuda"),
            torch.empty(rows, hidden, dtype=a.dtype, device="cuda"),
            torch.empty_like(wgu),
            torch.empty_like(wd),
        )
        ops.bwd_fused_sm90(
            a, dy, wgu, wd, offs, row_w, gu32, *outs, False, ops.BWD_RUN_ALL, fault
        )  # fmt: skip
        return outs

    try:
        call(0)
        torch.cuda.synchronize()  # returns: the waits are bounded
        with pytest.raises(MoKTimeoutError, match="backward dh tiles done"):
            call(-1)
    finally:
        record.clear()
    good = call(-1)
    want = swiglu_backward(a, wgu, wd, dy, row_w, offs, group_align=16, saved_gu=gu32, fused=False)
    n = sum(CASES[0][2])
    assert torch.equal(good[3][:n], want[0][:n])
    assert torch.equal(good[4], want[2]) and torch.equal(good[5], want[3])
