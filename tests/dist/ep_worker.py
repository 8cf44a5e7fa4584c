"""Worker for the expert-parallel reference test; launched by tests/test_ep.py via torchrun.

Every rank builds the whole problem (all ranks' tokens, seeded per rank), runs the EP layer on
its own slice and checks it against the single-device reference of the *whole* layer (oracle
anchor). Prints ``EP-WORKER-OK rank=R`` when every check passed.
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist

from mok.workload import ModelShape, make_routing
from reference.ep import CapacityError, ep_backward, ep_forward
from reference.moe import moe_backward, moe_forward
from reference.weights import MoEWeights
from tests import tolerances as tol

SEED = 1234


def problem(shape: ModelShape, num_tokens: int, world: int, skew: str, dtype: torch.dtype):
    w = MoEWeights.random(shape, seed=SEED, dtype=dtype)
    t = make_routing(num_tokens, shape.num_experts, shape.num_topk, world, skew, seed=SEED)
    xs = []
    for r in range(world):  # seed + rank, explicit generators
        g = torch.Generator().manual_seed(SEED + r)
        xs.append(torch.randn(num_tokens, shape.hidden, generator=g, dtype=torch.float64))
    x = torch.cat(xs).to(dtype)
    idx = torch.from_numpy(t.topk_idx)
    tw = torch.from_numpy(t.topk_weights).to(
        torch.float64 if dtype == torch.float64 else torch.float32
    )
    return x, idx, tw, w


def check(cond: bool, what: str) -> None:
    if not cond:
        raise AssertionError(f"rank {dist.get_rank()}: {what}")


def main() -> int:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    shape = ModelShape("ep-test", 16, 64, 48, 4, shared_intermediate=32)
    n = 37  # not a multiple of the row tile
    E = shape.num_experts
    sl = slice(rank * n, (rank + 1) * n)
    combos = [("pull", "push"), ("push", "push"), ("pull", "pull"), ("dedup_pull", "push")]

    for skew in ("uniform", "hot:0.5"):
        # fp64: every transfer mode reproduces the full single-device oracle.
        x, idx, tw, w = problem(shape, n, world, skew, torch.float64)
        oracle = moe_forward(x, idx, tw, w, torch.float64)
        lw = w.shard(rank, world)
        res = {}
        for dm, cm in combos:
            r = ep_forward(
                x[sl],
                idx[sl],
                tw[sl],
                lw,
                E,
                dispatch_mode=dm,
                combine_mode=cm,
                row_tile=8,
                compute_dtype=torch.float64,
            )
            res[dm, cm] = r
            err = tol.max_abs_err(r.out, oracle[sl])
            check(err <= tol.FP64_ATOL, f"{skew} {dm}/{cm} fp64 error {err:.3e}")
        # Data only moves: the dispatched buffers are bitwise identical across modes.
        base = res["pull", "push"]
        for key, r in res.items():
            check(torch.equal(r.recv, base.recv), f"{skew} recv of {key} differs from pull")
        for row in range(base.recv.shape[0]):
            src = int(base.schedule.src_rank[row])
            if src >= 0:
                tok = src * n + int(base.schedule.src_index[row]) // shape.num_topk
                check(torch.equal(base.recv[row], x[tok]), f"recv row {row} is not x[{tok}]")
            else:
                check(not bool(base.recv[row].any()), f"padding row {row} not zero")

        # bf16: same association order -> bitwise equal; dedup -> its own order, same rule.
        xb, wb = x.to(torch.bfloat16), w.to(torch.bfloat16)
        lwb = wb.shard(rank, world)
        ref_b = moe_forward(xb, idx, tw.float(), wb, torch.bfloat16)
        outs = {}
        for dm, cm in combos:
            outs[dm, cm] = ep_forward(
                xb[sl],
                idx[sl],
                tw[sl].float(),
                lwb,
                E,
                dispatch_mode=dm,
                combine_mode=cm,
                row_tile=8,
                compute_dtype=torch.bfloat16,
            ).out
            tol.assert_bf16_rule(outs[dm, cm], ref_b[sl], oracle[sl])
        check(torch.equal(outs["pull", "push"], outs["push", "push"]), "pull vs push differ")
        check(torch.equal(outs["pull", "push"], outs["pull", "pull"]), "push vs pull combine")
        again = ep_forward(
            xb[sl], idx[sl], tw[sl].float(), lwb, E, row_tile=8, compute_dtype=torch.bfloat16
        ).out
        check(torch.equal(again, outs["pull", "push"]), "two bf16 runs differ bitwise")

        # Backward over the reversed transfers vs the single-device explicit backward.
        g = torch.Generator().manual_seed(SEED + 100 + rank)
        go_parts = [
            torch.randn(
                n,
                shape.hidden,
                generator=torch.Generator().manual_seed(SEED + 100 + r),
                dtype=torch.float64,
            )
            for r in range(world)
        ]
        del g
        go = torch.cat(go_parts)
        ref_g = moe_backward(go, x, idx, tw, w, torch.float64)
        eg = ep_backward(
            go[sl], x[sl], idx[sl], tw[sl], lw, E, row_tile=8, compute_dtype=torch.float64
        )
        num_local = E // world
        es = slice(rank * num_local, (rank + 1) * num_local)
        for name, got, want in [
            ("dx", eg.dx, ref_g.dx[sl]),
            ("d_topk_weights", eg.d_topk_weights, ref_g.d_topk_weights[sl]),
            ("dw_gate", eg.dw_gate, ref_g.dw_gate[es]),
            ("dw_up", eg.dw_up, ref_g.dw_up[es]),
            ("dw_down", eg.dw_down, ref_g.dw_down[es]),
        ]:
            err = tol.max_abs_err(got, want)
            check(err <= tol.FP64_ATOL * 100, f"{skew} backward {name} error {err:.3e}")
        # The shared expert's weight grads are per-rank partials: their sum is the full grad.
        dsg = eg.d_shared_w_gate.clone()
        dist.all_reduce(dsg)
        check(tol.max_abs_err(dsg, ref_g.d_shared_w_gate) <= 1e-9, "shared dW_gate sum")

    # Capacity: every rank raises the same clear error; nothing is dropped or hangs.
    x, idx, tw, w = problem(shape, n, world, "hot:0.9", torch.float64)
    try:
        ep_forward(
            x[sl],
            idx[sl],
            tw[sl],
            w.shard(rank, world),
            E,
            row_tile=8,
            max_recv_rows=64,
            compute_dtype=torch.float64,
        )
        check(False, "capacity overflow did not raise")
    except CapacityError as e:
        msg = str(e)
        check("max_recv_rows=64" in msg and "never drops tokens" in msg and "expert" in msg, msg)

    # Shapes that differ across ranks are detected by the signature all-gather.
    m = n + (1 if rank == world - 1 else 0)
    x2 = torch.zeros(m, shape.hidden, dtype=torch.float64)
    idx2 = torch.arange(shape.num_topk).repeat(m, 1)
    tw2 = torch.full((m, shape.num_topk), 0.25, dtype=torch.float64)
    try:
        ep_forward(x2, idx2, tw2, w.shard(rank, world), E, compute_dtype=torch.float64)
        check(False, "mismatched num_tokens did not raise")
    except ValueError as e:
        check(f"num_tokens: rank 0 has {n}, rank {world - 1} has {n + 1}" in str(e), str(e))

    dist.barrier()
    print(f"EP-WORKER-OK rank={rank}", flush=True)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
