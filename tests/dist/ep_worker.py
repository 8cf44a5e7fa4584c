"""Worker for the expert-parallel reference test; launched by tests/test_ep.py via torchrun.

Every rank builds the whole problem (all ranks' tokens, seeded per rank), runs the EP layer on
its own slice and checks it against the single-device reference of the *whole* layer (oracle
anchor). Prints ``EP-WORKER-OK rank=R`` when every check passed.

With ``MOK_EP_CASES=<file>`` (a JSON list of :func:`run_case` cases, drawn by
tests/test_reference_props.py) it runs those cases instead and prints
``EP-PROPS-OK rank=R cases=N``.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from mok.bench.env import disable_multicast
from mok.spec.workload import ModelShape, make_routing
from reference.ep import CapacityError, ep_backward, ep_forward
from reference.moe import moe_backward, moe_forward, output_dtype
from reference.weights import MoEWeights
from tests import tolerances as tol
from tests.layer_problem import fp64_problem

SEED = 1234
COMBOS = [("pull", "push"), ("push", "push"), ("pull", "pull"), ("dedup_pull", "push")]
MODES = {"float64": torch.float64, "float32": torch.float32, "bfloat16": torch.bfloat16}
TOLS = {
    torch.float64: (tol.FP64_RTOL, tol.FP64_ATOL),
    torch.float32: (tol.FP32_RTOL, tol.FP32_ATOL),
}


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


def ragged_problem(case: dict, world: int):
    """The whole layer of ``case``: rank r holds ``case["tokens"][r]`` tokens (0 allowed), rank
    after rank; ``num_topk`` may be 0. Inputs in fp64, routing weights fp64."""
    total, e = sum(case["tokens"]), case["num_local"] * world
    return fp64_problem(
        total,
        e,
        case["num_topk"],
        case["hidden"],
        case["intermediate"],
        case["shared"],
        case["skew"],
        case["seed"],
    )


def _close(got: torch.Tensor, want: torch.Tensor, mode: torch.dtype, what: str) -> None:
    rtol, atol = TOLS[mode]
    check(got.shape == want.shape, f"{what}: shape {tuple(got.shape)} != {tuple(want.shape)}")
    try:
        torch.testing.assert_close(got.double(), want.double(), rtol=rtol, atol=atol)
    except AssertionError as err:
        check(False, f"{what}: {err}")


def run_case(case: dict) -> None:
    """Every transfer mode of the EP layer on ``case`` against the single-device reference of
    the whole layer; in fp64 / fp32 also the backward. ``case``: tokens (one count per rank),
    num_local, num_topk, hidden, intermediate, shared, skew, seed, row_tile, mode."""
    rank, world = dist.get_rank(), dist.get_world_size()
    mode = MODES[case["mode"]]
    name = json.dumps(case, sort_keys=True)
    x, go, idx, tw, w = ragged_problem(case, world)
    start = sum(case["tokens"][:rank])
    sl = slice(start, start + case["tokens"][rank])
    num_experts = w.num_experts
    dt = torch.float64 if mode == torch.float64 else torch.float32  # routing-weight dtype
    xm, wm = x.to(mode), w.to(mode)
    if mode == torch.bfloat16:  # fp64 oracle of the same (rounded) inputs
        ref = moe_forward(xm.double(), idx, tw.to(dt).double(), wm.to(torch.float64))
    else:
        ref = moe_forward(xm, idx, tw.to(dt), wm, mode)
    lw = wm.shard(rank, world)
    outs = {}
    for dm, cm in COMBOS:
        r = ep_forward(
            xm[sl],
            idx[sl],
            tw[sl].to(dt),
            lw,
            num_experts,
            dispatch_mode=dm,
            combine_mode=cm,
            row_tile=case["row_tile"],
            compute_dtype=mode,
        )
        what = f"case {name} {dm}/{cm}"
        check(r.out.dtype == output_dtype(mode), f"{what}: output dtype {r.out.dtype}")
        if mode == torch.bfloat16:
            tol.assert_bf16_ref_bound(r.out, ref[sl], f"rank {rank}: {what}")
        else:
            _close(r.out, ref[sl], mode, what)
        outs[dm, cm] = r
    base = outs[COMBOS[0]]
    for key, r in outs.items():  # data only moves: the dispatched rows are bitwise identical
        check(torch.equal(r.recv, base.recv), f"case {name}: recv of {key} differs from pull")
        # the same rows summed in the same order: bitwise equal outputs (dedup has its own order)
        same = key[0] == "dedup_pull" or torch.equal(r.out, base.out)
        check(same, f"case {name}: output of {key} differs from pull/push")
    if mode == torch.bfloat16:
        return
    want = moe_backward(go.to(mode), xm, idx, tw.to(dt), wm, mode)
    got = ep_backward(
        go[sl].to(mode),
        xm[sl],
        idx[sl],
        tw[sl].to(dt),
        lw,
        num_experts,
        row_tile=case["row_tile"],
        compute_dtype=mode,
    )
    es = slice(rank * lw.num_experts, (rank + 1) * lw.num_experts)
    pairs = [
        ("dx", got.dx, want.dx[sl]),
        ("d_topk_weights", got.d_topk_weights, want.d_topk_weights[sl]),
        ("dw_gate", got.dw_gate, want.dw_gate[es]),
        ("dw_up", got.dw_up, want.dw_up[es]),
        ("dw_down", got.dw_down, want.dw_down[es]),
    ]
    if w.has_shared:  # per-rank partials: their sum is the full gradient
        for field in ("d_shared_w_gate", "d_shared_w_up", "d_shared_w_down"):
            part = getattr(got, field).clone()
            dist.all_reduce(part)
            pairs.append((field, part, getattr(want, field)))
    for field, g, wnt in pairs:
        _close(g, wnt, mode, f"case {name} backward {field}")


def run_cases(path: str) -> int:
    cases = json.loads(Path(path).read_text())
    for case in cases:
        run_case(case)
    return len(cases)


def main() -> int:
    disable_multicast()  # (gloo here, but the same start as every worker)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if os.environ.get("MOK_EP_CASES"):
        num = run_cases(os.environ["MOK_EP_CASES"])
        dist.barrier()
        print(f"EP-PROPS-OK rank={rank} cases={num}", flush=True)
        dist.destroy_process_group()
        return 0
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

    # Token counts may differ between ranks, zero included: ranks with no tokens next to ranks
    # with tokens, then num_topk = 0 (the shared expert alone), then no tokens anywhere.
    uneven = [0, n, 5, 0, 1, n + 3, 0, 2][:world]
    base = {"num_local": 2, "hidden": 16, "intermediate": 24, "shared": 8, "row_tile": 4}
    base.update(skew="hot:0.5", seed=SEED)
    for tokens, k, mode in [
        (uneven, 3, "float64"),
        (uneven, 3, "bfloat16"),
        (uneven, 0, "float64"),
        ([0] * world, 2, "float32"),
    ]:
        run_case({**base, "tokens": tokens, "num_topk": k, "mode": mode})

    # Shapes that must agree across ranks are checked by the signature all-gather.
    k2 = shape.num_topk - (1 if rank == world - 1 else 0)
    x2 = torch.zeros(n, shape.hidden, dtype=torch.float64)
    idx2 = torch.arange(k2).repeat(n, 1)
    tw2 = torch.full((n, k2), 0.25, dtype=torch.float64)
    try:
        ep_forward(x2, idx2, tw2, w.shard(rank, world), E, compute_dtype=torch.float64)
        check(False, "mismatched num_topk did not raise")
    except ValueError as e:
        k = shape.num_topk
        check(f"num_topk: rank 0 has {k}, rank {world - 1} has {k - 1}" in str(e), str(e))

    dist.barrier()
    print(f"EP-WORKER-OK rank={rank}", flush=True)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
