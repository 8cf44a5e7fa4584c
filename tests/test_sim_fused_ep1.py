"""The fused model on one-GPU rows (``mok.bench layer --emulate-ep 2``) and the EP1 fit.

The one-GPU CSV (``h200x1-layer-2026-12-01.csv``, git a8e95d6) ran the per-rank work of EP2:
``num_ranks`` 1, ``num_experts`` the model's / 2, every expert local. The model must simulate
what ran (one rank, the row's experts, local flags), and the EP1 profile
(``sim/profiles/mok-fused-h200x1.json``, fit ``ep1`` of :data:`sim.measured.FUSED_FITS`) is
fitted on its uniform DeepSeek-V3 and Qwen3 rows, the rest held out. The refit runs in a few
seconds (2 fit rows, 2 knobs), so the committed profile is checked to be what the documented
command writes.
"""

from __future__ import annotations

import csv
import json

import pytest

from sim.app.cli import main
from sim.app.validate import summarise, validate_layer_rows
from sim.core.topology import get_topology
from sim.fused.fit import (
    FINE_GRIDS,
    fit_knobs,
    is_profile_fit_row,
    objective,
    profile_fit,
)
from sim.fused.model import _plan, fused_layer, fused_row, row_num_experts
from sim.fused.profile import load_fused_profile
from sim.fused.tune import pick_on_measured
from sim.measured import (
    FUSED_FIT_SMS,
    FUSED_FIT_SOURCES,
    FUSED_FIT_SUBSET,
    FUSED_FITS,
    fused_fit,
    is_fused_fit_row,
    measured_path,
    read_rows,
)

EP1 = measured_path("h200x1-layer-2026-12-01.csv")
LAYER = measured_path("h200x2-layer-2026-11-30.csv")
SWEEP = measured_path("h200x2-layer-sweep-2026-11-30.csv")
EXPERTS = {"deepseek-v3": 128, "kimi-k2": 192, "qwen3-30b-a3b": 64}  # the models' / 2


@pytest.fixture(scope="module")
def ep1_rows():
    return read_rows(EP1)


def _fused(rows, model=None, skew=None):
    return [
        r
        for r in rows
        if r["impl"] == "mok-fused"
        and (model is None or r["model"] == model)
        and (skew is None or r["skew"] == skew)
    ]


def test_emulated_rows_run_their_own_experts_on_one_rank(ep1_rows):
    """A row of --emulate-ep 2 is one rank with the row's num_experts (the model's / 2): the
    DeepSeek-V3 uniform routing (seed 4096) pads its 32768 rows to 40320 (315 row blocks, as the
    traced call of docs/perf-notes.md); the model's 256 experts on one rank would pad to 45440.
    emulated_ep itself is not read."""
    (row,) = _fused(ep1_rows, "deepseek-v3", "uniform")
    assert (row["num_ranks"], row["emulated_ep"], row["num_experts"]) == ("1", "2", "128")
    assert row_num_experts(row) == 128
    _, plan = _plan("deepseek-v3", 4096, 1, "h200x2", "uniform", 128, 4096, 128)
    assert (plan.num_local_experts, int(plan.padded_rows[0])) == (128, 40320)
    _, full = _plan("deepseek-v3", 4096, 1, "h200x2", "uniform", 128, 4096)
    assert int(full.padded_rows[0]) > 40320
    prof = load_fused_profile()
    got = fused_row(row, prof)
    want = fused_layer(
        "deepseek-v3", 4096, 1, "uniform", "dedup_pull", 16, 4096, prof, 128, 4096, 128
    )
    assert got == want
    assert (
        got.layer_us
        < fused_layer(
            "deepseek-v3", 4096, 1, "uniform", "dedup_pull", 16, 4096, prof, 128, 4096
        ).layer_us
    )
    assert fused_row({**row, "emulated_ep": "4"}, prof) == got
    # the model's own experts, given or not, are one case
    assert fused_layer(
        "deepseek-v3", 4096, 2, "uniform", "dedup_pull", 16, 4096, prof, num_experts=256
    ) == fused_layer("deepseek-v3", 4096, 2, "uniform", "dedup_pull", 16, 4096, prof)
    with pytest.raises(ValueError, match="num_experts=3 must be >= its top-8"):
        fused_layer("deepseek-v3", 4096, 1, "uniform", "pull", 16, 4096, prof, num_experts=3)
    with pytest.raises(ValueError, match="a multiple of num_ranks=2"):
        fused_layer("deepseek-v3", 4096, 2, "uniform", "pull", 16, 4096, prof, num_experts=129)


