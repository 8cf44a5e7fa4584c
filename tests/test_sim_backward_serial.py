"""mok's backward as it runs at one rank in the simulator (sim.layer.backward, the serial
backward, SimConfig.serial_backward): its chain in closed form, its config checks, validate's
train rows on it, and the piece-by-piece comparison with a train run's kernel profile
(sim.app.bwd_pieces) on the committed one-H100 files."""

from __future__ import annotations

import pytest

from mok.spec.workload import get_shape
from sim.app.bwd_pieces import classify, compare, main, measured_pieces, model_pieces
from sim.app.validate import (
    MOK_SWIGLU_BWD_BYTES,
    TRAIN_GATHER_MAX_INTER,
    summarise_train,
    train_model_config,
    validate_train_rows,
)
from sim.config import SimConfig, Workload
from sim.core.gemm import reduce_us
from sim.core.gemm_waves import round_times
from sim.layer.backward import REV_COMBINE_ROWS, backward_config
from sim.layer.model import BackwardBuilder, forward_backward, plan_for, simulate
from sim.measured import measured_path, read_rows

# one rank of an H100 with Qwen3-30B's experts
QWEN = Workload("qwen3-30b-a3b", 2048, 1, "hgx-h100", "hot:0.3", 5)
SERIAL = backward_config(SimConfig(dispatch_mode="dedup_pull"), recompute=True).replace(
    serial_backward=True
)
KERNELS = "experiments/h100x1-train-sonicmoe-levers-gbwd-b1b8a5b-kernels.csv"
LEVERS = measured_path("h100x1-train-sonicmoe-levers-2026-12-07.csv")


def _run(wl: Workload, cfg: SimConfig):
    plan = plan_for(wl, cfg.row_tile)
    return simulate(wl, cfg, plan), BackwardBuilder(wl, cfg, plan)


@pytest.mark.parametrize("gather", [False, True])
@pytest.mark.parametrize("recompute", [False, True])
def test_the_serial_backward_is_its_pieces_one_after_another(gather, recompute):
    """The prediction is the schedule, the dY and x copies (none when gathered) at the probe's
    local copy rate of every SM, each GEMM from its standalone fill to its last tile on every SM,
    and the one-pass combine (every (token, k) row read, every token written), summed."""
    cfg = SERIAL.replace(recompute=recompute, gather_backward=gather)
    res, b = _run(QWEN, cfg)
    gpu, shape = b.gpu, b.shape
    assert b.compute_sms == gpu.num_sms == 132
    rows = QWEN.tokens_per_rank * shape.num_topk
    copy = rows * shape.hidden * 2.0 / (gpu.curve("local_tma").gbps(132) * 1e3)
    copy += gpu.local_load_latency_us
    pieces = b.piece_us()
    names = ["down_dgrad", "gate_up_dgrad", "dw_down", "dw_gate_up", "shared"]
    assert list(pieces) == (["recompute"] if recompute else []) + names
    # the design's schedule task: base, the two handshakes, per row
    sched = cfg.schedule_base_us + b.handshake_us(0) + b.handshake_us(1)
    sched += rows * cfg.schedule_ns_per_row / 1e3
    combine = reduce_us(gpu, rows, QWEN.tokens_per_rank, shape.hidden)
    want = sched + (0.0 if gather else REV_COMBINE_ROWS * copy) + sum(pieces.values()) + combine
    assert res.layer_us == pytest.approx(want, rel=1e-9)
    # the breakdown still adds up: the copies are its exposed transfers
    b_ = res.breakdown
    assert sum(b_.values()) == pytest.approx(res.layer_us, rel=1e-9)
    assert b_["exposed_comm_us"] == pytest.approx(0.0 if gather else 2 * copy, rel=1e-9)
    assert res.wgrad_us == pytest.approx(pieces["dw_down"] + pieces["dw_gate_up"], rel=1e-9)


