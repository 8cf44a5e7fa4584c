"""mok as the token dispatch and routed experts of Megatron-core's MoE layer.

Megatron-core's ``MoELayer`` (``megatron/core/transformer/moe/moe_layer.py``, read at
NVIDIA/Megatron-LM d98e8a64ddf34856e74b24714e3bedb2f5a39553, megatron-core 0.20.0) runs, per
layer, its shared experts on ``hidden_states`` [S, B, H]; its router (``probs`` [T, E], zero off
the chosen experts, and the bool ``routing_map`` [T, E], T = S * B); then a token dispatcher
chosen by ``config.moe_token_dispatcher_type`` (``dispatch_preprocess`` permutes the rows by
expert, ``token_dispatch`` all-to-alls them to the experts' owners, ``dispatch_postprocess``
sorts them by local expert), the experts module built from ``MoESubmodules.experts``
(``forward(permuted_local_hidden_states, tokens_per_expert, permuted_probs)``: per expert
``fc2(act(gate) * up * prob)``, ``fc1``'s output rows the I gate rows then the I up rows), and
the dispatcher's combine back to [S, B, H]; it returns ``(output + shared, None)``.

:class:`MoKMoELayer` is a drop-in for such a ``MoELayer``: the same call and result, with the
router and the shared experts Megatron's (the same modules, so the aux losses and the expert
bias still update), and the dispatch, experts and combine one call of
:func:`mok.autograd.moe_on_leaves` (mok's kernels on a CUDA device, the reference layer
elsewhere). The dispatcher is not a spec submodule in Megatron (a config string picks it), so the
seam is the layer: build the model as usual and swap the layers, or let a spec build them::

    from mok.integrations.megatron import replace_moe_layers
    replace_moe_layers(model)  # every MoELayer of a built Megatron-core model

    from mok.integrations.megatron import moe_layer_spec
    layer_spec.submodules.mlp = moe_layer_spec(layer_spec.submodules.mlp)  # the MoE ModuleSpec

Weights. Megatron keeps per local expert ``linear_fc1`` [2I, H] (gate rows, then up rows) and
``linear_fc2`` [H, I]: ``TEGroupedMLP``'s ``linear_fc1.weight<l>`` / ``linear_fc2.weight<l>``,
``SequentialMLP``'s ``local_experts.<l>.linear_fc1.weight`` / ``.linear_fc2.weight``, and the
legacy ``GroupedMLP``'s ``weight1`` [H, L * 2I] / ``weight2`` [L * I, H] (read as [L, H, 2I] /
[L, I, H]). Those are mok's ``gate_up`` [L, 2I, H] and ``down`` [L, H, I] per expert: they are
stacked (transposed for GroupedMLP) once, at the swap; no step copies a weight. The Parameters'
``allreduce`` flag (Megatron DDP's expert-parameter marker) is kept. Checkpoints are mok's keys
(``gate_up`` / ``down``), not Megatron's sharded state dict.

Gradients. ``main_grad=True``: mok adds the experts' weight gradients (fp32) into each
Parameter's ``main_grad`` (Megatron DDP's buffer, as its optimizer reads it) and sets
``grad_added_to_main_grad``; ``.grad`` stays None. On CUDA the weight-gradient kernel's fp32 sums
are added directly (never rounded to bf16). Eager only: under torch.compile mok raises
:class:`mok.MoKUnsupportedError` (its compiled ops return gradients and have no side effect on a
buffer; leave it False there and Megatron DDP's hooks add ``.grad`` into ``main_grad``). Megatron
DDP's ``overlap_grad_reduce`` marks a bucket ready from each Parameter's ``.grad`` hook, which
``main_grad=True`` bypasses: use it without overlapped reduction.

Expert parallelism is mok's own: with ``group`` (Megatron's ``pg_collection.ep``) of R ranks
each rank keeps its E / R local experts (Megatron's: experts [rank * E / R, (rank + 1) * E / R))
and its own tokens with global expert ids; mok's dispatch moves the rows, no Megatron
all-to-all runs. ``group=None`` is one rank, which needs the layer to hold all E experts.

Supported: SwiGLU experts (``gated_linear_unit=True``, ``activation_func=F.silu``), no bias,
the probs on the expert outputs, exactly ``moe_router_topk`` experts per token. Refused with
:class:`mok.MoKUnsupportedError`: token dropping (``moe_expert_capacity_factor``), probs on the
inputs (``moe_apply_probs_on_input``), interleaved GLU rows (``moe_mlp_glu_interleave_size``),
latent MoE (``moe_latent_size``), fp8 / fp4, expert tensor parallelism, TE's single grouped
weight, and any other experts module. Megatron's partial CUDA graphs (``intermediate_tensors``)
and its delayed weight-gradient overlap (``backward_dw``) are not run. mok computes in the
Parameters' dtype (bf16 kernels on Hopper; fp32 or fp64 reference elsewhere).

Importing this module imports neither Megatron (it never does: modules are read by their
attributes and ``ModuleSpec`` is copied with :func:`dataclasses.replace`) nor mok's layer.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch
from torch import nn

from mok.errors import MoKInputError, MoKUnsupportedError
from mok.ranks import solo_group
from mok.spec.config import MoKConfig

__all__ = ["MoKMoELayer", "moe_layer_spec", "replace_moe_layers"]


class MoKMoELayer(nn.Module):
    """Megatron-core's ``MoELayer`` with mok's dispatch, experts and combine. ``router`` and
    ``shared_experts`` (or None): Megatron's modules; ``gate_up`` [L, 2I, H] and ``down``
    [L, H, I]: this rank's experts; ``num_experts`` / ``topk``: the global expert count and
    the router's top-k; ``group``, ``config``, ``fused``, ``recompute``: those of
    :class:`mok.MoE`; ``main_grad``: add the experts' weight gradients into ``main_grad``."""

    def __init__(
        self,
        router: nn.Module,
        gate_up: torch.Tensor,  # [num_local_experts, 2 * ffn_hidden, hidden]
        down: torch.Tensor,  # [num_local_experts, hidden, ffn_hidden]
        *,
        num_experts: int,
        topk: int,
        shared_experts: nn.Module | None = None,
        group=None,
        config: MoKConfig | dict | str | Path | None = None,
        fused: bool = False,
        recompute: bool = True,
        main_grad: bool = False,
    ) -> None:
        super().__init__()
        from mok.reference_layer import group_size

        local, two_i, hidden = gate_up.shape
        if two_i % 2 or tuple(down.shape) != (local, hidden, two_i // 2):
            raise MoKInputError(
                f"gate_up must be [L, 2I, H] and down [L, H, I] (found {tuple(gate_up.shape)} "
                f"and {tuple(down.shape)})"
            )
        ranks = 1 if group is None else group_size(group)
        if local * ranks != num_experts:
            raise MoKInputError(
                f"each of the {ranks} ranks holds num_experts / {ranks} experts (this rank holds "
                f"{local} of num_experts={num_experts}); pass group= the expert-parallel group"
            )
        self.router, self.shared_experts = router, shared_experts
        self.gate_up = gate_up if isinstance(gate_up, nn.Parameter) else nn.Parameter(gate_up)
        self.down = down if isinstance(down, nn.Parameter) else nn.Parameter(down)
        self.num_experts, self.topk = num_experts, topk
        self.group, self.config, self.fused, self.recompute = group, config, fused, recompute
        self.main_grad = main_grad

    @classmethod
    def from_moe_layer(cls, moe: nn.Module, *, group=None, **kw) -> MoKMoELayer:
        """The module for a built Megatron-core ``MoELayer`` ``moe``: its router and shared
        experts as they are, its local experts' weights stacked once into ``gate_up`` /
        ``down`` (``kw``: the options of :class:`MoKMoELayer`). Raises
        :class:`mok.MoKUnsupportedError` naming what of ``moe.config`` or ``moe.experts`` mok
        does not run."""
        cfg = moe.config
        _check_config(cfg)
        gate_up, down, sources = _expert_weights(moe.experts, cfg)
        params = []
        for w, src in zip((gate_up, down), sources, strict=True):
            p = nn.Parameter(w, requires_grad=src.requires_grad)
            if hasattr(src, "allreduce"):
                p.allreduce = src.allreduce  # Megatron DDP: expert params reduce over expert-DP
            params.append(p)
        return cls(
            moe.router, *params, num_experts=cfg.num_moe_experts, topk=cfg.moe_router_topk,
            shared_experts=getattr(moe, "shared_experts", None), group=group, **kw,
        )  # fmt: skip

    def forward(
        self,
        hidden_states: torch.Tensor,  # [seq, batch, hidden]
        intermediate_tensors=None,
        padding_mask: torch.Tensor | None = None,  # [batch, seq] bool, True for real tokens
    ) -> tuple[torch.Tensor, None]:  # ([seq, batch, hidden], no bias)
        """``MoELayer.forward``: shared experts plus sum_k probs[t, e_k] * expert_{e_k}(x[t])
        over the router's ``routing_map`` (exactly ``topk`` experts per token)."""
        from mok.autograd import moe_on_leaves
        from reference.weights import MoEWeights

        if intermediate_tensors is not None:
            raise MoKUnsupportedError(
                "MoKMoELayer runs the layer in one call; Megatron's partial CUDA graph capture "
                "(intermediate_tensors) is not supported"
            )
        shared = None if self.shared_experts is None else self.shared_experts(hidden_states)
        if padding_mask is None:
            probs, routing_map = self.router(hidden_states)
        else:  # MoELayer hands the router [seq, batch]
            probs, routing_map = self.router(hidden_states, padding_mask.transpose(0, 1).bool())
        seq, batch, hidden = hidden_states.shape
        # the chosen experts of each token in ascending id order (stable sort, no host sync)
        topk_idx = routing_map.to(torch.int8).sort(dim=1, descending=True, stable=True).indices
        topk_idx = topk_idx[:, : self.topk]  # [num_tokens, topk] int64, global expert ids
        topk_weights = probs.gather(1, topk_idx)  # [num_tokens, topk], the router's dtype
        i = self.gate_up.shape[1] // 2
        weights = MoEWeights(self.gate_up[:, :i], self.gate_up[:, i:], self.down)
        leaves = [self.gate_up, None, self.down, None, None, None]  # gate_up: one gate/up leaf
        x = hidden_states.reshape(seq * batch, hidden).to(self.gate_up.dtype)
        out = moe_on_leaves(
            x, topk_idx, topk_weights, weights, leaves, self.num_experts, self.config,
            solo_group(self.group), self.fused, self.recompute, self.main_grad,
        )  # fmt: skip
        out = out.to(hidden_states.dtype).view(seq, batch, hidden)
        return (out if shared is None else out + shared), None

    def set_layer_number(self, layer_number: int) -> None:
        """``BaseMoELayer.set_layer_number``: Megatron's transformer layer calls it; the router
        keeps the number (its aux-loss logging)."""
        self.layer_number = layer_number
        if hasattr(self.router, "set_layer_number"):
            self.router.set_layer_number(layer_number)

    def extra_repr(self) -> str:
        local, two_i, hidden = self.gate_up.shape
        return (
            f"num_experts={self.num_experts}, local={local}, topk={self.topk}, hidden={hidden}, "
            f"ffn_hidden={two_i // 2}, main_grad={self.main_grad}"
        )


def replace_moe_layers(model: nn.Module, **kw) -> int:
    """Replace every Megatron-core ``MoELayer`` in ``model`` (by class name, subclasses too)
    with :meth:`MoKMoELayer.from_moe_layer` of it (``kw``: its options); returns how many."""
    count = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if any(c.__name__ == "MoELayer" for c in type(child).__mro__):
                setattr(parent, name, MoKMoELayer.from_moe_layer(child, **kw))
                count += 1
    return count


def moe_layer_spec(spec, **kw):
    """A copy of Megatron's MoE ``ModuleSpec`` (``module=MoELayer``, ``submodules=
    MoESubmodules(...)``) that builds :class:`MoKMoELayer`: Megatron's ``build_module`` calls
    the copy's module with the layer's arguments; it builds Megatron's layer (router, shared
    experts, initialised experts), then converts it (``kw``: :meth:`MoKMoELayer.from_moe_layer`'s
    options; ``group=None`` takes the layer's ``ep_group`` where it spans more than one rank)."""
    if not dataclasses.is_dataclass(spec) or not hasattr(spec, "module"):
        raise MoKInputError(f"expected Megatron's ModuleSpec of MoELayer (found {spec!r})")
    params = {**spec.params, "_mok_megatron_module": spec.module, "_mok_options": kw}
    return dataclasses.replace(spec, module=_BuiltFromSpec, params=params)


class _BuiltFromSpec:
    """Called as a ModuleSpec's module class: builds Megatron's layer, returns its
    :class:`MoKMoELayer` (``__new__`` returns another type, so no ``__init__`` runs)."""

    def __new__(cls, *args, _mok_megatron_module, _mok_options, **kwargs):
        module = _mok_megatron_module
        if isinstance(module, tuple):  # (import path, name), as ModuleSpec allows
            import importlib

            module = getattr(importlib.import_module(module[0]), module[1])
        moe = module(*args, **kwargs)
        options = dict(_mok_options)
        ep = getattr(moe, "ep_group", None)
        if options.get("group") is None and ep is not None and ep.size() > 1:
            options["group"] = ep
        return MoKMoELayer.from_moe_layer(moe, **options)


def _check_config(cfg) -> None:
    """MoKUnsupportedError listing each setting of Megatron's TransformerConfig ``cfg`` that
    mok's layer does not compute."""
    import torch.nn.functional as F

    differs = []
    if not getattr(cfg, "gated_linear_unit", False) or cfg.activation_func is not F.silu:
        differs.append("experts other than SwiGLU (gated_linear_unit=True, F.silu)")
    checks = {
        "add_bias_linear": "expert biases",
        "moe_expert_capacity_factor": "token dropping",
        "moe_apply_probs_on_input": "probs on the expert inputs",
        "moe_mlp_glu_interleave_size": "interleaved GLU rows",
        "moe_latent_size": "latent MoE projections",
        "fp8": "fp8",
        "fp4": "fp4",
        "moe_single_grouped_weight": "TE's single grouped weight",
    }
    differs += [f"{what} ({k}={getattr(cfg, k)!r})" for k, what in checks.items() if _on(cfg, k)]
    etp = getattr(cfg, "expert_tensor_parallel_size", None) or 1
    if etp > 1:
        differs.append(f"expert tensor parallelism (expert_tensor_parallel_size={etp})")
    if differs:
        raise MoKUnsupportedError(
            f"mok runs Megatron's MoE layer with SwiGLU experts without bias, exactly "
            f"moe_router_topk experts per token and probs on the expert outputs; this config has "
            f"{', '.join(differs)}: keep Megatron's MoELayer for it"
        )


def _on(cfg, key: str) -> bool:
    value = getattr(cfg, key, None)
    return value is not None and value is not False


def _expert_weights(experts: nn.Module, cfg) -> tuple[torch.Tensor, torch.Tensor, tuple]:
    """(gate_up [L, 2I, H], down [L, H, I], (a source fc1 Parameter, a source fc2 Parameter))
    of Megatron's experts module: stacked copies of its local experts' weights."""
    kinds = {c.__name__ for c in type(experts).__mro__}
    hidden = cfg.hidden_size
    inter = getattr(cfg, "moe_ffn_hidden_size", None) or cfg.ffn_hidden_size
    if "TEGroupedMLP" in kinds and hasattr(getattr(experts, "linear_fc1", None), "weight0"):
        local = experts.num_local_experts
        fc1 = [getattr(experts.linear_fc1, f"weight{i}") for i in range(local)]
        fc2 = [getattr(experts.linear_fc2, f"weight{i}") for i in range(local)]
    elif "SequentialMLP" in kinds:
        fc1 = [e.linear_fc1.weight for e in experts.local_experts]
        fc2 = [e.linear_fc2.weight for e in experts.local_experts]
    elif "GroupedMLP" in kinds and hasattr(experts, "weight1"):  # legacy: [H, L*2I], [L*I, H]
        local = experts.num_local_experts
        w1 = experts.weight1.detach().view(local, hidden, 2 * inter).transpose(1, 2)
        w2 = experts.weight2.detach().view(local, inter, hidden).transpose(1, 2)
        return w1.contiguous(), w2.contiguous(), (experts.weight1, experts.weight2)
    else:
        raise MoKUnsupportedError(
            f"mok reads Megatron's TEGroupedMLP (per-expert weight<l>), SequentialMLP or "
            f"GroupedMLP experts; {type(experts).__name__} is none of them: keep Megatron's "
            f"MoELayer for this model"
        )
    shapes = {(tuple(a.shape), tuple(b.shape)) for a, b in zip(fc1, fc2, strict=True)}
    if shapes != {((2 * inter, hidden), (hidden, inter))}:
        raise MoKUnsupportedError(
            f"expected each expert's linear_fc1 [2I, H] = {[2 * inter, hidden]} and linear_fc2 "
            f"[H, I] = {[hidden, inter]} (found {sorted(shapes)}; expert tensor parallelism "
            f"shards them and is not supported)"
        )
    gate_up = torch.stack([w.detach() for w in fc1])
    down = torch.stack([w.detach() for w in fc2])
    return gate_up, down, (fc1[0], fc2[0])
