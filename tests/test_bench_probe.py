"""CPU contract of ``python -m mok.bench probe``: arguments, the probe JSON writer (same schema as
the committed probe) and that ``mok-sim calibrate`` fits a profile from what the writer emits."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest

from mok.bench import __main__ as bench_main
from mok.bench.probe import METHODS, SECTIONS, ProbeResults, parse_args, plan_points
from mok.bench.probe.results import _replay
from mok.bench.probe.run import STEPS
from sim.app.calibrate import GEMM_FIT_MIN_ROWS, fit_gpu_profile, grouped_gemm_points
from sim.app.cli import main as sim_main
from sim.core.gemm import gemm_us
from sim.core.hardware import GpuProfile, profiles_dir
from sim.measured import measured_path
from tests import tolerances as tol

COMMITTED = measured_path("h200x2-probe-2026-11-29.json")  # raw probes: mok/bench/results
PROFILES = profiles_dir()  # the GPU profiles fitted from them
META = {"gpu": "NVIDIA H200", "num_sms": 132, "l2_mb": 60.0, "num_ranks": 2, "git_sha": "test"}


def _from_committed(probe: dict) -> ProbeResults:
    """Feed every number of the committed probe through the writer's add_* calls."""
    r = probe["results"]
    res = ProbeResults(META)
    res.add_p2p_access(r["p2p_access"])
    for pair, v in r["signal_latency"].items():
        res.add_signal(pair, v["round_trip_us"])
    for key, ns in r["remote_load_latency"].items():
        reader, mem, mb = map(int, re.fullmatch(r"reader(\d)_mem(\d)_(\d+)MB_ns", key).groups())
        res.add_load_latency(reader, mem, mb, ns)
    for kind in ("push", "pull", "local"):
        for n, v in r["p2p_bandwidth_by_sms"][kind].items():
            res.add_copy(kind, "st", int(n), v)
    res.add_memcpy_peer(r["p2p_bandwidth_by_sms"]["memcpyPeer_GBps"])
    res.add_bf16_gemm(r["bf16_gemm_and_copy"]["bf16_tflops"])
    res.add_hbm(1 << 30, r["bf16_gemm_and_copy"]["d2d_copy_GBps_rw"], 2300.0, 2200.0)
    for tokens, v in r["nccl_all_to_all"].items():
        res.add_a2a(int(tokens), v["ms"], v["GBps_out_per_gpu"])
    for kind in ("push", "pull"):
        for n, v in r["p2p_bidirectional_by_sms"][kind].items():
            res.add_copy(kind, "st", int(n), v["per_direction_GBps"], bidir=True)
    for key, points in r["tma_bulk_by_sms"].items():
        if key == "pull_copy_correct":
            res.add_copy_check("pull_tma_chunk16384", points)
            continue
        kind, way, chunk = re.fullmatch(r"(\w+)_(onedir|bidir)_chunk(\d+)", key).groups()
        for n, v in points.items():
            res.add_copy(kind, "tma", int(n), v, bidir=way == "bidir", chunk=int(chunk))
    return res


def _assert_same(got, want, path="results"):
    if isinstance(want, dict):
        assert isinstance(got, dict), path
        assert sorted(got) == sorted(want), f"{path}: keys {sorted(got)} != {sorted(want)}"
        for k in want:
            _assert_same(got[k], want[k], f"{path}.{k}")
    elif isinstance(want, bool):
        assert got is want, path
    else:
        # the writer rounds (GB/s to 0.1, so 2 x per-direction may differ by 0.1; latencies
        # to 1e-5 us and 0.01 ns)
        assert got == pytest.approx(want, rel=1e-4, abs=0.11 if "GBps" in path else 1e-5), path


