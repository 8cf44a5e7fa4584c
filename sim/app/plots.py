"""Figures of simulation results; each function returns a matplotlib Figure (Agg backend) whose
title says what it compares, whose axes carry units, and whose time axes say "lower is better".
Names, units and colours come from :mod:`sim.app.labels`. The figures of measured runs
(:mod:`sim.app.measured_plots`) and of the push-signalling sensitivity
(:mod:`sim.app.sensitivity`) are re-exported here.

``python -m sim.app.plots WHAT`` draws the figures of committed or freshly measured CSVs; every
one writes under ``build/`` unless ``--out`` names another path (so nothing tracked is
overwritten unless asked): ``train-steps`` (``mok.bench train``, :func:`train_steps`),
``experts-pieces`` (``mok.bench experts``, :func:`expert_pieces`), ``sonicmoe`` (a
``mok.bench train --suite sonicmoe`` CSV against SonicMoE's published figures,
:func:`published_comparison`), ``kernels --csv x-kernels.csv`` (``mok.bench train --kernels``:
where a step's time goes, :func:`kernel_breakdown`), ``train-loss --csv a.csv
--csv b.csv`` (``mok.bench lm`` runs, :func:`write_train_loss`) and ``signalling-sensitivity``
(the push-signalling assumptions, :mod:`sim.app.sensitivity`; docs/sim-validation.md,
"Push signalling")."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402
from matplotlib.patches import Patch, Rectangle  # noqa: E402

from sim.app.labels import (  # noqa: E402
    BREAKDOWN_NAMES,
    LOWER_IS_BETTER,
    axis_label,
    ink_for,
    pct_text,
    policy_color,
    topology_title,
    workload_title,
    wrap_lines,
)
from sim.app.measured_plots import (  # noqa: E402  (re-exported: their home before the split)
    best_train_rows,
    expert_pieces,
    kernel_breakdown,
    layer_validation,
    lm_run_label,
    published_comparison,
    train_loss,
    train_steps,
    validation_scatter,
    write_train_loss,
)
from sim.app.sensitivity import (  # noqa: E402  (re-exported: their home before the split)
    SIGNALLING_ASSUMPTIONS,
    gpu_variant,
    signalling_sensitivity,
    signalling_sensitivity_rows,
    write_signalling_sensitivity,
)
from sim.config import SimConfig  # noqa: E402
from sim.core.topology import RES_PER_GPU  # noqa: E402
from sim.layer.results import LayerResult  # noqa: E402

__all__ = [
    "gantt",
    "link_utilisation",
    "sweep_heatmap",
    "sweep_heatmap_panels",
    "compare_bars",
    "push_pull_verdict",
    "policy_comparison",
    "train_steps",
    "expert_pieces",
    "published_comparison",
    "kernel_breakdown",
    "best_train_rows",
    "lm_run_label",
    "train_loss",
    "write_train_loss",
    "scaling_summary",
    "waves_scatter",
    "validation_scatter",
    "layer_validation",
    "PHASE_COLORS",
    "gpu_variant",
    "SIGNALLING_ASSUMPTIONS",
    "signalling_sensitivity_rows",
    "signalling_sensitivity",
    "write_signalling_sensitivity",
]

PHASE_COLORS = {
    "schedule": "#7f7f7f",
    "shared_expert": "#9467bd",
    "gemm": "#1f77b4",
    "reduce": "#17becf",
    "dispatch": "#ff7f0e",
    "combine": "#2ca02c",
    "signal": "#d62728",
    "credit": "#e377c2",
    "wgrad": "#aec7e8",
    "rev_combine": "#ffbb78",
    "rev_dispatch": "#98df8a",
}
_LANE = {
    "dispatch": 1,
    "combine": 2,
    "signal": 3,
    "credit": 3,
    "rev_combine": 1,
    "rev_dispatch": 2,
}
BREAKDOWN_COLORS = {
    "gemm_us": "#1f77b4",
    "exposed_comm_us": "#ff7f0e",
    "signalling_us": "#d62728",
    "schedule_us": "#7f7f7f",
}
# the configuration fields of sweep rows, which a heatmap cell may take the best over
_CONFIG_FIELDS = {
    "dispatch_mode": "dispatch",
    "combine_mode": "combine",
    "num_comm_sms": "comm SMs",
    "minibatch_size": "minibatch",
    "macrobatch_size": "ring size",
    "ring_slots": "ring size",
    "row_tile": "row tile",
    "mechanism": "copy mechanism",
    "dtype": "dtype",
}


def _policy(row: dict) -> str:
    return f"{row['dispatch_mode']}/{row['combine_mode']}"


def _config_text(cfg: SimConfig) -> str:
    """A layer configuration in words (what ``SimConfig.label`` abbreviates)."""
    return (
        f"{cfg.dispatch_mode} dispatch, {cfg.combine_mode} combine, {cfg.num_comm_sms} comm "
        f"SMs, minibatch {cfg.minibatch_size}, {cfg.ring_slots} ring slots"
    )


def _ranks_text(ranks: Sequence[int], ep: int) -> str:
    """``all 8 ranks`` / ``ranks 0-3 of 8`` / ``ranks 0, 5 of 8``."""
    ranks = list(ranks)
    if ranks == list(range(ep)):
        return f"all {ep} ranks"
    if len(ranks) > 1 and ranks == list(range(ranks[0], ranks[-1] + 1)):
        return f"ranks {ranks[0]}-{ranks[-1]} of {ep}"
    return f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))} of {ep}"


def _common_workload(rows: Sequence[dict], skip: Sequence[str] = ()) -> str:
    """The workload fields every row shares, in words (``deepseek-v3, 512 tokens per rank``);
    empty when the rows are not simulator records."""
    parts = []
    for key, fmt in (
        ("shape", "{}"),
        ("tokens_per_rank", "{} tokens per rank"),
        ("ep", "EP{}"),
        ("topology", "on {}"),
        ("skew", "{} routing"),
    ):
        vals = {r.get(key) for r in rows}
        if key in skip or len(vals) != 1 or None in vals:
            continue
        v = vals.pop()
        parts.append(fmt.format(topology_title(v) if key == "topology" else v))
    text = ", ".join(parts)
    return text.replace(", on ", " on ")


def gantt(result: LayerResult, ranks: Sequence[int] | None = None) -> Figure:
    """Per-rank timeline of one layer: a compute lane and the dispatch, combine and signal lanes
    under it; ``ranks`` (default: the first 8) are named in the title with the total."""
    recs = result.records()
    ep = result.workload.ep
    ranks = list(ranks) if ranks is not None else list(range(min(ep, 8)))
    fig, ax = plt.subplots(figsize=(11, 1.6 + 0.75 * len(ranks)), layout="constrained")
    lane_h = 0.2
    for i, r in enumerate(ranks):
        for rec in recs:
            if rec["rank"] not in (r, -1) or rec["duration_us"] <= 0:
                continue
            lane = _LANE.get(rec["phase"], 0)
            ax.broken_barh(
                [(rec["start_us"], rec["duration_us"])],
                (i - 0.4 + lane * lane_h, lane_h * 0.9),
                color=PHASE_COLORS.get(rec["phase"], "k"),
                linewidth=0,
            )
    ax.set_yticks(range(len(ranks)))
    ax.set_yticklabels([f"rank {r}" for r in ranks])
    ax.invert_yaxis()
    ax.set_ylabel("lanes per rank: compute,\ndispatch, combine, signal", fontsize=8)
    ax.set_xlabel("time since the layer started (us)")
    ax.set_title(
        f"Timeline of one layer forward, {_ranks_text(ranks, ep)}\n"
        f"{workload_title(result.workload.to_dict())}; {_config_text(result.config)}",
        fontsize=9,
    )
    handles = [
        Patch(color=c, label=p.replace("_", " "))
        for p, c in PHASE_COLORS.items()
        if any(rec["phase"] == p for rec in recs)
    ]
    fig.legend(handles=handles, fontsize=7, loc="outside lower center", ncol=len(handles))
    return fig


def link_utilisation(result: LayerResult, ranks: Sequence[int] | None = None) -> Figure:
    """NVLink utilisation per direction (what each rank's port sends and receives, as a fraction
    of its rate) over time; ``ranks`` (default: the first 4) are named in the title with the
    total. Needs a run with ``record_links=True``."""
    run, topo = result.run, result.topology
    ep = result.workload.ep
    ranks = list(ranks) if ranks is not None else list(range(min(ep, 4)))
    fig, axes = plt.subplots(2, 1, figsize=(11, 5.4), sharex=True, layout="constrained")
    fig.suptitle(
        f"NVLink port utilisation over one layer forward, {_ranks_text(ranks, ep)}\n"
        f"{workload_title(result.workload.to_dict())}; {_config_text(result.config)}",
        fontsize=9,
    )
    for ax, name in zip(axes, ("sent (tx)", "received (rx)"), strict=True):
        ax.set_ylabel(f"{name}, fraction\nof the port rate", fontsize=8)
    axes[1].set_xlabel("time since the layer started (us)")
    if run is None or not run.link_series:
        axes[0].text(0.5, 0.5, "no link series recorded (record_links=True)", ha="center")
        return fig
    caps = np.asarray(topo.capacities())
    t = np.array([s[0] for s in run.link_series])
    used = np.stack([s[1] for s in run.link_series])
    for ax, kind in ((axes[0], 1), (axes[1], 2)):
        for r in ranks:
            res = r * RES_PER_GPU + kind
            ax.step(t, used[:, res] / caps[res], where="post", label=f"rank {r}", lw=0.9)
        ax.set_ylim(0, 1.05)
    fig.legend(*axes[0].get_legend_handles_labels(), fontsize=7, loc="outside right upper")
    return fig


def _grid_axes(ax, x: str, y: str, xs: list, ys: list) -> None:
    """Ticks at the cells of a heatmap over ``xs`` x ``ys`` and the axis names with units."""
    ax.set_xticks(range(len(xs)))
    ax.set_xticklabels(xs)
    ax.set_yticks(range(len(ys)))
    ax.set_yticklabels(ys)
    ax.set_xlabel(axis_label(x), fontsize=9)
    ax.set_ylabel(axis_label(y), fontsize=9)


def _best_grid(rows, x: str, y: str, value: str, xs: list, ys: list) -> np.ndarray:
    """[len(ys), len(xs)]: the smallest ``value`` of the rows in each (x, y) cell, NaN if none."""
    grid = np.full((len(ys), len(xs)), np.nan)
    for r in rows:
        i, j = ys.index(r[y]), xs.index(r[x])
        if np.isnan(grid[i, j]) or r[value] < grid[i, j]:
            grid[i, j] = r[value]
    return grid


def _varying(rows: Sequence[dict], x: str, y: str) -> list[str]:
    """The configuration fields (in words) that take several values inside one (x, y) cell."""
    cells: dict[tuple, list[dict]] = {}
    for r in rows:
        cells.setdefault((r[x], r[y]), []).append(r)
    names = []
    for key, name in _CONFIG_FIELDS.items():
        if key in (x, y) or name in names:
            continue
        if any(len({c.get(key) for c in cell}) > 1 for cell in cells.values()):
            names.append(name)
    return names


def _cell_texts(ax, im, grid: np.ndarray, texts=None, fontsize: float = 8) -> None:
    """The value of each cell written on it in black or white, whichever reads better on the
    cell's colour (:func:`sim.app.labels.ink_for`); ``texts[i][j]`` replaces the number."""
    for i in range(grid.shape[0]):
        for j in range(grid.shape[1]):
            if np.isnan(grid[i, j]):
                continue
            text = texts[i][j] if texts is not None else f"{grid[i, j]:.0f}"
            ink = ink_for(im.cmap(im.norm(grid[i, j])))
            ax.text(j, i, text, ha="center", va="center", fontsize=fontsize, color=ink)


