"""``mok.integrations.megatron``: mok as Megatron-core's MoE dispatch and routed experts.

megatron-core does not install here (no wheel, no network), so the test compares against an
equivalent written in this file from the semantics of NVIDIA/Megatron-LM at commit
d98e8a64ddf34856e74b24714e3bedb2f5a39553 (megatron-core 0.20.0: ``moe_layer.py``,
``experts.py``, ``token_dispatcher.py``, ``router.py``, ``spec_utils.py``), not Megatron's code:
a top-k softmax router returning dense ``probs`` [T, E] and a bool ``routing_map`` [T, E]; the
local dispatcher's permutation (rows grouped by expert, tokens ascending within an expert) and
its combine (scatter-add onto the tokens); experts computing ``fc2(silu(gate) * up * prob)``
with ``fc1``'s rows the I gate rows then the I up rows, held as ``TEGroupedMLP``'s
``linear_fc1.weight<l>``, ``SequentialMLP``'s ``local_experts.<l>.linear_fc1.weight`` or the
legacy ``GroupedMLP``'s ``weight1`` [H, L * 2I]; a shared expert added to the output; a
``ModuleSpec`` built the way ``build_module`` does. fp64 on a CPU throughout.

Checked: output and every gradient (hidden states, router, shared expert, experts) to 1e-10;
``main_grad=True`` accumulating into fp32 ``main_grad`` what ``.grad`` would hold; a spec-built
layer; the swap of a model's layers; the refusals; the README snippet.
"""

from __future__ import annotations

import dataclasses
import re
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from mok import MoKUnsupportedError
from mok.integrations.megatron import MoKMoELayer, moe_layer_spec, replace_moe_layers
from tests import tolerances as tol

ROOT = Path(__file__).resolve().parents[1]
HIDDEN, FFN, EXPERTS, TOPK, SEQ, BATCH = 16, 12, 8, 3, 5, 2


# ---- the equivalent of Megatron-core's modules (from their semantics) -----------------------


def megatron_config(**over) -> SimpleNamespace:
    cfg = dict(
        hidden_size=HIDDEN, ffn_hidden_size=4 * HIDDEN, moe_ffn_hidden_size=FFN,
        num_moe_experts=EXPERTS, moe_router_topk=TOPK, gated_linear_unit=True,
        activation_func=F.silu, add_bias_linear=False, moe_expert_capacity_factor=None,
        moe_apply_probs_on_input=False, moe_mlp_glu_interleave_size=None, moe_latent_size=None,
        fp8=None, fp4=None, expert_tensor_parallel_size=1, moe_single_grouped_weight=False,
    )  # fmt: skip
    return SimpleNamespace(**{**cfg, **over})


def rand(g: torch.Generator, *shape: int) -> nn.Parameter:
    return nn.Parameter(torch.randn(*shape, generator=g, dtype=torch.float64) * 0.3)


class TopKRouter(nn.Module):
    """softmax over the expert logits, top-k: (probs [T, E], zero off the chosen; routing_map)."""

    def __init__(self, g: torch.Generator) -> None:
        super().__init__()
        self.weight = rand(g, EXPERTS, HIDDEN)

    def forward(self, x, padding_mask=None):
        scores = torch.softmax(x.reshape(-1, HIDDEN) @ self.weight.T, dim=-1)
        idx = torch.topk(scores, TOPK, dim=-1).indices
        routing_map = torch.zeros_like(scores, dtype=torch.bool).scatter(1, idx, True)
        return scores * routing_map, routing_map


def swiglu_prob(rows, fc1, fc2, prob):
    gate, up = torch.chunk(rows @ fc1.T, 2, dim=-1)
    return (F.silu(gate) * up * prob[:, None]) @ fc2.T


class _Weights(nn.Module):
    pass


class _Experts(nn.Module):
    """forward(permuted rows, tokens per expert, permuted probs) -> (rows' outputs, None) over
    ``weights(l)``: (fc1 [2I, H], fc2 [H, I]) of local expert l."""

    def forward(self, permuted, tokens_per_expert, permuted_probs):
        outs = []
        rows_e, probs_e = permuted.split(tokens_per_expert), permuted_probs.split(tokens_per_expert)
        for e, (rows, p) in enumerate(zip(rows_e, probs_e, strict=True)):
            outs.append(swiglu_prob(rows, *self.weights(e), p))
        return torch.cat(outs), None

    def grads(self):  # [L, 2I, H], [L, H, I]
        per_expert = [self.weights(e) for e in range(self.num_local_experts)]
        return [torch.stack([w.grad for w in ws]) for ws in zip(*per_expert, strict=True)]


