"""``mok.MoE`` off CUDA: the reference layer on the module's fused-layout Parameters, gradients
by autograd (gradcheck in fp64), weights wrapped without copies, clear errors. The CUDA path is
checked in tests/test_mok_autograd_gpu.py."""

from __future__ import annotations

import pytest
import torch

import mok
from mok import MoKInputError
from mok.spec.workload import make_routing
from reference.moe import moe_backward, moe_forward
from tests.tolerances import FP64_ATOL, FP64_RTOL

E, H, INTER, IS, K, N = 6, 16, 8, 12, 2, 9


def _routing(n=N, seed=0):
    t = make_routing(n, E, K, 1, "zipf:1.0", seed=seed)
    return torch.from_numpy(t.topk_idx), torch.from_numpy(t.topk_weights).double()


@pytest.mark.parametrize("shared", [0, IS])
def test_forward_is_the_reference_on_views_of_the_parameters(shared):
    torch.manual_seed(0)
    m = mok.MoE(E, H, INTER, shared, dtype=torch.float64)
    idx, tw = _routing()
    x = torch.randn(N, H, dtype=torch.float64)
    w = m.weights()
    assert w.w_gate.data_ptr() == m.gate_up.data_ptr()  # views, no copy
    assert w.w_up.data_ptr() == m.gate_up.data_ptr() + INTER * H * 8
    assert torch.equal(m(x, idx, tw), moe_forward(x, idx, tw, w, torch.float64))


@pytest.mark.parametrize("shared", [0, IS])
def test_gradcheck_fp64(shared):
    torch.manual_seed(1)
    m = mok.MoE(E, H, INTER, shared, dtype=torch.float64)
    idx, tw = _routing(seed=1)
    x = torch.randn(N, H, dtype=torch.float64, requires_grad=True)
    names = [n for n, _ in m.named_parameters()]
    leaves = [p.detach().clone().requires_grad_(True) for _, p in m.named_parameters()]

    def f(x, tw, *ps):
        return torch.func.functional_call(m, dict(zip(names, ps, strict=True)), (x, idx, tw))

    assert torch.autograd.gradcheck(f, (x, tw.requires_grad_(True), *leaves), eps=1e-6, atol=1e-8)


def test_gradients_land_in_the_fused_parameters():
    """Off CUDA the gradients are the reference's explicit backward, bit for bit, gate and up
    side by side in gate_up; autograd over the reference forward agrees to fp64 rounding."""
    torch.manual_seed(2)
    m = mok.MoE(E, H, INTER, IS, dtype=torch.float64)
    idx, tw = _routing(seed=2)
    x = torch.randn(N, H, dtype=torch.float64)
    out = m(x, idx, tw)
    out.square().sum().backward()
    w = m.weights()
    g = moe_backward(2 * out.detach(), x, idx, tw, w, torch.float64)
    assert torch.equal(m.gate_up.grad, torch.cat([g.dw_gate, g.dw_up], 1))
    assert torch.equal(m.down.grad, g.dw_down)
    assert torch.equal(m.shared_gate_up.grad, torch.cat([g.d_shared_w_gate, g.d_shared_w_up], 0))
    assert torch.equal(m.shared_down.grad, g.d_shared_w_down)
    ref = {k: v.detach().clone().requires_grad_(True) for k, v in vars(w).items()}
    moe_forward(x, idx, tw, type(w)(**ref), torch.float64).square().sum().backward()
    torch.testing.assert_close(
        m.gate_up.grad,
        torch.cat([ref["w_gate"].grad, ref["w_up"].grad], 1),
        rtol=FP64_RTOL,
        atol=FP64_ATOL,
    )
    torch.testing.assert_close(m.down.grad, ref["w_down"].grad, rtol=FP64_RTOL, atol=FP64_ATOL)


