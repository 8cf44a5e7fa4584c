"""CPU contract of the probe's push-signalling sections (poll_cost, fence_cost, block_skew,
signal_jitter): arguments, the host-side arithmetic on kernel records, the JSON writer / reader
and :func:`sim.app.signalling_fit.fit_signalling` on synthetic probes with planted values."""

from __future__ import annotations

import ctypes
import json
import math
import random

import pytest

from mok.bench.probe import METHODS, SECTIONS, ProbeResults, parse_args, plan_points
from mok.bench.probe.args import FENCE_MAX_BYTES, fence_points
from mok.bench.probe.results import distribution
from mok.bench.probe.signalling import fence_block_times, round_trips_us, skew_stats
from sim.app.signalling_fit import fit_fence, fit_poll, fit_signalling
from sim.core.hardware import Signalling

SIG_SECTIONS = ["poll_cost", "fence_cost", "block_skew", "signal_jitter"]
META = {"gpu": "NVIDIA H200", "num_sms": 132, "l2_mb": 60.0, "num_ranks": 1, "git_sha": "test"}

# planted values of the synthetic probe
FENCE_US, WINDOW, DRAIN_GBPS = 0.7, 24576.0, 300.0
LOAD_US, LANES, PER_FLAG_US = 1.0, 32, 0.005
RT_MIN_US, JITTER_US = 1.6, 0.12


def _fence_us(n: int, b: int) -> float:
    return FENCE_US + n * min(b, WINDOW) / (DRAIN_GBPS * 1e3)


def _poll_ns(k: int) -> float:
    return 1e3 * (LOAD_US * math.ceil(k / LANES) + PER_FLAG_US * k)


def _round_trips() -> list[float]:
    """Two exponential completions of mean JITTER_US per round trip above RT_MIN_US (seeded)."""
    rng = random.Random(0)
    return [
        RT_MIN_US + rng.expovariate(1 / JITTER_US) + rng.expovariate(1 / JITTER_US)
        for _ in range(4000)
    ]


def _synthetic(target: str = "local") -> ProbeResults:
    res = ProbeResults(META)
    for scope in ("gpu", "sys"):
        for k in (1, 2, 4, 8, 16, 32, 64, 128):
            res.add_poll_cost(scope, "warp", k, _poll_ns(k))
            res.add_poll_cost(scope, "thread", k, 50.0 + 700.0 * k)
            res.add_poll_cost(scope, "thread_per_flag", k, _poll_ns(k) + 30.0)
    for n in (1, 8, 32, 132):
        for kib in (0, 1, 4, 16, 64, 256):
            t = _fence_us(n, kib * 1024)
            res.add_fence_cost(target, "sc", n, kib * 1024, t, 1.3 * t, 0.01 * kib)
            res.add_fence_cost(target, "release", n, kib * 1024, 0.5 * t, t, 0.01 * kib)
    res.add_block_skew(
        1,
        {
            "blocks": 132,
            "sms_seen": 132,
            "launches": 20,
            "spread_us": 2.5,
            "spread_max_us": 4.0,
            "p50_us": 1.1,
            "p90_us": 2.0,
            "p99_us": 2.4,
            "timer_step_ns": 32,
        },
    )
    rts = _round_trips()
    for scope in ("sys", "gpu"):
        res.add_signal_jitter("0<->0", scope, len(rts), distribution(rts))
    return res


def test_sections_flag_runs_only_the_named_sections():
    a = parse_args(["--sections", ",".join(SIG_SECTIONS)])
    assert a.sections == SIG_SECTIONS
    assert a.skip == [s for s in SECTIONS if s not in SIG_SECTIONS]
    assert set(plan_points(a, 132, 1)) == set(SIG_SECTIONS)
    b = parse_args(["--sections", "poll_cost,fence_cost", "--skip", "fence_cost"])
    assert [s for s in SECTIONS if s not in b.skip] == ["poll_cost"]
    assert parse_args([]).skip == [] and parse_args([]).sections == []
    with pytest.raises(SystemExit, match=r"unknown --sections section\(s\) \['fence'\]"):
        parse_args(["--sections", "fence"])


