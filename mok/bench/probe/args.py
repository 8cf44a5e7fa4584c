"""The probe's command line: ``python -m mok.bench probe`` flags, the full-run and ``--quick``
defaults, their checks and the points each section will measure (pure Python)."""

from __future__ import annotations

import argparse

from mok.bench.probe.results import SECTIONS

__all__ = [
    "DEFAULTS",
    "FENCE_MAX_BYTES",
    "GEMM_SHAPES",
    "MIB",
    "build_parser",
    "fence_points",
    "parse_args",
    "plan_points",
]

MIB = 1 << 20
GEMM_SHAPES = {"h7168_i2048": (7168, 2048), "h2048_i768": (2048, 768)}  # (hidden, intermediate)
TMA_STORE_LAG = 4  # csrc/probe/probe.cu kStoreLag: stages still read by bulk stores
POLL_MAX_FLAGS = 128  # csrc/probe/probe.cu kPollMaxFlags
SKEW_MAX_BLOCKS_PER_SM = 4  # csrc/probe/probe.cu block_skew
FENCE_MAX_BYTES = 64 * MIB  # fence_cost points that would store more in all are left out

# option: (full run, --quick)
DEFAULTS = {
    "sms": ("1,2,4,8,16,32,66,132", "1,8,32,132"),
    "copy_mib": (1024, 256),
    "chunks": ("16384,2048", "16384,2048"),
    "iters": (10, 4),
    "warmup": (3, 1),
    "latency_iters": (20000, 2000),
    "chase_mb": ("1,256", "1,256"),
    "hbm_mib": (1024, 512),
    "a2a_tokens": ("512,4096,16384", "4096"),
    "gemm_rows": ("128,256,512,1024,2048,4096", "128,1024,4096"),
    "gemm_warm_s": (2.0, 0.5),
    "gemm_sms": ("8,16,32,66,100,132", "32,66,132"),
    "green_sms": ("16,32,64,128", "32,64"),
    "poll_flags": ("1,2,4,8,16,32,64,128", "1,8,32,128"),
    "poll_sweeps": (256, 64),
    "fence_sms": ("1,8,32,66,132", "1,32,132"),
    "fence_kib": ("0,1,4,16,64,256,1024", "0,16,256"),
    "skew_blocks": ("1,2", "1,2"),
}
_LISTS = (
    "sms",
    "chunks",
    "chase_mb",
    "a2a_tokens",
    "gemm_rows",
    "gemm_sms",
    "green_sms",
    "poll_flags",
    "fence_sms",
    "fence_kib",
    "skew_blocks",
)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m mok.bench probe",
        description="GPU microbenchmarks for `mok-sim calibrate` (torchrun for the peer parts).",
    )
    ap.add_argument("--out", default="probe.json", help="probe JSON to write (rank 0)")
    ap.add_argument("--csv", default=None, help="also write the flat rows as CSV")
    ap.add_argument("--quick", action="store_true", help="fast smoke run: fewer points, repeats")
    ap.add_argument("--skip", default="", help=f"sections to leave out: {','.join(SECTIONS)}")
    ap.add_argument("--sections", default="", help="run only these sections (comma list)")
    ap.add_argument("--sms", help="communication SM counts (comma list; > SMs of the GPU dropped)")
    ap.add_argument("--copy-mib", type=int, help="largest copy, MiB")
    ap.add_argument("--chunks", help="TMA chunk bytes (comma list)")
    ap.add_argument("--inflight", type=int, default=8, help="TMA loads in flight per SM")
    ap.add_argument("--iters", type=int, help="timed repeats per point")
    ap.add_argument("--warmup", type=int, help="untimed repeats per point")
    ap.add_argument("--latency-iters", type=int, help="round trips / dependent loads per launch")
    ap.add_argument("--chase-mb", help="pointer-chase buffer sizes, MB (comma list)")
    ap.add_argument("--hbm-mib", type=int, help="HBM copy/read/write buffer, MiB")
    ap.add_argument("--a2a-tokens", help="NCCL all_to_all tokens per rank pair (comma list)")
    ap.add_argument("--gemm-shapes", default=",".join(GEMM_SHAPES), help="grouped GEMM shapes")
    ap.add_argument("--gemm-experts", type=int, default=8, help="experts per grouped GEMM")
    ap.add_argument("--gemm-rows", help="rows per expert (comma list)")
    ap.add_argument(
        "--gemm-warm-s",
        type=float,
        help="seconds of untimed matmuls before the sustained one (the power-capped clock)",
    )
    ap.add_argument("--gemm-sms", help="compute SM counts for the carveout sweep (comma list)")
    ap.add_argument("--gemm-sms-rows", type=int, default=2048, help="rows per expert there")
    ap.add_argument("--green-sms", help="green-context SM counts (comma list, '' to skip)")
    ap.add_argument("--poll-flags", help="poll_cost: flags per sweep (comma list, 1..128)")
    ap.add_argument("--poll-sweeps", type=int, help="poll_cost: timed sweeps per launch")
    ap.add_argument("--fence-sms", help="fence_cost: storing SMs (comma list; > SMs dropped)")
    ap.add_argument(
        "--fence-kib", help="fence_cost: KiB stored per SM before the fence (comma list, 0 ok)"
    )
    ap.add_argument("--skew-blocks", help="block_skew: blocks per SM (comma list, 1..4)")
    ap.add_argument("--timeout-s", type=float, default=10.0, help="bound of every spin-wait")
    ap.add_argument("--seed", type=int, default=0)
    return ap


