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


@pytest.fixture(scope="module")
def pinned():
    with open(PINNED, newline="") as f:
        rows = list(csv.DictReader(f))
    recs = validate_rows(rows, load_kernel_profile())
    return rows, recs, summarise(recs)


def test_pinned_sweep_metrics(pinned):
    rows, recs, s = pinned
    v = s["validation"]
    print(
        f"\nvalidation rows {v['n']}: median |err| {100 * v['median_abs_err']:.2f}% max "
        f"{100 * v['max_abs_err']:.2f}%; fit rows {s['fit']['n']}: median "
        f"{100 * s['fit']['median_abs_err']:.2f}% max {100 * s['fit']['max_abs_err']:.2f}%; "
        f"spearman min {s['spearman_min']:.3f}; gap max {100 * s['gap_max']:.2f}%"
    )
    assert s["by_status"] == {"ok": 60, "skipped": 4}  # the DeepEP rows are not ours
    assert v["n"] == 26 and s["fit"]["n"] == 34
    # targets met on the pinned sweep
    assert v["median_abs_err"] <= 0.05
    assert s["spearman_min"] >= 0.9
    # target missed (gap <= 3%): among end-to-end dedup dispatches the sim picks the bulk-copy
    # kernel (414 us) over the vector one (401 us); guard against regressions
    assert s["gap_max"] <= 0.034
    # target missed (max <= 15%): vector dedup_partials at 132 SMs; guard against regressions
    assert v["max_abs_err"] <= 0.24
    worst = max((r for r in recs if r["role"] == "validation"), key=lambda r: abs(r["err"]))
    assert (worst["mode"], worst["engine"], worst["sms"]) == ("dedup_partials", "vector", "132")
    others = [abs(r["err"]) for r in recs if r["role"] == "validation" and r["sms"] != "132"]
    assert max(others) <= 0.13


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
