"""Worker of tests/test_integrations_torchtitan.py's expert-parallel test, launched via torchrun
on CPU gloo ranks.

Every rank builds the whole problem (the torchtitan-equivalent experts with all E experts, every
rank's tokens, seeded per rank) and converts the experts with ``group=WORLD`` (it keeps experts
[rank * E / R, (rank + 1) * E / R)). It runs its own tokens through mok's layer (mok's dispatch
moves the rows; no torchtitan all-to-all) and checks against the one-rank equivalent over every
rank's tokens (oracle anchor): its output rows, x and score gradients, and its experts' w1 / w2 /
w3 gradients (over every rank's rows), to 1e-10 in fp64; and that its state dict is torchtitan's
keys with its experts' rows. Prints ``TORCHTITAN-EP-OK rank=R``.
"""

from __future__ import annotations

import gc
import sys

import torch
import torch.distributed as dist

from mok.bench.env import disable_multicast
from mok.integrations.torchtitan import MoKRoutedExperts
from tests.test_integrations_torchtitan import (
    DIM,
    EXPERTS,
    HIDDEN,
    TOPK,
    GroupedExperts,
    RoutedExperts,
    close,
    counts,
    mok_grads,
    routing,
    torchtitan_grads,
)

TOKENS = [24, 17]  # per rank (uneven on purpose); more ranks repeat the pattern


def main() -> int:
    disable_multicast()  # (gloo here, but the same start as every worker)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    n = [TOKENS[r % len(TOKENS)] for r in range(world)]
    parts = [routing(n[r], seed=10 + r) for r in range(world)]  # seed + rank
    go = torch.randn(sum(n), DIM, generator=torch.Generator().manual_seed(3), dtype=torch.float64)

    # the one-rank equivalent over every rank's tokens
    tt = RoutedExperts(GroupedExperts(DIM, HIDDEN, EXPERTS, seed=0), TOPK)
    x_all = torch.cat([p[0] for p in parts]).detach().requires_grad_()
    s_all = torch.cat([p[1] for p in parts]).detach().requires_grad_()
    ids_all = torch.cat([p[2] for p in parts])
    want = tt(x_all, s_all, ids_all, counts(ids_all))
    want.backward(go)

    mk = MoKRoutedExperts.from_grouped_experts(tt, group=dist.group.WORLD)
    local = EXPERTS // world
    assert mk.inner_experts.gate_up.shape[0] == local
    x, s, ids = parts[rank]
    lo = sum(n[:rank])
    rows = slice(lo, lo + n[rank])
    got = mk(x, s, ids, counts(ids))
    got.backward(go[rows])
    close(got, want[rows].detach())
    close(x.grad, x_all.grad[rows])
    close(s.grad, s_all.grad[rows])
    mine = slice(rank * local, (rank + 1) * local)
    for a, b in zip(mok_grads(mk), torchtitan_grads(tt.inner_experts), strict=True):
        close(a, b[mine])

    sd = mk.state_dict()
    assert list(sd) == list(tt.state_dict())
    for k, v in tt.state_dict().items():
        assert torch.equal(sd[k], v[mine]), k
    fresh = MoKRoutedExperts.from_grouped_experts(
        RoutedExperts(GroupedExperts(DIM, HIDDEN, EXPERTS, seed=9), TOPK), group=dist.group.WORLD
    )
    fresh.load_state_dict(tt.state_dict())  # the whole layer's checkpoint: this rank's rows
    assert torch.equal(fresh.inner_experts.gate_up, mk.inner_experts.gate_up)

    dist.barrier()
    print(f"TORCHTITAN-EP-OK rank={rank}", flush=True)
    del mk, fresh, tt  # they hold the process group (mok/bench/lm.py says why this order)
    gc.collect()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
