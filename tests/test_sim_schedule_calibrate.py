"""Receive layout (MoK schedule formula), GEMM waves, profiles and the calibration fit."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from mok.spec.workload import make_routing
from sim.app.calibrate import (
    calibration_points,
    derive_profiles,
    fit_gpu_profile,
    fit_h200_profile,
    predict_bidirectional_gbps,
    predict_one_direction_gbps,
    with_fitted_gemm_waves,
    with_signalling,
)
from sim.app.signalling_fit import fit_signalling
from sim.core.gemm import gemm_us
from sim.core.hardware import GpuProfile, list_gpus, load_gpu, profiles_dir
from sim.layer.plan import RoutingPlan
from sim.measured import GEMM_WAVES_FIT_PROBES, SIGNALLING_FIT_PROBE, measured_path
from tests import tolerances as tol

PROFILES = profiles_dir()
PROBE = measured_path("h200x2-probe-2026-11-29.json")
SIG_PROBE = measured_path(SIGNALLING_FIT_PROBE)


def _brute_positions(trace, row_tile):
    """The schedule formula of docs/design.md, written with loops."""
    nr, e_total = trace.num_ranks, trace.num_experts
    per = e_total // nr
    flat = trace.topk_idx.reshape(-1)
    src = np.arange(flat.size) // (trace.num_tokens * trace.num_topk)
    m = np.zeros((e_total, nr), dtype=int)
    for e, s in zip(flat, src, strict=True):
        m[e, s] += 1
    pos = np.empty(flat.size, dtype=int)
    seen = np.zeros((e_total, nr), dtype=int)
    start = {}
    for d in range(nr):
        off = 0
        for lo in range(per):
            e = d * per + lo
            start[e] = off
            off += math.ceil(m[e].sum() / row_tile) * row_tile
    for i, (e, r) in enumerate(zip(flat, src, strict=True)):
        o = seen[e, r]
        seen[e, r] += 1
        p = sum(min(m[e, q], o) for q in range(nr)) + sum(1 for q in range(r) if m[e, q] > o)
        pos[i] = start[e] + p
    return pos


@pytest.mark.parametrize("skew", ["uniform", "zipf:1.2", "hot:0.5"])
def test_positions_follow_the_schedule_formula(skew):
    tr = make_routing(50, 16, 4, 4, skew, seed=3)
    plan = RoutingPlan(tr, row_tile=8)
    np.testing.assert_array_equal(plan.pos, _brute_positions(tr, 8))


def test_round_counts_are_consistent():
    tr = make_routing(300, 16, 4, 4, "zipf:1.0", seed=0)
    plan = RoutingPlan(tr, row_tile=16)
    rc = plan.rounds(64)
    assert rc.rows.sum() == tr.topk_idx.size
    # dedup: each distinct (token, dest) pair counted once as first and once as last
    dest = tr.topk_idx // 4
    pairs = sum(len(set(row)) for row in dest)
    assert rc.uniq_first.sum() == pairs == rc.uniq_last.sum()
    assert np.all(rc.uniq_first.sum(axis=1) <= rc.rows.sum(axis=1))
    # tiles cover the padded layout
    assert (rc.row_tiles.sum(axis=1) * 16 == rc.padded_rows).all()
    with pytest.raises(ValueError, match="multiple of"):
        plan.rounds(40)


def test_gemm_partial_waves_cost_full_waves():
    gpu = load_gpu("h200")
    one = gemm_us(gpu, 1, gpu.gemm_n_tile, 1024, 100)
    assert gemm_us(gpu, 100, gpu.gemm_n_tile, 1024, 100) == pytest.approx(one)
    assert gemm_us(gpu, 101, gpu.gemm_n_tile, 1024, 100) == pytest.approx(2 * one)
    # 790 TFLOP/s x efficiency on all SMs for a full wave
    flops = 2 * 128 * gpu.gemm_n_tile * 1024 * gpu.num_sms
    rate = flops / gemm_us(gpu, gpu.num_sms, gpu.gemm_n_tile, 1024, gpu.num_sms) / 1e6
    assert rate == pytest.approx(gpu.tensor_tflops["bf16"] * gpu.gemm_efficiency)


def test_profiles_load_and_validate():
    assert {"h200", "h100", "b200", "gb200", "gb300"} <= set(list_gpus())
    for name in list_gpus():
        p = load_gpu(name)
        assert p.assumptions, f"{name} documents no assumptions"
        assert p.curve("pull_tma").gbps(p.num_sms - 1) > 0
    bad = load_gpu("h200").to_dict()
    bad["gemm_efficiency"] = 1.5
    with pytest.raises(ValueError, match="gemm_efficiency"):
        GpuProfile.from_dict(bad)


def test_calibration_reproduces_the_probe_within_5_percent():
    probe = json.loads(PROBE.read_text())
    prof = fit_gpu_profile(probe)
    pts = calibration_points(probe)
    assert len(pts) >= 60
    for fam, kind, mech, n, measured in pts:
        f = predict_one_direction_gbps if fam == "one_direction" else predict_bidirectional_gbps
        pred = f(prof, kind, mech, n)
        assert pred == pytest.approx(measured, rel=0.05), (fam, kind, mech, n)
    assert prof.flag_latency_remote_us == pytest.approx(1.20, abs=0.01)
    assert prof.tensor_tflops["bf16"] == pytest.approx(790.3)


def test_committed_h200_profile_is_the_fit_of_the_committed_probe():
    """The comm fit of the two-GPU probe, the signalling fit of the one-GPU signalling probe
    (sim.app.signalling_fit) and the GEMM waves fit (sim.app.gemm_fit)."""
    fresh = fit_h200_profile(PROBE).to_dict()
    committed = json.loads((PROFILES / "h200.json").read_text())
    tol.assert_json_close(json.loads(json.dumps(fresh)), committed)
    bare = fit_gpu_profile(json.loads(PROBE.read_text()), probe_file=PROBE.name)
    assert "gemm_waves" not in bare.to_dict()  # the comm probe alone gives no GEMM waves section
    assert bare.fence_us == 0.5  # ... and keeps the stated fence (not in the comm probe)
    sig = with_signalling(bare, fit_signalling(json.loads(SIG_PROBE.read_text())), SIG_PROBE.name)
    assert list(sig.assumptions) == committed["assumptions"][:-1]  # all but the GEMM waves line


def test_calibration_writes_the_signalling_probe_fit_into_the_h200_profile():
    """fence_us, flag_poll_lanes and completion_jitter_us are the fit of the committed one-H200
    signalling probe; the fence's in-flight window stays the stated 16 KiB per SM (the probe
    stored into local memory: its window and drain are HBM/L2's, not NVLink's); incast stays
    the stated assumption. Values as fitted on h200-probe-signalling-2026-12-01.json."""
    got = fit_signalling(json.loads(SIG_PROBE.read_text()))
    h200 = load_gpu("h200")
    assert got["fit"]["fence_target"] == "local"
    assert h200.fence_us == pytest.approx(got["fence_us_above_flag"], rel=1e-12)
    assert h200.fence_us == pytest.approx(got["fence_us"] - got["fit"]["fence_release_us"])
    assert h200.signalling.flag_poll_lanes == got["signalling"]["flag_poll_lanes"] == 32
    assert h200.signalling.completion_jitter_us == got["signalling"]["completion_jitter_us"]
    assert h200.signalling.fence_inflight_bytes_per_sm == 16384.0
    assert (h200.incast.efficiency_min, h200.incast.writers_half) == (0.8, 8.0)
    # the numbers of the committed file (docs/sim-validation.md, "Push signalling")
    assert got["fence_us"] == pytest.approx(2.214, abs=5e-4)
    assert got["fit"]["fence_release_us"] == pytest.approx(0.645, abs=5e-4)
    assert h200.fence_us == pytest.approx(1.569, abs=5e-4)
    assert h200.signalling.completion_jitter_us == pytest.approx(0.086, abs=5e-4)
    assert got["fit"]["poll_sweep_overhead_us"] == pytest.approx(0.117, abs=5e-4)
    assert got["fit"]["poll_sweep_load_us"] == pytest.approx(0.168, abs=5e-4)
    # without the per-wait overhead the fit prefers 64 lanes: the artifact the overhead removes
    assert got["fit"]["poll_lanes_without_overhead"] == 64
    assert h200.fit["signalling"]["probe"] == SIGNALLING_FIT_PROBE
    for name in ("h100", "b200", "gb200", "gb300"):
        d = load_gpu(name)
        assert (d.fence_us, d.signalling, d.incast) == (h200.fence_us, h200.signalling, h200.incast)
        assert any(
            a.startswith("signalling and incast: measured on one H200") for a in d.assumptions
        )


def test_committed_derived_profiles_are_derived_from_the_committed_h200():
    """h100 / b200 / gb200 / gb300 are derive_profiles(h200), one source of truth; b200 / gb200
    / gb300 keep the H200's GEMM waves section with an assumption line saying so, the h100 has
    the fit on its own probe (sim.measured.GEMM_WAVES_FIT_PROBES)."""
    h200_waves = json.loads((PROFILES / "h200.json").read_text())["gemm_waves"]
    derived = derive_profiles(load_gpu("h200"))
    assert set(derived) == {"h100", "b200", "gb200", "gb300"}
    for name, prof in derived.items():
        committed = json.loads((PROFILES / f"{name}.json").read_text())
        tol.assert_json_close(json.loads(json.dumps(prof.to_dict())), committed)
        carried = any(a.startswith("gemm_waves: the H200 fit") for a in committed["assumptions"])
        assert (committed["gemm_waves"] == h200_waves) == carried == (name != "h100")


def test_calibration_writes_the_h100_probe_fit_into_the_h100_profile():
    """The h100 profile's gemm_waves section is the fit on the one-H100 dense sweep, at the
    H100's HBM rate, its source and an assumption line naming that probe."""
    (probe,) = GEMM_WAVES_FIT_PROBES["h100"]
    assert probe == "h100-probe-gemm-dense-2026-12-07.json"
    bare = GpuProfile(**{**load_gpu("h100").__dict__, "gemm_waves": None})
    fresh = with_fitted_gemm_waves(bare)
    committed = json.loads((PROFILES / "h100.json").read_text())
    tol.assert_json_close(
        json.loads(json.dumps(fresh.gemm_waves.to_dict())), committed["gemm_waves"]
    )
    assert fresh.gemm_waves.source == committed["gemm_waves"]["source"]
    assert probe in committed["gemm_waves"]["source"] and probe in committed["source"]
    assert committed["gemm_waves"]["reference_hbm_gbps"] == committed["hbm_gbps"] == 3350.0
    assert committed["assumptions"][-1].startswith("gemm_waves: fitted by sim.app.gemm_fit")
    assert probe in committed["assumptions"][-1]
    assert "h200-probe-gemm" not in json.dumps(committed["gemm_waves"])


