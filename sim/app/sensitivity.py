"""Sensitivity of the layer time to the push-signalling assumptions of the GPU profiles
(docs/sim-validation.md, "Push signalling"): the rows of one assumption's sweep, their figure,
and the writer of the committed figures (``python -m sim.app.plots signalling-sensitivity
--out docs/img`` regenerates them; the default ``--out`` is ``build/img``)."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402

from sim.app.labels import LOWER_IS_BETTER, policy_color  # noqa: E402
from sim.config import SimConfig, Workload  # noqa: E402
from sim.core import hardware  # noqa: E402
from sim.core.hardware import GpuProfile, load_gpu  # noqa: E402
from sim.core.topology import get_topology  # noqa: E402
from sim.layer.model import simulate  # noqa: E402

__all__ = [
    "gpu_variant",
    "SIGNALLING_ASSUMPTIONS",
    "signalling_sensitivity_rows",
    "signalling_sensitivity",
    "write_signalling_sensitivity",
]


@contextlib.contextmanager
def gpu_variant(gpu_name: str, change: Callable[[GpuProfile], GpuProfile]) -> Iterator[GpuProfile]:
    """Within the block, :func:`sim.core.hardware.load_gpu` (so every topology on this GPU)
    returns ``change(profile)`` for the preset ``gpu_name``; restored on exit."""
    base = load_gpu(gpu_name)
    new = change(base)
    hardware._CACHE[gpu_name] = new
    try:
        yield new
    finally:
        hardware._CACHE[gpu_name] = base


def _sig(**kw) -> Callable[[GpuProfile], GpuProfile]:
    return lambda g: dataclasses.replace(g, signalling=dataclasses.replace(g.signalling, **kw))


def _inc(**kw) -> Callable[[GpuProfile], GpuProfile]:
    return lambda g: dataclasses.replace(g, incast=dataclasses.replace(g.incast, **kw))


# name -> (axis label, values swept, profile change for one value, the measurement that pins it)
SIGNALLING_ASSUMPTIONS: dict[str, tuple[str, tuple[float, ...], Callable, str]] = {
    "incast_e_min": (
        "incast efficiency_min (many writers into one NVSwitch port)",
        (0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0),
        lambda v: _inc(efficiency_min=float(v)),
        "N GPUs writing into one port against one reader of N sources (8-GPU HGX)",
    ),
    "incast_n_half": (
        "incast writers_half (efficiency half-way at 1 + n_half writers)",
        (1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0),
        lambda v: _inc(writers_half=float(v)),
        "the same N-writer probe at N = 1..7 (8-GPU HGX)",
    ),
    "fence_inflight_kib": (
        "fence in-flight window per comm SM (KiB), drained at the NVLink rate",
        (0.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0),
        lambda v: _sig(fence_inflight_bytes_per_sm=1024.0 * float(v)),
        "fence_cost into a peer GPU (two GPUs in one process)",
    ),
    "jitter_us": (
        "cross-GPU completion jitter mean (us, exponential per sender)",
        (0.0, 0.045, 0.086, 0.2, 0.5, 1.0, 2.0),
        lambda v: _sig(completion_jitter_us=float(v)),
        "signal_jitter across two GPUs; the last of N flags at one receiver (8-GPU HGX)",
    ),
}

_SENS_MODES = (("push", "push"), ("pull", "push"), ("pull", "pull"))


def signalling_sensitivity_rows(
    param: str,
    values: Sequence[float] | None = None,
    shape: str = "kimi-k2",
    topology: str = "gb300-nvl72",
    ep: int = 64,
    skews: Sequence[str] = ("hot:0.3", "uniform"),
    tokens: int = 4096,
    cfg: SimConfig | None = None,
    modes: Sequence[tuple[str, str]] = _SENS_MODES,
) -> list[dict]:
    """One row per (value of ``param``, skew, dispatch/combine mode): the layer time, the
    signalling a rank spends (mean over ranks), with the GPU profile
    of ``topology`` changed by :data:`SIGNALLING_ASSUMPTIONS` ``[param]`` (``values``: its
    default sweep)."""
    _, default, change, _ = SIGNALLING_ASSUMPTIONS[param]
    gpu_name = get_topology(topology).gpu_name
    base = cfg or SimConfig()
    rows = []
    for v in values if values is not None else default:
        with gpu_variant(gpu_name, change(v)):
            for skew in skews:
                wl = Workload(shape, tokens, ep, topology, skew)
                for disp, comb in modes:
                    r = simulate(wl, base.replace(dispatch_mode=disp, combine_mode=comb))
                    rows.append(
                        {
                            "param": param,
                            "value": float(v),
                            "skew": skew,
                            "mode": f"{disp}/{comb}",
                            "layer_us": r.layer_us,
                            "signal_rank_us": r.signalling_per_rank()[0],
                        }
                    )
    return rows


def signalling_sensitivity(rows: Sequence[dict], title: str = "") -> Figure:
    """Per skew (columns): the layer time of each mode against the parameter (top) and the
    push-vs-pull differences push/push - pull/push and push/push - pull/pull (bottom; above 0:
    push is slower). ``title``: the workload, under the figure's heading."""
    param = rows[0]["param"]
    label = SIGNALLING_ASSUMPTIONS.get(param, (param,))[0]
    skews = list(dict.fromkeys(r["skew"] for r in rows))
    modes = list(dict.fromkeys(r["mode"] for r in rows))
    fig, axes = plt.subplots(
        2, len(skews), figsize=(5.2 * len(skews), 6.8), squeeze=False, layout="constrained"
    )
    for j, skew in enumerate(skews):
        by = {
            m: sorted(
                (r["value"], r["layer_us"]) for r in rows if r["skew"] == skew and r["mode"] == m
            )
            for m in modes
        }
        top, bot = axes[0][j], axes[1][j]
        for m, pts in by.items():
            x, y = zip(*pts, strict=True)
            top.plot(x, y, "o-", ms=3, color=policy_color(m), label=m)
        top.set_title(f"skew {skew}: layer time per dispatch/combine", fontsize=9)
        top.set_ylabel(f"layer time (us), {LOWER_IS_BETTER}", fontsize=8)
        top.legend(fontsize=7, title="dispatch/combine", title_fontsize=7)
        ref = dict(by.get("push/push", []))
        for m in modes:
            if m == "push/push" or not ref:
                continue
            other = dict(by[m])
            x = sorted(set(ref) & set(other))
            bot.plot(
                x, [ref[v] - other[v] for v in x], "s-", ms=3, color=policy_color(m),
                label=f"push/push - {m}",
            )  # fmt: skip
        bot.axhline(0, color="k", lw=0.6)
        bot.set_title(f"skew {skew}: push's cost (above 0: push is slower)", fontsize=9)
        bot.set_ylabel("layer time difference (us)", fontsize=8)
        bot.set_xlabel(label, fontsize=8)
        if bot.lines[1:]:
            bot.legend(fontsize=7)
    heading = f"Layer time against {label.split(' (')[0]}: push vs pull"
    fig.suptitle(heading + (f"\n{title}" if title else ""), fontsize=9)
    return fig


def write_signalling_sensitivity(
    out_dir: str | Path = "build/img",
    params: Sequence[str] | None = None,
    values: dict[str, Sequence[float]] | None = None,
    **kw,
) -> list[Path]:
    """Write ``signalling-sensitivity-<param>.png`` for each of ``params`` (default: every
    :data:`SIGNALLING_ASSUMPTIONS`) into ``out_dir``; ``values``: sweeps other than the default
    per param; ``kw``: :func:`signalling_sensitivity_rows` arguments (workload, config)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for p in params or list(SIGNALLING_ASSUMPTIONS):
        rows = signalling_sensitivity_rows(p, (values or {}).get(p), **kw)
        wl = (
            f"{kw.get('shape', 'kimi-k2')} EP{kw.get('ep', 64)} {kw.get('topology', 'gb300-nvl72')}"
            f", {kw.get('tokens', 4096)} tokens per rank; pins it: {SIGNALLING_ASSUMPTIONS[p][3]}"
        )
        fig = signalling_sensitivity(rows, wl)
        path = out / f"signalling-sensitivity-{p.replace('_', '-')}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)
    return written
