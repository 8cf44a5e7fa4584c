"""``fused="auto"`` (mok.path_choice) off CUDA: the pick and its margin, one measurement per key,
the explanation, refusals, tracing, argument checks, and the module / functional layer taking
``"auto"`` (the reference layer runs, as for fused=False). The timed choice on a GPU is checked in
tests/test_mok_autograd_gpu.py."""

from __future__ import annotations

import json
import types
import warnings

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import mok
from mok import MoKInputError
from mok import functional as mf
from mok import path_choice as pc
from mok.spec.config import MoKConfig
from mok.spec.workload import make_routing

E, H, INTER, K, N = 4, 16, 8, 2, 7


@pytest.fixture(autouse=True)
def _fresh():
    pc.clear_choices()
    yield
    pc.clear_choices()


@settings(max_examples=200, deadline=None)
@given(
    unfused=st.floats(1e-3, 1e3, allow_nan=False),
    ratio=st.floats(0.1, 3.0, allow_nan=False),
    margin=st.floats(0.0, 0.2),
)
def test_fused_is_picked_only_when_faster_by_the_margin(unfused, ratio, margin):
    fused = unfused * ratio
    assert pc.pick(unfused, fused, margin) == (fused < unfused * (1 - margin))
    assert not pc.pick(unfused, unfused, margin)  # a tie keeps the unfused path


@pytest.mark.parametrize("fused", [True, False])
def test_a_bool_is_kept_and_nothing_is_measured(fused):
    def measure():
        raise AssertionError("measured")

    assert pc.resolve_fused(fused, ("k",), measure, tracing=False) is fused
    assert pc.choices() == {}


@pytest.mark.parametrize("bad", ["yes", 1, None, "AUTO"])
def test_other_values_are_refused(bad):
    with pytest.raises(MoKInputError, match="fused must be True, False or 'auto'"):
        pc.resolve_fused(bad, ("k",), lambda: None, tracing=False)
    with pytest.raises(MoKInputError, match="fused must be"):
        mok.MoE(E, H, INTER, fused=bad)


def test_auto_measures_once_per_key_and_logs_why(caplog):
    calls = []

    def measure(fused):
        def m():
            calls.append(fused)
            return pc.PathChoice(fused, 2.0, 1.0 if fused else 3.0, "shape")

        return m

    caplog.set_level("INFO", logger="mok")
    assert pc.resolve_fused("auto", ("a",), measure(True), tracing=False) is True
    assert pc.resolve_fused("auto", ("a",), measure(False), tracing=False) is True  # kept
    assert pc.resolve_fused("auto", ("b",), measure(False), tracing=False) is False
    assert calls == [True, False]
    assert set(pc.choices()) == {("a",), ("b",)}
    assert "runs the fused forward: shape" in caplog.text
    assert "runs the unfused forward: shape" in caplog.text


def test_under_tracing_a_kept_choice_is_used_and_a_missing_one_runs_unfused():
    pc.resolve_fused("auto", ("a",), lambda: pc.PathChoice(True, 2.0, 1.0, ""), tracing=False)
    assert pc.resolve_fused("auto", ("a",), None, tracing=True) is True
    with pytest.warns(UserWarning, match="before any eager call"):
        assert pc.resolve_fused("auto", ("b",), None, tracing=True) is False
    assert ("b",) not in pc.choices()  # nothing kept: the next eager call measures


@pytest.mark.parametrize(
    ("times", "fused"), [([2.0, 1.0], True), ([2.0, 1.97], False), ([1.0, 2.0], False)]
)
def test_the_measured_choice_says_both_times(times, fused):
    ran = []
    got = pc.measured_choice(ran.append, [], None, "layer X", timer=lambda run: times)
    assert got.fused is fused and (got.unfused_ms, got.fused_ms) == tuple(times)
    assert f"fused {times[1]:.3f} ms, unfused {times[0]:.3f} ms" in got.text
    assert f"pin fused={fused}" in got.text and "layer X" in got.text


def test_a_refused_fused_path_is_not_run():
    def run(fused):
        raise AssertionError("ran")

    got = pc.measured_choice(run, ["no Hopper"], None, "layer X", timer=lambda r: r(True))
    assert not got.fused and got.fused_ms is None and got.unfused_ms is None
    assert "does not run it (no Hopper)" in got.text


