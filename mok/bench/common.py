"""What every benchmark shares (``comm``, ``layer`` / ``sweep`` and ``probe``).

- :func:`init_dist`: join the process group, NCCL with one GPU per process and NVLink multicast
  off before NCCL starts (:func:`mok.bench.env.disable_multicast`); a plain ``python -m mok.bench
  <command>`` without torchrun runs as a world of one.
- :func:`provenance`: the columns every CSV row carries (:data:`mok.spec.rows.PROVENANCE_COLUMNS`,
  less the per-row ``routing_seed``), from the getters of :data:`PROVENANCE`, which also give the
  probe JSON's ``meta`` (with ``driver`` and ``date``).
- :func:`time_cuda`: CUDA-event times of back-to-back calls after warm-up (a count of calls, and
  optionally seconds of them, so that the GPU reaches its sustained, power-capped clock), (median,
  p20, p80) in us, each the max over ranks (:func:`max_over_ranks`), and optionally the SM clock
  the timed calls ran at; :func:`time_cuda_local` for one rank alone.
- :class:`Recorder`: the rows of one CSV (GB/s over NVLink bytes, fraction of
  :data:`CEILING_GBPS`, provenance), printed as they come and written by rank 0;
  :class:`OneGpuRecorder` for the one-GPU benchmarks (no NVLink columns).
- the command lines' shared parts: :func:`parse_choices` (a comma list from a fixed set),
  :func:`check_one_gpu` (the one-GPU benchmarks' refusals), :func:`case_jobs` (models x tokens
  x skews), :func:`run_cases` (each case in turn, a progress bar, the CSV rewritten after
  each) and :func:`close_dist`.
- :func:`draw_routing`: the routing a benchmark runs on, drawn with
  :func:`mok.spec.workload.make_routing` (seed :func:`mok.spec.rows.bench_routing_seed`).
- :func:`compiled`: ``torch.compile`` of a baseline, once per function, or None where it does
  not build.

Importing this module touches neither CUDA nor the process group.
"""

from __future__ import annotations

import contextlib
import csv
import datetime
import itertools
import math
import os
import subprocess
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import NamedTuple

import torch
import torch.distributed as dist

from mok.bench.clocks import ClockSampler
from mok.ranks import init_ranks
from mok.spec.rows import PROVENANCE_COLUMNS, bench_routing_seed, git_sha

__all__ = [
    "CEILING_GBPS",
    "PROVENANCE",
    "OneGpuRecorder",
    "Recorder",
    "Timing",
    "add_warm_s",
    "case_jobs",
    "check_one_gpu",
    "close_dist",
    "compiled",
    "draw_routing",
    "driver_version",
    "init_dist",
    "is_rank0",
    "max_over_ranks",
    "parse_choices",
    "provenance",
    "run_cases",
    "time_cuda",
    "time_cuda_local",
    "world_size",
]

# One-direction peer-copy ceiling measured on 2x H200 (docs/perf-notes.md): frac_ceiling of a row.
CEILING_GBPS = 370.0


# ---- the process group -------------------------------------------------------------------------
def init_dist(command: str = "mok.bench") -> torch.device:
    """Join the torchrun group and return this process's GPU (:func:`mok.ranks.init_ranks`):
    NCCL with one GPU per process, or gloo with ranks sharing a GPU under ``MOK_SHARED_GPU=1``
    (timings then say nothing about NVLink); NVLink multicast off. Without torchrun (no
    ``RANK``) the process is a world of one. Raises :class:`mok.errors.MoKUnsupportedError`
    without a CUDA GPU (``command`` names the caller)."""
    return init_ranks(command)


def _joined() -> bool:
    return dist.is_available() and dist.is_initialized()


def is_rank0() -> bool:
    """Whether this process prints and writes (rank 0, or no process group)."""
    return not _joined() or dist.get_rank() == 0


def world_size() -> int:
    """Ranks of the process group (1 without one)."""
    return dist.get_world_size() if _joined() else 1


# ---- provenance --------------------------------------------------------------------------------
def driver_version() -> str:
    """The NVIDIA driver version (``nvidia-smi``; ``unknown`` where it cannot be read)."""
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=30,
        )
        return out.stdout.strip().splitlines()[0] if out.stdout.strip() else "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


# column -> getter of a measured value's provenance. Rows carry the PROVENANCE_COLUMNS found here
# (routing_seed is the row's own: see draw_routing); the probe's meta takes all of them.
PROVENANCE: dict[str, Callable[[], object]] = {
    "gpu": lambda: torch.cuda.get_device_name(),
    "num_ranks": world_size,
    "torch": lambda: torch.__version__,
    "cuda": lambda: torch.version.cuda,
    "git_sha": git_sha,
    "driver": driver_version,
    "date": lambda: datetime.date.today().isoformat(),
}


def provenance() -> dict:
    """The provenance columns of every CSV row of this run (after :func:`init_dist`), in the order
    of :data:`mok.spec.rows.PROVENANCE_COLUMNS`."""
    return {c: PROVENANCE[c]() for c in PROVENANCE_COLUMNS if c in PROVENANCE}


