"""torch.compile over mok's layer, off CUDA: traced, :func:`mok.functional.moe` is the custom op
``mok::moe`` (its backward ``mok::moe_backward``), which torch.library's opcheck accepts (schema,
fake implementation, autograd registration, AOT dispatch); a compiled ``mok.MoE`` (whole graph,
aot_eager and inductor) gives the eager output and gradients bit for bit. On CPU the ops run the
reference layer; the CUDA kernels behind the same ops are checked in
tests/test_mok_autograd_gpu.py."""

from __future__ import annotations

import pytest
import torch

import mok
from mok import functional as mf
from mok.spec.workload import make_routing

E, H, INTER, IS, K, N = 6, 16, 8, 12, 2, 9


# the CUDA path's config (off CUDA it is only carried): a frozen dataclass that the traced call
# must turn into the op's string argument
CONFIG = mok.MoKConfig(num_comm_sms=16, minibatch_size=1024)


def _inputs(shared: int, dtype=torch.float32, seed=0):
    torch.manual_seed(seed)
    m = mok.MoE(E, H, INTER, shared, dtype=dtype, config=CONFIG)
    t = make_routing(N, E, K, 1, "zipf:1.0", seed=seed)
    idx = torch.from_numpy(t.topk_idx)
    tw = torch.from_numpy(t.topk_weights).to(dtype)
    return m, torch.randn(N, H, dtype=dtype), idx, tw


def _grads(f, m, x, idx, tw, grad_out):
    """f's output and the gradients of x, topk_weights and every Parameter."""
    m.zero_grad(set_to_none=True)
    x, tw = x.clone().requires_grad_(True), tw.clone().requires_grad_(True)
    out = f(x, idx, tw)
    out.backward(grad_out)
    return [out.detach(), x.grad, tw.grad] + [p.grad for p in m.parameters()]


@pytest.mark.parametrize("recompute", [True, False])  # off CUDA the reference: nothing saved
@pytest.mark.parametrize("one_gate_up", [True, False])
@pytest.mark.parametrize("shared", [0, IS])
def test_opcheck_accepts_the_layer_op(shared, one_gate_up, recompute):
    m, x, idx, tw = _inputs(shared, torch.float64, seed=1)
    w = m.weights()
    if one_gate_up:
        leaves = [m.gate_up, None, m.down]
        leaves += [m.shared_gate_up, None, m.shared_down] if shared else [None] * 3
    else:
        leaves = [w.w_gate, w.w_up, w.w_down, w.shared_w_gate, w.shared_w_up, w.shared_w_down]
    leaves = [None if t is None else t.detach().clone().requires_grad_(True) for t in leaves]
    args = (
        x.requires_grad_(True),
        idx,
        tw.requires_grad_(True),
        *leaves,
        E,
        mok.MoKConfig().to_json(),
        "",
        False,
        recompute,
    )
    got = torch.library.opcheck(torch.ops.mok.moe.default, args)
    assert set(got.values()) == {"SUCCESS"}, got


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_a_compiled_module_gives_the_eager_gradients(backend):
    m, x, idx, tw = _inputs(IS, seed=2)
    grad_out = torch.randn(N, H)
    want = _grads(m, m, x, idx, tw, grad_out)
    torch._dynamo.reset()
    got = _grads(torch.compile(m, backend=backend, fullgraph=True), m, x, idx, tw, grad_out)
    assert len(got) == 7
    for a, b in zip(got, want, strict=True):
        assert a is not None and torch.equal(a, b)


def test_compiled_functional_layer_on_separate_weights():
    """Gate and up as two tensors of their own (no gate_up leaf): the same gradients as eager."""
    m, x, idx, tw = _inputs(0, seed=3)
    w = m.weights()
    wg, wu, wd = (t.detach().clone().requires_grad_(True) for t in (w.w_gate, w.w_up, w.w_down))
    grad_out = torch.randn(N, H)

    def layer(x, tw, wg, wu, wd):
        return mf.moe(x, idx, tw, type(w)(wg, wu, wd), E, CONFIG)

    runs = []
    for f in (layer, torch.compile(layer, backend="aot_eager", fullgraph=True)):
        xs, tws = x.clone().requires_grad_(True), tw.clone().requires_grad_(True)
        for t in (wg, wu, wd):
            t.grad = None
        out = f(xs, tws, wg, wu, wd)
        out.backward(grad_out)
        runs.append([out.detach(), xs.grad, tws.grad, wg.grad, wu.grad, wd.grad])
    for a, b in zip(*runs, strict=True):
        assert torch.equal(a, b)


