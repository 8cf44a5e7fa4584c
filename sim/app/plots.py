"""Figures of simulation results; each function returns a matplotlib Figure (Agg backend).

``python -m sim.app.plots signalling-sensitivity [--out docs/img]`` writes the sensitivity
figures of the push-signalling assumptions (:func:`write_signalling_sensitivity`;
docs/sim-validation.md, "Push signalling"); ``python -m sim.app.plots train-loss --csv a.csv
--csv b.csv [--out build/lm-loss.png]`` the loss curves of ``mok.bench lm`` runs
(:func:`write_train_loss`)."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402

from sim.config import SimConfig, Workload  # noqa: E402
from sim.core import hardware  # noqa: E402
from sim.core.hardware import GpuProfile, load_gpu  # noqa: E402
from sim.core.topology import RES_PER_GPU, get_topology  # noqa: E402
from sim.layer.model import simulate  # noqa: E402
from sim.layer.results import LayerResult  # noqa: E402

__all__ = [
    "gantt",
    "link_utilisation",
    "sweep_heatmap",
    "sweep_heatmap_panels",
    "compare_bars",
    "policy_comparison",
    "train_steps",
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


def gantt(result: LayerResult, ranks: Sequence[int] | None = None) -> Figure:
    """Per-rank Gantt chart: compute, dispatch, combine and signal lanes."""
    recs = result.records()
    ranks = list(ranks) if ranks is not None else list(range(min(result.workload.ep, 8)))
    fig, ax = plt.subplots(figsize=(11, 0.9 + 0.75 * len(ranks)))
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
    ax.set_xlabel("time (us)")
    ax.set_title(f"{result.workload.label()} | {result.config.label()}", fontsize=9)
    handles = [
        matplotlib.patches.Patch(color=c, label=p)
        for p, c in PHASE_COLORS.items()
        if any(rec["phase"] == p for rec in recs)
    ]
    ax.legend(handles=handles, fontsize=7, loc="upper right", ncol=4)
    fig.tight_layout()
    return fig


def link_utilisation(result: LayerResult, ranks: Sequence[int] | None = None) -> Figure:
    """NVLink utilisation per direction (tx and rx of each rank's port) over time; needs a run
    with ``record_links=True``."""
    run, topo = result.run, result.topology
    fig, axes = plt.subplots(2, 1, figsize=(11, 5), sharex=True)
    if run is None or not run.link_series:
        axes[0].text(0.5, 0.5, "no link series recorded (record_links=True)", ha="center")
        return fig
    caps = np.asarray(topo.capacities())
    t = np.array([s[0] for s in run.link_series])
    used = np.stack([s[1] for s in run.link_series])
    ranks = list(ranks) if ranks is not None else list(range(min(result.workload.ep, 4)))
    for ax, kind, name in ((axes[0], 1, "tx"), (axes[1], 2, "rx")):
        for r in ranks:
            res = r * RES_PER_GPU + kind
            ax.step(t, used[:, res] / caps[res], where="post", label=f"rank {r}", lw=0.9)
        ax.set_ylabel(f"NVLink {name} utilisation")
        ax.set_ylim(0, 1.05)
        ax.legend(fontsize=7, loc="upper right", ncol=4)
    axes[1].set_xlabel("time (us)")
    axes[0].set_title(f"{result.workload.label()} | {result.config.label()}", fontsize=9)
    fig.tight_layout()
    return fig


def _grid_axes(ax, x: str, y: str, xs: list, ys: list) -> None:
    """Ticks at the cells of a heatmap over ``xs`` x ``ys`` and the axis names."""
    ax.set_xticks(range(len(xs)))
    ax.set_xticklabels(xs)
    ax.set_yticks(range(len(ys)))
    ax.set_yticklabels(ys)
    ax.set_xlabel(x)
    ax.set_ylabel(y)


def _best_grid(rows, x: str, y: str, value: str, xs: list, ys: list) -> np.ndarray:
    """[len(ys), len(xs)]: the smallest ``value`` of the rows in each (x, y) cell, NaN if none."""
    grid = np.full((len(ys), len(xs)), np.nan)
    for r in rows:
        i, j = ys.index(r[y]), xs.index(r[x])
        if np.isnan(grid[i, j]) or r[value] < grid[i, j]:
            grid[i, j] = r[value]
    return grid


def sweep_heatmap(
    rows: Sequence[dict],
    x: str = "num_comm_sms",
    y: str = "minibatch_size",
    value: str = "layer_us",
    where: dict | None = None,
) -> Figure:
    """Heatmap of the best ``value`` over the other swept fields, for each (x, y) cell."""
    where = where or {}
    sel = [r for r in rows if all(r.get(k) == v for k, v in where.items())]
    xs = sorted({r[x] for r in sel})
    ys = sorted({r[y] for r in sel})
    grid = _best_grid(sel, x, y, value, xs, ys)
    fig, ax = plt.subplots(figsize=(1.2 + 0.9 * len(xs), 1.2 + 0.6 * len(ys)))
    im = ax.imshow(grid, cmap="viridis_r", aspect="auto")
    _grid_axes(ax, x, y, xs, ys)
    for i in range(len(ys)):
        for j in range(len(xs)):
            if not np.isnan(grid[i, j]):
                ax.text(j, i, f"{grid[i, j]:.0f}", ha="center", va="center", fontsize=7, color="w")
    fig.colorbar(im, ax=ax, label=value)
    title = ", ".join(f"{k}={v}" for k, v in where.items()) or "best over other fields"
    ax.set_title(title, fontsize=8)
    fig.tight_layout()
    return fig


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
) -> Figure:
    """:func:`sweep_heatmap` panels, one per (``row``, ``col``) value pair, with one colour
    scale per panel row (capped at ``vmax_rel`` x the row's best when given; lighter is faster).
    Each panel's best cell is outlined in red. The cells of ``measured`` (records with the same
    x, y, row and col fields plus ``measured_value``) are outlined in the text colour and show
    the measured value under the predicted one (``m ...``)."""
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
            0.6 + (1.0 + 0.7 * len(ys)) * len(prows),
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
            best = np.unravel_index(np.nanargmin(grid), grid.shape)
            for a in range(len(ys)):
                for b in range(len(xs)):
                    if np.isnan(grid[a, b]):
                        continue
                    m = meas.get((pr, pc, xs[b], ys[a]))
                    text = f"{grid[a, b]:.0f}" + (f"\nm {m:.0f}" if m is not None else "")
                    # black on the light (fast) end of viridis_r, white elsewhere
                    ink = "k" if grid[a, b] < lo + 0.35 * (hi - lo) else "w"
                    ax.text(b, a, text, ha="center", va="center", fontsize=7, color=ink)
                    if m is not None or (a, b) == best:
                        ax.add_patch(
                            matplotlib.patches.Rectangle(
                                (b - 0.46, a - 0.46),
                                0.92,
                                0.92,
                                fill=False,
                                edgecolor="r" if (a, b) == best else ink,
                                lw=1.5,
                            )
                        )
            ax.set_title(f"{row}={pr}, {col}={pc}", fontsize=8)
        capped = hi < np.nanmax(grids)
        fig.colorbar(im, ax=axes[i].tolist(), label=value, extend="max" if capped else "neither")
    return fig


def compare_bars(groups: dict[str, Sequence[LayerResult]]) -> Figure:
    """Stacked critical-path breakdown per policy, one panel per workload label."""
    fig, axes = plt.subplots(1, len(groups), figsize=(5.5 * len(groups), 4), squeeze=False)
    for ax, (title, results) in zip(axes[0], groups.items(), strict=True):
        labels = [f"{r.config.dispatch_mode}\n{r.config.combine_mode}" for r in results]
        bottom = np.zeros(len(results))
        for key, color in BREAKDOWN_COLORS.items():
            vals = np.array([r.breakdown[key] for r in results])
            ax.bar(labels, vals, bottom=bottom, color=color, label=key.removesuffix("_us"))
            bottom += vals
        for i, r in enumerate(results):
            ax.text(i, r.layer_us, f"{r.layer_us:.0f}", ha="center", va="bottom", fontsize=8)
        ax.set_title(title, fontsize=9)
        ax.set_ylabel("layer time (us), critical-path breakdown")
        ax.set_ylim(0, bottom.max() * 1.12)
    axes[0][0].legend(fontsize=7, loc="lower left")
    fig.tight_layout()
    return fig


def _policy(row: dict) -> str:
    return f"{row['dispatch_mode']}/{row['combine_mode']}"


def policy_comparison(rows: Sequence[dict], reference: str = "pull/push") -> Figure:
    """Layer time, layer time relative to the ``reference`` policy and NVLink payload per rank
    of each (dispatch, combine) policy: one row of panels per routing skew, one group of bars per
    (topology, EP). ``rows`` are :meth:`LayerResult.summary` rows."""
    skews = list(dict.fromkeys(r["skew"] for r in rows))
    cases = list(dict.fromkeys((r["topology"], r["ep"]) for r in rows))
    policies = list(dict.fromkeys(_policy(r) for r in rows))
    ref = {
        (r["topology"], r["ep"], r["skew"]): r["layer_us"] for r in rows if _policy(r) == reference
    }
    fig, axes = plt.subplots(
        len(skews), 3, figsize=(15, 2.6 * len(skews) + 0.6), squeeze=False, sharex=True
    )
    width = 0.8 / len(policies)
    metrics = (
        ("layer time (us)", lambda r: r["layer_us"]),
        (
            f"layer time / {reference}",
            lambda r: r["layer_us"] / ref.get((r["topology"], r["ep"], r["skew"]), np.nan),
        ),
        ("NVLink MB per rank", lambda r: r["nvlink_payload_mb"] / r["ep"]),
    )
    for i, skew in enumerate(skews):
        for j, (label, get) in enumerate(metrics):
            ax = axes[i][j]
            for p, pol in enumerate(policies):
                vals = np.full(len(cases), np.nan)
                for r in rows:
                    if r["skew"] == skew and _policy(r) == pol:
                        vals[cases.index((r["topology"], r["ep"]))] = get(r)
                xs = np.arange(len(cases)) + (p - (len(policies) - 1) / 2) * width
                ax.bar(xs, vals, width, label=pol)
            ax.set_ylabel(label, fontsize=8)
            ax.set_title(f"skew {skew}", fontsize=8)
        axes[i][1].axhline(1.0, color="k", lw=0.6)
    for ax in axes[-1]:
        ax.set_xticks(range(len(cases)))
        ax.set_xticklabels([f"{t}\nEP{ep}" for t, ep in cases], fontsize=7)
    axes[0][0].legend(fontsize=7, ncol=2)
    fig.tight_layout()
    return fig


def best_train_rows(rows: Sequence[dict]) -> dict[tuple[str, str, str], dict]:
    """The fastest row (``step_us``) of each (model, skew, impl) of a ``mok.bench train`` CSV:
    torch-best's faster of eager / compile, mok-fused's faster SM count."""
    best: dict[tuple[str, str, str], dict] = {}
    for r in rows:
        key = (r["model"], r["skew"], r["impl"])
        if key not in best or float(r["step_us"]) < float(best[key]["step_us"]):
            best[key] = r
    return best


def train_steps(
    rows: Sequence[dict],
    reference: str = "torch-best",
    target: float | None = None,
    title: str | None = None,
) -> Figure:
    """One training step (forward + backward) per implementation of a ``mok.bench train`` CSV:
    one panel per (skew, model), a bar per implementation (its fastest row) split into forward
    and backward, labelled with the step time, its ratio to ``reference`` and the memory the step
    adds above the weights (``step_mem_gib``); ``target``: a dashed line at the reference's step
    time divided by it (a speed-up goal)."""
    best = best_train_rows(rows)
    models = list(dict.fromkeys(r["model"] for r in rows))
    skews = list(dict.fromkeys(r["skew"] for r in rows))
    impls = list(dict.fromkeys(r["impl"] for r in rows))
    fig, axes = plt.subplots(
        len(skews), len(models), figsize=(4.2 * len(models), 3.0 * len(skews) + 0.4),
        squeeze=False,
    )  # fmt: skip
    for i, skew in enumerate(skews):
        for j, model in enumerate(models):
            ax = axes[i][j]
            ref = best.get((model, skew, reference))
            top = 0.0
            for x, impl in enumerate(impls):
                r = best.get((model, skew, impl))
                if r is None:
                    continue
                fwd, bwd = float(r["fwd_us"]) / 1e3, float(r["bwd_us"]) / 1e3
                step = float(r["step_us"]) / 1e3
                ax.bar(x, fwd, 0.7, color="#aec7e8", label="forward" if x == 0 else None)
                ax.bar(x, bwd, 0.7, bottom=fwd, color="#1f77b4",
                       label="backward" if x == 0 else None)  # fmt: skip
                text = f"{step:.1f} ms"
                if ref is not None and impl != reference:
                    text += f"\n{float(ref['step_us']) / float(r['step_us']):.2f}x"
                if r.get("step_mem_gib"):
                    text += f"\n+{float(r['step_mem_gib']):.1f} GiB"
                ax.text(x, fwd + bwd, text, ha="center", va="bottom", fontsize=6.5)
                top = max(top, fwd + bwd)
            if target and ref is not None:
                goal = float(ref["step_us"]) / 1e3 / target
                label = f"{reference} / {target:g}" if (i, j) == (0, 0) else None
                ax.axhline(goal, color="#d62728", ls="--", lw=0.8, label=label)
            ax.set_ylim(0, top * 1.45)
            ax.set_xticks(range(len(impls)))
            ax.set_xticklabels(impls, fontsize=7, rotation=20)
            ax.set_title(f"{model}, {skew}", fontsize=8)
            ax.set_ylabel("ms per step", fontsize=8)
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=len(labels), fontsize=7)
    if title:
        fig.suptitle(title, fontsize=9)
    fig.tight_layout(rect=(0, 0.05, 1, 1))
    return fig


def expert_pieces(rows: Sequence[dict], skew: str = "uniform", peak_tflops: float | None = None,
                  title: str | None = None) -> Figure:  # fmt: skip
    """The routed experts' GEMM pieces of a training step, each alone (a ``mok.bench experts``
    CSV, one ``skew``): one panel per model, per piece a bar for each implementation at its
    TFLOP/s of the routed rows' FLOPs, labelled with its time; ``peak_tflops``: a dashed line at
    the GPU's dense rate."""
    sel = [r for r in rows if r["skew"] == skew]
    models = list(dict.fromkeys(r["model"] for r in sel))
    pieces = list(dict.fromkeys(r["piece"] for r in sel))
    impls = list(dict.fromkeys(r["impl"] for r in sel))
    colors = {"mok": "#1f77b4", "mok-serial": "#aec7e8", "torch": "#ff7f0e"}
    width = 0.8 / max(1, len(impls))
    fig, axes = plt.subplots(1, len(models), figsize=(4.6 * len(models), 3.6), squeeze=False)
    for j, (ax, model) in enumerate(zip(axes[0], models, strict=True)):
        got = {(r["piece"], r["impl"]): r for r in sel if r["model"] == model}
        for k, impl in enumerate(impls):
            for x, piece in enumerate(pieces):
                r = got.get((piece, impl))
                if r is None:
                    continue
                at = x + (k - (len(impls) - 1) / 2) * width
                rate = float(r["tflops"])
                ax.bar(at, rate, width, color=colors.get(impl, "#7f7f7f"), label=impl)
                ax.text(at, rate, f"{float(r['median_us']) / 1e3:.2f}", ha="center",
                        va="bottom", fontsize=5.5, rotation=90)  # fmt: skip
        if peak_tflops:
            label = f"{peak_tflops:g} TFLOP/s (dense bf16 peak)" if j == 0 else None
            ax.axhline(peak_tflops, color="#d62728", ls="--", lw=0.8, label=label)
        ax.set_ylim(0, (peak_tflops or max(float(r["tflops"]) for r in sel)) * 1.12)
        ax.set_xticks(range(len(pieces)))
        ax.set_xticklabels(pieces, fontsize=6.5, rotation=25)
        ax.set_title(f"{model}, {skew}", fontsize=8)
        ax.set_ylabel("TFLOP/s (bars labelled in ms)", fontsize=7)
    handles, labels = [], []
    for ax in axes[0]:
        for h, lab in zip(*ax.get_legend_handles_labels(), strict=True):
            if lab not in labels:
                handles.append(h)
                labels.append(lab)
    fig.legend(handles, labels, loc="lower center", ncol=len(labels), fontsize=7)
    if title:
        fig.suptitle(title, fontsize=9)
    fig.tight_layout(rect=(0, 0.06, 1, 1))
    return fig