def test_parse_args_fills_full_and_quick_defaults():
    full, quick = parse_args([]), parse_args(["--quick"])
    assert full.sms == [1, 2, 4, 8, 16, 32, 66, 132]
    assert full.chunks == [16384, 2048] and full.copy_mib == 1024 and full.latency_iters == 20000
    assert full.gemm_rows == [128, 256, 512, 1024, 2048, 4096]
    assert quick.quick and len(quick.sms) < len(full.sms) and quick.iters < full.iters
    assert quick.gemm_shapes == ["h7168_i2048", "h2048_i768"]
    assert (full.gemm_warm_s, quick.gemm_warm_s) == (2.0, 0.5)
    a = parse_args(["--sms", "4,8", "--skip", "green,peer", "--green-sms", "", "--out", "x.json"])
    assert (a.sms, a.skip, a.green_sms, a.out) == ([4, 8], ["green", "peer"], [], "x.json")


@pytest.mark.parametrize(
    ("argv", "match"),
    [
        (["--skip", "nvlink"], r"unknown --skip section\(s\) \['nvlink'\]; supported: hbm"),
        (["--gemm-shapes", "h1_i1"], r"unknown --gemm-shapes \['h1_i1'\]; supported: h7168_i2048"),
        (["--chunks", "1000"], r"TMA chunks must be positive multiples of 16"),
        (["--chunks", "16384", "--inflight", "10"], r"\(inflight \+ 4\) x chunk <= 220 KiB"),
        (["--iters", "0"], r"--iters, --latency-iters and --timeout-s must be positive"),
        (["--gemm-warm-s", "-1"], r"--gemm-warm-s must be >= 0 \(found -1.0\)"),
    ],
)
def test_bad_arguments_say_what_is_supported(argv, match):
    with pytest.raises(SystemExit, match=match):
        parse_args(argv)


def test_plan_skips_peer_parts_on_one_gpu_and_drops_sms_past_the_gpu():
    a = parse_args(["--quick"])
    one, two = plan_points(a, 132, 1), plan_points(a, 132, 2)
    assert one["peer"] == 0 and two["peer"] > 0
    assert one["local"] == 4 * (1 + 2) + 2 + 2  # 4 SM counts x (st + 2 chunks), 2 flags, 2 chases
    assert plan_points(a, 16, 1)["local"] == 2 * 3 + 4  # only 1 and 8 SMs fit on 16
    assert "green" not in plan_points(parse_args(["--skip", "green"]), 132, 1)


def test_writer_reproduces_the_committed_probe_schema():
    probe = json.loads(COMMITTED.read_text())
    doc = _from_committed(probe).to_json()
    assert set(doc) == {"what", "methods", "results", "meta", "skipped"}
    for key, want in probe["results"].items():
        _assert_same(doc["results"][key], want, f"results.{key}")
    assert set(doc["results"]) - set(probe["results"]) == {"hbm_bandwidth", "copy_checks"}
    assert set(doc["methods"]) == set(doc["results"]) and set(doc["methods"]) <= set(METHODS)
    assert doc["results"]["hbm_bandwidth"]["copy_GBps_rw"] == 4180.9
    assert "2x NVIDIA H200 (132 SMs, 60.0 MB L2)" in doc["what"]


def test_calibrate_accepts_the_writers_json(tmp_path, capsys):
    probe = json.loads(COMMITTED.read_text())
    path = tmp_path / "probe.json"
    _from_committed(probe).write(path)
    out = tmp_path / "h200.json"
    assert sim_main(["calibrate", str(path), "--out", str(out)]) == 0
    assert "max error" in capsys.readouterr().out
    got = GpuProfile.from_dict(json.loads(out.read_text()))
    want = fit_gpu_profile(probe)
    assert got.comm_curves.keys() == want.comm_curves.keys()
    for name, c in want.comm_curves.items():
        assert got.comm_curves[name].per_sm_gbps == pytest.approx(c.per_sm_gbps, rel=1e-3), name
        assert got.comm_curves[name].ceiling_max_gbps == pytest.approx(c.ceiling_max_gbps, rel=1e-3)
    assert got.flag_latency_remote_us == pytest.approx(want.flag_latency_remote_us, rel=1e-4)
    assert got.gemm_efficiency == want.gemm_efficiency  # no grouped-GEMM points: the guess


