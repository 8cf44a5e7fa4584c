"""GPU microbenchmarks for the simulator's calibration: ``python -m mok.bench probe``.

``torchrun --nproc-per-node=2 -m mok.bench probe --out probe.json`` on two NVLink-connected GPUs
(ranks 0 and 1 are the measured pair; further ranks only take part in the collectives), or plain
``python -m mok.bench probe`` on one GPU, where the peer parts are skipped and the JSON says why.
``mok-sim calibrate probe.json`` fits a GPU profile from the result (sim/calibrate.py).

The JSON keeps the keys and units of ``sim/profiles/h200x2-probe-2026-11-29.json``
(``what`` / ``methods`` / ``results``) and adds ``meta``, ``skipped`` and the results
``hbm_bandwidth``, ``signal_latency_gpu_scope``, ``copy_checks``, ``grouped_gemm_by_rows``,
``grouped_gemm_by_sms`` (and ``grouped_gemm_by_sms_green``). Bandwidths and GEMM rates are
CUDA-event medians after warm-up, max over ranks (mok.bench.comm's timer); latencies come from
%globaltimer inside the kernels (csrc/probe.cu). The JSON is rewritten after every section, so a
failure late in the sweep keeps what was measured.
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import math
import os
import socket
import subprocess
import sys

import torch
import torch.distributed as dist

from mok.bench.comm import _timeit
from mok.bench.env import disable_multicast
from mok.bench.probe_results import METHODS, SECTIONS, ProbeResults
from mok.errors import MoKError, MoKTimeoutError, MoKUnsupportedError
from mok.spec.rows import git_sha

__all__ = ["ProbeResults", "build_parser", "parse_args", "plan_points", "main", "METHODS"]

MIB = 1 << 20
ROW_TILE = 128  # rows of one grouped-GEMM tile in sim.gemm's model
GEMM_SHAPES = {"h7168_i2048": (7168, 2048), "h2048_i768": (2048, 768)}  # (hidden, intermediate)
A2A_HIDDEN = 7168
TMA_STORE_LAG = 4  # csrc/probe.cu kStoreLag: stages still read by bulk stores
OUT_NS, OUT_CODE, OUT_ITER, OUT_SEEN, OUT_EXPECTED, OUT_BLOCK = 0, 1, 2, 3, 4, 5  # csrc/probe.h

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


# ---- arguments ---------------------------------------------------------------------------------
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


# ---- running on the GPU ------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _init_dist() -> tuple[int, int, torch.device]:
    if not torch.cuda.is_available():
        raise MoKUnsupportedError(
            f"the probe needs a CUDA GPU (torch.cuda.is_available() is False; torch "
            f"{torch.__version__}); the simulator's committed profiles need none"
        )
    disable_multicast()  # before NCCL starts
    if "RANK" not in os.environ:  # plain `python -m mok.bench probe`: a world of one
        os.environ.update(
            RANK="0",
            WORLD_SIZE="1",
            LOCAL_RANK="0",
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(_free_port()),
        )
    dev = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    torch.cuda.set_device(dev)
    dist.init_process_group("nccl", device_id=dev)
    return dist.get_rank(), dist.get_world_size(), dev


def _driver() -> str:
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


def _meta(a: argparse.Namespace, dev: torch.device, world: int) -> dict:
    p = torch.cuda.get_device_properties(dev)
    return {
        "gpu": p.name,
        "num_sms": p.multi_processor_count,
        "l2_mb": round(p.L2_cache_size / MIB, 1),
        "num_ranks": world,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "driver": _driver(),
        "git_sha": git_sha(),
        "date": datetime.date.today().isoformat(),
        "quick": bool(a.quick),
        "args": dict(vars(a)),
    }


def _cuda_error(err: int) -> str:
    try:
        rt = torch.cuda.cudart()
        return f"{rt.cudaGetErrorString(rt.cudaError(err))} (cudaError {err})"
    except Exception:  # noqa: BLE001 - the name is a courtesy; the code is what matters
        return f"cudaError {err}"


def _noop() -> None:
    return None


class Probe:
    """Runs the sections on every rank (collectives stay in step); rank 0 writes the JSON."""

    def __init__(self, a: argparse.Namespace, res: ProbeResults, rank: int, world: int, dev):
        from tqdm import tqdm

        from mok import _ext

        self.a, self.res, self.rank, self.world, self.dev = a, res, rank, world, dev
        props = torch.cuda.get_device_properties(dev)
        self.num_sms, self.l2_bytes = props.multi_processor_count, props.L2_cache_size
        self.sms = [s for s in a.sms if s <= self.num_sms]
        self.timeout_ns = int(a.timeout_s * 1e9)
        self.gen = torch.Generator(device=dev).manual_seed(a.seed + rank)
        self.out = torch.zeros(8, dtype=torch.int64, device=dev)  # csrc/probe.h OutField
        self.flag_base = 0
        self.write = tqdm.write
        self.plan = plan_points(a, self.num_sms, world)
        self.bar = tqdm(total=sum(self.plan.values()), disable=rank != 0, desc="probe")
        self.ext = _ext.load()  # compiles on first use (one log line)

    # -- helpers --
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
            raise MoKError(
                f"probe: launching {name} failed on rank {self.rank}: {_cuda_error(err)}"
            )

    def time(self, fn) -> float:
        """Median us over ranks' medians (max), mok.bench.comm's CUDA-event timer."""
        return _timeit(fn, self.a.iters, self.a.warmup)[0]

    def max_ranks(self, x: float) -> float:
        t = torch.tensor([float(x)], device=self.dev, dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return float(t.item())

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

    def copy_fn(self, mech: str, dst: int, src: int, nbytes: int, sms: int, chunk, stream: int):
        ext = self.ext
        if mech == "st":
            return lambda: self.call(
                "the 16-byte copy", ext.probe_copy_vector, dst, src, nbytes, sms, stream
            )
        out = self.out.data_ptr()
        inflight, tmo = self.a.inflight, self.timeout_ns
        return lambda: self.call(
            "the TMA copy", ext.probe_copy_tma, dst, src, nbytes, chunk, inflight, sms, tmo, out,
            stream,
        )  # fmt: skip

    def flush(self) -> None:
        if self.rank == 0:
            self.res.write(self.a.out)
            if self.a.csv:
                self.res.write_csv(self.a.csv)

    # -- sections --
    def run(self) -> None:
        steps = {
            "hbm": self.hbm,
            "gemm": self.bf16_gemm,
            "grouped": self.grouped,
            "local": self.local,
            "peer": self.peer,
            "green": self.green,
        }
        for name, fn in steps.items():
            if name in self.a.skip:
                self.res.skip(name, "--skip")
                continue
            if name == "peer" and self.world < 2:
                reason = (
                    "peer-copy bandwidth (16-byte, TMA, memcpyPeer; one and both directions), "
                    "0<->1 flag latency, remote load latency and NCCL all_to_all need 2 GPUs "
                    f"under torchrun --nproc-per-node=2 (this run: {self.world} process, "
                    f"{torch.cuda.device_count()} visible GPU(s))"
                )
                self.res.skip("peer", reason)
                self.say(f"probe: peer parts skipped: {reason}")
                continue
            fn()
            self.flush()
            torch.cuda.synchronize()
            dist.barrier()
        self.bar.close()

    def hbm(self) -> None:
        n = self.a.hbm_mib * MIB
        src = self.rand_bytes(n)
        dst = torch.empty_like(src)
        t_copy = self.time(lambda: dst.copy_(src))
        self.tick("hbm copy")
        s, out = self.stream(), self.out.data_ptr()
        ext = self.ext
        grid = 2 * self.num_sms
        t_read = self.time(
            lambda: self.call("the read kernel", ext.probe_read_bandwidth, src.data_ptr(), n,
                              grid, out, s)
        )  # fmt: skip
        self.tick("hbm read")
        t_write = self.time(lambda: dst.fill_(0x5A))
        self.tick("hbm write")
        self.res.add_hbm(n, 2 * n / (t_copy * 1e3), n / (t_read * 1e3), n / (t_write * 1e3))

    def bf16_gemm(self) -> None:
        n = 8192
        a, b = (
            torch.randn(n, n, device=self.dev, generator=self.gen).to(torch.bfloat16)
            for _ in range(2)
        )
        c = torch.empty_like(a)
        us = self.time(lambda: torch.mm(a, b, out=c))
        self.res.add_bf16_gemm(2.0 * n**3 / (us * 1e-6) / 1e12)
        self.tick("bf16 matmul")

    def grouped_fn(self, hidden: int, inter: int, op: str, rows: int):
        """A closure running one grouped GEMM (weight sets rotated past 3x L2)."""
        gm = getattr(torch, "_grouped_mm", None)
        if gm is None:
            raise MoKUnsupportedError(f"torch {torch.__version__} has no torch._grouped_mm")
        e = self.a.gemm_experts
        k, n = (hidden, 2 * inter) if op == "gate_up" else (inter, hidden)
        x = torch.randn(e * rows, k, device=self.dev, generator=self.gen).to(torch.bfloat16)
        sets = max(1, min(8, math.ceil(3 * self.l2_bytes / (e * n * k * 2))))
        # [E, N, K] like nn.Linear weights, handed over transposed ([E, K, N], K contiguous).
        ws = [
            (torch.randn(e, n, k, device=self.dev, generator=self.gen) * k**-0.5).to(torch.bfloat16)
            for _ in range(sets)
        ]
        offs = torch.arange(1, e + 1, device=self.dev, dtype=torch.int32) * rows
        turn = itertools.count()
        return lambda: gm(x, ws[next(turn) % sets].transpose(-2, -1), offs=offs)

    def grouped(self) -> None:
        a, e = self.a, self.a.gemm_experts
        for shape in a.gemm_shapes:
            hidden, inter = GEMM_SHAPES[shape]
            for op in ("gate_up", "down"):
                for rows in a.gemm_rows:
                    us = self.time(self.grouped_fn(hidden, inter, op, rows))
                    self.res.add_grouped(shape, hidden, inter, e, op, rows, self.num_sms, us)
                    self.tick(f"grouped {shape} {op} r{rows}")
        self.flush()
        setter = getattr(torch._C, "_set_sm_carveout_experimental", None)
        counts = [s for s in a.gemm_sms if s <= self.num_sms]
        if setter is None or len(counts) < 2:
            why = "torch has no SM carveout" if setter is None else "need >= 2 --gemm-sms counts"
            self.res.skip("grouped_gemm_by_sms", why)
            return
        rows = a.gemm_sms_rows
        for shape in a.gemm_shapes:
            hidden, inter = GEMM_SHAPES[shape]
            ratios, expect = [], max(counts) / min(counts)
            for op in ("gate_up", "down"):
                fn = self.grouped_fn(hidden, inter, op, rows)
                times = {}
                try:
                    for s in counts:
                        setter(None if s >= self.num_sms else self.num_sms - s)
                        times[s] = self.time(fn)
                        self.res.add_grouped(
                            shape, hidden, inter, e, op, rows, s, times[s], by="sms"
                        )
                        self.tick(f"grouped {shape} {op} {s} SMs")
                finally:
                    setter(None)
                ratios.append(times[min(counts)] / times[max(counts)])
            # NOTE: a working carveout slows the fewest-SM run by a good part of the SM ratio.
            ratio = min(ratios)
            self.res.mark_sm_limit(
                "grouped_gemm_by_sms", f"{shape}_rows{rows}", ratio > 1 + 0.25 * (expect - 1), ratio
            )

    def local(self) -> None:
        src = self.rand_bytes(self.copy_bytes(max(self.sms)))
        dst = torch.empty_like(src)
        s = self.stream()
        for mech, chunk in [("st", None)] + [("tma", c) for c in self.a.chunks]:
            self.out.zero_()
            fn, b = _noop, 0
            for sms in self.sms:
                b = self.copy_bytes(sms)
                fn = self.copy_fn(mech, dst.data_ptr(), src.data_ptr(), b, sms, chunk, s)
                us = self.time(fn)
                self.check_out(f"the local {mech} copy")
                self.res.add_copy("local", mech, sms, b / (us * 1e3), chunk=chunk)
                self.tick(f"local {mech}{chunk or ''} {sms} SMs")
            dst[:b].fill_(0xA5)  # poison, copy once more, compare
            fn()
            self.check_out(f"the local {mech} copy")
            ok = self.all_ok(torch.equal(dst[:b], src[:b]))
            self.res.add_copy_check(f"local_{mech}" + (f"_chunk{chunk}" if chunk else ""), ok)
        del src, dst
        # flag ping-pong between two blocks of this GPU, system and GPU scope
        flags = torch.zeros(64, dtype=torch.int64, device=self.dev)
        f0, f1 = flags.data_ptr(), flags.data_ptr() + 256  # separate 128-byte lines
        iters = self.a.latency_iters
        warm = max(10, iters // 20)
        for gpu_scope in (False, True):
            rts = []
            for _ in range(3):
                flags.zero_()
                self.out.zero_()
                self.call(
                    "the ping-pong kernel", self.ext.probe_pingpong, f0, f1, f1, f0, 2, 0,
                    int(gpu_scope), warm, iters, 0, self.timeout_ns, self.out.data_ptr(),
                    self.stream(),
                )  # fmt: skip
                self.check_out("the flag ping-pong between two blocks of one GPU")
                rts.append(self.out[OUT_NS].item() / iters)
            rt_ns = self.max_ranks(sorted(rts)[1])
            self.res.add_signal("0<->0", rt_ns / 1e3, gpu_scope=gpu_scope)
            self.tick(f"flag latency 0<->0 {'gpu' if gpu_scope else 'sys'}")
        for mb in self.a.chase_mb:
            words = torch.empty(mb * MIB // 8, dtype=torch.int64, device=self.dev)
            slots = self.build_chain(words)
            ns = self.max_ranks(self.chase(words.data_ptr(), slots))
            self.res.add_load_latency(0, 0, mb, ns)
            self.tick(f"load latency local {mb} MB")

    def build_chain(self, words: torch.Tensor) -> int:
        """A random single cycle over 64-byte slots: words[8 i] = 8 * next(i)."""
        slots = words.numel() // 8
        perm = torch.randperm(slots, device=self.dev, generator=self.gen)
        nxt = torch.empty_like(perm)
        nxt[perm] = perm.roll(-1)
        words[: slots * 8].view(slots, 8)[:, 0] = nxt * 8
        torch.cuda.synchronize()
        return slots

    def chase(self, ptr: int, slots: int) -> float:
        """ns per dependent load, median of 3 launches."""
        loads = self.a.latency_iters
        vals = []
        for _ in range(3):
            self.out.zero_()
            self.call(
                "the pointer chase", self.ext.probe_chase, ptr, 0, min(slots, 20000), loads,
                self.out.data_ptr(), self.stream(),
            )  # fmt: skip
            torch.cuda.synchronize()
            vals.append(self.out[OUT_NS].item() / loads)
        return sorted(vals)[1]

    def peer(self) -> None:
        import torch.distributed._symmetric_memory as symm_mem

        a, rank = self.a, self.rank
        copy_max = self.copy_bytes(max(self.sms))
        flag_off = max(copy_max, max(a.chase_mb, default=0) * MIB)
        sym = symm_mem.empty(flag_off + 64 * 1024, dtype=torch.uint8, device=self.dev)
        hdl = symm_mem.rendezvous(sym, group=dist.group.WORLD)
        ptrs = list(hdl.buffer_ptrs)
        if ptrs[rank] != sym.data_ptr():
            raise MoKUnsupportedError(
                f"symmetric buffer of rank {rank} is at {ptrs[rank]:#x} in the handle but the "
                f"tensor is at {sym.data_ptr():#x}; the probe needs the allocation's start"
            )
        pair = rank < 2
        peer = 1 - rank if pair else rank
        me, other = sym.data_ptr(), ptrs[peer]
        sym[:flag_off].view(torch.int32).random_(generator=self.gen)
        sym[flag_off:].zero_()
        local = self.rand_bytes(copy_max)
        torch.cuda.synchronize()
        dist.barrier()
        if torch.cuda.device_count() >= 2:
            acc = {
                "0->1": torch.cuda.can_device_access_peer(0, 1),
                "1->0": torch.cuda.can_device_access_peer(1, 0),
            }
        else:  # one GPU per process: the symmetric rendezvous above mapped the peer
            acc = {"0->1": 1, "1->0": 1}
        self.res.add_p2p_access(acc)

        # -- copies: 16-byte kernel and TMA; rank 0 alone (onedir), then both (bidir)
        s = self.stream()
        lp = local.data_ptr()
        for mech, chunk in [("st", None)] + [("tma", c) for c in a.chunks]:
            for bidir in (False, True):
                for kind in ("push", "pull"):
                    self.out.zero_()
                    active = rank == 0 or (bidir and rank == 1)
                    fn, b = _noop, 0
                    for sms in self.sms:
                        b = self.copy_bytes(sms)
                        dst, src = (other, lp) if kind == "push" else (lp, other)
                        fn = self.copy_fn(mech, dst, src, b, sms, chunk, s) if active else _noop
                        us = self.time(fn)
                        self.check_out(f"the {kind} {mech} copy")
                        self.res.add_copy(kind, mech, sms, b / (us * 1e3), bidir=bidir, chunk=chunk)
                        tag = "bidir" if bidir else "onedir"
                        self.tick(f"{kind} {mech}{chunk or ''} {tag} {sms} SMs")
                    if not bidir:
                        ok = self.verify_peer_copy(kind, fn, sym, local, b)
                        name = f"{kind}_{mech}" + (f"_chunk{chunk}" if chunk else "")
                        self.res.add_copy_check(name, ok)
        self.flush()

        # -- copy engine
        b = copy_max
        try:
            view = hdl.get_buffer(peer, (b,), torch.uint8) if pair else None
            ok, why = True, ""
        except Exception as e:  # noqa: BLE001 - reported in the JSON, the probe goes on
            view, ok, why = None, False, f"{type(e).__name__}: {e}"
        if self.all_ok(ok):
            src = local[:b]
            us = self.time((lambda v=view, x=src: v.copy_(x)) if rank == 0 else _noop)
            self.res.add_memcpy_peer(b / (us * 1e3))
        else:
            self.res.skip("memcpyPeer", f"hdl.get_buffer failed on some rank ({why or 'peer'})")
        self.tick("memcpyPeer")

        # -- flag ping-pong GPU0 <-> GPU1 (flags at the same offset of both symmetric buffers)
        iters = a.latency_iters
        warm = max(10, iters // 20)
        rts = []
        for _ in range(3):
            self.out.zero_()
            torch.cuda.synchronize()
            dist.barrier()
            if pair:
                self.call(
                    "the ping-pong kernel", self.ext.probe_pingpong, me + flag_off,
                    other + flag_off, 0, 0, 1, 0 if rank == 0 else -1, 0, warm, iters,
                    self.flag_base, self.timeout_ns, self.out.data_ptr(), s,
                )  # fmt: skip
            self.flag_base += warm + iters
            self.check_out("the flag ping-pong between GPU0 and GPU1")
            rts.append(self.out[OUT_NS].item() / iters if rank == 0 else 0.0)
        self.res.add_signal("0<->1", self.max_ranks(sorted(rts)[1]) / 1e3)
        self.tick("flag latency 0<->1")

        # -- dependent loads: GPU1 chases a chain in GPU0's memory
        for mb in a.chase_mb:
            slots = mb * MIB // 64
            if rank == 0:
                self.build_chain(sym[: mb * MIB].view(torch.int64))
            torch.cuda.synchronize()
            dist.barrier()
            ns = self.chase(other, slots) if rank == 1 else 0.0
            self.res.add_load_latency(1, 0, mb, self.max_ranks(ns))
            self.tick(f"load latency remote {mb} MB")
        view = local = None  # free the 1 GiB before the all_to_all buffers
        dist.barrier()

        # -- NCCL all_to_all (all ranks)
        for n in a.a2a_tokens:
            x = torch.randn(self.world * n, A2A_HIDDEN, device=self.dev, generator=self.gen)
            x = x.to(torch.bfloat16)
            y = torch.empty_like(x)
            us = self.time(lambda x=x, y=y: dist.all_to_all_single(y, x))
            sent = (self.world - 1) * n * A2A_HIDDEN * 2
            self.res.add_a2a(n, us / 1e3, sent / (us * 1e3))
            self.tick(f"nccl all_to_all {n}")

    def verify_peer_copy(self, kind: str, fn, sym, local, nbytes: int) -> bool:
        """Destination poisoned by its owner, rank 0 copies once, checksums compared."""
        rank = self.rank
        src, dst = (local, sym) if kind == "push" else (sym, local)
        src_owner, dst_owner = (0, 1) if kind == "push" else (1, 0)
        if rank == dst_owner:
            dst[:nbytes].fill_(0xA5)
        torch.cuda.synchronize()
        dist.barrier()
        if rank == 0:
            fn()
        self.check_out(f"the {kind} copy check")
        dist.barrier()
        sums = torch.zeros(2, dtype=torch.int64, device=self.dev)
        if rank == src_owner:
            sums[0] = src[:nbytes].view(torch.int64).sum()
        if rank == dst_owner:
            sums[1] = dst[:nbytes].view(torch.int64).sum()
        dist.all_reduce(sums)
        return bool(sums[0] == sums[1])

    def green(self) -> None:
        try:
            from torch.cuda.green_contexts import GreenContext
        except ImportError as e:
            self.res.skip("grouped_gemm_by_sms_green", f"no torch.cuda.green_contexts ({e})")
            return
        counts = [s for s in self.a.green_sms if s <= self.num_sms]
        shape, rows = self.a.gemm_shapes[0], self.a.gemm_sms_rows
        hidden, inter = GEMM_SHAPES[shape]
        for op in ("gate_up", "down"):
            fn = self.grouped_fn(hidden, inter, op, rows)
            for s in counts:
                try:
                    ctx = GreenContext.create(num_sms=s, device_id=self.dev.index)
                except Exception as e:  # noqa: BLE001 - reported in the JSON
                    self.res.skip(
                        "grouped_gemm_by_sms_green",
                        f"GreenContext.create(num_sms={s}) failed: {type(e).__name__}: {e}",
                    )
                    return
                ctx.set_context()
                try:
                    us = self.time_local(fn)
                finally:
                    ctx.pop_context()
                self.res.add_grouped(
                    shape, hidden, inter, self.a.gemm_experts, op, rows, s, us, by="sms",
                    method="green",
                )  # fmt: skip
                self.tick(f"green {shape} {op} {s} SMs")

    def time_local(self, fn) -> float:
        """Median us of this rank alone (no collectives: used inside a green context)."""
        for _ in range(self.a.warmup):
            fn()
        torch.cuda.synchronize()
        ev = [
            (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            for _ in range(self.a.iters)
        ]
        for s, e in ev:
            s.record()
            fn()
            e.record()
        torch.cuda.synchronize()
        t = sorted(s.elapsed_time(e) * 1e3 for s, e in ev)
        return t[len(t) // 2]


def main(argv: list[str] | None = None) -> int:
    a = parse_args(sys.argv[1:] if argv is None else argv)
    rank, world, dev = _init_dist()
    try:
        res = ProbeResults(_meta(a, dev, world))
        probe = Probe(a, res, rank, world, dev)
        probe.run()
        if rank == 0:
            probe.flush()
            print(res.table(), flush=True)
            print(f"wrote {a.out}" + (f" and {a.csv}" if a.csv else ""), flush=True)
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
