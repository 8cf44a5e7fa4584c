"""mok-sim validate on the training-step measurements (``mok.bench train``): the train CSV read
as its own kind (never as a layer CSV), the layer model's workload and config of a train row,
the records of a tiny synthetic CSV, and the CLI on the committed ``h200x1-train.csv`` (the
documented errors: on the first run, ``h200x1-train-first-2026-12-01.csv``)."""

from __future__ import annotations

import csv
import math
import re

import pytest

from mok.spec.workload import get_shape
from sim.app.cli import main
from sim.app.validate import (
    TRAIN_MOK_IMPLS,
    row_topology,
    summarise_train,
    train_model_config,
    train_piece_flops,
    validate_train_rows,
)
from sim.core.topology import get_topology
from sim.measured import is_layer_csv, is_train_csv, measured_path, read_measured, read_rows

TRAIN = measured_path("h200x1-train.csv")
FIRST = measured_path("h200x1-train-first-2026-12-01.csv")  # before mok-saved; docs' errors
LAYER = measured_path("h200x1-layer.csv")


# -- reading -------------------------------------------------------------------------------------
def test_the_train_csv_is_its_own_kind():
    kind, rows = read_measured(TRAIN)
    assert kind == "train" and len(rows) == 48 and is_train_csv(rows)
    assert not is_layer_csv(rows) and not is_layer_csv(read_rows(TRAIN))
    assert {r["_source"] for r in rows} == {"h200x1-train.csv"}
    kind, rows = read_measured(LAYER)
    assert kind == "layer" and is_layer_csv(rows) and not is_train_csv(rows)


def test_a_train_csv_with_layer_columns_is_still_a_train_csv(tmp_path):
    """Even with a ``minibatch`` column (a layer CSV's mark) the step times make it a train
    CSV: the layer readers never score its rows against a layer time."""
    text = TRAIN.read_text().splitlines()
    path = tmp_path / "t.csv"
    path.write_text("\n".join([text[0] + ",minibatch", *(r + ",4096" for r in text[1:])]) + "\n")
    kind, rows = read_measured(path)
    assert kind == "train" and not is_layer_csv(rows) and is_train_csv(rows)


# -- the layer model's workload and config of a train row -----------------------------------------
def _row(impl="mok-fused", sms=8, **kw) -> dict:
    """A train row as mok.bench train writes it (strings), times made up."""
    row = dict(model="tiny", hidden="256", intermediate="128", num_experts="8", num_topk="4")
    row.update(skew="uniform", tokens_per_rank="256", routing_seed="256", emulated_ep="2")
    row.update(impl=impl, mode="dedup_pull" if impl.startswith("mok") else "eager", sms=str(sms))
    row.update(fwd_us="100.0", bwd_us="250.0", step_us="350.0", p20_us="340.0", p80_us="360.0")
    row.update(gpu="NVIDIA H200", num_ranks="1")
    return {**row, **{k: str(v) for k, v in kw.items()}}


