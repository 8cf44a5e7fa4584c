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
# # Training a small MoE language model with `mok.MoE`
#
# `mok.MoE` is the MoE layer as an `nn.Module`: it owns the routed experts (`gate_up` `[E, 2I,
# H]`, `down` `[E, H, I]`) and the shared expert as Parameters and takes the routing from any
# router. On a CUDA GPU its forward and backward run mok's kernels (`mok.functional.moe`);
# elsewhere it runs the reference layer (`reference.moe`), so this notebook runs on a laptop CPU
# too.
#
# The model (`mok.bench.tiny_lm`): token embedding, a few blocks of (RMSNorm, softmax top-k
# router, MoE layer, residual), a tied output head, trained on a synthetic next-token task (a
# fixed random Markov chain over a small vocabulary, whose entropy is the loss floor). The same
# model is trained twice from the same seed on one rank: once with `mok.MoE`, once with a plain
# torch MoE layer (one `F.linear` per expert over its gathered rows, `index_add_` back). Both
# should follow the same loss curve. The last section trains it with its experts spread over
# four ranks (`mok.bench lm`).

# %%
# %matplotlib inline
import math
import os
import time
from pathlib import Path

import matplotlib.pyplot as plt
import torch

import mok
from mok.bench.tiny_lm import SIZES, batches, build, chain_entropy, markov_chain, train

# %% tags=["parameters"]
# SIZE: "tiny" (seconds on a CPU) or "gpu" (4096 tokens a step through 64 experts of width 2048,
# 300 steps; MOK_DEMO_SIZE=gpu); mok.bench.tiny_lm.SIZES holds both (model and training).
SIZE = os.environ.get("MOK_DEMO_SIZE", "tiny")
SEED = 0
# MOK_DEMO_FIGURE=path also saves the loss-curve figure there.
FIGURE = os.environ.get("MOK_DEMO_FIGURE")
# the mok.bench lm CSVs the last section draws (EP1 first), relative to the repository root
LM_CSVS = ["build/lm-ep1.csv", "build/lm-ep4.csv"]

# %%
SHAPE, RUN = SIZES[SIZE]
# "cuda" runs mok's kernels (bf16 on Hopper, one GPU); "cpu" the reference layer in fp32.
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPE = torch.bfloat16 if DEVICE == "cuda" else torch.float32
if DEVICE == "cpu":
    torch.set_num_threads(1)  # a tiny model: threads only add overhead (and contend with others)
print(SHAPE, RUN, sep="\n")

# %% [markdown]
# ## Data: a random Markov chain (each token's successor drawn from a fixed, peaked distribution)

# %%
TRANS = markov_chain(SHAPE.vocab, SEED)
FLOOR = chain_entropy(TRANS)
print(f"loss floor (entropy of the chain): {FLOOR:.3f} nats; uniform guess "
      f"{math.log(SHAPE.vocab):.3f}")  # fmt: skip

# %% [markdown]
# ## Train the model twice from the same seed: with `mok.MoE`, and with `TorchMoE` on the same
# initial weights


# %%
def run(kind: str) -> list[float]:
    model = build(SHAPE, kind=kind, seed=SEED, device=DEVICE, dtype=DTYPE)
    if kind == "mok":
        print(model)
    data = batches(TRANS, RUN.batch, RUN.seq, SEED + 2)
    t0 = time.perf_counter()
    losses = train(model, data, RUN.steps, RUN.lr, DEVICE)
    print(f"{kind}: {RUN.steps} steps in {time.perf_counter() - t0:.1f} s, final {losses[-1]:.3f}")
    return losses


curves = {kind: run(kind) for kind in ("mok", "torch")}

# %%
fig, ax = plt.subplots(figsize=(7, 3.5), layout="constrained")
for (kind, ls), style in zip(curves.items(), ("-", "--"), strict=True):
    ax.plot(ls, style, label=f"{kind} MoE layer", lw=1.2)
ax.axhline(FLOOR, color="grey", ls=":", label="loss floor")
ax.set_xlabel("step")
ax.set_ylabel("cross-entropy (nats)")
where = torch.cuda.get_device_name() if DEVICE == "cuda" else "CPU"
ax.set_title(
    f"MoE LM: hidden {SHAPE.hidden}, {SHAPE.num_experts} experts, top-{SHAPE.num_topk}, "
    f"{RUN.tokens} tokens/step ({where})\nmok.MoE vs a torch MoE layer from the same seed",
    fontsize=10,
)
ax.legend()
if FIGURE:
    fig.savefig(FIGURE, dpi=120)
plt.show()

# %% [markdown]
# ## The training step on one H200, measured
#
# What one step of the layer costs at a model's size: the committed `mok.bench train` run (one
# H200, the per-rank work of EP2 at 4096 tokens, gradients for x, the routing weights and every
# weight). `torch-best` is a careful torch layer under autograd (fused gate / up grouped GEMM,
# one permutation, its faster of eager and compiled); `mok-saved` and `mok-fused-saved` keep the
# experts' fp32 gate / up from the unfused or the fused forward (`mok.MoE(recompute=False)`,
# `fused=True` for the second), the other mok rows recompute them in the backward. The dashed
# line is torch-best's step / 1.5, the speed goal of the backward work.
# Re-run on a GPU with `python -m mok.bench train --csv my.csv` and point `TRAIN_CSV` at it.