def test_calibrate_fits_gemm_efficiency_from_grouped_points(tmp_path):
    probe = json.loads(COMMITTED.read_text())
    res = _from_committed(probe)
    unit = GpuProfile(**{**fit_gpu_profile(probe).__dict__, "gemm_efficiency": 1.0})
    e = 8

    def model_us(hidden, inter, op, rows, sms, eff):
        k, n = (hidden, 2 * inter) if op == "gate_up" else (inter, hidden)
        return gemm_us(unit, e * math.ceil(rows / 128), n, k, sms) / eff

    for shape, (h, i) in {"h7168_i2048": (7168, 2048), "h2048_i768": (2048, 768)}.items():
        for op in ("gate_up", "down"):
            for rows in (128, 1024, 4096):
                eff = 0.8 if rows >= GEMM_FIT_MIN_ROWS else 0.3  # small rows: ignored by the fit
                res.add_grouped(shape, h, i, e, op, rows, 132, model_us(h, i, op, rows, 132, eff))
            for sms in (32, 66, 132):
                us = model_us(h, i, op, 2048, sms, 0.8)
                res.add_grouped(shape, h, i, e, op, 2048, sms, us, by="sms")
                # a green sweep and an ineffective carveout never enter the fit
                res.add_grouped(shape, h, i, e, op, 2048, sms, 1.0, by="sms", method="green")
        res.mark_sm_limit("grouped_gemm_by_sms", f"{shape}_rows2048", True, 3.9)
    res.add_grouped("h2048_i768", 2048, 768, e, "down", 1024, 16, 1.0, by="sms")
    res.mark_sm_limit("grouped_gemm_by_sms", "h2048_i768_rows1024", False, 1.0)
    path = tmp_path / "probe.json"
    res.write(path)
    doc = json.loads(path.read_text())
    entry = doc["results"]["grouped_gemm_by_rows"]["h7168_i2048"]
    assert (entry["hidden"], entry["intermediate"], entry["num_experts"]) == (7168, 2048, 8)
    assert set(entry["gate_up"]) == {"128", "1024", "4096"}
    assert set(doc["results"]["grouped_gemm_by_sms"]["h2048_i768_rows2048"]["down"]) == {
        "32",
        "66",
        "132",
    }
    pts = grouped_gemm_points(doc)
    assert len(pts) == 2 * 2 * (3 + 3)  # rows sweeps + effective SM sweeps, both shapes and ops
    prof = fit_gpu_profile(doc)
    # the writer rounds us to 0.01: the fit recovers the planted 0.8 to that precision
    assert prof.gemm_efficiency == pytest.approx(0.8, rel=2e-3)
    assert prof.fit["gemm_efficiency_points"] == 2 * 2 * (2 + 3)
    assert prof.assumptions[0].startswith("gemm_efficiency=0.80")
    assert fit_gpu_profile(doc, gemm_efficiency=0.5).gemm_efficiency == 0.5


def test_one_gpu_probe_is_written_but_calibrate_names_what_is_missing(tmp_path, capsys):
    res = ProbeResults({**META, "num_ranks": 1, "quick": True})
    for n, v in ((1, 48.0), (8, 380.0), (132, 1900.0)):
        res.add_copy("local", "st", n, v)
        res.add_copy("local", "tma", n, v * 0.9, chunk=16384)
    res.add_copy_check("local_st", True)
    res.add_signal("0<->0", 1.68)
    res.add_signal("0<->0", 1.2, gpu_scope=True)
    res.add_load_latency(0, 0, 1, 145.0)
    res.add_bf16_gemm(790.0)
    res.add_hbm(1 << 29, 4200.0, 3900.0, 3600.0)
    res.skip("peer", "need 2 GPUs under torchrun --nproc-per-node=2")
    path = tmp_path / "one.json"
    res.write(path)
    doc = json.loads(path.read_text())
    assert doc["skipped"] == {"peer": "need 2 GPUs under torchrun --nproc-per-node=2"}
    assert "Skipped: peer (need 2 GPUs" in doc["what"] and "Quick smoke run" in doc["what"]
    assert doc["results"]["signal_latency_gpu_scope"]["0<->0"] == {
        "round_trip_us": 1.2,
        "one_way_us": 0.6,
    }
    with pytest.raises(ValueError, match=r"lacks p2p_bandwidth_by_sms.push, .*two-GPU probe"):
        fit_gpu_profile(doc)
    assert sim_main(["calibrate", str(path), "--out", str(tmp_path / "p.json")]) == 2
    assert "the probe skipped peer: need 2 GPUs" in capsys.readouterr().err


