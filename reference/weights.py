"""Parameters of one MoE layer: routed experts (sharded under expert parallelism) and the
shared expert (replicated)."""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

import torch

from mok.spec.workload import ModelShape

__all__ = ["MoEWeights"]


@dataclass
class MoEWeights:
    """Weights in ``nn.Linear`` layout (out_features, in_features), so every GEMM reduces over
    the last axis of both operands (K-major, what the tensor-core kernels want).

    w_gate, w_up:  [num_experts, intermediate, hidden]
    w_down:        [num_experts, hidden, intermediate]
    shared_w_gate, shared_w_up: [shared_intermediate, hidden]   (None: no shared expert)
    shared_w_down: [hidden, shared_intermediate]
    ``num_experts`` is the local count after :meth:`shard`.
    """

    w_gate: torch.Tensor
    w_up: torch.Tensor
    w_down: torch.Tensor
    shared_w_gate: torch.Tensor | None = None
    shared_w_up: torch.Tensor | None = None
    shared_w_down: torch.Tensor | None = None

    def __post_init__(self) -> None:
        e, i, h = self.w_gate.shape
        want = {"w_gate": (e, i, h), "w_up": (e, i, h), "w_down": (e, h, i)}
        for name, shape in want.items():
            got = tuple(getattr(self, name).shape)
            if got != shape:
                raise ValueError(f"{name} has shape {got}, expected {shape} from w_gate")
        shared = [self.shared_w_gate, self.shared_w_up, self.shared_w_down]
        if any(s is None for s in shared) != all(s is None for s in shared):
            raise ValueError("give all three shared-expert weights or none")
        if self.shared_w_gate is not None:
            si = self.shared_w_gate.shape[0]
            want_s = {"shared_w_gate": (si, h), "shared_w_up": (si, h), "shared_w_down": (h, si)}
            for name, shape in want_s.items():
                got = tuple(getattr(self, name).shape)
                if got != shape:
                    raise ValueError(f"{name} has shape {got}, expected {shape}")

    @property
    def num_experts(self) -> int:
        return self.w_gate.shape[0]

    @property
    def hidden(self) -> int:
        return self.w_gate.shape[2]

    @property
    def intermediate(self) -> int:
        return self.w_gate.shape[1]

    @property
    def has_shared(self) -> bool:
        return self.shared_w_gate is not None

    @classmethod
    def random(
        cls,
        shape: ModelShape,
        seed: int = 0,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
    ) -> MoEWeights:
        """Weights with variance ~1/fan_in so activations stay O(1) through the layer.

        Drawn on ``device`` from a generator of that device type: the same values for a given
        seed on every device of the type (CPU draws differ from CUDA draws)."""
        g = torch.Generator(device=device).manual_seed(seed)
        e, h, i, si = shape.num_experts, shape.hidden, shape.intermediate, shape.shared_intermediate

        def rnd(*size: int) -> torch.Tensor:
            fan_in = size[-1]
            t = torch.randn(*size, generator=g, dtype=torch.float64, device=device) / fan_in**0.5
            return t.to(dtype=dtype)

        return cls(
            w_gate=rnd(e, i, h),
            w_up=rnd(e, i, h),
            w_down=rnd(e, h, i),
            shared_w_gate=rnd(si, h) if si else None,
            shared_w_up=rnd(si, h) if si else None,
            shared_w_down=rnd(h, si) if si else None,
        )

    def shard(self, rank: int, num_ranks: int) -> MoEWeights:
        """The weights rank ``rank`` holds under expert parallelism over ``num_ranks`` ranks."""
        if self.num_experts % num_ranks:
            raise ValueError(
                f"num_experts={self.num_experts} is not divisible by num_ranks={num_ranks}"
            )
        n = self.num_experts // num_ranks
        s = slice(rank * n, (rank + 1) * n)
        return replace(self, w_gate=self.w_gate[s], w_up=self.w_up[s], w_down=self.w_down[s])

    def to(self, dtype: torch.dtype) -> MoEWeights:
        out = {}
        for f in fields(self):
            t = getattr(self, f.name)
            out[f.name] = None if t is None else t.to(dtype)
        return MoEWeights(**out)
