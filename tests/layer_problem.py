"""Layer problems of the tests: one rank's bf16 problem for the single-GPU tests (weights drawn
in fp32 on the device: seconds instead of minutes of CPU randn at real sizes), the routed
experts' operands of the backward-kernel tests, and the small fp64 problems of the reference's
property and expert-parallel tests."""

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


def expert_operands(hidden: int, inter: int, sizes: list[int], tail: int, seed: int = 0):
    """The routed experts' operands on the GPU, rows grouped by expert: (a [R, H], w_gate_up
    [L, 2I, H], w_down [L, H, I], dy [R, H] bf16, row weights [R] fp32 in [0, 1), int32 group
    ends [L]) for groups of ``sizes`` rows and ``tail`` rows past the last group (R = their
    sum), weights scaled by 1 / sqrt(fan-in), seeded."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    rows = sum(sizes) + tail
    L = len(sizes)

    def rnd(*shape, scale=1.0):
        return (torch.randn(*shape, device="cuda", generator=g) * scale).bfloat16()

    a = rnd(rows, hidden)
    dy = rnd(rows, hidden)
    wgu = rnd(L, 2 * inter, hidden, scale=hidden**-0.5)
    wd = rnd(L, hidden, inter, scale=inter**-0.5)
    row_w = torch.rand(rows, device="cuda", generator=g)
    offs = torch.tensor(sizes, device="cuda").cumsum(0).to(torch.int32)
    return a, wgu, wd, dy, row_w, offs
