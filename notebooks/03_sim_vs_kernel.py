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
# # Simulator vs kernel: predicted and measured phase times on 2x H200
#
# `mok/bench/results/*.csv` hold what the communication kernels measured on our 2x H200
# machine (`torchrun --nproc-per-node=2 -m mok.bench comm`). The simulator's comm-phase model
# (`sim.comm.model`) predicts every mok row of such a sweep from the calibrated H200 profile plus a
# few kernel knobs (`sim/profiles/mok-comm-h200x2.json`) that were fitted on a designated subset
# of the rows (the grid's 4096-token rows); its 512- and 16384-token rows are the validation set.
# The second part does the same for the fused layer (`csrc/layer/`, one persistent kernel)
# with the fused-kernel model (`sim.fused.model`, `sim/profiles/mok-fused-h200x2.json`); the
# third puts the layer model (`sim.layer`, the push-vs-pull model of the other notebooks) on the
# same rows.
#
# This notebook scores the predictions the way `mok-sim validate` does: absolute % error,
# Spearman rank correlation per workload group, and how much slower the simulator's chosen
# configuration is than the measured best.

# %%
# %matplotlib inline
import math
import statistics
from pathlib import Path

from IPython.display import display

from sim.app.plots import layer_validation, validation_scatter
from sim.app.validate import (
    TARGETS,
    format_report,
    rerun_spearman,
    summarise,
    validate_layer_model_rows,
    validate_layer_rows,
    validate_rows,
)
from sim.comm.profile import load_kernel_profile
from sim.fused.profile import load_fused_profile
from sim.measured import measured_path, read_rows

# %% tags=["parameters"]
# A measured sweep in the format `python -m mok.bench comm` writes: a file of mok/bench/results
# (sim.measured.measured_path) or a path. The default is the snapshot the regression test pins,
# measured on the current kernels (git 6760a48). The older h200x2-comm-*.csv describe older
# kernels.
MEASURED_CSV = "h200x2-comm-grid-v4-2026-11-30.csv"
KERNEL_PROFILE = "mok-comm-h200x2"
# fused layer: `mok.bench layer` and `mok.bench sweep` rows (the snapshots the fit used)
LAYER_CSVS = [
    "h200x2-layer-2026-11-30.csv",
    "h200x2-layer-sweep-2026-11-30.csv",
]
FUSED_PROFILE = "mok-fused-h200x2"


# %%
def measured(name: str) -> Path:
    """A path as given, or a file of mok/bench/results by name."""
    return Path(name) if Path(name).is_file() else measured_path(name)


path = measured(MEASURED_CSV)
records = validate_rows(read_rows(path), load_kernel_profile(KERNEL_PROFILE))
summary = summarise(records)
print(format_report(records, summary))

# %%
display(validation_scatter(records))

# %%
worst = max(
    (r for r in records if r["status"] == "ok" and r["role"] == "validation"),
    key=lambda r: abs(r["err"]),
)
v = summary["validation"]
met = [k for k, ok in summary["targets"].items() if ok]
missed = [k for k, ok in summary["targets"].items() if not ok]
print(
    f"Validation rows: median |error| {100 * v['median_abs_err']:.1f}% "
    f"(target {100 * TARGETS['median_abs_err']:.0f}%), max {100 * v['max_abs_err']:.1f}% "
    f"(target {100 * TARGETS['max_abs_err']:.0f}%); worst row {worst['what']} "
    f"{worst['mode']}/{worst.get('engine', '-')} at {worst['sms']} SMs, predicted "
    f"{worst['predicted_us']:.0f} us vs measured {worst['measured_us']:.0f} us."
)
rho = summary["spearman_min"]
print(
    f"Lowest Spearman over groups {rho:.3f}"
    if not math.isnan(rho)
    else "Spearman undefined (fewer than 3 configurations per group)"
)
print(f"Largest chosen-vs-best gap {100 * summary['gap_max']:.1f}%.")
print(f"Targets met: {', '.join(met) or 'none'}; missed: {', '.join(missed) or 'none'}.")

