"""The layer benchmark's torch baselines (their routed-expert FFN and the whole torch-best layer),
on the CPU."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from mok.bench.layer import prepare, torch_best_layer, torch_experts
from mok.spec.workload import ModelShape, make_routing
from reference.moe import moe_forward
from reference.weights import MoEWeights
from tests import tolerances as tol


def _loop(a, w, ends, dtype):
    """Expert by expert; SwiGLU in fp32 (fp64 for the oracle), h rounded to ``dtype``."""
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    out, start = [], 0
    for e, end in enumerate(ends):
        rows = a[start:end].to(dtype)
        g = (rows @ w.w_gate[e].to(dtype).T).to(acc)
        u = (rows @ w.w_up[e].to(dtype).T).to(acc)
        out.append((F.silu(g) * u).to(dtype) @ w.w_down[e].to(dtype).T)
        start = end
    return torch.cat(out)


def test_torch_experts_follows_the_bf16_rule_against_an_expert_loop():
    w = MoEWeights.random(ModelShape("t", 3, 32, 16, 2), seed=3, dtype=torch.bfloat16)
    a = torch.randn(10, 32, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16)
    ends = [4, 4, 10]  # expert 1 gets no rows
    got = torch_experts(a, w, torch.tensor(ends, dtype=torch.int32))
    tol.assert_bf16_rule(got, _loop(a, w, ends, torch.bfloat16), _loop(a, w, ends, torch.float64))


def test_torch_best_layer_follows_the_bf16_rule_against_the_reference():
    shape = ModelShape("t", 8, 64, 32, 2, shared_intermediate=32)
    w = MoEWeights.random(shape, seed=5, dtype=torch.bfloat16)
    x = torch.randn(40, 64, generator=torch.Generator().manual_seed(6)).to(torch.bfloat16)
    for skew in ("uniform", "hot:0.5", "aligned"):
        t = make_routing(40, 8, 2, 1, skew, seed=40)
        idx = torch.from_numpy(t.topk_idx)
        tw = torch.from_numpy(t.topk_weights)
        got = torch_best_layer(x, idx, tw, w, *prepare(w))
        w64 = w.to(torch.float64)
        oracle = moe_forward(x.double(), idx, tw.double(), w64, torch.float64)
        ref = moe_forward(x, idx, tw, w, torch.bfloat16)
        tol.assert_bf16_rule(got, ref, oracle)
