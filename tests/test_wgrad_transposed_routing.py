"""``mok.ops.WGRAD_GU_TRANSPOSED`` on the CPU: with the switch on, ``mok.experts`` computes
dW_gate_up with the weight-gradient kernels' transposed form (x's rows the kernel's operand A,
c in the weight's [L, 2I, H] layout), by TMA and gathered, and leaves dW_down as it is; the ops
refuse, naming the shapes, what the transposed form does not take. The kernels are stand-ins
here (torch on the CPU, in the layout the op promises); tests/test_mok_backward_kernel_gpu.py
runs the real ones."""

from __future__ import annotations

import pytest
import torch

from mok import experts as me
from mok import ops
from mok.errors import MoKInputError, MoKUnsupportedError

L, H, INTER = 3, 256, 128
SIZES = [32, 0, 48]  # rows per expert, multiples of 16 (an empty one)


def _problem(seed=0):
    g = torch.Generator().manual_seed(seed)
    rows = sum(SIZES)
    x = torch.randn(rows, H, generator=g).bfloat16()
    dgu = torch.randn(rows, 2 * INTER, generator=g).bfloat16()
    offs = torch.tensor(SIZES).cumsum(0).to(torch.int32)
    return x, dgu, offs


def _grouped_at_b(a, b, offs):
    """fp32 [L, M, N]: a[e]^T b[e] per group."""
    out, start = [], 0
    for end in offs.tolist():
        out.append(a[start:end].float().T @ b[start:end].float())
        start = end
    return torch.stack(out)