# %% [markdown]
# ## Fused layer: predicted vs measured
#
# The fused layer's comm SMs pull-dispatch minibatch by minibatch while the other SMs run
# 128 x 256 GEMM tiles in the kernel's fixed order (shared expert, then gate/up and down per
# minibatch), then all SMs run the weighted sum. `sim.fused.model` models that: a list schedule of
# the tiles over the compute SMs (padding rows included), each tile `k_blocks x kblock_us +
# tile_fixed_us` with `kblock_us` the worker's own rate or its share of a chip-wide operand
# ceiling, gate/up tiles waiting for their minibatch's dispatch, plus the schedule kernel, the
# launch and the HBM-bound sum. Four knobs were fitted on the DeepSeek-V3 and Qwen3 uniform
# dedup_pull rows; pull dispatch, Kimi-K2 and hot:0.5 are held out. NCCL and mok-unfused rows are
# measured baselines, not predicted.

# %%
fused_prof = load_fused_profile(FUSED_PROFILE)
layer_records = validate_layer_rows(read_rows(*(measured(p) for p in LAYER_CSVS)), fused_prof)
layer_summary = summarise(layer_records)
print(format_report(layer_records, layer_summary))

# %%
display(layer_validation(layer_records))

# %%
# the error table: one line per fused row
print(
    f"{'model':<14}{'skew':<8}{'mode':<11}{'sms':>4}{'mb':>6}{'role':>11}{'measured':>10}"
    f"{'predicted':>11}{'err':>7}{'p20-p80':>9}"
)
for r in layer_records:
    if r["status"] != "ok":
        continue
    band = 100 * (r["p80_us"] - r["p20_us"]) / r["measured_us"]
    print(
        f"{r['model']:<14}{r['skew']:<8}{r['mode']:<11}{r['sms']:>4}{r['minibatch']:>6}"
        f"{r['role']:>11}{r['measured_us']:>10.0f}{r['predicted_us']:>11.0f}"
        f"{100 * r['err']:>6.1f}%{band:>8.1f}%"
    )

# %%
lv, lf = layer_summary["validation"], layer_summary["fit"]
print(
    f"Fused layer: held-out rows median |error| {100 * lv['median_abs_err']:.1f}%, max "
    f"{100 * lv['max_abs_err']:.1f}% ({lv['n']} rows); fit rows {100 * lf['median_abs_err']:.1f}% "
    f"/ {100 * lf['max_abs_err']:.1f}% ({lf['n']} rows)."
)
for g in layer_summary["groups"]:
    if g["configs"] < 3:
        continue
    by_config = {}  # repeats of a configuration (two CSVs) merged by their median, as the report
    for r in layer_records:
        if r["status"] == "ok" and r["model"] == g["model"] and r["skew"] == g["skew"]:
            by_config.setdefault((r["mode"], r["sms"], r["minibatch"]), []).append(r["measured_us"])
    meas = [statistics.median(v) for v in by_config.values()]
    rho_noise = rerun_spearman(meas, 0.01, draws=300)[0]
    print(
        f"{g['model']}: Spearman {g['spearman']:.2f}, gap {100 * g['gap']:.1f}%; measured spread "
        f"{100 * g['spread']:.1f}%, {100 * g['band_overlap']:.0f}% of config pairs overlap in "
        f"p20-p80; two re-runs with 1% noise per config would agree at Spearman ~{rho_noise:.2f}."
    )
lmet = [k for k, ok in layer_summary["targets"].items() if ok]
lmissed = [k for k, ok in layer_summary["targets"].items() if not ok]
print(
    f"Fused layer targets met: {', '.join(lmet) or 'none'}; missed: {', '.join(lmissed) or 'none'}."
)

# %% [markdown]
# ## The layer model on the same rows
#
# The push-vs-pull model of notebooks 01, 02 and 04 (`sim.layer.model`) is not fitted on layer
# rows. By default it runs the expert GEMMs at the standalone grouped GEMM's calibrated rates
# (`sim.core.gemm_waves`, the GPU profile's `gemm_waves`), which the megakernel does not reach;
# `SimConfig(gemm_profile=FUSED_PROFILE)` runs them at the fused profile's k-loop efficiency,
# per-tile cost and operand ceiling instead (`mok-sim ... --gemm-profile`). Both on the two-GPU
# fused rows above (every row held out):

# %%
model_rows = read_rows(*(measured(p) for p in LAYER_CSVS))
for rates, prof in (("standalone GEMM rates", None), (f"{FUSED_PROFILE} rates", FUSED_PROFILE)):
    lm = summarise(validate_layer_model_rows(model_rows, prof))["validation"]
    print(
        f"layer model, {rates}: median |error| {100 * lm['median_abs_err']:.1f}%, max "
        f"{100 * lm['max_abs_err']:.1f}% ({lm['n']} rows)"
    )

# %%
display(layer_validation(validate_layer_model_rows(model_rows, FUSED_PROFILE)))
