"""Exceptions raised by mok. Every message says what was found and what is supported."""

from __future__ import annotations

__all__ = [
    "MoKError",
    "MoKConfigError",
    "MoKInputError",
    "MoKUnsupportedError",
    "MoKTimeoutError",
    "MoKCapacityError",
]


class MoKError(RuntimeError):
    """Base class of mok's errors."""


class MoKConfigError(MoKError, ValueError):
    """An invalid :class:`mok.MoKConfig` or config JSON."""


class MoKInputError(MoKError, ValueError):
    """Bad layer inputs (shape, dtype, device, routing)."""


class MoKUnsupportedError(MoKError):
    """The GPU, toolchain or problem is outside what mok supports."""


class MoKTimeoutError(MoKError):
    """A bounded spin-wait expired: a peer did not enter the layer, or is far behind.

    Attributes name the wait, the peer and the counter values the kernel saw."""

    def __init__(self, message: str, *, wait: str, peer: int, observed: int, expected: int):
        super().__init__(message)
        self.wait, self.peer, self.observed, self.expected = wait, peer, observed, expected


class MoKCapacityError(MoKError):
    """A rank would receive more rows than its receive buffer holds. mok never drops tokens."""
