"""``mok.MoE``: the layer as an ``nn.Module`` that owns this rank's routed experts and the shared
expert as Parameters and takes its routing (``topk_idx`` / ``topk_weights``) from any router.

Weights are held fused: ``gate_up`` ``[L, 2I, H]`` (the I gate rows, then the I up rows, the
``nn.Linear`` layout of each; HF transformers' and torchtitan's fused layout) and ``down``
``[L, H, I]``; :meth:`MoE.from_weights` wraps tensors of that layout without copying them. The
layer sees them as :class:`reference.weights.MoEWeights` views (:meth:`MoE.weights`), so the
gradients of both halves land in ``gate_up``.

The forward is :func:`mok.functional.moe`: mok's kernels on a CUDA device; elsewhere the
reference layer (:func:`reference.moe.moe_forward` in fp32 or fp64, which autograd
differentiates), so a model built on the module runs and tests on any machine. Both trace under
``torch.compile``.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch
from torch import nn

from mok.autograd import moe_on_leaves
from mok.errors import MoKInputError
from mok.path_choice import check_fused_arg
from mok.spec.config import MoKConfig
from reference.weights import MoEWeights

__all__ = ["MoE"]


class MoE(nn.Module):
    """This rank's experts of an MoE layer.

    Args:
        num_experts: the global expert count; this rank holds ``num_experts / ranks`` of them
            (``num_local_experts``; all of them without a process group).
        hidden, intermediate: the model and expert sizes.
        shared_intermediate: the shared expert's intermediate size (0: none).
        num_local_experts: the experts of this rank (default: all; under expert parallelism
            ``num_experts`` / the group's size).
        config: the :class:`mok.MoKConfig` (or dict / JSON path) of the CUDA path.
        group: the expert-parallel process group (None: one rank).
        fused: run the fused forward kernel on Hopper (the backward is the same); ``"auto"``:
            the faster of the fused and the unfused forward, timed at the layer's first call
            and kept (:mod:`mok.path_choice`; opt-in: the two paths' bits differ).
        recompute: the backward computes the routed experts' gate / up again (True) or the
            forward keeps them in fp32 (False: Hopper, fused or not; see
            :func:`mok.functional.moe`).
        main_grad: Parameters with a ``main_grad`` attribute (fp32, their shape; Megatron's
            optimizer sets it) get their gradients added there, not into ``.grad``; on CUDA
            ``gate_up`` and ``down`` from the weight-gradient kernel's fp32 sums (see
            :func:`mok.functional.moe`). Eager only.
        dtype, device: of the Parameters (bf16 for the CUDA path).
    """

    def __init__(
        self,
        num_experts: int,
        hidden: int,
        intermediate: int,
        shared_intermediate: int = 0,
        *,
        num_local_experts: int | None = None,
        config: MoKConfig | dict | str | Path | None = None,
        group=None,
        fused: bool | str = False,
        recompute: bool = True,
        main_grad: bool = False,
        dtype: torch.dtype = torch.bfloat16,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        local = num_experts if num_local_experts is None else num_local_experts
        for name, v in (
            ("num_experts", num_experts),
            ("hidden", hidden),
            ("intermediate", intermediate),
            ("num_local_experts", local),
        ):
            if not isinstance(v, int) or v < 1:
                raise MoKInputError(f"{name} must be a positive int (found {v!r})")
        if num_experts % local:
            raise MoKInputError(
                f"num_local_experts={local} must divide num_experts={num_experts} (experts are "
                "split evenly over the ranks)"
            )
        if not isinstance(shared_intermediate, int) or shared_intermediate < 0:
            raise MoKInputError(
                f"shared_intermediate must be an int >= 0 ({shared_intermediate!r})"
            )
        check_fused_arg(fused)
        kw = {"dtype": dtype, "device": device}
        self.num_experts, self.config, self.group, self.fused = num_experts, config, group, fused
        self.recompute, self.main_grad = recompute, main_grad
        self.gate_up = nn.Parameter(torch.empty(local, 2 * intermediate, hidden, **kw))
        self.down = nn.Parameter(torch.empty(local, hidden, intermediate, **kw))
        if shared_intermediate:
            self.shared_gate_up = nn.Parameter(torch.empty(2 * shared_intermediate, hidden, **kw))
            self.shared_down = nn.Parameter(torch.empty(hidden, shared_intermediate, **kw))
        else:
            self.shared_gate_up = self.shared_down = None
        self.reset_parameters()

    @classmethod
    def from_weights(
        cls,
        num_experts: int,
        gate_up: torch.Tensor,
        down: torch.Tensor,
        shared_gate_up: torch.Tensor | None = None,
        shared_down: torch.Tensor | None = None,
        **kw,
    ) -> MoE:
        """A module on existing weights, not copied: ``gate_up`` ``[L, 2I, H]``, ``down``
        ``[L, H, I]``, optional ``shared_gate_up`` ``[2Is, H]`` / ``shared_down`` ``[H, Is]``
        (the module's Parameters share their storage). ``kw``: config, group, fused, recompute,
        main_grad."""
        if gate_up.ndim != 3 or gate_up.shape[1] % 2 or down.ndim != 3:
            raise MoKInputError(
                f"gate_up must be [L, 2I, H] and down [L, H, I] (found {tuple(gate_up.shape)} and "
                f"{tuple(down.shape)})"
            )
        local, two_i, hidden = gate_up.shape
        if tuple(down.shape) != (local, hidden, two_i // 2):
            raise MoKInputError(
                f"down must be [L={local}, H={hidden}, I={two_i // 2}] for gate_up "
                f"{tuple(gate_up.shape)} (found {tuple(down.shape)})"
            )
        if num_experts % local:
            raise MoKInputError(f"{local} local experts do not divide num_experts={num_experts}")
        if (shared_gate_up is None) != (shared_down is None):
            raise MoKInputError("give both shared-expert weights or neither")
        si = 0 if shared_gate_up is None else shared_gate_up.shape[0] // 2
        m = cls.__new__(cls)
        nn.Module.__init__(m)
        m.num_experts = num_experts
        m.config, m.group, m.fused = kw.get("config"), kw.get("group"), kw.get("fused", False)
        check_fused_arg(m.fused)
        m.recompute, m.main_grad = kw.get("recompute", True), kw.get("main_grad", False)
        m.gate_up = gate_up if isinstance(gate_up, nn.Parameter) else nn.Parameter(gate_up)
        m.down = down if isinstance(down, nn.Parameter) else nn.Parameter(down)
        if si:
            if tuple(shared_gate_up.shape) != (2 * si, hidden) or tuple(shared_down.shape) != (
                hidden,
                si,
            ):
                raise MoKInputError(
                    f"shared_gate_up must be [2Is, H={hidden}] and shared_down [H, Is] (found "
                    f"{tuple(shared_gate_up.shape)} and {tuple(shared_down.shape)})"
                )
            m.shared_gate_up = nn.Parameter(shared_gate_up)
            m.shared_down = nn.Parameter(shared_down)
        else:
            m.shared_gate_up = m.shared_down = None
        return m

    def reset_parameters(self) -> None:
        """``nn.Linear``'s default init of each expert matrix (uniform, bound 1 / sqrt(fan_in))."""
        with torch.no_grad():
            for p in (self.gate_up, self.down, self.shared_gate_up, self.shared_down):
                if p is not None:
                    bound = 1.0 / math.sqrt(p.shape[-1])
                    p.uniform_(-bound, bound)

    @property
    def intermediate(self) -> int:
        return self.gate_up.shape[1] // 2

    def weights(self) -> MoEWeights:
        """The layer's weights as views of the Parameters (no copy)."""
        i = self.intermediate
        shared = {}
        if self.shared_gate_up is not None:
            si = self.shared_gate_up.shape[0] // 2
            shared = {
                "shared_w_gate": self.shared_gate_up[:si],
                "shared_w_up": self.shared_gate_up[si:],
                "shared_w_down": self.shared_down,
            }
        return MoEWeights(self.gate_up[:, :i], self.gate_up[:, i:], self.down, **shared)

    def forward(
        self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor
    ) -> torch.Tensor:
        """[num_tokens, hidden] -> [num_tokens, hidden] (x's dtype): shared(x) + the k routed
        experts' outputs weighted by topk_weights; topk_idx holds global expert ids."""
        # (None, None, None for the shared expert where there is none)
        leaves = [self.gate_up, None, self.down, self.shared_gate_up, None, self.shared_down]
        return moe_on_leaves(
            x, topk_idx, topk_weights, self.weights(), leaves, self.num_experts, self.config,
            self.group, self.fused, self.recompute, self.main_grad,
        )  # fmt: skip

    def extra_repr(self) -> str:
        local, two_i, hidden = self.gate_up.shape
        si = 0 if self.shared_gate_up is None else self.shared_gate_up.shape[0] // 2
        return (
            f"num_experts={self.num_experts}, local={local}, hidden={hidden}, "
            f"intermediate={two_i // 2}, shared_intermediate={si}, fused={self.fused}, "
            f"recompute={self.recompute}" + (", main_grad=True" if self.main_grad else "")
        )