def test_table_and_csv(tmp_path):
    res = _from_committed(json.loads(COMMITTED.read_text()))
    res.skip("green", "--skip")
    text = res.table()
    assert "copy     push st onedir" in text
    assert "1/2/4/8/16/24/32/48/66/132: 45.6/91.2/181/351/348/350/354/364/365/370 GB/s" in text
    assert "skipped  green: --skip" in text
    res.write_csv(tmp_path / "p.csv")
    lines = (tmp_path / "p.csv").read_text().splitlines()
    assert lines[0].startswith("family,case,x,value,unit,gpu")
    assert len(lines) == len(res.rows) + 1


def test_writer_rejects_unknown_points():
    res = ProbeResults(META)
    with pytest.raises(ValueError, match="unknown copy push/ld"):
        res.add_copy("push", "ld", 8, 1.0)
    with pytest.raises(ValueError, match="a local copy has no second direction"):
        res.add_copy("local", "st", 8, 1.0, bidir=True)
    with pytest.raises(ValueError, match="needs its chunk size"):
        res.add_copy("pull", "tma", 8, 1.0)
    with pytest.raises(ValueError, match="unknown grouped GEMM op 'up'"):
        res.add_grouped("s", 16, 16, 2, "up", 128, 132, 1.0)


def test_bench_entry_point_lists_probe(capsys):
    assert bench_main.main(["nope"]) == 2
    assert re.search(r"mok.bench \{[a-z,]*probe[a-z,]*\}", capsys.readouterr().err)
    with pytest.raises(SystemExit) as e:
        bench_main.main(["probe", "--help"])
    assert e.value.code == 0
    assert "--quick" in capsys.readouterr().out


MOK_PROBE = COMMITTED.with_name("h200x2-mok-probe-2026-11-30.json")


def test_mok_probe_on_two_h200_calibrates_to_the_committed_profiles(tmp_path):
    """The two-GPU run of ``python -m mok.bench probe`` (2026-11-30) gives the committed
    ``h200-mok-probe`` profile, and that profile agrees with ``h200`` (fitted from the
    independent 2026-11-29 measurements on the same machine): NVLink ceilings at the knee
    within 2 %,
    per-SM copy rates within 15 % (TMA: 3-14 % higher in the mok probe), flag latency within
    5 %, the bf16 tensor rate within 1 %."""
    out = tmp_path / "p.json"
    cmd = ["calibrate", str(MOK_PROBE), "--name", "h200-mok-probe", "--out", str(out)]
    assert sim_main(cmd) == 0
    got = GpuProfile.from_dict(json.loads(out.read_text()))
    committed = PROFILES / "h200-mok-probe.json"
    tol.assert_json_close(json.loads(out.read_text()), json.loads(committed.read_text()))
    ref = GpuProfile.from_dict(json.loads((PROFILES / "h200.json").read_text()))
    assert got.comm_curves.keys() == ref.comm_curves.keys()
    for name, c in ref.comm_curves.items():
        g = got.comm_curves[name]
        assert g.per_sm_gbps == pytest.approx(c.per_sm_gbps, rel=0.15), name
        if name.startswith(("push", "pull")):  # (the 11-29 TMA points stop at 32 SMs)
            assert g.ceiling_knee_gbps == pytest.approx(c.ceiling_knee_gbps, rel=0.02), name
    assert got.flag_latency_remote_us == pytest.approx(ref.flag_latency_remote_us, rel=0.05)
    assert got.tensor_tflops["bf16"] == pytest.approx(ref.tensor_tflops["bf16"], rel=0.01)


def _assert_close(got, want, path="", skip=()):
    """Same keys, numbers within the writer's rounding (TFLOP/s and GB/s recomputed from rounded
    times and rates)."""
    if isinstance(want, dict):
        keys = {k for k in want if f"{path}{k}" not in skip}
        assert keys <= set(got) and set(got) - keys <= {k for k in got if f"{path}{k}" in skip}
        for k in keys:
            _assert_close(got[k], want[k], f"{path}{k}.", skip)
    elif isinstance(want, bool):
        assert got is want, path
    else:
        assert got == pytest.approx(want, rel=2e-3, abs=0.11), path