# ---- timing ------------------------------------------------------------------------------------
class Timing(NamedTuple):
    """Per-call time in us of back-to-back calls (max over ranks), and the SM clock they ran at
    (MHz, the median of :class:`mok.bench.clocks.ClockSampler`'s samples, lowest over ranks;
    None where it was not read)."""

    median_us: float
    p20_us: float
    p80_us: float
    sm_mhz: float | None = None


def max_over_ranks(values: Sequence[float]) -> list[float]:
    """Each value's maximum over the ranks (float64, all-reduced on this process's GPU)."""
    q = torch.tensor([float(v) for v in values], dtype=torch.float64, device="cuda")
    dist.all_reduce(q, op=dist.ReduceOp.MAX)
    return [float(v) for v in q.cpu()]


def _event_times_us(fn, iters, warmup, then, barrier, warm_s=0.0, sampler=None) -> list[float]:
    """Sorted per-call CUDA-event times (us) of ``iters`` calls after the warm-up: at least
    ``warmup`` untimed calls, and more until ``warm_s`` seconds have passed (the GPU settles at
    its power-capped clock under sustained work, which short bursts do not reach). ``sampler``
    (a :class:`mok.bench.clocks.ClockSampler`) reads the clock during the timed calls."""
    start, done = time.perf_counter(), 0
    while done < warmup or time.perf_counter() - start < warm_s:
        fn()
        if then is not None:
            then()
        done += 1
        if warm_s > 0:
            torch.cuda.synchronize()  # the host's clock then follows the GPU's work
    torch.cuda.synchronize()
    if barrier:
        dist.barrier()
    ev = [
        (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
        for _ in range(iters)
    ]
    with sampler if sampler is not None else contextlib.nullcontext():
        for s, e in ev:
            s.record()
            fn()
            e.record()
            if then is not None:
                then()
        torch.cuda.synchronize()
    return sorted(s.elapsed_time(e) * 1e3 for s, e in ev)


def time_cuda(fn, iters: int, warmup: int, then=None, warm_s: float = 0.0, clocks=False) -> Timing:
    """Median, p20 and p80 (us) of ``fn``'s back-to-back calls timed with CUDA events after the
    warm-up (``warmup`` calls at least, ``warm_s`` seconds at least), the ranks in step (a barrier
    before the timed calls), each the max over ranks. ``then`` (untimed) runs after every call:
    for steps that need their consumer to run before they can run again. ``clocks``: sample the
    SM clock during the timed calls (:attr:`Timing.sm_mhz`)."""
    sampler = ClockSampler(torch.cuda.current_device()) if clocks else None
    t = torch.tensor(
        _event_times_us(fn, iters, warmup, then, True, warm_s, sampler), dtype=torch.float64
    )
    med, p20, p80 = max_over_ranks([t.median(), t.quantile(0.2), t.quantile(0.8)])
    mhz = None if sampler is None else sampler.median_mhz()
    if sampler is not None and world_size() > 1:  # every rank joins: the slowest rank's clock
        low = -max_over_ranks([-(math.inf if mhz is None else mhz)])[0]
        mhz = None if math.isinf(low) else low
    return Timing(med, p20, p80, mhz)


def add_warm_s(ap, default: float = 1.0) -> None:
    """The ``--warm-s`` option of the benchmarks that time sustained tensor-core work."""
    ap.add_argument(
        "--warm-s",
        type=float,
        default=default,
        help="seconds of untimed calls before each timed row (the GPU reaches its sustained, "
        "power-capped clock after ~0.1-0.2 s of such work)",
    )


def time_cuda_local(fn, iters: int, warmup: int) -> float:
    """Median us of ``fn`` on this rank alone (no collectives: usable inside a green context)."""
    t = _event_times_us(fn, iters, warmup, None, False)
    return t[len(t) // 2]


# ---- rows --------------------------------------------------------------------------------------
class Recorder:
    """The rows of one benchmark CSV: each row gets ``nvlink_gbps`` (``nvlink_bytes`` / median),
    ``frac_ceiling`` (of :data:`CEILING_GBPS`), times rounded to 0.1 us and the run's provenance
    ``meta``; rank 0 prints :meth:`describe` of each and :meth:`write` writes the CSV."""

    def __init__(self, path: str | None, meta: dict):
        self.rows, self.path, self.meta = [], path, meta

    def add(self, **row) -> None:
        nb = row.get("nvlink_bytes", 0)
        us = row["median_us"]
        gbps = nb / (us * 1e3) if us > 0 else 0.0
        row.update(nvlink_gbps=round(gbps, 1), frac_ceiling=round(gbps / CEILING_GBPS, 3))
        for k in ("median_us", "p20_us", "p80_us"):
            row[k] = round(row[k], 1)
        self.rows.append({**row, **self.meta})
        if is_rank0():
            print(self.describe(row), flush=True)

    def describe(self, row: dict) -> str:
        """The printed line of a row (each benchmark's recorder names its own columns)."""
        return f"{row['median_us']:>9.1f} us {row['nvlink_gbps']:>6.1f} GB/s"

    def write(self) -> None:
        if not is_rank0() or not self.path or not self.rows:
            return
        Path(self.path).parent.mkdir(parents=True, exist_ok=True)
        with open(self.path, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(self.rows[0]))
            w.writeheader()
            w.writerows(self.rows)
        print(f"wrote {self.path}", flush=True)


class OneGpuRecorder(Recorder):
    """The rows of a one-GPU benchmark's CSV: its ``times`` columns rounded to 0.1 us, then the
    run's provenance (no NVLink columns)."""

    times: tuple[str, ...] = ("median_us", "p20_us", "p80_us")

    def add(self, **row) -> None:
        for k in self.times:
            row[k] = round(row[k], 1)
        self.rows.append({**row, **self.meta})
        if is_rank0():
            print(self.describe(row), flush=True)


# ---- command lines -----------------------------------------------------------------------------
def parse_choices(ap, text: str, allowed: Sequence[str], flag: str) -> tuple[str, ...]:
    """The comma list ``text`` of ``flag``; ``ap.error`` (exit 2) naming any value not in
    ``allowed``."""
    values = tuple(text.split(","))
    unknown = sorted(set(values) - set(allowed))
    if unknown:
        ap.error(f"unknown {flag} {', '.join(unknown)}; supported: {', '.join(allowed)}")
    return values


def check_one_gpu(ap, emulate_ep: int, why: str = "", hint: str = "") -> None:
    """The one-GPU benchmarks' refusals, before any GPU work: a negative ``--emulate-ep``, a
    torchrun world of more than one process (``why`` / ``hint``: the benchmark's reason and
    advice, around the world size)."""
    if emulate_ep < 0:
        ap.error(f"--emulate-ep must be >= 0 (found {emulate_ep})")
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:
        ap.error(f"runs on one GPU{why}, not under a world of {world}{hint}")


def case_jobs(args) -> list[tuple[str, int, str]]:
    """The (model, tokens per rank, skew) cases of ``--models`` x ``--tokens`` x ``--skews``."""
    tokens = (int(v) for v in args.tokens.split(","))
    return list(itertools.product(args.models.split(","), tokens, args.skews.split(",")))


def run_cases(rec: Recorder, jobs, desc: str, run: Callable[..., None]) -> int:
    """``run(*job)`` for each job (a progress bar on rank 0), the caching allocator emptied and
    the CSV rewritten after each; then :func:`close_dist`."""
    from tqdm import tqdm

    for job in tqdm(jobs, disable=not is_rank0(), desc=desc):
        run(*job)
        torch.cuda.empty_cache()
        rec.write()
    return close_dist()


def close_dist() -> int:
    """All ranks done, the process group destroyed; the benchmark's exit status (0)."""
    dist.barrier()
    dist.destroy_process_group()
    return 0


# ---- routing -----------------------------------------------------------------------------------
def draw_routing(n: int, num_experts: int, topk: int, skew: str, seed: int | None = None):
    """(this rank's topk_idx, topk_weights on the GPU, the whole trace) of ``n`` tokens per rank,
    drawn with :func:`mok.spec.workload.make_routing` for the process group's ranks; ``seed``
    defaults to :func:`mok.spec.rows.bench_routing_seed` (the seed rows record)."""
    from mok.spec.workload import make_routing

    seed = bench_routing_seed(n) if seed is None else seed
    t = make_routing(n, num_experts, topk, dist.get_world_size(), skew, seed=seed)
    idx, w = t.rank_slice(dist.get_rank())
    return torch.from_numpy(idx).cuda(), torch.from_numpy(w).cuda(), t


# ---- torch.compile -----------------------------------------------------------------------------
_COMPILED: dict = {}


@contextlib.contextmanager
def one_rank_gather(emulated_ep: int):
    """Inside: mok's unfused forward at one rank gathers its rows from x (no dispatch,
    :data:`mok.layer.GATHER_AT_ONE_RANK`) only where the run stands for one rank
    (``emulated_ep`` <= 1). The per-rank work of EP N > 1 keeps the dispatch: a rank of EP N
    sends its rows to their experts' owners, so its copy is part of that work."""
    import mok.layer as ml

    before = ml.GATHER_AT_ONE_RANK
    ml.GATHER_AT_ONE_RANK = before and emulated_ep <= 1
    try:
        yield
    finally:
        ml.GATHER_AT_ONE_RANK = before


def compiled(fn):
    """``torch.compile(fn, dynamic=False)`` (one per function, so each shape compiles once per
    process), or None (with the reason printed) where it does not build. A compile that fails
    later, at the first call, is the caller's to catch."""
    if fn not in _COMPILED:
        try:
            _COMPILED[fn] = torch.compile(fn, dynamic=False)
        except Exception as e:  # noqa: BLE001 - any compile failure just drops the row
            if is_rank0():
                print(f"torch.compile unavailable ({type(e).__name__}: {e})", flush=True)
            _COMPILED[fn] = None
    return _COMPILED[fn]