def test_each_serial_gemm_is_one_launch_over_every_row():
    """One GEMM over all the rows on every SM (one round: its weights streamed once), from the
    standalone launch's fill (not the megakernel's) to its last tile; the comm SMs and the
    rounds of the design play no part."""
    res, b = _run(QWEN, SERIAL)
    plan, w = b.plan, b.waves
    tiles = -(-int(plan.padded_rows[0]) // 128)
    experts = int((plan.expert_counts.sum(axis=1) > 0).sum())
    dg = b.dgrad_specs(tiles, b.shape.intermediate, experts)
    got = b.piece_us()
    for name, spec in zip(("recompute", "down_dgrad", "gate_up_dgrad"), dg, strict=True):
        assert got[name] == pytest.approx(round_times([spec], 132, w.fill_us)[1], rel=1e-12)
    assert w.fill_us > w.layer_fill_us
    other = _run(QWEN, SERIAL.replace(num_comm_sms=8, minibatch_size=1024))[0]
    assert other.layer_us == pytest.approx(res.layer_us, rel=1e-9)


def test_mok_epilogue_bytes_slow_the_down_dgrad_alone():
    res, b = _run(QWEN, SERIAL)
    more = _run(QWEN, SERIAL.replace(swiglu_bwd_bytes_per_elem=14.0))[1].piece_us()
    less = b.piece_us()
    assert more["down_dgrad"] > less["down_dgrad"]
    assert {k: v for k, v in more.items() if k != "down_dgrad"} == {
        k: v for k, v in less.items() if k != "down_dgrad"
    }


def test_serial_backward_config_checks():
    with pytest.raises(ValueError, match="applies to direction='backward' only"):
        SimConfig(serial_backward=True)
    with pytest.raises(ValueError, match="serial backward only"):
        SimConfig(direction="backward", gather_backward=True)
    with pytest.raises(ValueError, match="True or False"):
        SimConfig(direction="backward", serial_backward=1)
    with pytest.raises(ValueError, match="at one rank"):
        _run(Workload("qwen3-30b-a3b", 256, 2, "hgx-h100"), SERIAL)
    with pytest.raises(ValueError, match="at one rank"):
        _run(QWEN, SERIAL.replace(kernel_profile="mok-comm-h200x2"))
    assert "serial" in SERIAL.label() and "gather" in SERIAL.replace(gather_backward=True).label()
    # forward_backward's forward drops the backward's switches
    fwd, bwd = forward_backward(QWEN, SERIAL)
    assert fwd.config.direction == "forward" and not fwd.config.serial_backward
    assert bwd.config.serial_backward


def test_the_gather_rule_is_mok_autograds():
    """validate's serial rows read their rows from the tokens where mok.autograd's "auto"
    gathers: the intermediate size at most its GATHER_BACKWARD_MAX_INTER."""
    autograd = pytest.importorskip("mok.autograd")
    assert autograd.GATHER_BACKWARD == "auto"
    assert autograd.GATHER_BACKWARD_MAX_INTER == TRAIN_GATHER_MAX_INTER
    got = {}
    for row in read_rows(LEVERS):
        if row["impl"] in ("mok-unfused", "mok-saved"):
            cfg = train_model_config(row)[3]
            inter = get_shape(row["model"]).intermediate
            assert cfg.gather_backward == (inter <= TRAIN_GATHER_MAX_INTER)
            assert cfg.swiglu_bwd_bytes_per_elem == MOK_SWIGLU_BWD_BYTES[cfg.recompute]
            got[row["model"]] = cfg.gather_backward
    assert got == {
        "sonic-1536x256": True,
        "sonic-4096x512": False,
        "sonic-4096x1024": False,
        "sonic-4096x2048": False,
    }


# -- the committed one-H100 profile ---------------------------------------------------------------
def test_kernels_are_classified_by_name():
    assert classify("mok::swiglu_bwd_kernel<0, true>") == ("bwd", "recompute+down_dgrad")
    assert classify("mok::swiglu_bwd_kernel<3, true>") == ("bwd", "down_dgrad")
    assert classify("mok::swiglu_bwd_kernel<1, false>") == ("fwd", "forward")
    assert classify("mok::wgrad_gather_kernel<0, 1>") == ("bwd", "dw_gate_up")
    assert classify("mok::wgrad_gather_kernel<0, 0>") == ("bwd", "dw_down")
    assert classify("mok::wgrad_kernel<0>") == ("bwd", "dw")
    assert classify("mok::dispatch_dedup_pull_kernel") == ("bwd", "copies")
    assert classify("mok::zero_padding_kernel") == ("bwd", "copies")
    assert classify("mok::combine_push_kernel<true>") == ("both", "combine")
    assert classify("mok::schedule_kernel") == ("both", "schedule")
    assert classify("at::native::vectorized_elementwise_kernel") == (None, "other")


def test_measured_pieces_add_up_to_the_rows_backward():
    kernels = read_rows(measured_path(KERNELS))
    mine = [k for k in kernels if (k["model"], k["impl"]) == ("sonic-1536x256", "mok-saved")]
    got = measured_pieces(mine, 3310.2)
    assert sum(got.values()) == pytest.approx(3310.2)
    # d_a alone (a dh kernel ran), the schedule and combine halved (one call each pass)
    by = {k["short"]: float(k["us_per_step"]) for k in mine}
    assert got["gate_up_dgrad"] == by["mok::bwd_fused_kernel<0>"]
    assert got["schedule"] == pytest.approx(by["mok::schedule_kernel"] / 2)
    assert got["combine"] == pytest.approx(by["mok::combine_push_kernel<true>"] / 2)
    assert "copies" not in got and "fused" not in got
    # without a dh kernel the launch is the whole backward
    alone = [k for k in mine if "swiglu_bwd_kernel<3" not in k["short"]]
    assert "fused" in measured_pieces(alone, 3310.2)


def test_the_serial_model_has_the_measured_combine_and_not_the_gemms():
    """docs/sim-validation.md, 'The backward by piece': on the profiled run (the gather forced
    on), the serial model's one-pass combine is within 10 % of the measured kernel at every
    shape, while its GEMMs are 7-55 % short of mok's kernels (recomputed here from the files)."""
    cases = compare(str(measured_path(KERNELS)), gather=True)
    assert len(cases) == 8
    for c in cases:
        meas, ser = c["measured"], c["serial"]
        assert ser["combine"] == pytest.approx(meas["combine"], rel=0.1)
        for name in ("gate_up_dgrad", "dw_gate_up", "dw_down"):
            assert -0.56 < ser[name] / meas[name] - 1 < -0.06
        # the serial model's pieces add up to its prediction, the design's to its
        for side in ("serial", "design"):
            p = c[side]
            parts = [v for k, v in p.items() if k not in ("total", "swiglu_epilogue")]
            assert sum(parts) == pytest.approx(p["total"])
            assert 0 < p["swiglu_epilogue"] < p["down_dgrad"]
        # no copies run in a gathered backward; the design moves (and may expose) rows anyway
        assert ser["copies"] == 0.0 and c["design"]["copies"] >= 0.0


def test_validate_on_the_serial_backward_and_on_the_design():
    """The levers CSV's backward errors: the serial model's are the documented ones
    (docs/sim-validation.md, 'The backward by piece'), the design's those before it; the
    forward is the same either way."""
    rows = read_rows(LEVERS)
    serial, design = validate_train_rows(rows), validate_train_rows(rows, design=True)
    for s, d in zip(serial, design, strict=True):
        if s["what"] == "fwd":
            assert s["predicted_us"] == d["predicted_us"] or s["status"] != "ok"
    got = {}
    for recs in (serial, design):
        errs = {}
        for r in recs:
            if r["what"] == "bwd" and r["status"] == "ok":
                errs.setdefault(r["model"], []).append(r["err"])
        got[recs is design] = {m: (min(e), max(e)) for m, e in errs.items()}
    want = {
        False: {
            "sonic-1536x256": (-0.398, -0.346),
            "sonic-4096x512": (-0.149, -0.097),
            "sonic-4096x1024": (-0.160, -0.123),
            "sonic-4096x2048": (-0.169, -0.087),
        },
        True: {
            "sonic-1536x256": (-0.211, -0.085),
            "sonic-4096x512": (-0.266, -0.124),
            "sonic-4096x1024": (-0.246, -0.189),
            "sonic-4096x2048": (-0.192, -0.136),
        },
    }
    for k, by in want.items():
        for m, (lo, hi) in by.items():
            assert got[k][m] == pytest.approx((lo, hi), abs=0.0015), (k, m)
    assert summarise_train(serial)["quantities"]["bwd"]["n"] == 24


def test_model_pieces_of_a_train_row_follow_its_path():
    (row,) = [
        r for r in read_rows(LEVERS) if (r["model"], r["impl"]) == ("sonic-4096x512", "mok-saved")
    ]
    p = model_pieces(row)
    assert p["copies"] > 0 and "recompute" not in p  # copied rows, from saved g / u
    assert model_pieces(row, gather=True)["copies"] == 0.0
    assert p["total"] == pytest.approx(validate_train_rows([row])[1]["predicted_us"])


def test_the_pieces_cli(capsys):
    assert main([str(measured_path(KERNELS)), "--gather", "on"]) == 0
    text = capsys.readouterr().out
    assert text.count("sonic-") == 8 and "one of the step's two calls" in text
    with pytest.raises(ValueError, match="give --train"):
        main([str(LEVERS)])


def test_the_pieces_cli_without_a_profile(capsys):
    """--train alone: the model's own pieces of every unfused-forward row beside its measured
    backward."""
    assert main(["--train", str(LEVERS)]) == 0
    text = capsys.readouterr().out
    assert text.count("sonic-") == 8 and "dY and x row copies" in text
    assert "one of the step's two calls" not in text
