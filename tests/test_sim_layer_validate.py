"""mok-sim validate on the fused-layer measurements: metrics on the committed layer CSVs, the
model's terms, the fitted profile, CLI.

The metric checks recompute every prediction from the committed snapshots of
``mok.bench layer`` and ``sweep`` at git c1bf59f (``h200x2-layer-2026-11-30.csv``,
``h200x2-layer-sweep-2026-11-30.csv`` in ``mok/bench/results``), the
two DeepSeek-V3 sweep re-runs and the committed fused profile (CPU only, a few seconds) and pin
today's numbers with a small margin, so a model change that makes them worse fails here. Fit
rows (:func:`sim.measured.is_fused_fit_row`): of the two snapshots, DeepSeek-V3 and
Qwen3-30B-A3B uniform dedup_pull, and Qwen3's pull at 8 SMs; held out: DeepSeek-V3 pull, Qwen3
pull at 16/32 SMs, Kimi-K2, hot:0.5 and every row of the re-runs.
"""

from __future__ import annotations

import csv
import math

import numpy as np
import pytest

from sim.app.cli import main
from sim.app.validate import rerun_spearman, spearman, summarise, validate_layer_rows
from sim.core.hardware import load_gpu
from sim.fused.fit import FINE_GRIDS, FUSED_KNOBS, objective
from sim.fused.model import fused_layer
from sim.fused.profile import FusedProfile, load_fused_profile
from sim.fused.tiles import STAGE_BYTES, kblock_us, run_tiles, tile_order
from sim.measured import is_fused_fit_row, measured_path, read_rows

LAYER = measured_path("h200x2-layer-2026-11-30.csv")
SWEEP = measured_path("h200x2-layer-sweep-2026-11-30.csv")
COMM = measured_path("h200x2-comm-2026-11-30.csv")
# DeepSeek-V3 sweep measured twice more (same kernel code, 40 iterations): held out
RERUNS = tuple(measured_path(f"h200x2-layer-sweep-rerun{i}-2026-11-30.csv") for i in (1, 2))


@pytest.fixture(scope="module")
def both():
    rows = read_rows(LAYER, SWEEP)
    recs = validate_layer_rows(rows, load_fused_profile())
    return rows, recs, summarise(recs)


def _stats(recs, **match) -> tuple[int, float, float]:
    errs = [
        abs(r["err"])
        for r in recs
        if r["status"] == "ok" and all(str(r[k]) == str(v) for k, v in match.items())
    ]
    return len(errs), float(np.median(errs)), max(errs)


def _group(s, model, skew="uniform"):
    (g,) = [g for g in s["groups"] if g["model"] == model and g["skew"] == skew]
    return g


def test_layer_metrics_all_and_holdout(both):
    """Today: validation (14 rows) median 1.4 %, max 5.4 %; fit (16) 0.5 % / 5.0 %."""
    _, recs, s = both
    # NCCL, DeepEP (24/64/128 SMs; none for Kimi-K2) and mok-unfused: baselines
    assert s["by_status"] == {"ok": 30, "baseline": 24}
    v, f, a = s["validation"], s["fit"], s["all"]
    assert (v["n"], f["n"], a["n"]) == (14, 16, 30)
    assert v["median_abs_err"] <= 0.016 and v["max_abs_err"] <= 0.06
    assert f["median_abs_err"] <= 0.007 and f["max_abs_err"] <= 0.055
    assert a["median_abs_err"] <= 0.011 and a["max_abs_err"] <= 0.06
    # held out by mode, shape and skew
    n, med, mx = _stats(recs, model="deepseek-v3", mode="pull")
    assert n == 6 and med <= 0.02 and mx <= 0.06  # worst: 8 SMs mb 2048, +5.4 % on a 7313 us run
    n, _, mx = _stats(recs, model="qwen3-30b-a3b", mode="pull", role="validation")
    assert n == 4 and mx <= 0.02  # 16 and 32 SMs; worst -1.8 % at 32 SMs
    n, _, mx = _stats(recs, model="kimi-k2")
    assert n == 2 and mx <= 0.025  # uniform -2.1 %, hot:0.5 -0.3 %
    n, _, mx = _stats(recs, skew="hot:0.5")
    assert n == 3 and mx <= 0.012  # worst: Qwen3 -0.9 %
    assert s["targets"]["median_abs_err"] and s["targets"]["max_abs_err"]


