# ---
# jupyter:
#   jupytext:
#     formats: py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # Tuning comm SMs, minibatch and ring size for one workload
#
# The megakernel splits the SMs of each GPU between communication (`num_comm_sms`) and the
# grouped expert GEMMs, and moves rows in minibatches of `minibatch_size` received rows per
# rank through a receive ring of `ring_slots` minibatches. Fewer comm SMs leave more SMs for
# the GEMMs but move bytes slower; smaller minibatches overlap more but give each GEMM fewer
# tiles, so its last wave runs partly empty.
#
# This notebook sweeps that grid with `sim.layer.sweep`, checks the rule of thumb *each grouped GEMM
# should get at least two full waves of tiles*, and hands the tuner's pick to the kernel as a
# `mok-config/1` JSON that `mok.MoKConfig.from_json` loads. The last section redoes the picture
# for the fused layer with its measured kernel model (`sim.fused.model`, fitted on 2x H200) against
# the measured sweep.

# %%
# %matplotlib inline
import math
import statistics
import tempfile
from pathlib import Path

from IPython.display import display

import mok
from mok.spec.workload import get_shape
from sim.app.emit import tune_document, write_json
from sim.app.plots import gantt, sweep_heatmap, sweep_heatmap_panels, waves_scatter
from sim.config import Workload
from sim.core.topology import get_topology
from sim.fused.model import fused_layer
from sim.fused.profile import load_fused_profile
from sim.fused.tiles import tile_order
from sim.fused.tune import tune_fused
from sim.layer.model import simulate
from sim.layer.sweep import grid, rank_rows, sweep, tune
from sim.measured import measured_path, read_rows

# %% tags=["parameters"]
SHAPE = "deepseek-v3"
# 1024 tokens/rank keeps the notebook fast; 4096-8192 is a realistic training micro-batch
# (then add minibatch 8192 and expect a few seconds per config).
TOKENS_PER_RANK = 1024
EP = 8
TOPOLOGY = "hgx-h200"
SKEW = "zipf:0.2"
SEED = 0
DISPATCH_MODE = "pull"  # the policy of the heatmaps; the tuner searches all of them
COMBINE_MODE = "push"
COMM_SMS = (8, 16, 24, 32, 48)
MINIBATCH_SIZES = (256, 512, 1024, 2048, 4096)
RING_SLOTS = (1, 2, 4)  # 1: a round's dispatch waits until the previous round was combined
MIN_WAVES = 2.0  # the rule of thumb under test
# tuner search space (keys of sim.layer.sweep.TUNE_SPACE; unspecified keys keep their defaults)
TUNE_SPACE = {
    "num_comm_sms": (16, 24, 32),
    "minibatch_size": (1024, 2048, 4096),
    "ring_slots": (2, 4),
}
JOBS = 1  # worker processes for the sweeps; results do not depend on it
# fused layer (sim.fused.model, fitted on 2x H200): the profile's fabric (h200x2, EP2) and the
# measured sweep's workload (4096 tokens/rank, uniform routing); about 1 s at these sizes
FUSED_PROFILE = "mok-fused-h200x2"
FUSED_MODELS = ("deepseek-v3", "qwen3-30b-a3b")
FUSED_TOKENS_PER_RANK = 4096
FUSED_EP = 2
FUSED_SKEW = "uniform"
FUSED_COMM_SMS = (4, 8, 12, 16, 24, 32, 48)
FUSED_MINIBATCH_SIZES = (1024, 2048, 4096, 8192)
# mok.bench sweep rows: a file of mok/bench/results (sim.measured.measured_path) or a path
FUSED_MEASURED_CSV = "h200x2-layer-sweep-2026-11-30.csv"

# %% [markdown]
# ## Sweep comm SMs x minibatch x ring size

# %%
wl = Workload(SHAPE, TOKENS_PER_RANK, EP, TOPOLOGY, SKEW, seed=SEED)
configs = grid([DISPATCH_MODE], [COMBINE_MODE], COMM_SMS, MINIBATCH_SIZES, RING_SLOTS)
rows = sweep(wl, configs, jobs=JOBS, progress=False)
print(f"{wl.label()}: {len(rows)} configs")

# %% [markdown]
# ## GEMM waves per minibatch
#
# A round's gate+up GEMM has `minibatch_size / row_tile` row tiles times
# `ceil(2 * intermediate / n_tile)` column tiles, the down GEMM `ceil(hidden / n_tile)` column
# tiles; one wave is one tile on every compute SM. The smaller of the two sets the count below.

