"""Provenance of measured rows: the columns every benchmark CSV row carries, and the routing seed.

Every row of ``mok.bench comm`` / ``layer`` / ``sweep`` names the GPU, the software versions,
the git commit and the seed of the routing trace it ran on, so a reader (the simulator's fits
and ``mok-sim validate``) can re-draw exactly that trace with
:func:`mok.spec.workload.make_routing`.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Mapping
from pathlib import Path

__all__ = ["PROVENANCE_COLUMNS", "bench_routing_seed", "git_sha", "row_routing_seed"]

# Written by the benchmarks into every row (besides what the row measures).
PROVENANCE_COLUMNS = ("gpu", "num_ranks", "torch", "cuda", "git_sha", "routing_seed")


def bench_routing_seed(tokens_per_rank: int) -> int:
    """The seed the benchmarks draw a routing of ``tokens_per_rank`` tokens per rank with.

    One seed per batch size: the rows of one size in ``comm``, ``layer`` and ``sweep`` ran on the
    same trace, and the simulator compares them with predictions on that trace."""
    return int(tokens_per_rank)


def row_routing_seed(row: Mapping) -> int:
    """The routing seed of a measured row: its ``routing_seed`` column, or (files written before
    the column existed) the benchmarks' rule :func:`bench_routing_seed`."""
    seed = row.get("routing_seed")
    if seed not in (None, ""):
        return int(seed)
    return bench_routing_seed(int(row["tokens_per_rank"]))


def git_sha() -> str:
    """The short commit of this checkout, with ``-dirty`` when tracked files differ from it (so a
    row measured on uncommitted code says so); ``MOK_GIT_SHA`` overrides it; ``unknown`` outside
    git."""
    env = os.environ.get("MOK_GIT_SHA")
    if env:
        return env
    root = Path(__file__).resolve().parents[2]

    def git(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, timeout=30)

    try:
        sha = git("rev-parse", "--short", "HEAD").stdout.strip()
        if not sha:
            return "unknown"
        dirty = git("status", "--porcelain", "--untracked-files=no").stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return f"{sha}-dirty" if dirty else sha
