"""``mok-sim tune --fused``: the fused layer's search space and limits, the emitted config's round
trip through ``mok.MoKConfig.from_json``, the fallback to the unfused model, and the tuner replayed
on the committed fused sweep (CPU only, a few seconds)."""

from __future__ import annotations

import json

import pytest

from sim.app.cli import main
from sim.config import Workload
from sim.fused.profile import load_fused_profile
from sim.fused.tune import fused_limits, fused_space, pick_on_measured, tune_fused
from sim.measured import measured_path, read_rows

SWEEP = measured_path("h200x2-layer-sweep-2026-11-30.csv")
QWEN = ["--shape", "qwen3-30b-a3b", "--tokens", "4096"]


def test_fused_tune_emits_a_config_that_round_trips(tmp_path, capsys):
    from mok.spec.config import MoKConfig

    path = tmp_path / "fused.json"
    assert main(["tune", "--fused", *QWEN, "--top", "3", "--emit-config", str(path)]) == 0
    out = capsys.readouterr().out
    doc = json.loads(path.read_text())
    assert set(doc) == {"format", "config", "workload", "predicted_us", "breakdown"}
    w = doc["workload"]
    assert (w["layer"], w["topology"], w["ep"], w["seed"]) == ("fused", "h200x2", 2, 4096)
    loaded = MoKConfig.from_json(path)  # the file as written
    assert loaded.to_dict()["config"] == doc["config"]  # every field, written by MoKConfig
    assert loaded.dispatch_mode in ("pull", "dedup_pull") and loaded.combine_mode == "push"
    assert loaded.row_tile in (64, 128) and loaded.macrobatch_size == 0
    assert 1 <= loaded.num_comm_sms < 132
    # the table's first row is the emitted config with its prediction
    first = next(ln for ln in out.splitlines() if ln.startswith(" 1 "))
    assert first.split()[1:6] == [
        loaded.dispatch_mode,
        str(loaded.num_comm_sms),
        str(loaded.minibatch_size),
        str(loaded.row_tile),
        f"{doc['predicted_us']:.1f}",
    ]
    assert sum(ln[:2].strip().isdigit() for ln in out.splitlines()) == 3
    assert "of 80 configs" in out  # row tile 2 x dispatch 2 x comm SMs 5 x minibatch 4


def test_fused_tune_searches_and_emits_the_row_tile(tmp_path, capsys):
    """Qwen3 at 4096 tokens: with MMA-bound sub-tiles, 64-row padding (35072 receive rows on rank
    0, 37376 at 128) wins at every config of the grid below; with the committed profile (sub-tiles
    as slow as full tiles, as measured) 128 wins; --row-tile pins one row tile."""
    from mok.spec.config import MoKConfig

    wl = Workload("qwen3-30b-a3b", 4096, 2, "h200x2", "uniform", seed=4096)
    committed = load_fused_profile()
    prof = committed.replace(half_kblock_factor=0.5)
    space = {"num_comm_sms": [16], "minibatch_size": [2048, 4096], "dispatch_mode": ["pull"]}
    rows = tune_fused(wl, prof, space)
    assert [(r["row_tile"], r["minibatch_size"]) for r in rows] == [
        (64, 2048),
        (64, 4096),
        (128, 2048),
        (128, 4096),
    ]
    by = {(r["row_tile"], r["minibatch_size"]): r["layer_us"] for r in rows}
    assert by[(128, 2048)] == pytest.approx(1019.9725587671555, rel=1e-9)  # as before row tile 64
    assert 0.95 < by[(64, 2048)] / by[(128, 2048)] < 0.99
    measured = {
        (r["row_tile"], r["minibatch_size"]): r["layer_us"]
        for r in tune_fused(wl, committed, space)
    }
    assert measured[(64, 2048)] > measured[(128, 2048)] == by[(128, 2048)]
    path = tmp_path / "fused.json"
    args = ["tune", "--fused", *QWEN, "--sms", "16", "--dispatch", "pull", "--minibatch", "2048"]
    assert main([*args, "--emit-config", str(path)]) == 0
    assert MoKConfig.from_json(path).row_tile == 128
    assert json.loads(path.read_text())["predicted_us"] == round(by[(128, 2048)], 3)
    assert main([*args, "--row-tile", "64", "--emit-config", str(path)]) == 0
    out = capsys.readouterr().out
    assert "of 1 configs" in out and MoKConfig.from_json(path).row_tile == 64
    with pytest.raises(ValueError, match=r"row tiles \[32\] are not supported"):
        fused_space({"row_tile": [32]}, 132)


