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
# router. On a CUDA GPU its forward and backward run mok's kernels (`mok.functional.moe`, one
# rank so far); elsewhere it runs the reference layer (`reference.moe`), so this notebook runs on
# a laptop CPU too.
#
# The model: token embedding, a few blocks of (RMSNorm, softmax top-k router, MoE layer,
# residual), a tied output head, trained on a synthetic next-token task (a fixed random Markov
# chain over a small vocabulary, whose entropy is the loss floor). The same model is trained twice
# from the same seed: once with `mok.MoE`, once with a plain torch MoE layer (one `F.linear` per
# expert over its gathered rows, `index_add_` back). Both should follow the same loss curve.

# %%
# %matplotlib inline
import math
import os
import time

import matplotlib.pyplot as plt
import torch
import torch.nn.functional as F
from torch import nn

import mok

# %% tags=["parameters"]
# model: vocabulary, width, experts, top-k, expert / shared-expert sizes, blocks
VOCAB, HIDDEN, EXPERTS, TOPK, INTER, SHARED, BLOCKS = 64, 64, 8, 2, 64, 64, 2
# data and training: sequences per step x tokens per sequence, steps, learning rate, seed
BATCH, SEQ, STEPS, LR, SEED = 8, 32, 150, 3e-3, 0
# MOK_DEMO_SIZE=gpu: a size worth a GPU (4096 tokens a step through 64 experts of width 2048,
# 300 steps); MOK_DEMO_FIGURE=path also saves the loss-curve figure there.
if os.environ.get("MOK_DEMO_SIZE") == "gpu":
    VOCAB, HIDDEN, EXPERTS, TOPK, INTER, SHARED, BLOCKS = 512, 2048, 64, 4, 768, 768, 2
    BATCH, SEQ, STEPS, LR = 16, 257, 300, 1e-3
FIGURE = os.environ.get("MOK_DEMO_FIGURE")
# "cuda" runs mok's kernels (bf16 on Hopper, one GPU); "cpu" the reference layer in fp32.
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPE = torch.bfloat16 if DEVICE == "cuda" else torch.float32
if DEVICE == "cpu":
    torch.set_num_threads(1)  # a tiny model: threads only add overhead (and contend with others)


# %% [markdown]
# ## Data: a random Markov chain (each token's successor drawn from a fixed, peaked distribution)


