"""mok as the routed experts of torchtitan's MoE models.

torchtitan's ``MoE`` (``torchtitan/models/common/moe.py``, read at pytorch/torchtitan
b5bcd76c66d0acb1a08b176d9639425bc55e0b2a) routes with its ``TokenChoiceTopKRouter`` (per token
``topk_scores_TK`` [T, K] and global ``topk_expert_ids_TK`` [T, K]) and calls
``self.routed_experts(x_TD, topk_scores_TK, topk_expert_ids_TK, num_local_tokens_per_expert_E)``:
a ``RoutedExperts`` whose token dispatcher sorts the (token, k) rows by expert (with expert
parallelism, an all-to-all moves them to the experts' owners), whose ``inner_experts``
(``GroupedExperts``) run ``w2 @ (silu(w1 @ x) * (w3 @ x))`` per expert, and whose dispatcher's
combine multiplies each row's output by its score and scatter-adds it onto its token. The shared
expert (``MoE.shared_experts``) is added by ``MoE`` outside ``routed_experts``.

:class:`MoKRoutedExperts` is a drop-in for ``moe.routed_experts``: it takes the same call (the
token counts are not needed: mok builds its own schedule) and returns the routed output [T, D]
from :func:`mok.autograd.moe_on_leaves` (mok's kernels on a CUDA device, the reference layer
elsewhere), so ``loss.backward()`` fills its Parameters' ``.grad`` and gives x and the scores
their gradients. The shared expert stays torchtitan's::

    from mok.integrations.torchtitan import replace_routed_experts
    replace_routed_experts(model)  # every moe.routed_experts of a built torchtitan model

Weights. torchtitan keeps ``w1_EFD`` (gate) [E, F, D], ``w3_EFD`` (up) [E, F, D] and ``w2_EDF``
(down) [E, D, F] (before #3425 named ``w1`` / ``w3`` / ``w2``, same layout). mok runs on one
``gate_up`` [L, 2F, D] (the F gate rows, then the F up rows) and ``down`` [L, D, F]:
:meth:`MoKRoutedExperts.from_grouped_experts` concatenates w1 and w3 once at conversion (w2 is
mok's ``down`` as it is and is taken without a copy where the rank keeps all of it); no step
copies a weight. The state dict keeps torchtitan's names and layout (``inner_experts.w1_EFD`` /
``w2_EDF`` / ``w3_EFD``, w1 and w3 as views of ``gate_up``), and loading one (torchtitan's, or
this module's) fills ``gate_up`` / ``down`` in place, so checkpoints go both ways.

Expert parallelism is mok's own: with ``group`` of R ranks each rank holds experts
[rank * E / R, (rank + 1) * E / R) (torchtitan's ``Shard(0)`` of the expert dim), passes its own
tokens with global expert ids, and mok's dispatch moves the rows to the owners and back; no
torchtitan all-to-all runs. ``group=None`` is one rank (all E experts) even in a bigger world.

Supported: the scores applied to the expert outputs (``score_before_experts=False``, the only
behaviour torchtitan has had since #3663; the old default True scaled each expert's input
instead, ``w2 (silu(w1 s x) * (w3 s x))``, which is not ``s`` times the output for a SwiGLU and
raises :class:`mok.MoKUnsupportedError`). Refused with the same error: experts modules whose
forward is not ``GroupedExperts``' own (gpt-oss's biased experts, a low-precision
``_grouped_mm``) and expert weights sharded other than over the experts (expert TP). torchtitan
computes its grouped GEMMs in bf16 whatever the weights' dtype; mok computes in the Parameters'
dtype (bf16 kernels on Hopper; fp32 or fp64 reference elsewhere), weighting in that precision.

Importing this module imports neither torchtitan (it never does: modules are read by their
attributes) nor anything of mok's layer.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from mok.errors import MoKInputError, MoKUnsupportedError
from mok.ranks import solo_group
from mok.spec.config import MoKConfig
from mok.spec.limits import expert_split_problem

__all__ = ["MoKExpertWeights", "MoKRoutedExperts", "replace_routed_experts"]

# (w1, w2, w3) Parameter names: torchtitan's since #3425, and before it
_NAMES = (("w1_EFD", "w2_EDF", "w3_EFD"), ("w1", "w2", "w3"))


class MoKExpertWeights(nn.Module):
    """This rank's routed experts as mok holds them: ``gate_up`` [L, 2F, D] and ``down``
    [L, D, F]; ``num_experts`` is the global count (torchtitan's ``inner_experts.num_experts``).
    Its state dict is torchtitan's (``names``: the w1, w2, w3 keys) and takes either form."""

    def __init__(
        self,
        num_experts: int,
        gate_up: torch.Tensor,  # [num_local_experts, 2 * hidden_dim, dim]
        down: torch.Tensor,  # [num_local_experts, dim, hidden_dim]
        names: tuple[str, str, str] = _NAMES[0],
        rank: int = 0,
    ) -> None:
        super().__init__()
        local, two_f, dim = gate_up.shape
        if two_f % 2 or tuple(down.shape) != (local, dim, two_f // 2) or num_experts % local:
            raise MoKInputError(
                f"gate_up must be [L, 2F, D] and down [L, D, F] with L dividing num_experts="
                f"{num_experts} (found {tuple(gate_up.shape)} and {tuple(down.shape)})"
            )
        self.num_experts, self.names, self.rank = num_experts, tuple(names), rank
        self.gate_up = gate_up if isinstance(gate_up, nn.Parameter) else nn.Parameter(gate_up)
        self.down = down if isinstance(down, nn.Parameter) else nn.Parameter(down)
        self.register_state_dict_post_hook(_to_torchtitan_keys)
        self.register_load_state_dict_pre_hook(_from_torchtitan_keys)

    @property
    def hidden_dim(self) -> int:
        return self.gate_up.shape[1] // 2

    def torchtitan_weights(self) -> dict[str, torch.Tensor]:
        """{w1: [L, F, D], w2: [L, D, F], w3: [L, F, D]} under torchtitan's names: views of the
        Parameters (detached), no copy."""
        f = self.hidden_dim
        w1, w2, w3 = self.names
        g = self.gate_up.detach()
        return {w1: g[:, :f], w2: self.down.detach(), w3: g[:, f:]}

    def extra_repr(self) -> str:
        local, two_f, dim = self.gate_up.shape
        return f"num_experts={self.num_experts}, local={local}, dim={dim}, hidden_dim={two_f // 2}"


def _to_torchtitan_keys(module: MoKExpertWeights, state_dict, prefix: str, local_metadata) -> None:
    del state_dict[prefix + "gate_up"], state_dict[prefix + "down"]
    for name, t in module.torchtitan_weights().items():
        state_dict[prefix + name] = t


def _from_torchtitan_keys(module: MoKExpertWeights, state_dict, prefix: str, *_args) -> None:
    """torchtitan's w1 / w2 / w3 (all E experts, or this rank's L) as gate_up / down."""
    names = next((n for n in _NAMES if all(prefix + k in state_dict for k in n)), None)
    if names is None:
        return  # mok's own keys, or missing ones (load_state_dict reports those)
    w1, w2, w3 = (state_dict.pop(prefix + k) for k in names)
    local = module.gate_up.shape[0]
    if w1.shape[0] != local and w1.shape[0] == module.num_experts:  # the whole layer's experts
        s = slice(module.rank * local, (module.rank + 1) * local)
        w1, w2, w3 = w1[s], w2[s], w3[s]
    state_dict[prefix + "gate_up"] = torch.cat([w1, w3], dim=1)
    state_dict[prefix + "down"] = w2


class MoKRoutedExperts(nn.Module):
    """torchtitan's ``RoutedExperts`` (dispatch, ``GroupedExperts``, score and combine) as mok's
    layer. ``inner_experts``: the weights (:class:`MoKExpertWeights`); ``config``, ``fused``,
    ``recompute``: those of :class:`mok.MoE`; ``group``: mok's expert-parallel group (None: one
    rank)."""

    def __init__(
        self,
        inner_experts: MoKExpertWeights,
        *,
        group=None,
        config: MoKConfig | dict | str | Path | None = None,
        fused: bool = False,
        recompute: bool = True,
    ) -> None:
        super().__init__()
        from mok.reference_layer import group_size

        ranks = 1 if group is None else group_size(group)
        local = inner_experts.gate_up.shape[0]
        if local * ranks != inner_experts.num_experts:
            raise MoKInputError(
                f"each of the {ranks} ranks holds num_experts / {ranks} experts (this rank holds "
                f"{local} of num_experts={inner_experts.num_experts})"
            )
        self.inner_experts = inner_experts
        self.group, self.config, self.fused, self.recompute = group, config, fused, recompute

    @classmethod
    def from_grouped_experts(
        cls,
        experts: nn.Module,
        *,
        group=None,
        num_experts: int | None = None,
        score_before_experts: bool = False,
        config: MoKConfig | dict | str | Path | None = None,
        fused: bool = False,
        recompute: bool = True,
    ) -> MoKRoutedExperts:
        """The module for torchtitan's ``RoutedExperts`` or ``GroupedExperts`` ``experts``: its
        w1 / w3 concatenated once into ``gate_up``, its w2 as ``down``. ``experts`` holds all
        ``num_experts`` experts (default: its ``num_experts``; with a ``group`` of R ranks each
        rank keeps its E / R) or already this rank's E / R (plain tensors or DTensors sharded
        over the experts). Raises :class:`mok.MoKUnsupportedError` for
        ``score_before_experts=True`` (also read from an old dispatcher's flag) and experts
        other than ``GroupedExperts``' SwiGLU."""
        from mok.reference_layer import group_size

        dispatcher = getattr(experts, "token_dispatcher", None)
        score_before_experts = score_before_experts or bool(
            getattr(dispatcher, "score_before_experts", False)
        )
        if score_before_experts:
            raise MoKUnsupportedError(
                "score_before_experts=True scales each expert's input by its routing score, "
                "w2 (silu(w1 s x) * (w3 s x)), which for a SwiGLU differs from mok's s * w2 "
                "(silu(w1 x) * (w3 x)) (score on the expert's output, torchtitan's "
                "score_before_experts=False and its only behaviour since #3663); build the "
                "model with score_before_experts=False to run its experts on mok"
            )
        inner = getattr(experts, "inner_experts", experts)
        names, (w1, w2, w3) = _grouped_weights(inner)
        total = num_experts if num_experts is not None else getattr(inner, "num_experts", None)
        total = w1.shape[0] if total is None else total
        ranks = 1 if group is None else group_size(group)
        rank = 0 if ranks == 1 else torch.distributed.get_rank(group)
        split = expert_split_problem(total, ranks)
        if split:
            raise MoKInputError(f"mok: {split}")
        local = total // ranks
        if w1.shape[0] == local:
            gate_up, down = torch.cat([w1, w3], dim=1), w2  # w2 is mok's down as it is
        elif w1.shape[0] == total:  # keep this rank's experts only (copies: the rest is freed)
            s = slice(rank * local, (rank + 1) * local)
            gate_up, down = torch.cat([w1[s], w3[s]], dim=1), w2[s].clone()
        else:
            raise MoKInputError(
                f"{type(inner).__name__} holds {w1.shape[0]} experts: expected num_experts="
                f"{total} or this rank's {local} (num_experts / {ranks} ranks)"
            )
        trainable = getattr(inner, names[0]).requires_grad
        gate_up = nn.Parameter(gate_up, requires_grad=trainable)
        down = nn.Parameter(down, requires_grad=trainable)
        weights = MoKExpertWeights(total, gate_up, down, names, rank)
        return cls(weights, group=group, config=config, fused=fused, recompute=recompute)

    def to_torchtitan_state_dict(self) -> dict[str, torch.Tensor]:
        """torchtitan's ``RoutedExperts`` state dict of this rank's experts:
        ``inner_experts.<w1>`` [L, F, D], ``<w2>`` [L, D, F], ``<w3>`` [L, F, D] (views, no
        copy; the same as :meth:`state_dict`)."""
        return {f"inner_experts.{k}": v for k, v in self.inner_experts.torchtitan_weights().items()}

    def forward(
        self,
        x_TD: torch.Tensor,  # [num_tokens, dim]
        topk_scores_TK: torch.Tensor,  # [num_tokens, num_topk] float, the router's scores
        topk_expert_ids_TK: torch.Tensor,  # [num_tokens, num_topk] int64, global expert ids
        num_local_tokens_per_expert_E: torch.Tensor | None = None,  # [num_experts]; unused
    ) -> torch.Tensor:  # [num_tokens, dim], x_TD's dtype
        """sum_k topk_scores_TK[t, k] * expert_{ids[t, k]}(x_TD[t]) per token: torchtitan's
        ``RoutedExperts.forward`` (the shared expert is not in it)."""
        from mok.autograd import moe_on_leaves
        from reference.weights import MoEWeights

        del num_local_tokens_per_expert_E  # mok builds its own schedule from the ids
        gate_up, down = self.inner_experts.gate_up, self.inner_experts.down
        f = self.inner_experts.hidden_dim
        weights = MoEWeights(gate_up[:, :f], gate_up[:, f:], down)
        leaves = [gate_up, None, down, None, None, None]  # gate_up is the one gate / up leaf
        x = x_TD.to(gate_up.dtype)
        out = moe_on_leaves(
            x, topk_expert_ids_TK, topk_scores_TK, weights, leaves,
            self.inner_experts.num_experts, self.config, solo_group(self.group), self.fused,
            self.recompute,
        )  # fmt: skip
        return out.to(x_TD.dtype)


def replace_routed_experts(model: nn.Module, **kw) -> int:
    """Replace every ``routed_experts`` submodule of ``model`` (torchtitan's ``MoE`` blocks)
    with :meth:`MoKRoutedExperts.from_grouped_experts` of it (``kw``: its options); returns how
    many. A model's keys and the routers, shared experts and load-balancing buffers stay."""
    moes = [m for m in model.modules() if hasattr(m, "routed_experts")]
    for m in moes:
        if not isinstance(m.routed_experts, MoKRoutedExperts):
            m.routed_experts = MoKRoutedExperts.from_grouped_experts(m.routed_experts, **kw)
    return len(moes)


def _grouped_weights(experts: nn.Module) -> tuple[tuple[str, str, str], list[torch.Tensor]]:
    """(names, [w1 [e, F, D], w2 [e, D, F], w3 [e, F, D]]) of a ``GroupedExperts`` (local
    tensors of DTensors sharded over the experts); MoKUnsupportedError naming what differs."""
    names = next((n for n in _NAMES if all(hasattr(experts, k) for k in n)), None)
    base = next((c for c in type(experts).__mro__ if c.__name__ == "GroupedExperts"), None)
    differs = []
    if names is None:
        differs.append("no w1_EFD / w2_EDF / w3_EFD (or w1 / w2 / w3) Parameters")
    for method in ("forward", "_grouped_mm"):
        if base is not None and getattr(type(experts), method, None) is not getattr(
            base, method, None
        ):
            differs.append(f"its own {method}")
    ws = []
    for k in names or ():
        w = getattr(experts, k)
        placements = getattr(w, "placements", ())
        if any(not (p.is_replicate() or (p.is_shard() and p.dim == 0)) for p in placements):
            differs.append(f"{k} sharded as {tuple(placements)} (not over the experts)")
        ws.append((w.to_local() if hasattr(w, "to_local") else w).detach())
    if ws and not differs:
        e, f, d = ws[0].shape if ws[0].ndim == 3 else (0, 0, 0)
        if ws[0].ndim != 3 or tuple(ws[1].shape) != (e, d, f) or tuple(ws[2].shape) != (e, f, d):
            differs.append(f"w1 / w2 / w3 of shapes {[tuple(w.shape) for w in ws]}")
    if differs:
        raise MoKUnsupportedError(
            f"mok runs torchtitan's GroupedExperts (w1_EFD, w3_EFD [E, F, D], w2_EDF [E, D, F]; "
            f"w2 (silu(w1 x) * (w3 x)); sharded over the experts only); {type(experts).__name__} "
            f"has {', '.join(differs)}: keep torchtitan's routed experts for this model"
        )
    return names, ws