def test_refusals_name_the_gpu_and_the_limits(monkeypatch):
    x = torch.zeros(N, H, dtype=torch.bfloat16)
    w = types.SimpleNamespace(w_gate=torch.zeros(E, INTER, H), shared_w_gate=None)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None: (10, 0))
    assert pc.fused_refusals(x, w, MoKConfig(), E, 132) == [
        "the fused layer does not run on sm_100"
    ]
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None: (9, 0))
    assert pc.fused_refusals(x.float(), w, MoKConfig(), E, 132)[0].startswith(
        "the fused layer takes bf16"
    )
    # hidden 16 is below what the fused layer's tiles take: its limits say so
    assert pc.fused_refusals(x, w, MoKConfig(), E, 132)


def test_the_key_leaves_out_the_token_count_and_keeps_recompute():
    w = types.SimpleNamespace(w_gate=torch.zeros(E, INTER, H), shared_w_gate=None)
    a = pc.choice_key(torch.zeros(N, H), w, E, K, MoKConfig(), None, True)
    assert a == pc.choice_key(torch.zeros(3 * N, H), w, E, K, MoKConfig(), None, True)
    assert a != pc.choice_key(torch.zeros(N, H), w, E, K, MoKConfig(), None, False)
    assert a != pc.choice_key(torch.zeros(N, H), w, E, K, MoKConfig(num_comm_sms=8), None, True)


def test_auto_off_cuda_is_the_reference_layer():
    torch.manual_seed(0)
    t = make_routing(N, E, K, 1, "uniform", seed=0)
    idx, tw = torch.from_numpy(t.topk_idx), torch.from_numpy(t.topk_weights).double()
    m = mok.MoE(E, H, INTER, dtype=torch.float64, fused="auto")
    x = torch.randn(N, H, dtype=torch.float64)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = m(x, idx, tw)
        w = m.weights()
        assert torch.equal(out, mf.moe_forward(x, idx, tw, w, E, fused="auto"))
    assert torch.equal(out, mok.MoE.from_weights(E, m.gate_up, m.down)(x, idx, tw))
    assert pc.choices() == {}  # nothing to choose off CUDA


def _key(**kw):
    w = types.SimpleNamespace(w_gate=torch.zeros(E, INTER, H), shared_w_gate=None)
    return pc.choice_key(torch.zeros(N, H), w, E, K, MoKConfig(**kw), None, True)


def test_a_choices_file_keeps_the_first_runs_choice(tmp_path, monkeypatch):
    path = tmp_path / "choices.json"
    monkeypatch.setenv(pc.CHOICES_ENV, str(path))
    name = pc.file_key(_key(), "GPU X")
    assert name.startswith("GPU X|ep=1|hidden=16|intermediate=8|shared=0|topk=2|experts=4|")
    made = pc.PathChoice(True, 2.0, 1.0, "timed")
    assert pc.resolve_fused("auto", _key(), lambda: made, False, name) is True
    stored = json.loads(path.read_text())[name]
    assert stored == {"fused": True, "unfused_ms": 2.0, "fused_ms": 1.0, "why": "timed"}
    pc.clear_choices()  # a new run: the file answers, nothing is timed

    def measure():
        raise AssertionError("measured again")

    assert pc.resolve_fused("auto", _key(), measure, False, name) is True
    (got,) = pc.choices().values()
    assert got.why == f"timed (stored in {path})"
    # another config is another entry, measured and added
    other = pc.file_key(_key(num_comm_sms=8), "GPU X")
    later = pc.PathChoice(False, 1.0, 2.0, "timed 2")
    assert pc.resolve_fused("auto", _key(num_comm_sms=8), lambda: later, False, other) is False
    assert set(json.loads(path.read_text())) == {name, other}


def test_a_broken_choices_file_is_named(tmp_path, monkeypatch):
    path = tmp_path / "choices.json"
    path.write_text("not json")
    monkeypatch.setenv(pc.CHOICES_ENV, str(path))
    with pytest.raises(MoKInputError, match="MOK_PATH_CHOICES=.*not a readable JSON"):
        pc.resolve_fused("auto", _key(), lambda: None, False, "k")