# %%
gpu = get_topology(TOPOLOGY).gpu
shape = get_shape(SHAPE)
n_tiles = min(
    math.ceil(2 * shape.intermediate / gpu.gemm_n_tile), math.ceil(shape.hidden / gpu.gemm_n_tile)
)


def gemm_waves(row: dict) -> float:
    """Waves of the smaller grouped GEMM of one full minibatch."""
    compute_sms = gpu.num_sms - row["num_comm_sms"]
    return row["minibatch_size"] // row["row_tile"] * n_tiles / compute_sms


for r in rows:
    r["ring_slots"] = r["macrobatch_size"] // r["minibatch_size"]
    r["gemm_waves"] = round(gemm_waves(r), 2)

# %% [markdown]
# ## Heatmaps: layer time (us) per comm SMs x minibatch, one per ring size

# %%
for slots in RING_SLOTS:
    display(
        sweep_heatmap(rows, "num_comm_sms", "minibatch_size", "layer_us", {"ring_slots": slots})
    )

# %% [markdown]
# ## Are configs under two waves slower?
#
# Each config is compared with the best config of the same comm SMs and ring size whose
# minibatch gives at least `MIN_WAVES` waves.

# %%
display(waves_scatter(rows, threshold=MIN_WAVES))
best_ok = {}
for r in rows:
    if r["gemm_waves"] >= MIN_WAVES:
        key = (r["num_comm_sms"], r["ring_slots"])
        best_ok[key] = min(best_ok.get(key, math.inf), r["layer_us"])
under = []  # layer time / best >= MIN_WAVES config, for configs under MIN_WAVES
for r in rows:
    ref = best_ok.get((r["num_comm_sms"], r["ring_slots"]))
    r["vs_best_ok"] = r["layer_us"] / ref if ref else math.nan
    if r["gemm_waves"] < MIN_WAVES and ref:
        under.append(r["vs_best_ok"])
# one line per (ring, minibatch), one column per comm SMs: time vs best >= 2-wave (waves)
print(f"layer time / best config with >= {MIN_WAVES:g} waves at the same comm SMs and ring")
print(f"{'ring':>4}{'minibatch':>10}" + "".join(f"{f'sms={n}':>16}" for n in COMM_SMS))
for slots in RING_SLOTS:
    for mb in MINIBATCH_SIZES:
        cells = {
            r["num_comm_sms"]: f"{r['vs_best_ok']:.2f}x ({r['gemm_waves']:.1f}w)"
            for r in rows
            if r["ring_slots"] == slots and r["minibatch_size"] == mb
        }
        print(f"{slots:>4}{mb:>10}" + "".join(f"{cells.get(n, '-'):>16}" for n in COMM_SMS))

# %% [markdown]
# ## What the tuner picks, and the hand-off to the kernel

# %%
best_cfg, tune_rows = tune(wl, TUNE_SPACE, jobs=JOBS, progress=False)
print(f"tuner searched {len(tune_rows)} configs; top 5:")
for r in tune_rows[:5]:
    print(
        f"  {r['dispatch_mode']}/{r['combine_mode']:<5} sms={r['num_comm_sms']:<3} "
        f"mb={r['minibatch_size']:<5} ring={r['macrobatch_size'] // r['minibatch_size']} "
        f"{r['layer_us']:.1f} us"
    )
best_result = simulate(wl, best_cfg)
doc = tune_document(wl, best_cfg, best_result)
path = Path(tempfile.mkdtemp(prefix="mok-tune-")) / "mok-config.json"
write_json(doc, path)
print(f"wrote {path}")
print(path.read_text())
kernel_cfg = mok.MoKConfig.from_json(path)
print(kernel_cfg)
display(gantt(best_result, ranks=range(min(EP, 4))))

# %% [markdown]
# ## Findings (computed from the sweep and the tuner)

# %%
sweep_best = rank_rows(rows)[0]
slower = sum(rel > 1.0 for rel in under)
print(
    f"Best {DISPATCH_MODE}/{COMBINE_MODE} config of the grid: {sweep_best['num_comm_sms']} comm "
    f"SMs, minibatch {sweep_best['minibatch_size']} ({sweep_best['gemm_waves']:.2f} waves), ring "
    f"{sweep_best['ring_slots']}: {sweep_best['layer_us']:.1f} us."
)
if under:
    print(
        f"Rule of thumb: {slower} of {len(under)} configs under {MIN_WAVES:g} waves are slower "
        f"than the best >= {MIN_WAVES:g}-wave config with the same comm SMs and ring (median "
        f"{statistics.median(under):.2f}x, worst {max(under):.2f}x)."
    )
