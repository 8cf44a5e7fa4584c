"""Names, units and colours that the charts (:mod:`sim.app.plots`) and the printed tables
(:mod:`sim.app.cli`) share, so a reader sees the same words for the same quantity everywhere.

Nothing here imports matplotlib or a simulator model: it is plain data and string helpers.
"""

from __future__ import annotations

import re
import textwrap
from collections.abc import Mapping, Sequence

__all__ = [
    "AXIS_LABELS",
    "BREAKDOWN_NAMES",
    "POLICY_COLORS",
    "LOWER_IS_BETTER",
    "axis_label",
    "ink_for",
    "pct_text",
    "policy_color",
    "topology_title",
    "workload_title",
    "wrap_lines",
    "TABLE_LEGEND",
    "SWEEP_LEGEND",
    "FUSED_TABLE_LEGEND",
]

LOWER_IS_BETTER = "lower is better"

# column names of the simulator's flat records -> axis labels with units
AXIS_LABELS = {
    "num_comm_sms": "communication SMs per GPU",
    "minibatch_size": "minibatch (rows per rank per round)",
    "macrobatch_size": "macrobatch (ring rows)",
    "ring_slots": "ring slots (macrobatch / minibatch)",
    "row_tile": "GEMM row tile (rows)",
    "layer_us": "layer time (us)",
    "gemm_waves": "GEMM waves per minibatch",
    "signal_rank_us": "signalling per rank (us)",
    "exposed_comm_us": "exposed communication (us)",
    "measured_us": "measured time (us)",
    "predicted_us": "predicted time (us)",
    "dispatch_mode": "dispatch",
    "combine_mode": "combine",
    "model": "model",
}

# the four terms of LayerResult.breakdown (sim.layer.results), which add up to the layer time
BREAKDOWN_NAMES = {
    "gemm_us": "GEMM (compute SMs)",
    "exposed_comm_us": "exposed comm (dispatch + combine)",
    "signalling_us": "exposed signalling",
    "schedule_us": "schedule",
}

# one colour per dispatch/combine policy, the same in every chart
POLICY_COLORS = {
    "push/push": "#d62728",
    "pull/push": "#1f77b4",
    "pull/pull": "#2ca02c",
    "dedup_pull/push": "#9467bd",
    "push/pull": "#ff7f0e",
}

_TOPOLOGY_TITLES = {
    "h200x2": "2x H200 (NV18)",
    "hgx-h200": "HGX H200",
    "hgx-h100": "HGX H100",
    "hgx-b200": "HGX B200",
    "gb200-nvl72": "GB200 NVL72",
    "gb300-nvl72": "GB300 NVL72",
}
_MULTI = re.compile(r"^(?P<base>.+)x(?P<n>\d+)$")

# What the columns of the comparison tables mean (sim.app.cli.format_table and the sweep's
# best-per-mode table); printed under the tables and in `mok-sim --help`.
TABLE_LEGEND = (
    "columns: layer us = one layer forward (lower is better); vs first = first row's time / "
    "this row's; gemm, exp.comm (exposed communication: what free transfers would save), "
    "signal (exposed signalling) = parts of the layer time; sig/rank = signalling time a rank "
    "spends over the layer, exposed or not (push: fences, flags, polls); idle% = compute SMs "
    "idle; NVL util% = NVLink port utilisation mean/max; NVL MB/rank = NVLink payload per rank. "
    "Titles: T4096 = 4096 tokens per rank, EP64 = 64 expert-parallel ranks, then the topology "
    "and the routing skew; sms = communication SMs, mb = minibatch rows per rank per round, "
    "ring = ring slots (macrobatch / minibatch)."
)
SWEEP_LEGEND = (
    "columns: sms = communication SMs, mb = minibatch rows per rank per round, ring = ring "
    "slots (macrobatch / minibatch), signal = exposed signalling (us), sig/rank = signalling "
    "time a rank spends, exposed or not (us), NVL util% = NVLink port utilisation mean/max."
)
FUSED_TABLE_LEGEND = (
    "columns: vs best = layer time over the best row's; 1st ready = when minibatch 0 has "
    "arrived (us); gemm = the last worker's busy GEMM time (us); stall = its waits for dispatch "
    "or gate/up tiles (us); sum = the final fixed-order weighted sum (us)."
)


def axis_label(field: str, note: str = "") -> str:
    """The axis label of a record column (its own name where none is known), plus ``note``
    (e.g. :data:`LOWER_IS_BETTER`) in parentheses."""
    text = AXIS_LABELS.get(field, field)
    return f"{text}, {note}" if note else text


def topology_title(name: str) -> str:
    """``gb300-nvl72`` -> ``GB300 NVL72``; ``gb300-nvl72x2`` -> ``2x GB300 NVL72 (over NICs)``."""
    if name in _TOPOLOGY_TITLES:
        return _TOPOLOGY_TITLES[name]
    m = _MULTI.match(name)
    if m and m["base"] in _TOPOLOGY_TITLES:
        return f"{m['n']}x {_TOPOLOGY_TITLES[m['base']]} (over NICs)"
    return name


def workload_title(w: Mapping, with_topology: bool = True) -> str:
    """A workload in words from a record (``shape``, ``tokens_per_rank``, ``ep``, ``topology``,
    ``skew``; a :class:`sim.config.Workload` ``to_dict()`` or a summary row):
    ``deepseek-v3, 4096 tokens per rank, EP64 on GB300 NVL72, zipf:0.2 routing``."""
    parts = [str(w["shape"]), f"{w['tokens_per_rank']} tokens per rank"]
    where = f" on {topology_title(w['topology'])}" if with_topology else ""
    parts.append(f"EP{w['ep']}{where}")
    parts.append(f"{w['skew']} routing")
    return ", ".join(parts)


def policy_color(policy: str) -> str:
    """The colour of a ``dispatch/combine`` policy (grey for one not in :data:`POLICY_COLORS`)."""
    return POLICY_COLORS.get(policy, "#7f7f7f")


def pct_text(x: float) -> str:
    """A percentage with two significant digits below 10 (``0.13 %``), fewer decimals above."""
    a = abs(x)
    return f"{x:.2f} %" if a < 10 else f"{x:.1f} %" if a < 100 else f"{x:.0f} %"


def ink_for(rgba: tuple[float, ...]) -> str:
    """Black or white text, whichever reads better on a cell of colour ``rgba`` (WCAG relative
    luminance of the sRGB colour; black above 0.179, where both contrasts are equal)."""

    def lin(c: float) -> float:
        return c / 12.92 if c <= 0.04045 else ((c + 0.055) / 1.055) ** 2.4

    r, g, b = (lin(float(c)) for c in rgba[:3])
    return "k" if 0.2126 * r + 0.7152 * g + 0.0722 * b > 0.179 else "w"


def wrap_lines(lines: Sequence[str], width_in: float, fontsize: float) -> str:
    """``lines`` joined by newlines, each wrapped to about ``width_in`` inches of text at
    ``fontsize`` points (about 0.55 em a character)."""
    chars = max(20, int(width_in * 72 / (0.55 * fontsize)))
    return "\n".join(textwrap.fill(ln, chars) for ln in lines if ln)