def test_one_rank_has_local_flags_and_no_remote_bytes(ep1_rows):
    """At EP1 the staged-x and slots-filled signals are this GPU's own flags, and no row moves
    over NVLink: pull and dedup_pull copy the same local rows; dedup_pull adds only the barrier
    after its (empty) remote pull, one local flag."""
    gpu = get_topology("h200x2").gpu
    prof = load_fused_profile()
    (row,) = _fused(ep1_rows, "qwen3-30b-a3b", "uniform")
    r1 = fused_row(row, prof)
    assert r1.terms["signal_us"] == gpu.flag_latency_local_us
    pull = fused_row({**row, "mode": "pull"}, prof)
    assert r1.layer_us - pull.layer_us == pytest.approx(gpu.flag_latency_local_us, abs=0.01)
    r2 = fused_layer("qwen3-30b-a3b", 4096, 2, "uniform", "dedup_pull", 16, 4096, prof)
    assert r2.terms["signal_us"] == gpu.flag_latency_remote_us > gpu.flag_latency_local_us
    # remote_rate_factor has nothing to act on at one rank
    assert fused_row(row, prof.replace(remote_rate_factor=0.2)) == r1


def test_aligned_routing_on_one_rank():
    """aligned: DeepSeek-V3 (128 experts: 256 rows each) and Qwen3 (64: 512 each) have no padding
    rows; Kimi-K2's 192 experts get 170 or 171 rows each, padded to 256 like every uniform
    expert (133-209 rows), so the model predicts aligned = uniform there."""
    for model, rows in (("deepseek-v3", 32768), ("qwen3-30b-a3b", 32768), ("kimi-k2", 49152)):
        _, plan = _plan(model, 4096, 1, "h200x2", "aligned", 128, 4096, EXPERTS[model])
        assert int(plan.padded_rows[0]) == rows
    _, uni = _plan("kimi-k2", 4096, 1, "h200x2", "uniform", 128, 4096, 192)
    assert int(uni.padded_rows[0]) == 49152
    prof = load_fused_profile("mok-fused-h200x1")
    args = (4096, 1, "dedup_pull", 16, 4096, prof, 128, 4096)

    def at(model, skew):
        return fused_layer(model, args[0], args[1], skew, *args[2:], num_experts=EXPERTS[model])

    assert at("kimi-k2", "aligned").layer_us == at("kimi-k2", "uniform").layer_us
    assert at("deepseek-v3", "aligned").layer_us < 0.86 * at("deepseek-v3", "uniform").layer_us


def test_row_shape_must_be_the_presets(ep1_rows):
    (row,) = _fused(ep1_rows, "kimi-k2", "uniform")
    assert row_num_experts({k: v for k, v in row.items() if k != "num_experts"}) is None
    with pytest.raises(ValueError, match="the row's hidden is 4096, the preset's 7168"):
        row_num_experts({**row, "hidden": "4096"})
    (rec,) = validate_layer_rows([{**row, "num_topk": "6"}], load_fused_profile())
    assert rec["status"] == "unsupported" and "num_topk" in rec["reason"]


