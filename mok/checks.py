"""Host-side argument checks shared by the API modules: they raise :class:`mok.MoKInputError`
saying what was found and what is expected."""

from __future__ import annotations

import torch

from mok.errors import MoKInputError

__all__ = ["check_tensor"]


def check_tensor(name: str, t: torch.Tensor, shape: tuple, dtypes: tuple, device) -> None:
    """Raise unless ``t`` is a tensor of ``shape``, one of ``dtypes``, on ``device``."""
    if not isinstance(t, torch.Tensor):
        raise MoKInputError(f"{name} must be a torch.Tensor (found {type(t).__name__})")
    if tuple(t.shape) != shape:
        raise MoKInputError(f"{name} must have shape {shape} (found {tuple(t.shape)})")
    if t.dtype not in dtypes:
        names = ", ".join(str(d).replace("torch.", "") for d in dtypes)
        raise MoKInputError(f"{name} must be {names} (found {str(t.dtype).replace('torch.', '')})")
    if t.device != device:
        raise MoKInputError(f"{name} is on {t.device}; the workspace lives on {device}")