def lm_run_label(rows: Sequence[dict]) -> str:
    """A ``mok.bench lm`` run in words: ``EP4 (4 ranks on one NVIDIA H100, bfloat16)``."""
    r = rows[0]
    ep = int(r["ep"])
    if r["device"] != "cuda":
        where = f"{ep} CPU processes" if ep > 1 else "CPU"
    elif int(r.get("shared_gpu") or 0) and ep > 1:
        where = f"{ep} ranks on one {r['gpu']}"
    else:
        where = f"{ep} x {r['gpu']}" if ep > 1 else r["gpu"]
    return f"EP{ep} ({where}, {r['dtype']})"


def train_loss(
    runs: dict[str, Sequence[dict]], reference: str | None = None, title: str | None = None
) -> Figure:
    """The loss curves of ``mok.bench lm`` runs (label -> the rows of its CSV: ``step``,
    ``loss``) over the steps, the chain's loss floor dashed where the rows carry it, and below
    each run's per-step difference to ``reference`` (default: the EP1 run, else the first)."""
    if not runs:
        raise ValueError("train_loss needs at least one run")
    if reference is None:
        ep1 = [k for k, rows in runs.items() if str(rows[0].get("ep")) == "1"]
        reference = ep1[0] if ep1 else next(iter(runs))
    curves = {k: {int(r["step"]): float(r["loss"]) for r in rows} for k, rows in runs.items()}
    ref = curves[reference]
    fig, (top, bottom) = plt.subplots(
        2, 1, figsize=(7.5, 5.2), sharex=True, height_ratios=(2.2, 1), layout="constrained"
    )
    for (label, curve), style in zip(curves.items(), ("-", "--", ":", "-."), strict=False):
        top.plot(list(curve), list(curve.values()), style, lw=1.2, label=label)
        if label == reference:
            continue
        steps = sorted(set(curve) & set(ref))
        diff = [curve[s] - ref[s] for s in steps]
        worst = max((abs(d) for d in diff), default=0.0)
        bottom.plot(steps, diff, lw=0.9, label=f"{label} - {reference} (max |diff| {worst:.2e})")
    floor = next(iter(runs.values()))[0].get("loss_floor")
    if floor not in (None, ""):
        top.axhline(float(floor), color="grey", ls=":", lw=1.0, label="loss floor (chain entropy)")
    top.set_ylabel("cross-entropy (nats)")
    top.legend(fontsize=8)
    bottom.axhline(0.0, color="grey", lw=0.6)
    bottom.set_xlabel("step")
    bottom.set_ylabel("loss difference (nats)", fontsize=8)
    if len(curves) > 1:
        bottom.legend(fontsize=7)
    if title is None:
        r = next(iter(runs.values()))[0]
        title = (
            f"MoE LM: hidden {r['hidden']}, {r['num_experts']} experts, top-{r['num_topk']}, "
            f"{r['tokens_per_step']} tokens/step, seed {r['seed']}\n"
            + " vs ".join(curves)
            + " from the same seed"
        )
    top.set_title(title, fontsize=9)
    return fig


