"""The fused model at row tile 64: expert regions padded to 64 rows, 128-row blocks that straddle
two experts (or end half-way) run as 64-row sub-tiles (csrc/layer.cuh ``routed_halves``).

Row tile 128 must predict what the model predicted before row tile 64 existed: the values below
were computed from the committed model before the change, for every fused configuration of the
committed layer CSVs and a few more of the tuner's grid (CPU only, a few seconds)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from sim.app.validate import summarise, validate_layer_rows
from sim.core.hardware import load_gpu
from sim.fused.model import _case, _plan, fused_layer
from sim.fused.profile import FusedProfile, load_fused_profile
from sim.fused.tiles import TILE_M, kblock_us, routed_halves, tile_order, tile_us
from sim.fused.tune import pick_on_measured
from sim.measured import (
    DEFAULT_ROW_TILE,
    is_fused_fit_row,
    measured_path,
    read_rows,
    results_dir,
    row_tile_of,
)

# the CSVs measured before row tile 64 existed (no row_tile column)
# the EP2 layer CSVs of 2x H200 measured before the row_tile column existed
LAYER_CSVS = tuple(
    sorted(p for p in results_dir().glob("h200x2-*layer*.csv") if "rowtile" not in p.name)
)
REL = 1e-9  # predictions at row tile 128 must not move (float noise only)


def mma_bound() -> FusedProfile:
    """The committed profile with sub-tiles bound by their MMAs (half_kblock_factor 0.5), where
    row tile 64 pays off: exercises the sub-tile terms that the measured value (1.0) hides."""
    return load_fused_profile().replace(half_kblock_factor=0.5)


MODELS = ("deepseek-v3", "kimi-k2", "qwen3-30b-a3b")

# (model, tokens/rank, skew, mode, comm SMs, minibatch) -> (layer_us, gemm_busy_us,
# gemm_stall_us) of the committed profile before row tile 64 (EP2; every fused config of the
# committed layer CSVs, then six more of the tuner's grid)
BEFORE = {
    ("deepseek-v3", 4096, "hot:0.5", "dedup_pull", 16, 4096): (
        7699.327883897042,
        7493.676631538439,
        0.0,
    ),
    ("deepseek-v3", 4096, "uniform", "dedup_pull", 8, 2048): (
        8095.8188903746695,
        7466.416529674989,
        423.7511083410782,
    ),
    ("deepseek-v3", 4096, "uniform", "dedup_pull", 8, 4096): (
        8266.741960253916,
        7501.315762016724,
        559.7749458785902,
    ),
    ("deepseek-v3", 4096, "uniform", "dedup_pull", 16, 2048): (
        8052.704797588416,
        7847.053545229814,
        0.0,
    ),
    ("deepseek-v3", 4096, "uniform", "dedup_pull", 16, 4096): (
        8055.462490482704,
        7849.811238124102,
        0.0,
    ),
    ("deepseek-v3", 4096, "uniform", "dedup_pull", 32, 2048): (
        8940.404670668502,
        8734.7534183099,
        0.0,
    ),
    ("deepseek-v3", 4096, "uniform", "dedup_pull", 32, 4096): (
        8937.047113388351,
        8731.395861029749,
        0.0,
    ),
    ("deepseek-v3", 4096, "uniform", "pull", 8, 2048): (
        7704.541630546196,
        7498.890378187593,
        0.0,
    ),
    ("deepseek-v3", 4096, "uniform", "pull", 8, 4096): (
        7803.304764590867,
        7501.315762016724,
        96.33775021554084,
    ),
    ("deepseek-v3", 4096, "uniform", "pull", 16, 2048): (
        8052.704797588416,
        7847.053545229814,
        0.0,
    ),
    ("deepseek-v3", 4096, "uniform", "pull", 16, 4096): (
        8055.462490482704,
        7849.811238124102,
        0.0,
    ),
    ("deepseek-v3", 4096, "uniform", "pull", 32, 2048): (
        8940.404670668502,
        8734.7534183099,
        0.0,
    ),
    ("deepseek-v3", 4096, "uniform", "pull", 32, 4096): (
        8937.047113388351,
        8731.395861029749,
        0.0,
    ),
    ("kimi-k2", 4096, "hot:0.5", "dedup_pull", 16, 4096): (
        10051.627792387982,
        9845.97654002938,
        0.0,
    ),
    ("kimi-k2", 4096, "uniform", "dedup_pull", 16, 4096): (
        9400.027822890996,
        9194.376570532393,
        0.0,
    ),
    ("qwen3-30b-a3b", 4096, "hot:0.5", "dedup_pull", 16, 4096): (
        1098.4783108746858,
        785.4679940754004,
        211.69248930135927,
    ),
    ("qwen3-30b-a3b", 4096, "uniform", "dedup_pull", 8, 2048): (
        1336.4887442083343,
        805.0467120585178,
        430.1242046518904,
    ),
    ("qwen3-30b-a3b", 4096, "uniform", "dedup_pull", 8, 4096): (
        1368.1738843049502,
        725.5903924523409,
        541.2656643546832,
    ),
    ("qwen3-30b-a3b", 4096, "uniform", "dedup_pull", 16, 2048): (
        1090.3124887401668,
        814.327415698256,
        174.66724554398468,
    ),
    ("qwen3-30b-a3b", 4096, "uniform", "dedup_pull", 16, 4096): (
        1108.2881478695524,
        797.7195892113994,
        209.25073116022702,
    ),
    ("qwen3-30b-a3b", 4096, "uniform", "dedup_pull", 32, 2048): (
        1126.0961286835022,
        928.333995451233,
        96.44430573434306,
    ),
    ("qwen3-30b-a3b", 4096, "uniform", "dedup_pull", 32, 4096): (
        1137.465658589163,
        928.3339954512331,
        107.81383564000373,
    ),
    ("qwen3-30b-a3b", 4096, "uniform", "pull", 8, 2048): (
        1390.5010020909306,
        882.450008859168,
        406.7331657338365,
    ),
    ("qwen3-30b-a3b", 4096, "uniform", "pull", 8, 4096): (
        1419.2927553377845,
        733.9772052497401,
        583.9977225901182,
    ),
    ("qwen3-30b-a3b", 4096, "uniform", "pull", 16, 2048): (
        1019.9725587671555,
        814.327415698256,
        104.32731557097327,
    ),
    ("qwen3-30b-a3b", 4096, "uniform", "pull", 16, 4096): (
        1048.4257714409607,
        793.3633578605416,
        153.7445860824929,
    ),
    ("qwen3-30b-a3b", 4096, "uniform", "pull", 32, 2048): (
        1080.4118529979003,
        928.333995451233,
        50.760030048741214,
    ),
    ("qwen3-30b-a3b", 4096, "uniform", "pull", 32, 4096): (
        1096.3104970886518,
        928.3339954512331,
        66.65867413949252,
    ),
    # not measured: other points of the tuner's grid, another skew / size
    ("deepseek-v3", 4096, "uniform", "dedup_pull", 24, 1024): (
        8452.165272566026,
        8246.514020207424,
        0.0,
    ),
    ("kimi-k2", 4096, "uniform", "pull", 48, 8192): (
        11971.729471579954,
        11766.078219221352,
        0.0,
    ),
    ("qwen3-30b-a3b", 4096, "uniform", "dedup_pull", 24, 1024): (
        1113.187202122453,
        820.9620323949091,
        190.90734222961783,
    ),
    ("kimi-k2", 4096, "hot:0.5", "pull", 8, 2048): (
        9627.368651904731,
        9421.717399546129,
        0.0,
    ),
    ("deepseek-v3", 512, "uniform", "pull", 16, 1024): (
        3046.605355652794,
        2863.0614287679905,
        100.78541053997833,
    ),
    ("qwen3-30b-a3b", 16384, "uniform", "dedup_pull", 32, 8192): (
        3910.812806982166,
        3337.263720773436,
        363.8850098170251,
    ),
}


def test_row_tile_128_predicts_what_it_did_before():
    prof = load_fused_profile()
    for (model, tokens, skew, mode, sms, mb), want in BEFORE.items():
        for rt in ({}, {"row_tile": 128}):
            r = fused_layer(model, tokens, 2, skew, mode, sms, mb, prof, **rt)
            got = (r.layer_us, r.terms["gemm_busy_us"], r.terms["gemm_stall_us"])
            assert got == pytest.approx(want, rel=REL, abs=1e-9), (model, skew, mode, sms, mb)


def test_committed_csvs_predict_what_they_did_before():
    """Every committed 2x H200 layer CSV lacks the row_tile column: its fused rows are row tile
    128."""
    rows = read_rows(*LAYER_CSVS)
    assert all("row_tile" not in r for r in rows)
    recs = validate_layer_rows(rows, load_fused_profile())
    ok = [r for r in recs if r["status"] == "ok"]
    # fused rows: layer 6, sweep 24, re-runs 12 + 12, and the later layer run (h200x2-layer.csv)
    assert len(ok) == 6 + 24 + 12 + 12 + 6
    for r in ok:
        assert r["row_tile"] == "128"
        key = (r["model"], int(r["tokens_per_rank"]), r["skew"], r["mode"])
        key += (int(r["sms"]), int(r["minibatch"]))
        assert r["predicted_us"] == pytest.approx(BEFORE[key][0], rel=REL)


def _kernel_routed_halves(starts: list[int], num_rows: int, row0: int) -> int:
    """csrc/layer.cuh routed_halves, line by line (expert_of_row: binary search on the region
    starts); the kernel's bit mask 3 (both halves) is 2 sub-tiles here."""

    def expert_of_row(row: int) -> int:
        lo, hi = 0, len(starts) - 1
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if starts[mid] <= row:
                lo = mid
            else:
                hi = mid - 1
        return lo

    if row0 + 64 >= num_rows:
        return 1
    return 0 if expert_of_row(row0) == expert_of_row(row0 + 64) else 2


