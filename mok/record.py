"""The error record of kernels that run outside a communication workspace (the fused experts'
backward), one per GPU.

Such a kernel's blocks wait on each other (bounded, like every wait in mok). A wait that
expires writes which wait, which tile and the counter values into host-mapped memory and raises
an abort word the kernel's other blocks read, so the launch ends instead of hanging. The host
reads the record at the next call (no synchronisation) and raises :class:`mok.MoKTimeoutError`;
the record stays set until :func:`clear`, since a kernel that timed out left its outputs
unfinished.
"""

from __future__ import annotations

import torch

from mok import _ext
from mok.errors import MoKTimeoutError

__all__ = ["KernelRecord", "record_for", "clear", "TIMEOUT_MS"]

# The bound of the kernels' waits on each other (one GPU: a wait this long is a bug, not a slow
# peer).
TIMEOUT_MS = 10_000.0
_records: dict[int, KernelRecord] = {}


class KernelRecord:
    """Pinned error record, abort word and the Params the kernels read them from."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.error = torch.zeros(_ext.ERR_FIELDS, dtype=torch.int64).pin_memory()
        self.meta = torch.zeros(_ext.META_WORDS, dtype=torch.int32, device=device)
        self._base, self._timeout_ms = b"", None

    def _build(self) -> bytes:
        p = _ext.Params()
        p.rank, p.num_ranks = 0, 1
        p.timeout_ns = int(TIMEOUT_MS * 1e6)
        p.sched, p.o_meta = self.meta.data_ptr(), 0
        p.error = _ext.load().host_device_pointer(self.error.data_ptr())
        return bytes(p)

    def params(self) -> bytes:
        """The Params of one launch, after raising what an earlier launch recorded."""
        self.raise_if_failed()
        if self._timeout_ms != TIMEOUT_MS:  # built on first use, and again if the bound changed
            self._base, self._timeout_ms = self._build(), TIMEOUT_MS
        return self._base

    def raise_if_failed(self) -> None:
        code, wait, _, observed, expected, _, _, extra = self.error.tolist()
        if code == 0:
            return
        name = _ext.LOCAL_WAITS.get(wait, f"wait {wait}")
        at = f"row tile {extra}" if extra >= 0 else f"expert {-1 - extra}"
        raise MoKTimeoutError(
            f"mok: the fused backward's wait '{name}' ({at}) timed out after "
            f"{self._timeout_ms:g} ms "
            f"on {self.device}: counter {observed}, expected >= {expected}. Its outputs are "
            "incomplete; this is a bug in mok (please report it with the shapes). "
            "mok.record.clear() resets the record.",
            wait=name,
            peer=0,
            observed=observed,
            expected=expected,
        )


def record_for(device: torch.device) -> KernelRecord:
    """The device's record (created on first use)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    rec = _records.get(index)
    if rec is None:
        rec = _records[index] = KernelRecord(torch.device("cuda", index))
    return rec


def clear(device: torch.device | None = None) -> None:
    """Reset the record (of every GPU without ``device``), after waiting for its kernels."""
    for index, rec in list(_records.items()):
        if device is None or device.index in (None, index):
            torch.cuda.synchronize(rec.device)
            rec.error.zero_()
            rec.meta.zero_()
