"""mok-sim validate on the experts' GEMM pieces timed alone (``mok.bench experts``): the CSV read
as its own kind, the layer model's config of a row, which rows are predicted, and the CLI on
the committed ``h200x1-experts.csv`` (the errors docs/sim-validation.md documents)."""

from __future__ import annotations

import pytest

from sim.app.cli import main
from sim.app.validate_experts import (
    EXPERTS_PIECES,
    experts_model_config,
    summarise_experts,
    validate_experts_rows,
)
from sim.measured import MeasuredCSVError, measured_path, read_measured

EXPERTS = measured_path("h200x1-experts.csv")
TRAIN = measured_path("h200x1-train.csv")


def test_the_experts_csv_is_its_own_kind(tmp_path):
    kind, rows = read_measured(EXPERTS)
    assert kind == "experts" and len(rows) == 78
    assert {r["piece"] for r in rows} == {*EXPERTS_PIECES, "fwd_saving"}
    bad = tmp_path / "e.csv"
    bad.write_text(EXPERTS.read_text().replace(",piece,", ",what_piece,", 1))
    with pytest.raises(MeasuredCSVError, match="not a measured CSV"):
        read_measured(bad)


def test_a_row_is_modelled_on_its_own_routing_and_the_kernels_tiles():
    _, rows = read_measured(EXPERTS)
    row = next(r for r in rows if r["piece"] == "bwd_from_saved" and r["model"] == "kimi-k2")
    wl, plan, cfg = experts_model_config(row)
    assert (wl.shape, wl.tokens_per_rank, wl.ep, wl.skew) == ("kimi-k2", 4096, 1, row["skew"])
    assert wl.seed == int(row["routing_seed"])
    assert plan.trace.num_experts == int(row["num_experts"]) == 192
    assert cfg.direction == "backward" and not cfg.recompute  # the dh GEMM from saved g / u
    assert cfg.row_tile == 128 and cfg.minibatch_size == 4096 and cfg.num_comm_sms == 1
    assert cfg.swiglu_bwd_bytes_per_elem == 14.0  # fp32 g, u read; h w, dg, du written
    other = next(r for r in rows if r["piece"] == "bwd_recompute" and r["model"] == "kimi-k2")
    assert experts_model_config(other)[2].recompute
    assert wl.topology == "h200x2"  # an H200 row; an H100 row runs on the h100 profile
    h100 = {**row, "gpu": "NVIDIA H100 80GB HBM3"}
    assert experts_model_config(h100)[0].topology == "hgx-h100"
    assert experts_model_config(h100)[1:] == (plan, cfg)


def test_every_backward_piece_is_predicted_and_the_rest_listed():
    _, rows = read_measured(EXPERTS)
    recs = validate_experts_rows(rows)
    assert len(recs) == len(rows)
    for r, row in zip(recs, rows, strict=True):
        modelled = row["piece"] in EXPERTS_PIECES and (row["piece"], row["impl"]) != (
            "bwd_recompute",
            "torch",
        )
        assert (r["status"] == "ok") == modelled, (row["piece"], row["impl"])
        if modelled:
            assert r["predicted_us"] > 0 and r["role"] == "validation"
            assert r["err"] == pytest.approx(r["predicted_us"] / r["measured_us"] - 1)
        else:
            assert r["status"] == "baseline" and r["reason"]


@pytest.mark.parametrize(
    ("gemm_profile", "want"),
    [
        (
            None,
            {
                ("dW_gate_up", "torch"): (0.161, 0.182),
                ("dW_down", "torch"): (0.171, 0.209),
                ("gate_up_dgrad", "torch"): (0.139, 0.254),
                ("gate_up_dgrad", "mok"): (0.211, 0.217),
                ("bwd_recompute", "mok"): (0.242, 0.271),
                ("bwd_from_saved", "mok"): (0.289, 0.406),
                ("dW_gate_up", "mok"): (0.041, 0.051),
                ("dW_down", "mok"): (0.045, 0.071),
                ("bwd_saved_all", "mok"): (0.135, 0.151),
                ("bwd_saved_all", "mok-serial"): (0.156, 0.224),
            },
        ),
        (
            "mok-fused-h200x1",
            {
                ("bwd_recompute", "mok"): (0.028, 0.047),
                ("bwd_from_saved", "mok"): (0.099, 0.306),
                ("dW_gate_up", "mok"): (0.049, 0.082),
                ("dW_down", "mok"): (0.035, 0.070),
                ("dW_down", "torch"): (0.120, 0.182),
                ("gate_up_dgrad", "mok"): (0.025, 0.091),
                ("bwd_saved_all", "mok"): (0.016, 0.045),
                ("bwd_saved_all", "mok-serial"): (0.028, 0.091),
            },
        ),
    ],
)
def test_the_documented_errors(gemm_profile, want):
    """docs/sim-validation.md, 'The backward's GEMM pieces alone': |err| median / max per
    piece and implementation at both rate sets."""
    _, rows = read_measured(EXPERTS)
    s = summarise_experts(validate_experts_rows(rows, gemm_profile))
    for key, (med, top) in want.items():
        got = s["by_piece"][key]
        assert got["median_abs_err"] == pytest.approx(med, abs=0.001), key
        assert got["max_abs_err"] == pytest.approx(top, abs=0.001), key


def test_cli_validates_the_committed_experts_csv(tmp_path, capsys):
    out = tmp_path / "records.csv"
    assert main(["validate", str(EXPERTS), "--csv", str(out)]) == 0
    text = capsys.readouterr().out
    assert "h200x1-experts.csv: 78 rows" in text and "|err| median / max" in text
    assert "kimi-k2        uniform  bwd_from_saved  mok" in text
    assert "not predicted: fwd_saving" in text
    assert len(out.read_text().splitlines()) == 79


@pytest.mark.parametrize(
    ("extra", "why"),
    [
        (["--refit"], "do not apply"),
        (["--plot", "x.png"], "do not apply"),
        ([str(TRAIN)], "mix of train CSVs (mok.bench train) and experts CSVs"),
    ],
)
def test_cli_refusals_on_an_experts_csv(extra, why, capsys):
    assert main(["validate", str(EXPERTS), *extra]) == 2
    assert why in capsys.readouterr().err


def test_the_pieces_figure_has_a_bar_per_row_at_its_rate():
    """sim.app.plots.expert_pieces on the committed CSV: a panel per model, one bar per (piece,
    impl) row of the skew at its TFLOP/s, labelled with its time in ms, and the peak line."""
    from sim.app.plots import expert_pieces
    from sim.measured import read_rows

    rows = [r for r in read_rows(EXPERTS) if r["skew"] == "uniform"]
    axes = expert_pieces(rows, "uniform", 790.0).get_axes()
    assert [ax.get_title() for ax in axes] == [
        f"{m}, uniform" for m in ("deepseek-v3", "kimi-k2", "qwen3-30b-a3b")
    ]
    for ax in axes:
        model = ax.get_title().split(", ")[0]
        mine = [r for r in rows if r["model"] == model]
        assert sorted(b.get_height() for b in ax.patches) == pytest.approx(
            sorted(float(r["tflops"]) for r in mine)
        )
        assert sorted(t.get_text() for t in ax.texts) == sorted(
            f"{float(r['median_us']) / 1e3:.2f}" for r in mine
        )
        assert [line.get_ydata()[0] for line in ax.get_lines()] == [790.0]