def _ints(text: str) -> list[int]:
    return [int(v) for v in str(text).split(",") if v.strip()]


def parse_args(argv: list[str]) -> argparse.Namespace:
    """Parse and fill the full-run or --quick defaults; lists become lists of ints."""
    a = build_parser().parse_args(argv)
    for name, (full, quick) in DEFAULTS.items():
        if getattr(a, name) is None:
            setattr(a, name, quick if a.quick else full)
    for name in _LISTS:
        setattr(a, name, _ints(getattr(a, name)))
    a.skip = [s for s in a.skip.split(",") if s]
    a.sections = [s for s in a.sections.split(",") if s]
    for flag, names in (("--skip", a.skip), ("--sections", a.sections)):
        bad = [s for s in names if s not in SECTIONS]
        if bad:
            raise SystemExit(
                f"probe: unknown {flag} section(s) {bad}; supported: {', '.join(SECTIONS)}"
            )
    if a.sections:  # only these: every other section is skipped
        a.skip = [s for s in SECTIONS if s in a.skip or s not in a.sections]
    a.gemm_shapes = [s for s in a.gemm_shapes.split(",") if s]
    bad = [s for s in a.gemm_shapes if s not in GEMM_SHAPES]
    if bad:
        raise SystemExit(f"probe: unknown --gemm-shapes {bad}; supported: {', '.join(GEMM_SHAPES)}")
    bad = [c for c in a.chunks if c <= 0 or c % 16 or (a.inflight + TMA_STORE_LAG) * c > 220 * 1024]
    if bad or not 1 <= a.inflight <= 16:
        raise SystemExit(
            f"probe: TMA chunks must be positive multiples of 16 with (inflight + 4) x chunk <= "
            f"220 KiB and 1 <= inflight <= 16 (found chunks {bad or a.chunks}, inflight "
            f"{a.inflight})"
        )
    if a.iters < 1 or a.warmup < 0 or a.latency_iters < 1 or a.timeout_s <= 0:
        raise SystemExit("probe: --iters, --latency-iters and --timeout-s must be positive")
    if a.gemm_warm_s < 0:
        raise SystemExit(f"probe: --gemm-warm-s must be >= 0 (found {a.gemm_warm_s})")
    if (
        a.poll_sweeps < 1
        or not all(1 <= k <= POLL_MAX_FLAGS for k in a.poll_flags)
        or not all(n >= 1 for n in a.fence_sms)
        or not all(b >= 0 for b in a.fence_kib)
        or not all(1 <= k <= SKEW_MAX_BLOCKS_PER_SM for k in a.skew_blocks)
    ):
        raise SystemExit(
            f"probe: --poll-flags must lie in 1..{POLL_MAX_FLAGS}, --poll-sweeps and --fence-sms "
            f"be positive, --fence-kib >= 0 and --skew-blocks in 1..{SKEW_MAX_BLOCKS_PER_SM} "
            f"(found {a.poll_flags}, {a.poll_sweeps}, {a.fence_sms}, {a.fence_kib}, "
            f"{a.skew_blocks})"
        )
    return a


def fence_points(a: argparse.Namespace, num_sms: int) -> list[tuple[int, int]]:
    """(storing SMs, bytes per SM) of the fence_cost sweep: ``--fence-sms`` that fit the GPU x
    ``--fence-kib``, without the points that would store more than FENCE_MAX_BYTES in all."""
    return [
        (n, kib * 1024)
        for n in a.fence_sms
        if n <= num_sms
        for kib in a.fence_kib
        if n * kib * 1024 <= FENCE_MAX_BYTES
    ]


def plan_points(
    a: argparse.Namespace, num_sms: int, world: int, fence_peer: bool = False
) -> dict[str, int]:
    """Measurements per section (the progress bar's total); ``fence_peer``: fence_cost also
    stores into a second GPU."""
    sms = [s for s in a.sms if s <= num_sms]
    shapes = len(a.gemm_shapes)
    plan = {
        "hbm": 3,
        "gemm": 2,
        "grouped": shapes * 2 * (len(a.gemm_rows) + len([s for s in a.gemm_sms if s <= num_sms])),
        "local": len(sms) * (1 + len(a.chunks)) + 2 + len(a.chase_mb),
        "peer": 4 * len(sms) * (1 + len(a.chunks)) + 2 + len(a.chase_mb) + len(a.a2a_tokens)
        if world >= 2
        else 0,
        "green": 2 * len([s for s in a.green_sms if s <= num_sms]) if shapes else 0,
        "poll_cost": 2 * 3 * len(a.poll_flags),  # scopes x modes x flag counts
        "fence_cost": 3 * len(fence_points(a, num_sms)) * (2 if fence_peer else 1),
        "block_skew": len(a.skew_blocks),
        "signal_jitter": 2,
    }
    return {k: v for k, v in plan.items() if k not in a.skip}