def scaling_summary(rows: Sequence[dict], where: dict | None = None) -> Figure:
    """One bar per step (in row order) of a scale-out: the critical-path breakdown of the layer
    time, the exposed-communication share and compute idle fraction, and NVLink vs NIC payload
    per rank. ``rows`` are :meth:`LayerResult.summary` rows; ``where`` filters them."""
    where = where or {}
    sel = [r for r in rows if all(r.get(k) == v for k, v in where.items())]
    labels = [f"{r['topology']}\nEP{r['ep']}" for r in sel]
    x = np.arange(len(sel))
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    bottom = np.zeros(len(sel))
    for key, color in BREAKDOWN_COLORS.items():
        vals = np.array([r[key] for r in sel])
        axes[0].bar(x, vals, bottom=bottom, color=color, label=key.removesuffix("_us"))
        bottom += vals
    axes[0].set_ylabel("layer time (us), critical-path breakdown")
    axes[0].legend(fontsize=7)
    share = np.array([r["exposed_comm_us"] / r["layer_us"] for r in sel])
    idle = np.array([r["compute_idle_frac"] for r in sel])
    axes[1].plot(x, 100 * share, "o-", color=BREAKDOWN_COLORS["exposed_comm_us"], label="exposed")
    axes[1].plot(x, 100 * idle, "s--", color="#7f7f7f", label="compute idle")
    axes[1].set_ylabel("% of layer time")
    axes[1].set_ylim(0, 100)
    axes[1].legend(fontsize=7)
    nv = np.array([r["nvlink_payload_mb"] / r["ep"] for r in sel])
    nic = np.array([r["nic_payload_mb"] / r["ep"] for r in sel])
    axes[2].bar(x, nv, color="#1f77b4", label="NVLink")
    axes[2].bar(x, nic, bottom=nv, color="#ff7f0e", label="NIC")
    axes[2].set_ylabel("payload MB per rank")
    axes[2].legend(fontsize=7)
    for ax in axes:
        ax.set_xticks(x)
        ax.set_xticklabels(labels, fontsize=7)
    title = ", ".join(f"{k}={v}" for k, v in where.items())
    if title:
        fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    return fig