else:
    print(f"Rule of thumb: no config of the grid has both sides of {MIN_WAVES:g} waves to compare.")
ring_best = {
    slots: min(r["layer_us"] for r in rows if r["ring_slots"] == slots) for slots in RING_SLOTS
}
print(
    "Best layer time per ring size: "
    + ", ".join(f"{slots} slot(s) {t:.1f} us" for slots, t in ring_best.items())
    + "."
)
print(
    f"The tuner picks {best_cfg.label()} at {best_result.layer_us:.1f} us "
    f"({sweep_best['layer_us'] / best_result.layer_us:.3f}x speedup over the best grid config); "
    f"MoKConfig.from_json reads back dispatch_mode={kernel_cfg.dispatch_mode}, "
    f"num_comm_sms={kernel_cfg.num_comm_sms}, minibatch_size={kernel_cfg.minibatch_size}."
)

# %% [markdown]
# ## The fused layer (measured kernel model)
#
# The fused layer (`csrc/layer.cuh`, one persistent kernel) has its own timing model,
# `sim.fused.model.fused_layer`, fitted on 2x H200 (profile `mok-fused-h200x2`;
# docs/sim-validation.md, "Fused layer" and "Tuner on the fused sweep"). Its ring holds the whole
# receive buffer, so only dispatch x comm SMs x minibatch are swept, on the profile's fabric
# (h200x2, EP2). Boxed in the text colour: the configs of the measured sweep, measured median (`m`)
# under the prediction; red box: the model's best per panel. The colour scale is capped at 1.2x each
# model's best.

# %%
fused_prof = load_fused_profile(FUSED_PROFILE)
# row tile 128: the measured sweep's (row tile 64 is slower on H200; docs/perf-notes.md)
fused_space = {
    "num_comm_sms": FUSED_COMM_SMS,
    "minibatch_size": FUSED_MINIBATCH_SIZES,
    "row_tile": [128],
}
fused_rows = []
for model in FUSED_MODELS:
    fwl = Workload(model, FUSED_TOKENS_PER_RANK, FUSED_EP, fused_prof.topology, FUSED_SKEW)
    fused_rows += [{"model": model, **r} for r in tune_fused(fwl, fused_prof, fused_space)]
csv_path = Path(FUSED_MEASURED_CSV)
csv_path = csv_path if csv_path.is_file() else measured_path(FUSED_MEASURED_CSV)
fused_measured = [
    {
        "model": r["model"],
        "dispatch_mode": r["mode"],
        "num_comm_sms": int(r["sms"]),
        "minibatch_size": int(r["minibatch"]),
        "measured_us": float(r["median_us"]),
        "p20_us": float(r["p20_us"]),
        "p80_us": float(r["p80_us"]),
    }
    for r in read_rows(csv_path)
    if r["impl"] == "mok-fused"
    and r["model"] in FUSED_MODELS
    and int(r["tokens_per_rank"]) == FUSED_TOKENS_PER_RANK
    and int(r.get("num_ranks") or 2) == FUSED_EP
    and r["skew"] == FUSED_SKEW
]
fused_title = (
    f"fused layer (model {FUSED_PROFILE}), EP{FUSED_EP} on {fused_prof.topology}, "
    f"{FUSED_TOKENS_PER_RANK} tokens per rank, {FUSED_SKEW} routing"
)
display(sweep_heatmap_panels(fused_rows, measured=fused_measured, vmax_rel=1.2, title=fused_title))

# %% [markdown]
# At the defaults, DeepSeek-V3 is GEMM-bound: from 12 to 32 comm SMs every minibatch is within 5 %
# of the best (12 SMs, 9271 us, either dispatch), as the shared expert's tiles hide the first
# minibatch's dispatch; at 8 SMs and fewer the gate/up tiles wait for the dispatch (4 SMs: +12 to
# +42 %), and 48 SMs leave 84 GEMM SMs (+20 to +22 %). Qwen3-30B-A3B has no shared expert to hide
# the dispatch behind: its optimum is pull at 12-16 SMs, minibatch 2048 (1133-1136 us), 8 SMs cost
# 16 %, 4 SMs double the time, and at 16 SMs pull is 3-5 % ahead of dedup_pull (predicted and
# measured). The 24 measured points are within -7 % to +5 % of the model; the largest misses are
# pull at 8 SMs, including DeepSeek-V3's fastest measured point (8985 us, predicted 5 % slower),
# inside a 7 % spread that docs/sim-validation.md finds close to the run-to-run noise.

