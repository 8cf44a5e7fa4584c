"""The SM clock a timed region ran at.

Under sustained tensor-core work an H200 reaches its 700 W power limit within ~0.1 s and lowers
its SM clock from 1980 MHz (docs/perf-notes.md, "Sustained work runs power-capped"), so a rate
measured over a short burst and one measured in a training step's steady state differ by ~15 %.
The benchmarks warm up for a time (``--warm-s``) and record the clock their timed calls ran at:
:class:`ClockSampler` reads it from a background thread every ``period_s`` while its ``with``
block runs, through NVML (``torch.cuda.clock_rate``, where ``pynvml`` is installed) or else
``nvidia-smi``; where neither answers, :meth:`ClockSampler.median_mhz` is None.
"""

from __future__ import annotations

import functools
import statistics
import subprocess
import threading

import torch

__all__ = ["ClockSampler"]


def _pci_id(device: int) -> str:
    p = torch.cuda.get_device_properties(device)
    return f"{p.pci_domain_id:08x}:{p.pci_bus_id:02x}:{p.pci_device_id:02x}.0"


@functools.cache
def _reader(device: int):
    """A function returning the SM clock (MHz) of ``device`` now, or None where none answers
    (found once per device: the nvidia-smi probe is a process)."""
    try:
        torch.cuda.clock_rate(device)
        return lambda: float(torch.cuda.clock_rate(device))
    except Exception:  # noqa: BLE001 - no pynvml (or no NVML): try nvidia-smi
        pass
    cmd = ["nvidia-smi", "--query-gpu=clocks.sm", "--format=csv,noheader,nounits"]

    def read() -> float:
        return float(subprocess.run(cmd, capture_output=True, text=True, timeout=10).stdout)

    try:
        cmd += ["-i", _pci_id(device)]
        read()
    except (OSError, ValueError, AttributeError, RuntimeError, subprocess.SubprocessError):
        return None
    return read


class ClockSampler:
    """``with ClockSampler(device):`` samples the SM clock every ``period_s`` seconds in a
    background thread; :meth:`median_mhz` is the median of the samples (None without any)."""

    def __init__(self, device: int, period_s: float = 0.02):
        self.device, self.period_s = device, period_s
        self.samples: list[float] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> ClockSampler:
        self.samples, read = [], _reader(self.device)
        self._stop.clear()
        if read is not None:
            self._thread = threading.Thread(target=self._run, args=(read,), daemon=True)
            self._thread.start()
        return self

    def _run(self, read) -> None:
        while True:
            try:
                self.samples.append(read())
            except (OSError, ValueError, subprocess.SubprocessError):
                return
            if self._stop.wait(self.period_s):
                return

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def median_mhz(self) -> float | None:
        return round(statistics.median(self.samples), 1) if self.samples else None