@pytest.fixture
def kernels(monkeypatch):
    """Stand-ins for the two weight-gradient ops that record their calls and write what the
    kernels would: c[e] = a[e]^T b[e], or its transpose with ``transposed``."""
    calls = []

    def write(a, b, offs, c, accumulate, transposed):
        r = _grouped_at_b(a, b, offs)
        r = r.transpose(1, 2) if transposed else r
        assert c.shape == r.shape, (c.shape, r.shape)
        if accumulate:
            c.add_(r)
        else:
            c.copy_(r)

    def wgrad(a, b, ends, c, accumulate=False, transposed=False):
        calls.append(("wgrad", a.shape[1], b.shape[1], tuple(c.shape), transposed))
        write(a, b, ends, c, accumulate, transposed)

    def wgrad_gather(other, tokens, row_src, topk, operand, ends, c, accumulate, transposed=False):
        calls.append(("gather", operand, other.shape[1], tuple(c.shape), transposed))
        rows = torch.where(
            (row_src >= 0)[:, None], tokens[(row_src.clamp(min=0) // topk).long()], 0
        )
        a, b = (rows, other) if operand == 0 else (other, rows)
        write(a, b, ends, c, accumulate, transposed)

    monkeypatch.setattr(ops, "wgrad_sm90", wgrad)
    monkeypatch.setattr(ops, "wgrad_gather_sm90", wgrad_gather)
    return calls


def test_wgrad_takes_the_transposed_form_for_the_same_result(kernels):
    """``_wgrad(dgu, x, ..., transposed=True)``: the kernel gets x as A and dgu as B with a
    [L, 2I, H] c and the transposed flag; the result is dgu^T x per group, as without it;
    added onto an fp32 accumulator as well."""
    x, dgu, offs = _problem()
    plain = me._wgrad(dgu, x, offs, True, 16)
    flipped = me._wgrad(dgu, x, offs, True, 16, None, True)
    assert kernels == [
        ("wgrad", 2 * INTER, H, (L, 2 * INTER, H), False),
        ("wgrad", H, 2 * INTER, (L, 2 * INTER, H), True),
    ]
    assert torch.equal(plain, flipped)
    torch.testing.assert_close(plain.float(), _grouped_at_b(dgu, x, offs).bfloat16().float())
    acc = torch.ones(L, 2 * INTER, H)
    got = me._wgrad(dgu, x, offs, True, 16, acc, True)
    assert got is acc and torch.equal(acc, 1 + _grouped_at_b(dgu, x, offs))


def test_gathered_wgrad_gathers_the_rows_as_operand_a(kernels):
    """``_wgrad_gathered(dgu, x, ..., operand=1, transposed=True)``: the gathering op gathers
    x's rows as its operand 0 into a [L, 2I, H] c, the same result; operand 0 is refused."""
    x, dgu, offs = _problem(1)
    tokens = x[::2].contiguous()
    row_src = torch.arange(x.shape[0], dtype=torch.int32)
    row_src[5] = -1  # a padding row
    plain = me._wgrad_gathered(dgu, tokens, row_src, 2, 1, offs, None)
    flipped = me._wgrad_gathered(dgu, tokens, row_src, 2, 1, offs, None, True)
    assert kernels == [
        ("gather", 1, 2 * INTER, (L, 2 * INTER, H), False),
        ("gather", 0, 2 * INTER, (L, 2 * INTER, H), True),
    ]
    assert torch.equal(plain, flipped)
    with pytest.raises(ValueError, match="got operand 0"):
        me._wgrad_gathered(dgu, tokens, row_src, 2, 0, offs, None, True)


def test_the_switch_reaches_dw_gate_up_only(monkeypatch):
    """swiglu_backward hands ``mok.ops.WGRAD_GU_TRANSPOSED`` to dW_gate_up's ``_wgrad`` and
    never to dW_down's; the results (torch's GEMMs on the CPU) are the same either way."""
    x, dgu, offs = _problem(2)
    g = torch.Generator().manual_seed(3)
    wgu = (torch.randn(L, 2 * INTER, H, generator=g) / 8).bfloat16()
    wd = (torch.randn(L, H, INTER, generator=g) / 8).bfloat16()
    dy = torch.randn(x.shape[0], H, generator=g).bfloat16()
    row_w = torch.rand(x.shape[0], generator=g)
    seen = []
    wgrad = me._wgrad

    def spy(a, b, offs, kernel, group_align, into=None, transposed=False):
        seen.append((a.shape[1], b.shape[1], transposed))
        return wgrad(a, b, offs, kernel, group_align, into, transposed)

    monkeypatch.setattr(me, "_wgrad", spy)
    runs = {}
    for switch in (False, True):
        monkeypatch.setattr(ops, "WGRAD_GU_TRANSPOSED", switch)
        runs[switch] = me.swiglu_backward(x, wgu, wd, dy, row_w, offs, group_align=16)
    assert seen == [
        (2 * INTER, H, False),
        (H, INTER, False),
        (2 * INTER, H, True),
        (H, INTER, False),
    ]
    for off, on in zip(runs[False], runs[True], strict=True):
        assert torch.equal(off, on)


def test_the_transposed_ops_refuse_shapes_they_do_not_take():
    """Refused before any launch (CPU tensors): H not a multiple of 128 or 2I not of 256 in
    the transposed form, a c not [L, 2I, H], and a gathered operand 1."""
    x, dgu, offs = _problem()
    c = torch.empty(L, 2 * INTER, H, dtype=torch.bfloat16)
    with pytest.raises(MoKUnsupportedError, match=r"a \[80, 64\] and b \[80, 256\].*128"):
        ops.wgrad_sm90(x[:, :64], dgu, offs, c[:, :, :64], False, True)
    with pytest.raises(MoKUnsupportedError, match=r"a \[80, 256\] and b \[80, 128\].*256"):
        ops.wgrad_sm90(x, dgu[:, :128], offs, c[:, :128], False, True)
    with pytest.raises(MoKInputError, match=r"c must be \[L, 256, 256\].*got \(3, 256, 128\)"):
        ops.wgrad_sm90(x, dgu, offs, c[:, :, :128], False, True)
    row_src = torch.zeros(x.shape[0], dtype=torch.int32)
    with pytest.raises(MoKUnsupportedError, match="gathers operand 0 only"):
        ops.wgrad_gather_sm90(x, dgu, row_src, 1, 1, offs, torch.empty(L, 256, 256), False, True)
