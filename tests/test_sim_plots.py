"""Every chart of :mod:`sim.app.plots` renders from small inputs (Agg backend) with a title, a
label on every axis (the bottom row's x axis where panels share it) and, on the time charts,
"lower is better"; the demo chart's verdict; cell text in black or white by the cell's
luminance; the plots entry point writes under build/ by default."""

from __future__ import annotations

import inspect
import io
import math
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402

from mok.bench.sonicmoe import published  # noqa: E402
from sim.app import plots  # noqa: E402
from sim.app.labels import LOWER_IS_BETTER, ink_for, topology_title  # noqa: E402
from sim.config import SimConfig, Workload  # noqa: E402
from sim.layer.model import simulate  # noqa: E402
from sim.layer.sweep import compare  # noqa: E402
from sim.measured import measured_path, read_rows  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
WL = Workload("tiny", 256, 8, "hgx-h200", "zipf:0.2")
CFG = SimConfig(num_comm_sms=16, minibatch_size=128, macrobatch_size=256)
POLICIES = (("push", "push"), ("pull", "push"))


@pytest.fixture(scope="module")
def data() -> SimpleNamespace:
    """Small inputs of every chart: one simulated layer (with link series), a 2 x 2 x 2 sweep of
    the tiny shape, summary rows of two topologies x two skews, the committed train / experts
    CSVs, and hand-made validation, loss and sensitivity records."""
    layer = simulate(WL, CFG, record_links=True)
    sweep = []
    for sms in (8, 16):
        for mb in (128, 256):
            cfg = CFG.replace(num_comm_sms=sms, minibatch_size=mb, macrobatch_size=2 * mb)
            for r in compare(WL, cfg, POLICIES):
                sweep.append(dict(r.summary(), gemm_waves=mb / 128 * 4 / (132 - sms)))
    summary = [
        r.summary()
        for topology, ep in (("h200x2", 2), ("hgx-h200", 8))
        for skew in ("uniform", "hot:0.3")
        for r in compare(Workload("tiny", 256, ep, topology, skew), CFG, POLICIES)
    ]
    panels = [dict(r, model=r["shape"]) for r in sweep]
    measured = [dict(panels[0], measured_us=1.05 * panels[0]["layer_us"])]
    validation = [
        {"status": "ok", "what": w, "role": role, "measured_us": m, "predicted_us": m * f}
        for w in ("dispatch", "combine")
        for role, m, f in (("fit", 100.0, 1.02), ("validation", 300.0, 0.9))
    ]
    layer_records = [
        {"status": "ok", "model": "deepseek-v3", "skew": "uniform", "mode": mode, "sms": sms,
         "minibatch": 4096, "source": "a.csv", "measured_us": 9000.0, "p20_us": 8900.0,
         "p80_us": 9100.0, "err": err, "role": role}
        for mode, sms, err, role in (("pull", 8, 0.02, "fit"), ("dedup_pull", 16, -0.04,
                                                                 "validation"))
    ]  # fmt: skip
    lm = {
        f"EP{ep}": [
            {"step": i, "loss": 3.0 * math.exp(-i / 5) + 1.0 + ep * 1e-4, "ep": ep,
             "hidden": 64, "num_experts": 8, "num_topk": 2, "tokens_per_step": 256, "seed": 0,
             "loss_floor": 1.0}
            for i in range(12)
        ]
        for ep in (1, 4)
    }  # fmt: skip
    sensitivity = [
        {"param": "jitter_us", "value": v, "skew": "uniform", "mode": m, "layer_us": t + v * k}
        for v in (0.0, 1.0)
        for m, t, k in (("push/push", 40.0, 5.0), ("pull/push", 38.0, 1.0))
    ]
    return SimpleNamespace(
        layer=layer,
        results=compare(WL, CFG),
        sweep=sweep,
        summary=summary,
        panels=panels,
        measured=measured,
        validation=validation,
        layer_records=layer_records,
        train=read_rows(measured_path("h200x1-train.csv")),
        experts=read_rows(measured_path("h200x1-experts.csv")),
        sonic=read_rows(measured_path("h100x1-train-sonicmoe-levers-2026-12-07.csv")),
        lm=lm,
        sensitivity=sensitivity,
    )


SONIC = published()

# a mok.bench train --kernels CSV's rows, made up: two implementations of one shape
KERNEL_ROWS = [
    {"model": "sonic-1536x256", "impl": impl, "mode": "dedup_pull", "short": short,
     "us_per_step": us}
    for impl, kernels in (
        ("mok-saved", (("mok::bwd_fused_kernel<0>", 2306.0), ("mok::schedule_kernel", 335.0),
                       ("mok::dispatch_dedup_pull_kernel", 704.0),
                       ("mok::combine_push_kernel<true>", 654.0), ("Memcpy DtoD", 10.0))),
        ("mok-unfused", (("mok::swiglu_bwd_kernel<0>", 3000.0),
                         ("mok::zero_padding_kernel", 81.0))),
    )
    for short, us in kernels
]  # fmt: skip

