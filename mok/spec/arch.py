"""Which of mok's code paths run on which GPU, decided once, by compute capability.

mok's extension is built for one target per GPU (an arch-specific cubin loads on that compute
capability only: sm_100a does not load on a 10.3 GB300). On every target it holds the
communication kernels (schedule, dispatch, combine), so the unfused layer runs there: mok's
dispatch and combine around torch's grouped GEMMs. The fused forward and mok's expert kernels
(the backward's dh / fused / weight-gradient kernels and the forward that keeps g / u) have
Hopper (sm_90a) bodies only: elsewhere :func:`mok.functional.moe_forward` with ``fused=True``
and ``recompute=False`` raise, and the backward runs torch's GEMMs. Blackwell targets are
compile-checked (``make cuda-check``), never run here.

``mok._ext`` builds for :func:`arch_paths`'s ``build``, the fused layer and the expert kernels
check ``fused_forward`` / ``expert_kernels``, and their errors use :func:`refusal`.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

__all__ = ["ArchPaths", "arch_paths", "BUILD_TARGETS", "refusal", "supported_text"]

# Compute capability -> the extension's nvcc target (make cuda-check compiles each). Not built:
# 12.x (consumer Blackwell: about 100 KiB of shared memory per block, which the copy rings are
# not sized for, and no NVLink domain) and anything before Hopper (no bulk-copy engine).
BUILD_TARGETS = {(9, 0): "90a", (10, 0): "100a", (10, 3): "103a"}
HOPPER = (9, 0)


@dataclass(frozen=True)
class ArchPaths:
    """What runs on a GPU of ``capability``."""

    capability: tuple[int, int]
    build: str | None  # the extension's target; None: mok's kernels do not run here
    comm_kernels: bool  # schedule, dispatch, combine: the unfused layer
    fused_forward: bool  # the fused layer megakernel
    expert_kernels: bool  # the experts' backward kernels and the g / u-keeping forward

    @property
    def name(self) -> str:
        return f"sm_{self.capability[0]}{self.capability[1]}"

    def runs(self) -> str:
        """What of mok runs on this GPU, as one phrase."""
        if self.build is None:
            return "no mok kernels (the reference layer runs on the CPU)"
        runs = ["mok's dispatch / combine with torch's grouped GEMMs (fused=False)"]
        if self.fused_forward:
            runs.append("the fused layer")
        if self.expert_kernels:
            runs.append("mok's expert kernels (the unfused forward's gate / up, the backward)")
        return ", ".join(runs)

    def describe(self) -> str:
        """One line: the GPU, its build target and what runs."""
        built = "" if self.build is None else f" (built as sm_{self.build})"
        return f"{self.name}{built}: {self.runs()}"


@functools.lru_cache(maxsize=16)
def arch_paths(capability: tuple[int, int]) -> ArchPaths:
    """The paths mok takes on a GPU of ``capability`` (major, minor)."""
    cap = (int(capability[0]), int(capability[1]))
    build = BUILD_TARGETS.get(cap)
    hopper = cap == HOPPER
    return ArchPaths(cap, build, build is not None, hopper, hopper)


def refusal(paths: ArchPaths, what: str, instead: str) -> str:
    """The message of an error raised because ``what`` has no path on ``paths``' GPU."""
    return (
        f"{what} has a Hopper (sm_90a) path only; this GPU is {paths.name}, where mok runs "
        f"{paths.runs()}. {instead}"
    )


def supported_text() -> str:
    """The compute capabilities mok builds for, as one phrase."""
    return ", ".join(f"{a}.{b} (sm_{t})" for (a, b), t in BUILD_TARGETS.items())
