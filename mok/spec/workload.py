"""Model-shape presets and routing traces (numpy only; shared by ``sim`` and ``reference``).

A routing trace holds, for every token of every rank, the ``num_topk`` distinct experts it is
sent to and their router weights. Tokens are laid out rank-major: token ``t`` of rank ``r`` is row
``r * num_tokens + t`` of the flat arrays, which is also the order an all-gather produces.

Skew is controlled by :class:`Skew`:

* ``uniform``: every expert equally likely;
* ``zipf``: expert popularity ~ 1 / rank^alpha (over a random permutation of the experts);
* ``hot``: a share ``hot_share`` of the tokens sends one of its k slots to one of ``hot_experts``
  hot experts (so each hot expert receives ``hot_share / hot_experts`` of the tokens), the other
  slots are uniform over the remaining experts;
* ``aligned``: no randomness in the experts: token ``g`` (rank-major over all ranks) sends slot
  ``j`` to expert ``(g + j * (num_experts // num_topk)) % num_experts``, so every expert receives
  exactly ``num_topk * tokens / num_experts`` rows when ``num_experts`` divides the token count
  (the GEMMs' best case: no ragged groups), and a token's experts spread over the ranks;
* ``rank_correlation`` (0..1) mixes each rank's own popularity ordering into the global one, so
  different source ranks prefer different experts.

Experts are drawn without replacement per token by successive sampling proportional to the
popularity weights (vectorised rejection of repeats), so every token's experts are distinct.
"""

from __future__ import annotations

import json
import math
import numbers
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

__all__ = [
    "ModelShape",
    "PRESETS",
    "get_shape",
    "Skew",
    "SKEW_SYNTAX",
    "RoutingTrace",
    "make_routing",
    "imbalance",
]


@dataclass(frozen=True)
class ModelShape:
    """Shape of one MoE layer.

    ``shared_intermediate`` is the intermediate size of the (single, fused) shared expert; 0 means
    the model has no shared expert.
    """

    name: str
    num_experts: int
    hidden: int
    intermediate: int
    num_topk: int
    shared_intermediate: int = 0

    def __post_init__(self) -> None:
        for f in ("num_experts", "hidden", "intermediate", "num_topk"):
            if getattr(self, f) <= 0:
                raise ValueError(f"ModelShape.{f} must be positive (found {getattr(self, f)})")
        if self.num_topk > self.num_experts:
            raise ValueError(
                f"num_topk={self.num_topk} exceeds num_experts={self.num_experts}: each token "
                "picks distinct experts"
            )
        if self.shared_intermediate < 0:
            raise ValueError(f"shared_intermediate must be >= 0 (found {self.shared_intermediate})")

    def routed_flops_per_token(self) -> int:
        """Forward FLOPs of the routed experts for one token (gate+up and down GEMMs, all k)."""
        return 2 * self.num_topk * 3 * self.hidden * self.intermediate

    def shared_flops_per_token(self) -> int:
        return 2 * 3 * self.hidden * self.shared_intermediate


PRESETS: dict[str, ModelShape] = {
    s.name: s
    for s in (
        ModelShape("deepseek-v3", 256, 7168, 2048, 8, shared_intermediate=2048),
        ModelShape("kimi-k2", 384, 7168, 2048, 8, shared_intermediate=2048),
        ModelShape("qwen3-30b-a3b", 128, 2048, 768, 8),
        ModelShape("qwen3-235b-a22b", 128, 4096, 1536, 8),
        ModelShape("glm-4.5", 160, 5120, 1536, 8, shared_intermediate=1536),
        ModelShape("gpt-oss-120b", 128, 2880, 2880, 4),
        ModelShape("tiny", 16, 256, 128, 4, shared_intermediate=128),
        # SonicMoE's throughput shapes (its paper's Fig. 14: hidden d x expert intermediate n,
        # E experts, top-K, no shared expert; mok.bench.sonicmoe holds its figures)
        ModelShape("sonic-1536x256", 128, 1536, 256, 8),
        ModelShape("sonic-4096x512", 128, 4096, 512, 8),
        ModelShape("sonic-4096x1024", 64, 4096, 1024, 4),
        ModelShape("sonic-4096x2048", 64, 4096, 2048, 4),
    )
}


def get_shape(name: str) -> ModelShape:
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(
            f"unknown model shape {name!r}; presets are {', '.join(sorted(PRESETS))}"
        ) from None


SKEW_SYNTAX = (
    "uniform, zipf:ALPHA (finite, >= 0), hot:SHARE[:NUM_HOT] (SHARE in [0, 1], NUM_HOT an "
    "integer >= 1), each optionally followed by @CORRELATION (in [0, 1]); or aligned"
)


def _is_int(v) -> bool:
    return isinstance(v, numbers.Integral) and not isinstance(v, bool)


