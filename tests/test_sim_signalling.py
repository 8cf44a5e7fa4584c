"""Push signalling (fence drain, flag polling, completion jitter), incast and the dedup fold's
bytes against closed forms (docs/sim-validation.md, "Mechanisms that separate push from pull")."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

from sim.config import SimConfig, Workload
from sim.core import hardware
from sim.core.engine import Graph, run_graph
from sim.core.hardware import Incast, Signalling, load_gpu, profiles_dir
from sim.layer.model import LayerBuilder, plan_for, simulate
from sim.layer.policies import FOLD_COPY_BYTES_PER_TRAFFIC_BYTE, remote_writers

TINY = Workload("tiny", 256, 8, "hgx-h200", "hot:0.3", seed=1)
CFG = SimConfig(num_comm_sms=16, minibatch_size=256, macrobatch_size=512)


def _off(monkeypatch, name: str = "h200", signalling: bool = True, incast: bool = True) -> None:
    gpu = load_gpu(name)
    new = dataclasses.replace(
        gpu,
        signalling=Signalling.off() if signalling else gpu.signalling,
        incast=Incast.off() if incast else gpu.incast,
    )
    monkeypatch.setitem(hardware._CACHE, name, new)


# -- the profile data ---------------------------------------------------------------------------


def test_every_gpu_profile_carries_the_mechanisms_and_h200_has_the_defaults():
    for name in hardware.list_gpus():
        doc = json.loads((profiles_dir() / f"{name}.json").read_text())
        assert set(doc["signalling"]) == {f.name for f in dataclasses.fields(Signalling)}
        assert set(doc["incast"]) == {f.name for f in dataclasses.fields(Incast)}
    # h200.json is the calibration's output: fence and polling lanes from the one-H200
    # signalling probe, the fence window and incast the stated values (the dataclass defaults);
    # the jitter mean is now the measured 0.086 us, not the 0.1 us default
    # (tests/test_sim_schedule_calibrate.py checks the values against the fit)
    gpu = load_gpu("h200")
    want = Signalling(completion_jitter_us=gpu.signalling.completion_jitter_us)
    assert gpu.signalling == want and gpu.incast == Incast()
    assert gpu.signalling.completion_jitter_us == pytest.approx(0.086, abs=5e-4)
    assert hardware.GpuProfile.from_dict(gpu.to_dict()) == gpu


def test_bad_mechanism_parameters_are_rejected():
    with pytest.raises(ValueError, match="Signalling"):
        Signalling(completion_jitter_us=-1.0)
    with pytest.raises(ValueError, match="Incast"):
        Incast(efficiency_min=0.0)


# -- push signalling ------------------------------------------------------------------------------


def test_fence_is_linear_in_outstanding_bytes_up_to_the_inflight_window():
    s = Signalling(fence_inflight_bytes_per_sm=16384.0)
    fixed, sms, drain = 0.5, 24, 800e3  # us, SMs, bytes/us
    window = 16384.0 * sms
    for x in (0.0, 1e4, 1e5, window):
        assert s.fence_us(fixed, x, sms, drain) == pytest.approx(fixed + x / drain, rel=1e-12)
    # beyond the window only the bytes still in flight drain
    assert s.fence_us(fixed, 10 * window, sms, drain) == pytest.approx(fixed + window / drain)
    assert Signalling.off().fence_us(fixed, 1e9, sms, drain) == fixed


def test_poll_sweep_grows_with_the_flags_polled():
    s = Signalling(flag_poll_lanes=32)
    load = 0.146
    got = [s.poll_us(n, load) for n in (1, 32, 33, 64, 65)]
    assert got == pytest.approx([load, load, 2 * load, 2 * load, 3 * load])
    assert Signalling.off().poll_us(64, load) == 0.0


@pytest.mark.parametrize("n", [1, 2, 8, 63])
def test_expected_last_of_n_senders_is_the_harmonic_number_times_the_mean(n):
    b = LayerBuilder(TINY, CFG, plan_for(TINY))
    mean = b.signalling.completion_jitter_us
    trials = 20000
    last = b.completion_jitter(7, (trials, n)).max(axis=1)
    h_n = sum(1.0 / k for k in range(1, n + 1))
    # the max of n iid exponentials has variance mean^2 * sum 1/k^2 (< 1.65 mean^2)
    sem = mean * np.sqrt(sum(1.0 / k**2 for k in range(1, n + 1)) / trials)
    assert last.mean() == pytest.approx(h_n * mean, abs=4 * sem)


def test_jitter_is_reproducible_per_seed_and_tag():
    b = LayerBuilder(TINY, CFG, plan_for(TINY))
    a1, a2 = b.completion_jitter(0, (8, 4)), b.completion_jitter(0, (8, 4))
    np.testing.assert_array_equal(a1, a2)
    assert not np.array_equal(a1, b.completion_jitter(1, (8, 4)))
    other = Workload("tiny", 256, 8, "hgx-h200", "hot:0.3", seed=2)
    b2 = LayerBuilder(other, CFG, plan_for(other))
    assert not np.array_equal(a1, b2.completion_jitter(0, (8, 4)))


def test_push_dispatch_signal_is_fence_flag_and_jitter_of_each_sender():
    b = LayerBuilder(TINY, CFG.replace(dispatch_mode="push"), plan_for(TINY))
    g = b.build()
    jit = b.completion_jitter(0, (b.num_ranks, b.rc.max_rounds))
    fences = [(t, nb, ex) for t, nb, ex in b._fences if g.round[t] >= 0]
    assert fences
    for t, nbytes, extra in fences:
        s, m = g.rank[t], g.round[t]
        want = b.fence + min(nbytes, 16384.0 * CFG.num_comm_sms) / b.push_drain
        assert g.duration[t] == pytest.approx(want + b.flag_remote + jit[s, m], rel=1e-12)
        assert extra == pytest.approx(b.flag_remote + jit[s, m])


def test_retime_keeps_the_fences_of_a_fresh_build():
    from sim.layer.model import simulate_many

    cfgs = [CFG.replace(dispatch_mode="push", num_comm_sms=n) for n in (8, 16, 32)]
    shared = [r.layer_us for r in simulate_many(TINY, cfgs)]
    fresh = [simulate(TINY, c).layer_us for c in cfgs]
    assert shared == pytest.approx(fresh, rel=1e-12)


def test_pull_dispatch_has_no_per_sender_wait():
    a = simulate(TINY, CFG.replace(dispatch_mode="pull", combine_mode="pull"))
    b = LayerBuilder(TINY, CFG.replace(dispatch_mode="pull", combine_mode="pull"), plan_for(TINY))
    b.build()
    # pull dispatch and pull combine fence no remote stores: only the fixed part remains
    assert all(nbytes == 0.0 for _, nbytes, _ in b._fences)
    assert a.layer_us > 0


# -- incast ---------------------------------------------------------------------------------------


def test_incast_efficiency_is_one_for_one_writer_and_falls_monotonically():
    inc = Incast(efficiency_min=0.8, writers_half=8.0)
    n = np.arange(1, 200)
    e = inc.efficiency(n)
    assert e[0] == 1.0
    assert np.all(np.diff(e) < 0) and np.all(e > 0.8)
    assert inc.efficiency(9) == pytest.approx(0.9)  # half-way at 1 + writers_half
    assert np.all(Incast.off().efficiency(n) == 1.0)


@pytest.mark.parametrize("kind", ["push", "pull"])
def test_many_writers_into_one_port_closed_form(kind):
    """7 ranks move B bytes each into rank 0: push (7 writers into rank 0's port) runs at
    efficiency(7) of the port, pull (rank 0 reads, one receiver) at the full port."""
    b = LayerBuilder(TINY, CFG.replace(num_comm_sms=64), plan_for(TINY))
    b.g = Graph()
    n, size = 8, 4.0e6
    writers = np.zeros(n)
    writers[0] = n - 1
    if kind == "push":
        for s in range(1, n):
            peer = np.zeros(n)
            peer[0] = size
            b.transfer(s, "push", False, peer, 0.0, [], s, "x", 0, writers=writers)
        eff = b.incast.efficiency(n - 1)
    else:
        b.transfer(0, "pull", True, np.r_[0.0, np.full(n - 1, size)], 0.0, [], 0, "x", 0)
        eff = 1.0
    run = run_graph(b.g, b.topo.capacities(b.gpu))
    a = b.gpu.protocol[kind].data_bytes_per_byte
    wire = b.gpu.nvlink_wire_gbps * 1e3
    lat = b.topo.remote_latency_us(b.gpu) * (0.5 if kind == "push" else 1.0)
    engine = b.rates.push if kind == "push" else b.rates.pull
    total = (n - 1) * size
    # the destination port binds (7 engines push, one engine pulls at its own rate)
    per_port = total * a / (wire * eff)
    per_engine = size / engine if kind == "push" else total / engine
    assert run.makespan_us == pytest.approx(lat + max(per_port, per_engine), rel=1e-6)


def test_remote_writers_counts_other_senders_per_destination_and_round():
    rows = np.zeros((3, 2, 3))
    rows[0, 0, :] = [5, 1, 1]  # dst 0 round 0: itself and two others
    rows[1, 1, 0] = 2
    w = remote_writers(rows)
    assert w.tolist() == [[2, 0], [0, 1], [0, 0]]


def test_direct_link_has_no_incast():
    wl = Workload("tiny", 256, 2, "h200x2", "hot:0.3", seed=1)
    assert LayerBuilder(wl, CFG, plan_for(wl)).incast is None


# -- everything off: the model of before ----------------------------------------------------------


def _rx_tx(b) -> tuple[float, float]:
    from sim.core.topology import NVL_RX, NVL_TX

    ptr, rid, coef, size = b.g.flows.arrays()
    used = np.zeros(b.topo.num_resources)
    for f in range(size.shape[0]):
        np.add.at(used, rid[ptr[f] : ptr[f + 1]], coef[ptr[f] : ptr[f + 1]] * size[f])
    t = b.topo
    rx = sum(used[t.res(g, NVL_RX)] for g in range(t.num_gpus))
    tx = sum(used[t.res(g, NVL_TX)] for g in range(t.num_gpus))
    return rx, tx


@pytest.mark.parametrize("combine", ["push", "pull"])
def test_mechanisms_off_give_the_constant_signalling_of_before(combine, monkeypatch):
    """Off: every fence is the constant ``fence_us`` + one remote flag, the push dispatch's
    poll is ``flag_poll_us_per_peer`` per sender, no jitter and no incast (every wire byte
    leaving a port enters another)."""
    _off(monkeypatch, "h200")
    cfg = CFG.replace(dispatch_mode="push", combine_mode=combine)
    b = LayerBuilder(TINY, cfg, plan_for(TINY))
    g = b.build()
    assert b._fences
    for t, _, _ in b._fences:
        assert g.duration[t] == pytest.approx(b.fence + b.flag_remote, rel=1e-12)
    has = b.rc.rows > 0
    fence_tasks = {f for f, _, _ in b._fences}
    polls = [
        t
        for t in range(len(g))
        if g.phase[t] == "signal" and g.round[t] >= 0 and g.deps[t]
        if all(d in fence_tasks for d in g.deps[t])
    ]
    assert polls
    for t in polls:
        n = int(has[g.rank[t], g.round[t]].sum())
        assert g.duration[t] == pytest.approx(cfg.flag_poll_us_per_peer * n, rel=1e-12)
    rx, tx = _rx_tx(b)
    assert rx == pytest.approx(tx, rel=1e-12)


def test_incast_charges_the_destination_ports_only_for_push():
    b = LayerBuilder(TINY, CFG.replace(dispatch_mode="push"), plan_for(TINY))
    b.build()
    rx, tx = _rx_tx(b)
    assert rx > tx * 1.01  # lost wire slots at the hot destinations' ports
    b = LayerBuilder(TINY, CFG.replace(dispatch_mode="pull", combine_mode="pull"), plan_for(TINY))
    b.build()
    rx, tx = _rx_tx(b)
    assert rx == pytest.approx(tx, rel=1e-12)


def test_ep2_pull_is_untouched_by_the_mechanisms(monkeypatch):
    """On the fitted machine (h200x2) a pull/pull layer does not see them at all."""
    wl = Workload("deepseek-v3", 512, 2, "h200x2", "hot:0.3", seed=3)
    cfg = SimConfig(dispatch_mode="pull", combine_mode="pull", minibatch_size=1024)
    on = simulate(wl, cfg).layer_us
    _off(monkeypatch, "h200")
    assert simulate(wl, cfg).layer_us == pytest.approx(on, rel=1e-12)


# -- the dedup fold's bytes -----------------------------------------------------------------------


@pytest.mark.parametrize("dtype", ["bf16", "mxfp8"])
def test_dedup_fold_is_charged_in_copied_bytes(dtype):
    """The fold reads a bf16 row and the fp32 partial and writes the partial (10 bytes of
    traffic per element): 5 copied bytes per element on the local copy curve, whatever the
    dispatch dtype."""
    cfg = CFG.replace(dispatch_mode="dedup_pull", dtype=dtype)
    b = LayerBuilder(TINY, cfg, plan_for(TINY))
    b.build()
    rc, h = b.rc, TINY.model_shape.hidden
    fanout = sum(
        float(rc.rows[d, m].sum() - rc.uniq_first[d, m].sum() + rc.uniq_first[d, m, d])
        for d in range(b.num_ranks)
        for m in range(int(rc.num_rounds[d]))
    )
    folded = sum(
        max(0.0, float(rc.rows[d, m].sum() - (rc.uniq_last[d, m].sum() - rc.uniq_last[d, m, d])))
        for d in range(b.num_ranks)
        for m in range(int(rc.num_rounds[d]))
    )
    want = fanout * b.dispatch_row_bytes + folded * h * 5.0
    assert FOLD_COPY_BYTES_PER_TRAFFIC_BYTE * cfg.dedup_accumulate_bytes_per_elem == 5.0
    assert b.payload_bytes["local"] == pytest.approx(want, rel=1e-12)


def test_signalling_sensitivity_runs_on_a_tiny_grid(tmp_path):
    """sim.app.plots: the rows and the figure of one assumption's sweep, and the writer (two
    values, one skew, the tiny shape); the preset's profile is restored afterwards."""
    from sim.app.plots import (
        SIGNALLING_ASSUMPTIONS,
        signalling_sensitivity,
        signalling_sensitivity_rows,
        write_signalling_sensitivity,
    )

    kw = {"shape": "tiny", "topology": "hgx-h200", "ep": 8, "tokens": 256, "skews": ("hot:0.3",)}
    cfg = SimConfig(num_comm_sms=16, minibatch_size=256, macrobatch_size=512)
    before = load_gpu("h200")
    rows = signalling_sensitivity_rows("jitter_us", [0.0, 1.0], cfg=cfg, **kw)
    assert load_gpu("h200") is before
    assert len(rows) == 2 * 3 and {r["mode"] for r in rows} == {
        "push/push",
        "pull/push",
        "pull/pull",
    }
    by = {(r["value"], r["mode"]): r["layer_us"] for r in rows}
    # jitter delays push completions and the schedule's two all-rank handshakes: pull/pull (no
    # push flag) moves by the handshakes' share alone, less than push/push
    pull = by[(1.0, "pull/pull")] - by[(0.0, "pull/pull")]
    push = by[(1.0, "push/push")] - by[(0.0, "push/push")]
    assert 0 < pull < push
    fig = signalling_sensitivity(rows)
    assert len(fig.axes) == 2
    out = write_signalling_sensitivity(
        tmp_path, ["incast_e_min"], {"incast_e_min": [0.8, 1.0]}, cfg=cfg, **kw
    )
    assert [p.name for p in out] == ["signalling-sensitivity-incast-e-min.png"]
    assert out[0].stat().st_size > 10_000
    assert set(SIGNALLING_ASSUMPTIONS) >= {
        "incast_e_min",
        "incast_n_half",
        "fence_inflight_kib",
        "jitter_us",
    }


def test_an_all_rank_handshake_grows_with_the_rank_count():
    """The flag's latency, one sweep per 32 flags and the latest of R - 1 jitters: EP64 pays
    two sweeps and about H_63 x the jitter mean more than EP2; no jitter at one rank."""
    from sim.core.topology import get_topology
    from sim.core.transfer import TransferBuilder

    topo = get_topology("gb300-nvl72")
    us = {n: TransferBuilder(topo, n, 0.5, "round").handshake_us(0) for n in (1, 2, 64)}
    b1 = TransferBuilder(topo, 1, 0.5, "round")
    assert us[1] == pytest.approx(b1.flag_remote + b1.poll_us(1))
    assert us[1] < us[2] < us[64]
    sig, load = topo.gpu.signalling, topo.gpu.local_load_latency_us
    sweeps = (64 + sig.flag_poll_lanes - 1) // sig.flag_poll_lanes
    late = us[64] - b1.flag_remote - sweeps * load
    assert 0 < late < 20 * sig.completion_jitter_us  # the max of 63 exponentials (mean ~4.7x)
