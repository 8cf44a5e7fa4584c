"""The torch-best layer of the training benchmarks under autograd, shared by the one-GPU rows
(:mod:`mok.bench.train`) and the expert-parallel pipelines (:mod:`mok.bench.train_ep`): its
routed experts (gate and up as one ``torch._grouped_mm`` over ``[L, 2I, H]`` weights prepared
once, bf16 SwiGLU, the down grouped GEMM) and its shared expert, written without in-place or
``out=`` ops so that autograd differentiates them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from mok.bench.layer import permuted_layer

__all__ = ["grouped_experts", "shared_expert", "swiglu", "torch_best_train_layer"]


def swiglu(gu: torch.Tensor) -> torch.Tensor:
    """``silu(g) * u`` of ``gu`` = [R, 2I] (g | u) in its dtype, differentiable: no in-place or
    ``out=`` op (:func:`torch.chunk`'s backward writes both halves' gradients into one
    [R, 2I] tensor)."""
    g, u = gu.chunk(2, dim=-1)
    return F.silu(g) * u


def torch_best_train_layer(
    x: torch.Tensor,
    idx: torch.Tensor,
    tw: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    shared_gate_up: torch.Tensor | None = None,
    shared_down: torch.Tensor | None = None,
) -> torch.Tensor:
    """:func:`mok.bench.layer.torch_best_layer` that autograd differentiates: x [n, H], idx
    [n, K] (local expert ids), tw [n, K], the routed weights ``gate_up`` [L, 2I, H] (gate rows,
    then up rows) / ``down`` [L, H, I] and optionally the shared expert's ``shared_gate_up``
    [2Is, H] / ``shared_down`` [H, Is] -> [n, H] in x's dtype (bf16 on the GPU; fp32 runs too,
    for the tests). Gradients flow to x, tw and every weight; the routing is data."""
    out = permuted_layer(x, idx, tw, gate_up.shape[0], grouped_experts(gate_up, down))
    if shared_gate_up is None:
        return out
    return out + shared_expert(x, shared_gate_up, shared_down)


def grouped_experts(gate_up: torch.Tensor, down: torch.Tensor):
    """torch-best's routed experts on ``gate_up`` [L, 2I, H] / ``down`` [L, H, I]: a function
    (rows [R, H] grouped by expert, offs [L] int32 group ends) -> [R, H] in the rows' dtype,
    gate and up as one ``torch._grouped_mm``, :func:`swiglu`, the down grouped GEMM."""

    def experts(rows: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
        h = swiglu(torch._grouped_mm(rows, gate_up.transpose(1, 2), offs=offs))
        return torch._grouped_mm(h, down.transpose(1, 2), offs=offs)

    return experts


def shared_expert(
    x: torch.Tensor, shared_gate_up: torch.Tensor, shared_down: torch.Tensor
) -> torch.Tensor:
    """torch-best's shared expert: x [n, H], ``shared_gate_up`` [2Is, H] (gate and up as one
    ``mm``), ``shared_down`` [H, Is] -> [n, H] in x's dtype."""
    return swiglu(x @ shared_gate_up.T) @ shared_down.T
