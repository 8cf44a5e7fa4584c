"""GPU fuzz test of the layer at EP1: random shapes, routings and configs of the fused and the
unfused paths against the reference under the BF16 rule.

Each case is drawn from one seed (printed with the case on failure; ``MOK_FUZZ_SEED`` replays a
run, ``MOK_FUZZ_CASES`` sets how many cases). Routings include zero tokens, one token, odd
counts, hot experts, every token on the same experts, and ring wrap-around (rings smaller than
the routed rows). Every case also runs twice and must be bitwise identical. The backward
fuzz test (every fourth seed of the same draw) checks every gradient of ``mok.functional.moe``
against the reference's backward the same way.
"""

from __future__ import annotations

import os
import random
from dataclasses import dataclass

import pytest

torch = pytest.importorskip("torch")

import mok  # noqa: E402
from mok import functional as mf  # noqa: E402
from mok.spec.workload import ModelShape, make_routing  # noqa: E402
from reference.moe import moe_backward as ref_moe_backward  # noqa: E402
from reference.moe import moe_forward as ref_moe_forward  # noqa: E402
from reference.weights import MoEWeights  # noqa: E402
from tests import tolerances as tol  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.sm90]

BASE_SEED = int(os.environ.get("MOK_FUZZ_SEED", "20261201"))
NUM_CASES = int(os.environ.get("MOK_FUZZ_CASES", "160"))
ROUTINGS = ("uniform", "hot:0.5", "zipf:1.2", "hot:0.9:1", "same-experts")


@dataclass(frozen=True)
class Case:
    seed: int
    hidden: int
    inter: int
    shared_inter: int
    num_experts: int
    num_topk: int
    num_tokens: int
    routing: str
    fused: bool
    dispatch_mode: str
    combine_mode: str
    num_comm_sms: int
    minibatch_size: int
    macrobatch_size: int
    row_tile: int

    def config(self) -> mok.MoKConfig:
        return mok.MoKConfig(
            dispatch_mode=self.dispatch_mode,
            combine_mode=self.combine_mode,
            num_comm_sms=self.num_comm_sms,
            minibatch_size=self.minibatch_size,
            macrobatch_size=self.macrobatch_size,
            row_tile=self.row_tile,
            wait_timeout_ms=10_000.0,
        )


def draw(seed: int) -> Case:
    rng = random.Random(seed)
    fused = rng.random() < 0.6
    E = rng.choice([4, 8, 16, 32, 64])
    K = rng.randint(1, min(8, E))
    n = rng.choice([0, 1, 2, rng.randrange(3, 130, 2), rng.randrange(131, 1200, 2), 2048])
    if fused:
        dm, cm = rng.choice([("pull", "push"), ("dedup_pull", "push")])
        row_tile = rng.choice([64, 128])
        mb = rng.choice([128, 256, 512, 4096])
    else:
        dm, cm = rng.choice(
            [("pull", "push"), ("pull", "pull"), ("push", "push"), ("push", "pull")]
            + [("dedup_pull", "push")]
        )
        row_tile = rng.choice([16, 64, 128])
        mb = rng.choice([1, 2, 4, 32]) * row_tile
    # Ring of one or two minibatches: wraps around when the routed rows exceed it.
    macro = rng.choice([0, mb, 2 * mb])
    skew = rng.choice(ROUTINGS)
    if skew.startswith("hot") and K + 1 > E:  # hot routing needs a cold expert per pick
        skew = "uniform"
    return Case(
        seed=seed,
        hidden=rng.choice([256, 512, 1024, 2048]),
        inter=rng.choice([128, 256, 384]),
        shared_inter=rng.choice([0, 128, 256]),
        num_experts=E,
        num_topk=K,
        num_tokens=n,
        routing=skew,
        fused=fused,
        dispatch_mode=dm,
        combine_mode=cm,
        num_comm_sms=rng.choice([1, 2, 4, 8, 16, 32]),
        minibatch_size=mb,
        macrobatch_size=macro,
        row_tile=row_tile,
    )


def routing(case: Case) -> tuple[torch.Tensor, torch.Tensor]:
    n, E, K = case.num_tokens, case.num_experts, case.num_topk
    if case.routing == "same-experts":  # every token on experts 0..K-1
        g = torch.Generator().manual_seed(case.seed)
        idx = torch.stack([torch.randperm(K, generator=g) for _ in range(n)]) if n else None
        idx = torch.zeros(0, K, dtype=torch.int64) if idx is None else idx
        w = torch.rand(n, K, generator=g)
        return idx, w / w.sum(dim=1, keepdim=True).clamp_min(1e-6)
    t = make_routing(n, E, K, 1, case.routing, seed=case.seed)
    return torch.from_numpy(t.topk_idx), torch.from_numpy(t.topk_weights)


