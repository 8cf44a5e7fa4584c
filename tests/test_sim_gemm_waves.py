"""GEMM waves model (sim.core.gemm_waves): closed forms of each term, the fits on the dense
one-H200 and one-H100 probes against the committed profile sections, and the layer's
re-simulated breakdown (sim.layer.results.comm_free_run)."""

from __future__ import annotations

import numpy as np
import pytest

from sim.app.gemm_fit import (
    DENSE_GEMM_ROWS,
    FIT_PARAMS,
    LAUNCH_US,
    dense_probe_command,
    errors,
    fit,
    fit_probes,
    main,
    predict,
    probe_points,
)
from sim.config import SimConfig, Workload
from sim.core.engine import Graph, run_graph
from sim.core.gemm_waves import (
    GemmSpec,
    GemmWaves,
    gemm_spec,
    per_sm_tflops,
    probe_tiles,
    round_times,
    schedule_tiles,
    standalone_gemm_us,
)
from sim.core.hardware import GpuProfile, load_gpu
from sim.layer.model import LayerBuilder, plan_for, simulate
from sim.layer.results import comm_free_run, critical_path
from sim.measured import GEMM_WAVES_FIT_PROBES, gpu_profile_of

P = 100
T = 10.0
DENSE = "h200-probe-gemm-dense-2026-12-01.json"
DENSE_H100 = "h100-probe-gemm-dense-2026-12-07.json"
# a parameter set for the closed forms (round numbers, not the fit)
W = GemmWaves(
    tile_efficiency=1.2,
    sustained_efficiency=0.9,
    tile_fixed_us=0.5,
    fill_us=10.0,
    host_us=40.0,
    weight_gbps=1e9,  # no weight streaming unless a test sets it
    launch_us=4.0,
    reference_hbm_gbps=4800.0,
)


def spec(tiles, t=T):
    return GemmSpec(tiles, t, t, 0.0)


@pytest.mark.parametrize("k", [1, 2, 5])
def test_k_full_waves(k):
    busy, done = round_times([spec(k * P)], P, fill_us=3.0)
    assert busy == pytest.approx(3.0 + k * T)
    assert done == pytest.approx(3.0 + k * T)


def test_fractional_last_wave_costs_a_wave_alone_but_frees_the_pool_early():
    busy, done = round_times([spec(150)], P, fill_us=0.0)
    assert done == pytest.approx(2 * T)  # the tail: ceil(1.5) waves
    assert busy == pytest.approx(1.5 * T)  # fluid occupancy: the next round backfills


def test_two_gemms_summing_to_one_wave_backfill_into_one_wave():
    busy, done = round_times([spec(40), spec(60)], P, fill_us=0.0)
    assert done == pytest.approx(T)
    assert busy == pytest.approx(T)
    # a shorter second GEMM fills the idle SMs of the first's partial wave several times
    busy, done = round_times([spec(50), spec(100, T / 2)], P, fill_us=0.0)
    assert done == pytest.approx(T)


def test_list_schedule_matches_a_heap():
    import heapq

    rng = np.random.default_rng(0)
    free = rng.uniform(0, 25, 17)
    for tiles, t in ((5, 3.0), (40, 7.0), (200, 0.5)):
        h = list(free)
        heapq.heapify(h)
        for _ in range(tiles):
            heapq.heappush(h, heapq.heappop(h) + t)
        assert np.allclose(schedule_tiles(free, tiles, t), sorted(h))
        free = schedule_tiles(free, tiles, t)


def test_weight_streaming_bounds_a_small_gemm():
    gpu = load_gpu("h200")
    s = gemm_spec(gpu, gpu.waves(), 8, 4096, 7168, 8, 132)  # 128 rows x 8 experts
    assert s.weight_us > s.compute_tile_us
    assert s.tile_us == pytest.approx(s.weight_us)  # under one wave: the whole stream per tile