def waves_scatter(
    rows: Sequence[dict],
    x: str = "gemm_waves",
    y: str = "layer_us",
    hue: str = "num_comm_sms",
    threshold: float | None = 2.0,
) -> Figure:
    """Scatter of ``y`` against ``x`` (e.g. GEMM waves per minibatch, a field the caller adds to
    sweep rows), one colour per ``hue`` value, with a vertical line at ``threshold``."""
    fig, ax = plt.subplots(figsize=(6.5, 4))
    for h in sorted({r[hue] for r in rows}):
        sel = [r for r in rows if r[hue] == h]
        ax.scatter([r[x] for r in sel], [r[y] for r in sel], s=18, label=f"{hue}={h}")
    if threshold is not None:
        ax.axvline(threshold, color="k", ls=":", lw=1)
    ax.set_xscale("log", base=2)
    ax.set_xlabel(x)
    ax.set_ylabel(y)
    ax.legend(fontsize=7)
    fig.tight_layout()
    return fig


def validation_scatter(records: Sequence[dict]) -> Figure:
    """Predicted vs measured phase time of ``sim.app.validate`` records (log-log, y = x and +-15%
    lines), coloured by ``what`` (a comm kernel's phase, or a train row's fwd / bwd / step),
    hollow markers for the rows the knobs were fitted on."""
    ok = [r for r in records if r.get("status") == "ok"]
    fig, ax = plt.subplots(figsize=(6.4, 6.0), layout="constrained")
    colors = {"schedule": "#7f7f7f", "dispatch": "#ff7f0e", "combine": "#2ca02c"}
    # the quantities of a train CSV's records (sim.app.validate.validate_train_rows)
    colors.update(fwd="#1f77b4", bwd="#d62728", step="#9467bd")
    for what in sorted({r["what"] for r in ok}):
        for role, face in (("validation", None), ("fit", "none")):
            pts = [r for r in ok if r["what"] == what and r["role"] == role]
            if not pts:
                continue
            c = colors.get(what, "#1f77b4")
            ax.scatter(
                [r["measured_us"] for r in pts],
                [r["predicted_us"] for r in pts],
                s=28,
                edgecolors=c,
                facecolors=face or c,
                label=f"{what} ({role})",
            )
    if ok:
        lo = min(min(r["measured_us"], r["predicted_us"]) for r in ok) * 0.8
        hi = max(max(r["measured_us"], r["predicted_us"]) for r in ok) * 1.25
        x = np.array([lo, hi])
        ax.plot(x, x, color="k", lw=0.8)
        for f in (0.85, 1.15):
            ax.plot(x, f * x, color="k", lw=0.6, ls="--")
        ax.set_xlim(lo, hi)
        ax.set_ylim(lo, hi)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("measured us")
    ax.set_ylabel("predicted us")
    ax.set_title("mok-sim validate: predicted vs measured (dashed: +-15%)")
    ax.legend(fontsize=8)
    return fig


