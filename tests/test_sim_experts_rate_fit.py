"""mok's own GEMM rates on one H100 (``python -m sim.app.experts_rate_fit``): why the H200's fit
cannot be repeated on the H100's layer CSV, the candidate the experts pieces give (a refit of
the committed rows reproduces the knobs docs/sim-validation.md documents), and its holdout on
the train CSVs (the errors documented there, for which no profile was committed)."""

from __future__ import annotations

import dataclasses
import statistics

import pytest

from sim.app.experts_rate_fit import (
    EXPERTS_CSV,
    FIT_PIECES,
    experts_errors,
    fit_experts_rates,
    main,
    train_errors,
)
from sim.fused.fit import fit_knobs
from sim.fused.model import fused_row
from sim.fused.profile import load_fused_profile
from sim.measured import fused_fit, measured_path, read_rows

START = load_fused_profile("mok-fused-h200x1")
# the candidate (both shapes), as documented
KNOBS = {"gemm_efficiency": 0.895, "tile_fixed_us": 5.2, "operand_tbps": 11.85}


@pytest.fixture(scope="module")
def candidate():
    prof, fit_rows = fit_experts_rates(read_rows(measured_path(EXPERTS_CSV)), START)
    return prof, fit_rows


def test_the_h200_fit_has_one_h100_row_and_cannot_fit_it():
    rows = read_rows(measured_path("h100x1-layer-sonic-1536x256-2026-12-07.csv"))
    assert not [r for r in rows if fused_fit("ep1").matches(r)]
    # the same fit, given the H100's one fused shape: one row, one comm-SM count, one model
    spec = dataclasses.replace(
        fused_fit("ep1"), name="h100", sms={("sonic-1536x256", "dedup_pull"): None}
    )
    fit_rows = [r for r in rows if spec.matches(r)]
    assert len(fit_rows) == 1
    assert fit_knobs(fit_rows, spec)[0] == ("gemm_efficiency",)
    row = fit_rows[0]
    # 5052 us measured; the model stays near half of it over the whole efficiency grid
    for eff in (0.975, 0.6, 0.4):
        assert fused_row(row, START.replace(gemm_efficiency=eff)).layer_us < 0.51 * float(
            row["median_us"]
        )


def test_a_refit_gives_the_documented_candidate(candidate):
    prof, fit_rows = candidate
    assert len(fit_rows) == 10
    assert {r["piece"] for r in fit_rows} == set(FIT_PIECES)
    assert {k: getattr(prof, k) for k in KNOBS} == pytest.approx(KNOBS, abs=1e-9)
    assert prof.fit["mean_abs_log_err"] == pytest.approx(0.1022, abs=5e-4)
    # the other knobs are mok-fused-h200x1's
    assert prof.comm_rate_factor == START.comm_rate_factor


def test_the_candidate_on_the_experts_rows(candidate, tmp_path):
    prof, _ = candidate
    path = tmp_path / "c.json"
    prof.save(path)
    rows = read_rows(measured_path(EXPERTS_CSV))
    errs = {(r["model"], r["piece"], r["impl"]): e for r, e in experts_errors(rows, str(path))}
    fit = [e for (_, p, i), e in errs.items() if i == "mok" and p in FIT_PIECES]
    assert min(fit) == pytest.approx(-0.310, abs=0.005)  # bwd_from_saved at 1536 x 256
    assert max(fit) == pytest.approx(0.175, abs=0.005)  # dW_gate_up at 4096 x 512
    held = [e for (_, p, _i), e in errs.items() if p == "bwd_saved_all"]
    assert min(held) > -0.08 and max(held) < 0.06


def test_the_holdout_on_the_train_rows(candidate, tmp_path):
    prof, _ = candidate
    path = tmp_path / "c.json"
    prof.save(path)
    base, cand = train_errors(None), train_errors(str(path))

    def med(tab, what):
        return statistics.median(abs(e) for k, v in tab.items() if k[2] == what for e in v)

    def span(tab, csv, model):
        v = tab[(csv, model, "bwd")]
        return min(v), max(v)

    ep2 = "h100x1-train-models-ep2-2026-12-07.csv"
    levers = "h100x1-train-sonicmoe-levers-2026-12-07.csv"
    # the backward: SonicMoE's shapes and Qwen3 come closer, DeepSeek-V3 and Kimi-K2 turn slow
    assert med(base, "bwd") == pytest.approx(0.141, abs=0.002)
    assert med(cand, "bwd") == pytest.approx(0.125, abs=0.002)
    assert max(abs(e) for k, v in cand.items() if k[2] == "bwd" for e in v) > 0.38
    assert span(base, ep2, "kimi-k2") == pytest.approx((-0.113, -0.073), abs=0.002)
    assert span(cand, ep2, "kimi-k2") == pytest.approx((0.277, 0.386), abs=0.002)
    assert span(cand, levers, "sonic-1536x256") == pytest.approx((-0.227, -0.145), abs=0.002)
    assert span(cand, levers, "sonic-4096x512") == pytest.approx((0.072, 0.120), abs=0.002)
    # the forward (held out too): median |err| 25.8 % to 7.1 %
    assert med(base, "fwd") == pytest.approx(0.258, abs=0.002)
    assert med(cand, "fwd") == pytest.approx(0.071, abs=0.002)


def test_the_command_runs(capsys, tmp_path):
    main(["--no-train", "--models", "sonic-4096x512", "--save-profile", str(tmp_path / "p.json")])
    out = capsys.readouterr().out
    assert "fitted on 5 rows" in out and "holdout" in out
    assert load_fused_profile(tmp_path / "p.json").fit["num_rows"] == 5