def test_per_sm_rate_is_capped_by_the_sustained_chip_rate():
    gpu = load_gpu("h200")
    f, n = gpu.tensor_tflops["bf16"], gpu.num_sms
    knee = W.sustained_efficiency / W.tile_efficiency * n  # 99 SMs
    for sms in (8, 66, 99):
        assert per_sm_tflops(gpu, W, sms) == pytest.approx(W.tile_efficiency * f / n)
    for sms in (100, 116, 132):
        assert sms > knee
        assert sms * per_sm_tflops(gpu, W, sms) == pytest.approx(W.sustained_efficiency * f)
    # the tile time follows: 2 * 128 * 256 * K flops at the capped rate, plus the fixed part
    s = gemm_spec(gpu, W, 132, 256, 1024, 1, 132)
    assert s.compute_tile_us == pytest.approx(
        W.tile_fixed_us + 2 * 128 * 256 * 1024 / (W.sustained_efficiency * f / 132 * 1e6)
    )
    # mxfp8 scales with its own tensor rate
    assert per_sm_tflops(gpu, W, 132, "mxfp8") / per_sm_tflops(gpu, W, 132) == pytest.approx(
        gpu.tensor_tflops["mxfp8"] / f
    )


@pytest.mark.parametrize(
    ("rows", "n", "want"),
    [
        (128, 4096, (16, 64, 128)),  # <= 128 rows per expert: 64 x 128 tiles, 2 per expert
        (100, 4096, (16, 64, 128)),
        (129, 4096, (16, 128, 256)),  # 2 row tiles of 128
        (256, 4096, (16, 128, 256)),
        (384, 4096, (32, 128, 256)),  # 3 row tiles run as 4: clusters of 2 along M
        (512, 4096, (32, 128, 256)),
        (640, 7168, (48, 128, 256)),
        (1024, 128, (128, 64, 128)),  # N <= 128: the small tiles again, 16 per expert
    ],
)
def test_probe_tiles_pair_row_tiles_per_cluster(rows, n, want):
    assert probe_tiles(8, rows, n) == want


def test_standalone_gemm_closed_form_and_host_floor():
    gpu = load_gpu("h200")
    # 8 experts x 1024 rows x N 2048 (8 tiles of 256): 64 x 8 = 512 tiles on 132 SMs = 4 waves
    rows, n, k = 1024, 2048, 4096
    t = W.tile_fixed_us + 2 * 128 * 256 * k / (per_sm_tflops(gpu, W, 132) * 1e6)
    want = W.fill_us + 4 * t
    assert want > W.host_us
    assert standalone_gemm_us(gpu, W, 8, rows, n, k, 132) == pytest.approx(want)
    # an odd multiple of 128 rows per expert costs what the next even multiple costs
    for odd in (384, 640, 896):
        assert standalone_gemm_us(gpu, W, 8, odd, n, k, 132) == standalone_gemm_us(
            gpu, W, 8, odd + 128, n, k, 132
        )
    # a GEMM shorter than the host time of a call measures the host
    assert standalone_gemm_us(gpu, W, 8, 256, 256, 256, 132) == W.host_us
    assert W.layer_fill_us == W.fill_us - W.launch_us


@pytest.mark.parametrize("name, probe", [("h200", DENSE), ("h100", DENSE_H100)])
def test_fit_reproduces_the_committed_profile_section(name, probe):
    """Each measured GPU's section is the fit on its own dense sweep (all probes given: the
    other GPU's points are not fitted), launch_us the assumption, weight_gbps at its HBM rate."""
    gpu = load_gpu(name)
    assert GEMM_WAVES_FIT_PROBES[name] == fit_probes(name) == (probe,)
    pts = probe_points()
    p = fit(gpu, pts)
    committed = gpu.waves()
    for param, (*_, decimals) in FIT_PARAMS.items():
        assert getattr(p, param) == pytest.approx(getattr(committed, param), abs=10.0**-decimals)
    assert (p.launch_us, p.reference_hbm_gbps, p.source) == (
        committed.launch_us,
        gpu.hbm_gbps,
        committed.source,
    )
    assert committed.launch_us == LAUNCH_US and committed.reference_hbm_gbps == gpu.hbm_gbps
    others = [f for g, fs in GEMM_WAVES_FIT_PROBES.items() if g != name for f in fs]
    assert probe in committed.source and not any(f in committed.source for f in others)


def test_derived_profiles_carry_the_h200_section_and_the_h100_its_own():
    """b200 / gb200 / gb300 carry the H200's section (rates as fractions of their own tensor
    rate); the h100's is fitted on the one-H100 probe and differs from it."""
    h200 = load_gpu("h200").waves()
    for name in ("b200", "gb200", "gb300"):
        assert load_gpu(name).waves() == h200
    h100 = load_gpu("h100").waves()
    assert h100 != h200 and DENSE_H100 in h100.source and DENSE not in h100.source