def test_ranking_on_the_committed_sweep(both):
    """Qwen3's 12 configurations span 39 % and rank at 0.986, gap 0 %. DeepSeek-V3's span 21.6
    %: the model picks the measured best (pull, 8 SMs, mb 2048; gap 0 %) but ranks the group at
    only 0.775. Its 4 configs at 16 SMs are measured within 0.9 % of each other; the model ties
    them, and so it does the 4 at 32 SMs, where this run has one row (dedup_pull, mb 4096) 3 %
    below both re-runs. The runs rank the 12 configs differently (test_reruns_held_out)."""
    _, recs, s = both
    qw, ds = _group(s, "qwen3-30b-a3b"), _group(s, "deepseek-v3")
    assert qw["configs"] == ds["configs"] == 12
    assert qw["role"] == ds["role"] == "validation"  # pull rows held out in both
    assert qw["spearman"] >= 0.98 and qw["gap"] <= 0.005  # 0.986, 0.0 %
    assert qw["spread"] >= 0.38 and qw["band_overlap"] <= 0.03  # 39.1 %, 2 %
    assert ds["spread"] >= 0.21  # 21.6 %
    assert ds["band_overlap"] == pytest.approx(0.606, abs=0.01)  # 40 of 66 pairs
    assert ds["chosen"] == ds["best"] == "mok-fused:pull@8/mb2048" and ds["gap"] == 0.0
    assert 0.75 <= ds["spearman"] < 0.9  # 0.775: missed
    rep = [
        r["measured_us"]
        for r in recs
        if r["model"] == "deepseek-v3"
        and r["skew"] == "uniform"
        and r["impl"] == "mok-fused"
        and (r["mode"], r["sms"], r["minibatch"]) == ("dedup_pull", "16", "4096")
    ]
    assert len(rep) == 2 and max(rep) / min(rep) - 1 == pytest.approx(0.0084, abs=1e-3)
    # 1 % of per-config noise would leave two runs of this sweep agreeing at about 0.88
    meas = [
        r["measured_us"] for r in recs if r["source"] == SWEEP.name and r["model"] == ds["model"]
    ]
    assert rerun_spearman(meas, 0.01, draws=400)[0] > 0.85  # 0.88
    assert not s["targets"]["spearman"] and s["targets"]["gap"]


def test_reruns_held_out():
    """The DeepSeek-V3 sweep measured twice more (40 iterations each, all rows held out): the
    model is within 2.3 % of every row, picks the measured best of both (pull, 8 SMs, mb 2048),
    and ranks them at 0.866 and 0.912. The two runs rank each other at 0.916, and the committed
    sweep at 0.916 and 0.825: the model is about as close to each run as the runs are to each
    other."""
    prof = load_fused_profile()
    runs = [read_rows(p) for p in RERUNS]
    for rows, (rho_min, err_max) in zip(runs, ((0.86, 0.022), (0.9, 0.025)), strict=True):
        recs = validate_layer_rows(rows, prof)
        s = summarise(recs)
        assert s["fit"]["n"] == 0 and s["validation"]["n"] == 12
        assert s["validation"]["median_abs_err"] <= 0.014  # 1.3 % both
        assert s["validation"]["max_abs_err"] <= err_max  # 2.0 %, 2.3 %
        (g,) = s["groups"]
        assert g["chosen"] == g["best"] == "mok-fused:pull@8/mb2048" and g["gap"] == 0.0
        assert rho_min <= g["spearman"] < rho_min + 0.03  # 0.866, 0.912
    key = ("mode", "sms", "minibatch")
    old = {
        tuple(r[k] for k in key): float(r["median_us"])
        for r in read_rows(SWEEP)
        if r["model"] == "deepseek-v3"
    }
    r1, r2 = ({tuple(r[k] for k in key): float(r["median_us"]) for r in rs} for rs in runs)
    assert set(r1) == set(r2) == set(old)
    cfgs = sorted(old)

    def rho(a, b):
        return spearman([a[c] for c in cfgs], [b[c] for c in cfgs])

    assert rho(r1, r2) == pytest.approx(0.916, abs=1e-3)
    assert (rho(old, r1), rho(old, r2)) == (
        pytest.approx(0.916, abs=1e-3),
        pytest.approx(0.825, abs=1e-3),
    )
    # the committed sweep's fastest row (7313 us) is 7 % below both re-runs of its config
    c = ("pull", "8", "2048")
    assert old[c] < 0.94 * min(r1[c], r2[c])


