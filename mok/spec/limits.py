"""What mok's kernels support (ranks, the fused layer's shapes and modes), written once.

The tile sizes mirror ``csrc/layer/sm90_gemm.cuh`` (``kTileM`` receive rows per GEMM block,
``kTileN`` output columns of the down projection, half of it SwiGLU columns per gate/up tile); a
CPU test reads them from the header, so the two cannot drift apart. ``mok.functional`` raises
:class:`mok.MoKUnsupportedError` with :func:`why_unsupported`'s reasons and the simulator's
tuner leaves out what it lists, so both say the same thing in the same words.
"""

from __future__ import annotations

from mok.spec.config import MoKConfig

__all__ = [
    "FUSED_BLOCK_ROWS",
    "FUSED_HIDDEN_TILE",
    "FUSED_INTER_TILE",
    "FUSED_MAX_LOCAL_EXPERTS",
    "FUSED_ROW_TILES",
    "FUSED_DISPATCH_MODES",
    "FUSED_COMBINE_MODES",
    "FUSED_DTYPES",
    "MAX_RANKS",
    "TMA_MIN_ROW_BYTES",
    "config_problems",
    "expert_split_problem",
    "nearest_ep_sizes",
    "rank_count_problem",
    "expert_problems",
    "shape_problems",
    "why_unsupported",
]

# GEMM blocks of 128 receive rows; 256 output columns of the down projection; 128 SwiGLU columns
# (256 gate+up columns) per gate/up tile.
FUSED_BLOCK_ROWS, FUSED_HIDDEN_TILE, FUSED_INTER_TILE = 128, 256, 128
# Local experts per rank: the workers keep their region starts in shared memory.
FUSED_MAX_LOCAL_EXPERTS = 384
# Expert regions padded to 64 rows run their 64-row tails as half tiles.
FUSED_ROW_TILES = (64, 128)
FUSED_DISPATCH_MODES = ("pull", "dedup_pull")
FUSED_COMBINE_MODES = ("push",)
FUSED_DTYPES = ("bf16",)

# Ranks of one expert-parallel group: one NVLink domain, up to an NVL72 rack (csrc/params.h
# kMaxRanks, which sizes the kernels' per-rank arrays; a CPU test compares the two).
MAX_RANKS = 72

# Rows of at least this many bytes move faster through the bulk-copy (TMA) rings; smaller rows
# make their single issuing thread the limit, and 16-byte vector loads win (docs/perf-notes.md
# v3, v4). ``engine="auto"`` picks by it.
TMA_MIN_ROW_BYTES = 8192


def config_problems(cfg: MoKConfig, num_sms: int | None = None) -> list[str]:
    """Why the fused layer cannot run ``cfg`` (empty: it can). ``num_sms``: the GPU's SM count,
    to check ``num_comm_sms`` against (None: not checked)."""
    why = []
    if cfg.dispatch_mode not in FUSED_DISPATCH_MODES or cfg.combine_mode not in FUSED_COMBINE_MODES:
        why.append(
            f"the fused layer supports dispatch_mode {' or '.join(FUSED_DISPATCH_MODES)} with "
            f"combine_mode {' or '.join(FUSED_COMBINE_MODES)} (config has {cfg.dispatch_mode!r} "
            f"/ {cfg.combine_mode!r}); the other modes run through moe_forward(..., fused=False)"
        )
    if cfg.row_tile not in FUSED_ROW_TILES:
        why.append(
            f"the fused layer needs row_tile in {FUSED_ROW_TILES} (config has {cfg.row_tile})"
        )
    if cfg.minibatch_size % FUSED_BLOCK_ROWS:
        why.append(
            f"the fused layer needs minibatch_size % {FUSED_BLOCK_ROWS} == 0 (its GEMM row "
            f"blocks must not straddle minibatches; config has {cfg.minibatch_size})"
        )
    if num_sms is not None and not 1 <= cfg.num_comm_sms < num_sms:
        why.append(
            f"the fused layer needs 1 <= num_comm_sms < {num_sms} SMs (config has "
            f"{cfg.num_comm_sms})"
        )
    return why