# %%
def markov_chain(vocab: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(vocab, vocab, generator=g) * 3.0
    return torch.softmax(logits, dim=-1)


def batches(trans: torch.Tensor, batch: int, seq: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    while True:
        tok = torch.randint(trans.shape[0], (batch,), generator=g)
        out = [tok]
        for _ in range(seq):
            tok = torch.multinomial(trans[tok], 1, generator=g).squeeze(1)
            out.append(tok)
        yield torch.stack(out, dim=1)  # [batch, seq + 1]


TRANS = markov_chain(VOCAB, SEED)
# the loss floor: the chain's entropy under its stationary distribution
_stat = torch.linalg.matrix_power(TRANS, 64)[0]
FLOOR = float(-(_stat[:, None] * TRANS * TRANS.clamp_min(1e-30).log()).sum())
print(f"loss floor (entropy of the chain): {FLOOR:.3f} nats; uniform guess {math.log(VOCAB):.3f}")


# %% [markdown]
# ## The model, with the MoE layer passed in


# %%
class TorchMoE(nn.Module):
    """A plain torch MoE layer on the same Parameters as mok.MoE (for the comparison)."""

    def __init__(self, ref: mok.MoE):
        super().__init__()
        self.gate_up = nn.Parameter(ref.gate_up.detach().clone())
        self.down = nn.Parameter(ref.down.detach().clone())
        self.shared_gate_up = nn.Parameter(ref.shared_gate_up.detach().clone())
        self.shared_down = nn.Parameter(ref.shared_down.detach().clone())

    @staticmethod
    def _ffn(x, gate_up, down):
        g, u = F.linear(x, gate_up).chunk(2, dim=-1)
        return F.linear(F.silu(g) * u, down)

    def forward(self, x, topk_idx, topk_weights):
        out = self._ffn(x, self.shared_gate_up, self.shared_down)
        for e in range(self.gate_up.shape[0]):
            tok, k = (topk_idx == e).nonzero(as_tuple=True)
            if tok.numel():
                y = self._ffn(x[tok], self.gate_up[e], self.down[e]) * topk_weights[tok, k, None]
                out = out.index_add(0, tok, y.to(out.dtype))
        return out


class Block(nn.Module):
    def __init__(self, moe: nn.Module):
        super().__init__()
        self.norm = nn.RMSNorm(HIDDEN)
        self.router = nn.Linear(HIDDEN, EXPERTS, bias=False)
        self.moe = moe

    def forward(self, h):
        x = self.norm(h)
        probs = torch.softmax(self.router(x).float(), dim=-1)
        w, idx = probs.topk(TOPK, dim=-1)
        w = w / w.sum(-1, keepdim=True)
        return h + self.moe(x, idx, w)


class TinyLM(nn.Module):
    def __init__(self, moes):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        nn.init.normal_(self.embed.weight, std=HIDDEN**-0.5)  # tied head: logits O(1) at init
        self.blocks = nn.ModuleList(Block(m) for m in moes)
        self.norm = nn.RMSNorm(HIDDEN)

    def forward(self, tokens):  # [B, T] -> logits [B, T, V]
        b, t = tokens.shape
        h = self.embed(tokens).view(b * t, HIDDEN)
        for blk in self.blocks:
            h = blk(h)
        return (self.norm(h) @ self.embed.weight.T).view(b, t, VOCAB)


def build(kind: str) -> TinyLM:
    torch.manual_seed(SEED)
    moes = [mok.MoE(EXPERTS, HIDDEN, INTER, SHARED, dtype=torch.float32) for _ in range(BLOCKS)]
    if kind == "torch":
        moes = [TorchMoE(m) for m in moes]
    torch.manual_seed(SEED + 1)  # the rest of the model: the same init for both
    model = TinyLM(moes)
    return model.to(device=DEVICE, dtype=DTYPE)


# %% [markdown]
# ## Train both from the same seed


# %%
def train(kind: str) -> list[float]:
    model = build(kind)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
    data = batches(TRANS, BATCH, SEQ, SEED + 2)
    losses, t0 = [], time.perf_counter()
    for _ in range(STEPS):
        seq = next(data).to(DEVICE)
        logits = model(seq[:, :-1])
        loss = F.cross_entropy(logits.float().reshape(-1, VOCAB), seq[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    print(f"{kind}: {STEPS} steps in {time.perf_counter() - t0:.1f} s, final loss {losses[-1]:.3f}")
    return losses


curves = {kind: train(kind) for kind in ("mok", "torch")}

# %%
fig, ax = plt.subplots(figsize=(7, 3.5), layout="constrained")
for (kind, ls), style in zip(curves.items(), ("-", "--"), strict=True):
    ax.plot(ls, style, label=f"{kind} MoE layer", lw=1.2)
ax.axhline(FLOOR, color="grey", ls=":", label="loss floor")
ax.set_xlabel("step")
ax.set_ylabel("cross-entropy (nats)")
where = torch.cuda.get_device_name() if DEVICE == "cuda" else "CPU"
tokens = BATCH * (SEQ - 1)  # the layer's inputs per step (each sequence's last id is a target)
ax.set_title(
    f"MoE LM: hidden {HIDDEN}, {EXPERTS} experts, top-{TOPK}, {tokens} tokens/step ({where})\n"
    "mok.MoE vs a torch MoE layer from the same seed",
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

# %%
tail = 20
gap = max(abs(a - b) for a, b in zip(curves["mok"][-tail:], curves["torch"][-tail:], strict=True))
drop = curves["mok"][0] - curves["mok"][-1]
print(
    f"Loss curves: mok {curves['mok'][0]:.3f} -> {curves['mok'][-1]:.3f}, torch "
    f"{curves['torch'][0]:.3f} -> {curves['torch'][-1]:.3f}; largest gap over the last {tail} "
    f"steps {gap:.4f} nats (loss fell by {drop:.3f})."
)