def test_the_traced_graph_holds_one_op_each_way():
    """The compiled forward graph calls mok::moe once and the backward mok::moe_backward once,
    and nothing that mutates a buffer (what inductor failed on when the graph held mok's
    communication ops, which write workspace buffers)."""
    from functorch.compile import make_boxed_func
    from torch._functorch.aot_autograd import aot_module_simplified

    m, x, idx, tw = _inputs(IS, seed=4)
    graphs = []

    def backend(gm, example_inputs):
        def keep(g, _):
            graphs.append(g)
            return make_boxed_func(g.forward)

        return aot_module_simplified(gm, example_inputs, fw_compiler=keep, bw_compiler=keep)

    torch._dynamo.reset()
    out = torch.compile(m, backend=backend, fullgraph=True)(x.requires_grad_(True), idx, tw)
    out.sum().backward()
    assert len(graphs) == 2
    targets = [[str(n.target) for n in g.graph.nodes if n.op == "call_function"] for g in graphs]
    assert targets[0].count("mok.moe.default") == 1, targets[0]
    assert targets[1].count("mok.moe_backward.default") == 1, targets[1]
    assert not any("copy_" in t or "auto_functionalize" in t for t in targets[0] + targets[1])


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("recompute", [True, False])
@pytest.mark.parametrize("shared", [0, 128, 64])  # Is = 64: the saving kernel needs Is % 128
def test_fake_shapes_on_cuda_tensors(fused, recompute, shared):
    """The ops' fake implementations on (fake) CUDA tensors, as torch.compile traces them on a
    GPU: the output like x; with recompute=False the kept fp32 gate / up of the rows one call
    can fill (tokens x top-k plus the padding of each expert region: 15 rows at the unfused row
    tile 16, row_tile - 1 for the fused forward) and the shared expert's of every token where
    the kernel takes its shape (else empty); the gradients like their inputs."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    e, h, i, k, n = 8, 64, 128, 2, 16
    config = mok.MoKConfig()
    cfg = config.to_json()
    with FakeTensorMode():
        x = torch.empty(n, h, device="cuda", dtype=torch.bfloat16)
        idx = torch.empty(n, k, device="cuda", dtype=torch.int64)
        tw = torch.empty(n, k, device="cuda")
        gu = torch.empty(e, 2 * i, h, device="cuda", dtype=torch.bfloat16)
        wd = torch.empty(e, h, i, device="cuda", dtype=torch.bfloat16)
        sw = [None, None, None]
        if shared:
            sw = [torch.empty(2 * shared, h, device="cuda", dtype=torch.bfloat16), None,
                  torch.empty(h, shared, device="cuda", dtype=torch.bfloat16)]  # fmt: skip
        weights = (gu, None, wd, *sw)
        out, saved, saved_sh = torch.ops.mok.moe(x, idx, tw, *weights, e, cfg, "", fused, recompute)
        grads = torch.ops.mok.moe_backward(
            out, x, idx, tw, *weights, e, cfg, "", saved, saved_sh, recompute, fused
        )
        assert out.shape == x.shape and out.dtype == x.dtype and out.device == x.device
        tile = config.row_tile if fused else mf.UNFUSED_ROW_TILE
        rows = 0 if recompute else n * k + e * (tile - 1)
        assert saved.dtype == saved_sh.dtype == torch.float32
        assert tuple(saved.shape) == ((0,) if recompute else (rows, 2 * i))
        keeps = not recompute and shared % 128 == 0 and shared > 0
        assert tuple(saved_sh.shape) == ((n, 2 * shared) if keeps else (0,))
        leaves = [t for t in (x, tw, gu, wd, *sw) if t is not None]
        assert [(t.shape, t.dtype) for t in grads] == [(t.shape, t.dtype) for t in leaves]