def _is_real(v) -> bool:
    return isinstance(v, numbers.Real) and not isinstance(v, bool)


@dataclass(frozen=True)
class Skew:
    """How routing is skewed. See the module docstring for the meaning of each kind."""

    kind: str = "uniform"
    alpha: float = 1.0
    hot_experts: int = 1
    hot_share: float = 0.5
    rank_correlation: float = 0.0

    KINDS = ("uniform", "zipf", "hot", "aligned")

    def __post_init__(self) -> None:
        if not isinstance(self.kind, str) or self.kind not in self.KINDS:
            raise ValueError(f"unknown skew kind {self.kind!r}; supported: {', '.join(self.KINDS)}")
        for name in ("alpha", "hot_share", "rank_correlation"):
            v = getattr(self, name)
            if not _is_real(v) or not math.isfinite(v):
                raise ValueError(f"skew {name} must be a finite number (found {v!r})")
        if not _is_int(self.hot_experts):
            raise ValueError(f"hot_experts must be an integer (found {self.hot_experts!r})")
        if self.alpha < 0:
            raise ValueError(f"zipf alpha must be >= 0 (found {self.alpha})")
        if self.hot_experts < 1:
            raise ValueError(f"hot_experts must be >= 1 (found {self.hot_experts})")
        if not 0.0 <= self.hot_share <= 1.0:
            raise ValueError(f"hot_share must be in [0, 1] (found {self.hot_share})")
        if not 0.0 <= self.rank_correlation <= 1.0:
            raise ValueError(f"rank_correlation must be in [0, 1] (found {self.rank_correlation})")
        if self.kind == "aligned" and self.rank_correlation:
            raise ValueError("aligned routing has no per-rank correlation (drop the @ suffix)")

    @classmethod
    def parse(cls, text: str) -> Skew:
        """Parse ``uniform``, ``zipf:ALPHA``, ``hot:SHARE`` or ``hot:SHARE:NUM_HOT``; an optional
        ``@CORR`` suffix sets the per-rank correlation (``zipf:1.2@0.5``). Every number must be
        finite and in range (:data:`SKEW_SYNTAX`); anything else raises a ValueError that names
        the spec and the supported forms."""
        if not isinstance(text, str):
            raise ValueError(
                f"a skew spec must be a string (found {type(text).__name__} {text!r}); "
                f"supported: {SKEW_SYNTAX}"
            )
        body = text.strip()
        corr = None
        if "@" in body:
            body, corr = body.split("@", 1)
        parts = body.split(":")
        kw: dict = {}
        try:
            if corr is not None:
                kw["rank_correlation"] = float(corr)
            if parts[0] in ("uniform", "aligned") and len(parts) == 1:
                return cls(parts[0], **kw)
            if parts[0] == "zipf" and len(parts) == 2:
                return cls("zipf", alpha=float(parts[1]), **kw)
            if parts[0] == "hot" and len(parts) in (2, 3):
                n = int(parts[2]) if len(parts) == 3 else 1
                return cls("hot", hot_share=float(parts[1]), hot_experts=n, **kw)
        except ValueError as e:
            raise ValueError(f"cannot parse skew {text!r}: {e}; supported: {SKEW_SYNTAX}") from None
        raise ValueError(f"cannot parse skew {text!r}; supported: {SKEW_SYNTAX}")

    def label(self) -> str:
        base = {
            "uniform": "uniform",
            "aligned": "aligned",
            "zipf": f"zipf:{self.alpha:g}",
            "hot": f"hot:{self.hot_share:g}:{self.hot_experts}",
        }[self.kind]
        return base + (f"@{self.rank_correlation:g}" if self.rank_correlation else "")


