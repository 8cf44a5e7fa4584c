"""What every probe section uses: :class:`ProbeContext` (the parsed arguments, the results being
written, this rank, the loaded extension, the kernels' out record, the progress bar, the timers
and checks shared by the sections) and the probe JSON's ``meta``."""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist

from mok.bench.common import PROVENANCE, max_over_ranks, time_cuda, time_cuda_local
from mok.bench.probe.args import MIB, plan_points
from mok.bench.probe.results import ProbeResults
from mok.errors import MoKError, MoKTimeoutError

__all__ = ["ProbeContext", "fence_peer_device", "probe_meta", "noop"]

OUT_NS, OUT_CODE, OUT_ITER, OUT_SEEN, OUT_EXPECTED, OUT_BLOCK = (
    0,
    1,
    2,
    3,
    4,
    5,
)  # csrc/probe/probe.h
OUT_SINK, OUT_CYCLES = 6, 7  # csrc/probe/probe.h


def probe_meta(a: argparse.Namespace, dev: torch.device, world: int) -> dict:
    """The probe JSON's ``meta``: the GPU (SMs, L2), the benchmarks' provenance (with the driver
    and the date) and the arguments."""
    p = torch.cuda.get_device_properties(dev)
    prov = {k: PROVENANCE[k]() for k in ("torch", "cuda", "driver", "git_sha", "date")}
    return {
        "gpu": p.name,
        "num_sms": p.multi_processor_count,
        "l2_mb": round(p.L2_cache_size / MIB, 1),
        "num_ranks": world,
        "torch": prov["torch"],
        "cuda": prov["cuda"],
        "driver": prov["driver"],
        "git_sha": prov["git_sha"],
        "date": prov["date"],
        "quick": bool(a.quick),
        "args": dict(vars(a)),
    }


def cuda_error(err: int) -> str:
    try:
        rt = torch.cuda.cudart()
        return f"{rt.cudaGetErrorString(rt.cudaError(err))} (cudaError {err})"
    except Exception:  # noqa: BLE001 - the name is a courtesy; the code is what matters
        return f"cudaError {err}"


def fence_peer_device(dev: torch.device, world: int) -> int | None:
    """The GPU whose memory fence_cost also stores into: the next visible one, when this is the
    only process (under torchrun every rank runs the one-GPU sections on its own GPU at once) and
    it can map that GPU's memory; None otherwise."""
    count = torch.cuda.device_count()
    if world != 1 or count < 2:
        return None
    peer = (dev.index + 1) % count
    return peer if torch.cuda.can_device_access_peer(dev.index, peer) else None


def noop() -> None:
    """What a rank that only takes part in a collective timing runs."""
    return None


class ProbeContext:
    """State and helpers of the sections; every rank runs every section (collectives stay in
    step), rank 0 writes the JSON."""

    def __init__(self, a: argparse.Namespace, res: ProbeResults, rank: int, world: int, dev):
        from tqdm import tqdm

        from mok import _ext

        self.a, self.res, self.rank, self.world, self.dev = a, res, rank, world, dev
        props = torch.cuda.get_device_properties(dev)
        self.num_sms, self.l2_bytes = props.multi_processor_count, props.L2_cache_size
        self.sms = [s for s in a.sms if s <= self.num_sms]
        self.timeout_ns = int(a.timeout_s * 1e9)
        self.gen = torch.Generator(device=dev).manual_seed(a.seed + rank)
        self.out = torch.zeros(8, dtype=torch.int64, device=dev)  # csrc/probe/probe.h OutField
        self.flag_base = 0
        self.write = tqdm.write
        self.fence_peer = fence_peer_device(dev, world)
        self.plan = plan_points(a, self.num_sms, world, self.fence_peer is not None)
        self.bar = tqdm(total=sum(self.plan.values()), disable=rank != 0, desc="probe")
        self.ext = _ext.load()  # compiles on first use (one log line)

    def say(self, msg: str) -> None:
        if self.rank == 0:
            self.write(msg)

    def tick(self, desc: str) -> None:
        self.bar.set_description(desc[:40], refresh=False)
        self.bar.update()

    def stream(self) -> int:
        return torch.cuda.current_stream().cuda_stream

    def call(self, name: str, fn, *args) -> None:
        err = fn(*args)
        if err:
            raise MoKError(f"probe: launching {name} failed on rank {self.rank}: {cuda_error(err)}")

    def time(self, fn) -> float:
        """Median us, max over ranks (mok.bench.common's CUDA-event timer)."""
        return time_cuda(fn, self.a.iters, self.a.warmup).median_us

    def time_local(self, fn) -> float:
        """Median us of this rank alone (no collectives: used inside a green context)."""
        return time_cuda_local(fn, self.a.iters, self.a.warmup)

    def max_ranks(self, x: float) -> float:
        return max_over_ranks([x])[0]

    def all_ok(self, ok: bool) -> bool:
        t = torch.tensor([int(ok)], device=self.dev)
        dist.all_reduce(t, op=dist.ReduceOp.MIN)
        return bool(t.item())

    def check_out(self, what: str) -> None:
        """Raise on every rank if any rank's kernel recorded a timeout in self.out."""
        torch.cuda.synchronize()
        recs = [torch.empty_like(self.out) for _ in range(self.world)]
        dist.all_gather(recs, self.out)
        for r, rec in enumerate(recs):
            v = rec.tolist()
            if v[OUT_CODE]:
                raise MoKTimeoutError(
                    f"probe: {what} timed out on rank {r} after {self.a.timeout_s:g} s (block "
                    f"{v[OUT_BLOCK]}, iteration {v[OUT_ITER]}, saw {v[OUT_SEEN]}, waited for "
                    f"{v[OUT_EXPECTED]}): the partner never answered; is the peer GPU running "
                    "the probe and mapped (symmetric memory)? Raise --timeout-s if it is slow.",
                    wait=what,
                    peer=(1 - r) if self.world > 1 else r,
                    observed=v[OUT_SEEN],
                    expected=v[OUT_EXPECTED],
                )

    def rand_bytes(self, nbytes: int) -> torch.Tensor:
        t = torch.empty(nbytes // 4, dtype=torch.int32, device=self.dev)
        return t.random_(generator=self.gen).view(torch.uint8)

    def copy_bytes(self, sms: int) -> int:
        """Bytes copied at ``sms`` SMs: >= 256 MiB (4x L2) and ~tens of ms at ~45 GB/s per SM."""
        return min(self.a.copy_mib * MIB, max(256 * MIB, sms * 32 * MIB))

    def flush(self) -> None:
        """Rank 0 rewrites the JSON (and the CSV) with what was measured so far."""
        if self.rank == 0:
            self.res.write(self.a.out)
            if self.a.csv:
                self.res.write_csv(self.a.csv)