def test_fused_fits_one_place():
    """FUSED_FITS maps each fused profile to its fit; the two-GPU one is the legacy constants."""
    ep2, ep1 = fused_fit("ep2"), fused_fit("ep1")
    assert fused_fit() is ep2 is fused_fit("mok-fused-h200x2") is FUSED_FITS["mok-fused-h200x2"]
    assert ep1 is fused_fit("mok-fused-h200x1")
    assert (ep2.sms, ep2.sources, ep2.subset) == (
        FUSED_FIT_SMS,
        FUSED_FIT_SOURCES,
        FUSED_FIT_SUBSET,
    )
    assert (ep2.num_ranks, ep1.num_ranks, ep1.sources, ep1.base) == (2, 1, None, ep2.profile)
    with pytest.raises(ValueError, match="unknown fused fit 'ep3'; the fits: ep2"):
        fused_fit("ep3")
    # the two-GPU subset is untouched: 16 fit rows there, none of the one-GPU file
    two = read_rows(LAYER, SWEEP)
    assert sum(map(is_fused_fit_row, two)) == 16
    assert not any(is_fused_fit_row(r, "ep1") for r in two)  # two ranks
    one = read_rows(EP1)
    assert not any(map(is_fused_fit_row, one))
    fit = [r for r in one if is_fused_fit_row(r, ep1)]
    assert sorted((r["model"], r["skew"]) for r in fit) == [
        ("deepseek-v3", "uniform"),
        ("qwen3-30b-a3b", "uniform"),
    ]
    # sources: any CSV for the fit, the recorded ones afterwards; no source: by content
    other = {**fit[0], "_source": "h200x1-layer-later.csv"}
    assert is_fused_fit_row(other, ep1)
    assert not is_fused_fit_row(other, ep1, sources=[EP1.name])
    no_source = {k: v for k, v in other.items() if k != "_source"}
    assert is_fused_fit_row(no_source, ep1, sources=[EP1.name])


def test_fit_knobs_are_what_the_rows_identify(ep1_rows):
    ep1 = fused_fit("ep1")
    fit = [r for r in ep1_rows if ep1.matches(r)]
    knobs, fixed = fit_knobs(fit, ep1)
    assert knobs == ("gemm_efficiency", "tile_fixed_us")
    assert list(fixed) == ["operand_tbps", "comm_rate_factor", "remote_rate_factor"]
    more = fit + [{**r, "sms": "8"} for r in fit]
    knobs, fixed = fit_knobs(more, ep1)
    assert knobs == ("gemm_efficiency", "tile_fixed_us", "operand_tbps", "comm_rate_factor")
    assert list(fixed) == ["remote_rate_factor"]
    knobs, fixed = fit_knobs([r for r in more if r["model"] == "qwen3-30b-a3b"], ep1)
    assert "tile_fixed_us" in fixed and "gemm_efficiency" in knobs
    two = [r for r in read_rows(LAYER, SWEEP) if is_fused_fit_row(r)]
    assert fit_knobs(two, fused_fit("ep2")) == (
        (
            "gemm_efficiency",
            "tile_fixed_us",
            "operand_tbps",
            "comm_rate_factor",
            "remote_rate_factor",
        ),
        {},
    )


# the committed EP1 profile's figures by the CSV it was fitted on (|err|: fit rows n / max,
# validation rows n / median / max; the two-GPU profile's median on all the CSV's rows is above
# the last figure), so that a refit on a new file (same command) only needs its line here.
# h200x1-layer-step2-2026-12-01.csv (git 7cabc14, 4 / 8 / 16 comm SMs) and h200x1-layer.csv
# (git e004fb6, the same run after the shared-memory tile lookups): the figures of their refits.
EP1_PINS = {
    "h200x1-layer-2026-12-01.csv": ((2, 0.003), (7, 0.030, 0.085), 0.04),
    "h200x1-layer-step2-2026-12-01.csv": ((6, 0.087), (21, 0.017, 0.137), 0.025),
    "h200x1-layer.csv": ((6, 0.092), (21, 0.020, 0.143), 0.025),
}


def _committed_ep1():
    prof = load_fused_profile("mok-fused-h200x1")
    (src,) = prof.fit["sources"]
    return prof, src, read_rows(measured_path(src))