def test_probe_points_belong_to_the_gpu_the_probe_ran_on():
    """Every point's GPU is its probe's meta.gpu; a GPU's fit points are those of its own fit
    probes only, and filtering by GPU keeps exactly its points."""
    pts = probe_points()
    by_gpu = {g: probe_points(gpu=g) for g in GEMM_WAVES_FIT_PROBES}
    assert sorted(pts, key=repr) == sorted(sum(by_gpu.values(), []), key=repr)
    for g, mine in by_gpu.items():
        assert mine and {q.gpu for q in mine} == {g}
        assert {q.source for q in mine if q.is_fit} == set(GEMM_WAVES_FIT_PROBES[g])
    assert {q.source for q in by_gpu["h100"]} == {DENSE_H100}
    assert gpu_profile_of("NVIDIA H100 80GB HBM3") == "h100"
    assert gpu_profile_of("NVIDIA H200") == "h200"
    assert gpu_profile_of("NVIDIA B200") is None and gpu_profile_of(None) is None
    with pytest.raises(ValueError, match="no GEMM waves fit probes for GPU 'b200'"):
        fit_probes("b200")


def _abs_errors(gpu, p, pts):
    return np.abs([predict(gpu, p, q) / q.us - 1.0 for q in pts])


def test_fit_and_holdout_errors():
    """Measured with the committed section (docs/sim-validation.md, 'Calibrated on the dense
    sweep'). Fit: every point of the dense sweep; holdout: the grouped GEMMs of the other
    probes (other runs on other days; the 4 of the sustained-matmul probe came later)."""
    gpu = load_gpu("h200")
    p = gpu.waves()
    pts = probe_points()
    e = errors(gpu, p, pts)  # the H100 probe's points are skipped (another GPU)
    fit_err, hold = np.abs(e["fit"]), np.abs(e["holdout"])
    assert len(fit_err) == 96 and len(hold) == 76
    assert np.median(fit_err) < 0.03 and fit_err.max() < 0.205  # measured 2.8 % / 20.0 %
    # NOTE: the holdout median is better than with the old parameters (5.8 % over 60 points);
    # its max is worse (19.8 % then): the two-GPU probe's host floor is higher (47-54 us per call
    # under torchrun against 43.6 us fitted), and the 64 x 128 tiles of 128 rows per expert run
    # slower than the model's single per-SM rate in all three probes.
    assert np.median(hold) < 0.055 and hold.max() < 0.235  # measured 4.9 % / 23.0 % (76)
    pts = [q for q in pts if q.gpu == "h200"]
    dense_rows = [q for q in pts if q.source == DENSE and q.section == "by_rows"]
    dense_sms = [q for q in pts if q.source == DENSE and q.section == "by_sms"]
    old_sms = [q for q in pts if q.source != DENSE and q.section == "by_sms"]
    r, m, o = (_abs_errors(gpu, p, x) for x in (dense_rows, dense_sms, old_sms))
    assert np.median(r) < 0.045 and r.max() < 0.205  # measured 4.1 % / 20.0 %
    assert np.median(m) < 0.025 and m.max() < 0.11  # measured 2.4 % / 10.6 %
    assert np.median(o) < 0.035 and o.max() < 0.13  # measured 3.1 % / 12.7 %


def test_h100_fit_errors():
    """Measured with the committed h100 section (docs/sim-validation.md, 'One H100'). Fit: every
    point of the one-H100 dense sweep; no other H100 probe, so nothing is held out."""
    gpu = load_gpu("h100")
    p = gpu.waves()
    e = errors(gpu, p, probe_points())  # the H200 probes' points are skipped (another GPU)
    fit_err = np.abs(e["fit"])
    assert len(fit_err) == 96 and e["holdout"].size == 0
    assert np.median(fit_err) < 0.035 and fit_err.max() < 0.15  # measured 3.2 % / 14.4 %
    pts = probe_points((DENSE_H100,))
    rows, sms = ([q for q in pts if q.section == s] for s in ("by_rows", "by_sms"))
    r, m = _abs_errors(gpu, p, rows), _abs_errors(gpu, p, sms)
    assert np.median(r) < 0.035 and r.max() < 0.15  # measured 3.0 % / 14.4 %
    assert np.median(m) < 0.04 and m.max() < 0.105  # measured 3.5 % / 9.9 %
    # the H200's section (as the h100 profile carried it before) on the same points
    old = _abs_errors(gpu, load_gpu("h200").waves(), pts)
    assert np.median(old) > np.median(fit_err) and old.max() > 0.3  # measured 3.8 % / 34.1 %