def test_dispatch_at_8_sms_and_the_soft_ceiling():
    """DeepSeek-V3 at 8 comm SMs, as a traced call shows it: pull hides its dispatch (its
    gate/up tiles waited 95 us per worker for their first stage, 80 at 16 SMs), dedup_pull
    exposes its dedup pull (435 and 552 us per worker at mb 2048 and 4096). And 124 workers
    are faster than 116: the operand ceiling is approached smoothly, not a hard maximum."""
    prof = load_fused_profile()
    pull8 = fused_layer("deepseek-v3", 4096, 2, "uniform", "pull", 8, 2048, prof)
    pull16 = fused_layer("deepseek-v3", 4096, 2, "uniform", "pull", 16, 2048, prof)
    assert pull8.terms["gemm_stall_us"] == 0.0 and pull16.terms["gemm_stall_us"] == 0.0
    for mb, exposed in ((2048, 424), (4096, 560)):  # trace minus the 16-SM wait: 355, 472
        r = fused_layer("deepseek-v3", 4096, 2, "uniform", "dedup_pull", 8, mb, prof)
        assert r.terms["gemm_stall_us"] == pytest.approx(exposed, abs=10)
    # the GEMM phase: 4.3 % shorter with 124 workers than with 116 (measured: 3.8 % in total)
    assert pull8.terms["gemm_busy_us"] / pull16.terms["gemm_busy_us"] - 1 == pytest.approx(
        -0.044, abs=0.003
    )
    gpu = load_gpu("h200")
    kb = [kblock_us(prof, gpu.tflops("bf16"), gpu.num_sms, w, 61.09) for w in (116, 124)]
    assert 1 < kb[1] / kb[0] < 124 / 116  # 0.821 -> 0.842 us per k-block


def test_layer_csv_alone_lists_baselines(capsys):
    assert main(["validate", str(LAYER), "--rows"]) == 0
    out = capsys.readouterr().out
    assert "baselines (measured, not predicted" in out and "targets" in out
    # the fused speedups over each baseline, measured vs predicted, from the same run
    lines = out.splitlines()
    (ds_nccl,) = [ln for ln in lines if ln.split()[:3] == ["deepseek-v3", "uniform", "nccl:a2a"]]
    assert "measured 1.75x, predicted 1.75x" in ds_nccl
    deepep = [ln.split()[0] for ln in lines if "deepep:normal" in ln]
    assert sorted(set(deepep)) == ["deepseek-v3", "qwen3-30b-a3b"] and len(deepep) == 12
    recs = validate_layer_rows(read_rows(LAYER), load_fused_profile())
    s = summarise(recs)
    assert s["fit"]["n"] == 2 and s["validation"]["n"] == 4
    assert s["validation"]["median_abs_err"] <= 0.01 and s["validation"]["max_abs_err"] <= 0.025
    assert any("torch._grouped_mm" in b for b in s["baselines"])


def test_cli_validate_layer_and_sweep(tmp_path, capsys):
    out_csv, out_png = tmp_path / "pred.csv", tmp_path / "pred.png"
    rc = main(["validate", str(LAYER), str(SWEEP), "--csv", str(out_csv), "--plot", str(out_png)])
    assert rc == 0
    text = capsys.readouterr().out
    assert "fused-layer model" in text and "spearman" in text and "spread" in text
    with open(out_csv, newline="") as f:
        got = list(csv.DictReader(f))
    assert len(got) == 54 and {"predicted_us", "sum_us", "first_ready_us", "source"} <= set(got[0])
    assert out_png.stat().st_size > 0
    assert main(["validate", str(LAYER), str(COMM)]) == 2
    assert "mix of layer CSVs" in capsys.readouterr().err