@dataclass
class RoutingTrace:
    """Routing of ``num_ranks * num_tokens`` tokens (rank-major).

    topk_idx:     [num_ranks * num_tokens, num_topk] int64, distinct experts per row
    topk_weights: [num_ranks * num_tokens, num_topk] float32
    """

    topk_idx: np.ndarray
    topk_weights: np.ndarray
    num_experts: int
    num_ranks: int
    meta: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.topk_idx.ndim != 2 or self.topk_idx.shape != self.topk_weights.shape:
            raise ValueError(
                f"topk_idx {self.topk_idx.shape} and topk_weights {self.topk_weights.shape} must "
                "be 2-D of the same shape [num_ranks * num_tokens, num_topk]"
            )
        if self.topk_idx.shape[0] % self.num_ranks:
            raise ValueError(
                f"{self.topk_idx.shape[0]} tokens do not split evenly over {self.num_ranks} ranks"
            )

    @property
    def num_tokens(self) -> int:
        """Tokens per rank."""
        return self.topk_idx.shape[0] // self.num_ranks

    @property
    def num_topk(self) -> int:
        return self.topk_idx.shape[1]

    def rank_slice(self, rank: int) -> tuple[np.ndarray, np.ndarray]:
        """(topk_idx, topk_weights) of one rank's tokens, each [num_tokens, num_topk]."""
        s = slice(rank * self.num_tokens, (rank + 1) * self.num_tokens)
        return self.topk_idx[s], self.topk_weights[s]

    def per_rank(self) -> np.ndarray:
        """topk_idx as [num_ranks, num_tokens, num_topk]."""
        return self.topk_idx.reshape(self.num_ranks, self.num_tokens, self.num_topk)

    def save(self, path: str | Path) -> None:
        """Write a .npz (plain arrays plus JSON metadata; loading never unpickles)."""
        meta = dict(self.meta, num_experts=self.num_experts, num_ranks=self.num_ranks)
        np.savez_compressed(
            path,
            topk_idx=self.topk_idx,
            topk_weights=self.topk_weights,
            meta_json=np.array(json.dumps(meta)),
        )

    @classmethod
    def load(cls, path: str | Path) -> RoutingTrace:
        with np.load(path, allow_pickle=False) as z:
            meta = json.loads(str(z["meta_json"]))
            return cls(
                topk_idx=z["topk_idx"].astype(np.int64),
                topk_weights=z["topk_weights"].astype(np.float32),
                num_experts=int(meta.pop("num_experts")),
                num_ranks=int(meta.pop("num_ranks")),
                meta=meta,
            )


def _popularity(num_experts: int, skew: Skew, rng: np.random.Generator) -> np.ndarray:
    """Unnormalised expert popularity [num_experts] float64 for uniform / zipf."""
    if skew.kind == "zipf":
        with np.errstate(over="ignore"):  # a large alpha: the tail underflows to 0
            w = 1.0 / np.arange(1, num_experts + 1, dtype=np.float64) ** skew.alpha
        return w[rng.permutation(num_experts)]
    return np.ones(num_experts)


def _gumbel_topk(logp: np.ndarray, k: int, rng: np.random.Generator) -> np.ndarray:
    """Sample k distinct columns per row with probability ~ exp(logp) (successive sampling)."""
    g = logp - np.log(-np.log(rng.random(logp.shape)))
    return np.argpartition(-g, k - 1, axis=1)[:, :k]


def _sample_distinct(p: np.ndarray, n: int, k: int, rng: np.random.Generator) -> np.ndarray:
    """[n, k] distinct draws from probabilities ``p`` without replacement (successive sampling).

    Each column is drawn from ``p`` and redrawn where it repeats an earlier column, which is
    exactly "draw from p restricted to the unused experts". O(n * k) instead of the
    O(n * num_experts) of Gumbel-top-k; rows still colliding after a few rounds (only under
    extreme skew) fall back to Gumbel-top-k.
    """
    cdf = np.cumsum(p)
    cdf /= cdf[-1]
    out = np.empty((n, k), dtype=np.int64)
    live = np.arange(n)  # rows still filled column by column
    for j in range(k):
        col = np.searchsorted(cdf, rng.random(live.size), side="right")
        for _ in range(8):
            dup = (out[live, :j] == col[:, None]).any(axis=1)
            if not dup.any():
                break
            col[dup] = np.searchsorted(cdf, rng.random(int(dup.sum())), side="right")
        else:
            dup = (out[live, :j] == col[:, None]).any(axis=1)
            rows = live[dup]
            logp = np.broadcast_to(np.log(np.maximum(p, 1e-300)), (rows.size, p.size))
            out[rows] = _gumbel_topk(logp, k, rng)
            live, col = live[~dup], col[~dup]
        out[live, j] = col
    return np.minimum(out, p.size - 1)


