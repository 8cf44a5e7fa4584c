"""The torch SwiGLU experts of the unfused path (mok.experts): the fused gate/up layout without a
copy when the weights already share one tensor, a copy cached per weight version otherwise, and
results within the BF16 rule of an fp64 oracle."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from mok import experts as ex
from tests.tolerances import assert_bf16_rule

L, I, H = 3, 32, 64  # noqa: E741 (the intermediate size, as in the docs)


@pytest.fixture(autouse=True)
def _fresh_cache():
    ex.clear_cache()
    yield
    ex.clear_cache()


def _weights(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    wg = (torch.randn(L, I, H, generator=g) * H**-0.5).bfloat16()
    wu = (torch.randn(L, I, H, generator=g) * H**-0.5).bfloat16()
    wd = (torch.randn(L, H, I, generator=g) * I**-0.5).bfloat16()
    return wg, wu, wd


def test_halves_of_one_tensor_are_used_as_they_are():
    base = torch.randn(L, 2 * I, H)
    got = ex.gate_up_weight(base[:, :I], base[:, I:])
    assert got.data_ptr() == base.data_ptr() and got.shape == base.shape
    assert not ex._cache
    # one expert: the outer stride does not matter (a 2-D shared-expert weight, unsqueezed)
    two_d = torch.randn(2 * I, H)
    got = ex.gate_up_weight(two_d[:I].unsqueeze(0), two_d[I:].unsqueeze(0))
    assert got.data_ptr() == two_d.data_ptr()


def test_separate_weights_are_fused_once_and_rebuilt_after_an_update():
    wg, wu, _ = _weights()
    a = ex.gate_up_weight(wg, wu)
    assert torch.equal(a, torch.cat([wg, wu], 1))
    assert ex.gate_up_weight(wg, wu) is a
    wu.mul_(2)  # an optimizer step: the version changes
    b = ex.gate_up_weight(wg, wu)
    assert b is not a and torch.equal(b[:, I:], wu)
    assert len(ex._cache) == 1  # the stale copy was replaced


def test_back_to_back_allocations_are_not_mistaken_for_one_tensor():
    store = torch.randn(2 * L * I * H)
    wg = store[: L * I * H].view(L, I, H).clone()  # its own storage
    wu = torch.empty_like(wg).copy_(store[L * I * H :].view(L, I, H))
    assert ex._halves_of_one(wg, wu) is None  # whatever their addresses
    # the same check, with addresses back to back but two storages: only one storage counts
    base = torch.randn(L, 2 * I, H)
    assert ex._halves_of_one(base[:, :I], base[:, I:]) is not None


def test_swapped_halves_are_not_mistaken_for_one_tensor():
    base = torch.randn(L, 2 * I, H)
    got = ex.gate_up_weight(base[:, I:], base[:, :I])  # up half first: not gate | up
    assert got.data_ptr() != base.data_ptr()
    assert torch.equal(got[:, :I], base[:, I:])


def _oracle(a, wg, wu, wd, offs):
    out, start = [], 0
    for e, end in enumerate(offs.tolist()):
        x = a[start:end].double()
        h = F.silu(x @ wg[e].double().T) * (x @ wu[e].double().T)
        out.append(h @ wd[e].double().T)
        start = end
    return torch.cat(out)


def _bf16_reference(a, wg, wu, wd, offs):
    out, start = [], 0
    for e, end in enumerate(offs.tolist()):
        x = a[start:end]
        h = (F.silu(x @ wg[e].T) * (x @ wu[e].T)).bfloat16()
        out.append(h @ wd[e].T)
        start = end
    return torch.cat(out)


@pytest.mark.parametrize("exact", [True, False])
def test_grouped_experts_meet_the_bf16_rule(exact):
    wg, wu, wd = _weights(1)
    offs = torch.tensor([40, 41, 100], dtype=torch.int32)  # one expert gets a single row
    a = torch.randn(100, H, generator=torch.Generator().manual_seed(2)).bfloat16()
    y = ex.grouped_swiglu(a, wg, wu, wd, offs, exact=exact)
    assert y.dtype == torch.bfloat16 and y.shape == (100, H)
    assert_bf16_rule(y, _bf16_reference(a, wg, wu, wd, offs), _oracle(a, wg, wu, wd, offs))


@pytest.mark.parametrize("exact", [True, False])
def test_shared_expert_meets_the_bf16_rule(exact):
    wg, wu, wd = (w[0] for w in _weights(3))
    x = torch.randn(50, H, generator=torch.Generator().manual_seed(4)).bfloat16()
    y = ex.dense_swiglu(x, wg, wu, wd, exact=exact)
    offs = torch.tensor([50], dtype=torch.int32)
    w3 = (wg[None], wu[None], wd[None])
    assert_bf16_rule(y, _bf16_reference(x, *w3, offs), _oracle(x, *w3, offs))


def test_a_new_weight_in_freed_memory_is_not_served_from_the_cache():
    wg, wu, _ = _weights(5)
    first = ex.gate_up_weight(wg, wu).clone()
    del wg, wu  # freed; the next allocation may reuse the memory and even the ids
    for seed in range(6, 12):
        wg, wu, _ = _weights(seed)
        got = ex.gate_up_weight(wg, wu)
        assert torch.equal(got, torch.cat([wg, wu], 1))
        assert not torch.equal(got, first)
        del wg, wu


def test_two_d_weights_are_cached_by_the_tensors_themselves():
    wg, wu = torch.randn(I, H), torch.randn(I, H)
    a = ex.gate_up_weight(wg, wu)
    assert a.shape == (2 * I, H) and ex.gate_up_weight(wg, wu) is a