@pytest.mark.parametrize(
    "argv",
    [
        ["--poll-flags", "0"],
        ["--poll-flags", "1,256"],
        ["--poll-sweeps", "0"],
        ["--fence-sms", "0"],
        ["--fence-kib", "-1"],
        ["--skew-blocks", "5"],
    ],
)
def test_signalling_arguments_are_checked(argv):
    with pytest.raises(SystemExit, match=r"--poll-flags must lie in 1\.\.128"):
        parse_args(argv)


def test_fence_points_drop_sms_past_the_gpu_and_past_64_mib():
    a = parse_args(["--fence-sms", "1,66,200", "--fence-kib", "0,16,1024"])
    pts = fence_points(a, 132)
    assert pts == [(1, 0), (1, 16384), (1, 1 << 20), (66, 0), (66, 16384)]
    assert all(n * b <= FENCE_MAX_BYTES for n, b in fence_points(parse_args([]), 132))
    full, quick = parse_args([]), parse_args(["--quick"])
    plan, plan_q = plan_points(full, 132, 1), plan_points(quick, 132, 1)
    assert plan["fence_cost"] == 3 * len(fence_points(full, 132))
    assert plan_points(full, 132, 1, fence_peer=True)["fence_cost"] == 2 * plan["fence_cost"]
    assert plan["poll_cost"] == 2 * 3 * 8 and plan["block_skew"] == 2
    assert plan["signal_jitter"] == 2
    assert sum(plan_q[s] for s in SIG_SECTIONS) < sum(plan[s] for s in SIG_SECTIONS)


def test_distribution_quantiles_and_moments():
    d = distribution([4.0, 1.0, 3.0, 2.0, 5.0])
    assert d == pytest.approx(
        {"min": 1, "p50": 3, "mean": 3, "p90": 4.6, "p99": 4.96, "max": 5, "std": math.sqrt(2)}
    )
    assert distribution([7.0])["p99"] == 7.0
    with pytest.raises(ValueError, match="no values"):
        distribution([])


def test_fence_block_times_convert_each_blocks_clock():
    # block 0 at 2 cycles/ns, block 1 at 1 cycle/ns; fence 500 / 900 ns, stores 1000 / 400 ns
    rec = [
        [0, 100, 1000, 2100, 1600, 3100, 50_000, 100_100],
        [10, 0, 410, 400, 1400, 1300, 50_010, 50_000],
    ]
    med, worst, store = fence_block_times(rec)
    assert (med, worst, store) == pytest.approx((0.7, 0.9, 0.7))
    # without a clock reading: the globaltimer intervals
    assert fence_block_times([[0, 0, 1000, 0, 3000, 0, 0, 0]]) == pytest.approx((2.0, 2.0, 1.0))
    with pytest.raises(ValueError):
        fence_block_times([])


def test_skew_stats_spread_quantiles_and_timer_step():
    launch1 = [[1000 + 100 * i, i % 4, 32 if i else 0, 20000] for i in range(8)]  # 0.7 us
    launch2 = [[5000 + 300 * i, i % 4, 64, 20000] for i in range(8)]  # 2.1 us
    s = skew_stats([launch1, launch2])
    assert (s["blocks"], s["sms_seen"], s["launches"], s["timer_step_ns"]) == (8, 4, 2, 32)
    assert s["spread_us"] == pytest.approx(1.4) and s["spread_max_us"] == pytest.approx(2.1)
    offsets = [0.1 * i for i in range(8)] + [0.3 * i for i in range(8)]
    assert s["p90_us"] == pytest.approx(distribution(offsets)["p90"])
    with pytest.raises(ValueError):
        skew_stats([])


