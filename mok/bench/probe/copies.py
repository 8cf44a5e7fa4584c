"""Copy bandwidth (the NVLink and local copy curves): the 16-byte copy kernel and TMA bulk copies
(csrc/probe/probe.cu) by SM count, local and to / from the peer, one and both directions, each
checked once against its source; the copy engine (``Tensor.copy_`` into the peer's symmetric
buffer, memcpyPeer); NCCL ``all_to_all_single``."""

from __future__ import annotations

import torch
import torch.distributed as dist

from mok.bench.probe.context import ProbeContext, noop

__all__ = ["copy_fn", "local_copies", "memcpy_peer", "nccl_all_to_all", "peer_copies"]

A2A_HIDDEN = 7168


def copy_fn(p: ProbeContext, mech: str, dst: int, src: int, nbytes: int, sms: int, chunk, stream):
    """A closure launching one copy of ``nbytes`` at ``sms`` SMs: ``mech`` st (16-byte kernel) or
    tma (bulk copies of ``chunk`` bytes)."""
    ext = p.ext
    if mech == "st":
        return lambda: p.call(
            "the 16-byte copy", ext.probe_copy_vector, dst, src, nbytes, sms, stream
        )
    out = p.out.data_ptr()
    inflight, tmo = p.a.inflight, p.timeout_ns
    return lambda: p.call(
        "the TMA copy", ext.probe_copy_tma, dst, src, nbytes, chunk, inflight, sms, tmo, out,
        stream,
    )  # fmt: skip


def local_copies(p: ProbeContext) -> None:
    """Copies within this GPU's memory by SM count, then the copy check of each mechanism."""
    src = p.rand_bytes(p.copy_bytes(max(p.sms)))
    dst = torch.empty_like(src)
    s = p.stream()
    for mech, chunk in [("st", None)] + [("tma", c) for c in p.a.chunks]:
        p.out.zero_()
        fn, b = noop, 0
        for sms in p.sms:
            b = p.copy_bytes(sms)
            fn = copy_fn(p, mech, dst.data_ptr(), src.data_ptr(), b, sms, chunk, s)
            us = p.time(fn)
            p.check_out(f"the local {mech} copy")
            p.res.add_copy("local", mech, sms, b / (us * 1e3), chunk=chunk)
            p.tick(f"local {mech}{chunk or ''} {sms} SMs")
        dst[:b].fill_(0xA5)  # poison, copy once more, compare
        fn()
        p.check_out(f"the local {mech} copy")
        ok = p.all_ok(torch.equal(dst[:b], src[:b]))
        p.res.add_copy_check(f"local_{mech}" + (f"_chunk{chunk}" if chunk else ""), ok)


def peer_copies(p: ProbeContext, sym: torch.Tensor, other: int, local: torch.Tensor) -> None:
    """16-byte and TMA copies between ``local`` (this GPU) and the partner's symmetric buffer
    (``other``): rank 0 alone (onedir, then checked), then both ranks at once (bidir)."""
    rank = p.rank
    s = p.stream()
    lp = local.data_ptr()
    for mech, chunk in [("st", None)] + [("tma", c) for c in p.a.chunks]:
        for bidir in (False, True):
            for kind in ("push", "pull"):
                p.out.zero_()
                active = rank == 0 or (bidir and rank == 1)
                fn, b = noop, 0
                for sms in p.sms:
                    b = p.copy_bytes(sms)
                    dst, src = (other, lp) if kind == "push" else (lp, other)
                    fn = copy_fn(p, mech, dst, src, b, sms, chunk, s) if active else noop
                    us = p.time(fn)
                    p.check_out(f"the {kind} {mech} copy")
                    p.res.add_copy(kind, mech, sms, b / (us * 1e3), bidir=bidir, chunk=chunk)
                    tag = "bidir" if bidir else "onedir"
                    p.tick(f"{kind} {mech}{chunk or ''} {tag} {sms} SMs")
                if not bidir:
                    ok = verify_peer_copy(p, kind, fn, sym, local, b)
                    name = f"{kind}_{mech}" + (f"_chunk{chunk}" if chunk else "")
                    p.res.add_copy_check(name, ok)


def verify_peer_copy(p: ProbeContext, kind: str, fn, sym, local, nbytes: int) -> bool:
    """Destination poisoned by its owner, rank 0 copies once, checksums compared."""
    rank = p.rank
    src, dst = (local, sym) if kind == "push" else (sym, local)
    src_owner, dst_owner = (0, 1) if kind == "push" else (1, 0)
    if rank == dst_owner:
        dst[:nbytes].fill_(0xA5)
    torch.cuda.synchronize()
    dist.barrier()
    if rank == 0:
        fn()
    p.check_out(f"the {kind} copy check")
    dist.barrier()
    sums = torch.zeros(2, dtype=torch.int64, device=p.dev)
    if rank == src_owner:
        sums[0] = src[:nbytes].view(torch.int64).sum()
    if rank == dst_owner:
        sums[1] = dst[:nbytes].view(torch.int64).sum()
    dist.all_reduce(sums)
    return bool(sums[0] == sums[1])


def memcpy_peer(p: ProbeContext, hdl, peer: int, pair: bool, local: torch.Tensor, nbytes: int):
    """The copy engine: rank 0 copies ``nbytes`` of ``local`` into the partner's symmetric buffer
    (``hdl``'s view of rank ``peer``) with ``Tensor.copy_``."""
    try:
        view = hdl.get_buffer(peer, (nbytes,), torch.uint8) if pair else None
        ok, why = True, ""
    except Exception as e:  # noqa: BLE001 - reported in the JSON, the probe goes on
        view, ok, why = None, False, f"{type(e).__name__}: {e}"
    if p.all_ok(ok):
        src = local[:nbytes]
        us = p.time((lambda v=view, x=src: v.copy_(x)) if p.rank == 0 else noop)
        p.res.add_memcpy_peer(nbytes / (us * 1e3))
    else:
        p.res.skip("memcpyPeer", f"hdl.get_buffer failed on some rank ({why or 'peer'})")
    p.tick("memcpyPeer")


def nccl_all_to_all(p: ProbeContext) -> None:
    """NCCL all_to_all_single of ``--a2a-tokens`` bf16 rows of 7168 per rank pair (all ranks)."""
    for n in p.a.a2a_tokens:
        x = torch.randn(p.world * n, A2A_HIDDEN, device=p.dev, generator=p.gen)
        x = x.to(torch.bfloat16)
        y = torch.empty_like(x)
        us = p.time(lambda x=x, y=y: dist.all_to_all_single(y, x))
        sent = (p.world - 1) * n * A2A_HIDDEN * 2
        p.res.add_a2a(n, us / 1e3, sent / (us * 1e3))
        p.tick(f"nccl all_to_all {n}")
