"""mok as an experts implementation of HF transformers' MoE models (transformers >= 5.7).

:func:`register` adds ``"mok"`` to transformers' ``ExpertsInterface``; a model then runs its
routed experts through :func:`mok.autograd.moe_on_leaves` once it asks for that name::

    import mok.integrations.hf
    mok.integrations.hf.register()
    model = AutoModelForCausalLM.from_pretrained(path, experts_implementation="mok")
    # or model.set_experts_implementation("mok") on a model that exists

transformers calls the implementation as ``fn(experts, hidden_states [T, H], top_k_index [T, K],
top_k_weights [T, K]) -> [T, H]``, with the experts module's own fused weights on ``experts``.
Every model whose experts module keeps transformers' default layout runs (Qwen3-MoE, Qwen2-MoE,
Qwen3.5-MoE, Mixtral, OLMoE, DeepSeek-V3, GLM-4-MoE, ...): ``gate_up_proj`` ``[E, 2I, H]`` (the
I gate rows, then the I up rows) and ``down_proj`` ``[E, H, I]``, no biases, SiLU, the default
gate (``act(gate) * up``). That is mok's own layout (``mok.MoE``'s ``gate_up`` / ``down``), so
both paths read the Parameters in place: mok's layer takes ``gate_up_proj`` itself as its one
gate / up operand and autograd leaf (its gate and up halves are views of it), so the CUDA path,
fused or not, makes no per-step copy and keeps no cached one (:func:`mok.experts.gate_up_weight`
copies, once per weight update, only gate / up given as two separate tensors). Other layouts
(transposed, interleaved gate / up, biases, another activation or gate: gpt-oss, for one) raise
:class:`mok.MoKUnsupportedError` at their first call. A shared expert is outside the experts
module and stays transformers'. ``loss.backward()`` gives ``gate_up_proj`` and ``down_proj`` their
gradients (they are the autograd leaves of mok's layer), and the hidden states and routing
weights theirs.

On a CUDA device the layer is mok's kernels (bf16, Hopper); elsewhere it is mok's reference
layer (fp32 for fp32 / bf16 inputs, fp64 for fp64), so a model runs and tests on any machine.

Expert parallelism. transformers' own expert parallelism (the ``ep_router`` / ``grouped_gemm``
plans of its models; ``DistributedConfig(enable_expert_parallel=True)``) gives each rank's experts
module its ``num_experts / ranks`` experts (``num_experts`` becomes that local count), calls it
with local expert ids, every slot of another rank's expert as the id ``num_local_experts`` ("not
on this rank"), and combines the ranks' outputs itself (5.17: tokens replicated on every rank,
outputs all-reduced; later releases can also move the tokens with an all-to-all). That runs with
``"mok"``: mok computes the rank's experts as a layer of one rank, each "not on this rank" slot
becoming a weight-0 slot that adds exactly zero and gets a zero gradient (:func:`local_routing`;
tests/test_integrations_hf.py runs it at two gloo ranks; transformers loads such a model through
accelerate, which the ``hf`` extra installs).
mok's own expert parallelism (the experts' owners pull the tokens over NVLink and push the
outputs back) is not reachable through this interface: it needs each token's global expert ids
on its home rank and the whole group in one call, and the interface gives a rank only its local
ids, the other ranks' collapsed into one sentinel. A ``group`` of more than one rank therefore
raises :class:`mok.MoKUnsupportedError`; ``mok.MoE`` with ``group=`` is mok's expert parallelism.

Importing this module imports neither transformers nor anything of mok's layer; :func:`register`
does, and says ``pip install "mok[hf]"`` when transformers is missing.
"""

from __future__ import annotations

import re
from pathlib import Path

import torch

from mok.errors import MoKUnsupportedError
from mok.ranks import solo_group
from mok.spec.config import MoKConfig

__all__ = ["MIN_TRANSFORMERS", "register", "local_routing"]