class TEGroupedMLP(_Experts):
    def __init__(self, fc1, fc2) -> None:
        super().__init__()
        self.num_local_experts = len(fc1)
        self.linear_fc1, self.linear_fc2 = _Weights(), _Weights()
        for i, (a, b) in enumerate(zip(fc1, fc2, strict=True)):
            setattr(self.linear_fc1, f"weight{i}", a)
            setattr(self.linear_fc2, f"weight{i}", b)

    def weights(self, e):
        return getattr(self.linear_fc1, f"weight{e}"), getattr(self.linear_fc2, f"weight{e}")


class SequentialMLP(_Experts):
    def __init__(self, fc1, fc2) -> None:
        super().__init__()
        self.num_local_experts = len(fc1)
        self.local_experts = nn.ModuleList()
        for a, b in zip(fc1, fc2, strict=True):
            e = nn.Module()
            e.linear_fc1, e.linear_fc2 = _Weights(), _Weights()
            e.linear_fc1.weight, e.linear_fc2.weight = a, b
            self.local_experts.append(e)

    def weights(self, e):
        expert = self.local_experts[e]
        return expert.linear_fc1.weight, expert.linear_fc2.weight


class GroupedMLP(_Experts):
    """Legacy: weight1 [H, L * 2I] (view [L, H, 2I]) and weight2 [L * I, H] (view [L, I, H])."""

    def __init__(self, fc1, fc2) -> None:
        super().__init__()
        self.num_local_experts = len(fc1)
        w1 = torch.stack([a.detach().T for a in fc1])  # [L, H, 2I], its memory is weight1's
        self.weight1 = nn.Parameter(w1.reshape(HIDDEN, -1))
        self.weight2 = nn.Parameter(torch.cat([b.detach().T for b in fc2]))

    def weights(self, e):
        w1 = self.weight1.view(self.num_local_experts, HIDDEN, 2 * FFN)  # GroupedMLP's view
        return w1[e].T, self.weight2.view(self.num_local_experts, FFN, HIDDEN)[e].T

    def grads(self):
        w1 = self.weight1.grad.view(EXPERTS, HIDDEN, 2 * FFN).transpose(1, 2)
        return [w1, self.weight2.grad.view(EXPERTS, FFN, HIDDEN).transpose(1, 2)]


class SharedExpertMLP(nn.Module):
    def __init__(self, g: torch.Generator) -> None:
        super().__init__()
        self.fc1, self.fc2 = rand(g, 2 * FFN, HIDDEN), rand(g, HIDDEN, FFN)

    def forward(self, x):
        gate, up = torch.chunk(x @ self.fc1.T, 2, dim=-1)
        return (F.silu(gate) * up) @ self.fc2.T


class MoELayer(nn.Module):
    """route -> permute by expert -> experts -> scatter-add back -> plus the shared expert."""

    def __init__(self, config=None, submodules=None, layer_number=None, seed: int = 0) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.config = config or megatron_config()
        self.router = TopKRouter(g)
        fc1 = [rand(g, 2 * FFN, HIDDEN) for _ in range(EXPERTS)]
        fc2 = [rand(g, HIDDEN, FFN) for _ in range(EXPERTS)]
        self.experts = (submodules or TEGroupedMLP)(fc1, fc2)
        self.shared_experts = SharedExpertMLP(g)

    def forward(self, hidden_states, intermediate_tensors=None, padding_mask=None):
        x = hidden_states.reshape(-1, HIDDEN)
        probs, routing_map = self.router(x)
        by_expert = routing_map.T  # [E, T]
        tokens = torch.arange(x.shape[0]).expand(EXPERTS, -1).masked_select(by_expert)
        permuted_probs = probs.T.masked_select(by_expert)
        counts = by_expert.sum(1).tolist()
        y, _ = self.experts(x[tokens], counts, permuted_probs)
        out = torch.zeros_like(x).index_add(0, tokens, y).view(hidden_states.shape)
        return out + self.shared_experts(hidden_states), None


def inputs(seed: int = 7) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(SEQ, BATCH, HIDDEN, generator=g, dtype=torch.float64).requires_grad_()


def close(a: torch.Tensor, b: torch.Tensor) -> None:
    torch.testing.assert_close(a, b, rtol=tol.FP64_RTOL, atol=tol.FP64_ATOL)


# ---- tests -----------------------------------------------------------------------------------


@pytest.mark.parametrize("experts", [TEGroupedMLP, SequentialMLP, GroupedMLP])
def test_output_and_gradients_match_megatron(experts):
    ref = MoELayer(submodules=experts)
    x_ref = inputs()
    out_ref, bias = ref(x_ref)
    out_ref.pow(2).sum().backward()

    layer = MoKMoELayer.from_moe_layer(MoELayer(submodules=experts))
    x = inputs()
    out, mok_bias = layer(x)
    out.pow(2).sum().backward()

    assert bias is None and mok_bias is None
    close(out, out_ref)
    close(x.grad, x_ref.grad)
    close(layer.router.weight.grad, ref.router.weight.grad)
    close(layer.shared_experts.fc1.grad, ref.shared_experts.fc1.grad)
    close(layer.shared_experts.fc2.grad, ref.shared_experts.fc2.grad)
    gate_up_grad, down_grad = ref.experts.grads()
    close(layer.gate_up.grad, gate_up_grad)
    close(layer.down.grad, down_grad)