def _box(ax, i: int, j: int, color: str) -> None:
    ax.add_patch(Rectangle((j - 0.46, i - 0.46), 0.92, 0.92, fill=False, edgecolor=color, lw=1.8))


def _value_note(value: str) -> str:
    return LOWER_IS_BETTER if value.endswith("_us") else ""


def sweep_heatmap(
    rows: Sequence[dict],
    x: str = "num_comm_sms",
    y: str = "minibatch_size",
    value: str = "layer_us",
    where: dict | None = None,
    title: str | None = None,
) -> Figure:
    """Heatmap of ``value`` over ``x`` x ``y`` (rows filtered by ``where``): each cell is the
    smallest value of its rows, the best over the fields the title names; the best cell is
    outlined in red. Light is fast. ``title``: the first line (default: the workload)."""
    where = where or {}
    sel = [r for r in rows if all(r.get(k) == v for k, v in where.items())]
    xs = sorted({r[x] for r in sel})
    ys = sorted({r[y] for r in sel})
    grid = _best_grid(sel, x, y, value, xs, ys)
    fig, ax = plt.subplots(
        figsize=(3.4 + 0.95 * len(xs), 2.2 + 0.6 * len(ys)), layout="constrained"
    )
    im = ax.imshow(grid, cmap="viridis_r", aspect="auto")
    _grid_axes(ax, x, y, xs, ys)
    _cell_texts(ax, im, grid)
    if not np.isnan(grid).all():
        _box(ax, *np.unravel_index(np.nanargmin(grid), grid.shape), "r")
    fig.colorbar(im, ax=ax, label=axis_label(value, _value_note(value)))
    over = _varying(sel, x, y)
    per_cell = max(1, len(sel) // max(1, int(np.sum(~np.isnan(grid)))))
    note = _value_note(value)
    lines = [
        f"{axis_label(value)} per {AXIS_SHORT.get(x, x)} x {AXIS_SHORT.get(y, y)}"
        + (f", {note}" if note else ""),
        title or _common_workload(sel),
    ]
    if where:
        lines.append(", ".join(f"{axis_label(k)} {v}" for k, v in where.items()))
    cell = f"each cell: the best of {per_cell} configs over {', '.join(over)}; " if over else ""
    lines.append(cell + "red box: the best cell")
    ax.set_title(wrap_lines(lines, fig.get_figwidth() - 1.4, 8), fontsize=8)
    return fig


AXIS_SHORT = {"num_comm_sms": "comm SMs", "minibatch_size": "minibatch"}


def sweep_heatmap_panels(
    rows: Sequence[dict],
    x: str = "num_comm_sms",
    y: str = "minibatch_size",
    value: str = "layer_us",
    row: str = "model",
    col: str = "dispatch_mode",
    measured: Sequence[dict] = (),
    measured_value: str = "measured_us",
    vmax_rel: float | None = None,
    title: str | None = None,
) -> Figure:
    """:func:`sweep_heatmap` panels, one per (``row``, ``col``) value pair, with one colour
    scale per panel row (capped at ``vmax_rel`` x the row's best when given; light is fast).
    Each panel's best cell is outlined in red. The cells of ``measured`` (records with the same
    x, y, row and col fields plus ``measured_value``) are outlined in the text colour and show
    the measured value under the predicted one (``m ...``). ``title``: the first line of the
    heading (default: the workload the rows share)."""
    prows = list(dict.fromkeys(r[row] for r in rows))
    pcols = list(dict.fromkeys(r[col] for r in rows))
    xs = sorted({r[x] for r in rows})
    ys = sorted({r[y] for r in rows})
    meas = {(m[row], m[col], m[x], m[y]): m[measured_value] for m in measured}
    fig, axes = plt.subplots(
        len(prows),
        len(pcols),
        figsize=(
            0.6 + (1.2 + 0.9 * len(xs)) * len(pcols),
            1.0 + (1.0 + 0.7 * len(ys)) * len(prows),
        ),
        squeeze=False,
        layout="constrained",
    )
    for i, pr in enumerate(prows):
        grids = []
        for pc in pcols:
            panel = [r for r in rows if r[row] == pr and r[col] == pc]
            grids.append(_best_grid(panel, x, y, value, xs, ys))
        lo = np.nanmin(grids)
        hi = np.nanmax(grids) if vmax_rel is None else min(np.nanmax(grids), vmax_rel * lo)
        for j, (pc, grid) in enumerate(zip(pcols, grids, strict=True)):
            ax = axes[i][j]
            im = ax.imshow(grid, cmap="viridis_r", aspect="auto", vmin=lo, vmax=hi)
            _grid_axes(ax, x, y, xs, ys)
            texts = [
                [
                    f"{grid[a, b]:.0f}"
                    + (
                        f"\nm {m:.0f}"
                        if (m := meas.get((pr, pc, xs[b], ys[a]))) is not None
                        else ""
                    )
                    for b in range(len(xs))
                ]
                for a in range(len(ys))
            ]
            _cell_texts(ax, im, grid, texts, fontsize=7)
            best = np.unravel_index(np.nanargmin(grid), grid.shape)
            for a, b in np.argwhere(~np.isnan(grid)):
                if (a, b) == best:
                    _box(ax, a, b, "r")
                elif (pr, pc, xs[b], ys[a]) in meas:
                    _box(ax, a, b, ink_for(im.cmap(im.norm(grid[a, b]))))
            ax.set_title(f"{pr}, {axis_label(col)} {pc}", fontsize=8)
        capped = hi < np.nanmax(grids)
        label = axis_label(value) + (f"\n(capped at {vmax_rel:g}x the best)" if capped else "")
        fig.colorbar(im, ax=axes[i].tolist(), label=label, extend="max" if capped else "neither")
    heading = title or _common_workload(rows, skip=(row, col))
    note = "; boxed in the text colour: measured (m, under the prediction)" if meas else ""
    what = (
        f"{axis_label(value)} per {AXIS_SHORT.get(x, x)} x {AXIS_SHORT.get(y, y)}"
        f" ({_value_note(value) or 'colour: value'}; red box: each panel's best{note})"
    )
    fig.suptitle(wrap_lines([heading, what], fig.get_figwidth() - 0.5, 9), fontsize=9)
    return fig


def push_pull_verdict(results: Sequence[LayerResult]) -> str:
    """The fastest policy of ``results`` against the best policy of the other dispatch family
    (push against pull / dedup-pull), in words: ``pull/pull is 0.13 % (3.5 us) faster than
    push/push``; ``... tie at ... us`` within 0.05 us."""
    times = {f"{r.config.dispatch_mode}/{r.config.combine_mode}": r.layer_us for r in results}
    best = min(times, key=times.__getitem__)
    push = best.startswith("push/")
    rivals = {p: t for p, t in times.items() if p.startswith("push/") != push}
    rivals = rivals or {p: t for p, t in times.items() if p != best}
    if not rivals:
        return f"{best}: {times[best]:.1f} us"
    other = min(rivals, key=rivals.__getitem__)
    gap = rivals[other] - times[best]
    if gap < 0.05:
        return f"{best} and {other} tie at {times[best]:.1f} us"
    return f"{best} is {pct_text(100 * gap / rivals[other])} ({gap:.1f} us) faster than {other}"


def compare_bars(groups: dict[str, Sequence[LayerResult]]) -> Figure:
    """Push or pull at a glance, one column per workload (``groups``: a label -> the
    LayerResults of its dispatch/combine policies). Top: each policy's layer time minus the
    fastest policy's, labelled in us and %, with the verdict (:func:`push_pull_verdict`) in the
    panel title. Bottom: where they part, the same difference per term of the critical-path
    breakdown (:mod:`sim.layer.results`: GEMM, exposed communication, exposed signalling,
    schedule), which add up to the bar above."""
    policies = list(
        dict.fromkeys(
            f"{r.config.dispatch_mode}/{r.config.combine_mode}"
            for res in groups.values()
            for r in res
        )
    )
    fig, axes = plt.subplots(
        2,
        len(groups),
        figsize=(6.4 * len(groups), 7.0),
        squeeze=False,
        layout="constrained",
        height_ratios=(1.0, 1.3),
    )
    terms = list(BREAKDOWN_NAMES)
    for j, (label, results) in enumerate(groups.items()):
        top, bot = axes[0][j], axes[1][j]
        by = {f"{r.config.dispatch_mode}/{r.config.combine_mode}": r for r in results}
        names = list(by)
        best = min(names, key=lambda p: by[p].layer_us)
        t0 = by[best].layer_us
        gaps = np.array([by[p].layer_us - t0 for p in names])
        span = float(gaps.max()) or 1.0
        ys = np.arange(len(names))
        top.barh(ys, gaps, 0.6, color=[policy_color(p) for p in names])
        for yi, p, g in zip(ys, names, gaps, strict=True):
            if p == best:
                text = f"fastest: {t0:.1f} us"
            elif g < 0.05:
                text = f"ties the fastest ({by[p].layer_us:.1f} us)"
            else:
                text = f"+{g:.1f} us (+{pct_text(100 * g / t0)})"
            top.text(g + 0.02 * span, yi, text, va="center", fontsize=8)
        top.set_yticks(ys, [p.replace("/", " / ") for p in names])
        top.invert_yaxis()
        top.set_xlim(0, 1.7 * span)
        top.set_ylabel("dispatch / combine")
        top.set_xlabel(f"layer time minus the fastest policy's (us), {LOWER_IS_BETTER}")
        wl = results[0].workload
        where = f"{topology_title(wl.topology)}, EP{wl.ep}" if wl is not None else label
        top.set_title(f"{where}\n{push_pull_verdict(results)}", fontsize=10, fontweight="bold")

        width = 0.8 / len(names)
        for k, p in enumerate(names):
            diff = [by[p].breakdown[t] - by[best].breakdown[t] for t in terms]
            xs = np.arange(len(terms)) + (k - (len(names) - 1) / 2) * width
            bot.bar(xs, diff, width, color=policy_color(p))
        bot.axhline(0, color="k", lw=0.6)
        lim = max(1.0, *(abs(v) for v in bot.get_ylim()))
        bot.set_ylim(-1.1 * lim, 1.1 * lim)
        bot.set_xticks(range(len(terms)), [BREAKDOWN_NAMES[t].replace(" (", "\n(") for t in terms])
        bot.tick_params(axis="x", labelsize=8)
        bot.set_ylabel(f"term minus the fastest policy's (us)\n{LOWER_IS_BETTER}", fontsize=9)
        bot.set_xlabel("critical-path terms of the layer time (they add up to the bar above)")
        bot.set_title(f"where they part (reference: {best}, the fastest)", fontsize=9)
    handles = [Patch(color=policy_color(p), label=p.replace("/", " / ")) for p in policies]
    fig.legend(
        handles=handles,
        loc="outside lower center",
        ncol=len(handles),
        fontsize=8,
        title="dispatch / combine policy",
        title_fontsize=8,
    )
    first = next(iter(groups.values()))[0]
    rows = [r.workload.to_dict() for res in groups.values() for r in res if r.workload]
    fig.suptitle(
        f"Push or pull? One MoE layer forward: {_common_workload(rows) or 'the workloads'}; "
        f"{first.config.num_comm_sms} comm SMs, minibatch {first.config.minibatch_size}, "
        f"{first.config.ring_slots} ring slots",
        fontsize=10,
    )
    return fig


def _case_ticks(ax, cases: Sequence[tuple[str, int]]) -> None:
    """(topology, EP) tick labels, slanted so that long names do not collide."""
    ax.set_xticks(range(len(cases)))
    ax.set_xticklabels(
        [f"{t} EP{ep}" for t, ep in cases], fontsize=7, rotation=30, ha="right",
        rotation_mode="anchor",
    )  # fmt: skip


def policy_comparison(rows: Sequence[dict], reference: str = "pull/push") -> Figure:
    """Per (topology, EP) group of bars, one bar per (dispatch, combine) policy: the layer time
    (log scale), the layer time relative to the ``reference`` policy (in %, 0 = the reference)
    and the NVLink payload per rank, one row of panels per routing skew. ``rows`` are
    :meth:`LayerResult.summary` rows."""
    skews = list(dict.fromkeys(r["skew"] for r in rows))
    cases = list(dict.fromkeys((r["topology"], r["ep"]) for r in rows))
    policies = list(dict.fromkeys(_policy(r) for r in rows))
    ref = {
        (r["topology"], r["ep"], r["skew"]): r["layer_us"] for r in rows if _policy(r) == reference
    }
    fig, axes = plt.subplots(
        len(skews),
        3,
        figsize=(15, 2.7 * len(skews) + 1.6),
        squeeze=False,
        sharex=True,
        layout="constrained",
    )
    width = 0.8 / len(policies)

    def rel(r: dict) -> float:
        return 100 * (r["layer_us"] / ref.get((r["topology"], r["ep"], r["skew"]), np.nan) - 1)

    metrics = (
        (f"layer time (us, log scale)\n{LOWER_IS_BETTER}", lambda r: r["layer_us"]),
        (f"layer time vs {reference} (%)\n{LOWER_IS_BETTER}", rel),
        ("NVLink payload per rank (MB)", lambda r: r["nvlink_payload_mb"] / r["ep"]),
    )
    titles = ("layer time", f"layer time relative to {reference}", "NVLink payload per rank")
    for i, skew in enumerate(skews):
        for j, (label, get) in enumerate(metrics):
            ax = axes[i][j]
            for p, pol in enumerate(policies):
                vals = np.full(len(cases), np.nan)
                for r in rows:
                    if r["skew"] == skew and _policy(r) == pol:
                        vals[cases.index((r["topology"], r["ep"]))] = get(r)
                xs = np.arange(len(cases)) + (p - (len(policies) - 1) / 2) * width
                ax.bar(xs, vals, width, color=policy_color(pol), label=pol)
            ax.set_ylabel(label, fontsize=8)
            ax.set_title(f"skew {skew}: {titles[j]}", fontsize=8)
        axes[i][0].set_yscale("log")
        axes[i][1].axhline(0.0, color="k", lw=0.6)
    for ax in axes[-1]:
        _case_ticks(ax, cases)
        ax.set_xlabel("topology, expert-parallel ranks", fontsize=8)
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(
        handles, labels, loc="outside lower center", ncol=len(labels), fontsize=8,
        title="dispatch / combine policy", title_fontsize=8,
    )  # fmt: skip
    fig.suptitle(
        "Push vs pull vs dedup-pull per (topology, EP), one row per routing skew"
        + (f": {w}" if (w := _common_workload(rows, skip=("ep", "topology", "skew"))) else ""),
        fontsize=10,
    )
    return fig


def scaling_summary(rows: Sequence[dict], where: dict | None = None) -> Figure:
    """One bar per step (in row order) of a scale-out: the critical-path breakdown of the layer
    time, the exposed-communication share and compute idle fraction, and NVLink vs NIC payload
    per rank. ``rows`` are :meth:`LayerResult.summary` rows; ``where`` filters them."""
    where = where or {}
    sel = [r for r in rows if all(r.get(k) == v for k, v in where.items())]
    cases = [(r["topology"], r["ep"]) for r in sel]
    x = np.arange(len(sel))
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.4), layout="constrained")
    bottom = np.zeros(len(sel))
    for key, color in BREAKDOWN_COLORS.items():
        vals = np.array([r[key] for r in sel])
        axes[0].bar(x, vals, bottom=bottom, color=color, label=BREAKDOWN_NAMES[key])
        bottom += vals
    axes[0].set_ylabel(f"layer time (us), {LOWER_IS_BETTER}")
    axes[0].set_title("layer time and its critical-path terms", fontsize=9)
    axes[0].legend(fontsize=7)
    share = np.array([r["exposed_comm_us"] / r["layer_us"] for r in sel])
    idle = np.array([r["compute_idle_frac"] for r in sel])
    axes[1].plot(
        x, 100 * share, "o-", color=BREAKDOWN_COLORS["exposed_comm_us"],
        label="exposed communication",
    )  # fmt: skip
    axes[1].plot(x, 100 * idle, "s--", color="#7f7f7f", label="compute SMs idle")
    axes[1].set_ylabel(f"% of the layer time, {LOWER_IS_BETTER}")
    axes[1].set_title("exposed communication and idle compute", fontsize=9)
    axes[1].set_ylim(0, 100)
    axes[1].legend(fontsize=7)
    nv = np.array([r["nvlink_payload_mb"] / r["ep"] for r in sel])
    nic = np.array([r["nic_payload_mb"] / r["ep"] for r in sel])
    axes[2].bar(x, nv, color="#1f77b4", label="NVLink")
    axes[2].bar(x, nic, bottom=nv, color="#ff7f0e", label="NIC (between NVLink domains)")
    axes[2].set_ylabel("payload per rank (MB)")
    axes[2].set_title("bytes each rank sends, by link", fontsize=9)
    axes[2].legend(fontsize=7)
    for ax in axes:
        _case_ticks(ax, cases)
        ax.set_xlabel("topology, expert-parallel ranks", fontsize=8)
    policy = {_policy(r) for r in sel}
    heading = f"Scaling out {policy.pop() if len(policy) == 1 else 'the layer'}"
    w = _common_workload(sel, skip=("ep", "topology"))
    fig.suptitle(heading + (f": {w}" if w else ""), fontsize=10)
    return fig


