"""GEMM rates: a bf16 ``torch.mm`` 8192^3 (a short burst, and sustained past the GPU's power cap
with the SM clock it ran at), ``torch._grouped_mm`` by rows per expert on all SMs, by SM count
through torch's SM carveout, and (cross-check) inside CUDA green contexts."""

from __future__ import annotations

import itertools
import math

import torch

from mok.bench.common import time_cuda
from mok.bench.probe.args import GEMM_SHAPES
from mok.bench.probe.context import ProbeContext
from mok.errors import MoKUnsupportedError

__all__ = ["grouped_fn", "measure_bf16_gemm", "measure_green", "measure_grouped"]

SUSTAINED_CALLS = 100  # timed calls of the sustained matmul (at least --iters)


def measure_bf16_gemm(p: ProbeContext) -> None:
    n = 8192
    a, b = (torch.randn(n, n, device=p.dev, generator=p.gen).to(torch.bfloat16) for _ in range(2))
    c = torch.empty_like(a)

    def mm():
        torch.mm(a, b, out=c)

    flop = 2.0 * n**3
    us = p.time(mm)
    p.res.add_bf16_gemm(flop / (us * 1e-6) / 1e12)
    p.tick("bf16 matmul")
    # Sustained: ``--gemm-warm-s`` seconds of untimed calls first, then enough timed calls
    # (~1.4 ms each on an H200) for the clock sampler's 20 ms period to see several samples.
    t = time_cuda(
        mm, max(p.a.iters, SUSTAINED_CALLS), p.a.warmup, warm_s=p.a.gemm_warm_s, clocks=True
    )
    p.res.add_bf16_gemm_sustained(flop / (t.median_us * 1e-6) / 1e12, t.sm_mhz, p.a.gemm_warm_s)
    p.tick("bf16 matmul sustained")


def grouped_fn(p: ProbeContext, hidden: int, inter: int, op: str, rows: int):
    """A closure running one grouped GEMM (weight sets rotated past 3x L2)."""
    gm = getattr(torch, "_grouped_mm", None)
    if gm is None:
        raise MoKUnsupportedError(f"torch {torch.__version__} has no torch._grouped_mm")
    e = p.a.gemm_experts
    k, n = (hidden, 2 * inter) if op == "gate_up" else (inter, hidden)
    x = torch.randn(e * rows, k, device=p.dev, generator=p.gen).to(torch.bfloat16)
    sets = max(1, min(8, math.ceil(3 * p.l2_bytes / (e * n * k * 2))))
    # [E, N, K] like nn.Linear weights, handed over transposed ([E, K, N], K contiguous).
    ws = [
        (torch.randn(e, n, k, device=p.dev, generator=p.gen) * k**-0.5).to(torch.bfloat16)
        for _ in range(sets)
    ]
    offs = torch.arange(1, e + 1, device=p.dev, dtype=torch.int32) * rows
    turn = itertools.count()
    return lambda: gm(x, ws[next(turn) % sets].transpose(-2, -1), offs=offs)


def measure_grouped(p: ProbeContext) -> None:
    """Grouped GEMMs by rows per expert (all SMs), then by SM count (carveout)."""
    a, e = p.a, p.a.gemm_experts
    for shape in a.gemm_shapes:
        hidden, inter = GEMM_SHAPES[shape]
        for op in ("gate_up", "down"):
            for rows in a.gemm_rows:
                us = p.time(grouped_fn(p, hidden, inter, op, rows))
                p.res.add_grouped(shape, hidden, inter, e, op, rows, p.num_sms, us)
                p.tick(f"grouped {shape} {op} r{rows}")
    p.flush()
    setter = getattr(torch._C, "_set_sm_carveout_experimental", None)
    counts = [s for s in a.gemm_sms if s <= p.num_sms]
    if setter is None or len(counts) < 2:
        why = "torch has no SM carveout" if setter is None else "need >= 2 --gemm-sms counts"
        p.res.skip("grouped_gemm_by_sms", why)
        return
    rows = a.gemm_sms_rows
    for shape in a.gemm_shapes:
        hidden, inter = GEMM_SHAPES[shape]
        ratios, expect = [], max(counts) / min(counts)
        for op in ("gate_up", "down"):
            fn = grouped_fn(p, hidden, inter, op, rows)
            times = {}
            try:
                for s in counts:
                    setter(None if s >= p.num_sms else p.num_sms - s)
                    times[s] = p.time(fn)
                    p.res.add_grouped(shape, hidden, inter, e, op, rows, s, times[s], by="sms")
                    p.tick(f"grouped {shape} {op} {s} SMs")
            finally:
                setter(None)
            ratios.append(times[min(counts)] / times[max(counts)])
        # NOTE: a working carveout slows the fewest-SM run by a good part of the SM ratio.
        ratio = min(ratios)
        p.res.mark_sm_limit(
            "grouped_gemm_by_sms", f"{shape}_rows{rows}", ratio > 1 + 0.25 * (expect - 1), ratio
        )


def measure_green(p: ProbeContext) -> None:
    """The first shape's grouped GEMMs inside green contexts of ``--green-sms`` SMs."""
    try:
        from torch.cuda.green_contexts import GreenContext
    except ImportError as e:
        p.res.skip("grouped_gemm_by_sms_green", f"no torch.cuda.green_contexts ({e})")
        return
    counts = [s for s in p.a.green_sms if s <= p.num_sms]
    shape, rows = p.a.gemm_shapes[0], p.a.gemm_sms_rows
    hidden, inter = GEMM_SHAPES[shape]
    for op in ("gate_up", "down"):
        fn = grouped_fn(p, hidden, inter, op, rows)
        for s in counts:
            try:
                ctx = GreenContext.create(num_sms=s, device_id=p.dev.index)
            except Exception as e:  # noqa: BLE001 - reported in the JSON
                p.res.skip(
                    "grouped_gemm_by_sms_green",
                    f"GreenContext.create(num_sms={s}) failed: {type(e).__name__}: {e}",
                )
                return
            ctx.set_context()
            try:
                us = p.time_local(fn)
            finally:
                ctx.pop_context()
            p.res.add_grouped(
                shape, hidden, inter, p.a.gemm_experts, op, rows, s, us, by="sms", method="green",
            )  # fmt: skip
            p.tick(f"green {shape} {op} {s} SMs")
