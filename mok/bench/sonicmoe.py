"""SonicMoE's published one-GPU throughput, the bar ``mok.bench train --suite sonicmoe`` puts
mok's rows next to.

Source: SonicMoE's paper (Dao-AILab/sonic-moe), Fig. 14: H100, BF16, uniform routing, no shared
expert, forward FLOPs counted as 6 T K d n and the backward as twice that. The values are read
off the figure (about +-5 %); they are not measured here. Each entry: the preset of
:data:`mok.spec.workload.PRESETS` holding (E, d, n, K), the tokens T of the figure, and its
forward / backward TFLOP/s.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["SonicPoint", "SONICMOE_H100", "published", "sonicmoe_flops", "comparison_lines"]


@dataclass(frozen=True)
class SonicPoint:
    model: str  # a preset of mok.spec.workload
    tokens: int  # T
    fwd_tflops: float  # as read off the figure
    bwd_tflops: float


SONICMOE_H100 = (
    SonicPoint("sonic-1536x256", 24576, 365.0, 405.0),
    SonicPoint("sonic-4096x512", 32768, 505.0, 510.0),
    SonicPoint("sonic-4096x1024", 32768, 550.0, 555.0),
    SonicPoint("sonic-4096x2048", 32768, 600.0, 585.0),
)


def published() -> dict[str, tuple[int, float, float]]:
    """:data:`SONICMOE_H100` by preset: (tokens, forward, backward TFLOP/s), the form
    :func:`sim.app.plots.published_comparison` takes."""
    return {p.model: (p.tokens, p.fwd_tflops, p.bwd_tflops) for p in SONICMOE_H100}


def sonicmoe_flops(tokens: int, hidden: int, inter: int, topk: int) -> tuple[int, int]:
    """(forward, backward) FLOPs as SonicMoE counts them: 6 T K d n, and twice that."""
    fwd = 6 * tokens * topk * hidden * inter
    return fwd, 2 * fwd


def comparison_lines(rows: list[dict]) -> list[str]:
    """A table of the train rows of SonicMoE's shapes (one per shape and implementation) next to
    SonicMoE's figures: forward and backward TFLOP/s and their ratios to SonicMoE's."""
    points = {p.model: p for p in SONICMOE_H100}
    out = [
        "| shape (T, d, n, E, K) | SonicMoE fwd / bwd | impl (mode, sms) | fwd / bwd TFLOP/s | "
        "x SonicMoE fwd / bwd | SM MHz |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        p = points.get(r["model"])
        if p is None or int(r["tokens_per_rank"]) != p.tokens:
            continue
        fwd, bwd = float(r["fwd_tflops"]), float(r["bwd_tflops"])
        shape = (
            f"{p.tokens}, {r['hidden']}, {r['intermediate']}, {r['num_experts']}, {r['num_topk']}"
        )
        out.append(
            f"| {shape} | {p.fwd_tflops:g} / {p.bwd_tflops:g} | {r['impl']} ({r['mode']}, "
            f"{r['sms']}) | {fwd:.0f} / {bwd:.0f} | {fwd / p.fwd_tflops:.2f} / "
            f"{bwd / p.bwd_tflops:.2f} | {r.get('sm_mhz', '')} |"
        )
    return out
