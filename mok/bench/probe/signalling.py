"""Push signalling on one GPU, with the kernels of csrc/probe/probe.cu: the cost of a sweep over
K flags that are already set (``poll_cost``), of the release fence after n SMs stored K bytes each
(``fence_cost``; also into a second GPU where one process sees two), the spread of the start
times of a persistent grid (``block_skew``) and the distribution of flag round trips between two
blocks (``signal_jitter``). The parameters they pin are those of
:class:`sim.core.hardware.Signalling` (docs/sim-validation.md, "Push signalling");
:func:`sim.app.signalling_fit.fit_signalling` turns the results into them.

Every rank measures its own GPU; each number written is the maximum over ranks.
"""

from __future__ import annotations

import statistics

import torch

from mok.bench.common import max_over_ranks
from mok.bench.probe.args import fence_points
from mok.bench.probe.context import OUT_CYCLES, OUT_NS, OUT_SINK, ProbeContext
from mok.bench.probe.results import FENCES, POLL_MODES, distribution
from mok.errors import MoKError

__all__ = [
    "fence_block_times",
    "measure_block_skew",
    "measure_fence_cost",
    "measure_poll_cost",
    "measure_signal_jitter",
    "round_trips_us",
    "skew_stats",
]

POLL_WARMUP = 8  # untimed sweeps per launch
FENCE_HOLD_NS = 50_000  # a fence block lives >= this long: its SM clock against %globaltimer
SKEW_HOLD_NS = 20_000  # a skew block holds its SM this long after its entry
FENCE_REC_WORDS, SKEW_REC_WORDS = 8, 4  # csrc/probe/probe.h fence_cost / block_skew records
MAX_JITTER_SAMPLES = 28672  # csrc/probe/probe.cu kMaxJitterSamples
_STATS = ("min", "p50", "mean", "p90", "p99", "max", "std")


def measure_poll_cost(p: ProbeContext) -> None:
    """ns per sweep over K flags that hold their target, by scope, mode and K."""
    flags = torch.ones(max(p.a.poll_flags), dtype=torch.int64, device=p.dev)  # target 1: set
    sweeps = p.a.poll_sweeps
    for scope in ("gpu", "sys"):
        for code, mode in enumerate(POLL_MODES):
            for k in p.a.poll_flags:
                ns, missed = [], 0
                for _ in range(3):
                    p.out.zero_()
                    p.call(
                        "the poll kernel", p.ext.probe_poll_flags, flags.data_ptr(), k, code,
                        int(scope == "gpu"), 1, POLL_WARMUP, sweeps, p.out.data_ptr(), p.stream(),
                    )  # fmt: skip
                    out = p.out.tolist()  # (synchronises)
                    ns.append(out[OUT_NS] / sweeps)
                    missed += out[OUT_SINK]
                ns_sweep, missed = max_over_ranks([sorted(ns)[1], missed])
                if missed:
                    raise MoKError(
                        f"probe: the poll kernel found {missed:g} sweeps with a flag below its "
                        f"target ({mode}, {scope} scope, {k} flags); the flags were set before "
                        "the launch, so their stores were not visible to it"
                    )
                p.res.add_poll_cost(scope, mode, k, ns_sweep)
                p.tick(f"poll {mode} {scope} {k}")


def fence_block_times(rec: list[list[int]]) -> tuple[float, float, float]:
    """(median fence us, slowest block's fence us, median store us) of one fence_cost launch,
    from its per-block records (%globaltimer / %clock64 pairs at entry, stores issued, flag
    raised, end of hold): %clock64 intervals converted with each block's own SM clock."""
    fence, store = [], []
    for g0, c0, g1, c1, g2, c2, g3, c3 in rec:
        if g3 > g0 and c3 > c0:
            ns_per_cycle = (g3 - g0) / (c3 - c0)
            fence.append((c2 - c1) * ns_per_cycle / 1e3)
            store.append((c1 - c0) * ns_per_cycle / 1e3)
        else:  # no clock reading: the coarser %globaltimer interval
            fence.append((g2 - g1) / 1e3)
            store.append((g1 - g0) / 1e3)
    if not fence:
        raise ValueError("no fence_cost block records")
    return statistics.median(fence), max(fence), statistics.median(store)