def test_committed_ep1_profile():
    """The EP1 profile: fitted on the uniform rows of DeepSeek-V3 and Qwen3 of its CSV; the knobs
    its rows cannot identify (:func:`sim.fused.fit.fit_knobs`) at the two-GPU profile's values.
    On h200x1-layer-2026-12-01.csv: 2 rows at 16 comm SMs, so 2 knobs (gemm_efficiency,
    tile_fixed_us) that match them (0.2 % and 0.0 %); held out (7 rows): median 2.9 %, max 8.3 %
    (Kimi-K2 uniform, whose p20-p80 band is 29 % wide)."""
    prof, src, rows = _committed_ep1()
    two = load_fused_profile()
    spec, srcs = profile_fit(prof)
    assert (spec.name, srcs) == ("ep1", (src,))
    fit = [r for r in rows if is_profile_fit_row(r, prof)]
    assert len(fit) == prof.fit["num_rows"]
    knobs, fixed = fit_knobs(fit, spec)
    assert (list(knobs), prof.fit["fixed"]) == (prof.fit["knobs"], fixed)
    assert "remote_rate_factor" in fixed
    for k in fixed:
        assert getattr(prof, k) == getattr(two, k)
    for k in ("comm_profile", "topology", "half_kblock_factor", "half_fixed_factor"):
        assert getattr(prof, k) == getattr(two, k)
    assert prof.fit_subset.startswith(spec.subset) and src in prof.source
    best = objective(fit, prof)
    assert best == pytest.approx(prof.fit["objective"], abs=1e-4)
    for k in knobs:  # a local minimum on the fine grids
        grid = list(FINE_GRIDS[k])
        i = grid.index(getattr(prof, k))
        for j in (i - 1, i + 1):
            if 0 <= j < len(grid):
                assert objective(fit, prof.replace(**{k: float(grid[j])})) >= best
    assert src in EP1_PINS, f"refitted on {src}: add its figures to EP1_PINS"
    (n_fit, fit_max), (n_val, val_med, val_max), ep2_med = EP1_PINS[src]
    s = summarise(validate_layer_rows(rows, prof))
    assert s["fit"]["n"] == n_fit and s["fit"]["max_abs_err"] <= fit_max
    assert s["validation"]["n"] == n_val
    assert s["validation"]["median_abs_err"] <= val_med
    assert s["validation"]["max_abs_err"] <= val_max
    # the two-GPU profile on the same rows (all held out) is further off
    s2 = summarise(validate_layer_rows(rows, two))
    assert s2["fit"]["n"] == 0 and s2["validation"]["median_abs_err"] > ep2_med


def test_refit_command_writes_the_committed_profile(tmp_path, capsys):
    """`mok-sim validate <one-GPU CSV> --refit --fused-fit ep1 --save-profile P` starts from
    the two-GPU profile and writes sim/profiles/mok-fused-h200x1.json (a few seconds on the
    2 fit rows of h200x1-layer-2026-12-01.csv, about 25 s on the 6 of h200x1-layer.csv)."""
    _, src, _ = _committed_ep1()
    out = tmp_path / "ep1.json"
    path = str(measured_path(src))
    rc = main(["validate", path, "--refit", "--fused-fit", "ep1", "--save-profile", str(out)])
    assert rc == 0
    text = capsys.readouterr().out
    assert "starting from mok-fused-h200x2" in text
    assert "remote_rate_factor not fitted" in text
    assert load_fused_profile(out) == load_fused_profile("mok-fused-h200x1")
    assert json.loads(out.read_text())["fit"]["sources"] == [src]


def test_validate_picks_the_profile_of_the_fit(tmp_path, capsys):
    _, src, _ = _committed_ep1()
    (n_fit, _), (n_val, _, _), _ = EP1_PINS[src]
    pred = tmp_path / "pred.csv"
    path = str(measured_path(src))
    assert main(["validate", path, "--fused-fit", "ep1", "--csv", str(pred)]) == 0
    text = capsys.readouterr().out
    assert "profile mok-fused-h200x1 fitted on" in text and "note:" not in text
    with open(pred, newline="") as f:
        got = [r for r in csv.DictReader(f) if r["status"] == "ok"]
    assert sorted(r["role"] for r in got) == ["fit"] * n_fit + ["validation"] * n_val
    # EP1 rows against the two-GPU profile: said, and every row held out
    assert main(["validate", str(EP1)]) == 0
    text = capsys.readouterr().out
    assert "note: the fused rows ran at EP1 and profile mok-fused-h200x2 was fitted at EP2" in text
    assert "--fused-fit ep1" in text


def test_tuner_replay_on_one_gpu_rows(ep1_rows):
    recs = pick_on_measured(ep1_rows, load_fused_profile("mok-fused-h200x1"))
    assert len(recs) == 9 and {r["num_ranks"] for r in recs} == {1}
    assert all(r["configs"] == 1 and r["gap"] == 0 for r in recs)
