"""Layer problems of the tests: one rank's bf16 problem for the single-GPU tests (weights drawn
in fp32 on the device: seconds instead of minutes of CPU randn at real sizes), and the small
fp64 problems of the reference's property and expert-parallel tests."""

from __future__ import annotations

import torch

from mok.spec.workload import ModelShape, make_routing
from reference.weights import MoEWeights


def layer_problem(
    shape: ModelShape, num_tokens: int, seed: int, skew: str = "hot:0.5", device: str = "cuda"
):
    """(weights, x [num_tokens, hidden] bf16, topk_idx [num_tokens, num_topk] int64,
    topk_weights [num_tokens, num_topk] fp32), all on ``device``, seeded."""
    dev = torch.device(device)
    w = MoEWeights.random(shape, seed=seed, dtype=torch.float32, device=dev).to(torch.bfloat16)
    t = make_routing(num_tokens, shape.num_experts, shape.num_topk, 1, skew, seed=seed)
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, shape.hidden, generator=g).to(torch.bfloat16).to(dev)
    idx = torch.from_numpy(t.topk_idx).to(dev)
    return w, x, idx, torch.from_numpy(t.topk_weights).to(dev)


def fp64_problem(
    num_tokens: int,
    num_experts: int,
    num_topk: int,
    hidden: int,
    intermediate: int,
    shared: int,
    skew: str,
    seed: int,
):
    """(x, grad_out [num_tokens, hidden], topk_idx [num_tokens, num_topk] int64, topk_weights
    [num_tokens, num_topk], weights), all fp64 on the CPU; ``num_topk`` may be 0."""
    shape = ModelShape("case", num_experts, hidden, intermediate, max(num_topk, 1), shared)
    w = MoEWeights.random(shape, seed=seed, dtype=torch.float64)
    g = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(num_tokens, hidden, generator=g, dtype=torch.float64)
    go = torch.randn(num_tokens, hidden, generator=g, dtype=torch.float64)
    if num_topk:
        t = make_routing(num_tokens, num_experts, num_topk, 1, skew, seed=seed)
        idx, tw = torch.from_numpy(t.topk_idx), torch.from_numpy(t.topk_weights).double()
    else:
        idx = torch.zeros(num_tokens, 0, dtype=torch.int64)
        tw = torch.zeros(num_tokens, 0, dtype=torch.float64)
    return x, go, idx, tw, w