@pytest.mark.parametrize("row_tile", [64, 128])
def test_routed_halves_follow_the_kernel(row_tile):
    rng = np.random.default_rng(7)
    for _ in range(40):
        rows = rng.integers(0, 300, rng.integers(1, 12))
        rows[rng.random(rows.size) < 0.3] = 0  # empty regions
        padded = -(-rows // row_tile) * row_tile
        starts = np.cumsum(padded) - padded
        num_rows = int(padded.sum())
        row0 = np.arange(-(-num_rows // 128)) * 128
        got = routed_halves(num_rows, starts, row0)
        want = [_kernel_routed_halves(list(starts), num_rows, int(r)) for r in row0]
        np.testing.assert_array_equal(got, want)
        if row_tile == 128:
            assert not got.any()


def test_tile_order_marks_the_split_blocks():
    """Regions of 192, 64, 128 and 64 rows (padded to 64): 448 rows, minibatches of 256 rows:
    blocks [0, 128) expert 0 (full), [128, 256) experts 0 | 1 (split), [256, 384) expert 2
    (full), [384, 448) expert 3 alone (lower half only). Minibatch 1 has 192 rows: 2 blocks."""
    starts = np.array([0, 192, 256, 384])
    o = tile_order(448, 256, 100, 512, 256, 0, interleave=True, region_starts=starts)
    assert o.num_minibatches == 2 and o.num_groups == 4  # no shared expert
    gu, dn = o.kind == 2, o.kind == 3
    # 2 GU and 2 DN columns per block: GU(0), GU(1), DN(0), DN(1)
    np.testing.assert_array_equal(o.group[gu], [0, 0, 1, 1, 2, 2, 3, 3])
    np.testing.assert_array_equal(o.halves[gu], [0, 0, 2, 2, 0, 0, 1, 1])
    np.testing.assert_array_equal(o.wait_group[dn], [0, 0, 1, 1, 2, 2, 3, 3])
    np.testing.assert_array_equal(o.halves[dn], [0, 0, 2, 2, 0, 0, 1, 1])
    # the same rows padded to 128: no split, the padding is multiplied instead
    o128 = tile_order(640, 256, 100, 512, 256, 0, region_starts=np.array([0, 256, 384, 512]))
    assert o128.num_groups == 5 and not o128.halves.any()
    # the shared expert's tiles are never split
    o = tile_order(448, 256, 100, 512, 256, 128, region_starts=starts)
    assert not o.halves[o.kind < 2].any()
    assert o.halves.sum() == 2 * 2 * (2 + 1)  # (GU, DN) x 2 columns x (split + lower half)
    with pytest.raises(ValueError, match="multiple of 64"):
        tile_order(480, 256, 100, 512, 256, 0, region_starts=starts)
    with pytest.raises(ValueError, match="multiples of 64"):
        tile_order(448, 256, 100, 512, 256, 0, region_starts=np.array([0, 100]))


def test_sub_tile_costs():
    """A 64-row sub-tile: k_blocks x (2-norm of own x half_kblock_factor and the unchanged
    operand share) + tile_fixed_us x half_fixed_factor; a split block runs its sub-tiles back to
    back. Its k-block is between half_kblock_factor and 1x a full tile's."""
    gpu = load_gpu("h200")
    tf, sms = gpu.tflops("bf16"), gpu.num_sms
    prof = mma_bound()
    own = 2 * 128 * 256 * 64 / (tf * 1e6 / sms * prof.gemm_efficiency)
    full = kblock_us(prof, tf, sms, 116, 61.0)
    half = kblock_us(prof, tf, sms, 116, 61.0, half=True)
    shared = 116 * 48 * 1024 / (prof.operand_tbps * 1e6) - prof.tile_fixed_us / 61.0
    assert full == pytest.approx(math.hypot(own, shared))
    assert half == pytest.approx(math.hypot(own * prof.half_kblock_factor, shared))
    assert prof.half_kblock_factor * full < half < full  # 0.67x at DeepSeek-V3, 16 comm SMs
    no_ceiling = prof.replace(operand_tbps=math.inf)
    assert kblock_us(no_ceiling, tf, sms, 116, 61.0, half=True) == pytest.approx(0.5 * own)
    # tiles: a full one, a split block of 2 sub-tiles, a lower half alone; 10 k-blocks each
    o = tile_order(320, 512, 1, 256, 128, 0, region_starts=np.array([0, 64, 256]))
    np.testing.assert_array_equal(o.halves, [2, 0, 1, 2, 0, 1])  # GU then DN of 3 blocks
    np.testing.assert_array_equal(o.k_blocks, [4, 4, 4, 2, 2, 2])
    dur = tile_us(o, prof, tf, sms, 116)
    # k-blocks per fixed part: (2 x 4 + 4 + 4 + 2 x 2 + 2 + 2) / (2 + 3 x half_fixed_factor x 2)
    mean_kb = 24 / (2 + 3 * 2 * prof.half_fixed_factor)
    kb, hb = (kblock_us(prof, tf, sms, 116, mean_kb, half=h) for h in (False, True))
    sub_fixed = prof.tile_fixed_us * prof.half_fixed_factor
    want = [2 * (4 * hb + sub_fixed), 4 * kb + prof.tile_fixed_us, 4 * hb + sub_fixed]
    want += [2 * (2 * hb + sub_fixed), 2 * kb + prof.tile_fixed_us, 2 * hb + sub_fixed]
    np.testing.assert_allclose(dur, want, rtol=1e-12)


def test_row_tile_64_on_the_benchmark_routing():
    """4096 tokens/rank, EP2, rank 0: padded receive rows 41344 -> 37056 (DeepSeek-V3), 49152 ->
    37184 (Kimi-K2), 37376 -> 35072 (Qwen3); 66 of 290, 95 of 291 and 31 of 274 routed blocks
    straddle two experts, and DeepSeek-V3's and Kimi-K2's last block is a lower half alone. With
    MMA-bound sub-tiles row tile 64 would be faster at dedup_pull, 16 comm SMs, minibatch 4096:
    DeepSeek-V3 -2.1 %, Kimi-K2 -12.9 %, Qwen3 -2.6 %; with the measured knob (sub-tiles as slow
    as full tiles) DeepSeek-V3 is slower at row tile 64, as measured (+7 to +8 %)."""
    prof = mma_bound()
    padded = {"deepseek-v3": (41344, 37056), "kimi-k2": (49152, 37184)}
    padded["qwen3-30b-a3b"] = (37376, 35072)
    want = {"deepseek-v3": 7886.34251124872, "kimi-k2": 8185.268486366069}
    want["qwen3-30b-a3b"] = 1079.6339573422379
    splits = {"deepseek-v3": (66, 1), "kimi-k2": (95, 1), "qwen3-30b-a3b": (31, 0)}
    for m in MODELS:
        for rt, rows in zip((128, 64), padded[m], strict=True):
            _, plan = _plan(m, 4096, 2, prof.topology, "uniform", rt, 4096)
            assert plan.padded_rows[0] == rows
            starts = plan.region_starts[0]
            assert starts[0] == 0 and np.all(starts % rt == 0) and starts[-1] < rows
        c = _case(
            m, 4096, 2, "uniform", "dedup_pull", 16, 4096, prof.comm_profile, "h200x2", 64, 4096
        )
        o = c.orders[0]
        gu = o.kind == 2
        assert np.unique(o.group[gu]).size == -(-padded[m][1] // 128)
        got = tuple(np.unique(o.group[gu & (o.halves == h)]).size for h in (2, 1))
        assert got == splits[m]
        r64 = fused_layer(m, 4096, 2, "uniform", "dedup_pull", 16, 4096, prof, row_tile=64)
        r128 = fused_layer(m, 4096, 2, "uniform", "dedup_pull", 16, 4096, prof, row_tile=128)
        assert r64.layer_us == pytest.approx(want[m], rel=1e-6)
        assert r64.layer_us < r128.layer_us
        assert r64.terms["sum_us"] == r128.terms["sum_us"]
        # costlier sub-tiles make row tile 64 slower; row tile 128 does not see the knobs
        dear = prof.replace(half_kblock_factor=1.0, half_fixed_factor=1.0)
        r64_dear = fused_layer(m, 4096, 2, "uniform", "dedup_pull", 16, 4096, dear, row_tile=64)
        assert r64_dear.layer_us > r64.layer_us
        r128_dear = fused_layer(m, 4096, 2, "uniform", "dedup_pull", 16, 4096, dear)
        assert r128_dear.layer_us == r128.layer_us
    committed = load_fused_profile()
    r = {
        rt: fused_layer(
            "deepseek-v3", 4096, 2, "uniform", "dedup_pull", 16, 4096, committed, row_tile=rt
        )
        for rt in (64, 128)
    }
    assert 1.05 < r[64].layer_us / r[128].layer_us < 1.10


def test_profile_without_the_sub_tile_knobs_loads(tmp_path):
    """A profile from before the sub-tile knobs loads with their defaults (the committed
    profile's values), and a saved profile carries them."""
    prof = load_fused_profile()
    d = prof.to_dict()
    assert (d["half_kblock_factor"], d["half_fixed_factor"]) == (1.0, 0.6)
    old = {k: v for k, v in d.items() if not k.startswith("half_")}
    assert FusedProfile.from_dict(old) == prof
    p = tmp_path / "p.json"
    prof.replace(half_kblock_factor=0.7).save(p)
    assert load_fused_profile(p).half_kblock_factor == 0.7


def _with_row_tile(rows: list[dict], row_tile: str, scale: float = 1.0) -> list[dict]:
    return [
        {**r, "row_tile": row_tile if r["impl"].startswith("mok") else "0"}
        | ({"median_us": str(float(r["median_us"]) * scale)} if r["impl"] == "mok-fused" else {})
        for r in rows
    ]


def test_validate_keys_configs_by_row_tile():
    """A layer CSV with a row_tile column: configs differing only in it are distinct in the
    ranking, row tile 64 rows are predicted at 64, explicit 128 is the same as a missing
    column, other libraries' rows (row_tile 0) stay baselines, and no 64-row row is a fit row."""
    sweep = read_rows(measured_path("h200x2-layer-sweep-2026-11-30.csv"))
    qwen = [r for r in sweep if r["model"] == "qwen3-30b-a3b"]
    rows = _with_row_tile(qwen, "128") + _with_row_tile(qwen, "64", scale=0.97)
    recs = validate_layer_rows(rows, load_fused_profile())
    assert all(r["status"] == "ok" for r in recs)
    (g,) = summarise(recs)["groups"]
    assert g["configs"] == 24
    assert g["best"] == "mok-fused:pull@16/mb2048/rt64"
    for row, r in zip(rows, recs, strict=True):
        args = ("qwen3-30b-a3b", 4096, 2, "uniform", r["mode"], int(r["sms"]), int(r["minibatch"]))
        want = fused_layer(*args, row_tile=int(r["row_tile"]))
        assert r["predicted_us"] == want.layer_us
        if r["row_tile"] == "64":
            assert want.layer_us != fused_layer(*args).layer_us
            assert r["role"] == "validation" and not is_fused_fit_row(row)
        else:
            fit = r["mode"] == "dedup_pull" or r["sms"] == "8"  # Qwen3's fit rows
            assert r["role"] == ("fit" if fit else "validation")
    # explicit 128 and a missing column: the same config (repeats, merged by their median)
    same = validate_layer_rows(qwen + _with_row_tile(qwen, "128"), load_fused_profile())
    (g,) = summarise(same)["groups"]
    assert g["configs"] == 12
    # baselines carry row_tile 0 and are not predicted
    layer = _with_row_tile(read_rows(measured_path("h200x2-layer-2026-11-30.csv")), "64")
    recs = validate_layer_rows(layer, load_fused_profile())
    assert {r["row_tile"] for r in recs if r["status"] == "baseline"} == {"0", "64"}
    assert {r["row_tile"] for r in recs if r["status"] == "ok"} == {"64"}
    assert not any(is_fused_fit_row(r) for r in layer)
    assert row_tile_of({}) == row_tile_of({"row_tile": ""}) == 128
    assert row_tile_of({"row_tile": "64"}) == 64
    # CSVs without the column ran the fused kernel's full tile (sim.measured imports no sim.fused)
    assert DEFAULT_ROW_TILE == TILE_M


def test_tuner_replay_keeps_row_tiles_apart():
    sweep = read_rows(measured_path("h200x2-layer-sweep-2026-11-30.csv"))
    qwen = [r for r in sweep if r["model"] == "qwen3-30b-a3b"]
    rows = _with_row_tile(qwen, "128") + _with_row_tile(qwen, "64", scale=0.97)
    (rec,) = pick_on_measured(rows, mma_bound())
    assert rec["configs"] == 24
    assert rec["best"] == "pull 16 SMs mb 2048 rt 64" and rec["best_measured_us"] == pytest.approx(
        0.97 * 1020.7
    )
    assert rec["picked"].endswith(" rt 64")