def test_round_trips_read_uint32_cycles():
    # 2 cycles per ns; -2 as int32 is 2**32 - 2 cycles (a saturated sample)
    got = round_trips_us([3000, 4000, -2], total_cycles=2_000_000, total_ns=1_000_000)
    assert got == pytest.approx([1.5, 2.0, (2**32 - 2) / 2e3])
    with pytest.raises(ValueError, match="no clock reading"):
        round_trips_us([1], 0, 10)


def test_writer_and_reader_round_trip_the_signalling_sections(tmp_path):
    res = _synthetic()
    res.skip("fence_cost.peer", "one GPU visible")
    path = tmp_path / "sig.json"
    res.write(path)
    doc = json.loads(path.read_text())
    r = doc["results"]
    assert set(r) == set(SIG_SECTIONS) and set(doc["methods"]) == set(SIG_SECTIONS)
    assert set(SIG_SECTIONS) <= set(METHODS)
    assert r["poll_cost"]["sys"]["warp"]["64"] == pytest.approx(_poll_ns(64), abs=0.05)
    assert set(r["poll_cost"]["gpu"]) == {"warp", "thread", "thread_per_flag"}
    pt = r["fence_cost"]["local"]["sc"]["32"]["16384"]
    assert set(pt) == {"fence_us", "fence_max_us", "store_us"}
    assert pt["fence_us"] == pytest.approx(_fence_us(32, 16384), abs=1e-4)
    assert r["block_skew"]["1"]["sms_seen"] == 132 and r["block_skew"]["1"]["timer_step_ns"] == 32
    jit = r["signal_jitter"]["sys"]["0<->0"]
    assert jit["samples"] == 4000 and set(jit["round_trip_us"]) == {
        "min", "p50", "mean", "p90", "p99", "max", "std",
    }  # fmt: skip
    rt = jit["round_trip_us"]
    assert jit["one_way_jitter_mean_us"] == pytest.approx((rt["mean"] - rt["min"]) / 2, abs=1e-5)
    assert jit["one_way_jitter_mean_us"] == pytest.approx(JITTER_US, rel=0.05)
    assert "Skipped: fence_cost.peer (one GPU visible)" in doc["what"]
    back = ProbeResults.read(path)
    assert back.to_json() == doc
    assert len(back.rows) == len(res.rows)
    text = back.table()
    assert "poll     warp sys ns/sweep" in text and "1/2/4/8/16/32/64/128:" in text
    assert "fence    local sc fence us at 132 SMs" in text
    assert "skew     start spread 1 block(s)/SM" in text
    assert "flag one-way jitter mean 0<->0 sys" in text


def test_writer_rejects_unknown_signalling_points():
    res = ProbeResults(META)
    with pytest.raises(ValueError, match=r"unknown poll point sys/lane"):
        res.add_poll_cost("sys", "lane", 4, 1.0)
    with pytest.raises(ValueError, match=r"unknown fence point local/membar"):
        res.add_fence_cost("local", "membar", 1, 0, 1.0, 1.0, 0.0)
    with pytest.raises(ValueError, match=r"unknown scope 'cta'"):
        res.add_signal_jitter("0<->0", "cta", 10, distribution([1.0]))