# %%
print(
    f"{'model':<15}{'dispatch':<11}{'sms':>4}{'mb':>6}{'predicted':>11}{'measured':>10}"
    f"{'err':>8}   p20-p80 (us)"
)
fused_errs = []
for m in fused_measured:
    pred = fused_layer(
        m["model"],
        FUSED_TOKENS_PER_RANK,
        FUSED_EP,
        FUSED_SKEW,
        m["dispatch_mode"],
        m["num_comm_sms"],
        m["minibatch_size"],
        fused_prof,
    ).layer_us
    fused_errs.append(pred / m["measured_us"] - 1)
    print(
        f"{m['model']:<15}{m['dispatch_mode']:<11}{m['num_comm_sms']:>4}{m['minibatch_size']:>6}"
        f"{pred:>11.0f}{m['measured_us']:>10.0f}{100 * fused_errs[-1]:>+7.1f}%"
        f"   {m['p20_us']:.0f}-{m['p80_us']:.0f}"
    )

# %% [markdown]
# ### Two full waves, in the fused model
#
# One minibatch has `minibatch / 128 x intermediate / 128` gate/up tiles and `minibatch / 128 x
# hidden / 256` down tiles (`sim.fused.tiles.tile_order`); its waves are the smaller count over the
# compute SMs. Per comm SMs: the model's best minibatch, its waves (`w`), and how much slower the
# best minibatch with at least `MIN_WAVES` waves is. The model's list schedule has no barrier
# between minibatches (each tile, in order, runs on the worker that frees first, as soon as its
# input is ready), so the next minibatch's tiles can fill a partial wave.

# %%
fused_gpu_sms = get_topology(fused_prof.topology).gpu.num_sms


def fused_waves(model: str, sms: int, minibatch: int) -> float:
    """Waves of the smaller GEMM of one full minibatch of the fused layer."""
    s = get_shape(model)
    o = tile_order(minibatch, minibatch, 0, s.hidden, s.intermediate, 0)  # routed tiles only
    gate_up, down = int((o.group >= 0).sum()), int((o.wait_group >= 0).sum())
    return min(gate_up, down) / (fused_gpu_sms - sms)


fused_under, fused_cost = 0, []  # bests under MIN_WAVES; best >= MIN_WAVES / best
print(f"{'model':<15}{'dispatch':<11}" + "".join(f"{f'sms={n}':>17}" for n in FUSED_COMM_SMS))
for model in FUSED_MODELS:
    for mode in ("pull", "dedup_pull"):
        cells = []
        for n in FUSED_COMM_SMS:
            sel = [
                r
                for r in fused_rows
                if (r["model"], r["dispatch_mode"], r["num_comm_sms"]) == (model, mode, n)
            ]
            best = min(sel, key=lambda r: r["layer_us"])
            waves = fused_waves(model, n, best["minibatch_size"])
            ok = [
                r["layer_us"]
                for r in sel
                if fused_waves(model, n, r["minibatch_size"]) >= MIN_WAVES
            ]
            rel = min(ok) / best["layer_us"] if ok else math.nan
            fused_under += waves < MIN_WAVES
            fused_cost.append(rel)
            cells.append(f"{best['minibatch_size']} {waves:.1f}w {rel:.2f}x")
        print(f"{model:<15}{mode:<11}" + "".join(f"{c:>17}" for c in cells))

# %%
for model in FUSED_MODELS:
    pick = next(r for r in fused_rows if r["model"] == model)  # tune_fused sorts best first
    meas = [m for m in fused_measured if m["model"] == model]
    line = (
        f"Fused {model}: the model's best is {pick['dispatch_mode']}, {pick['num_comm_sms']} comm "
        f"SMs, minibatch {pick['minibatch_size']} ({pick['layer_us']:.0f} us)"
    )
    if meas:
        mb = min(meas, key=lambda m: m["measured_us"])
        line += (
            f"; measured best of {len(meas)} swept configs: {mb['dispatch_mode']}, "
            f"{mb['num_comm_sms']} SMs, minibatch {mb['minibatch_size']} "
            f"({mb['measured_us']:.0f} us)"
        )
    print(line + ".")
if fused_errs:
    abs_errs = [abs(e) for e in fused_errs]
    print(
        f"Fused predicted vs measured over {len(fused_errs)} configs: median |error| "
        f"{100 * statistics.median(abs_errs):.1f}%, max {100 * max(abs_errs):.1f}%."
    )
print(
    f"Two-wave rule in the fused model: {fused_under} of {len(fused_cost)} best minibatches "
    f"(per model, dispatch and comm SMs) have under {MIN_WAVES:g} waves; the best minibatch with "
    f">= {MIN_WAVES:g} waves is at most {max(fused_cost):.2f}x slower."
)