def test_from_weights_shares_storage_and_checks_shapes():
    gu = torch.randn(E, 2 * INTER, H, dtype=torch.float64)
    dn = torch.randn(E, H, INTER, dtype=torch.float64)
    m = mok.MoE.from_weights(E, gu, dn)
    assert m.gate_up.data_ptr() == gu.data_ptr() and m.down.data_ptr() == dn.data_ptr()
    with pytest.raises(MoKInputError, match=r"down must be \[L=6, H=16, I=8\]"):
        mok.MoE.from_weights(E, gu, dn.transpose(1, 2))
    with pytest.raises(MoKInputError, match="both shared-expert weights or neither"):
        mok.MoE.from_weights(E, gu, dn, shared_gate_up=torch.randn(2 * IS, H))
    with pytest.raises(MoKInputError, match="must divide num_experts"):
        mok.MoE(E, H, INTER, num_local_experts=4)
    with pytest.raises(MoKInputError, match="hidden must be a positive int"):
        mok.MoE(E, 0, INTER)


def test_local_experts_need_a_group_of_their_share():
    # 3 of 6 experts on a rank without a process group (one rank): the share is wrong
    m = mok.MoE(E, H, INTER, num_local_experts=3, dtype=torch.float64)
    idx, tw = _routing()
    match = r"each of the 1 ranks holds num_experts / 1 = 6 experts \(this rank holds 3"
    with pytest.raises(MoKInputError, match=match):
        m(torch.randn(N, H, dtype=torch.float64), idx, tw)


def test_activation_checkpointing_gives_the_same_gradients():
    """torch.utils.checkpoint around the module (the forward runs again in the backward): the
    gradients of a plain call, bit for bit."""
    from torch.utils.checkpoint import checkpoint

    torch.manual_seed(3)
    m = mok.MoE(E, H, INTER, IS, dtype=torch.float64)
    idx, tw = _routing(seed=3)
    x = torch.randn(N, H, dtype=torch.float64)
    runs = []
    for wrap in (False, True):
        m.zero_grad(set_to_none=True)
        xs, tws = x.clone().requires_grad_(True), tw.clone().requires_grad_(True)
        out = checkpoint(m, xs, idx, tws, use_reentrant=False) if wrap else m(xs, idx, tws)
        out.square().sum().backward()
        runs.append([xs.grad, tws.grad, *(p.grad for p in m.parameters())])
    for a, b in zip(*runs, strict=True):
        assert torch.equal(a, b)


def test_repr_names_the_layer_and_its_options():
    m = mok.MoE(E, H, INTER, IS, dtype=torch.float64, recompute=False)
    assert repr(m) == (
        f"MoE(num_experts={E}, local={E}, hidden={H}, intermediate={INTER}, "
        f"shared_intermediate={IS}, fused=False, recompute=False)"
    )


def test_main_grad_takes_the_gradients_of_the_weights_that_have_one():
    """main_grad=True: each Parameter with a main_grad (fp32, its shape) gets its gradient added
    there (bitwise start + the plain call's gradient, fp32 here) and keeps .grad None, Megatron's
    grad_added_to_main_grad flag set; the others get .grad as usual; a main_grad of the wrong
    dtype is refused; under torch.compile it is refused."""
    torch.manual_seed(3)
    plain = mok.MoE(E, H, INTER, IS, dtype=torch.float32)
    m = mok.MoE.from_weights(E, *(p.detach().clone() for p in plain.parameters()), main_grad=True)
    idx, tw = _routing(seed=3)
    x = torch.randn(N, H)
    plain(x, idx, tw.float()).square().sum().backward()
    start = {}
    for name in ("gate_up", "down", "shared_down"):  # not shared_gate_up: .grad as usual
        p = getattr(m, name)
        p.main_grad = torch.randn(p.shape)
        p.grad_added_to_main_grad = False
        start[name] = p.main_grad.clone()
    m(x, idx, tw.float()).square().sum().backward()
    for name, s0 in start.items():
        p = getattr(m, name)
        assert p.grad is None and p.grad_added_to_main_grad, name
        assert torch.equal(p.main_grad, s0 + getattr(plain, name).grad), name
    assert torch.equal(m.shared_gate_up.grad, plain.shared_gate_up.grad)
    assert "main_grad=True" in repr(m)
    m.down.main_grad = torch.zeros(m.down.shape, dtype=torch.float64)
    with pytest.raises(MoKInputError, match="main_grad must be an fp32 tensor"):
        m(x, idx, tw.float())
    m.down.main_grad = torch.zeros(m.down.shape)
    with pytest.raises(Exception, match="main_grad=True adds gradients into main_grad eagerly"):
        torch.compile(m, backend="aot_eager", fullgraph=True)(x, idx, tw.float())
