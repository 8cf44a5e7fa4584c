"""The small MoE language model of notebook 05 and ``mok.bench lm``, and its synthetic data.

The model (:class:`TinyLM`): a token embedding, ``blocks`` x (RMSNorm, softmax top-k router,
MoE layer, residual), a final RMSNorm and an output head tied to the embedding. The task: next
token of a fixed random Markov chain over a small vocabulary (:func:`markov_chain`,
:func:`batches`); the chain's entropy (:func:`chain_entropy`) is the loss floor.

:func:`build` makes the model from a seed. The MoE layer is :class:`mok.MoE` (mok's kernels on
CUDA, the reference layer elsewhere) or, for the comparison in notebook 05, :class:`TorchMoE` on
the same initial weights. With a process group of R ranks (expert parallelism) each rank holds
``num_experts / R`` routed experts of every layer: rank r those numbered ``r E / R`` to
``(r + 1) E / R - 1``, cut from the full expert tensors every rank draws from the seed, so the
ranks' experts together are exactly those of the one-rank model; everything else (embedding,
norms, routers, shared experts) is replicated, the same on every rank.

Nothing here touches CUDA or the process group until :func:`build` is given a device or a group.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import mok
from mok.errors import MoKInputError

__all__ = [
    "SIZES",
    "Block",
    "LMShape",
    "LMTraining",
    "TinyLM",
    "TorchMoE",
    "batches",
    "build",
    "chain_entropy",
    "lm_loss",
    "markov_chain",
    "train",
]


@dataclasses.dataclass(frozen=True)
class LMShape:
    """The model: vocabulary, width, routed experts, top-k, expert / shared-expert intermediate
    sizes (0: no shared expert), MoE blocks."""

    vocab: int
    hidden: int
    num_experts: int
    num_topk: int
    intermediate: int
    shared_intermediate: int
    blocks: int


@dataclasses.dataclass(frozen=True)
class LMTraining:
    """A training run: sequences per step x tokens per sequence (each sequence holds ``seq + 1``
    ids: ``seq`` inputs, each with the next id as its target), steps, AdamW learning rate."""

    batch: int
    seq: int
    steps: int
    lr: float

    @property
    def tokens(self) -> int:
        """Tokens per step through every MoE layer (``batch * seq``)."""
        return self.batch * self.seq


# name -> (model, training). tiny: notebook 05's default, seconds on a laptop CPU. gpu: 4096
# tokens a step through 64 experts of width 2048 (notebook 05's MOK_DEMO_SIZE=gpu).
SIZES: dict[str, tuple[LMShape, LMTraining]] = {
    "tiny": (LMShape(64, 64, 8, 2, 64, 64, 2), LMTraining(8, 32, 150, 3e-3)),
    "gpu": (LMShape(512, 2048, 64, 4, 768, 768, 2), LMTraining(16, 256, 300, 1e-3)),
}


# ---- data --------------------------------------------------------------------------------------
def markov_chain(vocab: int, seed: int) -> torch.Tensor:
    """[vocab, vocab] fp32 transition matrix (rows sum to 1), peaked: softmax of N(0, 3^2)."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(vocab, vocab, generator=g) * 3.0
    return torch.softmax(logits, dim=-1)


def chain_entropy(trans: torch.Tensor) -> float:
    """The chain's entropy rate in nats under its stationary distribution (the loss floor)."""
    stat = torch.linalg.matrix_power(trans, 64)[0]
    return float(-(stat[:, None] * trans * trans.clamp_min(1e-30).log()).sum())


def batches(trans: torch.Tensor, batch: int, seq: int, seed: int) -> Iterator[torch.Tensor]:
    """Endless [batch, seq + 1] int64 CPU batches of chain walks from uniform start ids, drawn
    with a generator of ``seed`` (the same batches on every rank that uses the same seed)."""
    g = torch.Generator().manual_seed(seed)
    while True:
        tok = torch.randint(trans.shape[0], (batch,), generator=g)
        out = [tok]
        for _ in range(seq):
            tok = torch.multinomial(trans[tok], 1, generator=g).squeeze(1)
            out.append(tok)
        yield torch.stack(out, dim=1)


