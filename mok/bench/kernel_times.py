"""Where a step's time goes: each kernel's device time per step, from a few steps under
``torch.profiler`` (``python -m mok.bench train --kernels``).

- :func:`kernel_times`: the kernels (and copies) of ``steps`` calls of a step, each with its calls
  and self device time per step, largest first. Without CUDA the profiler's CPU ops stand in (the
  CPU tests).
- :func:`short_name`: a kernel's name without its return type, arguments and mangling noise.
- :func:`summary_lines`: the printed table of the largest, with each one's share of the step.
- :class:`KernelRecorder`: the rows of the ``-kernels`` CSV beside a train CSV.

The profiler adds a little time per launch, so these shares are for finding where the time goes;
the step's time is the train row's (CUDA events, without the profiler).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from mok.bench.common import Recorder

# steps profiled per row (after the row's own timed steps, so nothing is cold)
PROFILED_STEPS = 3


@dataclass(frozen=True)
class KernelTime:
    """One kernel's calls and self device time per step (us)."""

    name: str
    calls: float
    us: float


def kernel_times(step: Callable[[], object], steps: int = PROFILED_STEPS) -> list[KernelTime]:
    """Each kernel of ``steps`` calls of ``step`` (already warm), per step, largest first."""
    from torch.profiler import ProfilerActivity, profile

    cuda = torch.cuda.is_available()
    activity = ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU
    if cuda:
        torch.cuda.synchronize()
    with profile(activities=[activity]) as prof:
        for _ in range(steps):
            step()
        if cuda:
            torch.cuda.synchronize()
    out = []
    for ev in prof.key_averages():
        us = ev.self_device_time_total if cuda else ev.self_cpu_time_total
        if us > 0:
            out.append(KernelTime(ev.key, ev.count / steps, us / steps))
    return sorted(out, key=lambda k: -k.us)


_TEMPLATE = re.compile(r"<[^<>]*>")


def short_name(name: str) -> str:
    """``void mok::bwd_fused_kernel<0>(mok::FusedBwdKernelArgs)`` -> ``mok::bwd_fused_kernel<0>``;
    a template-heavy or mangled name shortened to its recognisable head (at most 60 characters)."""
    text = name.strip()
    if text.startswith("void "):
        text = text[len("void ") :]
    depth = 0
    for i, ch in enumerate(text):  # cut the argument list (the first "(" outside <...>)
        depth += ch == "<"
        depth -= ch == ">"
        if ch == "(" and depth == 0 and i > 0:
            text = text[:i].rstrip()
            break
    if len(text) > 60:  # nested template arguments: keep the outermost level as <...>
        inner = text
        while _TEMPLATE.search(inner):
            inner = _TEMPLATE.sub("", inner)
        text = inner if len(inner) <= 60 else inner[:57] + "..."
    return text


def summary_lines(times: list[KernelTime], top: int = 8) -> list[str]:
    """The ``top`` largest kernels: us per step, calls per step, share of the profiled total."""
    total = sum(k.us for k in times) or 1.0
    lines = [f"    {'us/step':>9} {'calls':>5} {'share':>6}  kernel"]
    for k in times[:top]:
        lines.append(f"    {k.us:>9.1f} {k.calls:>5.1f} {k.us / total:>6.1%}  {short_name(k.name)}")
    rest = times[top:]
    if rest:
        us = sum(k.us for k in rest)
        lines.append(f"    {us:>9.1f} {'':>5} {us / total:>6.1%}  ({len(rest)} others)")
    return lines


def kernels_csv(train_csv: str) -> str:
    """The kernels CSV beside ``train_csv``: ``<stem>-kernels.csv``."""
    p = Path(train_csv)
    return str(p.with_name(f"{p.stem}-kernels{p.suffix or '.csv'}"))


class KernelRecorder(Recorder):
    """The ``-kernels`` CSV: per (case, implementation) row of the train CSV, one row per kernel
    (``kernel`` its full name, ``short`` :func:`short_name`, ``calls_per_step``,
    ``us_per_step``, ``share`` of the profiled total), then the run's provenance. Prints
    :func:`summary_lines` per implementation instead of a line per kernel."""

    def add_step(self, case: dict, times: list[KernelTime]) -> None:
        total = sum(k.us for k in times) or 1.0
        for k in times:
            self.rows.append(
                {
                    **case,
                    "kernel": k.name,
                    "short": short_name(k.name),
                    "calls_per_step": round(k.calls, 2),
                    "us_per_step": round(k.us, 1),
                    "share": round(k.us / total, 4),
                    "profiled_steps": PROFILED_STEPS,
                    **self.meta,
                }
            )