def test_fused_space_respects_the_layer_limits():
    wl = Workload("tiny", 256, 2, "h200x2", "uniform", seed=256)
    prof = load_fused_profile()
    rows = tune_fused(wl, prof, {"num_comm_sms": [8, 131], "minibatch_size": [256, 512]})
    assert len(rows) == 2 * 2 * 2 * 2  # x row tile 64, 128
    assert [r["layer_us"] for r in rows] == sorted(r["layer_us"] for r in rows)
    assert {r["combine_mode"] for r in rows} == {"push"}
    assert fused_space(None, 40)["num_comm_sms"] == (8, 16, 24, 32)  # defaults that fit
    with pytest.raises(ValueError, match=r"1 <= num_comm_sms < 132"):
        fused_space({"num_comm_sms": [0, 16]}, 132)
    with pytest.raises(ValueError, match="multiples of the fused layer's 128-row blocks"):
        fused_space({"minibatch_size": [1000]}, 132)
    with pytest.raises(ValueError, match="pulls its dispatch"):
        fused_space({"dispatch_mode": ["push"]}, 132)


def test_fused_limits_name_what_is_unsupported():
    prof = load_fused_profile()
    assert fused_limits(Workload("deepseek-v3", 512, 8, "hgx-h200"), prof) == []
    why = fused_limits(Workload("gpt-oss-120b", 512, 2, "h200x2"), prof, dtype="mxfp8")
    assert any("hidden % 256 == 0 (found hidden=2880)" in w for w in why)
    assert any("intermediate % 128 == 0 (found 2880)" in w for w in why)
    assert any("bf16" in w for w in why)
    assert any("Hopper" in w for w in fused_limits(Workload("tiny", 256, 8, "hgx-b200"), prof))
    assert any(
        "NVLink domains" in w for w in fused_limits(Workload("tiny", 256, 16, "hgx-h200x2"), prof)
    )
    assert fused_limits(Workload("tiny", 256, 2, "h200x2"), prof, row_tile=64) == []
    why = fused_limits(Workload("tiny", 256, 2, "h200x2"), prof, row_tile=32)
    assert why == ["the fused layer needs row_tile in (64, 128) (found 32)"]


def test_unsupported_shape_falls_back_to_the_unfused_model(tmp_path, capsys):
    from mok.spec.config import MoKConfig

    path = tmp_path / "cfg.json"
    args = ["tune", "--fused", "--shape", "gpt-oss-120b", "--tokens", "512", "--sms", "16"]
    args += ["--minibatch", "512", "--dispatch", "pull", "--jobs", "1", "--quiet"]
    assert main([*args, "--emit-config", str(path)]) == 0
    err = capsys.readouterr().err
    assert "hidden % 256 == 0 (found hidden=2880)" in err
    assert "tuning the unfused layer instead" in err and "fused=False" in err
    doc = json.loads(path.read_text())
    assert doc["workload"]["layer"] == "unfused" and doc["workload"]["fused_unsupported"]
    assert MoKConfig.from_json(path).num_comm_sms == 16


def test_fused_tune_rejects_comm_sms_that_leave_no_workers(capsys):
    assert main(["tune", "--fused", *QWEN, "--sms", "16,132"]) == 2
    assert "leave no GEMM workers" in capsys.readouterr().err


def test_tuner_on_the_fused_sweep():
    # docs/sim-validation.md "Tuner on the fused sweep": the fused model's pick among each
    # group's 12 swept configs vs the measured best (measured medians, us)
    recs = {r["model"]: r for r in pick_on_measured(read_rows(SWEEP), load_fused_profile())}
    assert set(recs) == {"deepseek-v3", "qwen3-30b-a3b"}
    ds, qw = recs["deepseek-v3"], recs["qwen3-30b-a3b"]
    assert ds["configs"] == qw["configs"] == 12
    # DeepSeek-V3: pull at 8 SMs hides its dispatch and 124 workers beat 116
    assert ds["picked"] == ds["best"] == "pull 8 SMs mb 2048" and ds["gap"] == 0.0
    assert ds["best_measured_us"] == 7313.1
    assert qw["picked"] == qw["best"] == "pull 16 SMs mb 2048" and qw["gap"] == 0.0
    assert qw["best_measured_us"] == 1020.7


def test_tuner_on_the_deepseek_reruns():
    # the same pick on both re-runs of the DeepSeek-V3 sweep (held out of the fit)
    for name, best_us in (("rerun1", 7841.5), ("rerun2", 7836.5)):
        path = SWEEP.with_name(f"h200x2-layer-sweep-{name}-2026-11-30.csv")
        (ds,) = pick_on_measured(read_rows(path), load_fused_profile())
        assert ds["picked"] == ds["best"] == "pull 8 SMs mb 2048" and ds["gap"] == 0.0
        assert ds["best_measured_us"] == best_us