def measure_fence_cost(p: ProbeContext) -> None:
    """Release-fence time after n SMs stored K bytes each, locally and (one process seeing two
    GPUs) into the next GPU's memory."""
    points = fence_points(p.a, p.num_sms)
    if not points:
        p.res.skip("fence_cost", f"no --fence-sms fits the {p.num_sms} SMs of this GPU")
        return
    targets = [("local", p.dev)]
    if p.fence_peer is not None:
        p.call("enabling peer access", p.ext.probe_enable_peer_access, p.fence_peer)
        targets.append(("peer", torch.device("cuda", p.fence_peer)))
    else:
        reason = (
            "stores into a peer GPU need one process that sees two GPUs with peer access "
            f"(this run: {p.world} process(es), {torch.cuda.device_count()} visible GPU(s))"
        )
        p.res.skip("fence_cost.peer", reason)
    max_n = max(n for n, _ in points)
    rec = torch.zeros(max_n * FENCE_REC_WORDS, dtype=torch.int64, device=p.dev)
    for target, dev in targets:
        buf = torch.empty(max(16, max(n * b for n, b in points)), dtype=torch.uint8, device=dev)
        flags = torch.zeros(max_n, dtype=torch.int64, device=dev)
        for code, fence in enumerate(FENCES):
            for n, per_sm in points:
                launches = []
                for it in range(1 + p.a.iters):  # the first launch is untimed
                    p.call(
                        "the fence kernel", p.ext.probe_fence_cost, buf.data_ptr(), per_sm,
                        flags.data_ptr(), it + 1, code, n, FENCE_HOLD_NS, rec.data_ptr(),
                        p.stream(),
                    )  # fmt: skip
                    rows = rec[: n * FENCE_REC_WORDS].view(n, FENCE_REC_WORDS).tolist()
                    if it:
                        launches.append(fence_block_times(rows))
                med = [statistics.median(v) for v in zip(*launches, strict=True)]
                p.res.add_fence_cost(target, fence, n, per_sm, *max_over_ranks(med))
                p.tick(f"fence {target} {fence} {n} SMs {per_sm // 1024} KiB")
        del buf, flags
    torch.cuda.synchronize()


def skew_stats(launches: list[list[list[int]]]) -> dict:
    """block_skew's entry of the per-block records (entry ns, SM id, timer step ns, hold ns) of
    several launches of one grid."""
    if not launches or not launches[0]:
        raise ValueError("no block_skew records")
    spreads, offsets, steps, sms = [], [], [], []
    for rows in launches:
        t0 = min(r[0] for r in rows)
        spreads.append((max(r[0] for r in rows) - t0) / 1e3)
        offsets += [(r[0] - t0) / 1e3 for r in rows]
        steps += [r[2] for r in rows if r[2] > 0]
        sms.append(len({r[1] for r in rows}))
    d = distribution(offsets)
    return {
        "blocks": len(launches[0]),
        "sms_seen": min(sms),
        "launches": len(launches),
        "spread_us": statistics.median(spreads),
        "spread_max_us": max(spreads),
        "p50_us": d["p50"],
        "p90_us": d["p90"],
        "p99_us": d["p99"],
        "timer_step_ns": min(steps, default=0),
    }


def measure_block_skew(p: ProbeContext) -> None:
    """Start-time spread of a cooperative grid of k blocks per SM, per ``--skew-blocks``."""
    for k in p.a.skew_blocks:
        grid = k * p.num_sms
        rec = torch.zeros(grid * SKEW_REC_WORDS, dtype=torch.int64, device=p.dev)
        launches = []
        for it in range(1 + 2 * p.a.iters):  # the first launch is untimed
            p.call(
                "the block-skew kernel (a cooperative launch)", p.ext.probe_block_skew, k, grid,
                SKEW_HOLD_NS, rec.data_ptr(), p.stream(),
            )  # fmt: skip
            rows = rec.view(grid, SKEW_REC_WORDS).tolist()
            if it:
                launches.append(rows)
        stats = skew_stats(launches)
        keys = list(stats)
        p.res.add_block_skew(k, dict(zip(keys, max_over_ranks(stats.values()), strict=True)))
        p.tick(f"block skew {k}/SM")


def round_trips_us(cycles: list[int], total_cycles: int, total_ns: int) -> list[float]:
    """Recorded round trips (uint32 %clock64 cycles, as int32 from torch) in us, at the SM clock
    of the timed loop (total_cycles over total_ns)."""
    if total_cycles <= 0 or total_ns <= 0:
        raise ValueError(f"no clock reading (cycles {total_cycles}, ns {total_ns})")
    us_per_cycle = total_ns / total_cycles / 1e3
    return [(c & 0xFFFFFFFF) * us_per_cycle for c in cycles]


def measure_signal_jitter(p: ProbeContext) -> None:
    """Every round trip of the flag ping-pong between two blocks of this GPU, sys and GPU scope."""
    iters = min(p.a.latency_iters, MAX_JITTER_SAMPLES)
    warm = max(10, iters // 20)
    flags = torch.zeros(64, dtype=torch.int64, device=p.dev)
    f0, f1 = flags.data_ptr(), flags.data_ptr() + 256  # separate 128-byte lines
    samples = torch.zeros(iters, dtype=torch.int32, device=p.dev)
    for scope in ("sys", "gpu"):
        flags.zero_()
        p.out.zero_()
        p.call(
            "the recording ping-pong kernel", p.ext.probe_pingpong_samples, f0, f1,
            int(scope == "gpu"), warm, iters, p.timeout_ns, samples.data_ptr(),
            p.out.data_ptr(), p.stream(),
        )  # fmt: skip
        p.check_out("the recorded flag ping-pong between two blocks of one GPU")
        out = p.out.tolist()
        rts = round_trips_us(samples.tolist(), out[OUT_CYCLES], out[OUT_NS])
        d = distribution(rts)
        vals = max_over_ranks([d[k] for k in _STATS])
        p.res.add_signal_jitter("0<->0", scope, iters, dict(zip(_STATS, vals, strict=True)))
        p.tick(f"flag jitter 0<->0 {scope}")