# chart function -> (its figure from the small inputs, whether its values are times)
CHARTS = {
    "gantt": (lambda d: plots.gantt(d.layer, ranks=range(4)), False),
    "link_utilisation": (lambda d: plots.link_utilisation(d.layer), False),
    "sweep_heatmap": (lambda d: plots.sweep_heatmap(d.sweep), True),
    "sweep_heatmap_panels": (
        lambda d: plots.sweep_heatmap_panels(d.panels, measured=d.measured, vmax_rel=1.2),
        True,
    ),
    "compare_bars": (lambda d: plots.compare_bars({WL.label(): d.results}), True),
    "policy_comparison": (lambda d: plots.policy_comparison(d.summary), True),
    "train_steps": (lambda d: plots.train_steps(d.train, target=1.5), True),
    "expert_pieces": (lambda d: plots.expert_pieces(d.experts, "uniform", 790.0), False),
    "published_comparison": (
        lambda d: plots.published_comparison(d.sonic, SONIC, "SonicMoE"),
        False,
    ),
    "kernel_breakdown": (lambda d: plots.kernel_breakdown(KERNEL_ROWS), True),
    "train_loss": (lambda d: plots.train_loss(d.lm), False),
    "scaling_summary": (lambda d: plots.scaling_summary(d.summary, {"skew": "uniform"}), True),
    "waves_scatter": (lambda d: plots.waves_scatter(d.sweep), True),
    "validation_scatter": (lambda d: plots.validation_scatter(d.validation), False),
    "layer_validation": (lambda d: plots.layer_validation(d.layer_records), False),
    "signalling_sensitivity": (lambda d: plots.signalling_sensitivity(d.sensitivity), True),
}


def _texts(fig: Figure) -> str:
    """Every title and axis label of ``fig``, one string."""
    parts = [fig.get_suptitle()]
    for ax in fig.axes:
        parts += [ax.get_title(), ax.get_xlabel(), ax.get_ylabel()]
    return "\n".join(parts)


def test_every_chart_function_is_rendered_here():
    charts = {
        name
        for name in plots.__all__
        if callable(f := getattr(plots, name))
        and inspect.signature(f).return_annotation in ("Figure", Figure)
    }
    assert charts == set(CHARTS)


@pytest.mark.parametrize("name", list(CHARTS))
def test_chart_renders_with_a_title_and_labelled_axes(name, data):
    make, times = CHARTS[name]
    fig = make(data)
    try:
        assert isinstance(fig, Figure)
        title = fig.get_suptitle() or " ".join(ax.get_title() for ax in fig.axes)
        assert title.strip(), f"{name}: no title"
        for ax in fig.axes:
            if ax.get_label() == "<colorbar>":
                assert ax.get_ylabel().strip(), f"{name}: a colour bar without a label"
                continue
            assert ax.get_ylabel().strip(), f"{name}: a panel without a y label"
            spec = ax.get_subplotspec()
            if spec is None or spec.is_last_row():
                assert ax.get_xlabel().strip(), f"{name}: a bottom panel without an x label"
        if times:
            assert LOWER_IS_BETTER in _texts(fig), f"{name}: a time chart that does not say so"
        buf = io.BytesIO()
        fig.savefig(buf, format="png", dpi=40)
        assert buf.getvalue()[:8] == b"\x89PNG\r\n\x1a\n"
    finally:
        plt.close(fig)


def _fake(policy: str, us: float) -> SimpleNamespace:
    d, c = policy.split("/")
    return SimpleNamespace(config=SimpleNamespace(dispatch_mode=d, combine_mode=c), layer_us=us)


@pytest.mark.parametrize(
    ("times", "want"),
    [
        (
            {"push/push": 2691.9, "pull/push": 2691.9, "pull/pull": 2688.4},
            "pull/pull is 0.13 % (3.5 us) faster than push/push",
        ),
        (
            {"push/push": 5000.0, "pull/push": 5030.0, "dedup_pull/push": 5010.0},
            "push/push is 0.20 % (10.0 us) faster than dedup_pull/push",
        ),
        ({"push/push": 100.0, "pull/push": 100.01}, "push/push and pull/push tie at 100.0 us"),
        (
            {"pull/push": 10.0, "pull/pull": 15.0},
            "pull/push is 33.3 % (5.0 us) faster than pull/pull",
        ),
    ],
)
def test_push_pull_verdict(times, want):
    assert plots.push_pull_verdict([_fake(p, t) for p, t in times.items()]) == want