def test_fit_signalling_recovers_the_planted_values():
    doc = _synthetic().to_json()
    got = fit_signalling(doc)
    sig = got["signalling"]
    assert sig["fence_inflight_bytes_per_sm"] == pytest.approx(WINDOW, rel=0.02)
    assert sig["flag_poll_lanes"] == LANES
    assert sig["completion_jitter_us"] == pytest.approx(JITTER_US, rel=0.05)
    assert got["fence_us"] == pytest.approx(FENCE_US, rel=0.02)
    assert got["flag_poll_us_per_peer"] == pytest.approx(PER_FLAG_US, rel=0.02)
    fit = got["fit"]
    assert fit["fence_target"] == "local" and fit["fence_knee_reached"]
    assert fit["fence_drain_gbps"] == pytest.approx(DRAIN_GBPS, rel=0.03)
    assert fit["fence_us_empty"] == pytest.approx(FENCE_US)
    assert fit["poll_sweep_load_us"] == pytest.approx(LOAD_US, rel=0.01)
    assert fit["poll_sweep_overhead_us"] == pytest.approx(0.0, abs=1e-6)  # none planted
    # the planted release points are half the sequence: the part above the flag is the other half
    assert fit["fence_release_us"] == pytest.approx(FENCE_US / 2, rel=0.02)
    assert got["fence_us_above_flag"] == pytest.approx(FENCE_US / 2, rel=0.02)
    assert fit["poll_thread_us_per_flag"] == pytest.approx(0.7)
    assert fit["one_way_min_us"] == pytest.approx(RT_MIN_US / 2, rel=0.01)
    assert fit["start_skew_us"] == 2.5
    assert any("local stores" in n for n in got["notes"])
    prof_sig = Signalling(**sig)  # the profile section the values would replace
    assert prof_sig.poll_us(64, LOAD_US) == pytest.approx(2 * LOAD_US)


def test_fit_signalling_prefers_the_peer_fence_and_names_what_is_missing():
    res = _synthetic()
    for n in (1, 8, 32):
        for b in (0, 4096, 65536):
            res.add_fence_cost("peer", "sc", n, b, 2.0 + n * b / 1e6, 3.0, 0.0)
    got = fit_signalling(res.to_json())
    assert got["fit"]["fence_target"] == "peer" and got["fence_us"] == pytest.approx(2.0, rel=1e-4)
    assert not got["fit"]["fence_knee_reached"]  # linear up to the largest b: W a lower bound
    assert any("no knee" in n for n in got["notes"])
    doc = res.to_json()
    del doc["results"]["signal_jitter"]
    with pytest.raises(ValueError, match=r"lacks results.signal_jitter \(run: python -m mok"):
        fit_signalling(doc)
    with pytest.raises(ValueError, match=r"lacks results.poll_cost"):
        fit_signalling({"results": {"fence_cost": doc["results"]["fence_cost"]}})


def test_fit_fence_and_poll_edge_cases():
    flat = {str(n): {str(b): {"fence_us": 0.9} for b in (0, 4096, 65536)} for n in (1, 8)}
    assert fit_fence(flat) == {
        "fence_us": pytest.approx(0.9),
        "fence_inflight_bytes_per_sm": 0.0,
        "drain_gbps": None,
        "knee_reached": False,
    }
    with pytest.raises(ValueError, match=">= 3 fence_cost points"):
        fit_fence({"1": {"0": {"fence_us": 1.0}}})
    # one flag per lane up to 128: no step within the sweep, lanes = the largest N
    assert fit_poll({str(k): 800.0 for k in (1, 8, 32, 128)})["flag_poll_lanes"] == 128
    serial = fit_poll({str(k): 600.0 * k for k in (1, 2, 4, 8)})  # one load per flag
    assert serial["flag_poll_lanes"] == 1 and serial["sweep_load_us"] == pytest.approx(0.6)
    with pytest.raises(ValueError, match=">= 2 poll_cost points"):
        fit_poll({"1": 1.0})


def test_fit_poll_with_a_per_wait_overhead_keeps_the_warp_width():
    """A warp sweep whose first load per lane costs o + a and every further one a (the H200
    shape: flat to 32 flags, then one load latency per extra flag per lane): without ``o`` the
    form can pay the overhead only once by a wider L (64 here, a fit artifact), with it L = 32."""
    o, a = 0.12, 0.17
    pts = {str(k): 1e3 * (o + a * math.ceil(k / 32)) for k in (1, 2, 4, 8, 16, 32, 64, 128)}
    got = fit_poll(pts, overhead=True)
    assert got["flag_poll_lanes"] == 32
    assert got["sweep_overhead_us"] == pytest.approx(o, rel=1e-6)
    assert got["sweep_load_us"] == pytest.approx(a, rel=1e-6)
    assert got["per_flag_us"] == pytest.approx(0.0, abs=1e-9)
    assert fit_poll(pts)["flag_poll_lanes"] == 64
    # no step at all: the no-overhead answer (no sweep within the largest N)
    assert (
        fit_poll({str(k): 800.0 for k in (1, 8, 32, 128)}, overhead=True)["flag_poll_lanes"] == 128
    )


