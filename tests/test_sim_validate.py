"""mok-sim validate: metrics on the pinned measured sweep, Spearman, chosen-vs-best gap, CLI."""

from __future__ import annotations

import csv
import math
from pathlib import Path

import pytest

from sim.cli import main
from sim.phases import KERNELS, kernel_key, load_kernel_profile
from sim.validate import chosen_gap, spearman, summarise, validate_rows

PINNED = Path(__file__).resolve().parents[1] / "sim" / "profiles" / "h200x2-comm-2026-11-30.csv"

HEADER = (
    "model,hidden,num_experts,num_topk,skew,tokens_per_rank,what,impl,mode,engine,scope,sms,"
    "median_us,num_ranks"
)


GRID = PINNED.with_name("h200x2-comm-grid-2026-11-30.csv")


@pytest.fixture(scope="module")
def pinned():
    with open(PINNED, newline="") as f:
        rows = list(csv.DictReader(f))
    recs = validate_rows(rows, load_kernel_profile())
    return rows, recs, summarise(recs)


@pytest.fixture(scope="module")
def grid():
    with open(GRID, newline="") as f:
        rows = list(csv.DictReader(f))
    recs = validate_rows(rows, load_kernel_profile())
    return rows, recs, summarise(recs)


def test_grid_sweep_metrics(grid):
    """The broad grid (both models, 512/4096/16384 tokens, uniform and hot:0.5, 24 SMs): fit rows
    are DeepSeek-V3 uniform at 4096/16384 tokens, everything else is validation."""
    rows, recs, s = grid
    v = s["validation"]
    print(
        f"\ngrid validation rows {v['n']}: median |err| {100 * v['median_abs_err']:.2f}% max "
        f"{100 * v['max_abs_err']:.2f}%; fit rows {s['fit']['n']}; spearman min "
        f"{s['spearman_min']:.3f}; gap max {100 * s['gap_max']:.2f}%"
    )
    assert s["by_status"] == {"ok": 300, "skipped": 72}  # DeepEP and NCCL rows are not ours
    assert v["n"] == 250 and s["fit"]["n"] == 50
    assert s["fit"]["median_abs_err"] <= 0.02
    # every target is MISSED on the grid; guard against regressions with a small margin:
    # median: the host floor differs per Python entry point (dedup_sum ~100 us, others ~145)
    assert v["median_abs_err"] <= 0.075
    # max: pull dispatch/combine at 512 tokens (~300-400 us, not host- or byte-bound) and the
    # bulk-copy engine on Qwen3's 4 KiB rows (slower than the probe's row-issue cost implies)
    assert v["max_abs_err"] <= 0.60
    worst = max((r for r in recs if r["role"] == "validation"), key=lambda r: abs(r["err"]))
    assert (worst["tokens_per_rank"], worst["mode"]) == ("512", "pull")
    assert s["spearman_min"] >= -0.45
    assert s["gap_max"] <= 0.33
    # v3 labels are modelled (remote-only dispatch / fan-out, gather sum, vec+gather e2e)
    assert not s["unsupported"]


def test_pinned_sweep_metrics(pinned):
    """The old single-workload snapshot: DeepSeek-V3 4096 uniform is a fit workload now, so all
    its rows are in-sample (kept as a cheap regression check)."""
    rows, recs, s = pinned
    assert s["by_status"] == {"ok": 60, "skipped": 4}  # the DeepEP rows are not ours
    assert s["validation"]["n"] == 0 and s["fit"]["n"] == 60
    assert s["fit"]["median_abs_err"] <= 0.03
    assert s["spearman_min"] >= 0.9
    assert s["gap_max"] <= 0.01
    # dedup_partials at 132 SMs (local-HBM bound on the full GPU) stays the worst row
    assert s["fit"]["max_abs_err"] <= 0.21
    worst = max(recs, key=lambda r: abs(r["err"]) if r["status"] == "ok" else 0)
    assert (worst["mode"], worst["sms"]) == ("dedup_partials", "132")


def test_spearman_hand_example_and_ties():
    assert spearman([1, 2, 3, 4, 5], [5, 6, 7, 8, 7]) == pytest.approx(0.82078268, rel=1e-6)
    assert spearman([1, 2, 3], [30, 20, 10]) == pytest.approx(-1.0)
    # ties get average ranks: x ranks (1, 2.5, 2.5, 4), y ranks (1, 2, 3, 4)
    assert spearman([1, 2, 2, 3], [1, 2, 3, 4]) == pytest.approx(0.9486833, rel=1e-6)
    assert math.isnan(spearman([1, 1, 1], [1, 2, 3]))


def _toy_csv(tmp_path, lines):
    p = tmp_path / "toy.csv"
    p.write_text(HEADER + "\n" + "\n".join(lines) + "\n")
    return p


def test_chosen_gap_on_toy_csv(tmp_path):
    assert chosen_gap([3.0, 1.0, 2.0], [10.0, 12.0, 11.0]) == (1, 0, pytest.approx(0.2))
    base = "deepseek-v3,7168,256,8,uniform,4096"
    p = _toy_csv(
        tmp_path,
        [
            f"{base},dispatch,mok,pull,tma,end-to-end,8,300.0,2",
            f"{base},dispatch,mok,pull,tma,end-to-end,24,100.0,2",
            # measured best, but the sim predicts 8-SM fan-out slower than 24-SM pull
            f"{base},dispatch,mok,fanout,tma,end-to-end,8,90.0,2",
            f"{base},dispatch,deepep,normal,-,comparable,24,50.0,2",
            f"{base},dispatch,mok,warp_drive,tma,end-to-end,24,1.0,2",
        ],
    )
    with open(p, newline="") as f:
        rows = list(csv.DictReader(f))
    recs = validate_rows(rows, load_kernel_profile())
    assert [r["status"] for r in recs] == ["ok", "ok", "ok", "skipped", "unsupported"]
    s = summarise(recs)
    (g,) = s["groups"]
    assert g["configs"] == 3
    assert g["chosen"] == "mok:pull/tma@24" and g["best"] == "mok:fanout/tma@8"
    assert g["gap"] == pytest.approx(100.0 / 90.0 - 1)
    assert any("warp_drive" in u for u in s["unsupported"])


def test_legacy_labels_and_kernel_table():
    assert kernel_key({"what": "dispatch", "mode": "dedup_pull"})[1] == "dedup_pull+fanout"
    assert kernel_key({"what": "dispatch", "mode": "dedup_pull", "engine": "tma", "scope": "x"})[
        1
    ] == ("dedup_pull")
    prof = load_kernel_profile()
    for spec in KERNELS.values():
        for knob in spec.knobs:
            assert prof.factor(knob) > 0


def test_cli_validate(tmp_path, capsys):
    out_csv, out_png = tmp_path / "pred.csv", tmp_path / "pred.png"
    rc = main(["validate", str(PINNED), "--csv", str(out_csv), "--plot", str(out_png)])
    assert rc == 0
    text = capsys.readouterr().out
    assert "summary" in text and "spearman" in text
    with open(out_csv, newline="") as f:
        got = list(csv.DictReader(f))
    assert len(got) == 64 and {"predicted_us", "role", "status"} <= set(got[0])
    assert out_png.stat().st_size > 0
