"""The probe's run: the sections in their order (:data:`STEPS`, the keys of
:data:`mok.bench.probe.results.SECTIONS`; ``--skip`` leaves some out, ``--sections`` keeps only
those named), the two sections that measure several things (``local``: copies, flags and loads
within one GPU; ``peer``: the same between GPU0 and GPU1 over their symmetric buffers, then NCCL)
and :func:`main`."""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist

from mok.bench.common import init_dist
from mok.bench.probe.args import MIB, parse_args
from mok.bench.probe.context import ProbeContext, probe_meta
from mok.bench.probe.copies import local_copies, memcpy_peer, nccl_all_to_all, peer_copies
from mok.bench.probe.gemm import measure_bf16_gemm, measure_green, measure_grouped
from mok.bench.probe.hbm import measure_hbm
from mok.bench.probe.latency import local_chases, local_flags, peer_flags, remote_chases
from mok.bench.probe.results import ProbeResults
from mok.bench.probe.signalling import (
    measure_block_skew,
    measure_fence_cost,
    measure_poll_cost,
    measure_signal_jitter,
)
from mok.errors import MoKUnsupportedError

__all__ = ["STEPS", "main", "run_sections"]


def local_section(p: ProbeContext) -> None:
    local_copies(p)
    local_flags(p)
    local_chases(p)


def peer_section(p: ProbeContext) -> None:
    """Ranks 0 and 1 are the measured pair (further ranks only take part in the collectives)."""
    import torch.distributed._symmetric_memory as symm_mem

    a, rank = p.a, p.rank
    copy_max = p.copy_bytes(max(p.sms))
    flag_off = max(copy_max, max(a.chase_mb, default=0) * MIB)
    sym = symm_mem.empty(flag_off + 64 * 1024, dtype=torch.uint8, device=p.dev)
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
    sym[:flag_off].view(torch.int32).random_(generator=p.gen)
    sym[flag_off:].zero_()
    local = p.rand_bytes(copy_max)
    torch.cuda.synchronize()
    dist.barrier()
    if torch.cuda.device_count() >= 2:
        acc = {
            "0->1": torch.cuda.can_device_access_peer(0, 1),
            "1->0": torch.cuda.can_device_access_peer(1, 0),
        }
    else:  # one GPU per process: the symmetric rendezvous above mapped the peer
        acc = {"0->1": 1, "1->0": 1}
    p.res.add_p2p_access(acc)

    peer_copies(p, sym, other, local)
    p.flush()
    memcpy_peer(p, hdl, peer, pair, local, copy_max)
    peer_flags(p, me, other, flag_off, pair)
    remote_chases(p, sym, other)
    del local  # free the 1 GiB before the all_to_all buffers
    dist.barrier()
    nccl_all_to_all(p)


# section -> what runs it, in the order they run (and are written into the JSON)
STEPS = {
    "hbm": measure_hbm,
    "gemm": measure_bf16_gemm,
    "grouped": measure_grouped,
    "local": local_section,
    "peer": peer_section,
    "green": measure_green,
    "poll_cost": measure_poll_cost,
    "fence_cost": measure_fence_cost,
    "block_skew": measure_block_skew,
    "signal_jitter": measure_signal_jitter,
}


def run_sections(p: ProbeContext) -> None:
    """Every section not skipped, the JSON rewritten after each (a late failure keeps the rest)."""
    for name, fn in STEPS.items():
        if name in p.a.skip:
            chosen = p.a.sections
            p.res.skip(name, "not in --sections" if chosen and name not in chosen else "--skip")
            continue
        if name == "peer" and p.world < 2:
            reason = (
                "peer-copy bandwidth (16-byte, TMA, memcpyPeer; one and both directions), "
                "0<->1 flag latency, remote load latency and NCCL all_to_all need 2 GPUs "
                f"under torchrun --nproc-per-node=2 (this run: {p.world} process, "
                f"{torch.cuda.device_count()} visible GPU(s))"
            )
            p.res.skip("peer", reason)
            p.say(f"probe: peer parts skipped: {reason}")
            continue
        fn(p)
        p.flush()
        torch.cuda.synchronize()
        dist.barrier()
    p.bar.close()


def main(argv: list[str] | None = None) -> int:
    a = parse_args(sys.argv[1:] if argv is None else argv)
    dev = init_dist("the probe")
    rank, world = dist.get_rank(), dist.get_world_size()
    try:
        res = ProbeResults(probe_meta(a, dev, world))
        p = ProbeContext(a, res, rank, world, dev)
        run_sections(p)
        if rank == 0:
            p.flush()
            print(res.table(), flush=True)
            print(f"wrote {a.out}" + (f" and {a.csv}" if a.csv else ""), flush=True)
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
