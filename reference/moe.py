"""Single-device MoE layer: ``out = shared(x) + sum_k w_k * expert_k(x)``, forward and an
explicitly written backward.

Stages (each takes ``compute_dtype``, see :mod:`reference.numerics` for what it rounds):

* :func:`route`: router logits -> (topk_idx, topk_weights);
* :func:`expert_ffn` / :func:`expert_ffn_backward`: one SwiGLU expert on a block of rows;
* :func:`combine`: fixed-order fp32 (fp64 for the oracle) weighted sum of the k expert outputs
  of every token, starting from the shared expert's output: ``acc = shared; acc += w_0 * y_0;
  acc += w_1 * y_1; ...`` — the order the kernels reproduce;
* :func:`moe_forward` / :func:`moe_backward`: the whole layer on one device.

The shared expert never uses MXFP8: in ``"mxfp8"`` mode it runs in bf16.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from reference.numerics import Mode, carrier, check_mode, linear, store
from reference.validation import validate_layer_inputs
from reference.weights import MoEWeights

__all__ = [
    "route",
    "SwiGLUSaved",
    "expert_ffn",
    "expert_ffn_backward",
    "combine",
    "shared_mode",
    "moe_forward",
    "moe_backward",
    "MoEGrads",
    "finish_backward",
    "output_dtype",
    "shared_forward",
]


def route(
    router_logits: torch.Tensor, num_topk: int, score: str = "softmax", normalize: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k routing.

    router_logits: [num_tokens, num_experts] float
    Returns topk_idx [num_tokens, num_topk] int64 (distinct experts, highest score first; ties
    go to the lower expert id) and topk_weights [num_tokens, num_topk] float32 (scores of the
    chosen experts, renormalised to sum to 1 when ``normalize``). ``num_tokens`` and
    ``num_topk`` may be 0 (empty results).
    """
    if score not in ("softmax", "sigmoid"):
        raise ValueError(f"unknown router score {score!r}; supported: 'softmax', 'sigmoid'")
    if router_logits.ndim != 2 or not 0 <= num_topk <= router_logits.shape[1]:
        raise ValueError(
            f"router_logits must be [num_tokens, num_experts] with 0 <= num_topk <= num_experts "
            f"(found shape {tuple(router_logits.shape)}, num_topk={num_topk})"
        )
    logits = router_logits.double()
    scores = logits.softmax(dim=1) if score == "softmax" else logits.sigmoid()
    # NOTE: a stable descending sort breaks ties by expert id, unlike topk which is unspecified.
    order = torch.sort(scores, dim=1, descending=True, stable=True).indices[:, :num_topk]
    weights = scores.gather(1, order)
    if normalize:
        weights = weights / weights.sum(dim=1, keepdim=True)
    return order, weights.float()


@dataclass
class SwiGLUSaved:
    """What an expert's forward keeps for its backward (all [n, intermediate], carrier dtype)."""

    gate: torch.Tensor
    up: torch.Tensor
    h: torch.Tensor  # stored SwiGLU output (rounded), input of the down projection


def expert_ffn(
    x: torch.Tensor,
    w_gate: torch.Tensor,
    w_up: torch.Tensor,
    w_down: torch.Tensor,
    compute_dtype: Mode = torch.float32,
) -> tuple[torch.Tensor, SwiGLUSaved]:
    """SwiGLU FFN of one expert: ``y = (silu(x Wg^T) * (x Wu^T)) Wd^T``.

    x: [n, hidden]; w_gate, w_up: [intermediate, hidden]; w_down: [hidden, intermediate]
    Returns y [n, hidden] (rounded for storage) and the saved activations.
    """
    mode = check_mode(compute_dtype)
    gate = linear(x, w_gate, mode)
    up = linear(x, w_up, mode)
    h = store(F.silu(gate) * up, mode)  # SwiGLU runs in the GEMM epilogue, in fp32
    y = store(linear(h, w_down, mode), mode)
    return y, SwiGLUSaved(gate, up, h)