def test_train_model_config_of_a_committed_row():
    (row,) = [
        r
        for r in read_rows(TRAIN)
        if (r["model"], r["skew"], r["impl"], r["sms"])
        == ("deepseek-v3", "uniform", "mok-fused", "8")
    ]
    wl, plan, fwd, bwd = train_model_config(row)
    assert (wl.shape, wl.ep, wl.topology, wl.tokens_per_rank, wl.seed) == (
        "deepseek-v3",
        1,
        "h200x2",
        4096,
        4096,
    )
    # the per-rank work of EP2: the row's 128 experts, all local, every routed row on this GPU
    assert (plan.num_ranks, plan.num_local_experts, int(plan.expert_counts.sum())) == (
        1,
        128,
        4096 * 8,
    )
    assert (fwd.direction, fwd.num_comm_sms, fwd.dispatch_mode, fwd.minibatch_size) == (
        "forward",
        8,
        "dedup_pull",
        4096,
    )
    # the whole receive buffer: 2 x 4096 x 8 rows + 128 experts x 127 padding, in minibatches
    assert (
        fwd.macrobatch_size == bwd.macrobatch_size == -(-(2 * 4096 * 8 + 128 * 127) // 4096) * 4096
    )
    # mok's serial backward: rows copied (intermediate 2048 > 256), mok's epilogue bytes
    assert (bwd.direction, bwd.recompute, bwd.serial_backward, bwd.gather_backward) == (
        "backward",
        True,
        True,
        False,
    )
    assert bwd.swiglu_bwd_bytes_per_elem == 6.0
    # the design (--design-backward): the forward's config on 24 comm SMs, the design's bytes
    _, _, fwd_d, design = train_model_config(row, design=True)
    assert fwd_d == fwd and (design.direction, design.num_comm_sms) == ("backward", 24)
    assert (design.serial_backward, design.swiglu_bwd_bytes_per_elem) == (False, 8.0)
    assert design.replace(direction="forward", recompute=False, num_comm_sms=8) == fwd
    assert bwd == design.replace(
        serial_backward=True, gather_backward=False, swiglu_bwd_bytes_per_elem=6.0
    )
    _, _, f2, b2 = train_model_config(row, "mok-fused-h200x1")
    assert f2.gemm_profile == b2.gemm_profile == "mok-fused-h200x1"
    # a run that forced the gather (mok.autograd.GATHER_BACKWARD = True): no row copies
    assert train_model_config(row, gather=True)[3].gather_backward


def test_a_row_runs_on_the_gpu_it_ran_on():
    """The one rank's topology, and so its GPU profile, is the row's GPU (its gpu column): an
    H100 row hgx-h100's first GPU, an H200 row (or one of another GPU, or without the column)
    h200x2's; the rest of the config does not depend on it."""
    got = {}
    for gpu, topo in (
        ("NVIDIA H100 80GB HBM3", "hgx-h100"),
        ("NVIDIA H200", "h200x2"),
        ("NVIDIA B200", "h200x2"),
        ("", "h200x2"),
    ):
        row = _row(gpu=gpu)
        assert row_topology(row) == topo
        wl, plan, fwd, bwd = train_model_config(row)
        assert wl.topology == topo and wl.ep == 1
        got[gpu] = (plan.expert_counts.tolist(), fwd, bwd)
    assert len({repr(v) for v in got.values()}) == 1
    assert get_topology("hgx-h100").gpu.name == "h100" and get_topology("h200x2").gpu.name == "h200"
    assert row_topology({"model": "tiny"}) == "h200x2"


def test_the_topology_alone_barely_moves_a_one_rank_prediction():
    """At EP1 the topology's links carry no rows: the committed H200 train CSV predicted on
    hgx-h200 instead of h200x2 (both H200) moves each prediction by under 0.1 % (measured at most
    0.07 %), so an H100 row on hgx-h100 differs from an H200 one by its GPU profile."""
    from unittest import mock

    import sim.app.validate as v

    rows = read_rows(TRAIN)
    base = {(r["row"], r["what"]): r["predicted_us"] for r in validate_train_rows(rows)}
    with mock.patch.dict(v.ROW_TOPOLOGIES, {"h200": "hgx-h200"}):
        other = validate_train_rows(rows)
    moved = [
        r["predicted_us"] / base[(r["row"], r["what"])] - 1 for r in other if r["status"] == "ok"
    ]
    assert len(moved) == 84 and max(map(abs, moved)) < 1e-3


def test_saving_rows_differ_in_recompute_and_in_the_weight_gradients_depth():
    """mok-saved and mok-fused-saved: no recompute; mok-fused-saved's backward steps each
    expert's weight gradients over its region padded to the row tile (the others at 16), so the
    model gives it the longer weight gradients on the same routing, and mok-fused's forward."""
    from sim.layer.model import simulate

    got = {i: train_model_config(_row(i, 8 if "fused" in i else 132)) for i in TRAIN_MOK_IMPLS}
    steps = {i: (b.recompute, b.wgrad_depth_step, f is None) for i, (_, _, f, b) in got.items()}
    assert steps == {
        "mok-unfused": (True, 16, True),
        "mok-saved": (False, 16, True),
        "mok-fused": (True, 16, False),
        "mok-fused-saved": (False, 128, False),
    }
    assert got["mok-fused"][2] == got["mok-fused-saved"][2]
    wl, plan, _, saved = got["mok-saved"]
    fused_saved = got["mok-fused-saved"][3]
    assert fused_saved == saved.replace(wgrad_depth_step=128)
    assert simulate(wl, fused_saved, plan).wgrad_us > simulate(wl, saved, plan).wgrad_us


def test_train_model_config_refuses_what_it_does_not_model():
    wl, plan, fwd, bwd = train_model_config(_row("mok-unfused", 132))
    assert fwd is None and bwd.num_comm_sms == 24 and plan.num_local_experts == 8
    with pytest.raises(ValueError, match="not a mok row"):
        train_model_config(_row("torch-best", 0))
    with pytest.raises(ValueError, match="runs on one GPU"):
        train_model_config(_row(num_ranks=2))
    with pytest.raises(ValueError, match="hidden is 512"):
        train_model_config(_row(hidden=512))


# -- records of a tiny synthetic CSV ------------------------------------------------------------
def _write(path, rows) -> None:
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)