def test_json_close_is_exact_but_for_float_ulps():
    """The comparison behind the test above: floats within FIT_RTOL, all else exact."""
    want = {"name": "h200", "n": 3, "ok": True, "none": None, "v": [1.0, {"x": 2.5}]}
    few_ulps = {**want, "v": [math.nextafter(1.0, 2.0), {"x": 2.5 * (1 + 4e-16)}]}
    tol.assert_json_close(few_ulps, want)
    bad = [
        ({**want, "v": [1.0, {"x": 2.5 * (1 + 1e-6)}]}, r"\$\.v\[1\]\.x: "),
        ({**want, "n": 4}, r"\$\.n: got 4, want 3"),
        ({**want, "n": 3.0}, r"\$\.n: got 3\.0, want 3"),
        ({**want, "ok": 1}, r"\$\.ok: got 1, want True"),
        ({**want, "name": "h100"}, r"\$\.name: got 'h100'"),
        ({k: v for k, v in want.items() if k != "none"}, r"\$: missing keys \['none'\]"),
        ({**want, "v": [1.0]}, r"\$\.v: length 1 != 2"),
        ({**want, "v": [1, {"x": 2.5}]}, r"\$\.v\[0\]: got 1 \(int\), want 1\.0"),
    ]
    for got, msg in bad:
        with pytest.raises(AssertionError, match=msg):
            tol.assert_json_close(got, want)