def waves_scatter(
    rows: Sequence[dict],
    x: str = "gemm_waves",
    y: str = "layer_us",
    hue: str = "num_comm_sms",
    threshold: float | None = 2.0,
    title: str | None = None,
) -> Figure:
    """Scatter of ``y`` against ``x`` (e.g. GEMM waves per minibatch, a field the caller adds to
    sweep rows), one colour per ``hue`` value, with a vertical line at ``threshold``."""
    fig, ax = plt.subplots(figsize=(7.5, 4.2), layout="constrained")
    for h in sorted({r[hue] for r in rows}):
        sel = [r for r in rows if r[hue] == h]
        ax.scatter([r[x] for r in sel], [r[y] for r in sel], s=18, label=str(h))
    if threshold is not None:
        ax.axvline(threshold, color="k", ls=":", lw=1, label=f"{threshold:g} {axis_label(x)}")
    ax.set_xscale("log", base=2)
    ax.set_xlabel(f"{axis_label(x)} (log2 scale)")
    ax.set_ylabel(axis_label(y, _value_note(y)))
    fig.legend(fontsize=7, title=axis_label(hue), title_fontsize=7, loc="outside right upper")
    heading = title or _common_workload(rows) or "sweep"
    ax.set_title(f"{heading}\n{axis_label(y)} against {axis_label(x)}, one dot per config",
                 fontsize=9)  # fmt: skip
    return fig