def test_main_grad_accumulates_what_grad_would_hold():
    plain = MoKMoELayer.from_moe_layer(MoELayer())
    into = MoKMoELayer.from_moe_layer(MoELayer(), main_grad=True)
    for p in (into.gate_up, into.down):
        p.main_grad = torch.zeros(p.shape, dtype=torch.float32)
        p.grad_added_to_main_grad = False
    for step in range(2):  # two micro-batches accumulate
        for layer in (plain, into):
            layer(inputs(seed=step))[0].pow(2).sum().backward()
    for p, q in ((into.gate_up, plain.gate_up), (into.down, plain.down)):
        assert p.grad is None and p.grad_added_to_main_grad
        torch.testing.assert_close(p.main_grad, q.grad.float(), rtol=tol.FP32_RTOL, atol=0)
    assert into.router.weight.grad is not None  # the router's gradient is autograd's as usual


def test_weights_stacked_once_not_per_step():
    layer = MoKMoELayer.from_moe_layer(MoELayer())
    ptrs = (layer.gate_up.data_ptr(), layer.down.data_ptr())
    layer(inputs())[0].sum().backward()
    assert (layer.gate_up.data_ptr(), layer.down.data_ptr()) == ptrs
    assert [n for n, _ in layer.named_parameters() if "experts" not in n and "router" not in n] == [
        "gate_up",
        "down",
    ]


@dataclasses.dataclass
class ModuleSpec:
    """Megatron's ModuleSpec fields; build() is build_module's call for a class module."""

    module: object
    params: dict = dataclasses.field(default_factory=dict)
    submodules: object = None

    def build(self, *args, **kwargs):
        return self.module(*args, **self.params, submodules=self.submodules, **kwargs)


def test_spec_builds_mok_layer():
    spec = ModuleSpec(module=MoELayer, params={"seed": 3}, submodules=SequentialMLP)
    built = moe_layer_spec(spec).build(megatron_config(), layer_number=1)
    assert isinstance(built, MoKMoELayer) and spec.module is MoELayer
    ref = spec.build(megatron_config(), layer_number=1)
    close(built(inputs())[0], ref(inputs())[0])


def test_replace_moe_layers():
    model = nn.Sequential(MoELayer(seed=1), MoELayer(seed=2))
    x = inputs()
    want = model[1](model[0](x)[0])[0]
    assert replace_moe_layers(model) == 2
    assert all(isinstance(m, MoKMoELayer) for m in model)
    close(model[1](model[0](x)[0])[0], want)
    assert "megatron" not in sys.modules


@pytest.mark.parametrize(
    "over, match",
    [
        ({"moe_expert_capacity_factor": 1.0}, "token dropping"),
        ({"moe_apply_probs_on_input": True}, "probs on the expert inputs"),
        ({"activation_func": F.gelu}, "other than SwiGLU"),
        ({"expert_tensor_parallel_size": 2}, "expert tensor parallelism"),
        ({"fp8": "e4m3"}, "fp8"),
    ],
)
def test_refusals(over, match):
    with pytest.raises(MoKUnsupportedError, match=match):
        MoKMoELayer.from_moe_layer(MoELayer(config=megatron_config(**over)))


def test_refuses_other_experts_and_partial_graphs():
    moe = MoELayer()
    moe.experts = nn.Linear(2, 2)
    with pytest.raises(MoKUnsupportedError, match="Linear is none of them"):
        MoKMoELayer.from_moe_layer(moe)
    layer = MoKMoELayer.from_moe_layer(MoELayer())
    with pytest.raises(MoKUnsupportedError, match="intermediate_tensors"):
        layer(inputs(), intermediate_tensors=(None, None))


def test_readme_snippet_runs():
    """README.md's Megatron-LM snippet on a stand-in ``model`` (two of this file's layers)."""
    text = (ROOT / "README.md").read_text()
    block = re.search(
        r"<!-- snippet: megatron -->\s*```python\n(.*?)```\s*<!-- /snippet -->", text, re.S
    )
    assert block, "README.md has no <!-- snippet: megatron --> python block"
    model = nn.Sequential(MoELayer(seed=1), MoELayer(seed=2))
    scope = {"model": model}
    exec(compile(block.group(1), "README.md[snippet: megatron]", "exec"), scope)
    assert all(isinstance(m, MoKMoELayer) for m in model)
