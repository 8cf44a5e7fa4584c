"""GEMM waves model (sim.core.gemm_waves): closed forms, the probe fit, and the layer's
re-simulated breakdown (sim.layer.results.comm_free_run)."""

from __future__ import annotations

import numpy as np
import pytest

from sim.app.gemm_fit import DENSE_GEMM_ROWS, dense_probe_command, errors, fit, probe_points
from sim.config import SimConfig, Workload
from sim.core.engine import Graph, run_graph
from sim.core.gemm_waves import (
    H200_GEMM_WAVES,
    GemmSpec,
    gemm_spec,
    round_times,
    schedule_tiles,
)
from sim.core.hardware import load_gpu
from sim.layer.model import simulate
from sim.layer.results import comm_free_run, critical_path

P = 100
T = 10.0


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
    s = gemm_spec(gpu, H200_GEMM_WAVES, 8, 4096, 7168, 8, 132)  # 128 rows x 8 experts
    assert s.weight_us > s.compute_tile_us
    assert s.tile_us == pytest.approx(s.weight_us)  # under one wave: the whole stream per tile


def test_fit_reproduces_the_defaults_and_the_measured_points():
    gpu = load_gpu("h200")
    # NOTE: the dense sweep (h200-probe-gemm-dense-2026-12-01.json) is held out apart: the
    # defaults predate it, and on it they miss by 8.6 % median / 36 % max (it is the next fit).
    every = probe_points()
    pts = [q for q in every if "gemm-dense" not in q.source]
    dense = [q for q in every if "gemm-dense" in q.source]
    assert (
        len(dense) == 96 and np.median(np.abs(errors(gpu, H200_GEMM_WAVES, dense)["holdout"])) < 0.1
    )
    p = fit(gpu, pts)
    for name in ("tile_efficiency", "tile_fixed_us", "fill_us", "weight_gbps"):
        assert getattr(p, name) == pytest.approx(getattr(H200_GEMM_WAVES, name), rel=0.02)
    e = errors(gpu, H200_GEMM_WAVES, pts)
    assert len(e["fit"]) == 12 and len(e["holdout"]) >= 48
    assert np.median(np.abs(e["fit"])) < 0.05 and np.abs(e["fit"]).max() < 0.21
    assert np.median(np.abs(e["holdout"])) < 0.07 and np.abs(e["holdout"]).max() < 0.21
    # the point: 128 rows per expert, gate+up of h7168_i2048, measured 139.7 us
    pt = next(q for q in pts if q.is_fit and q.rows == 128 and q.op == "gate_up" and q.k == 7168)
    assert abs(errors(gpu, H200_GEMM_WAVES, [pt])["fit"][0]) < 0.10


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