# ---- the model ---------------------------------------------------------------------------------
class TorchMoE(nn.Module):
    """A plain torch MoE layer on copies of a :class:`mok.MoE`'s Parameters (all experts): one
    ``F.linear`` SwiGLU per expert over its gathered rows, ``index_add`` back."""

    def __init__(self, ref: mok.MoE):
        super().__init__()
        if ref.shared_gate_up is None:
            raise MoKInputError("TorchMoE copies a mok.MoE with a shared expert")
        self.gate_up = nn.Parameter(ref.gate_up.detach().clone())  # [E, 2I, H]
        self.down = nn.Parameter(ref.down.detach().clone())  # [E, H, I]
        self.shared_gate_up = nn.Parameter(ref.shared_gate_up.detach().clone())  # [2Is, H]
        self.shared_down = nn.Parameter(ref.shared_down.detach().clone())  # [H, Is]

    @staticmethod
    def _ffn(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
        g, u = F.linear(x, gate_up).chunk(2, dim=-1)
        return F.linear(F.silu(g) * u, down)

    def forward(
        self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor
    ) -> torch.Tensor:
        """x [num_tokens, hidden], topk_idx / topk_weights [num_tokens, num_topk] ->
        [num_tokens, hidden]."""
        out = self._ffn(x, self.shared_gate_up, self.shared_down)
        for e in range(self.gate_up.shape[0]):
            tok, k = (topk_idx == e).nonzero(as_tuple=True)
            if tok.numel():
                y = self._ffn(x[tok], self.gate_up[e], self.down[e]) * topk_weights[tok, k, None]
                out = out.index_add(0, tok, y.to(out.dtype))
        return out


class Block(nn.Module):
    """h + moe(norm(h)) with the routing of a softmax top-k router (weights renormalised)."""

    def __init__(self, moe: nn.Module, hidden: int, num_experts: int, num_topk: int):
        super().__init__()
        self.num_topk = num_topk
        self.norm = nn.RMSNorm(hidden)
        self.router = nn.Linear(hidden, num_experts, bias=False)
        self.moe = moe

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        """[num_tokens, hidden] -> [num_tokens, hidden]."""
        x = self.norm(h)
        probs = torch.softmax(self.router(x).float(), dim=-1)  # [num_tokens, num_experts] fp32
        w, idx = probs.topk(self.num_topk, dim=-1)
        w = w / w.sum(-1, keepdim=True)
        return h + self.moe(x, idx, w)


class TinyLM(nn.Module):
    """Embedding, the blocks (one per MoE layer of ``moes``), RMSNorm, tied head."""

    def __init__(self, moes: list[nn.Module], shape: LMShape):
        super().__init__()
        self.shape = shape
        self.embed = nn.Embedding(shape.vocab, shape.hidden)
        nn.init.normal_(self.embed.weight, std=shape.hidden**-0.5)  # tied head: logits O(1)
        self.blocks = nn.ModuleList(
            Block(m, shape.hidden, shape.num_experts, shape.num_topk) for m in moes
        )
        self.norm = nn.RMSNorm(shape.hidden)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens [B, T] int64 -> logits [B, T, vocab] (the model's dtype)."""
        b, t = tokens.shape
        h = self.embed(tokens).view(b * t, self.shape.hidden)
        for blk in self.blocks:
            h = blk(h)
        return (self.norm(h) @ self.embed.weight.T).view(b, t, self.shape.vocab)

    def expert_parameters(self) -> list[nn.Parameter]:
        """The routed experts' Parameters (``gate_up``, ``down`` of each layer): this rank's
        shard under expert parallelism."""
        return [p for blk in self.blocks for p in (blk.moe.gate_up, blk.moe.down)]

    def replicated_parameters(self) -> list[nn.Parameter]:
        """Every other Parameter (the same on every rank)."""
        experts = {id(p) for p in self.expert_parameters()}
        return [p for p in self.parameters() if id(p) not in experts]


def _shard(full: mok.MoE, rank: int, ranks: int, group, config) -> mok.MoE:
    """Rank ``rank``'s experts of ``full`` (copies; the shared expert whole) as a mok.MoE."""
    local = full.num_experts // ranks
    cut = slice(rank * local, (rank + 1) * local)
    with torch.no_grad():
        return mok.MoE.from_weights(
            full.num_experts, full.gate_up[cut].clone(), full.down[cut].clone(),
            full.shared_gate_up.clone(), full.shared_down.clone(), config=config, group=group,
        )  # fmt: skip


def build(
    shape: LMShape,
    *,
    kind: str = "mok",
    seed: int = 0,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
    group=None,
    config: mok.MoKConfig | None = None,
) -> TinyLM:
    """The model of ``shape`` drawn from ``seed`` (the caller's RNG state is left alone).

    kind: ``mok`` (:class:`mok.MoE` layers, with ``config``) or ``torch`` (:class:`TorchMoE`,
    one rank). group: the expert-parallel process group (None: one rank); this rank keeps its
    ``num_experts / R`` experts of each layer. The weights are drawn in fp32 on the CPU (the
    experts: every layer's ``[E, 2I, H]`` / ``[E, H, I]`` whole, on every rank, then cut), then
    moved to ``device`` / ``dtype``.
    """
    if kind not in ("mok", "torch"):
        raise MoKInputError(f"unknown kind {kind!r}; supported: mok, torch")
    ranks = 1 if group is None else dist.get_world_size(group)
    rank = 0 if group is None else dist.get_rank(group)
    if shape.num_experts % ranks:
        raise MoKInputError(
            f"{ranks} ranks must divide num_experts={shape.num_experts} (experts are split "
            "evenly over the ranks)"
        )
    if kind == "torch" and ranks > 1:
        raise MoKInputError(f"kind='torch' runs on one rank (found a group of {ranks})")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        full = [
            mok.MoE(
                shape.num_experts,
                shape.hidden,
                shape.intermediate,
                shape.shared_intermediate,
                dtype=torch.float32,
            )  # fmt: skip
            for _ in range(shape.blocks)
        ]
        if kind == "torch":
            moes: list[nn.Module] = [TorchMoE(m) for m in full]
        elif ranks == 1 and group is None and config is None:
            moes = full
        else:
            moes = [_shard(m, rank, ranks, group, config) for m in full]
        del full
        torch.manual_seed(seed + 1)  # the rest of the model: the same for every kind and rank
        model = TinyLM(moes, shape)
    return model.to(device=device, dtype=dtype)


# ---- training ----------------------------------------------------------------------------------
def lm_loss(model: TinyLM, seq: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy (fp32 scalar) of ``seq`` [B, T + 1] (inputs ``seq[:, :-1]``,
    targets ``seq[:, 1:]``)."""
    logits = model(seq[:, :-1])
    return F.cross_entropy(logits.float().reshape(-1, model.shape.vocab), seq[:, 1:].reshape(-1))


def train(
    model: TinyLM,
    data: Iterator[torch.Tensor],
    steps: int,
    lr: float,
    device: torch.device | str | None = None,
) -> list[float]:
    """``steps`` AdamW steps (weight decay 0) on one rank over ``data``'s batches; the loss of
    each step (before its update)."""
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    losses = []
    for _ in range(steps):
        seq = next(data).to(device)
        loss = lm_loss(model, seq)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses
