"""The fused experts' backward's host side, on CPU: where ``swiglu_backward(fused=True)`` is
refused, and how a timeout its kernel recorded reads (mok.record)."""

from __future__ import annotations

import pytest
import torch

from mok import record
from mok.errors import MoKTimeoutError
from mok.experts import swiglu_backward


def _cpu_operands(seed=0):
    g = torch.Generator().manual_seed(seed)
    rows, hidden, inter, L = 32, 256, 256, 2

    def rnd(*shape):
        return torch.randn(*shape, generator=g).bfloat16()

    a, dy = rnd(rows, hidden), rnd(rows, hidden)
    wgu, wd = rnd(L, 2 * inter, hidden) * 0.05, rnd(L, hidden, inter) * 0.05
    offs = torch.tensor([16, 32], dtype=torch.int32)
    return a, wgu, wd, dy, torch.rand(rows, generator=g), offs


def test_fused_needs_the_hopper_kernel():
    a, wgu, wd, dy, row_w, offs = _cpu_operands()
    with pytest.raises(ValueError, match="Hopper kernel"):
        swiglu_backward(a, wgu, wd, dy, row_w, offs, group_align=16, fused=True)


def test_fused_default_leaves_the_cpu_path_alone():
    """fused=None off the GPU is the torch path, bitwise fused=False."""
    a, wgu, wd, dy, row_w, offs = _cpu_operands(1)
    got = swiglu_backward(a, wgu, wd, dy, row_w, offs, group_align=16)
    want = swiglu_backward(a, wgu, wd, dy, row_w, offs, group_align=16, fused=False)
    for g, w in zip(got, want, strict=True):
        assert torch.equal(g, w)


def _record(fields) -> record.KernelRecord:
    rec = record.KernelRecord.__new__(record.KernelRecord)
    rec.device, rec._timeout_ms = torch.device("cuda", 0), 300.0
    rec.error = torch.tensor(fields, dtype=torch.int64)
    return rec


@pytest.mark.parametrize(("extra", "where"), [(7, "row tile 7"), (-3, "expert 2")])
def test_a_recorded_timeout_names_the_wait_and_the_tile(extra, where):
    rec = _record([1, 108, 0, 3, 4, 0, 0, extra])
    with pytest.raises(MoKTimeoutError, match=f"backward dh tiles done' \\({where}\\)") as err:
        rec.raise_if_failed()
    assert (err.value.observed, err.value.expected) == (3, 4)
    assert "300 ms" in str(err.value)


def test_an_empty_record_raises_nothing():
    _record([0] * 8).raise_if_failed()
