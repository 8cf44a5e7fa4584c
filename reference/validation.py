"""Input checks of the reference layer. Every message says what was found and what is expected."""

from __future__ import annotations

import torch

from reference.schedule import validate_routing
from reference.weights import MoEWeights

__all__ = ["validate_layer_inputs"]

_FLOATS = (torch.float64, torch.float32, torch.bfloat16, torch.float16)


def validate_layer_inputs(
    x: torch.Tensor,
    topk_idx: torch.Tensor,
    topk_weights: torch.Tensor,
    weights: MoEWeights,
    num_experts: int | None = None,
) -> None:
    """Check the layer's inputs; ``num_experts`` is the global count (default: the weights')."""
    num_experts = weights.num_experts if num_experts is None else num_experts
    if x.ndim != 2:
        raise ValueError(f"x must be [num_tokens, hidden] (found shape {tuple(x.shape)})")
    if x.dtype not in _FLOATS:
        raise ValueError(f"x must be a float tensor (found {x.dtype})")
    if x.shape[1] != weights.hidden:
        raise ValueError(f"x has hidden={x.shape[1]} but the weights have hidden={weights.hidden}")
    if topk_idx.ndim != 2 or topk_idx.shape[0] != x.shape[0]:
        raise ValueError(
            f"topk_idx must be [num_tokens={x.shape[0]}, num_topk] (found shape "
            f"{tuple(topk_idx.shape)})"
        )
    if topk_weights.shape != topk_idx.shape:
        raise ValueError(
            f"topk_weights has shape {tuple(topk_weights.shape)}, expected the shape of topk_idx "
            f"{tuple(topk_idx.shape)}"
        )
    if topk_weights.dtype not in _FLOATS:
        raise ValueError(f"topk_weights must be a float tensor (found {topk_weights.dtype})")
    w_dtype = weights.w_gate.dtype
    if w_dtype != x.dtype:
        raise ValueError(
            f"x is {x.dtype} but the expert weights are {w_dtype}; give both the same dtype"
        )
    devices = {t.device for t in (x, topk_idx, topk_weights, weights.w_gate)}
    if len(devices) > 1:
        raise ValueError(
            f"inputs live on different devices ({', '.join(sorted(map(str, devices)))}); "
            "move them to one device"
        )
    if topk_idx.shape[1] > num_experts:
        raise ValueError(f"num_topk={topk_idx.shape[1]} exceeds num_experts={num_experts}")
    validate_routing(topk_idx, num_experts)
    finite = torch.isfinite(topk_weights)
    if not bool(finite.all()):
        tok, k = (~finite).nonzero()[0].tolist()
        raise ValueError(
            f"topk_weights is not finite at token {tok}, k={k} "
            f"(value {topk_weights[tok, k].item()}); router weights must be finite"
        )
