"""What a workspace holds, worked out from its shapes before anything is allocated.

:func:`plan` gives the receive capacity, the symmetric and schedule layouts and the bytes of a
workspace for ``max_tokens`` tokens per rank; :class:`mok.workspace.Workspace` allocates by it.
:func:`default_max_tokens` is the token count a workspace is sized for when the config leaves
``max_tokens`` at 0: ``DEFAULT_MAX_TOKENS`` per rank, halved while the workspace would take
more than ``1 / MEMORY_SHARE`` of the GPU's memory (its share of it where ranks share the GPU),
and never below ``MIN_DEFAULT_TOKENS``. The workspace is then sized for the larger of that and
the largest count any rank passes in its first call.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mok import _ext
from mok.spec.config import MoKConfig

__all__ = [
    "Shapes",
    "Plan",
    "plan",
    "layout",
    "dedup_rows",
    "default_max_tokens",
    "DEFAULT_MAX_TOKENS",
    "MIN_DEFAULT_TOKENS",
    "MEMORY_SHARE",
]

# Token rows per rank of a workspace whose config has max_tokens=0 (at most).
DEFAULT_MAX_TOKENS = 8192
# ... and at least (the memory rule never halves below it).
MIN_DEFAULT_TOKENS = 256
# A default-sized workspace takes at most this fraction (1 / MEMORY_SHARE) of its GPU's memory.
MEMORY_SHARE = 16
ALIGN = 256  # bytes: every symmetric region starts at a multiple
CHUNK_TOKENS = 64  # tokens per chunk of the schedule's histograms


@dataclass(frozen=True)
class Shapes:
    max_tokens: int  # token rows per rank of every per-token buffer (any call: 0..max_tokens)
    hidden: int
    num_topk: int
    num_experts: int
    dtype: torch.dtype


@dataclass(frozen=True)
class Plan:
    """A workspace's sizes (rows, and bytes per rank)."""

    capacity: int  # receive-buffer rows (MoKConfig.capacity_rows)
    num_chunks: int  # schedule histogram chunks of CHUNK_TOKENS tokens
    num_minibatches: int  # minibatches of the receive buffer
    ring_rows: int  # the fused layer's receive / h ring
    sym_sizes: dict[str, int]  # symmetric regions, bytes (unaligned)
    sched_sizes: list[tuple[str, int]]  # the schedule table's arrays, int32 elements
    dedup_bytes: int  # the local dedup-dispatch buffer (allocated on first use)

    @property
    def sym_layout(self) -> tuple[dict[str, int], int]:
        """({region: byte offset}, bytes) of the symmetric allocation: every region starting
        at a multiple of ALIGN."""
        return layout(list(self.sym_sizes.items()), ALIGN)

    @property
    def sched_layout(self) -> tuple[dict[str, int], int]:
        """({array: int32 offset}, int32 words) of the schedule table (ALIGN-byte aligned)."""
        return layout(self.sched_sizes, ALIGN // 4)

    @property
    def sym_bytes(self) -> int:
        return self.sym_layout[1]

    @property
    def sched_bytes(self) -> int:
        return 4 * self.sched_layout[1]

    @property
    def total_bytes(self) -> int:
        """Symmetric, schedule and dedup bytes: what a workspace of this plan allocates before
        the fused layer's per-FFN buffers."""
        return self.sym_bytes + self.sched_bytes + self.dedup_bytes


def layout(names_sizes: list[tuple[str, int]], align: int) -> tuple[dict[str, int], int]:
    """Consecutive regions of these sizes, each starting at a multiple of ``align``: ({name:
    offset}, the total)."""
    off, out = 0, {}
    for name, size in names_sizes:
        out[name] = off
        off += -(-size // align) * align
    return out, off


def dedup_rows(num_ranks: int, max_tokens: int, capacity: int) -> int:
    """Rows of the dedup dispatch's buffer: one per (source rank, token) with an expert on this
    rank, so never more than the tokens of every rank nor than the receive rows (each such pair
    has at least one receive row; the schedule checks the receive rows against the capacity
    first)."""
    return min(num_ranks * max_tokens, capacity)


def plan(shapes: Shapes, config: MoKConfig, num_ranks: int, fused: bool = False) -> Plan:
    """The sizes of a workspace of ``shapes`` at ``num_ranks`` ranks (``fused``: of the fused
    layer alone: a receive buffer of the ring's rows, no expert-output buffer, no dedup
    partials or rows)."""
    R, N, H, K, E = (
        num_ranks,
        shapes.max_tokens,
        shapes.hidden,
        shapes.num_topk,
        shapes.num_experts,
    )
    L = E // R
    row_bytes = H * torch.empty((), dtype=shapes.dtype).element_size()
    cap = config.capacity_rows(N, K, L, R)
    num_chunks = max(1, -(-N // CHUNK_TOKENS))
    mb = config.minibatch_size
    num_minibatches = -(-cap // mb)
    full = num_minibatches * mb
    ring = min(config.macrobatch_size or full, full)
    recv_rows = min(ring, cap) if fused else cap
    sym = {
        "signals": _ext.NUM_SIGNALS * _ext.MAX_RANKS * 8,
        "route_status": 2 * _ext.MAX_RANKS * _ext.ROUTE_STATUS_WORDS * 4,
        "route_idx": 2 * R * N * K * 4,
        "route_w": 2 * R * N * K * 4,
        "x": N * row_bytes,
        # the output gradient's rows, staged like x for the owners of their experts (the fused
        # backward's transfers at several ranks)
        "dy": 0 if fused else N * H * 2,
        "recv": recv_rows * row_bytes,
        "slots": N * K * H * 2,
        "y": 0 if fused else cap * H * 2,
        # the dedup pull combine: an owner's partial row per dedup row, then (int32, per token
        # and owner term of this rank) the row on that owner (csrc/params.h partials_rows)
        "partials": 0 if fused else dedup_rows(R, N, cap) * H * 2 + N * K * 4,
        # fp32 per receive row: the backward's router-weight gradient, staged by the expert's
        # owner for the token's home rank to read (no kernel addresses it)
        "row_grads": cap * 4,
    }
    sched = [
        ("counts", E * R),
        ("offsets", R * (L + 1)),
        ("src_rank", cap),
        ("src_index", cap),
        ("dst_rank", N * K),
        ("dst_index", N * K),
        ("dedup_src_rank", R * N),
        ("dedup_src_token", R * N),
        ("dedup_slot", R * N),
        ("fanout", cap),
        ("fan_rows", R * N * K),
        ("fan_w", R * N * K),
        ("hist", R * num_chunks * E),
        ("dhist", R * num_chunks),
        ("dcount", R),
        ("meta", _ext.META_WORDS),
        ("ready", num_minibatches),
    ]
    # one row per (source rank, token) with an expert here: never more than the receive rows
    dedup = 0 if fused else dedup_rows(R, N, cap) * row_bytes
    return Plan(cap, num_chunks, num_minibatches, ring, sym, sched, dedup)


def default_max_tokens(
    shapes: Shapes,
    config: MoKConfig,
    num_ranks: int,
    fused: bool,
    memory_bytes: int,
    ranks_per_gpu: int = 1,
) -> int:
    """The tokens per rank a workspace is sized for when ``config.max_tokens`` is 0 (before the
    first call's count is taken into account; ``shapes.max_tokens`` is ignored):
    ``DEFAULT_MAX_TOKENS``, halved while the workspace's bytes (:func:`plan`: symmetric,
    schedule and dedup buffers; the fused layer's shared-expert output) exceed ``memory_bytes /
    MEMORY_SHARE / ranks_per_gpu``, never below ``MIN_DEFAULT_TOKENS``."""
    budget = memory_bytes // MEMORY_SHARE // max(1, ranks_per_gpu)
    n = DEFAULT_MAX_TOKENS
    while n > MIN_DEFAULT_TOKENS:
        p = plan(
            Shapes(n, shapes.hidden, shapes.num_topk, shapes.num_experts, shapes.dtype),
            config,
            num_ranks,
            fused,
        )
        extra = n * shapes.hidden * 2 if fused else 0  # the shared expert's output rows
        if p.total_bytes + extra <= budget:
            break
        n //= 2
    return n


def default_cost(
    hidden: int,
    num_topk: int,
    num_experts: int,
    config: MoKConfig,
    num_ranks: int,
    fused: bool,
    memory_bytes: int,
    ranks_per_gpu: int = 1,
) -> tuple[int, int]:
    """(tokens per rank, bytes per rank) of a workspace created for a first call of at most the
    default size (bf16 rows): :func:`default_max_tokens` and :func:`plan`'s symmetric, schedule
    and dedup bytes (the fused layer's local buffers, which depend on the FFN sizes, aside)."""
    s = Shapes(0, hidden, num_topk, num_experts, torch.bfloat16)
    n = default_max_tokens(s, config, num_ranks, fused, memory_bytes, ranks_per_gpu)
    return n, _bytes(hidden, num_topk, num_experts, config, num_ranks, n, fused)


def default_table(models: list, eps: list[int], memory_gib: float, max_tokens: int = 0) -> str:
    """A markdown table of :func:`default_cost` with the default config: one row per model
    (a :class:`mok.spec.workload.ModelShape`) and EP size, the unfused and fused workspaces.
    ``max_tokens``: the cost of a workspace of exactly that many tokens per rank instead
    (``MoKConfig(max_tokens=...)``; the memory then does not matter)."""
    cfg = MoKConfig()
    memory = int(memory_gib * 2**30)
    what = "tokens / rank" if max_tokens else "default tokens / rank"
    lines = [
        f"| model | EP | {what} | workspace (GB) | fused layer's (GB) |",
        "| --- | --- | --- | --- | --- |",
    ]
    for m in models:
        for r in eps:
            if m.num_experts % r:
                continue
            args = (m.hidden, m.num_topk, m.num_experts, cfg, r)
            if max_tokens:
                n = nf = max_tokens
                full, fused = (_bytes(*args, max_tokens, f) for f in (False, True))
            else:
                n, full = default_cost(*args, False, memory)
                nf, fused = default_cost(*args, True, memory)
            tokens = str(n) if n == nf else f"{n} ({nf} fused)"
            lines.append(f"| {m.name} | {r} | {tokens} | {full / 1e9:.2f} | {fused / 1e9:.2f} |")
    return "\n".join(lines)


def _bytes(hidden, num_topk, num_experts, config, num_ranks, tokens, fused) -> int:
    shapes = Shapes(tokens, hidden, num_topk, num_experts, torch.bfloat16)
    return plan(shapes, config, num_ranks, fused).total_bytes


def main(argv: list[str] | None = None) -> int:
    import argparse

    from mok.spec.workload import get_shape

    ap = argparse.ArgumentParser(
        prog="python -m mok.sizing",
        description="What a default-sized workspace (MoKConfig.max_tokens=0), or one of "
        "--max-tokens tokens, costs per rank, per model shape and EP size.",
    )
    ap.add_argument("--models", default="deepseek-v3,kimi-k2,qwen3-30b-a3b,gpt-oss-120b")
    ap.add_argument("--ep", default="1,2,8", help="EP sizes (comma list)")
    ap.add_argument("--memory-gib", type=float, default=80.0, help="the GPU's memory")
    ap.add_argument(
        "--max-tokens",
        type=int,
        default=0,
        help="the cost of a workspace of exactly this many tokens per rank "
        "(MoKConfig.max_tokens) instead of the default size",
    )
    args = ap.parse_args(argv)
    try:
        models = [get_shape(name) for name in args.models.split(",")]
    except ValueError as e:
        ap.error(str(e))
    eps = [int(r) for r in args.ep.split(",")]
    if args.max_tokens < 0 or args.memory_gib <= 0 or min(eps) < 1:
        ap.error("--max-tokens must be >= 0, --memory-gib > 0 and every --ep >= 1")
    print(default_table(models, eps, args.memory_gib, args.max_tokens))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
