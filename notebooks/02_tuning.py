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
# This notebook sweeps that grid with `sim.sweep`, checks the rule of thumb *each grouped GEMM
# should get at least two full waves of tiles*, and hands the tuner's pick to the kernel as a
# `mok-config/1` JSON that `mok.MoKConfig.from_json` loads.

# %%
# %matplotlib inline
import math
import statistics
import tempfile
from pathlib import Path

from IPython.display import display

import mok
from mok.workload import get_shape
from sim.config import Workload
from sim.model import simulate
from sim.plots import gantt, sweep_heatmap, waves_scatter
from sim.sweep import grid, rank_rows, sweep, tune, tune_document, write_json
from sim.topology import get_topology

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
# tuner search space (keys of sim.sweep.TUNE_SPACE; unspecified keys keep their defaults)
TUNE_SPACE = {
    "num_comm_sms": (16, 24, 32),
    "minibatch_size": (1024, 2048, 4096),
    "ring_slots": (2, 4),
}
JOBS = 1  # worker processes for the sweeps; results do not depend on it

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
