"""Flags and loads: the flag ping-pong round trip (two blocks of one GPU at system and GPU scope,
GPU0 <-> GPU1 at system scope) and dependent-load latency (a pointer chase in this GPU's memory,
and GPU1 chasing a chain in GPU0's), with the kernels of csrc/probe/probe.cu."""

from __future__ import annotations

import torch
import torch.distributed as dist

from mok.bench.probe.args import MIB
from mok.bench.probe.context import OUT_NS, ProbeContext

__all__ = ["build_chain", "chase", "local_chases", "local_flags", "peer_flags", "remote_chases"]


def local_flags(p: ProbeContext) -> None:
    """Flag ping-pong between two blocks of this GPU, system and GPU scope."""
    flags = torch.zeros(64, dtype=torch.int64, device=p.dev)
    f0, f1 = flags.data_ptr(), flags.data_ptr() + 256  # separate 128-byte lines
    iters = p.a.latency_iters
    warm = max(10, iters // 20)
    for gpu_scope in (False, True):
        rts = []
        for _ in range(3):
            flags.zero_()
            p.out.zero_()
            p.call(
                "the ping-pong kernel", p.ext.probe_pingpong, f0, f1, f1, f0, 2, 0,
                int(gpu_scope), warm, iters, 0, p.timeout_ns, p.out.data_ptr(), p.stream(),
            )  # fmt: skip
            p.check_out("the flag ping-pong between two blocks of one GPU")
            rts.append(p.out[OUT_NS].item() / iters)
        rt_ns = p.max_ranks(sorted(rts)[1])
        p.res.add_signal("0<->0", rt_ns / 1e3, gpu_scope=gpu_scope)
        p.tick(f"flag latency 0<->0 {'gpu' if gpu_scope else 'sys'}")


def local_chases(p: ProbeContext) -> None:
    """Dependent loads in this GPU's memory, one chain per ``--chase-mb``."""
    for mb in p.a.chase_mb:
        words = torch.empty(mb * MIB // 8, dtype=torch.int64, device=p.dev)
        slots = build_chain(p, words)
        ns = p.max_ranks(chase(p, words.data_ptr(), slots))
        p.res.add_load_latency(0, 0, mb, ns)
        p.tick(f"load latency local {mb} MB")


def peer_flags(p: ProbeContext, me: int, other: int, flag_off: int, pair: bool) -> None:
    """Flag ping-pong GPU0 <-> GPU1 (flags at ``flag_off`` of both symmetric buffers: this
    rank's at ``me``, the partner's at ``other``)."""
    iters = p.a.latency_iters
    warm = max(10, iters // 20)
    s = p.stream()
    rts = []
    for _ in range(3):
        p.out.zero_()
        torch.cuda.synchronize()
        dist.barrier()
        if pair:
            p.call(
                "the ping-pong kernel", p.ext.probe_pingpong, me + flag_off,
                other + flag_off, 0, 0, 1, 0 if p.rank == 0 else -1, 0, warm, iters,
                p.flag_base, p.timeout_ns, p.out.data_ptr(), s,
            )  # fmt: skip
        p.flag_base += warm + iters
        p.check_out("the flag ping-pong between GPU0 and GPU1")
        rts.append(p.out[OUT_NS].item() / iters if p.rank == 0 else 0.0)
    p.res.add_signal("0<->1", p.max_ranks(sorted(rts)[1]) / 1e3)
    p.tick("flag latency 0<->1")


def remote_chases(p: ProbeContext, sym: torch.Tensor, other: int) -> None:
    """GPU1 chases a chain that GPU0 built at the start of its symmetric buffer ``sym``
    (``other``: the partner's buffer)."""
    for mb in p.a.chase_mb:
        slots = mb * MIB // 64
        if p.rank == 0:
            build_chain(p, sym[: mb * MIB].view(torch.int64))
        torch.cuda.synchronize()
        dist.barrier()
        ns = chase(p, other, slots) if p.rank == 1 else 0.0
        p.res.add_load_latency(1, 0, mb, p.max_ranks(ns))
        p.tick(f"load latency remote {mb} MB")


def build_chain(p: ProbeContext, words: torch.Tensor) -> int:
    """A random single cycle over 64-byte slots: words[8 i] = 8 * next(i)."""
    slots = words.numel() // 8
    perm = torch.randperm(slots, device=p.dev, generator=p.gen)
    nxt = torch.empty_like(perm)
    nxt[perm] = perm.roll(-1)
    words[: slots * 8].view(slots, 8)[:, 0] = nxt * 8
    torch.cuda.synchronize()
    return slots


def chase(p: ProbeContext, ptr: int, slots: int) -> float:
    """ns per dependent load, median of 3 launches."""
    loads = p.a.latency_iters
    vals = []
    for _ in range(3):
        p.out.zero_()
        p.call(
            "the pointer chase", p.ext.probe_chase, ptr, 0, min(slots, 20000), loads,
            p.out.data_ptr(), p.stream(),
        )  # fmt: skip
        torch.cuda.synchronize()
        vals.append(p.out[OUT_NS].item() / loads)
    return sorted(vals)[1]
