"""The SM budget of mok's kernels: how many SMs (persistent blocks) a layer call may use.

``MoKConfig.num_sms`` (0: every SM of the GPU) caps the grid of every kernel a layer call
launches: the communication kernels, the schedule build, the fused layer (its communication and
GEMM blocks together) and the experts' GEMM kernels of the forward and the backward. The SMs left
over are free for work the caller overlaps on other streams (as DeepEP's ``num_sms`` leaves SMs to
compute), and ranks that share one GPU under MPS can each run on SMs of their own.

The layer entry points set the budget for the duration of a call (:func:`sm_budget`); the
launchers read it (:func:`budget_sms`).
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator

import torch

__all__ = ["budget_sms", "device_sms", "sm_budget"]

_BUDGET: contextvars.ContextVar[int] = contextvars.ContextVar("mok_sm_budget", default=0)


def device_sms(device: torch.device | int | None = None) -> int:
    """The GPU's SM count."""
    return torch.cuda.get_device_properties(device).multi_processor_count


def budget_sms(device: torch.device | int | None = None, budget: int | None = None) -> int:
    """The SMs a kernel launched now may use: ``budget`` (or the call's :func:`sm_budget` when
    None), at most the GPU's count; 0 means every SM."""
    sms = device_sms(device)
    cap = _BUDGET.get() if budget is None else budget
    return min(sms, cap) if cap else sms


@contextlib.contextmanager
def sm_budget(num_sms: int) -> Iterator[None]:
    """Launch mok's kernels on at most ``num_sms`` SMs inside the block (0: every SM)."""
    token = _BUDGET.set(int(num_sms))
    try:
        yield
    finally:
        _BUDGET.reset(token)