def test_demo_chart_titles_carry_the_verdict_and_name_the_policies(data):
    fig = plots.compare_bars({WL.label(): data.results})
    try:
        top, bottom = fig.axes[:2]
        assert top.get_title() == (
            f"{topology_title(WL.topology)}, EP{WL.ep}\n{plots.push_pull_verdict(data.results)}"
        )
        names = [t.get_text() for t in top.get_yticklabels()]
        assert names == [
            f"{r.config.dispatch_mode} / {r.config.combine_mode}" for r in data.results
        ]
        assert top.get_ylabel() == "dispatch / combine"
        fastest = min(r.layer_us for r in data.results)
        widths = sorted(p.get_width() for p in top.patches)
        assert widths == pytest.approx(sorted(r.layer_us - fastest for r in data.results))
        # the legend sits outside the panels: no bar is under it
        (legend,) = fig.legends
        fig.canvas.draw()
        box = legend.get_window_extent()
        for ax in fig.axes:
            assert not box.overlaps(ax.get_window_extent())
    finally:
        plt.close(fig)


def test_cell_text_is_black_on_light_cells_and_white_on_dark_ones(data):
    assert ink_for((1.0, 1.0, 0.0, 1.0)) == "k"  # viridis' yellow end
    assert ink_for((0.267, 0.005, 0.329, 1.0)) == "w"  # viridis' purple end
    fig = plots.sweep_heatmap(data.sweep)
    try:
        ax = fig.axes[0]
        (im,) = ax.get_images()
        grid = im.get_array()
        for t in ax.texts:
            x, y = t.get_position()
            cell = grid[int(round(y)), int(round(x))]
            assert matplotlib.colors.to_hex(t.get_color()) == matplotlib.colors.to_hex(
                ink_for(im.cmap(im.norm(cell)))
            )
        assert {matplotlib.colors.to_hex(t.get_color()) for t in ax.texts} <= {
            "#000000",
            "#ffffff",
        }
    finally:
        plt.close(fig)


def test_link_and_gantt_titles_say_which_ranks_they_show(data):
    for fig in (plots.link_utilisation(data.layer), plots.gantt(data.layer, ranks=[0, 1, 2, 3])):
        try:
            assert f"ranks 0-3 of {WL.ep}" in _texts(fig)
        finally:
            plt.close(fig)
    fig = plots.gantt(data.layer)
    try:
        assert f"all {WL.ep} ranks" in _texts(fig)
    finally:
        plt.close(fig)


def test_plots_entry_point_writes_under_build_by_default(tmp_path):
    """``python -m sim.app.plots train-steps`` from another folder writes build/... there, not
    the committed docs/img figure."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), MPLBACKEND="Agg")
    csv = str(measured_path("h200x1-train.csv"))
    cmd = [sys.executable, "-m", "sim.app.plots", "train-steps", "--csv", csv]
    p = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "wrote build/train-step-h200.png" in p.stdout
    assert [q.relative_to(tmp_path).as_posix() for q in tmp_path.rglob("*")] == [
        "build",
        "build/train-step-h200.png",
    ]


def test_the_published_comparison_labels_each_bar_with_its_ratio():
    row = {"model": "sonic-1536x256", "skew": "uniform", "impl": "mine", "tokens_per_rank": 24576,
           "step_us": 1.0, "fwd_tflops": 182.4, "bwd_tflops": 405.0, "hidden": 1536,
           "intermediate": 256, "num_experts": 128, "num_topk": 8}  # fmt: skip
    other = dict(row, tokens_per_rank=4096)  # not the published token count: left out
    fig = plots.published_comparison([row, other], SONIC, "SonicMoE")
    try:
        fwd, bwd = fig.axes
        assert [t.get_text() for t in fwd.texts] == ["365", "182\n0.50x"]
        assert [t.get_text() for t in bwd.texts] == ["405", "405\n1.00x"]
        assert [t.get_text() for t in fwd.get_xticklabels()] == [
            "T 24576, d 1536\nn 256, E 128, K 8"
        ]
    finally:
        plt.close(fig)


@pytest.mark.parametrize(
    ("short", "category"),
    [
        ("mok::bwd_fused_kernel<0>", "experts' GEMMs"),
        ("mok::wgrad_gather_kernel<0, 1>", "experts' GEMMs"),
        (
            "_ZN7cutlass13device_kernelIN2at4cuda6detail25enable_3x_kernel_for_s...",
            "experts' GEMMs",
        ),
        ("mok::dispatch_dedup_pull_kernel", "row dispatch"),
        ("mok::combine_push_kernel<true>", "combine"),
        ("mok::dedup_sum_kernel", "combine"),
        ("mok::schedule_kernel", "schedule"),
        ("mok::zero_padding_kernel", "padding rows"),
        ("at::native::vectorized_elementwise_kernel", "other"),
    ],
)
def test_kernels_fall_into_their_categories(short, category):
    from sim.app.measured_plots import kernel_category

    assert kernel_category(short) == category


def test_the_kernel_breakdown_sums_each_bar():
    fig = plots.kernel_breakdown(KERNEL_ROWS)
    try:
        texts = [t.get_text() for t in fig.axes[0].texts]
        assert " 4.01 ms" in texts and " 3.08 ms" in texts  # the two bars' totals
        assert "2.31" in texts and "0.70" in texts  # segments of at least 4 %
    finally:
        plt.close(fig)