def expert_ffn_backward(
    dout: torch.Tensor,
    weight: torch.Tensor,
    x: torch.Tensor,
    saved: SwiGLUSaved,
    w_gate: torch.Tensor,
    w_up: torch.Tensor,
    w_down: torch.Tensor,
    compute_dtype: Mode = torch.float32,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Backward of ``weight * expert_ffn(x)`` for a block of rows.

    dout: [n, hidden] gradient of the layer output at each row's token; weight: [n] router
    weight of each row. Returns (dx [n, hidden], dweight [n], dw_gate [I, H], dw_up [I, H],
    dw_down [H, I]).

    The router-weight gradient is the inner product of the SwiGLU output ``h`` with the
    down-projection input gradient ``dout @ Wd`` (= <y, dout>, without materialising y again).
    """
    mode = check_mode(compute_dtype)
    c = carrier(mode)
    weight = weight.to(c)
    dh_unweighted = linear(dout, w_down.T, mode)  # [n, I]
    dweight = (saved.h * dh_unweighted).sum(dim=1)
    dh = weight[:, None] * dh_unweighted
    sig = torch.sigmoid(saved.gate)
    silu = saved.gate * sig
    dgate = store(dh * saved.up * sig * (1 + saved.gate * (1 - sig)), mode)
    dup = store(dh * silu, mode)
    dx = store(linear(dgate, w_gate.T, mode) + linear(dup, w_up.T, mode), mode)
    dw_down = linear((weight[:, None] * dout.to(c)).T, saved.h.T, mode)
    dw_gate = linear(dgate.T, x.to(c).T, mode)
    dw_up = linear(dup.T, x.to(c).T, mode)
    return dx, dweight, dw_gate, dw_up, dw_down


def shared_mode(mode: Mode) -> Mode:
    """The shared expert stays BF16 in MXFP8 mode."""
    return torch.bfloat16 if mode == "mxfp8" else mode


def combine(
    slots: torch.Tensor,
    topk_weights: torch.Tensor,
    shared_y: torch.Tensor | None,
    compute_dtype: Mode = torch.float32,
) -> torch.Tensor:
    """Fixed-order weighted sum of each token's k expert outputs.

    slots: [num_tokens, num_topk, hidden] expert outputs in slot order (token * num_topk + k)
    topk_weights: [num_tokens, num_topk]; shared_y: [num_tokens, hidden] or None
    Returns [num_tokens, hidden] in the carrier dtype, rounded for storage; with num_topk == 0
    it is the shared expert's output (zeros without one).
    """
    mode = check_mode(compute_dtype)
    c = carrier(mode)
    acc = (
        torch.zeros(slots.shape[0], slots.shape[2], dtype=c, device=slots.device)
        if shared_y is None
        else shared_y
    )
    acc = acc.to(c)
    w = topk_weights.to(c)
    for k in range(slots.shape[1]):
        acc = acc + w[:, k : k + 1] * slots[:, k].to(c)
    return store(acc, mode)


def output_dtype(mode: Mode) -> torch.dtype:
    """dtype of the layer's output and dx in this mode."""
    return torch.bfloat16 if mode in (torch.bfloat16, "mxfp8") else carrier(mode)


def shared_forward(x: torch.Tensor, weights: MoEWeights, mode: Mode) -> torch.Tensor | None:
    """The shared expert's output [num_tokens, hidden] (rounded for storage), or None."""
    if not weights.has_shared:
        return None
    ws = (weights.shared_w_gate, weights.shared_w_up, weights.shared_w_down)
    return expert_ffn(x, *ws, shared_mode(mode))[0]


def moe_forward(
    x: torch.Tensor,
    topk_idx: torch.Tensor,
    topk_weights: torch.Tensor,
    weights: MoEWeights,
    compute_dtype: Mode = torch.float32,
) -> torch.Tensor:
    """The MoE layer on one device.

    x: [num_tokens, hidden]; topk_idx: [num_tokens, num_topk] int; topk_weights: [num_tokens,
    num_topk] float. Returns [num_tokens, hidden] in fp64 / fp32 / bf16 (bf16 for "mxfp8").
    Differentiable by autograd in fp64/fp32 (used to check :func:`moe_backward`). Zero tokens
    give [0, hidden]; num_topk == 0 gives the shared expert's output alone (zeros without one).
    """
    mode = check_mode(compute_dtype)
    validate_layer_inputs(x, topk_idx, topk_weights, weights)
    num_tokens, num_topk = topk_idx.shape
    c = carrier(mode)
    slots = torch.zeros(num_tokens * num_topk, weights.hidden, dtype=c, device=x.device)
    for e in range(weights.num_experts):
        tok, k = (topk_idx == e).nonzero(as_tuple=True)
        if tok.numel():
            y, _ = expert_ffn(x[tok], weights.w_gate[e], weights.w_up[e], weights.w_down[e], mode)
            slots = slots.index_put((tok * num_topk + k,), y)
    shared_y = shared_forward(x, weights, mode)
    out = combine(slots.view(num_tokens, num_topk, weights.hidden), topk_weights, shared_y, mode)
    return out.to(output_dtype(mode))


@dataclass
class MoEGrads:
    """Gradients of the layer (of one rank's tokens and local experts under expert parallelism;
    the shared expert's weight gradients are then per-rank partials). Weight gradients are not
    rounded (fp32 / fp64 carrier)."""

    dx: torch.Tensor  # [num_tokens, hidden]
    d_topk_weights: torch.Tensor  # [num_tokens, num_topk]
    dw_gate: torch.Tensor  # [num_experts, intermediate, hidden]
    dw_up: torch.Tensor  # [num_experts, intermediate, hidden]
    dw_down: torch.Tensor  # [num_experts, hidden, intermediate]
    d_shared_w_gate: torch.Tensor | None = None
    d_shared_w_up: torch.Tensor | None = None
    d_shared_w_down: torch.Tensor | None = None


def moe_backward(
    grad_out: torch.Tensor,
    x: torch.Tensor,
    topk_idx: torch.Tensor,
    topk_weights: torch.Tensor,
    weights: MoEWeights,
    compute_dtype: Mode = torch.float32,
) -> MoEGrads:
    """Explicit backward of :func:`moe_forward` (recomputes the forward activations).

    grad_out: [num_tokens, hidden]. dx accumulates the shared expert's term first, then the k
    routed terms in k order (fp32 / fp64), like the forward combine.
    """
    mode = check_mode(compute_dtype)
    validate_layer_inputs(x, topk_idx, topk_weights, weights)
    num_tokens, num_topk = topk_idx.shape
    c = carrier(mode)
    e_, i_, h_ = weights.num_experts, weights.intermediate, weights.hidden
    dslots = torch.zeros(num_tokens * num_topk, h_, dtype=c)
    d_topk_weights = torch.zeros(num_tokens * num_topk, dtype=c)
    dw_gate = torch.zeros(e_, i_, h_, dtype=c)
    dw_up = torch.zeros(e_, i_, h_, dtype=c)
    dw_down = torch.zeros(e_, h_, i_, dtype=c)
    for e in range(e_):
        tok, k = (topk_idx == e).nonzero(as_tuple=True)
        if not tok.numel():
            continue
        ws = (weights.w_gate[e], weights.w_up[e], weights.w_down[e])
        _, saved = expert_ffn(x[tok], *ws, mode)
        dx, dw, dwg, dwu, dwd = expert_ffn_backward(
            grad_out[tok], topk_weights[tok, k], x[tok], saved, *ws, mode
        )
        dslots[tok * num_topk + k] = dx
        d_topk_weights[tok * num_topk + k] = dw
        dw_gate[e], dw_up[e], dw_down[e] = dwg, dwu, dwd
    grads = MoEGrads(
        dx=dslots,  # replaced below
        d_topk_weights=d_topk_weights.view(num_tokens, num_topk),
        dw_gate=dw_gate,
        dw_up=dw_up,
        dw_down=dw_down,
    )
    return finish_backward(grads, dslots, grad_out, x, weights, mode)


def finish_backward(
    grads: MoEGrads,
    dx_slots: torch.Tensor,
    grad_out: torch.Tensor,
    x: torch.Tensor,
    weights: MoEWeights,
    compute_dtype: Mode,
) -> MoEGrads:
    """Home-rank end of the backward: the shared expert's backward, then
    ``dx = dx_shared + dx_0 + dx_1 + ...`` in k order (fp32 / fp64), set into ``grads``.

    dx_slots: [num_tokens * num_topk, hidden] routed dx rows in slot order (token * K + k)
    """
    mode = check_mode(compute_dtype)
    c = carrier(mode)
    num_tokens = x.shape[0]
    acc = torch.zeros(num_tokens, x.shape[1], dtype=c)
    if weights.has_shared:
        sm = shared_mode(mode)
        ws = (weights.shared_w_gate, weights.shared_w_up, weights.shared_w_down)
        _, saved = expert_ffn(x, *ws, sm)
        ones = torch.ones(num_tokens, dtype=c)
        acc, _, sdg, sdu, sdd = expert_ffn_backward(grad_out, ones, x, saved, *ws, sm)
        grads.d_shared_w_gate, grads.d_shared_w_up, grads.d_shared_w_down = sdg, sdu, sdd
    num_topk = grads.d_topk_weights.shape[1]
    ones_w = torch.ones(num_tokens, num_topk, dtype=c)
    dx = combine(dx_slots.view(num_tokens, num_topk, x.shape[1]), ones_w, acc, mode)
    grads.dx = dx.to(output_dtype(mode))
    return grads