def shape_problems(
    hidden: int, intermediate: int, shared_intermediate: int, dtype: str = "bf16", name: str = ""
) -> list[str]:
    """Why the fused layer cannot run a layer of these sizes (empty: it can). ``dtype``: the
    token dtype as ``bf16`` / ``fp32`` / ...; ``name`` prefixes each reason (a preset's name)."""
    pre = f"{name}: " if name else ""
    why = []
    if hidden % FUSED_HIDDEN_TILE:
        why.append(
            f"{pre}the fused layer needs hidden % {FUSED_HIDDEN_TILE} == 0 (found hidden={hidden})"
        )
    for what, n in (("intermediate", intermediate), ("shared intermediate", shared_intermediate)):
        if n % FUSED_INTER_TILE:
            why.append(f"{pre}the fused layer needs {what} % {FUSED_INTER_TILE} == 0 (found {n})")
    if dtype not in FUSED_DTYPES:
        why.append(f"the fused layer runs {' or '.join(FUSED_DTYPES)} tokens (found {dtype})")
    return why


def why_unsupported(
    cfg: MoKConfig,
    hidden: int,
    intermediate: int,
    shared_intermediate: int,
    dtype: str = "bf16",
    num_sms: int | None = None,
    num_local_experts: int | None = None,
) -> list[str]:
    """Every reason the fused layer cannot run ``cfg`` on a layer of these sizes (empty: it can).
    ``num_local_experts``: experts per rank (None: not checked). The GPU itself (the fused
    layer has an sm_90a path only) is checked where it is known."""
    why = config_problems(cfg, num_sms) + shape_problems(
        hidden, intermediate, shared_intermediate, dtype
    )
    if num_local_experts is not None:
        why += expert_problems(num_local_experts)
    return why


def expert_problems(num_local_experts: int) -> list[str]:
    """Why the fused layer cannot hold this many experts per rank (empty: it can)."""
    if num_local_experts <= FUSED_MAX_LOCAL_EXPERTS:
        return []
    return [
        f"the fused layer supports at most {FUSED_MAX_LOCAL_EXPERTS} experts per rank (found "
        f"{num_local_experts}: raise the expert parallelism, or use moe_forward(..., fused=False))"
    ]


def nearest_ep_sizes(num_experts: int, ep: int) -> list[int]:
    """The EP sizes nearest ``ep`` (one below, one above, where they exist) whose ranks split
    ``num_experts`` evenly and that mok's kernels run (at most :data:`MAX_RANKS`)."""
    fits = [d for d in range(1, min(num_experts, MAX_RANKS) + 1) if num_experts % d == 0]
    below = [d for d in fits if d < ep][-1:]
    above = [d for d in fits if d > ep][:1]
    return below + above


def rank_count_problem(num_ranks: int) -> str | None:
    """Why mok's kernels cannot run ``num_ranks`` ranks (None: they can)."""
    if 1 <= num_ranks <= MAX_RANKS:
        return None
    return (
        f"mok's NVLink kernels support 1 to {MAX_RANKS} ranks (one NVLink domain, up to an NVL72 "
        f"rack); found {num_ranks}"
    )


def expert_split_problem(num_experts: int, num_ranks: int) -> str | None:
    """Why ``num_experts`` experts cannot run at EP ``num_ranks`` (None: they can): every rank
    holds the same number of experts (experts r * E / R .. on rank r), so R must divide E; the
    message names the nearest EP sizes that do."""
    if num_ranks >= 1 and num_experts % num_ranks == 0:
        return None
    near = " / ".join(f"EP{d}" for d in nearest_ep_sizes(num_experts, num_ranks))
    return (
        f"num_experts={num_experts} does not split evenly over {num_ranks} ranks (every rank "
        f"holds num_experts / ranks experts); the nearest EP sizes that do: {near}"
    )