def _probe_files() -> list[Path]:
    """The committed probe JSONs (what / methods / results), wherever they are kept."""
    root = Path(__file__).resolve().parents[1]
    found = [*root.glob("sim/profiles/*probe*.json"), *root.glob("mok/bench/results/**/*.json")]
    return sorted(p for p in found if "results" in json.loads(p.read_text()))


@pytest.mark.parametrize("path", _probe_files(), ids=lambda p: p.name)
def test_reader_reads_every_committed_probe(path, tmp_path):
    doc = json.loads(path.read_text())
    res = ProbeResults.read(path)
    assert res.results == doc["results"]
    assert res.meta == doc.get("meta", {}) and res.skipped == doc.get("skipped", {})
    out = res.to_json()
    assert set(out["methods"]) == set(doc["results"]) & set(METHODS)
    if "meta" in doc:  # written by mok.bench probe: its summary line comes back as written
        assert out["what"] == doc["what"]
    # every point goes through the writer's add_* calls: the same keys and (rounded) numbers, but
    # for the summaries of points a file may lack (the TMA pull check without copy_checks, the
    # d2d copy without hbm_bandwidth)
    fresh = ProbeResults({})
    _replay(fresh, doc["results"])
    lacks = {"tma_bulk_by_sms.pull_copy_correct", "bf16_gemm_and_copy.d2d_copy_GBps_rw"}
    _assert_close(fresh.results, doc["results"], skip=lacks)
    families = {r["family"] for r in res.rows}
    # a run with sections skipped (--skip: e.g. the dense GEMM sweep) holds only the rest
    assert families and len(res.table().splitlines()) >= len(families)
    if not any(k in res.skipped for k in ("local", "peer")):
        assert families >= {"latency", "copy"}
    res.write_csv(tmp_path / "p.csv")
    assert len((tmp_path / "p.csv").read_text().splitlines()) == len(res.rows) + 1


def test_reader_rejects_what_is_not_a_probe(tmp_path):
    profile = PROFILES / "h200.json"  # a fitted GPU profile, not a probe
    with pytest.raises(ValueError, match=r"not a probe JSON \(found \[.*\]\): python -m mok"):
        ProbeResults.read(profile)
    with pytest.raises(ValueError, match="not a probe JSON"):
        ProbeResults.from_json([1, 2])


def test_reader_round_trips_what_the_writer_wrote(tmp_path):
    res = _from_committed(json.loads(COMMITTED.read_text()))
    res.add_grouped("h2048_i768", 2048, 768, 8, "down", 1024, 66, 50.0, by="sms")
    res.add_grouped("h2048_i768", 2048, 768, 8, "down", 1024, 32, 60.0, by="sms", method="green")
    res.mark_sm_limit("grouped_gemm_by_sms", "h2048_i768_rows1024", True, 1.9)
    res.add_bf16_gemm_sustained(640.5, 1515.0, 2.0)
    res.skip("green", "--skip")
    res.write(tmp_path / "p.json")
    back = ProbeResults.read(tmp_path / "p.json")
    assert back.to_json() == json.loads((tmp_path / "p.json").read_text())
    gemm = back.to_json()["results"]["bf16_gemm_and_copy"]
    assert (gemm["bf16_tflops_sustained"], gemm["sustained_sm_mhz"]) == (640.5, 1515.0)
    cases = {(r["case"], r["value"], r["unit"]) for r in back.rows}
    assert ("bf16 matmul 8192^3 sustained", 640.5, "TFLOP/s") in cases
    assert ("bf16 matmul 8192^3 sustained SM clock", 1515.0, "MHz") in cases
    assert sorted(map(str, back.rows), key=str) != [] and back.table().endswith(
        "skipped  green: --skip"
    )


def test_sections_run_in_the_order_the_results_name_them():
    assert tuple(STEPS) == SECTIONS
