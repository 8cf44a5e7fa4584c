"""HBM bandwidth: a device-to-device copy (bytes read + written), a 16-byte load kernel
(csrc/probe/probe.cu) and a fill, over one ``--hbm-mib`` buffer."""

from __future__ import annotations

import torch

from mok.bench.probe.args import MIB
from mok.bench.probe.context import ProbeContext

__all__ = ["measure_hbm"]


def measure_hbm(p: ProbeContext) -> None:
    n = p.a.hbm_mib * MIB
    src = p.rand_bytes(n)
    dst = torch.empty_like(src)
    t_copy = p.time(lambda: dst.copy_(src))
    p.tick("hbm copy")
    s, out = p.stream(), p.out.data_ptr()
    ext = p.ext
    grid = 2 * p.num_sms
    t_read = p.time(
        lambda: p.call("the read kernel", ext.probe_read_bandwidth, src.data_ptr(), n, grid, out, s)
    )
    p.tick("hbm read")
    t_write = p.time(lambda: dst.fill_(0x5A))
    p.tick("hbm write")
    p.res.add_hbm(n, 2 * n / (t_copy * 1e3), n / (t_read * 1e3), n / (t_write * 1e3))
