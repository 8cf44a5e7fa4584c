"""The layer off CUDA: the reference layer behind mok's API, on one device or expert-parallel over
a process group (gloo on CPUs), with the API's error type.

``mok.functional.moe`` / ``moe_forward`` / ``moe_backward`` and ``mok.MoE`` run it where x is not
on a CUDA device, so models built on mok run anywhere: fp64 for fp64 inputs, else fp32, results
in x's dtype. Bad inputs raise :class:`mok.MoKInputError` (what the CUDA path raises for the same
mistakes) at the API boundary.
"""

from __future__ import annotations

import torch

from mok.errors import MoKInputError
from reference.ep import ep_backward, ep_forward
from reference.moe import MoEGrads
from reference.moe import moe_backward as reference_backward
from reference.moe import moe_forward as reference_forward
from reference.validation import validate_layer_inputs
from reference.weights import MoEWeights

__all__ = ["check_reference_inputs", "group_size", "reference_grads", "reference_layer"]


def group_size(group) -> int:
    """Ranks of ``group`` (1 without torch.distributed)."""
    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized()):
        return 1
    return dist.get_world_size(group)


def check_reference_inputs(
    x: torch.Tensor,
    topk_idx: torch.Tensor,
    topk_weights: torch.Tensor,
    weights: MoEWeights,
    num_experts: int,
) -> None:
    """The reference layer's input checks, raised as :class:`mok.MoKInputError` from here (a
    short traceback) rather than from deep inside the reference."""
    try:
        validate_layer_inputs(x, topk_idx, topk_weights, weights, num_experts)
    except ValueError as e:
        raise MoKInputError(str(e)) from None


def _mode(x: torch.Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _ranks(weights: MoEWeights, num_experts: int, group) -> int:
    """The group's rank count, once this rank holds its share of the experts."""
    ranks = group_size(group)
    if weights.w_gate.shape[0] * ranks != num_experts:
        raise MoKInputError(
            f"each of the {ranks} ranks holds num_experts / {ranks} = {num_experts // ranks} "
            f"experts (this rank holds {weights.w_gate.shape[0]} of num_experts={num_experts})"
        )
    return ranks


def reference_layer(
    x: torch.Tensor,  # [num_tokens, hidden]
    topk_idx: torch.Tensor,  # [num_tokens, num_topk] int
    topk_weights: torch.Tensor,  # [num_tokens, num_topk] float
    weights: MoEWeights,  # this rank's experts (+ the shared expert)
    num_experts: int,
    group=None,
) -> torch.Tensor:
    """The layer's output [num_tokens, hidden] in x's dtype: the reference on one device, or
    expert-parallel over ``group`` (:func:`reference.ep.ep_forward`)."""
    mode = _mode(x)
    if _ranks(weights, num_experts, group) > 1:
        out = ep_forward(x, topk_idx, topk_weights, weights, num_experts, compute_dtype=mode,
                         group=group).out  # fmt: skip
        return out.to(x.dtype)
    return reference_forward(x, topk_idx, topk_weights, weights, mode).to(x.dtype)


def reference_grads(
    grad_out: torch.Tensor,
    x: torch.Tensor,
    topk_idx: torch.Tensor,
    topk_weights: torch.Tensor,
    weights: MoEWeights,
    num_experts: int,
    group=None,
) -> MoEGrads:
    """The gradients of :func:`reference_layer` for ``grad_out`` (fp32 / fp64 carriers): the
    reference's explicit backward, or :func:`reference.ep.ep_backward` over ``group``."""
    mode = _mode(x)
    if _ranks(weights, num_experts, group) > 1:
        return ep_backward(grad_out, x, topk_idx, topk_weights, weights, num_experts,
                           compute_dtype=mode, group=group)  # fmt: skip
    return reference_backward(grad_out, x, topk_idx, topk_weights, weights, mode)