def test_records_of_a_tiny_train_csv(tmp_path):
    path = tmp_path / "train.csv"
    rows = [
        _row("torch-best", 0, fwd_us=80, bwd_us=200, step_us=280),
        _row("mok-unfused", 132, fwd_us=90, bwd_us=240, step_us=330),
        _row("mok-fused", 8),
        _row("mok-fused", 16, fwd_us=95, bwd_us=255, step_us=350),
        _row("mok-fused", 8, model="no-such-model"),
    ]
    _write(path, rows)
    kind, read = read_measured(path)
    assert kind == "train"
    recs = validate_train_rows(read)
    assert len(recs) == 3 * len(rows)
    by = {(r["row"], r["what"]): r for r in recs}
    assert [r["what"] for r in recs[:3]] == ["fwd", "bwd", "step"]
    for q in ("fwd", "bwd", "step"):
        assert by[(0, q)]["status"] == "baseline" and "torch-best" in by[(0, q)]["reason"]
        assert by[(4, q)]["status"] == "unsupported" and "no-such-model" in by[(4, q)]["reason"]
        assert by[(0, q)]["measured_us"] == float(rows[0][f"{q}_us"])
    # mok-unfused: its backward predicted, its forward (and so its step) not modelled
    assert by[(1, "bwd")]["status"] == "ok"
    assert by[(1, "fwd")]["status"] == by[(1, "step")]["status"] == "baseline"
    assert "one after another" in by[(1, "fwd")]["reason"]
    for i in (2, 3):
        f, b, s = (by[(i, q)] for q in ("fwd", "bwd", "step"))
        assert f["status"] == b["status"] == s["status"] == "ok"
        assert s["predicted_us"] == pytest.approx(f["predicted_us"] + b["predicted_us"])
        for r in (f, b, s):
            assert r["role"] == "validation"
            assert r["err"] == pytest.approx(r["predicted_us"] / r["measured_us"] - 1)
            assert sum(
                r[k] for k in ("gemm_us", "exposed_comm_us", "signalling_us", "schedule_us")
            ) == pytest.approx(r["predicted_us"])
        assert f["sim_sms"] == rows[i]["sms"] and b["sim_sms"] == "serial"
        assert s["sim_sms"] == f"{rows[i]['sms']}+serial"
        # only the step's p20 / p80 are measured
        assert math.isnan(f["p20_us"]) and s["p20_us"] == 340.0
        assert b["wgrad_us"] > 0 and f["wgrad_us"] == 0.0
    # one backward whatever the forward: the same prediction for every mok row of the group
    assert (
        by[(1, "bwd")]["predicted_us"]
        == by[(2, "bwd")]["predicted_us"]
        == by[(3, "bwd")]["predicted_us"]
    )
    pieces = {k: v for k, v in by[(2, "bwd")].items() if k.startswith("piece_")}
    assert sorted(pieces) == sorted(f"piece_{k}_us" for k in train_piece_flops(rows[2]))
    assert 0 < sum(pieces.values()) <= by[(2, "bwd")]["predicted_us"]
    s = summarise_train(recs)
    assert s["rows"] == 5 and s["by_status"] == {"baseline": 5, "ok": 7, "unsupported": 3}
    assert [s["quantities"][q]["n"] for q in ("fwd", "bwd", "step")] == [2, 3, 2]
    assert s["ranking"]["bwd"]["groups"] == 0  # one prediction: nothing to rank
    assert s["ranking"]["fwd"]["groups"] == s["ranking"]["step"]["groups"] == 1
    assert validate_train_rows(read) == recs  # deterministic


def test_piece_flops_are_the_forward_gemms_twice_plus_the_recompute():
    row = _row()
    shape = get_shape("tiny")
    fwd = 256 * 4 * 6 * 256 * 128 + 256 * 6 * 256 * 128  # routed + shared forward GEMMs
    recompute = 256 * 4 * 4 * 256 * 128 + 256 * 4 * 256 * 128
    got = train_piece_flops(row)
    assert sum(got.values()) == 2 * fwd + recompute
    assert got["shared"] == 256 * 16 * shape.hidden * shape.shared_intermediate


# -- the CLI on the committed CSV -----------------------------------------------------------------
def _numbers(line: str) -> list[float]:
    return [float(x) for x in re.findall(r"-?\d+\.\d+(?=%)", line)]


