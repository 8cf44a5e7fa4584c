"""The experts' backward kernel on one GPU (``mok.experts.swiglu_backward(..., kernel=True)``,
csrc/layer/sm90_bwd.cuh): w h, the SwiGLU gradients and the router-weight gradient against an fp64
oracle of the same operands, under the bf16 rule with the torch path (which rounds g, u and the
down dgrad to bf16 on the GPU) as the bf16 reference; the gradients it feeds (d_a, the weight
gradients) likewise; and bitwise equal across runs. Groups of every size class: empty, shorter
than a tile, straddling tiles, rows past the last group."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from mok.experts import _swiglu_backward_sm90, _swiglu_backward_torch, swiglu_backward
from tests import tolerances as tol
from tests.layer_problem import expert_operands

pytestmark = [pytest.mark.gpu, pytest.mark.sm90]

# (hidden, intermediate, rows per group) - a trailing None adds 37 rows past the last group
CASES = [
    (256, 128, [5, 0, 130, 128, 1], True),
    (1024, 384, [300, 77, 0, 0, 513], False),
    (7168, 2048, [256, 200, 260], True),
    (2048, 768, [40] * 40 + [0] * 10 + [129] * 5, True),
]


def _operands(hidden, inter, sizes, tail, seed=0):
    return expert_operands(hidden, inter, sizes, 37 if tail else 0, seed)


def _gathered_rows(hidden, sizes, topk, seed):
    """Tokens x and grad_out [T, hidden] bf16 and the receive rows of a gathered backward:
    src (token * topk + k; -1 for about a tenth of the rows inside groups, padding, and for the
    37 rows past the last group), the rows a / dy copied out of them (zeros where src is -1)
    and row weights (0 there); T = 70000 // topk + 3, so sources pass 65535. Returns (x,
    grad_out, src, rows, n, a, dy, row_w), n the rows of the groups."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    tokens = 70000 // topk + 3
    x = torch.randn(tokens, hidden, device="cuda", generator=g).to(torch.bfloat16)
    grad_out = torch.randn(tokens, hidden, device="cuda", generator=g).to(torch.bfloat16)
    rows, n = sum(sizes) + 37, sum(sizes)
    src = torch.randint(0, tokens * topk, (rows,), device="cuda", generator=g, dtype=torch.int32)
    src[torch.rand(rows, device="cuda", generator=g) < 0.1] = -1
    src[n:] = -1
    real = (src >= 0)[:, None]
    tok = (src.clamp(min=0) // topk).long()
    a = torch.where(real, x[tok], 0).contiguous()
    dy = torch.where(real, grad_out[tok], 0).contiguous()
    row_w = torch.rand(rows, device="cuda", generator=g) * (src >= 0)
    return x, grad_out, src, rows, n, a, dy, row_w


def _oracle(a, wgu, wd, dy, row_w, sizes):
    """fp64 w h, dgu and <h, dy @ w_down> per row."""
    inter = wd.shape[-1]
    hs, dgus, dws, r = [], [], [], 0
    for e, n in enumerate(sizes):
        gu = a[r : r + n].double() @ wgu[e].double().T
        gt, u = gu[:, :inter], gu[:, inter:]
        sig = torch.sigmoid(gt)
        h = F.silu(gt) * u
        d = dy[r : r + n].double() @ wd[e].double()
        dws.append((h * d).sum(1))
        dw = d * row_w[r : r + n, None].double()
        dgus.append(torch.cat([dw * u * sig * (1 + gt * (1 - sig)), dw * gt * sig], 1))
        hs.append(h * row_w[r : r + n, None].double())
        r += n
    return torch.cat(hs), torch.cat(dgus), torch.cat(dws)


@pytest.mark.parametrize(("hidden", "inter", "sizes", "tail"), CASES)
def test_kernel_against_fp64(hidden, inter, sizes, tail):
    a, wgu, wd, dy, row_w, offs = _operands(hidden, inter, sizes, tail)
    n = sum(sizes)
    h, dgu, d_w = _swiglu_backward_sm90(a, wgu, wd, dy, row_w, offs)
    h_t, dgu_t, d_w_t = _swiglu_backward_torch(a, wgu, wd, dy, row_w, offs)
    want = _oracle(a, wgu, wd, dy, row_w, sizes)
    for name, got, ref, oracle in zip(
        ("hw", "dgu", "d_row_weight"), (h, dgu, d_w), (h_t, dgu_t, d_w_t), want, strict=True
    ):
        assert torch.isfinite(got[:n]).all(), name
        tol.assert_bf16_rule(got[:n].double().cpu(), ref[:n].double().cpu(), oracle.cpu())
    again = _swiglu_backward_sm90(a, wgu, wd, dy, row_w, offs)
    for name, x, y in zip(("hw", "dgu", "d_row_weight"), (h, dgu, d_w), again, strict=True):
        assert torch.equal(x[:n], y[:n]), f"{name}: two runs differ"


@pytest.mark.parametrize(("hidden", "inter", "sizes", "tail"), CASES[:2])
def test_gradients_match_the_torch_path(hidden, inter, sizes, tail):
    """Everything swiglu_backward returns, kernel vs torch path: within the bf16 rule of the
    torch path against an fp64 autograd oracle."""
    a, wgu, wd, dy, row_w, offs = _operands(hidden, inter, sizes, tail, seed=1)
    n = sum(sizes)
    got = swiglu_backward(a, wgu, wd, dy, row_w, offs, kernel=True)
    ref = swiglu_backward(a, wgu, wd, dy, row_w, offs, kernel=False)
    leaves = [t.double().requires_grad_() for t in (a[:n], wgu, wd, row_w[:n])]
    ys, r = [], 0
    for e, m in enumerate(sizes):
        gu = leaves[0][r : r + m] @ leaves[1][e].T
        hh = F.silu(gu[:, :inter]) * gu[:, inter:]
        ys.append(leaves[3][r : r + m, None] * (hh @ leaves[2][e].T))
        r += m
    oracle = torch.autograd.grad(torch.cat(ys), leaves, dy[:n].double())
    order = (0, 3, 1, 2)  # d_a, d_row_weight, d_wgu, d_wd
    for i, (g, rf) in enumerate(zip(got, ref, strict=True)):
        o = oracle[order[i]]
        g, rf = (g[:n], rf[:n]) if i < 2 else (g, rf)
        tol.assert_bf16_rule(g.double().cpu(), rf.double().cpu(), o.cpu())


def test_dense_without_routing_weight():
    """The shared expert's form: one group, no routing weight, fp32 d_a."""
    a, wgu, wd, dy, _, _ = _operands(512, 256, [300], False, seed=2)
    got = swiglu_backward(a, wgu[0], wd[0], dy, d_a_dtype=torch.float32, kernel=True)
    ref = swiglu_backward(a, wgu[0], wd[0], dy, d_a_dtype=torch.float32, kernel=False)
    assert got[1] is None and got[0].dtype == torch.float32
    for g, r in zip((got[0], got[2], got[3]), (ref[0], ref[2], ref[3]), strict=True):
        tol.assert_bf16_ref_bound(g.double().cpu(), r.double().cpu(), "dense")


# (M, N, rows per group: multiples of 16, incl. empty groups and groups not a multiple of 64)
WGRAD_CASES = [
    (128, 256, [16, 80, 0, 208, 64]),
    (4096, 7168, [256, 48, 0, 272]),
    (1536, 2048, [0, 0, 16]),
]


@pytest.mark.parametrize(("m", "n", "sizes"), WGRAD_CASES)
def test_wgrad_kernel_against_fp64(m, n, sizes):
    """c[e] = a[e]^T b[e]: the kernel within the bf16 rule of torch's grouped GEMM against an
    fp64 oracle; rows of the next group and past the last group (nonzero) add nothing; empty
    groups give zeros; two runs are bitwise equal."""
    from mok import ops

    g = torch.Generator(device="cuda").manual_seed(3)
    rows = sum(sizes) + 40
    a = torch.randn(rows, m, device="cuda", generator=g).bfloat16()
    b = torch.randn(rows, n, device="cuda", generator=g).bfloat16()
    offs = torch.tensor(sizes, device="cuda").cumsum(0).to(torch.int32)
    c = torch.full((len(sizes), m, n), float("nan"), device="cuda", dtype=torch.bfloat16)
    ops.wgrad_sm90(a, b, offs, c)
    ref = torch._grouped_mm(a.T, b, offs=offs)
    r = 0
    for e, k in enumerate(sizes):
        oracle = a[r : r + k].double().T @ b[r : r + k].double()
        if k == 0:
            assert not c[e].any(), f"group {e} is empty: zeros"
        else:
            tol.assert_bf16_rule(c[e].double().cpu(), ref[e].double().cpu(), oracle.cpu())
        r += k
    again = torch.empty_like(c)
    ops.wgrad_sm90(a, b, offs, again)
    assert torch.equal(c, again)


def test_swiglu_backward_weight_gradients_take_the_kernel():
    """With wgrad_kernel and 16-aligned groups the weight gradients come from the kernel: equal
    to calling it directly, and within the bf16 reference bound of the torch path."""
    from mok import ops

    a, wgu, wd, dy, row_w, offs = _operands(1024, 256, [32, 0, 112, 64], False, seed=4)
    got = swiglu_backward(a, wgu, wd, dy, row_w, offs, wgrad_kernel=True, group_align=16)
    d_a, d_w, d_wgu, d_wd = got
    hw, dgu, _ = _swiglu_backward_sm90(a, wgu, wd, dy, row_w, offs)
    want = torch.empty_like(d_wgu)
    ops.wgrad_sm90(dgu, a, offs, want)
    assert torch.equal(d_wgu, want)
    ref = swiglu_backward(a, wgu, wd, dy, row_w, offs)  # torch's weight GEMMs
    assert torch.equal(d_a, ref[0]) and torch.equal(d_w, ref[1])
    for got, r in zip((d_wgu, d_wd), ref[2:], strict=True):
        tol.assert_bf16_ref_bound(got.double().cpu(), r.double().cpu(), "weight gradient")


@pytest.mark.parametrize(
    ("hidden", "inter", "sizes"),
    [(1024, 384, [300, 77, 0, 0, 513]), (2048, 768, [40, 300, 0, 64, 65, 129, 192, 200])],
)
def test_saving_forward_and_the_backward_from_it(hidden, inter, sizes):
    """The forward that keeps gate / up (kernel mode 1) gives fp32 [g | u] against fp64 and y
    within the bf16 rule of torch's; the backward from them (mode 2, or its 256-column tiles
    where I % 256 == 0) is bitwise the one that recomputes them (the same k-loop in fp32).
    Groups whose last tile has <= 64 rows (run by one warpgroup) and > 64."""
    from mok.experts import grouped_swiglu, grouped_swiglu_saving

    a, wgu, wd, dy, row_w, offs = _operands(hidden, inter, sizes, True, seed=5)
    n, inter = sum(sizes), wd.shape[-1]
    y, gu32 = grouped_swiglu_saving(a, wgu, wd, offs)
    r = 0
    for e, m in enumerate(sizes):
        gu64 = a[r : r + m].double() @ wgu[e].double().T
        torch.testing.assert_close(
            gu32[r : r + m].double(), gu64, rtol=tol.FP32_RTOL, atol=tol.FP32_ATOL
        )
        r += m
    wg, wu = wgu[:, :inter], wgu[:, inter:]
    ref = grouped_swiglu(a, wg, wu, wd, offs, exact=False)
    ys, r = [], 0
    for e, m in enumerate(sizes):
        gu64 = a[r : r + m].double() @ wgu[e].double().T
        ys.append((F.silu(gu64[:, :inter]) * gu64[:, inter:]) @ wd[e].double().T)
        r += m
    tol.assert_bf16_rule(y[:n].double().cpu(), ref[:n].double().cpu(), torch.cat(ys).cpu())
    got = swiglu_backward(a, wgu, wd, dy, row_w, offs, saved_gu=gu32)
    want = swiglu_backward(a, wgu, wd, dy, row_w, offs)
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        g, w = (g[:n], w[:n]) if i < 2 else (g, w)
        assert torch.equal(g, w), f"output {i} differs from the recomputing backward"


@pytest.mark.parametrize(
    ("hidden", "inter", "sizes", "topk"),
    [(1024, 384, [300, 77, 0, 0, 513], 4), (2048, 768, [40, 300, 0, 64, 65, 129, 192, 200], 8)],
)
def test_saving_forward_gathers_its_rows_bitwise(hidden, inter, sizes, topk):
    """The saving forward that reads its rows from the tokens (cp.async in the gate / up
    GEMM's operand loads, ``grouped_swiglu_saving_gathered``) gives bitwise the outputs of the
    one that reads the same rows copied out first, with g / u kept or not: rows that repeat a
    token, padding rows (-1: zeros) inside groups, source rows past 65535, groups of every size
    class, and rows past the last group end (not read)."""
    from mok.experts import grouped_swiglu_saving, grouped_swiglu_saving_gathered

    _, wgu, wd, _, _, offs = _operands(hidden, inter, sizes, True, seed=7)
    g = torch.Generator(device="cuda").manual_seed(11)
    tokens = 70000 // topk + 3
    x = torch.randn(tokens, hidden, device="cuda", generator=g).to(torch.bfloat16)
    rows, n = sum(sizes) + 37, sum(sizes)
    src = torch.randint(0, tokens * topk, (rows,), device="cuda", generator=g, dtype=torch.int32)
    src[torch.rand(rows, device="cuda", generator=g) < 0.1] = -1  # padding rows
    src[n:] = -1
    a = torch.where((src >= 0)[:, None], x[(src.clamp(min=0) // topk).long()], 0)
    y_ref, gu_ref = grouped_swiglu_saving(a.contiguous(), wgu, wd, offs)
    y, gu32 = grouped_swiglu_saving_gathered(x, src, topk, wgu, wd, offs, rows)
    assert torch.equal(gu32[:n], gu_ref[:n]), "gathered g / u differ from the copied rows'"
    assert torch.equal(y[:n], y_ref[:n]), "gathered y differs from the copied rows'"
    # without g / u kept (the forward of recompute=True): the same y, from either operand
    y_only, none = grouped_swiglu_saving_gathered(x, src, topk, wgu, wd, offs, rows, keep=False)
    y_copied, _ = grouped_swiglu_saving(a.contiguous(), wgu, wd, offs, keep=False)
    assert none is None and torch.equal(y_only[:n], y[:n]) and torch.equal(y_copied[:n], y[:n])


@pytest.mark.parametrize(("into", "saved"), [(False, False), (True, False), (False, True)])
@pytest.mark.parametrize(
    ("hidden", "inter", "sizes", "topk"),
    [(1024, 512, [304, 80, 0, 0, 512], 4), (2048, 768, [48, 304, 0, 64, 80, 128, 192, 208], 8)],
)
def test_backward_gathers_its_rows_bitwise(hidden, inter, sizes, topk, into, saved):
    """The backward that reads each row's input and output gradient from the tokens
    (``swiglu_backward_gathered``: the experts' kernel and both weight-gradient kernels gather
    them in their operand loads) gives bitwise the results of ``swiglu_backward`` on the same
    rows copied out first (from saved g / u: its fused one-launch kernel): d_a, the
    router-weight gradient and both weight gradients (bf16, or added onto fp32 accumulators),
    with padding rows (-1, weight 0: zeros) inside groups whose ends are multiples of 16,
    repeated tokens, and rows past the last group (not read)."""
    from mok.experts import grouped_swiglu_saving, swiglu_backward, swiglu_backward_gathered

    _, wgu, wd, _, _, offs = _operands(hidden, inter, sizes, True, seed=9)
    x, grad_out, src, rows, n, a, dy, row_w = _gathered_rows(hidden, sizes, topk, seed=13)

    def accumulators():
        if not into:
            return None
        return tuple(torch.full(w.shape, 0.5, device="cuda") for w in (wgu, wd))

    gu = grouped_swiglu_saving(a, wgu, wd, offs)[1] if saved else None
    want = swiglu_backward(
        a, wgu, wd, dy, row_w, offs, group_align=16, wgrad_into=accumulators(), saved_gu=gu
    )
    got = swiglu_backward_gathered(x, grad_out, src, topk, rows, wgu, wd, row_w, offs,
                                   accumulators(), gu)  # fmt: skip
    for i, name in enumerate(("d_a", "d_row_weight", "d_w_gate_up", "d_w_down")):
        g_, w_ = (got[i][:n], want[i][:n]) if i < 2 else (got[i], want[i])
        assert torch.equal(g_, w_), f"{name} of the gathered backward differs"


@pytest.mark.parametrize(("m", "n", "sizes"), WGRAD_CASES)
def test_wgrad_kernel_fp32_out_and_accumulate(m, n, sizes):
    """fp32 c: an fp32 accumulation against the fp64 oracle (tests/tolerances.assert_fp32_gemm),
    whose bf16 rounding is the bf16 output; accumulate=True adds the same sums onto what c
    holds (a main_grad buffer): bitwise c0 + the fp32 result, empty groups adding nothing,
    bitwise repeatable; a bf16 c refuses it."""
    from mok import ops

    g = torch.Generator(device="cuda").manual_seed(5)
    rows = sum(sizes) + 40
    a = torch.randn(rows, m, device="cuda", generator=g).bfloat16()
    b = torch.randn(rows, n, device="cuda", generator=g).bfloat16()
    offs = torch.tensor(sizes, device="cuda").cumsum(0).to(torch.int32)
    c = torch.full((len(sizes), m, n), float("nan"), device="cuda")
    ops.wgrad_sm90(a, b, offs, c)
    bf = torch.empty(len(sizes), m, n, device="cuda", dtype=torch.bfloat16)
    ops.wgrad_sm90(a, b, offs, bf)
    assert torch.equal(c.bfloat16(), bf), "the bf16 output is the fp32 one rounded"
    base = torch.randn(len(sizes), m, n, device="cuda", generator=g)
    acc = base.clone()
    ops.wgrad_sm90(a, b, offs, acc, True)
    assert torch.equal(acc, base + c)
    r = 0
    for e, k in enumerate(sizes):
        ae, be = a[r : r + k].double(), b[r : r + k].double()
        if k == 0:
            assert not c[e].any(), f"group {e} is empty: zeros"
        else:
            tol.assert_fp32_gemm(c[e], ae.T @ be, ae.abs().T @ be.abs())
        r += k
    again = base.clone()
    ops.wgrad_sm90(a, b, offs, again, True)
    assert torch.equal(acc, again)
    with pytest.raises(Exception, match="fp32 c"):
        ops.wgrad_sm90(a, b, offs, bf, True)


def test_swiglu_backward_adds_the_kernels_fp32_sums_into_main_grad():
    """swiglu_backward(wgrad_into=...) with the kernel: each buffer becomes its start plus the
    kernel's fp32 weight gradient (bitwise), and the other gradients are the plain call's."""
    from mok import ops

    a, wgu, wd, dy, row_w, offs = _operands(1024, 256, [32, 0, 112, 64], False, seed=6)
    plain = swiglu_backward(a, wgu, wd, dy, row_w, offs, wgrad_kernel=True, group_align=16)
    g = torch.Generator(device="cuda").manual_seed(7)
    acc = tuple(torch.randn(w.shape, device="cuda", generator=g) for w in (wgu, wd))
    start = tuple(t.clone() for t in acc)
    got = swiglu_backward(
        a, wgu, wd, dy, row_w, offs, wgrad_kernel=True, group_align=16, wgrad_into=acc
    )
    assert torch.equal(got[0], plain[0]) and torch.equal(got[1], plain[1])
    hw, dgu, _ = _swiglu_backward_sm90(a, wgu, wd, dy, row_w, offs)
    for added, s0, (x, y) in zip(acc, start, ((dgu, a), (dy, hw)), strict=True):
        f32 = torch.empty_like(s0)
        ops.wgrad_sm90(x, y, offs, f32)
        assert torch.equal(added, s0 + f32)


# ---- dW_gate_up computed as x^T dgu, stored transposed (mok.ops.WGRAD_GU_TRANSPOSED) ----------


def _wgrad_outputs(call, shape, base):
    """The three outputs of one weight-gradient call ``call(c, accumulate)``: bf16 and fp32 c
    (NaN-filled first: every element must be written) and fp32 ``base`` + the sums
    (accumulate)."""
    bf = torch.full(shape, float("nan"), device="cuda", dtype=torch.bfloat16)
    call(bf, False)
    f32 = torch.full(shape, float("nan"), device="cuda")
    call(f32, False)
    acc = base.clone()
    call(acc, True)
    return bf, f32, acc


@pytest.mark.parametrize(("m", "n", "sizes"), WGRAD_CASES)
def test_wgrad_kernel_transposed_against_fp64(m, n, sizes):
    """``transposed=True``: c [L, N, M] holds (a[e]^T b[e])^T (dW_gate_up computed as x^T dgu,
    x's rows the 128-column operand, stored in the weight's [L, 2I, H] layout). bf16, fp32 and
    fp32 added onto c, against the fp64 oracle as the plain form's tests do (the bf16 rule with
    torch's grouped GEMM as the bf16 reference; tests/tolerances.assert_fp32_gemm): rows of the
    next group and past the last group (nonzero) add nothing, empty groups give zeros (and add
    nothing), bf16 is the fp32 result rounded, fp32-add the base plus the fp32 result, each
    bitwise repeatable.

    Last, each output is compared bitwise with the plain form's (c = a^T b) transposed back. The
    tiles and each element's k order (16-row steps over its group's rows) are the same and only
    the epilogue writes elsewhere, so we expect the same bits; that assumes the tensor cores sum
    an element's products in an order that does not depend on which operand is A. If only that
    comparison fails, the transposed store is right and the assumption is wrong (then the
    switch test test_the_transposed_switch_changes_no_bit fails too)."""
    from mok import ops

    g = torch.Generator(device="cuda").manual_seed(8)
    rows = sum(sizes) + 40
    a = torch.randn(rows, m, device="cuda", generator=g).bfloat16()
    b = torch.randn(rows, n, device="cuda", generator=g).bfloat16()
    offs = torch.tensor(sizes, device="cuda").cumsum(0).to(torch.int32)
    L = len(sizes)
    base = torch.randn(L, n, m, device="cuda", generator=g)

    def transposed(c, accumulate):
        ops.wgrad_sm90(a, b, offs, c, accumulate, True)

    bf, f32, acc = _wgrad_outputs(transposed, (L, n, m), base)
    ref = torch._grouped_mm(a.T, b, offs=offs)  # [L, M, N] bf16
    r = 0
    for e, k in enumerate(sizes):
        ae, be = a[r : r + k].double(), b[r : r + k].double()
        if k == 0:
            assert not bf[e].any() and not f32[e].any(), f"group {e} is empty: zeros"
        else:
            oracle = (ae.T @ be).T
            tol.assert_bf16_rule(bf[e].double().cpu(), ref[e].T.double().cpu(), oracle.cpu())
            tol.assert_fp32_gemm(f32[e], oracle, (ae.abs().T @ be.abs()).T)
        r += k
    assert torch.equal(f32.bfloat16(), bf), "the bf16 output is the fp32 one rounded"
    assert torch.equal(acc, base + f32), "fp32-add adds the fp32 sums onto c"
    again = _wgrad_outputs(transposed, (L, n, m), base)
    for name, x, y in zip(("bf16", "fp32", "fp32-add"), (bf, f32, acc), again, strict=True):
        assert torch.equal(x, y), f"{name}: two runs differ"

    def plain(c, accumulate):
        ops.wgrad_sm90(a, b, offs, c, accumulate)

    flat = _wgrad_outputs(plain, (L, m, n), base.transpose(1, 2).contiguous())
    for name, x, y in zip(("bf16", "fp32", "fp32-add"), (bf, f32, acc), flat, strict=True):
        assert torch.equal(x, y.transpose(1, 2)), f"{name}: not the plain form's bits"


@pytest.mark.parametrize(
    ("m", "n", "sizes", "topk"),
    [(256, 512, [16, 80, 0, 208, 64], 4), (1024, 768, [48, 0, 304, 16, 128], 8)],
)
def test_wgrad_gather_kernel_transposed_is_the_copied_rows(m, n, sizes, topk):
    """The gathering kernel's transposed form (``wgrad_gather_sm90(..., operand=0,
    transposed=True)``: x's rows gathered from the tokens by cp.async as operand A, C^T stored)
    gives bitwise the TMA kernel's transposed form on the same rows copied out first, bf16, fp32
    and fp32-add, bitwise repeatable (so the oracle checks of the test above hold for it too;
    the fp32 output is checked against fp64 here as well): padding rows (-1: zeros) inside
    groups, repeated tokens, source rows past 65535, empty groups, and rows past the last group
    whose sources are real tokens (not read). A gathered operand 1 in the transposed form is
    refused."""
    from mok import ops
    from mok.errors import MoKUnsupportedError

    g = torch.Generator(device="cuda").manual_seed(17)
    tokens = 70000 // topk + 3
    x = torch.randn(tokens, m, device="cuda", generator=g).to(torch.bfloat16)
    rows, n_real = sum(sizes) + 37, sum(sizes)
    src = torch.randint(0, tokens * topk, (rows,), device="cuda", generator=g, dtype=torch.int32)
    src[:n_real][torch.rand(n_real, device="cuda", generator=g) < 0.1] = -1  # padding rows
    a = torch.where((src >= 0)[:, None], x[(src.clamp(min=0) // topk).long()], 0).contiguous()
    b = torch.randn(rows, n, device="cuda", generator=g).bfloat16()
    offs = torch.tensor(sizes, device="cuda").cumsum(0).to(torch.int32)
    L = len(sizes)
    base = torch.randn(L, n, m, device="cuda", generator=g)

    def copied(c, accumulate):
        ops.wgrad_sm90(a, b, offs, c, accumulate, True)

    def gathered(c, accumulate):
        ops.wgrad_gather_sm90(b, x, src, topk, 0, offs, c, accumulate, True)

    want = _wgrad_outputs(copied, (L, n, m), base)
    got = _wgrad_outputs(gathered, (L, n, m), base)
    again = _wgrad_outputs(gathered, (L, n, m), base)
    for name, w, x_, y in zip(("bf16", "fp32", "fp32-add"), want, got, again, strict=True):
        assert torch.equal(x_, w), f"{name}: the gathered rows give other bits than the copied"
        assert torch.equal(x_, y), f"{name}: two runs differ"
    r = 0
    for e, k in enumerate(sizes):
        ae, be = a[r : r + k].double(), b[r : r + k].double()
        if k == 0:
            assert not got[1][e].any(), f"group {e} is empty: zeros"
        else:
            tol.assert_fp32_gemm(got[1][e], (ae.T @ be).T, (ae.abs().T @ be.abs()).T)
        r += k
    with pytest.raises(MoKUnsupportedError, match="operand 0 only"):
        ops.wgrad_gather_sm90(a, x, src, topk, 1, offs, torch.empty_like(got[1]), False, True)


@pytest.mark.parametrize("into", [False, True])
@pytest.mark.parametrize(
    ("hidden", "inter", "sizes", "topk"),
    [(1024, 512, [304, 80, 0, 0, 512], 4), (2048, 768, [48, 304, 0, 64, 80, 128, 192, 208], 8)],
)
def test_the_transposed_switch_changes_no_bit(hidden, inter, sizes, topk, into, monkeypatch):
    """``mok.ops.WGRAD_GU_TRANSPOSED`` off and on, every path of the experts' backward that
    computes dW_gate_up with mok's kernels: from saved g / u in one launch (the fused kernel),
    one launch per GEMM, recomputing g / u, and gathering the rows from the tokens (from saved
    g / u and recomputing), with bf16 weight gradients or fp32 ones added onto accumulators.

    Within each setting every path gives the same bits (the gathered backward is the dispatched
    one's, as the switch promises; with it on all of them compute x^T dgu stored transposed).
    Across the settings it asserts bitwise equality too: dgu^T x (x's rows operand B) and x^T dgu
    stored transposed (x's rows operand A) sum the same products per element in the same k
    order, so we expect the same bits, assuming the tensor cores' sum does not depend on which
    operand is A. A failure of only that comparison means the switch changes bits (within the
    oracle tolerances the transposed kernels' own tests check), not that a path is wrong."""
    from mok import ops
    from mok.experts import grouped_swiglu_saving, swiglu_backward, swiglu_backward_gathered

    _, wgu, wd, _, _, offs = _operands(hidden, inter, sizes, True, seed=9)
    x, grad_out, src, rows, n, a, dy, row_w = _gathered_rows(hidden, sizes, topk, seed=23)
    gu = grouped_swiglu_saving(a, wgu, wd, offs)[1]

    def accumulators():
        if not into:
            return None
        return tuple(torch.full(w.shape, 0.5, device="cuda") for w in (wgu, wd))

    def dispatched(**kw):
        into = accumulators()
        return swiglu_backward(a, wgu, wd, dy, row_w, offs, group_align=16, wgrad_into=into, **kw)

    def gathered(saved):
        into = accumulators()
        return swiglu_backward_gathered(
            x, grad_out, src, topk, rows, wgu, wd, row_w, offs, into, saved
        )

    runs = {}
    for switch in (False, True):
        monkeypatch.setattr(ops, "WGRAD_GU_TRANSPOSED", switch)
        runs[switch] = {
            "fused": dispatched(saved_gu=gu, fused=True),
            "serial": dispatched(saved_gu=gu, fused=False),
            "recompute": dispatched(),
            "gathered": gathered(gu),
            "gathered recompute": gathered(None),
        }
        torch.cuda.synchronize()
    names = ("d_a", "d_row_weight", "d_w_gate_up", "d_w_down")
    for switch, paths in runs.items():
        first = paths["fused"]
        for path, outs in paths.items():
            for i, name in enumerate(names):
                o, p = (outs[i][:n], first[i][:n]) if i < 2 else (outs[i], first[i])
                assert torch.equal(o, p), f"switch {switch}: {name} of {path} != fused"
    for path, off in runs[False].items():
        on = runs[True][path]
        for i, name in enumerate(names):
            o, p = (off[i][:n], on[i][:n]) if i < 2 else (off[i], on[i])
            assert torch.equal(o, p), f"{name} of the {path} backward differs with the switch"
