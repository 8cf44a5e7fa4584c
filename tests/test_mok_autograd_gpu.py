"""The layer under autograd on one GPU (:func:`mok.functional.moe`): every gradient against the
reference's explicit backward (fp64 oracle) under the bf16 rule, and bitwise equal across runs.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from mok.spec.workload import ModelShape, make_routing
from reference.moe import moe_backward
from reference.weights import MoEWeights
from tests import tolerances as tol

CASES = [
    (ModelShape("shared", 16, 1024, 512, 4, shared_intermediate=512), 300, "uniform"),
    (ModelShape("noshared", 32, 2048, 768, 8), 513, "hot:0.5"),
    (ModelShape("dsv3-like", 16, 7168, 2048, 4, shared_intermediate=2048), 130, "uniform"),
]
GRADS = ("dx", "d_topk_weights", "dw_gate", "dw_up", "dw_down")
SHARED_GRADS = ("d_shared_w_gate", "d_shared_w_up", "d_shared_w_down")
WEIGHTS = {"dw_gate": "w_gate", "dw_up": "w_up", "dw_down": "w_down"}
WEIGHTS.update({f"d_{n}": n for n in ("shared_w_gate", "shared_w_up", "shared_w_down")})
WEIGHT_GRAD = {n: g for g, n in WEIGHTS.items()}


def _inputs(shape: ModelShape, n: int, skew: str, seed: int = 0):
    w = MoEWeights.random(shape, seed=seed, dtype=torch.bfloat16, device="cuda")
    t = make_routing(n, shape.num_experts, shape.num_topk, 1, skew, seed=seed)
    g = torch.Generator(device="cuda").manual_seed(seed + 1)
    x = torch.randn(n, shape.hidden, device="cuda", generator=g).to(torch.bfloat16)
    grad_out = torch.randn(n, shape.hidden, device="cuda", generator=g).to(torch.bfloat16)
    idx = torch.from_numpy(t.topk_idx).cuda()
    tw = torch.from_numpy(t.topk_weights).cuda().float()
    return x, idx, tw, w, grad_out


def _mok_grads(shape, x, idx, tw, w, grad_out, fused=False, config=None, recompute=True):
    import mok
    from mok import functional as mf

    w = dataclasses.replace(
        w, **{k: v.detach().clone() for k, v in vars(w).items() if v is not None}
    )
    for v in vars(w).values():
        if v is not None:
            v.requires_grad_(True)
    xs, tws = x.clone().requires_grad_(True), tw.clone().requires_grad_(True)
    cfg = config or mok.MoKConfig(num_comm_sms=16, minibatch_size=1024)
    out = mf.moe(xs, idx, tws, w, shape.num_experts, cfg, fused=fused, recompute=recompute)
    out.backward(grad_out)
    got = {"dx": xs.grad, "d_topk_weights": tws.grad}
    got.update({g: getattr(w, n).grad for g, n in WEIGHTS.items() if getattr(w, n) is not None})
    return out.detach(), got


def _cpu(w: MoEWeights) -> MoEWeights:
    return dataclasses.replace(w, **{k: v.cpu() for k, v in vars(w).items() if v is not None})


def _grads_and_oracle(shape, n, skew):
    x, idx, tw, w, grad_out = _inputs(shape, n, skew)
    _, got = _mok_grads(shape, x, idx, tw, w, grad_out)
    args = (grad_out.cpu(), x.cpu(), idx.cpu(), tw.cpu(), _cpu(w))
    names = GRADS + (SHARED_GRADS if shape.shared_intermediate else ())
    return got, moe_backward(*args, torch.float64), moe_backward(*args, torch.bfloat16), names


def _report(got, oracle, ref16, names) -> str:
    return "; ".join(
        f"{n}: {tol.max_abs_err(got[n].cpu(), getattr(oracle, n)):.3e} vs bf16 reference "
        f"{tol.max_abs_err(tol.stored_like(getattr(ref16, n), got[n]), getattr(oracle, n)):.3e}"
        for n in names
    )


@pytest.mark.gpu
@pytest.mark.sm90
@pytest.mark.parametrize(("shape", "n", "skew"), CASES, ids=[c[0].name for c in CASES])
def test_gradients_against_the_reference(shape, n, skew):
    """Every gradient (x, routing weights, routed and shared weights) under the bf16 rule
    against the fp64 oracle, and bitwise equal in a second run (fixed-order sums, no
    atomics)."""
    got, oracle, ref16, names = _grads_and_oracle(shape, n, skew)
    failed = []
    for name in names:
        assert got[name] is not None, f"{name}: no gradient"
        try:
            ref = tol.stored_like(getattr(ref16, name), got[name])
            tol.assert_bf16_rule(got[name].cpu().double(), ref, getattr(oracle, name))
        except AssertionError:
            failed.append(name)
    assert not failed, f"{failed} break the bf16 rule; " + _report(got, oracle, ref16, names)
    x, idx, tw, w, grad_out = _inputs(shape, n, skew)
    _, again = _mok_grads(shape, x, idx, tw, w, grad_out)
    for name in names:
        assert torch.equal(got[name], again[name]), f"{name} differs between two runs"


@pytest.mark.gpu
@pytest.mark.sm90
def test_twenty_runs_bitwise_equal():
    shape, n, skew = CASES[1]
    x, idx, tw, w, grad_out = _inputs(shape, n, skew, seed=11)
    _, first = _mok_grads(shape, x, idx, tw, w, grad_out)
    for run in range(19):
        _, again = _mok_grads(shape, x, idx, tw, w, grad_out)
        for name, g in first.items():
            assert torch.equal(g, again[name]), f"run {run + 2}: {name} differs from run 1"


CONFIGS = [
    dict(num_comm_sms=4, minibatch_size=256),
    dict(num_comm_sms=32, minibatch_size=4096),
    dict(num_comm_sms=8, minibatch_size=128, macrobatch_size=128, row_tile=64),  # rings wrap
    dict(dispatch_mode="dedup_pull", combine_mode="push", num_comm_sms=16),
]


@pytest.mark.gpu
@pytest.mark.sm90
@pytest.mark.parametrize("fused", [False, True])
def test_configs_give_the_same_gradients(fused):
    """Comm SMs, minibatch, ring size (a ring of one minibatch wraps many times) and dispatch
    mode change nothing in any gradient, fused forward or not."""
    import mok

    shape, n, skew = CASES[0]
    x, idx, tw, w, grad_out = _inputs(shape, n, skew, seed=13)
    _, want = _mok_grads(shape, x, idx, tw, w, grad_out)
    for over in CONFIGS:
        cfg = mok.MoKConfig(**{"wait_timeout_ms": 10_000.0, **over})
        _, got = _mok_grads(shape, x, idx, tw, w, grad_out, fused=fused, config=cfg)
        for name, g in want.items():
            assert torch.equal(g, got[name]), f"{over}: {name} differs"


@pytest.mark.gpu
@pytest.mark.sm90
def test_zero_tokens():
    shape = CASES[0][0]
    x, idx, tw, w, grad_out = _inputs(shape, 0, "uniform")
    out, got = _mok_grads(shape, x, idx, tw, w, grad_out)
    assert out.shape == (0, shape.hidden)
    assert got["dx"].shape == (0, shape.hidden) and got["d_topk_weights"].shape == (0, 4)
    for name in ("dw_gate", "dw_up", "dw_down", "d_shared_w_gate"):
        assert got[name] is not None and not got[name].any(), name


@pytest.mark.gpu
@pytest.mark.sm90
def test_fused_forward_backs_through_the_same_path():
    shape, n, skew = CASES[0]
    x, idx, tw, w, grad_out = _inputs(shape, n, skew, seed=3)
    _, unfused = _mok_grads(shape, x, idx, tw, w, grad_out)
    _, fused = _mok_grads(shape, x, idx, tw, w, grad_out, fused=True)
    for name, g in unfused.items():
        assert torch.equal(g, fused[name]), f"{name}: the backward depends only on the inputs"


@pytest.mark.gpu
@pytest.mark.sm90
def test_without_grad_it_is_moe_forward():
    import mok
    from mok import functional as mf

    shape, n, skew = CASES[1]
    x, idx, tw, w, _ = _inputs(shape, n, skew, seed=5)
    cfg = mok.MoKConfig(num_comm_sms=16, minibatch_size=1024)
    a = mf.moe(x, idx, tw, w, shape.num_experts, cfg)
    b = mf.moe_forward(x, idx, tw, w, shape.num_experts, cfg)
    assert not a.requires_grad and torch.equal(a, b)


@pytest.mark.gpu
@pytest.mark.sm90
def test_module_on_cuda_is_the_functional_layer():
    """mok.MoE on its fused [L, 2I, H] Parameters gives the functional layer's output and
    gradients, bitwise (both halves' gradients land in gate_up)."""
    import mok

    shape, n, skew = CASES[0]
    x, idx, tw, w, grad_out = _inputs(shape, n, skew, seed=7)
    out, want = _mok_grads(shape, x, idx, tw, w, grad_out)
    cfg = mok.MoKConfig(num_comm_sms=16, minibatch_size=1024)
    m = mok.MoE.from_weights(
        shape.num_experts,
        torch.cat([w.w_gate, w.w_up], 1).clone(),
        w.w_down.clone(),
        torch.cat([w.shared_w_gate, w.shared_w_up], 0).clone(),
        w.shared_w_down.clone(),
        config=cfg,
    )
    xs, tws = x.clone().requires_grad_(True), tw.clone().requires_grad_(True)
    got = m(xs, idx, tws)
    got.backward(grad_out)
    assert torch.equal(got.detach(), out)
    assert torch.equal(xs.grad, want["dx"]) and torch.equal(tws.grad, want["d_topk_weights"])
    assert torch.equal(m.gate_up.grad, torch.cat([want["dw_gate"], want["dw_up"]], 1))
    assert torch.equal(m.down.grad, want["dw_down"])
    assert torch.equal(
        m.shared_gate_up.grad, torch.cat([want["d_shared_w_gate"], want["d_shared_w_up"]], 0)
    )


@pytest.mark.gpu
@pytest.mark.sm90
def test_fused_forward_takes_the_halves_of_one_gate_up():
    """The fused kernel reads w_gate / w_up as the halves of one [L, 2I, H] tensor (mok.MoE's
    layout) exactly as two separate tensors, and mok.MoE(fused=True) trains: its gradients are
    the unfused module's (the backward depends only on the inputs)."""
    import mok
    from mok import functional as mf

    shape, n, skew = CASES[1]
    x, idx, tw, w, grad_out = _inputs(shape, n, skew, seed=17)
    cfg = mok.MoKConfig(num_comm_sms=16, minibatch_size=1024)
    inter = shape.intermediate
    gu = torch.cat([w.w_gate, w.w_up], 1).contiguous()
    halves = dataclasses.replace(w, w_gate=gu[:, :inter], w_up=gu[:, inter:])
    want = mf.moe_forward(x, idx, tw, w, shape.num_experts, cfg, fused=True)
    got = mf.moe_forward(x, idx, tw, halves, shape.num_experts, cfg, fused=True)
    assert torch.equal(got, want)
    grads = []
    for fused in (False, True):
        m = mok.MoE.from_weights(shape.num_experts, gu.clone(), w.w_down.clone(), config=cfg)
        m.fused = fused
        xs = x.clone().requires_grad_(True)
        m(xs, idx, tw).backward(grad_out)
        grads.append((xs.grad, m.gate_up.grad, m.down.grad))
    for a, b in zip(*grads, strict=True):
        assert a is not None and torch.equal(a, b)


@pytest.mark.gpu
@pytest.mark.sm90
def test_torch_compile_gives_the_eager_gradients():
    """torch.compile (inductor, whole graph) of a function calling mok.functional.moe, traced as
    the ops mok::moe / mok::moe_backward: output and every gradient bitwise equal to eager."""
    import mok
    from mok import functional as mf

    shape, n, skew = CASES[0]
    x, idx, tw, w, grad_out = _inputs(shape, n, skew, seed=19)
    cfg = mok.MoKConfig(num_comm_sms=16, minibatch_size=1024)
    out, want = _mok_grads(shape, x, idx, tw, w, grad_out, config=cfg)
    names = [k for k, v in vars(w).items() if v is not None]

    def layer(xs, tws, *ws):
        weights = MoEWeights(**dict(zip(names, ws, strict=True)))
        return mf.moe(xs, idx, tws, weights, shape.num_experts, cfg)

    leaves = [getattr(w, k).detach().clone().requires_grad_(True) for k in names]
    xs, tws = x.clone().requires_grad_(True), tw.clone().requires_grad_(True)
    got = torch.compile(layer, fullgraph=True)(xs, tws, *leaves)
    got.backward(grad_out)
    assert torch.equal(got.detach(), out)
    assert torch.equal(xs.grad, want["dx"]) and torch.equal(tws.grad, want["d_topk_weights"])
    for k, t in zip(names, leaves, strict=True):
        assert torch.equal(t.grad, want[WEIGHT_GRAD[k]]), k


@pytest.mark.gpu
@pytest.mark.sm90
@pytest.mark.parametrize("case", [0, 1])  # with and without a shared expert
def test_saved_activations_give_the_recomputed_gradients(case):
    """recompute=False (the unfused forward keeps the routed and the shared experts' fp32 gate
    / up): every gradient bitwise the recomputing backward's, also with NaN in the receive
    buffer's padding rows; the output under the bf16 rule."""
    import mok
    from mok import functional as mf

    shape, n, skew = CASES[case]
    x, idx, tw, w, grad_out = _inputs(shape, n, skew, seed=23)
    cfg = mok.MoKConfig(num_comm_sms=16, minibatch_size=1024)
    _, want = _mok_grads(shape, x, idx, tw, w, grad_out, config=cfg)
    leaves = {
        k: v.detach().clone().requires_grad_(True) for k, v in vars(w).items() if v is not None
    }
    ws = dataclasses.replace(w, **leaves)
    # the receive buffer's padding rows keep what earlier calls left there (the forward saves
    # g / u of those rows too): NaN there must not reach a gradient
    sms = torch.cuda.get_device_properties(x.device).multi_processor_count
    recv = mok.get_workspace(
        n, shape.hidden, shape.num_topk, shape.num_experts, x.dtype, mf.unfused_config(cfg, sms),
        None, x.device,
    ).recv_buffer  # fmt: skip
    recv.fill_(float("nan"))
    xs, tws = x.clone().requires_grad_(True), tw.clone().requires_grad_(True)
    out = mf.moe(xs, idx, tws, ws, shape.num_experts, cfg, recompute=False)
    out.backward(grad_out)
    assert torch.equal(xs.grad, want["dx"]) and torch.equal(tws.grad, want["d_topk_weights"])
    for k, t in leaves.items():
        assert torch.equal(t.grad, want[WEIGHT_GRAD[k]]), k
    kept = []  # what the forward kept: the routed g / u, then the shared expert's (or None)
    mf.moe_forward(x, idx, tw, w, shape.num_experts, cfg, _saved=kept)
    si = shape.shared_intermediate
    assert len(kept) == 2 and kept[0].shape[1] == 2 * shape.intermediate
    assert (kept[1] is None) if not si else tuple(kept[1].shape) == (n, 2 * si)
    from reference.moe import moe_forward as ref_forward

    xc, ic, tc, wc = x.cpu(), idx.cpu(), tw.cpu(), _cpu(w)
    oracle = ref_forward(xc.double(), ic, tc.double(), wc.to(torch.float64), torch.float64)
    ref16 = ref_forward(xc, ic, tc, wc, torch.bfloat16)
    tol.assert_bf16_rule(out.detach().cpu().double(), ref16.double(), oracle)


FUSED_SAVING = [
    (0, dict(num_comm_sms=16, minibatch_size=1024)),
    (1, dict(num_comm_sms=16, minibatch_size=1024)),
    (0, CONFIGS[2]),  # row_tile 64: 128-row blocks split between experts; the rings wrap
    (1, CONFIGS[2]),
    (0, CONFIGS[3]),  # dedup_pull
    (2, dict(num_comm_sms=24, minibatch_size=512)),
]


@pytest.mark.gpu
@pytest.mark.sm90
@pytest.mark.parametrize("recompute", [False, True])
@pytest.mark.parametrize("case", CASES[:2])
def test_one_rank_forward_gathers_bitwise(case, recompute, monkeypatch):
    """At one rank the unfused forward whose experts' kernel reads its rows from x
    (``mok.layer.GATHER_AT_ONE_RANK``, no dispatch) gives bitwise the output and every gradient
    of the one that dispatches them into the receive buffer first, keeping g / u for the
    backward (recompute=False) or not; the backward then gathers its rows too
    (``mok.autograd.GATHER_BACKWARD`` forced on: "auto" would not at these sizes)."""
    import mok.autograd as ma
    import mok.layer as ml

    monkeypatch.setattr(ma, "GATHER_BACKWARD", True)

    shape, n, skew = case
    x, idx, tw, w, grad_out = _inputs(shape, n, skew, seed=3)
    runs = {}
    for gather in (False, True):
        monkeypatch.setattr(ml, "GATHER_AT_ONE_RANK", gather)
        runs[gather] = _mok_grads(shape, x, idx, tw, w, grad_out, recompute=recompute)
    (out0, g0), (out1, g1) = runs[False], runs[True]
    assert torch.equal(out0, out1), "the gathered forward's output differs"
    for name, v in g0.items():
        assert torch.equal(v, g1[name]), f"{name} differs with the gathered forward"


@pytest.mark.gpu
@pytest.mark.sm90
@pytest.mark.parametrize(("case", "over"), FUSED_SAVING)
def test_fused_forward_keeps_gate_up(case, over):
    """recompute=False with the fused forward (its gate / up tiles write the fp32 g / u by
    receive row, regions padded to its row tile): every gradient bitwise the recomputing
    backward's; the output bitwise the fused forward's without saving."""
    import mok

    mok.clear_workspaces()  # each config is a workspace of its own (and its backward's another)
    shape, n, skew = CASES[case]
    x, idx, tw, w, grad_out = _inputs(shape, n, skew, seed=31)
    cfg = mok.MoKConfig(**{"wait_timeout_ms": 10_000.0, **over})
    plain, want = _mok_grads(shape, x, idx, tw, w, grad_out, fused=True, config=cfg)
    out, got = _mok_grads(shape, x, idx, tw, w, grad_out, True, cfg, recompute=False)
    assert torch.equal(out, plain), "saving changed the fused forward's output"
    for name, g in want.items():
        assert torch.equal(g, got[name]), f"{over}: {name} differs from the recomputed one"


TRANSFERS = [
    (0, 300, {}, False),  # dedup_pull (the default): the dedup combine's sum
    (0, 300, {}, True),
    (0, 5, dict(dispatch_mode="pull", combine_mode="push"), False),
    (1, 513, dict(dispatch_mode="pull", combine_mode="pull"), False),  # hot: empty experts
    (1, 1, dict(dispatch_mode="push", combine_mode="push"), False),
    (1, 7, dict(dispatch_mode="pull", combine_mode="push"), True),
    (2, 130, dict(row_tile=64, minibatch_size=128, macrobatch_size=128), True),
]


@pytest.mark.gpu
@pytest.mark.sm90
@pytest.mark.parametrize(("case", "n", "over", "fused"), TRANSFERS)
def test_transfers_in_the_launch_give_the_kernels_bits(case, n, over, fused, monkeypatch):
    """recompute=False: the backward with its token transfers inside the routed experts'
    launch (reverse combine, d_a by (token, k), the reverse dispatch's sum) gives every gradient
    bitwise as the communication kernels around the launch do, for each dispatch / combine
    mode, a token or a few, empty experts, the fused forward's regions."""
    import mok
    import mok.autograd as ma

    mok.clear_workspaces()
    shape, _, skew = CASES[case]
    x, idx, tw, w, grad_out = _inputs(shape, n, skew, seed=41)
    cfg = mok.MoKConfig(**{"num_comm_sms": 16, "minibatch_size": 1024, **over})
    calls, launch = [], ma.swiglu_backward_tokens

    def counted(*args, **kwargs):
        calls.append(1)
        return launch(*args, **kwargs)

    runs = {}
    for inside in (False, True):
        monkeypatch.setattr(ma, "TRANSFERS_IN_LAUNCH", inside)
        monkeypatch.setattr(ma, "swiglu_backward_tokens", counted)
        runs[inside] = _mok_grads(shape, x, idx, tw, w, grad_out, fused, cfg, recompute=False)
        assert len(calls) == int(inside), "the in-launch transfers did not run (or ran unasked)"
    (out0, want), (out1, got) = runs[False], runs[True]
    assert torch.equal(out0, out1)
    for name, g in want.items():
        assert torch.equal(g, got[name]), f"{over}: {name} differs with the transfers in the launch"


@pytest.mark.gpu
@pytest.mark.sm90
@pytest.mark.parametrize("row_tile", [128, 64])
def test_fused_keep_holds_each_receive_rows_gate_up(row_tile):
    """mok.functional.forward(..., keep=...): each real receive row of the kept fp32 buffer is
    its token's gate / up (x @ w_gate_up[e].T) within the fp32 GEMM bound of the fp64 product,
    the shared expert's row of every token too; the output is the same bits as without keep;
    buffers of the wrong dtype or too few rows, or a shared buffer without a shared expert,
    raise MoKInputError."""
    import mok
    from mok import functional as mf

    mok.clear_workspaces()
    shape, n, skew = CASES[0]
    x, idx, tw, w, _ = _inputs(shape, n, skew, seed=37)
    cfg = mok.MoKConfig(num_comm_sms=16, minibatch_size=1024, row_tile=row_tile)
    ws = mok.get_workspace(
        n, shape.hidden, shape.num_topk, shape.num_experts, x.dtype, cfg, None, x.device,
        fused=True,
    )  # fmt: skip
    sched = mf.build_schedule(idx, tw, ws)
    inter, si = shape.intermediate, shape.shared_intermediate
    rows = ws.capacity
    gu32 = torch.full((rows, 2 * inter), float("nan"), device="cuda")
    shared = torch.full((n, 2 * si), float("nan"), device="cuda")
    out = mf.forward(x, sched, w, keep=(gu32, shared))
    assert torch.equal(out, mf.forward(x, sched, w))
    k = shape.num_topk
    offs = sched.offsets.long().tolist()
    src = sched.src_index[:rows].long()
    for e in range(shape.num_experts):
        at = torch.arange(offs[e], offs[e + 1], device="cuda")
        at = at[src[at] >= 0]
        if at.numel() == 0:
            continue
        a = x[src[at] // k].double()
        wgu = torch.cat([w.w_gate[e], w.w_up[e]]).double()
        tol.assert_fp32_gemm(gu32[at], a @ wgu.T, a.abs() @ wgu.abs().T)
    swgu = torch.cat([w.shared_w_gate, w.shared_w_up]).double()
    tol.assert_fp32_gemm(shared, x.double() @ swgu.T, x.double().abs() @ swgu.abs().T)
    bad = [
        (gu32.bfloat16(), None, "float32"),
        (gu32[:10], None, "rows"),
        (None, shared[:, :8], "shape"),
    ]
    for g, sh, what in bad:
        with pytest.raises(mok.MoKInputError, match=what):
            mf.forward(x, sched, w, keep=(g, sh))
    no_shared = dataclasses.replace(w, shared_w_gate=None, shared_w_up=None, shared_w_down=None)
    with pytest.raises(mok.MoKInputError, match="no shared expert"):
        mf.forward(x, sched, no_shared, keep=(None, shared))


@pytest.mark.gpu
@pytest.mark.sm90
@pytest.mark.parametrize(
    ("fused", "recompute"), [(False, True), (True, True), (False, False), (True, False)]
)
def test_compiled_module_gives_the_eager_gradients(fused, recompute):
    """A torch.compile'd mok.MoE (whole graph; gate_up as one leaf) with a shared expert, fused
    or not, saving its activations or not: output and the gradients of x, the routing weights
    and every Parameter bitwise equal to the eager module's."""
    import mok

    shape, n, skew = CASES[0]
    x, idx, tw, w, grad_out = _inputs(shape, n, skew, seed=23)
    cfg = mok.MoKConfig(num_comm_sms=16, minibatch_size=1024)
    gu = torch.cat([w.w_gate, w.w_up], 1).contiguous()
    sgu = torch.cat([w.shared_w_gate, w.shared_w_up], 0).contiguous()
    runs = []
    for compiled in (False, True):
        m = mok.MoE.from_weights(
            shape.num_experts, gu.clone(), w.w_down.clone(), sgu.clone(), w.shared_w_down.clone(),
            config=cfg, recompute=recompute,
        )  # fmt: skip
        m.fused = fused
        f = torch.compile(m, fullgraph=True) if compiled else m
        xs, tws = x.clone().requires_grad_(True), tw.clone().requires_grad_(True)
        out = f(xs, idx, tws)
        out.backward(grad_out)
        params = (m.gate_up, m.down, m.shared_gate_up, m.shared_down)
        runs.append((out.detach(), xs.grad, tws.grad, *(p.grad for p in params)))
    for a, b in zip(*runs, strict=True):
        assert a is not None and torch.equal(a, b)


@pytest.mark.gpu
@pytest.mark.sm90
def test_explicit_backward_is_the_autograd_backward():
    """mok.functional.moe_backward (one call, no autograd) gives the gradients loss.backward()
    gives through mok.functional.moe, bitwise, as reference.moe.MoEGrads."""
    import mok
    from mok import functional as mf

    shape, n, skew = CASES[1]
    x, idx, tw, w, grad_out = _inputs(shape, n, skew, seed=29)
    cfg = mok.MoKConfig(num_comm_sms=16, minibatch_size=1024)
    _, want = _mok_grads(shape, x, idx, tw, w, grad_out, config=cfg)
    got = mf.moe_backward(grad_out, x, idx, tw, w, shape.num_experts, cfg)
    for name, t in want.items():
        assert torch.equal(getattr(got, name), t), name


@pytest.mark.gpu
@pytest.mark.sm90
@pytest.mark.parametrize("recompute", [True, False])
def test_main_grad_gets_the_kernels_fp32_sums(recompute):
    """mok.MoE(main_grad=True) on CUDA: gate_up and down get the weight-gradient kernel's fp32
    sums added to their (zero) main_grad, whose bf16 rounding is the plain call's gradient,
    bitwise; the shared expert's gate_up gets its bf16 gradient added; .grad stays None; x's
    and the routing weights' gradients are the plain call's."""
    import mok

    shape, n, skew = CASES[0]
    x, idx, tw, w, grad_out = _inputs(shape, n, skew, seed=8)
    ws = (
        torch.cat([w.w_gate, w.w_up], 1),
        w.w_down,
        torch.cat([w.shared_w_gate, w.shared_w_up], 0),
        w.shared_w_down,
    )
    runs = {}
    for main in (False, True):
        m = mok.MoE.from_weights(
            shape.num_experts, *(t.clone() for t in ws), recompute=recompute, main_grad=main
        )
        if main:
            for name in ("gate_up", "down", "shared_gate_up"):
                getattr(m, name).main_grad = torch.zeros(getattr(m, name).shape, device="cuda")
        xs, tws = x.clone().requires_grad_(True), tw.clone().requires_grad_(True)
        m(xs, idx, tws).backward(grad_out)
        runs[main] = (m, xs.grad, tws.grad)
    (plain, dx, dtw), (m, dx2, dtw2) = runs[False], runs[True]
    assert torch.equal(dx, dx2) and torch.equal(dtw, dtw2)
    for name in ("gate_up", "down", "shared_gate_up"):
        p = getattr(m, name)
        assert p.grad is None and p.main_grad.dtype == torch.float32, name
        assert torch.equal(p.main_grad.bfloat16(), getattr(plain, name).grad), name
    assert torch.equal(m.shared_down.grad, plain.shared_down.grad)


@pytest.mark.gpu
@pytest.mark.sm90
@pytest.mark.parametrize(("fused", "recompute"), [(False, True), (False, False), (True, False)])
def test_garbage_in_freed_memory_reaches_no_gradient(fused, recompute):
    """The backward's receive buffers come uninitialised from the allocator and only their
    padding rows are zeroed: with the allocator's free memory full of NaN first, every gradient
    is finite and bitwise the one of a run on clean memory."""
    import mok
    from mok import functional as mf

    shape = CASES[0][0]
    x, idx, tw, w, grad_out = _inputs(shape, 300, "hot:0.5", seed=7)
    cfg = mok.MoKConfig(num_comm_sms=16, minibatch_size=1024)

    def grads():
        given = {k: v for k, v in vars(w).items() if v is not None}
        leaves = {k: v.detach().clone().requires_grad_() for k, v in given.items()}
        ww = dataclasses.replace(w, **leaves)
        xs, tws = x.clone().requires_grad_(), tw.clone().requires_grad_()
        out = mf.moe(xs, idx, tws, ww, shape.num_experts, cfg, fused=fused, recompute=recompute)
        out.backward(grad_out)
        return [xs.grad, tws.grad] + [v.grad for v in vars(ww).values() if v is not None]

    clean = grads()
    torch.cuda.synchronize()
    free = torch.cuda.mem_get_info()[0]
    junk = torch.full((min(free // 4, 8 << 30) // 2,), float("nan"), dtype=torch.bfloat16,
                      device="cuda")  # fmt: skip
    del junk  # its blocks stay in the caching allocator, NaN-filled
    dirty = grads()
    for i, (a, b) in enumerate(zip(clean, dirty, strict=True)):
        assert torch.isfinite(b).all(), f"gradient {i} is not finite"
        assert torch.equal(a, b), f"gradient {i} differs from the clean run"


@pytest.mark.gpu
@pytest.mark.sm90
@pytest.mark.parametrize("recompute", [True, False])
def test_auto_runs_the_path_it_timed_bitwise(recompute):
    """fused="auto": the first call times both forwards and keeps one (logged, with both times);
    every result is bitwise that of the kept path pinned, and later calls measure nothing."""
    from mok import path_choice as pc

    shape, n, skew = CASES[0]
    x, idx, tw, w, grad_out = _inputs(shape, n, skew, seed=3)
    pc.clear_choices()
    out, got = _mok_grads(shape, x, idx, tw, w, grad_out, fused="auto", recompute=recompute)
    (choice,) = pc.choices().values()
    assert choice.unfused_ms > 0 and choice.fused_ms > 0, choice
    assert choice.fused == pc.pick(choice.unfused_ms, choice.fused_ms), choice
    pinned, want = _mok_grads(shape, x, idx, tw, w, grad_out, fused=choice.fused,
                              recompute=recompute)  # fmt: skip
    assert torch.equal(out, pinned), choice.text
    for k in want:
        assert torch.equal(got[k], want[k]), (k, choice.text)
    again, _ = _mok_grads(shape, x, idx, tw, w, grad_out, fused="auto", recompute=recompute)
    assert torch.equal(again, out) and len(pc.choices()) == 1
    pc.clear_choices()