def layer_validation(records: Sequence[dict]) -> Figure:
    """Fused-layer rows of ``sim.app.validate.validate_layer_rows``: per row, the prediction error
    ``predicted / measured - 1`` (filled: validation row, hollow: fit row) against the measured
    p20-p80 band around the median (grey bar), one panel per model; dotted lines at +-5 %.
    With several measured CSVs, tick labels end in the CSV's letter (legend title)."""
    ok = [r for r in records if r.get("status") == "ok"]
    models = list(dict.fromkeys(r["model"] for r in ok)) or ["(no rows)"]
    sources = list(dict.fromkeys(r.get("source", "") for r in ok))
    tag = {src: f" {chr(97 + i)}" if len(sources) > 1 else "" for i, src in enumerate(sources)}
    fig, axes = plt.subplots(
        len(models), 1, figsize=(12, 2.7 * len(models)), squeeze=False, layout="constrained"
    )
    colors = {"pull": "#ff7f0e", "dedup_pull": "#1f77b4"}
    for ax, model in zip(axes[:, 0], models, strict=True):
        rows = sorted(
            (r for r in ok if r["model"] == model),
            key=lambda r: (r["skew"], r["mode"], int(r["sms"]), int(r["minibatch"]), r["source"]),
        )
        x = np.arange(len(rows))
        lo = [100 * (r["p20_us"] / r["measured_us"] - 1) for r in rows]
        hi = [100 * (r["p80_us"] / r["measured_us"] - 1) for r in rows]
        ax.bar(x, np.subtract(hi, lo), bottom=lo, width=0.6, color="#cccccc", label="p20-p80")
        errs = [100 * r["err"] for r in rows]
        for mode, c in colors.items():
            for role, face in (("validation", c), ("fit", "none")):
                sel = [i for i, r in enumerate(rows) if r["mode"] == mode and r["role"] == role]
                if sel:
                    ax.scatter(
                        x[sel],
                        [errs[i] for i in sel],
                        s=36,
                        edgecolors=c,
                        facecolors=face,
                        zorder=3,
                        label=f"{mode} ({role})",
                    )
        ax.axhline(0, color="k", lw=0.6)
        for y in (-5, 5):
            ax.axhline(y, color="k", lw=0.6, ls=":")
        top = 1.15 * max([6.0] + [abs(v) for v in errs + lo + hi])
        ax.set_ylim(-top, top)
        ax.set_xlim(-0.5, max(len(rows), 8) - 0.5)
        ax.set_xticks(x)
        ax.set_xticklabels(
            [
                f"{r['skew'].replace('uniform', 'uni')}{tag[r['source']]}\n"
                f"{r['sms']}/{r['minibatch']}"
                for r in rows
            ],
            fontsize=7,
        )
        ax.set_ylabel("% vs measured")
        ax.set_title(f"{model} (x: skew, comm SMs / minibatch)", fontsize=9)
        ax.legend(
            fontsize=7,
            loc="upper left",
            bbox_to_anchor=(1.0, 1.0),
            title="\n".join(f"{t.strip()}: {src}" for src, t in tag.items() if t) or None,
            title_fontsize=6,
        )
    fig.suptitle("fused layer: predicted vs measured median (grey: measured p20-p80)", fontsize=10)
    return fig


