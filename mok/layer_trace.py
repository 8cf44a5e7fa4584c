"""Per-tile timeline of the fused layer: ``forward(..., trace=new_trace(ws))``.

The kernel writes (globaltimer ns, packed event) pairs: communication blocks and each worker's
TMA producer into region 0 of their block, the first consumer warpgroup into region 1
(csrc/layer/sm90_fwd.cuh ``TraceEvent``). :func:`decode` turns the buffer into events,
:func:`summary` into per-role time splits, :func:`to_chrome` into a Chrome / Perfetto trace.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

__all__ = ["EVENTS", "SPANS", "Event", "new_trace", "decode", "summary", "to_chrome"]

EVENTS = {
    1: "staged",
    2: "pulled",
    3: "ring_wait",
    4: "ready",
    10: "dep_wait",
    11: "dep_done",
    20: "tile_start",
    21: "first_stage",
    22: "main_done",
    23: "epi_done",
    24: "epi_staged",
    25: "epi_stored",
    26: "epi_fenced",
    30: "sum_start",
    31: "sum_done",
}
TILE_KINDS = ("shared_gu", "shared_dn", "gu", "dn")
# Events stamped per GEMM tile (the packed kind byte names the tile kind), and the others.
_TILE_EVENTS = frozenset(c for c in EVENTS if 10 <= c < 30)
_INSTANTS = frozenset(n for c, n in EVENTS.items() if c not in _TILE_EVENTS)
# Phases between two events of one tile: name -> (start, end).
SPANS = {
    "consumer_wait_first_stage": ("tile_start", "first_stage"),
    "consumer_mma": ("first_stage", "main_done"),
    "consumer_epilogue": ("main_done", "epi_done"),
    "consumer_epilogue_stage": ("main_done", "epi_staged"),
    # until the last chunk is handed to the store warp (which stores, fences and publishes it
    # while the consumers go on; its work is not traced)
    "consumer_epilogue_store": ("epi_staged", "epi_stored"),
    "producer_dependency_wait": ("dep_wait", "dep_done"),
}
# The non-overlapping ones, drawn in the Chrome trace.
_CHROME_SPANS = (
    "consumer_wait_first_stage",
    "consumer_mma",
    "consumer_epilogue",
    "producer_dependency_wait",
)


@dataclass(frozen=True)
class Event:
    block: int
    region: int  # 0: communication / producer thread, 1: first consumer warpgroup
    t_ns: int
    name: str
    kind: str  # tile kind ("" outside tiles)
    index: int  # tile index in the worker's order, or minibatch


def new_trace(ws, entries: int = 4096) -> torch.Tensor:
    """A zeroed trace buffer for one call on ``ws``'s GPU (int64 [num_sms, 2, entries, 2])."""
    return torch.zeros(ws.num_sms, 2, entries, 2, dtype=torch.int64, device=ws.device)


def decode(trace: torch.Tensor) -> list[Event]:
    """Events of a filled buffer, sorted by time (synchronises)."""
    t = trace.cpu().numpy().view("uint64")
    out = []
    for b in range(t.shape[0]):
        for r in range(2):
            n = int(t[b, r, 0, 0])
            for ns, code in t[b, r, 1 : n + 1].tolist():
                kind = (code >> 48) & 0xFF
                is_tile = (code >> 56) in _TILE_EVENTS
                out.append(
                    Event(
                        b,
                        r,
                        ns,
                        EVENTS.get(code >> 56, f"event{code >> 56}"),
                        TILE_KINDS[kind] if is_tile and kind < len(TILE_KINDS) else "",
                        code & 0xFFFFFFFF,
                    )
                )
    out.sort(key=lambda e: e.t_ns)
    return out


def _spans(events: list[Event], start: str, end: str) -> list[tuple[Event, Event]]:
    open_: dict[tuple[int, int, int], Event] = {}
    spans = []
    for e in events:
        key = (e.block, e.region, e.index)
        if e.name == start:
            open_[key] = e
        elif e.name == end and key in open_:
            spans.append((open_.pop(key), e))
    return spans


def summary(events: list[Event]) -> dict[str, float]:
    """Time splits in us, summed over workers: consumers waiting for a tile's first stage, in
    the MMA loop, in the epilogue (per tile kind), producers waiting for operands; plus the
    layer's span, the final sum's span, and ``worker_end_spread``: how far apart the workers'
    last tiles ended (load balance at the end of the GEMM phase)."""
    out: dict[str, float] = {}
    for name, (a, b) in SPANS.items():
        for s, e in _spans(events, a, b):
            key = f"{name}[{s.kind}]" if s.kind else name
            out[key] = out.get(key, 0.0) + (e.t_ns - s.t_ns) / 1e3
    if events:
        out["span"] = (events[-1].t_ns - events[0].t_ns) / 1e3
        ends: dict[int, int] = {}
        for e in events:
            if e.name == "epi_done":
                ends[e.block] = max(ends.get(e.block, 0), e.t_ns)
        if ends:
            out["worker_end_spread"] = (max(ends.values()) - min(ends.values())) / 1e3
        sums = [e.t_ns for e in events if e.name in ("sum_start", "sum_done")]
        if sums:
            out["final_sum_span"] = (max(sums) - min(sums)) / 1e3
    return out


def to_chrome(events: list[Event], path: str | Path) -> None:
    """Chrome trace JSON (opens in ui.perfetto.dev): a track per block and region."""
    t0 = events[0].t_ns if events else 0
    rows = []
    for a, b in (SPANS[name] for name in _CHROME_SPANS):
        for s, e in _spans(events, a, b):
            rows.append(
                {
                    "name": f"{s.kind} {a}->{b}",
                    "ph": "X",
                    "pid": s.block,
                    "tid": s.region,
                    "ts": (s.t_ns - t0) / 1e3,
                    "dur": (e.t_ns - s.t_ns) / 1e3,
                    "args": {"tile": s.index},
                }
            )
    for e in events:
        if e.name in _INSTANTS:
            rows.append(
                {
                    "name": e.name,
                    "ph": "i",
                    "pid": e.block,
                    "tid": e.region,
                    "ts": (e.t_ns - t0) / 1e3,
                    "s": "t",
                    "args": {"index": e.index},
                }
            )
    Path(path).write_text(json.dumps({"traceEvents": rows}))