@pytest.mark.parametrize(
    "name, probe, other, hold",
    [("h200", DENSE, DENSE_H100, "76 points"), ("h100", DENSE_H100, DENSE, "no points")],
)
def test_gemm_fit_main_prints_every_point_of_one_gpu(capsys, name, probe, other, hold):
    assert main([name]) == 0
    out = capsys.readouterr().out
    assert out.count(f"fit  {probe}") == 96 and other not in out
    assert "fit: 96 points" in out and f"holdout: {hold}" in out
    assert f"--out {name}-probe-gemm-dense.json" in out


def test_the_dense_sweep_shows_the_cluster_pairs():
    """The measured times at odd multiples of 128 rows per expert are those of the next even
    multiple (within the sweep's scatter), which the paired row tiles reproduce."""
    pts = [q for q in probe_points((DENSE,)) if q.section == "by_rows"]
    us = {(q.shape, q.op, q.rows): q.us for q in pts}
    ratios = [us[(s, o, r)] / us[(s, o, r + 128)] for s, o, r in us if r in (384, 640, 896)]
    assert len(ratios) == 12 and max(abs(x - 1) for x in ratios) < 0.09
    # ... and not those of the even multiple below (the tiles of 256 more rows per expert)
    gate_up = [us[("h7168_i2048", "gate_up", r)] for r in (256, 384, 512, 640, 768)]
    assert gate_up[1] / gate_up[0] > 1.7 and gate_up[3] / gate_up[2] > 1.4


def test_profile_without_gemm_waves_is_a_clear_error(monkeypatch):
    import sim.core.hardware as hw

    gpu = load_gpu("h200")
    bare = GpuProfile(**{**gpu.__dict__, "gemm_waves": None})
    assert "gemm_waves" not in bare.to_dict()  # such profiles keep their old JSON form
    assert GpuProfile.from_dict(gpu.to_dict()) == gpu
    with pytest.raises(ValueError, match="no gemm_waves section"):
        bare.waves()
    monkeypatch.setitem(hw._CACHE, "h200", bare)
    wl = Workload("tiny", 256, 2, "h200x2")
    with pytest.raises(ValueError, match="'h200' has no gemm_waves section"):
        LayerBuilder(wl, SimConfig(minibatch_size=256), plan_for(wl))


def test_dense_probe_command_uses_existing_flags():
    from mok.bench.probe.args import parse_args

    cmd = dense_probe_command().split()
    a = parse_args(cmd[4:])
    assert a.gemm_rows == list(DENSE_GEMM_ROWS) and "grouped" not in a.skip


def test_breakdown_comm_hidden_and_comm_only():
    # comm hidden: a 100 us transfer next to a 500 us compute task
    g = Graph()
    x = g.transfer([], 100.0, [], 0, "dispatch")
    c = g.delay(500.0, [], 0, "gemm")
    g.delay(1.0, [x, c], 0, "reduce")
    run = run_graph(g, np.ones(1))
    assert run.makespan_us - comm_free_run(g).makespan_us == pytest.approx(0.0)
    # comm only: the compute waits for the transfer
    g = Graph()
    x = g.transfer([], 100.0, [], 0, "dispatch")
    g.delay(1.0, [x], 0, "gemm")
    run = run_graph(g, np.ones(1))
    free = comm_free_run(g)
    assert run.makespan_us - free.makespan_us == pytest.approx(100.0)
    assert critical_path(g, free)["gemm"] == pytest.approx(1.0)


def test_layer_breakdown_adds_up_and_is_what_free_comm_saves():
    wl = Workload("tiny", 256, 8, "hgx-h200")
    r = simulate(wl, SimConfig(num_comm_sms=8, minibatch_size=256))
    assert sum(r.breakdown.values()) == pytest.approx(r.layer_us, rel=1e-9)
    free = comm_free_run(r.graph).makespan_us
    assert r.breakdown["exposed_comm_us"] == pytest.approx(r.layer_us - free)
    assert r.path_comm_us >= r.breakdown["exposed_comm_us"] - 1e-6