def test_tile_order_follows_the_kernel():
    """5 row blocks in minibatches of 2, 2, 1; shared expert over 2 row blocks; interleaved
    GU(0), GU(1), DN(0), GU(2), DN(1), DN(2) after shared GU and shared DN."""
    o = tile_order(640, 256, 200, hidden=512, intermediate=256, shared_intermediate=128)
    # (kind, row blocks x columns): shared GU 2x1, shared DN 2x2, GU 2x2, 2x2, DN 2x2, GU 1x2,
    # DN 2x2, DN 1x2
    runs = [(0, 2), (1, 4), (2, 4), (2, 4), (3, 4), (2, 2), (3, 4), (3, 2)]
    kinds = np.concatenate([np.full(n, k) for k, n in runs])
    np.testing.assert_array_equal(o.kind, kinds)
    assert o.num_minibatches == 3 and o.num_groups == 2 + 5
    np.testing.assert_array_equal(o.k_blocks[:6], [8, 8, 2, 2, 2, 2])  # K = hidden, then Is
    gu = o.kind == 2
    np.testing.assert_array_equal(o.wait_mb[gu], [0] * 4 + [1] * 4 + [2] * 2)
    np.testing.assert_array_equal(o.group[gu], [2, 2, 3, 3, 4, 4, 5, 5, 6, 6])
    dn = o.kind == 3
    np.testing.assert_array_equal(o.wait_group[dn], [2, 2, 3, 3, 4, 4, 5, 5, 6, 6])
    np.testing.assert_array_equal(o.k_blocks[dn], np.full(10, 4))  # K = intermediate
    assert np.all(o.wait_mb[~gu] == -1)
    assert not o.halves.any()  # regions padded to 128 rows: no block is split
    with pytest.raises(ValueError, match="num_rows=600 must be a multiple of 128"):
        tile_order(600, 256, 200, 512, 256, 128)
    with pytest.raises(ValueError, match="minibatch_rows=192 a positive multiple of 128"):
        tile_order(640, 192, 200, 512, 256, 128)


def test_tile_schedule_and_kblock_terms():
    """Each tile, in order, runs on the worker that frees first (the kernel's in-order claims
    from one counter) once its dependency is met; a k-block takes the worker's own rate or its
    share of the operand ceiling, whichever is slower."""
    gpu = load_gpu("h200")
    prof = FusedProfile(gemm_efficiency=0.5, tile_fixed_us=2.0, operand_tbps=math.inf)
    own = 2 * 128 * 256 * 64 / (gpu.tflops("bf16") * 1e6 / gpu.num_sms * 0.5)
    assert kblock_us(prof, gpu.tflops("bf16"), gpu.num_sms, 116, 10.0) == pytest.approx(own)
    capped = prof.replace(operand_tbps=1.0)
    shared = 116 * STAGE_BYTES / 1e6 - 2.0 / 10.0
    both = math.hypot(own, shared)  # the 2-norm: above either limit, the larger near the knee
    assert kblock_us(capped, gpu.tflops("bf16"), gpu.num_sms, 116, 10.0) == pytest.approx(both)
    # a share below zero (workers mostly outside their k-loops) leaves the worker's own rate
    assert kblock_us(capped, gpu.tflops("bf16"), gpu.num_sms, 1, 0.01) == pytest.approx(own)
    # 2 workers; tiles: GU of minibatch 0 (ready at 5 us) x2, then a DN tile waiting for both
    i64 = np.int64
    kb = np.array([1, 1, 1], dtype=i64)
    wait_mb = np.array([0, 0, -1], dtype=i64)
    wait_group = np.array([-1, -1, 0], dtype=i64)
    group = np.array([0, 0, -1], dtype=i64)
    end, busy = run_tiles(kb * 3.0 + 1.0, wait_mb, wait_group, group, 1, 2, np.array([5.0]), 0.5)
    # GU tiles 5..9 on workers 0 and 1; DN on worker 0 from 9 + 0.5 to 13.5
    assert (end, busy) == (pytest.approx(13.5), pytest.approx(8.0))
    # 3 GU tiles of 3, 1, 1 k-blocks: tile 2 goes to worker 1 (free at 9), not to worker 0
    # (t % W, free at 15): it ends at 13 and worker 0's 5..15 ends the phase
    kb = np.array([3, 1, 1], dtype=i64)
    wait_mb = np.array([0, 0, 0], dtype=i64)
    wait_group = np.array([-1, -1, -1], dtype=i64)
    group = np.array([0, 0, 0], dtype=i64)
    end, busy = run_tiles(kb * 3.0 + 1.0, wait_mb, wait_group, group, 1, 2, np.array([5.0]), 0.5)
    assert (end, busy) == (pytest.approx(15.0), pytest.approx(10.0))


