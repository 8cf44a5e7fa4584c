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
# (`sim.phases`) predicts every mok row of such a sweep from the calibrated H200 profile plus a
# few kernel knobs (`sim/profiles/mok-comm-h200x2.json`) that were fitted on a designated subset
# of the rows (DeepSeek-V3 uniform at 4096 / 16384 tokens, and 8 / 16 communication SMs); the
# other rows (Qwen3, hot:0.5, 512 tokens) are the validation set.
#
# This notebook scores the predictions the way `mok-sim validate` does: absolute % error,
# Spearman rank correlation per workload group, and how much slower the simulator's chosen
# configuration is than the measured best.

# %%
# %matplotlib inline
import math
from pathlib import Path

from IPython.display import display

import sim
from sim.phases import load_kernel_profile
from sim.plots import validation_scatter
from sim.validate import TARGETS, format_report, read_rows, summarise, validate_rows

# %% tags=["parameters"]
# A measured sweep in the format `python -m mok.bench comm` writes; the default is the snapshot
# the regression test pins (the file under mok/bench/results/ is the latest run).
MEASURED_CSV = "sim/profiles/h200x2-comm-grid-2026-11-30.csv"
KERNEL_PROFILE = "mok-comm-h200x2"

# %%
root = Path(sim.__file__).resolve().parents[1]
path = Path(MEASURED_CSV)
path = path if path.is_absolute() else root / path
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
