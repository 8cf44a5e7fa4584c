"""Worker of the expert-parallel training tests (tests/test_mok_ep_train_gpu.py), launched through
torchrun at any EP size, one GPU per rank or every rank on one GPU (``MOK_SHARED_GPU=1``).

Every rank builds the whole global problem (weights, routing, tokens and output gradient of all
ranks, seeded independently of the EP size), runs the layer under autograd on its slice (rank r
holds the global tokens of its count after those of ranks < r) and checks:

* against the reference of the whole problem (oracle anchor), under the bf16 rule: the output,
  dx, the routing weights' gradient and its experts' weight gradients against the global fp64
  oracle; the shared expert's weight gradients against the reference of its own tokens;
* parallelism invariance: the same bits as mok at EP1 over the whole global batch (a group of
  this rank alone) for the output, dx, the routing weights' gradient and the routed weight
  gradients, for every dispatch / combine mode, the fused forward and kept activations;
* determinism (``--repeats`` runs bitwise equal), a rank with zero tokens beside ranks with
  many, bad routing on one rank (every rank raises, the next call works), and a rank that never
  enters the backward (``--timeout``: its peers raise MoKTimeoutError in time).

``--schedule-restore`` runs only the case of ``mok.autograd.RESTORE_SCHEDULE`` (on by default, and
so in every EP1 run above): on and off, the same bits, one schedule kernel a step at one rank and
two with peers.

``--wgrad-gu-plain`` runs it all with ``mok.ops.WGRAD_GU_TRANSPOSED`` off (dW_gate_up as
dgu^T x, not the default transposed form, at every EP size and in EP1's run alike).

Prints ``MOK-TRAIN-OK rank=R``; invariance differences are printed per tensor before failing.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import random
import subprocess
import sys
import time

import torch
import torch.distributed as dist

import mok
import mok.autograd as ma
from mok import functional as mf
from mok import ops
from mok.ranks import init_ranks
from mok.spec.workload import ModelShape, make_routing
from reference.moe import moe_backward, moe_forward
from reference.weights import MoEWeights
from tests import tolerances as tol

SEED = 2024
# (shape, tokens per rank, skew)
CASES = [
    (ModelShape("shared", 16, 512, 256, 4, shared_intermediate=256), 96, "uniform"),
    (ModelShape("noshared", 32, 1024, 256, 8), 80, "hot:0.5"),
    (ModelShape("zipf", 16, 512, 256, 6, shared_intermediate=256), 64, "zipf:1.2"),
]
# Above eight ranks (--wide: EP16, EP32, EP64): 64 experts, one per rank at EP64; tiny rows.
WIDE = (ModelShape("wide", 64, 256, 256, 4, shared_intermediate=256), 16, "uniform")
WIDE_MODES = ("pull/push", "dedup/push", "fused saved", "fused saved in-launch")
# (name, MoKConfig fields, fused forward, recompute). Rows in source order (row_order="source")
# make every result of the non-dedup modes bitwise EP1's; interleaved rows keep the output and
# the input / routing-weight gradients so, and the weight gradients within a summation order;
# dedup sums a token's rows per owner rank first, so its sums depend on the EP size.
SRC = dict(row_order="source")
MODES = [
    ("pull/push", dict(dispatch_mode="pull", combine_mode="push", **SRC), False, True),
    ("push/push", dict(dispatch_mode="push", combine_mode="push", **SRC), False, True),
    ("pull/pull", dict(dispatch_mode="pull", combine_mode="pull", **SRC), False, True),
    ("pull/push interleaved", dict(dispatch_mode="pull", combine_mode="push"), False, True),
    ("dedup/push", dict(dispatch_mode="dedup_pull", combine_mode="push", **SRC), False, True),
    ("pull/push saved", dict(dispatch_mode="pull", combine_mode="push", **SRC), False, False),
    ("fused", dict(dispatch_mode="pull", combine_mode="push", **SRC), True, True),
    ("fused saved", dict(dispatch_mode="pull", combine_mode="push", **SRC), True, False),
    ("fused dedup saved", dict(dispatch_mode="dedup_pull", combine_mode="push"), True, False),
    # the backward's transfers inside the routed experts' launch (mok.autograd.TRANSFERS_IN_LAUNCH)
    ("pull/push saved in-launch", dict(dispatch_mode="pull", combine_mode="push", **SRC), False,
     False),
    ("fused saved in-launch", dict(dispatch_mode="pull", combine_mode="push", **SRC), True, False),
]  # fmt: skip
QUICK_MODES = (
    "pull/push",
    "pull/push interleaved",
    "dedup/push",
    "pull/push saved",
    "fused saved",
    "fused saved in-launch",
)
ROUTED = ("out", "dx", "d_topk_weights", "dw_gate", "dw_up", "dw_down")
SHARED = ("d_shared_w_gate", "d_shared_w_up", "d_shared_w_down")
LEAF = {"dw_gate": "w_gate", "dw_up": "w_up", "dw_down": "w_down"}
LEAF.update({f"d_{n}": n for n in ("shared_w_gate", "shared_w_up", "shared_w_down")})


def wait_ms(at_eight: float) -> float:
    """A wait bound for this run: ``at_eight`` up to 8 ranks, growing with the ranks above (on
    shared-GPU ranks every cross-rank hop waits for the peers' time slices)."""
    return at_eight * max(1, dist.get_world_size() // 8)


def check(cond: bool, what: str) -> None:
    if not cond:
        raise AssertionError(f"rank {dist.get_rank()}: {what}")


@dataclasses.dataclass
class Problem:
    shape: ModelShape
    counts: list[int]  # tokens of every rank
    w: MoEWeights  # all experts, bf16 on the device
    x: torch.Tensor  # [sum(counts), H] bf16, the global batch
    idx: torch.Tensor  # [sum(counts), K] int64
    tw: torch.Tensor  # [sum(counts), K] fp32
    grad_out: torch.Tensor  # [sum(counts), H] bf16

    def rows(self, rank: int) -> slice:
        start = sum(self.counts[:rank])
        return slice(start, start + self.counts[rank])


def problem(
    shape: ModelShape, counts: list[int], skew: str, dev, seed: int = SEED, routing=None
) -> Problem:
    """The global problem: a function of the shape, the total token count and the seed only, so
    EP1 over the whole batch and EP R over its slices see the same tokens. ``routing``: the
    (topk_idx, topk_weights) of all tokens instead of ``make_routing``'s of ``skew``."""
    n = sum(counts)
    w = MoEWeights.random(shape, seed=seed, dtype=torch.bfloat16, device=dev)
    if routing is None:
        t = make_routing(n, shape.num_experts, shape.num_topk, 1, skew, seed=seed)
        routing = torch.from_numpy(t.topk_idx), torch.from_numpy(t.topk_weights)
    g = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(n, shape.hidden, generator=g).to(torch.bfloat16)
    grad_out = torch.randn(n, shape.hidden, generator=g).to(torch.bfloat16)
    idx, tw = routing[0].long(), routing[1].float()
    return Problem(shape, counts, w, x.to(dev), idx.to(dev), tw.to(dev), grad_out.to(dev))


def leaves(w: MoEWeights) -> MoEWeights:
    """Fresh leaf copies of w's tensors (requires_grad)."""
    return dataclasses.replace(
        w,
        **{k: v.detach().clone().requires_grad_(True) for k, v in vars(w).items() if v is not None},
    )


@contextlib.contextmanager
def transfers_in_launch(on: bool):
    """With ``on``, the backward moves its tokens inside the routed experts' launch; checks on
    exit that it did (the launch takes the operands of every case here)."""
    if not on:
        yield
        return
    calls = []
    inner = ma.swiglu_backward_tokens

    def counted(*args, **kwargs):
        calls.append(1)
        return inner(*args, **kwargs)

    ma.TRANSFERS_IN_LAUNCH, ma.swiglu_backward_tokens = True, counted
    try:
        yield
    finally:
        ma.TRANSFERS_IN_LAUNCH, ma.swiglu_backward_tokens = False, inner
    check(bool(calls), "the backward did not run its transfers in the launch")


def run(p: Problem, sl: slice, w: MoEWeights, cfg: mok.MoKConfig, fused: bool, recompute: bool,
        group=None, inside: bool = False) -> dict[str, torch.Tensor]:  # fmt: skip
    """The layer and its backward under autograd on tokens ``sl`` with experts ``w``
    (``inside``: the backward's transfers inside its launch)."""
    w = leaves(w)
    x = p.x[sl].clone().requires_grad_(True)
    tw = p.tw[sl].clone().requires_grad_(True)
    out = mf.moe(x, p.idx[sl], tw, w, p.shape.num_experts, cfg, group, fused, recompute)
    with transfers_in_launch(inside):
        out.backward(p.grad_out[sl])
    got = {"out": out.detach(), "dx": x.grad, "d_topk_weights": tw.grad}
    for g, n in LEAF.items():
        if getattr(w, n) is not None:
            got[g] = getattr(w, n).grad
    return got


def references(p: Problem, rank: int, R: int) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """{name: (fp64 oracle, bf16 reference)} of this rank's part: its tokens' rows, its experts'
    weight gradients (of the whole batch), its shared expert's (of its own tokens)."""
    sl, L = p.rows(rank), p.shape.num_experts // R
    ex = slice(rank * L, (rank + 1) * L)
    out = {}
    w = dataclasses.replace(p.w, **{k: v.cpu() for k, v in vars(p.w).items() if v is not None})
    x, idx, tw, grad_out = (t.cpu() for t in (p.x, p.idx, p.tw, p.grad_out))
    for dt in (torch.float64, torch.bfloat16):  # the reference runs on the CPU
        y = moe_forward(x, idx, tw, w, compute_dtype=dt)
        g = moe_backward(grad_out, x, idx, tw, w, dt)
        mine = moe_backward(grad_out[sl], x[sl], idx[sl], tw[sl], w, dt)
        parts = {"out": y[sl], "dx": g.dx[sl], "d_topk_weights": g.d_topk_weights[sl]}
        parts.update({n: getattr(g, n)[ex] for n in ("dw_gate", "dw_up", "dw_down")})
        if p.shape.shared_intermediate:
            parts.update({n: getattr(mine, n) for n in SHARED})
        for n, t in parts.items():
            out.setdefault(n, []).append(t)
    return {n: tuple(v) for n, v in out.items()}


def check_reference(got: dict, refs: dict, what: str) -> None:
    for name, (oracle, ref16) in refs.items():
        g = got[name].cpu().double()
        try:
            tol.assert_bf16_rule(g, tol.stored_like(ref16, got[name].cpu()).double(), oracle)
        except AssertionError as e:
            raise AssertionError(f"rank {dist.get_rank()}: {what}: {name}: {e}") from None


def invariant(fields: dict) -> tuple[str, ...]:
    """What a mode's results at EP R share bit for bit with EP1's."""
    if fields["dispatch_mode"] == "dedup_pull":
        return ()
    if fields.get("row_order") != "source":
        return ("out", "dx", "d_topk_weights")
    return ROUTED


def invariance(got: dict, ep1: dict, sl: slice, ex: slice) -> dict[str, float]:
    """{tensor of ``got`` (EP R) that differs from EP1's part: its max |diff|}."""
    bad = {}
    for name in ROUTED:
        if name not in got:
            continue
        mine = got[name]
        want = ep1[name][ex] if name.startswith("dw_") else ep1[name][sl]
        if not torch.equal(mine, want):
            bad[name] = (mine.double() - want.double()).abs().max().item()
    return bad


def case_checks(shape, counts, skew, modes, solo, dev, repeats: int) -> list[str]:
    rank, R = dist.get_rank(), dist.get_world_size()
    p = problem(shape, counts, skew, dev)
    sl, L = p.rows(rank), shape.num_experts // R
    ex = slice(rank * L, (rank + 1) * L)
    refs = references(p, rank, R)
    local = p.w.shard(rank, R)
    full = slice(0, sum(counts))
    tag = f"[{shape.name} counts={counts} {skew}]"
    failures = []
    for name, fields, fused, recompute in MODES:
        if name not in modes:
            continue
        cfg = mok.MoKConfig(num_comm_sms=8, wait_timeout_ms=wait_ms(60_000.0), **fields)
        inside = name.endswith("in-launch")
        got = run(p, sl, local, cfg, fused, recompute, inside=inside)
        check_reference(got, refs, f"{tag} {name}")
        ep1 = run(p, full, p.w, cfg, fused, recompute, group=solo, inside=inside)
        diffs = invariance(got, ep1, sl, ex)
        bad = [n for n in diffs if n in invariant(fields)]
        text = ", ".join(f"{n} {d:.3e}" for n, d in diffs.items()) or "none"
        print(f"rank {rank}: {tag} {name}: EP{R} vs EP1 max |diff|: {text}", flush=True)
        if bad:
            failures.append(f"{tag} {name}: EP{R} != EP1 in {', '.join(bad)}")
        if inside:  # the communication kernels around the launch: the same bits
            kernels = run(p, sl, local, cfg, fused, recompute)
            for n, t in got.items():
                check(torch.equal(t, kernels[n]), f"{tag} {name}: {n} differs from the kernels'")
        if name in ("pull/push", "fused saved", "fused saved in-launch") and counts == [
            counts[0]
        ] * R:
            # an SM budget: every kernel on 40 SMs, the same bits
            small = run(p, sl, local, dataclasses.replace(cfg, num_sms=40), fused, recompute,
                        inside=inside)  # fmt: skip
            for n, t in got.items():
                check(torch.equal(t, small[n]), f"{tag} {name}: num_sms=40: {n} differs")
        for rep in range(repeats if name == modes[0] else 0):
            again = run(p, sl, local, cfg, fused, recompute)
            for n, t in got.items():
                check(torch.equal(t, again[n]), f"{tag} {name}: run {rep + 2}: {n} differs")
        print(f"rank {rank}: {tag} {name} ok{' (NOT INVARIANT)' if bad else ''}", flush=True)
        mok.clear_workspaces()
    return failures


def api_case(dev) -> None:
    """mok.MoE(group), torch.compile (fullgraph) of the functional layer, and main_grad at this
    EP size: the same bits as the eager functional layer (main_grad: its fp32 sums, which the
    eager gradients are the bf16 roundings of)."""
    rank, R = dist.get_rank(), dist.get_world_size()
    shape = CASES[0][0]
    p = problem(shape, [96] * R, "hot:0.5", dev)
    sl, local = p.rows(rank), p.w.shard(rank, R)
    cfg = mok.MoKConfig(num_comm_sms=8, wait_timeout_ms=60_000.0, dispatch_mode="pull")
    want = run(p, sl, local, cfg, False, True)
    # the module, on one [L, 2I, H] gate_up and a [2Is, H] shared gate_up
    gu = torch.cat([local.w_gate, local.w_up], 1).detach().clone()
    sgu = torch.cat([local.shared_w_gate, local.shared_w_up], 0).detach().clone()
    m = mok.MoE.from_weights(
        shape.num_experts, gu, local.w_down.detach().clone(), sgu,
        local.shared_w_down.detach().clone(), config=cfg,
    )  # fmt: skip
    x = p.x[sl].clone().requires_grad_(True)
    out = m(x, p.idx[sl], p.tw[sl])
    out.backward(p.grad_out[sl])
    inter, s_inter = shape.intermediate, shape.shared_intermediate
    check(torch.equal(out, want["out"]), "MoE(group): output")
    check(torch.equal(x.grad, want["dx"]), "MoE(group): dx")
    check(torch.equal(m.gate_up.grad[:, :inter], want["dw_gate"]), "MoE(group): gate_up grad")
    check(torch.equal(m.gate_up.grad[:, inter:], want["dw_up"]), "MoE(group): gate_up grad (up)")
    check(torch.equal(m.down.grad, want["dw_down"]), "MoE(group): down grad")
    check(torch.equal(m.shared_gate_up.grad[:s_inter], want["d_shared_w_gate"]), "MoE: shared gate")
    # the explicit backward (no autograd): the same bits
    g = mf.moe_backward(p.grad_out[sl], p.x[sl], p.idx[sl], p.tw[sl], local, shape.num_experts, cfg)
    for n in ("dx", "d_topk_weights", "dw_gate", "dw_up", "dw_down", "d_shared_w_down"):
        check(torch.equal(getattr(g, n), want[n]), f"moe_backward at EP{R}: {n} differs")
    # compiled, fullgraph
    w = leaves(local)
    x = p.x[sl].clone().requires_grad_(True)
    tw = p.tw[sl].clone().requires_grad_(True)

    def layer(x, idx, tw):
        return mf.moe(x, idx, tw, w, shape.num_experts, cfg)

    out = torch.compile(layer, fullgraph=True)(x, p.idx[sl], tw)
    out.backward(p.grad_out[sl])
    got = {"out": out.detach(), "dx": x.grad, "d_topk_weights": tw.grad, "dw_down": w.w_down.grad}
    for n, t in got.items():
        check(torch.equal(t, want[n]), f"torch.compile at EP{R}: {n} differs from eager")
    # compiled with kept activations (the receive rows' count: from max_tokens at EP > 1)
    saved_cfg = dataclasses.replace(cfg, max_tokens=96)
    want_saved = run(p, sl, local, saved_cfg, False, False)
    w = leaves(local)
    x = p.x[sl].clone().requires_grad_(True)

    def saving(x, idx, tw):
        return mf.moe(x, idx, tw, w, shape.num_experts, saved_cfg, recompute=False)

    out = torch.compile(saving, fullgraph=True)(x, p.idx[sl], p.tw[sl])
    out.backward(p.grad_out[sl])
    check(torch.equal(x.grad, want_saved["dx"]), f"compiled recompute=False at EP{R}: dx")
    check(torch.equal(w.w_up.grad, want_saved["dw_up"]), "compiled recompute=False: dw_up")
    # main_grad
    w = leaves(local)
    for t in vars(w).values():
        if t is not None:
            t.main_grad = torch.zeros_like(t, dtype=torch.float32)
    x = p.x[sl].clone().requires_grad_(True)
    out = mf.moe(x, p.idx[sl], p.tw[sl], w, shape.num_experts, cfg, main_grad=True)
    out.backward(p.grad_out[sl])
    for g, n in LEAF.items():
        t = getattr(w, n)
        check(t.grad is None, f"main_grad: {n}.grad set")
        check(torch.equal(t.main_grad.to(t.dtype), want[g]), f"main_grad: {n} differs")
    mok.clear_workspaces()
    print(
        f"rank {rank}: MoE(group), moe_backward, torch.compile, main_grad at EP{R} ok", flush=True
    )


def restore_case(dev, solo) -> None:
    """mok.autograd.RESTORE_SCHEDULE at this EP size: with peers the backward builds its schedule
    again whether the switch is on or off (two schedule kernels a step); on a group of this rank
    alone (EP1 of the whole batch) it restores the forward's with the switch on (one). Every
    result bitwise the switch off's, recomputing or from kept g / u."""
    rank, R = dist.get_rank(), dist.get_world_size()
    shape, n, skew = CASES[0]
    p = problem(shape, [n] * R, skew, dev)
    sl, local, full = p.rows(rank), p.w.shard(rank, R), slice(0, n * R)
    cfg = mok.MoKConfig(num_comm_sms=8, wait_timeout_ms=wait_ms(60_000.0), dispatch_mode="pull")
    builds, inner = [], ops.build_schedule

    def counted(*args, **kwargs):
        builds.append(1)
        return inner(*args, **kwargs)

    ops.build_schedule = counted
    try:
        for recompute in (True, False):
            for group, rows, w in ((None, sl, local), (solo, full, p.w)):
                where = f"recompute={recompute} {'EP1 of the batch' if group else f'EP{R}'}"
                runs = {}
                for on in (True, False):
                    ma.RESTORE_SCHEDULE = on
                    before = len(builds)
                    runs[on] = run(p, rows, w, cfg, False, recompute, group=group)
                    want = 1 if on and (group is not None or R == 1) else 2
                    got = len(builds) - before
                    check(got == want, f"{where}, switch {on}: {got} schedule builds, not {want}")
                for name, t in runs[False].items():
                    check(torch.equal(runs[True][name], t), f"{where}: {name} differs")
    finally:
        ops.build_schedule, ma.RESTORE_SCHEDULE = inner, True
    mok.check()
    mok.clear_workspaces()
    print(f"rank {rank}: the schedule restored at one rank, built again at EP{R} ok", flush=True)


def fuzz_cases(dev, num_cases: int) -> None:
    """The GPU fuzz test's cases (tests/test_mok_fuzz_gpu.py: shapes, routings incl. one hot
    expert and every token on the same experts, configs, ring wrap-around) at this EP size, each
    rank with its own token count (0 and 1 included), forward and backward against the
    reference of the whole problem; cases whose experts do not split over the ranks are
    skipped."""
    from tests.test_mok_fuzz_gpu import BASE_SEED, draw
    from tests.test_mok_fuzz_gpu import routing as fuzz_routing

    rank, R = dist.get_rank(), dist.get_world_size()
    ran = 0
    for i in range(num_cases):
        case = draw(BASE_SEED + 7919 * R + i)
        if case.num_experts % R:
            continue
        rng = random.Random(case.seed + 1)
        counts = [rng.choice([0, 1, rng.randrange(2, 300)]) for _ in range(R)]
        case = dataclasses.replace(case, num_tokens=sum(counts))
        shape = ModelShape("fuzz", case.num_experts, case.hidden, case.inter, case.num_topk,
                           case.shared_inter)  # fmt: skip
        p = problem(shape, counts, "", dev, seed=case.seed, routing=fuzz_routing(case))
        recompute = case.fused or rng.random() < 0.5
        row_order = rng.choice(["interleaved", "source"])
        cfg = dataclasses.replace(case.config(), row_order=row_order)
        try:
            got = run(p, p.rows(rank), p.w.shard(rank, R), cfg, case.fused, recompute)
            mok.check()
            check_reference(got, references(p, rank, R), "fuzz")
        except Exception as e:
            raise AssertionError(
                f"rank {rank}: fuzz case {case} counts={counts} recompute={recompute} "
                f"row_order={row_order}: {type(e).__name__}: {e}"
            ) from None
        finally:
            mok.clear_workspaces()
        ran += 1
    print(f"rank {rank}: fuzz: {ran} of {num_cases} drawn cases at EP{R} ok", flush=True)


def bad_routing_case(dev, shape: ModelShape) -> None:
    """Rank 0 routes a token to an expert that does not exist: every rank raises at its next
    mok call, and the call after that runs and gives the first call's bits."""
    rank, R = dist.get_rank(), dist.get_world_size()
    p = problem(shape, [64] * R, "uniform", dev)
    sl, local = p.rows(rank), p.w.shard(rank, R)
    cfg = mok.MoKConfig(num_comm_sms=8, wait_timeout_ms=wait_ms(60_000.0))
    first = run(p, sl, local, cfg, False, True)
    bad = dataclasses.replace(p, idx=p.idx.clone())
    if rank == 0:
        bad.idx[sl.start + 3, 1] = shape.num_experts
    try:
        run(bad, sl, local, cfg, False, True)
        mok.check()
        check(False, "an out-of-range expert id was not reported")
    except mok.MoKInputError as e:
        check(f"to expert {shape.num_experts} outside" in str(e), str(e))
    again = run(p, sl, local, cfg, False, True)
    for n, t in first.items():
        check(torch.equal(t, again[n]), f"after bad routing: {n} differs")
    mok.clear_workspaces()
    print(f"rank {rank}: bad routing on rank 0 raised everywhere, next call ok", flush=True)


def timeout_case(dev, inside: bool, shape: ModelShape) -> None:
    """Rank 1 runs the forward and never the backward: every other rank's backward raises
    MoKTimeoutError within its wait_timeout_ms (plus the launch and host time), no hang.
    ``inside``: from kept activations, the transfers inside the launch."""
    rank, R = dist.get_rank(), dist.get_world_size()
    p = problem(shape, [64] * R, "uniform", dev)
    sl, local = p.rows(rank), leaves(p.w.shard(rank, R))
    timeout_ms = wait_ms(4000.0)
    cfg = mok.MoKConfig(num_comm_sms=8, wait_timeout_ms=timeout_ms)
    x = p.x[sl].clone().requires_grad_(True)
    out = mf.moe(x, p.idx[sl], p.tw[sl], local, shape.num_experts, cfg, recompute=not inside)
    mok.check()
    dist.barrier()
    if rank != 1:
        t0 = time.monotonic()
        try:
            with transfers_in_launch(inside):
                out.backward(p.grad_out[sl])
            mok.check()
            check(False, "the backward without rank 1 did not time out")
        except mok.MoKTimeoutError as e:
            took = time.monotonic() - t0
            check(took < timeout_ms / 1000 + 30 + R, f"raised after {took:.1f} s")
            how = "in-launch" if inside else "kernels"
            print(f"rank {rank} ({how}) raised after {took:.1f} s: {str(e)[:120]}", flush=True)
    dist.barrier()
    mok.clear_workspaces()


def memory_report(dev: torch.device, rank: int) -> None:
    """What each rank holds on its GPU at the end (the shared-GPU EP sizes are bounded by it,
    tests/dist/launch.py GIB_PER_SHARED_RANK): torch's caching allocator per rank, then (rank 0)
    every process's total as nvidia-smi sees it; the difference is the CUDA context, the
    libraries' workspaces and the symmetric memory, which torch's allocator does not count."""
    mib = 2**20
    print(
        f"rank {rank}: MEMORY torch reserved {torch.cuda.memory_reserved(dev) / mib:.0f} MiB "
        f"(peak {torch.cuda.max_memory_reserved(dev) / mib:.0f}, allocated "
        f"{torch.cuda.memory_allocated(dev) / mib:.0f})",
        flush=True,
    )
    if rank != 0:
        return
    q = ["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"]
    with contextlib.suppress(OSError, subprocess.SubprocessError, ValueError):  # no such view
        out = subprocess.run(q, capture_output=True, text=True, timeout=30).stdout
        used = [int(line.split(",")[1]) for line in out.splitlines() if line.count(",") == 1]
        if used:
            print(
                f"rank 0: MEMORY per process (nvidia-smi, {len(used)} processes): "
                f"min {min(used)} MiB, max {max(used)} MiB, total {sum(used)} MiB",
                flush=True,
            )


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="fewer modes and cases")
    ap.add_argument("--timeout", action="store_true", help="only the missing-peer case")
    ap.add_argument("--repeats", type=int, default=20, help="runs of the first mode compared")
    ap.add_argument("--report", action="store_true", help="print invariance failures, pass")
    ap.add_argument("--fuzz", type=int, default=0, help="fuzz cases (forward and backward)")
    ap.add_argument("--wide", action="store_true",
                    help="above eight ranks: the tiny 64-expert case (with --timeout: its shape)")  # fmt: skip
    ap.add_argument("--wgrad-gu-plain", action="store_true",
                    help="mok.ops.WGRAD_GU_TRANSPOSED off (dW_gate_up as dgu^T x)")  # fmt: skip
    ap.add_argument("--schedule-restore", action="store_true",
                    help="only the case of mok.autograd.RESTORE_SCHEDULE on and off")  # fmt: skip
    args = ap.parse_args()
    if args.wgrad_gu_plain:
        ops.WGRAD_GU_TRANSPOSED = False
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.set_num_threads(2)  # the CPU reference
    dev = init_ranks("train_worker.py")
    rank, R = dist.get_rank(), dist.get_world_size()
    # EP1 of the whole batch runs on a group of this rank alone (every rank makes every group).
    solo = [dist.new_group([r]) for r in range(R)][rank]
    shape = WIDE[0] if args.wide else CASES[0][0]
    failures: list[str] = []
    if args.timeout:
        if R > 1:
            timeout_case(dev, False, shape)
            timeout_case(dev, True, shape)
    elif args.schedule_restore:
        restore_case(dev, solo)
    elif args.wide:
        failures = case_checks(shape, [WIDE[1]] * R, WIDE[2], WIDE_MODES, solo, dev, 0)
    else:
        modes = QUICK_MODES if args.quick else tuple(m[0] for m in MODES)
        for i, (case_shape, n, skew) in enumerate(CASES[:2] if args.quick else CASES):
            failures += case_checks(
                case_shape, [n] * R, skew, modes, solo, dev, args.repeats if i == 0 else 0
            )
        # unequal counts, one rank without tokens
        counts = [0 if r == 1 else 48 + 40 * r for r in range(R)]
        failures += case_checks(
            shape, counts, "hot:0.5", (*modes[:2], "fused saved in-launch"), solo, dev, 0
        )
        api_case(dev)
        restore_case(dev, solo)
    if not (args.timeout or args.schedule_restore):
        if R > 1:
            bad_routing_case(dev, shape)
        if args.fuzz and not args.wide:
            fuzz_cases(dev, args.fuzz)
        for f in failures:
            print(f"rank {rank}: INVARIANCE {f}", flush=True)
        check(args.report or not failures, f"{len(failures)} invariance failures")
    dist.barrier()
    memory_report(dev, rank)
    print(f"MOK-TRAIN-OK rank={rank}", flush=True)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