# %%
from sim.app.plots import best_train_rows, train_steps  # noqa: E402
from sim.measured import measured_path, read_rows  # noqa: E402

TRAIN_CSV = measured_path("h200x1-train.csv")
train_rows = read_rows(TRAIN_CSV)
fig = train_steps(train_rows, target=1.5, title=f"{TRAIN_CSV.name}: one training step per layer")
plt.show()
best = {k: float(r["step_us"]) / 1e3 for k, r in best_train_rows(train_rows).items()}
for model in dict.fromkeys(r["model"] for r in train_rows):
    ref = best[(model, "uniform", "torch-best")]
    mok_best = min(
        v for (m, s, i), v in best.items() if m == model and s == "uniform" and i != "torch-best"
    )
    print(f"{model}: torch-best {ref:.2f} ms, best mok {mok_best:.2f} ms ({ref / mok_best:.2f}x)")

# %% [markdown]
# ## Against SonicMoE's published H100 figures
#
# `python -m mok.bench train --suite sonicmoe` runs SonicMoE's four throughput shapes on one GPU
# and counts FLOPs as SonicMoE does (6 T K d n forward, twice that backward). The committed run is
# from one H100; SonicMoE's bars are read off its paper's figure (about +-5 %).

# %%
from mok.bench.sonicmoe import published  # noqa: E402
from sim.app.plots import published_comparison  # noqa: E402

SONIC_CSV = measured_path("h100x1-train-sonicmoe-levers-2026-12-07.csv")
shown = ("torch-best", "mok-unfused", "mok-saved")
sonic_rows = [r for r in read_rows(SONIC_CSV) if r["impl"] in shown]
fig = published_comparison(sonic_rows, published(), "SonicMoE", title=SONIC_CSV.name)
plt.show()

# %%
tail = 20
gap = max(abs(a - b) for a, b in zip(curves["mok"][-tail:], curves["torch"][-tail:], strict=True))
drop = curves["mok"][0] - curves["mok"][-1]
print(
    f"Loss curves: mok {curves['mok'][0]:.3f} -> {curves['mok'][-1]:.3f}, torch "
    f"{curves['torch'][0]:.3f} -> {curves['torch'][-1]:.3f}; largest gap over the last {tail} "
    f"steps {gap:.4f} nats (loss fell by {drop:.3f})."
)

# %% [markdown]
# ## The same model at EP4, on one GPU
#
# `mok.bench lm` trains this model with its routed experts spread over the R ranks of a torchrun
# world: rank r holds experts r E / R to (r + 1) E / R - 1 of every layer (cut from the experts
# every rank draws from the seed, so together they are the EP1 model's), the rest is replicated.
# Each step every rank draws the same global batch and takes its R-th of the sequences; the
# replicated Parameters' gradients are all-reduced, the experts' come from mok's backward over
# every rank's rows; then the same AdamW step everywhere. Each step's loss is the mean over all
# ranks' tokens, as at EP1. On CUDA the layers run mok's kernels with
# `MoKConfig(dispatch_mode="pull", row_order="source")`, with which the MoE layer is bitwise the
# same at every EP size; the two curves still differ slightly, because the all-reduce sums the
# replicated Parameters' gradients in another order than one GEMM over the whole batch does.
# `MOK_SHARED_GPU=1` puts the four ranks on one GPU (their kernels time-slice: the run says
# nothing about NVLink speed, only about the losses):
#
# ```bash
# MOK_SHARED_GPU=1 torchrun --nproc-per-node=4 -m mok.bench lm --csv build/lm-ep4.csv
# python -m mok.bench lm --csv build/lm-ep1.csv
# python -m sim.app.plots train-loss --csv build/lm-ep1.csv --csv build/lm-ep4.csv \
#     --out build/lm-loss.png
# ```
#
# On a GPU the default size is `gpu`; without one (or with `--device cpu`) the commands train
# the `tiny` model in fp32 on CPU processes, the layer being mok's expert-parallel reference over
# gloo (tests/test_bench_lm.py runs it in CI). The figure below draws `LM_CSVS` where they exist
# (else any `*-lm-ep*.csv` committed under `mok/bench/results/`).

# %%
from sim.app.plots import lm_run_label, train_loss  # noqa: E402
from sim.measured import read_rows, results_dir  # noqa: E402

root = Path(mok.__file__).resolve().parents[1]
lm_csvs = [root / p for p in LM_CSVS if (root / p).is_file()]
if len(lm_csvs) < 2:
    lm_csvs = sorted(results_dir().glob("*-lm-ep*.csv"))
if len(lm_csvs) < 2:
    print(f"No EP runs to draw ({', '.join(LM_CSVS)} not under {root}): run the commands above.")
else:
    lm_runs = {lm_run_label(read_rows(p)): read_rows(p) for p in lm_csvs}
    fig = train_loss(lm_runs)
    plt.show()