# -- sensitivity of the push-signalling assumptions ----------------------------------------------


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
    push-vs-pull differences push/push - pull/push and push/push - pull/pull (bottom)."""
    param = rows[0]["param"]
    label = SIGNALLING_ASSUMPTIONS.get(param, (param,))[0]
    skews = list(dict.fromkeys(r["skew"] for r in rows))
    modes = list(dict.fromkeys(r["mode"] for r in rows))
    fig, axes = plt.subplots(2, len(skews), figsize=(5.2 * len(skews), 6.4), squeeze=False)
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
            top.plot(x, y, "o-", ms=3, label=m)
        top.set_title(skew, fontsize=9)
        top.set_ylabel("layer us")
        top.legend(fontsize=7)
        ref = dict(by.get("push/push", []))
        for m in modes:
            if m == "push/push" or not ref:
                continue
            other = dict(by[m])
            x = sorted(set(ref) & set(other))
            bot.plot(x, [ref[v] - other[v] for v in x], "s-", ms=3, label=f"push/push - {m}")
        bot.axhline(0, color="k", lw=0.6)
        bot.set_ylabel("layer us difference")
        bot.set_xlabel(label, fontsize=8)
        if bot.lines[1:]:
            bot.legend(fontsize=7)
    if title:
        fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    return fig


def write_signalling_sensitivity(
    out_dir: str | Path = "docs/img",
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


def write_train_loss(csvs: Sequence[str | Path], out: str | Path, title: str | None = None) -> Path:
    """:func:`train_loss` of the ``mok.bench lm`` CSVs ``csvs`` (each labelled by
    :func:`lm_run_label`, or its file name where two runs read the same) saved to ``out``."""
    from sim.measured import read_rows

    runs: dict[str, list[dict]] = {}
    for path in csvs:
        rows = read_rows(path)
        if not rows:
            raise ValueError(f"{path}: no rows")
        label = lm_run_label(rows)
        runs[label if label not in runs else f"{label} [{Path(path).name}]"] = rows
    fig = train_loss(runs, title=title)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out


if __name__ == "__main__":  # pragma: no cover - maintenance entry point
    import argparse

    ap = argparse.ArgumentParser(prog="python -m sim.app.plots")
    sub = ap.add_subparsers(dest="what", required=True)
    sp = sub.add_parser("signalling-sensitivity", help="the push-signalling assumptions' figures")
    sp.add_argument("--out", default="docs/img")
    sp.add_argument("--params", default=",".join(SIGNALLING_ASSUMPTIONS))
    tp = sub.add_parser("train-steps", help="the training-step figure of a mok.bench train CSV")
    tp.add_argument("--csv", default="mok/bench/results/h200x1-train.csv")
    tp.add_argument("--out", default="docs/img/train-step-h200.png")
    tp.add_argument("--title", default=None)
    ep = sub.add_parser("experts-pieces", help="the expert GEMM pieces of a mok.bench experts CSV")
    ep.add_argument("--csv", default="mok/bench/results/h200x1-experts.csv")
    ep.add_argument("--out", default="docs/img/experts-pieces-h200.png")
    ep.add_argument("--skew", default="uniform")
    ep.add_argument("--peak", type=float, default=790.0, help="dense bf16 TFLOP/s of the GPU")
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

        train_steps(read_rows(a.csv), target=1.5, title=a.title).savefig(a.out, dpi=110)
        print(f"wrote {a.out}")
    elif a.what == "experts-pieces":
        from sim.measured import read_rows

        expert_pieces(read_rows(a.csv), a.skew, a.peak).savefig(a.out, dpi=110)
        print(f"wrote {a.out}")
    else:
        for path in write_signalling_sensitivity(a.out, a.params.split(",")):
            print(f"wrote {path}")