def test_fit_signalling_on_the_committed_h200_probe():
    """The one-H200 run (h200-probe-signalling-2026-12-01.json): the numbers docs/sim-validation.md
    quotes ("Push signalling")."""
    from sim.measured import SIGNALLING_FIT_PROBE, measured_path

    got = fit_signalling(json.loads(measured_path(SIGNALLING_FIT_PROBE).read_text()))
    f = got["fit"]
    assert got["fence_us"] == pytest.approx(2.214, abs=5e-4)
    assert f["fence_release_us"] == pytest.approx(0.645, abs=5e-4)
    assert got["fence_us_above_flag"] == pytest.approx(1.569, abs=5e-4)
    assert got["signalling"]["fence_inflight_bytes_per_sm"] == pytest.approx(6455, abs=1)
    assert f["fence_drain_gbps"] == pytest.approx(1233, abs=1)
    assert got["signalling"]["flag_poll_lanes"] == 32 and f["poll_lanes_without_overhead"] == 64
    assert got["flag_poll_us_per_peer"] == 0.0
    assert got["signalling"]["completion_jitter_us"] == pytest.approx(0.086, abs=5e-4)
    assert f["completion_jitter_gpu_scope_us"] == pytest.approx(0.045, abs=5e-4)
    assert f["one_way_spread_us"] == pytest.approx(0.150, abs=5e-4)
    assert f["poll_thread_us_per_flag"] == pytest.approx(0.153, abs=5e-4)
    assert (f["start_skew_us"], f["start_skew_2_per_sm_us"]) == (0.032, 0.064)


# ---- the sections end to end on a stand-in for the CUDA extension ------------------------------
def _words(ptr: int, n: int, ctype=ctypes.c_int64):
    return (ctype * n).from_address(ptr)


class FakeExt:
    """The probe kernels' records written as csrc/probe/probe.cu documents them, with the same
    arguments and checks (a bad call returns cudaErrorInvalidValue, 1)."""

    num_sms = 132

    def __init__(self):
        self.calls: dict[str, int] = {}

    def _count(self, name):
        self.calls[name] = self.calls.get(name, 0) + 1

    def probe_poll_flags(self, flags, k, mode, gpu_scope, target, warmup, sweeps, out, stream):
        self._count("poll")
        if not (1 <= k <= 128 and 0 <= mode <= 2 and sweeps >= 1 and warmup >= 0) or flags % 8:
            return 1
        assert all(v >= target for v in _words(flags, k))  # the flags are set
        _words(out, 8)[0] = sweeps * (100 + 10 * k + 1000 * mode + 5000 * gpu_scope)
        return 0

    def probe_fence_cost(self, dst, per_block, flags, flag_value, fence, grid, hold_ns, rec, s):
        self._count("fence")
        if per_block < 0 or per_block % 16 or not 0 <= fence <= 2 or not 1 <= grid <= 132:
            return 1
        assert grid * per_block <= FENCE_MAX_BYTES and hold_ns > 0 and flag_value >= 1
        r = _words(rec, grid * 8)
        for b in range(grid):  # 2 cycles per ns; stores 2 us; fence 0.5 us + 5 ns x block
            g0, c0 = 1000 * b, 7
            g1, c1 = g0 + 2000, c0 + 4000
            g2, c2 = g1 + 600, c1 + 1000 + 10 * b
            r[8 * b : 8 * b + 8] = [g0, c0, g1, c1, g2, c2, g0 + hold_ns, c0 + 2 * hold_ns]
        return 0

    def probe_block_skew(self, blocks_per_sm, grid, hold_ns, rec, stream):
        self._count("skew")
        if not 1 <= blocks_per_sm <= 4 or grid != blocks_per_sm * self.num_sms:
            return 1
        r = _words(rec, grid * 4)
        for b in range(grid):
            r[4 * b : 4 * b + 4] = [5000 + 10 * b, b % self.num_sms, 32, hold_ns]
        return 0

    def probe_pingpong_samples(self, f0, f1, gpu_scope, warmup, iters, timeout_ns, samples, out, s):
        self._count("jitter")
        if warmup < 0 or not 1 <= iters <= 28672 or (f0 | f1) % 8 or f1 - f0 < 128:
            return 1
        cyc = [3000 + 400 * (i % 10) for i in range(iters)]
        _words(samples, iters, ctypes.c_uint32)[:] = cyc
        o = _words(out, 8)
        o[7], o[0] = sum(cyc), sum(cyc) // 2
        return 0

    def probe_enable_peer_access(self, peer_device):
        return 0