def case_inputs(case: Case, offset: int):
    """(bf16 weights, topk_idx, topk_weights, x, the host generator x came from) of a case on
    the GPU; ``offset``: the generator's seed past the case's."""
    dev = torch.device("cuda")
    shape = ModelShape(
        "fuzz", case.num_experts, case.hidden, case.inter, case.num_topk, case.shared_inter
    )
    w = MoEWeights.random(shape, seed=case.seed, dtype=torch.float32, device=dev)
    w = w.to(torch.bfloat16)
    idx, tw = routing(case)
    g = torch.Generator().manual_seed(case.seed + offset)
    x = torch.randn(case.num_tokens, case.hidden, generator=g).to(torch.bfloat16).to(dev)
    return w, idx.to(dev), tw.to(dev), x, g


def run_case(case: Case) -> None:
    w, idx, tw, x, _ = case_inputs(case, 1)
    cfg = case.config()
    out = mf.moe_forward(x, idx, tw, w, case.num_experts, cfg, fused=case.fused)
    again = mf.moe_forward(x, idx, tw, w, case.num_experts, cfg, fused=case.fused)
    mok.check()
    assert out.shape == (case.num_tokens, case.hidden)
    assert torch.equal(out, again), "two runs differ"
    oracle = ref_moe_forward(x.double(), idx, tw.double(), w.to(torch.float64), torch.float64)
    ref_b = ref_moe_forward(x, idx, tw, w, torch.bfloat16)
    tol.assert_bf16_rule(out.cpu(), ref_b.cpu(), oracle.cpu())


def run_cases(seeds, run) -> list[str]:
    """``run(draw(seed))`` for every seed, the workspaces cleared after each; the failures, each
    with the environment that replays it."""
    failures = []
    for seed in seeds:
        case = draw(seed)
        try:
            run(case)
        except Exception as e:  # noqa: BLE001 - collected and reported with the seed
            failures.append(
                f"MOK_FUZZ_SEED={seed} MOK_FUZZ_CASES=1: {case}: {type(e).__name__}: {e}"
            )
        finally:
            mok.clear_workspaces()
    return failures


def test_fuzz_layer_against_reference():
    seeds = [BASE_SEED + i for i in range(NUM_CASES)]
    kinds = {"fused": 0, "unfused": 0, "zero": 0, "one": 0}
    for case in map(draw, seeds):
        kinds["fused" if case.fused else "unfused"] += 1
        kinds["zero"] += case.num_tokens == 0
        kinds["one"] += case.num_tokens == 1
    failures = run_cases(seeds, run_case)
    print(f"fuzz: {len(seeds)} cases from seed {BASE_SEED}: {kinds}, {len(failures)} failed")
    assert not failures, "\n".join(failures)


GRADS = ("dx", "d_topk_weights", "dw_gate", "dw_up", "dw_down")
SHARED = ("shared_w_gate", "shared_w_up", "shared_w_down")


def _grads(case: Case, x, idx, tw, w, grad_out) -> dict:
    w = MoEWeights(**{k: None if t is None else t.detach().clone() for k, t in vars(w).items()})
    leaves = {n: getattr(w, n) for n in ("w_gate", "w_up", "w_down", *SHARED)}
    leaves = {n: t.requires_grad_(True) for n, t in leaves.items() if t is not None}
    xs, tws = x.clone().requires_grad_(True), tw.clone().requires_grad_(True)
    out = mf.moe(xs, idx, tws, w, case.num_experts, case.config(), fused=case.fused)
    out.backward(grad_out)
    got = {"dx": xs.grad, "d_topk_weights": tws.grad}
    got.update({f"d{n}" if n.startswith("w_") else f"d_{n}": t.grad for n, t in leaves.items()})
    return got


def run_backward_case(case: Case) -> None:
    w, idx, tw, x, g = case_inputs(case, 2)
    grad_out = torch.randn(case.num_tokens, case.hidden, generator=g).to(torch.bfloat16)
    grad_out, tw = grad_out.to(x.device), tw.float()
    got = _grads(case, x, idx, tw, w, grad_out)
    again = _grads(case, x, idx, tw, w, grad_out)
    mok.check()
    # the reference runs on the host
    args = (grad_out.cpu(), x.cpu(), idx.cpu(), tw.cpu())
    w = MoEWeights(**{k: None if t is None else t.cpu() for k, t in vars(w).items()})
    oracle = ref_moe_backward(*args, w, torch.float64)
    ref_b = ref_moe_backward(*args, w, torch.bfloat16)
    names = GRADS + (tuple(f"d_{n}" for n in SHARED) if case.shared_inter else ())
    for name in names:
        assert torch.equal(got[name], again[name]), f"{name}: two runs differ"
        want = getattr(oracle, name)
        ref = tol.stored_like(getattr(ref_b, name), got[name])
        try:
            tol.assert_bf16_rule(got[name].cpu().double(), ref, want)
        except AssertionError as e:
            raise AssertionError(f"{name}: {e}") from None


def test_fuzz_backward_against_reference():
    seeds = [BASE_SEED + i for i in range(0, NUM_CASES, 4)]
    failures = run_cases(seeds, run_backward_case)
    print(f"fuzz backward: {len(seeds)} cases from seed {BASE_SEED}, {len(failures)} failed")
    assert not failures, "\n".join(failures)
