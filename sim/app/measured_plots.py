"""Figures of measured runs and of the simulator against them: the training step per
implementation (``mok.bench train``, :func:`train_steps`), the experts' GEMM pieces
(``mok.bench experts``, :func:`expert_pieces`), loss curves (``mok.bench lm``,
:func:`train_loss`), and predicted against measured times (``mok-sim validate``,
:func:`validation_scatter`, :func:`layer_validation`). Each returns a matplotlib Figure (Agg
backend); :mod:`sim.app.plots` re-exports them and draws them from the command line."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402
from matplotlib.patches import Patch  # noqa: E402

from sim.app.labels import LOWER_IS_BETTER, wrap_lines  # noqa: E402

__all__ = [
    "best_train_rows",
    "train_steps",
    "expert_pieces",
    "published_comparison",
    "lm_run_label",
    "train_loss",
    "write_train_loss",
    "validation_scatter",
    "layer_validation",
]


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
            ax.set_ylabel(f"ms per step, {LOWER_IS_BETTER}", fontsize=8)
            if i == len(skews) - 1:
                ax.set_xlabel("implementation (its fastest row)", fontsize=8)
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=len(labels), fontsize=7)
    fig.suptitle(
        (title or "One training step of the MoE layer (forward + backward) per implementation")
        + f"\nbar labels: step time, speed-up over {reference}, memory the step adds above the "
        "weights",
        fontsize=9,
    )
    fig.tight_layout(rect=(0, 0.05, 1, 1))
    return fig


def published_comparison(
    rows: Sequence[dict],
    published: dict[str, tuple[int, float, float]],
    source: str,
    skew: str = "uniform",
    title: str | None = None,
) -> Figure:
    """Forward and backward TFLOP/s of a ``mok.bench train`` CSV next to another library's
    published figures at its own shapes: ``published`` maps a model preset to (tokens, forward,
    backward TFLOP/s) as ``source`` publishes them. Two panels (forward, backward), per shape a
    hatched bar for ``source`` and one for each implementation's fastest step
    (:func:`best_train_rows`), labelled with its TFLOP/s and its ratio to ``source``."""
    best = best_train_rows([r for r in rows if r["skew"] == skew])
    shapes = [
        m for m, (t, _, _) in published.items()
        if any(k[0] == m and int(b["tokens_per_rank"]) == t for k, b in best.items())
    ]  # fmt: skip
    impls = list(dict.fromkeys(k[2] for k in best if k[0] in shapes))
    width = 0.8 / (1 + max(1, len(impls)))
    fig, axes = plt.subplots(1, 2, figsize=(max(7.0, 2.2 * len(shapes) + 3.0), 3.6), squeeze=False)
    cmap = plt.get_cmap("tab10")
    for p, (ax, what) in enumerate(zip(axes[0], ("forward", "backward"), strict=True)):
        col = "fwd_tflops" if p == 0 else "bwd_tflops"
        for x, m in enumerate(shapes):
            theirs = published[m][1 + p]
            label = f"{source} (published)" if x == 0 else None
            ax.bar(x - 0.4 + width / 2, theirs, width, color="#c7c7c7", hatch="//",
                   edgecolor="#7f7f7f", label=label)  # fmt: skip
            ax.text(x - 0.4 + width / 2, theirs, f"{theirs:.0f}", ha="center", va="bottom",
                    fontsize=6)  # fmt: skip
            for j, impl in enumerate(impls):
                r = best.get((m, skew, impl))
                if r is None:
                    continue
                v = float(r[col])
                xi = x - 0.4 + width * (j + 1.5)
                ax.bar(xi, v, width, color=cmap(j), label=impl if x == 0 else None)
                ax.text(xi, v, f"{v:.0f}\n{v / theirs:.2f}x", ha="center", va="bottom",
                        fontsize=5.5)  # fmt: skip
        ax.set_xticks(range(len(shapes)))
        ax.set_xticklabels([_shape_text(m, best, skew) for m in shapes], fontsize=6.5)
        ax.set_ylabel(f"{what} TFLOP/s, higher is better", fontsize=8)
        ax.set_xlabel(f"{source}'s shapes (T tokens, d hidden, n expert size)", fontsize=8)
        ax.set_title(what, fontsize=9)
        ax.margins(y=0.2)
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=min(len(labels), 5), fontsize=7)
    fig.suptitle(
        (title or f"mok against {source}'s published figures at its shapes")
        + f"\nbar labels: TFLOP/s and the ratio to {source}; each implementation's fastest step",
        fontsize=9,
    )
    fig.tight_layout(rect=(0, 0.08, 1, 1))
    return fig


# kernel categories of a step's profile (mok.bench train --kernels): the first pattern a kernel's
# short name contains decides; the rest is "other"
KERNEL_CATEGORIES = (
    ("experts' GEMMs", ("swiglu_bwd_kernel", "bwd_fused_kernel", "wgrad", "cutlass", "gemm")),
    ("row dispatch", ("dispatch", "fanout")),
    ("combine", ("combine", "dedup_sum", "dedup_partials")),
    ("schedule", ("schedule",)),
    ("padding rows", ("zero_padding",)),
)


def kernel_category(short: str) -> str:
    """The category (:data:`KERNEL_CATEGORIES`) of a kernel's short name, or "other"."""
    low = short.lower()
    for name, patterns in KERNEL_CATEGORIES:
        if any(p in low for p in patterns):
            return name
    return "other"