def test_sections_run_on_a_stand_in_extension(tmp_path, monkeypatch):
    import torch
    import torch.distributed as dist

    from mok.bench.probe import signalling
    from mok.bench.probe.context import ProbeContext
    from mok.bench.probe.run import run_sections

    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(dist, "barrier", lambda *a, **k: None)
    monkeypatch.setattr(dist, "all_gather", lambda recs, t: recs[0].copy_(t))
    monkeypatch.setattr(signalling, "max_over_ranks", lambda v: [float(x) for x in v])
    out = tmp_path / "sig.json"
    a = parse_args(["--sections", ",".join(SIG_SECTIONS), "--out", str(out)])
    p = object.__new__(ProbeContext)
    p.a, p.res, p.rank, p.world, p.dev = a, ProbeResults(META), 0, 1, torch.device("cpu")
    p.num_sms, p.sms, p.timeout_ns, p.fence_peer = 132, a.sms, 10**10, None
    p.out, p.ext, p.write = torch.zeros(8, dtype=torch.int64), FakeExt(), print
    p.plan = plan_points(a, 132, 1)
    done = []
    p.bar = type("Bar", (), {"set_description": lambda *a, **k: None, "close": lambda s: None})()
    p.bar.update = lambda: done.append(1)
    p.stream = lambda: 0
    run_sections(p)
    assert len(done) == sum(p.plan.values())
    calls = p.ext.calls
    assert calls["poll"] == 3 * 2 * 3 * 8  # 3 launches x scopes x modes x flag counts
    assert calls["fence"] == (1 + a.iters) * 3 * len(fence_points(a, 132))
    assert calls["skew"] == 2 * (1 + 2 * a.iters) and calls["jitter"] == 2
    doc = json.loads(out.read_text())
    r = doc["results"]
    assert r["poll_cost"]["sys"]["warp"]["8"] == 180.0
    assert r["poll_cost"]["gpu"]["thread_per_flag"]["128"] == 100 + 1280 + 2000 + 5000
    pt = r["fence_cost"]["local"]["sc"]["8"]["16384"]
    assert pt == {"fence_us": 0.5175, "fence_max_us": 0.535, "store_us": 2.0}
    assert doc["skipped"]["fence_cost.peer"].startswith("stores into a peer GPU need")
    assert doc["skipped"]["hbm"] == "not in --sections"
    skew = r["block_skew"]["2"]
    assert (skew["blocks"], skew["sms_seen"], skew["timer_step_ns"]) == (264, 132, 32)
    assert skew["spread_us"] == pytest.approx(2.63)
    jit = r["signal_jitter"]["gpu"]["0<->0"]
    assert jit["samples"] == a.latency_iters
    assert jit["round_trip_us"]["min"] == 1.5 and jit["round_trip_us"]["max"] == 3.3
    assert jit["one_way_jitter_mean_us"] == pytest.approx(0.45)
    got = fit_signalling(doc)
    assert got["signalling"]["completion_jitter_us"] == pytest.approx(0.45)
    assert got["fit"]["fence_target"] == "local"