def make_routing(
    num_tokens: int,
    num_experts: int,
    num_topk: int,
    num_ranks: int = 1,
    skew: Skew | str = "uniform",
    seed: int = 0,
) -> RoutingTrace:
    """Generate a routing trace of ``num_tokens`` tokens per rank on ``num_ranks`` ranks.

    Weights are a softmax over the chosen experts' random logits (sum to 1 per token), float32.
    ``num_tokens`` may be 0 (empty ``[0, num_topk]`` arrays). ``skew`` is a :class:`Skew` or a
    spec :meth:`Skew.parse` reads; ``seed`` an integer >= 0. Bad arguments raise ValueError.
    """
    if isinstance(skew, str):
        skew = Skew.parse(skew)
    elif not isinstance(skew, Skew):
        raise ValueError(
            f"skew must be a Skew or a spec string (found {type(skew).__name__} {skew!r}); "
            f"supported specs: {SKEW_SYNTAX}"
        )
    args = {"num_tokens": num_tokens, "num_experts": num_experts, "num_topk": num_topk}
    args.update(num_ranks=num_ranks, seed=seed)
    for name, v in args.items():
        if not _is_int(v):
            raise ValueError(f"{name} must be an integer (found {type(v).__name__} {v!r})")
    if num_tokens < 0 or num_ranks < 1 or num_experts < 1 or seed < 0:
        raise ValueError(
            f"need num_tokens >= 0, num_ranks >= 1, num_experts >= 1, seed >= 0 (found "
            f"{num_tokens}, {num_ranks}, {num_experts}, {seed})"
        )
    if not 1 <= num_topk <= num_experts:
        raise ValueError(f"num_topk must be in [1, num_experts={num_experts}] (found {num_topk})")
    num_tokens, num_experts, num_topk = int(num_tokens), int(num_experts), int(num_topk)
    num_ranks, seed = int(num_ranks), int(seed)
    rng = np.random.default_rng(seed)
    hot = skew.kind == "hot"
    # a token that skips the hot experts still needs num_topk distinct cold ones
    if hot and skew.hot_experts + num_topk > num_experts:
        raise ValueError(
            f"hot routing {skew.label()!r} needs hot_experts + num_topk <= num_experts "
            f"({skew.hot_experts} + {num_topk} > {num_experts})"
        )
    idx = np.empty((num_ranks, num_tokens, num_topk), dtype=np.int64)
    if skew.kind == "aligned":
        g = np.arange(num_ranks * num_tokens, dtype=np.int64)[:, None]
        j = np.arange(num_topk, dtype=np.int64)[None, :]
        idx[:] = ((g + j * (num_experts // num_topk)) % num_experts).reshape(idx.shape)
        num_ranks_drawn = 0  # no expert draws; the weights below are still random
    else:
        num_ranks_drawn = num_ranks
        base = _popularity(num_experts, skew, rng)
        base = base / base.sum()
    for r in range(num_ranks_drawn):
        p = base
        if skew.rank_correlation > 0:
            own = _popularity(num_experts, skew, rng) if skew.kind == "zipf" else base
            own = np.roll(own / own.sum(), rng.integers(num_experts))
            p = (1 - skew.rank_correlation) * base + skew.rank_correlation * own
        if not hot:
            idx[r] = _sample_distinct(p, num_tokens, num_topk, rng)
            continue
        # NOTE: hot experts are the last `hot_experts` ids so the uniform part is a plain range.
        num_cold = num_experts - skew.hot_experts
        to_hot = rng.random(num_tokens) < skew.hot_share
        which_hot = num_cold + rng.integers(skew.hot_experts, size=num_tokens)
        cold = _sample_distinct(np.ones(num_cold), num_tokens, num_topk, rng)
        cold[to_hot, rng.integers(num_topk, size=int(to_hot.sum()))] = which_hot[to_hot]
        idx[r] = cold
    logits = rng.standard_normal((num_ranks * num_tokens, num_topk))
    w = np.exp(logits - logits.max(axis=1, keepdims=True))
    w = (w / w.sum(axis=1, keepdims=True)).astype(np.float32)
    meta = {"skew": skew.label(), "seed": seed, "generator": "mok.spec.workload.make_routing"}
    return RoutingTrace(idx.reshape(-1, num_topk), w, num_experts, num_ranks, meta)


def imbalance(trace: RoutingTrace, num_ranks: int | None = None) -> dict[str, float]:
    """Load-imbalance metrics of a trace on ``num_ranks`` expert-parallel ranks.

    Returns max/mean of tokens per expert and of (token, k) rows received per rank, plus the
    fraction of (token, k) rows whose expert lives on another rank than the token.
    """
    num_ranks = num_ranks or trace.num_ranks
    from mok.spec.limits import expert_split_problem

    split = expert_split_problem(trace.num_experts, num_ranks)
    if split:
        raise ValueError(split)
    per_expert = np.bincount(trace.topk_idx.ravel(), minlength=trace.num_experts)
    per_rank = per_expert.reshape(num_ranks, -1).sum(axis=1)
    dst = trace.topk_idx // (trace.num_experts // num_ranks)
    src = np.repeat(np.arange(trace.topk_idx.shape[0]) // trace.num_tokens, trace.num_topk)
    src = src % num_ranks
    return {
        "expert_max_over_mean": float(per_expert.max() / max(per_expert.mean(), 1e-12)),
        "rank_max_over_mean": float(per_rank.max() / max(per_rank.mean(), 1e-12)),
        "max_tokens_per_expert": int(per_expert.max()),
        "max_rows_per_rank": int(per_rank.max()),
        "remote_fraction": float(np.mean(dst.ravel() != src)),
    }


def shape_dict(shape: ModelShape) -> dict:
    return asdict(shape)