def test_tile_schedule_matches_a_plain_argmin():
    """_run_tiles keeps its workers in a heap by (free time, id); the plain loop it replaces
    took argmin(free), the lowest id among ties. Integer durations make ties common."""
    rng = np.random.default_rng(0)
    n, groups, workers = 600, 40, 7
    kb = rng.integers(1, 5, n)
    wait_mb = np.where(rng.random(n) < 0.3, rng.integers(0, 3, n), -1)
    group = np.where(wait_mb >= 0, rng.integers(0, groups, n), -1)
    wait_group = np.where((wait_mb < 0) & (rng.random(n) < 0.5), rng.integers(0, groups, n), -1)
    ready = np.array([0.0, 5.0, 40.0])
    free, busy, done = np.zeros(workers), np.zeros(workers), np.zeros(groups)
    for t in range(n):
        w = int(np.argmin(free))
        start = free[w]
        if wait_mb[t] >= 0:
            start = max(start, ready[wait_mb[t]])
        elif wait_group[t] >= 0:
            start = max(start, done[wait_group[t]] + 1.0)
        free[w] = start + kb[t] * 2.0 + 1.0
        busy[w] += kb[t] * 2.0 + 1.0
        if group[t] >= 0:
            done[group[t]] = max(done[group[t]], free[w])
    last = int(np.argmax(free))
    got = run_tiles(kb * 2.0 + 1.0, wait_mb, wait_group, group, groups, workers, ready, 1.0)
    assert got == (free[last], busy[last])


def test_fused_layer_sum_and_fixed_terms():
    """The final weighted sum reads num_tokens x (top-k + shared) slot rows and writes one row
    per token at the device-copy rate; schedule and launch come from the comm profile."""
    prof = load_fused_profile()
    gpu = load_gpu("h200")
    r = fused_layer("deepseek-v3", 4096, 2, "uniform", "dedup_pull", 16, 4096, prof)
    traffic = (4096 * 8 + 4096 + 4096) * 7168 * 2
    assert r.terms["sum_us"] == pytest.approx(traffic / (2 * gpu.hbm_copy_gbps * 1e3))
    assert r.terms["schedule_us"] == r.terms["launch_us"] == 32.0
    assert r.layer_us == r.device_us > r.host_us  # device-bound, like every measured row
    parts = ("schedule_us", "launch_us", "gemm_busy_us", "gemm_stall_us", "signal_us", "sum_us")
    assert r.device_us == pytest.approx(sum(r.terms[k] for k in parts))
    # DeepSeek-V3: the dedup pull hides under the shared expert at 16 SMs
    assert r.terms["gemm_stall_us"] == 0.0 and r.terms["first_ready_us"] > 0
    # Qwen3 has no shared expert: the first minibatch's dispatch is exposed
    q = fused_layer("qwen3-30b-a3b", 4096, 2, "uniform", "dedup_pull", 16, 4096, prof)
    assert q.terms["gemm_stall_us"] >= q.terms["first_ready_us"] > 0
    with pytest.raises(ValueError, match="mode must be pull or dedup_pull"):
        fused_layer("deepseek-v3", 4096, 2, "uniform", "push", 16, 4096, prof)
    with pytest.raises(ValueError, match="must leave GEMM workers"):
        fused_layer("deepseek-v3", 4096, 2, "uniform", "pull", 132, 4096, prof)
    with pytest.raises(ValueError, match=r"row_tile in \(64, 128\) \(found 32\)"):
        fused_layer("deepseek-v3", 4096, 2, "uniform", "pull", 16, 4096, prof, row_tile=32)
    with pytest.raises(ValueError, match="minibatch % 128 == 0"):
        fused_layer("deepseek-v3", 4096, 2, "uniform", "pull", 16, 192, prof, row_tile=64)


