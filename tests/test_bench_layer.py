"""The layer benchmark's routed-expert FFN of its baselines, on the CPU."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from mok.bench.layer import swiglu_experts
from mok.spec.workload import ModelShape
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


def test_swiglu_experts_follows_the_bf16_rule_against_an_expert_loop():
    w = MoEWeights.random(ModelShape("t", 3, 32, 16, 2), seed=3, dtype=torch.bfloat16)
    a = torch.randn(10, 32, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16)
    ends = [4, 4, 10]  # expert 1 gets no rows
    got = swiglu_experts(a, w, torch.tensor(ends, dtype=torch.int32))
    tol.assert_bf16_rule(got, _loop(a, w, ends, torch.bfloat16), _loop(a, w, ends, torch.float64))
