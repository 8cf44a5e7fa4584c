"""The probe's command line: ``python -m mok.bench probe`` flags, the full-run and ``--quick``
defaults, their checks and the points each section will measure (pure Python)."""

from __future__ import annotations

import argparse

from mok.bench.probe.results import SECTIONS

__all__ = ["DEFAULTS", "GEMM_SHAPES", "MIB", "build_parser", "parse_args", "plan_points"]

MIB = 1 << 20
GEMM_SHAPES = {"h7168_i2048": (7168, 2048), "h2048_i768": (2048, 768)}  # (hidden, intermediate)
TMA_STORE_LAG = 4  # csrc/probe/probe.cu kStoreLag: stages still read by bulk stores

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
    "gemm_sms": ("8,16,32,66,100,132", "32,66,132"),
    "green_sms": ("16,32,64,128", "32,64"),
}


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m mok.bench probe",
        description="GPU microbenchmarks for `mok-sim calibrate` (torchrun for the peer parts).",
    )
    ap.add_argument("--out", default="probe.json", help="probe JSON to write (rank 0)")
    ap.add_argument("--csv", default=None, help="also write the flat rows as CSV")
    ap.add_argument("--quick", action="store_true", help="fast smoke run: fewer points, repeats")
    ap.add_argument("--skip", default="", help=f"sections to leave out: {','.join(SECTIONS)}")
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
    ap.add_argument("--gemm-sms", help="compute SM counts for the carveout sweep (comma list)")
    ap.add_argument("--gemm-sms-rows", type=int, default=2048, help="rows per expert there")
    ap.add_argument("--green-sms", help="green-context SM counts (comma list, '' to skip)")
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
    for name in ("sms", "chunks", "chase_mb", "a2a_tokens", "gemm_rows", "gemm_sms", "green_sms"):
        setattr(a, name, _ints(getattr(a, name)))
    a.skip = [s for s in a.skip.split(",") if s]
    bad = [s for s in a.skip if s not in SECTIONS]
    if bad:
        raise SystemExit(
            f"probe: unknown --skip section(s) {bad}; supported: {', '.join(SECTIONS)}"
        )
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
    return a


def plan_points(a: argparse.Namespace, num_sms: int, world: int) -> dict[str, int]:
    """Measurements per section (the progress bar's total)."""
    sms = [s for s in a.sms if s <= num_sms]
    shapes = len(a.gemm_shapes)
    plan = {
        "hbm": 3,
        "gemm": 1,
        "grouped": shapes * 2 * (len(a.gemm_rows) + len([s for s in a.gemm_sms if s <= num_sms])),
        "local": len(sms) * (1 + len(a.chunks)) + 2 + len(a.chase_mb),
        "peer": 4 * len(sms) * (1 + len(a.chunks)) + 2 + len(a.chase_mb) + len(a.a2a_tokens)
        if world >= 2
        else 0,
        "green": 2 * len([s for s in a.green_sms if s <= num_sms]) if shapes else 0,
    }
    return {k: v for k, v in plan.items() if k not in a.skip}