def test_committed_profile_is_a_local_fit_minimum():
    """The committed knobs minimise the fit objective on the fit rows against a step of each
    knob to its neighbours on the fit's fine grids (the full search, ``mok-sim validate
    --refit``, takes a few minutes). gemm_efficiency sits at the grid's top, 1.0."""
    prof = load_fused_profile()
    fit = [r for r in read_rows(LAYER, SWEEP, *RERUNS) if is_fused_fit_row(r)]
    assert len(fit) == 16  # none from the re-runs
    assert sum(r["mode"] == "pull" for r in fit) == 2  # Qwen3 at 8 SMs
    best = objective(fit, prof)
    assert best == pytest.approx(prof.fit["objective"], abs=1e-4)
    assert prof.gemm_efficiency == FINE_GRIDS["gemm_efficiency"][-1] == 1.0
    for k in FUSED_KNOBS:
        grid = list(FINE_GRIDS[k])
        i = grid.index(getattr(prof, k))
        for j in (i - 1, i + 1):
            if 0 <= j < len(grid):
                assert objective(fit, prof.replace(**{k: float(grid[j])})) >= best


def test_fused_profile_round_trip_and_errors(tmp_path):
    prof = load_fused_profile()
    p = tmp_path / "f.json"
    prof.save(p)
    assert load_fused_profile(p) == prof
    assert all(k.split(":")[0] for k in prof.assumptions)
    with pytest.raises(ValueError, match="gemm_efficiency must be > 0"):
        FusedProfile(gemm_efficiency=0.0)
    with pytest.raises(ValueError, match="remote_rate_factor must be > 0"):
        FusedProfile(remote_rate_factor=-1.0)
    with pytest.raises(ValueError, match=r"half_kblock_factor must be in \(0, 1\]"):
        FusedProfile(half_kblock_factor=1.5)
    with pytest.raises(ValueError, match=r"half_fixed_factor must be in \[0, 1\]"):
        FusedProfile(half_fixed_factor=-0.1)
    with pytest.raises(ValueError, match="not found"):
        load_fused_profile("no-such-profile")


# Row tiles 64 and 128 (git 6760a48 and d561924, 20 iterations; all rows held out): the sweep of
# 72 uniform configs, and its re-run with hot:0.5 added (144 configs).
ROWTILE = tuple(
    measured_path(f"h200x2-layer-sweep-rowtile{s}-2026-11-30.csv") for s in ("", "-rerun")
)


def test_row_tile_sweeps_held_out():
    """The model on the two sweeps with row tiles 64 and 128 (no fit row among them): every
    row within 9.3 %, medians 2.4 % and 2.6 %; Spearman >= 0.9 for DeepSeek-V3 and Qwen3 in
    every group, below it for Kimi-K2, whose configurations come in near-tied pairs (row tile 64
    and 128 measure within 1 % of each other at the median) and whose two runs rank each other
    at 0.916; the pick within 3.1 % of the measured best in every group."""
    prof = load_fused_profile()
    want = {  # (median |err|, max |err|) bounds per CSV
        ROWTILE[0]: (0.026, 0.062),
        ROWTILE[1]: (0.028, 0.095),
    }
    for path, (med, mx) in want.items():
        s = summarise(validate_layer_rows(read_rows(path), prof))
        assert s["fit"]["n"] == 0
        assert s["validation"]["median_abs_err"] <= med
        assert s["validation"]["max_abs_err"] <= mx
        for g in s["groups"]:
            assert g["gap"] <= 0.032, g
            if g["model"] != "kimi-k2":
                assert g["spearman"] >= 0.9, g
