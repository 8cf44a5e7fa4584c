"""A loop-by-loop transcription of the schedule formula (docs/design.md), for small test sizes."""

from __future__ import annotations


def brute_force_pull_rows(
    topk_idx_all,
    num_experts: int,
    rank: int,
    row_tile: int,
    tokens: list[int] | None = None,
    row_order: str = "interleaved",
):
    """Return (offsets, rows) with rows[p] = (src_rank, src_index) or (-1, -1). ``tokens``:
    rank r holds tokens[r] tokens (rows of ``topk_idx_all[r]`` past that are padding); default
    all of them. ``row_order``: the sources take turns (``interleaved``) or come one after the
    other (``source``)."""
    num_ranks, num_tokens, num_topk = (int(s) for s in topk_idx_all.shape)
    tokens = [num_tokens] * num_ranks if tokens is None else tokens
    num_local = num_experts // num_ranks
    entries = {}  # (l, r) -> src_index list in increasing order
    for r in range(num_ranks):
        for t in range(tokens[r]):
            for k in range(num_topk):
                e = int(topk_idx_all[r, t, k])
                if e // num_local == rank:
                    entries.setdefault((e % num_local, r), []).append(t * num_topk + k)
    m = [[len(entries.get((lx, r), [])) for r in range(num_ranks)] for lx in range(num_local)]
    offsets = [0]
    for lx in range(num_local):
        size = sum(m[lx])
        offsets.append(offsets[-1] + (size + row_tile - 1) // row_tile * row_tile)
    rows = [(-1, -1)] * offsets[-1]
    for (lx, r), idxs in entries.items():
        for o, i in enumerate(idxs):
            if row_order == "source":
                p = sum(m[lx][r2] for r2 in range(r)) + o
            else:
                p = sum(min(m[lx][r2], o) for r2 in range(num_ranks))
                p += sum(1 for r2 in range(r) if m[lx][r2] > o)
            rows[offsets[lx] + p] = (r, i)
    return offsets, rows