def _save(fig: Figure, out: str | Path) -> None:
    """Save ``fig`` to ``out``, creating its folder, and say where."""
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    print(f"wrote {out}")


if __name__ == "__main__":  # pragma: no cover - maintenance entry point
    import argparse

    ap = argparse.ArgumentParser(
        prog="python -m sim.app.plots",
        description="Figures of committed or measured CSVs. Each writes under build/ unless "
        "--out names another path; the committed figures under docs/img are refreshed only by "
        "naming them (e.g. train-steps --out docs/img/train-step-h200.png).",
    )
    sub = ap.add_subparsers(dest="what", required=True)
    sp = sub.add_parser("signalling-sensitivity", help="the push-signalling assumptions' figures")
    sp.add_argument("--out", default="build/img", help="folder (docs/img: the committed ones)")
    sp.add_argument("--params", default=",".join(SIGNALLING_ASSUMPTIONS))
    tp = sub.add_parser("train-steps", help="the training-step figure of a mok.bench train CSV")
    tp.add_argument("--csv", default="mok/bench/results/h200x1-train.csv")
    tp.add_argument(
        "--out", default="build/train-step-h200.png",
        help="PNG (docs/img/train-step-h200.png: the README's figure)",
    )  # fmt: skip
    tp.add_argument("--title", default=None)
    ep = sub.add_parser("experts-pieces", help="the expert GEMM pieces of a mok.bench experts CSV")
    ep.add_argument("--csv", default="mok/bench/results/h200x1-experts.csv")
    ep.add_argument(
        "--out", default="build/experts-pieces-h200.png",
        help="PNG (docs/img/experts-pieces-h200.png: docs/backward.md's figure)",
    )  # fmt: skip
    ep.add_argument("--skew", default="uniform")
    ep.add_argument("--peak", type=float, default=790.0, help="dense bf16 TFLOP/s of the GPU")
    cp = sub.add_parser("sonicmoe", help="a mok.bench train --suite sonicmoe CSV against "
                        "SonicMoE's published H100 figures")  # fmt: skip
    cp.add_argument("--csv", default="mok/bench/results/h100x1-train-sonicmoe-da-2026-12-07.csv")
    cp.add_argument(
        "--out", default="build/sonicmoe-h100.png",
        help="PNG (docs/img/sonicmoe-h100.png: the README's figure)",
    )  # fmt: skip
    cp.add_argument(
        "--impls", default="torch-best,mok-unfused,mok-saved",
        help="the implementations drawn (the default: the README's figure's)",
    )  # fmt: skip
    kp = sub.add_parser("kernels", help="where a step's time goes: a mok.bench train --kernels "
                        "CSV (<csv>-kernels.csv) by kernel category")  # fmt: skip
    kp.add_argument("--csv", required=True, help="the -kernels.csv of mok.bench train --kernels")
    kp.add_argument("--out", default="build/kernels.png")
    kp.add_argument("--title", default=None)
    lp = sub.add_parser("train-loss", help="loss curves of mok.bench lm CSVs (EP R vs EP1)")
    lp.add_argument("--csv", action="append", required=True, help="a mok.bench lm CSV (repeat)")
    lp.add_argument("--out", default="build/lm-loss.png")
    lp.add_argument("--title", default=None)
    a = ap.parse_args()
    if a.what == "train-loss":
        write_train_loss(a.csv, a.out, a.title)
        print(f"wrote {a.out}")
    elif a.what == "train-steps":
        from sim.measured import read_rows

        _save(train_steps(read_rows(a.csv), target=1.5, title=a.title), a.out)
    elif a.what == "sonicmoe":
        from mok.bench.sonicmoe import published
        from sim.measured import read_rows

        keep = set(a.impls.split(","))
        rows = [r for r in read_rows(a.csv) if r["impl"] in keep]
        title = f"{Path(a.csv).name} against SonicMoE's published H100 figures (its Fig. 14)"
        _save(published_comparison(rows, published(), "SonicMoE", title=title), a.out)
    elif a.what == "kernels":
        from sim.measured import read_rows

        _save(kernel_breakdown(read_rows(a.csv), title=a.title), a.out)
    elif a.what == "experts-pieces":
        from sim.measured import read_rows

        _save(expert_pieces(read_rows(a.csv), a.skew, a.peak), a.out)
    else:
        for path in write_signalling_sensitivity(a.out, a.params.split(",")):
            print(f"wrote {path}")