# The first transformers release whose models accept a name registered in ExpertsInterface
# (5.0-5.6 keep a fixed list: "eager", "grouped_mm", "batched_mm" and later "deepgemm").
MIN_TRANSFORMERS = (5, 7)


def register(
    name: str = "mok",
    config: MoKConfig | dict | str | Path | None = None,
    group=None,
    fused: bool = False,
    recompute: bool = True,
):
    """Register mok as transformers' experts implementation ``name`` and return the function
    registered. ``config``, ``fused`` and ``recompute`` are those of :class:`mok.MoE` (the CUDA
    path's :class:`mok.MoKConfig`; the fused forward kernel; keeping the routed experts' fp32
    gate / up for the backward with ``recompute=False``, Hopper only). ``group``: None, or a
    process group of one rank. Registering a name again replaces its function.

    Raises ImportError when transformers is not installed, :class:`mok.MoKUnsupportedError` for
    transformers older than 5.7 or a ``group`` of more than one rank."""
    interface = _experts_interface()
    _check_group(group)
    forward = _experts_forward(config, group, fused, recompute)
    interface.register(name, forward)
    return forward


def local_routing(
    top_k_index: torch.Tensor,  # [num_tokens, num_topk] int; >= num_local_experts: elsewhere
    top_k_weights: torch.Tensor,  # [num_tokens, num_topk] float
    num_local_experts: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' routing of one rank as mok routing of the rank's ``num_local_experts``
    experts: (topk_idx [num_tokens, k'] int64, topk_weights [num_tokens, k'], top_k_weights'
    dtype), k' = min(num_topk, num_local_experts).

    An id >= ``num_local_experts`` means "not on this rank" and must add nothing. mok takes k
    distinct valid ids per token, so each such slot gets an id in [0, k') that the token does
    not use (there are enough: a token with c such slots among k' uses at most k' - c ids) and
    weight 0, which adds an exact zero to the output and to every gradient; its routing weight's
    gradient is zero too. Where k > num_local_experts, a token holds at most num_local_experts of
    the rank's experts, so its slots are first reordered (this rank's first, in their order) and
    cut to k'. Device ops on [num_tokens, k] only: no host synchronisation."""
    num_local = num_local_experts
    away = top_k_index >= num_local
    idx, w = top_k_index, top_k_weights
    if idx.shape[1] > num_local:
        keep = torch.sort(away.to(torch.uint8), dim=1, stable=True).indices[:, :num_local]
        idx, w, away = idx.gather(1, keep), w.gather(1, keep), away.gather(1, keep)
    k = idx.shape[1]
    # ids in [0, k) each token uses (column k collects its other ids and its away slots)
    used = torch.zeros(idx.shape[0], k + 1, dtype=torch.uint8, device=idx.device)
    used.scatter_(1, torch.where(away, k, idx.clamp(min=0, max=k)), 1)
    free = torch.sort(used[:, :k], dim=1, stable=True).indices  # unused ids first, ascending
    nth = (torch.cumsum(away, dim=1) - 1).clamp(min=0)  # the slot's rank among the away slots
    idx = torch.where(away, free.gather(1, nth), idx).to(torch.int64)
    return idx, w.masked_fill(away, 0)


# ---- what register() builds -----------------------------------------------------------------


def _experts_interface():
    """transformers' ExpertsInterface, checked for a version whose models take its names."""
    try:
        import transformers
    except ImportError as e:
        raise ImportError(
            "mok.integrations.hf needs HF transformers >= 5.7, which is not installed: "
            'pip install "mok[hf]"'
        ) from e
    found = tuple(int(p) for p in re.findall(r"\d+", transformers.__version__)[:2])
    if found < MIN_TRANSFORMERS:
        raise MoKUnsupportedError(
            f"mok.integrations.hf needs transformers >= 5.7 (found {transformers.__version__}): "
            "older releases reject experts implementations registered by name; "
            'pip install -U "mok[hf]"'
        )
    from transformers.integrations.moe import ExpertsInterface

    return ExpertsInterface


def _check_group(group) -> None:
    from mok.reference_layer import group_size

    if group is not None and group_size(group) != 1:
        raise MoKUnsupportedError(
            f"mok.integrations.hf runs each rank's experts module as one rank (found a group of "
            f"{group_size(group)} ranks): transformers' experts interface gives a rank only its "
            "local expert ids (the other ranks' as one 'not on this rank' id), not the global "
            "ids mok's expert parallelism routes by. Use transformers' expert parallelism "
            "(group=None: its 'not on this rank' ids are supported) or mok.MoE with group="
        )


def _experts_forward(config, group, fused: bool, recompute: bool):
    def mok_experts_forward(
        self: torch.nn.Module,
        hidden_states: torch.Tensor,  # [num_tokens, hidden]
        top_k_index: torch.Tensor,  # [num_tokens, num_topk] int, local ids (+ "elsewhere")
        top_k_weights: torch.Tensor,  # [num_tokens, num_topk] float
    ) -> torch.Tensor:  # [num_tokens, hidden], hidden_states' dtype
        from mok.autograd import moe_on_leaves
        from reference.weights import MoEWeights

        gate_up, down = _swiglu_weights(self)
        num_local = gate_up.shape[0]
        idx, w = local_routing(top_k_index, top_k_weights, num_local)
        x = hidden_states.to(gate_up.dtype)  # as transformers' grouped_mm casts (autocast)
        inter = gate_up.shape[1] // 2
        weights = MoEWeights(gate_up[:, :inter], gate_up[:, inter:], down)
        leaves = [gate_up, None, down, None, None, None]  # gate_up is the one gate / up leaf
        out = moe_on_leaves(
            x, idx, w, weights, leaves, num_local, config, solo_group(group), fused, recompute
        )
        return out.to(hidden_states.dtype)

    return mok_experts_forward


def _swiglu_weights(experts: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    """(gate_up_proj [L, 2I, H], down_proj [L, H, I]) of a transformers experts module of the
    default layout; MoKUnsupportedError naming what differs otherwise."""
    from transformers.activations import SiLUActivation
    from transformers.integrations import moe as hf_moe

    gate_up = getattr(experts, "gate_up_proj", None)
    down = getattr(experts, "down_proj", None)
    flags = {
        "is_transposed": False,
        "is_concatenated": True,
        "has_bias": False,
        "has_gate": True,
    }
    differs = [
        f"{k}={getattr(experts, k)}"
        for k, want in flags.items()
        if getattr(experts, k, want) != want
    ]
    if not isinstance(getattr(experts, "act_fn", None), SiLUActivation | torch.nn.SiLU):
        differs.append(f"act_fn={getattr(experts, 'act_fn', None)!r}")
    default_gate = getattr(hf_moe, "_default_apply_gate", None)  # act(gate) * up
    if getattr(type(experts), "_apply_gate", default_gate) is not default_gate:
        differs.append("its own _apply_gate")
    if not (isinstance(gate_up, torch.Tensor) and isinstance(down, torch.Tensor)):
        differs.append("no gate_up_proj / down_proj tensors")
    elif gate_up.ndim != 3 or down.ndim != 3 or gate_up.shape[1] % 2:
        differs.append(f"gate_up_proj {tuple(gate_up.shape)}, down_proj {tuple(down.shape)}")
    else:
        local, two_i, hidden = gate_up.shape
        if tuple(down.shape) != (local, hidden, two_i // 2):
            differs.append(f"down_proj {tuple(down.shape)} for gate_up_proj {tuple(gate_up.shape)}")
        elif getattr(experts, "num_experts", local) != local:
            differs.append(f"num_experts={experts.num_experts} for {local} experts' weights")
    if differs:
        raise MoKUnsupportedError(
            f"mok runs experts of transformers' default layout (gate_up_proj [E, 2I, H], gate "
            f"rows then up rows; down_proj [E, H, I]; no biases; SiLU(gate) * up); "
            f"{type(experts).__name__} has {', '.join(differs)}: use another experts "
            "implementation for this model"
        )
    return gate_up, down
