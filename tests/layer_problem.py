"""One rank's layer problem for the single-GPU tests: bf16 weights (drawn in fp32 on the
device: seconds instead of minutes of CPU randn at real sizes), tokens and a routing."""

from __future__ import annotations

import torch

from mok.workload import ModelShape, make_routing
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