def kernel_breakdown(rows: Sequence[dict], title: str | None = None) -> Figure:
    """Where a training step's device time goes, from a ``mok.bench train --kernels`` CSV: per
    (model, implementation) one horizontal bar of ms per step, stacked by kernel category
    (:func:`kernel_category`), each segment of at least 4 % labelled with its ms."""
    groups: dict[tuple[str, str], dict[str, float]] = {}
    for r in rows:
        key = (r["model"], f"{r['impl']} ({r['mode']})")
        cats = groups.setdefault(key, {})
        cat = kernel_category(r["short"])
        cats[cat] = cats.get(cat, 0.0) + float(r["us_per_step"]) / 1e3
    names = [c for c, _ in KERNEL_CATEGORIES] + ["other"]
    keys = list(groups)
    fig, ax = plt.subplots(figsize=(8.0, 0.45 * len(keys) + 1.8))
    cmap = plt.get_cmap("tab10")
    for i, key in enumerate(keys):
        left, total = 0.0, sum(groups[key].values())
        for j, cat in enumerate(names):
            ms = groups[key].get(cat, 0.0)
            if ms <= 0:
                continue
            ax.barh(i, ms, left=left, color=cmap(j))
            if ms >= 0.04 * total:
                ax.text(left + ms / 2, i, f"{ms:.2f}", ha="center", va="center", fontsize=6)
            left += ms
        ax.text(left, i, f" {total:.2f} ms", ha="left", va="center", fontsize=6.5)
    ax.set_yticks(range(len(keys)))
    ax.set_yticklabels([f"{m}\n{impl}" for m, impl in keys], fontsize=6.5)
    ax.invert_yaxis()
    ax.set_xlabel(f"device time per step, ms ({LOWER_IS_BETTER})", fontsize=8)
    ax.set_ylabel("shape, implementation", fontsize=8)
    ax.margins(x=0.12)
    present = [(j, c) for j, c in enumerate(names) if any(c in g for g in groups.values())]
    fig.legend([Patch(color=cmap(j)) for j, _ in present], [c for _, c in present],
               loc="lower center", ncol=len(present), fontsize=7)  # fmt: skip
    fig.suptitle(
        (title or "Where a training step's time goes")
        + "\nkernels' device time per step under torch.profiler, by category; labels in ms",
        fontsize=9,
    )
    fig.tight_layout(rect=(0, 0.1, 1, 1))
    return fig


def _shape_text(model: str, best: dict, skew: str) -> str:
    """(T, d, n, E, K) of ``model`` from any of its rows."""
    r = next(b for k, b in best.items() if k[0] == model and k[1] == skew)
    return (
        f"T {r['tokens_per_rank']}, d {r['hidden']}\nn {r['intermediate']}, E "
        f"{r['num_experts']}, K {r['num_topk']}"
    )


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
        ax.set_ylabel("TFLOP/s of the routed rows, higher is better\n(bar labels: time in ms)",
                      fontsize=7)  # fmt: skip
        ax.set_xlabel("GEMM piece of the experts' backward (and the forward's saving)", fontsize=7)
    handles, labels = [], []
    for ax in axes[0]:
        for h, lab in zip(*ax.get_legend_handles_labels(), strict=True):
            if lab not in labels:
                handles.append(h)
                labels.append(lab)
    fig.legend(handles, labels, loc="lower center", ncol=len(labels), fontsize=7)
    fig.suptitle(
        title
        or f"The routed experts' GEMM pieces of a training step, each alone ({skew} "
        "routing): mok vs torch",
        fontsize=9,
    )
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
    top.set_title(wrap_lines(title.split("\n"), fig.get_figwidth() - 0.5, 9), fontsize=9)
    return fig


def validation_scatter(records: Sequence[dict]) -> Figure:
    """Predicted vs measured phase time of ``sim.app.validate`` records (log-log, y = x and +-15%
    lines), coloured by ``what`` (a comm kernel's phase, or a train row's fwd / bwd / step),
    hollow markers for the rows the knobs were fitted on."""
    ok = [r for r in records if r.get("status") == "ok"]
    fig, ax = plt.subplots(figsize=(6.4, 6.2), layout="constrained")
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
    ax.set_xlabel("measured time (us, log scale)")
    ax.set_ylabel("predicted time (us, log scale)")
    ax.set_title(
        "mok-sim validate: simulator prediction against the measured kernels\n"
        "one dot per measured row (solid: exact; dashed: +-15 %; hollow: fitted on)",
        fontsize=9,
    )
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
        len(models), 1, figsize=(12, 0.6 + 2.7 * len(models)), squeeze=False, layout="constrained"
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
        ax.set_ylabel("prediction error\n(% of measured)", fontsize=8)
        ax.set_title(f"{model}", fontsize=9)
        ax.legend(
            fontsize=7,
            loc="upper left",
            bbox_to_anchor=(1.0, 1.0),
            title="\n".join(f"{t.strip()}: {src}" for src, t in tag.items() if t) or None,
            title_fontsize=6,
        )
    axes[-1, 0].set_xlabel("measured configuration: routing skew, comm SMs / minibatch", fontsize=8)
    fig.suptitle(
        "Fused layer: predicted vs measured median per configuration (0 = exact; dotted: "
        "+-5 %; grey: the measured p20-p80 band)",
        fontsize=10,
    )
    return fig


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