@pytest.mark.parametrize("gemm_profile", [None, "mok-fused-h200x1"])
def test_cli_validates_the_committed_train_csv(tmp_path, capsys, gemm_profile):
    out, plot = tmp_path / "pred.csv", tmp_path / "pred.png"
    argv = ["validate", str(TRAIN), "--csv", str(out), "--plot", str(plot)]
    argv += ["--gemm-profile", gemm_profile] if gemm_profile else []
    assert main(argv) == 0
    text = capsys.readouterr().out
    assert (
        "mok's backward as it runs at one rank" in " ".join(text.split())
        and f"{TRAIN}: 48 rows" in text
    )
    assert ("mok-fused-h200x1" in text) == bool(gemm_profile)
    overall = {
        line.split()[0]: _numbers(line)[:2]
        for line in text.splitlines()
        if re.match(r"  (fwd|bwd|step) +\d+ ", line)
    }
    assert list(overall) == ["fwd", "bwd", "step"]
    for med, top in overall.values():
        assert math.isfinite(med) and math.isfinite(top) and 0 <= med <= top
    assert "torch-best:eager" in text and "baselines (measured, not predicted" in text
    with open(out, newline="") as f:
        recs = list(csv.DictReader(f))
    assert len(recs) == 144 and plot.stat().st_size > 0
    ok = [r for r in recs if r["status"] == "ok"]
    assert len(ok) == 84 and all(math.isfinite(float(r["err"])) for r in ok)
    base = {r["impl"] for r in recs if r["status"] == "baseline"}
    assert base == {"torch-best", "mok-unfused", "mok-saved"}
    # mok-saved: its backward predicted (no routed recompute), its forward and step not
    saved = {r["what"]: r["status"] for r in recs if r["impl"] == "mok-saved"}
    assert saved == {"fwd": "baseline", "bwd": "ok", "step": "baseline"}
    # mok-fused-saved: the fused forward, its backward without the routed recompute, all three
    assert {r["status"] for r in recs if r["impl"] == "mok-fused-saved"} == {"ok"}


def test_the_documented_errors():
    """docs/sim-validation.md, 'Layer model: the backward against the train benchmark': |err|
    median / max per quantity at the standalone and at the EP1 megakernel GEMM rates, on the
    first run (30 rows) and on the committed run with mok-saved and mok-fused-saved (48 rows),
    the backward by the fused design (``--design-backward``, validate's backward before the
    serial one)."""
    rows = read_rows(FIRST)
    want = {
        None: {"fwd": (0.205, 0.256), "bwd": (0.219, 0.303), "step": (0.213, 0.278)},
        "mok-fused-h200x1": {"fwd": (0.075, 0.142), "bwd": (0.048, 0.094), "step": (0.042, 0.106)},
    }
    # the backward's figures moved on 2026-12-06 (the x rows' second pull, the dedup reverse
    # dispatch, the router-weight gradient; docs/sim-validation.md, note under the first table)
    now = {
        None: {"fwd": (0.282, 0.332), "bwd": (0.156, 0.280), "step": (0.180, 0.272)},
        "mok-fused-h200x1": {"fwd": (0.065, 0.192), "bwd": (0.102, 0.171), "step": (0.067, 0.117)},
    }
    for csv_rows, table in ((rows, want), (read_rows(TRAIN), now)):
        for prof, by_q in table.items():
            s = summarise_train(validate_train_rows(csv_rows, prof, design=True))
            for q, (med, top) in by_q.items():
                got = s["quantities"][q]
                assert got["median_abs_err"] == pytest.approx(med, abs=0.001), (prof, q)
                assert got["max_abs_err"] == pytest.approx(top, abs=0.001), (prof, q)


@pytest.mark.parametrize(
    ("extra", "why"),
    [
        (["--refit"], "a train CSV has nothing to refit"),
        (["--fused-fit", "ep1"], "--fused-profile / --fused-fit apply to layer CSVs"),
        (["--layer-model"], "a train CSV is always predicted by the layer model"),
        ([str(LAYER)], "mix of layer CSVs (mok.bench layer / sweep) and train CSVs"),
    ],
)
def test_cli_refusals_on_a_train_csv(extra, why, capsys):
    assert main(["validate", str(TRAIN), *extra]) == 2
    assert why in capsys.readouterr().err


# -- the figure -----------------------------------------------------------------------------------
def test_the_train_steps_figure_shows_each_implementations_fastest_step():
    """sim.app.plots.train_steps on the committed CSV: a panel per (skew, model), a forward and a
    backward bar per implementation whose sum is its fastest step, labelled with that time."""
    from sim.app.plots import train_steps

    rows = read_rows(TRAIN)
    fastest: dict[tuple, float] = {}
    for r in rows:
        key = (r["model"], r["skew"], r["impl"])
        fastest[key] = min(fastest.get(key, math.inf), float(r["step_us"]) / 1e3)
    impls = list(dict.fromkeys(r["impl"] for r in rows))
    axes = train_steps(rows, target=1.5).get_axes()
    assert len(axes) == len({k[:2] for k in fastest}) == 6
    for ax in axes:
        model, skew = ax.get_title().split(", ")
        want = [fastest[(model, skew, impl)] for impl in impls]
        assert len(ax.patches) == 2 * len(impls)  # forward and backward of each
        tops = [b.get_y() + b.get_height() for b in ax.patches if b.get_y() > 0]
        assert tops == pytest.approx(want, abs=0.002)  # fwd + bwd = step, to the CSV's rounding
        assert [t.get_text().split("\n")[0] for t in ax.texts] == [f"{w:.1f} ms" for w in want]
