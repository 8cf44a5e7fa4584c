"""Property tests of the reference over random small problems: the single-device layer (forward
and explicit backward) against a dense per-token fp64 oracle written here, the schedule with a
different token count per rank against a loop-by-loop transcription, and the expert-parallel
layer (every transfer mode, ranks with zero tokens next to ranks with tokens) against the
single-device layer on gloo ranks, all cases in one torchrun launch."""

from __future__ import annotations

import json

import torch
from hypothesis import HealthCheck, Phase, example, given, settings
from hypothesis import strategies as st

from mok.spec.workload import make_routing
from reference.ep import COMBINE_MODES, DISPATCH_MODES
from reference.moe import moe_backward, moe_forward, output_dtype
from reference.schedule import build_all_schedules
from reference.weights import MoEWeights
from tests import tolerances as tol
from tests.dist.launch import torchrun
from tests.layer_problem import fp64_problem
from tests.schedule_bruteforce import brute_force_pull_rows

MODES = {"float64": torch.float64, "float32": torch.float32, "bfloat16": torch.bfloat16}
TOLS = {
    torch.float64: (tol.FP64_RTOL, tol.FP64_ATOL),
    torch.float32: (tol.FP32_RTOL, tol.FP32_ATOL),
}
SKEWS = ["uniform", "zipf:1.5", "zipf:0.5@0.7", "hot:0.5"]
EP_RANKS = 3  # ranks of the gloo launch (not a power of two on purpose)


def _skew(draw, num_experts: int, num_topk: int) -> str:
    # hot routing needs a cold expert for every other slot: hot_experts + num_topk <= experts
    fits = [s for s in SKEWS if not s.startswith("hot") or num_topk + 1 <= num_experts]
    return draw(st.sampled_from(fits))


@st.composite
def layers(draw, max_tokens: int = 64, modes: tuple[str, ...] = tuple(MODES)):
    num_experts = draw(st.integers(1, 8))
    num_topk = draw(st.integers(0, min(num_experts, 4)))
    return {
        "tokens": draw(st.integers(0, max_tokens)),
        "num_experts": num_experts,
        "num_topk": num_topk,
        "hidden": 8 * draw(st.integers(1, 4)),
        "intermediate": 8 * draw(st.integers(1, 4)),
        "shared": draw(st.sampled_from([0, 8, 16])),
        "skew": _skew(draw, num_experts, num_topk),
        "seed": draw(st.integers(0, 2**16)),
        "mode": draw(st.sampled_from(modes)),
    }


# the largest layers the strategies draw, in every mode
_LARGEST = {"tokens": 64, "num_experts": 8, "num_topk": 4, "hidden": 32, "intermediate": 32}
_LARGEST.update(shared=16, skew="hot:0.5", seed=3)


def _problem(case: dict):
    """fp64 inputs of a layer case: x, grad_out, topk_idx, topk_weights, weights."""
    keys = ("tokens", "num_experts", "num_topk", "hidden", "intermediate", "shared", "skew")
    return fp64_problem(*(case[k] for k in keys), case["seed"])


def _in_mode(mode: torch.dtype, x, go, tw, w):
    """The inputs as the layer takes them in ``mode`` (bf16 mode: bf16 x and weights, fp32
    router weights)."""
    xd = torch.bfloat16 if mode == torch.bfloat16 else mode
    twd = torch.float32 if mode == torch.bfloat16 else mode
    return x.to(xd), go.to(xd), tw.to(twd), w.to(xd)


def _ffn(x: torch.Tensor, wg: torch.Tensor, wu: torch.Tensor, wd: torch.Tensor) -> torch.Tensor:
    gate = wg @ x
    return wd @ (gate * torch.sigmoid(gate) * (wu @ x))


def dense_oracle(x, idx, tw, w: MoEWeights) -> torch.Tensor:
    """``out[t] = shared(x[t]) + sum_k tw[t, k] * expert_{idx[t, k]}(x[t])``, token by token, in
    fp64 (the inputs' values, exactly)."""
    x, tw = x.double(), tw.double()
    wd = w.to(torch.float64) if w.w_gate.dtype != torch.float64 else w
    rows = []
    for t in range(x.shape[0]):
        acc = torch.zeros(wd.hidden, dtype=torch.float64)
        if wd.has_shared:
            acc = acc + _ffn(x[t], wd.shared_w_gate, wd.shared_w_up, wd.shared_w_down)
        for k in range(idx.shape[1]):
            e = int(idx[t, k])
            acc = acc + tw[t, k] * _ffn(x[t], wd.w_gate[e], wd.w_up[e], wd.w_down[e])
        rows.append(acc)
    return torch.stack(rows) if rows else torch.zeros(0, wd.hidden, dtype=torch.float64)


# MoEGrads field of the gradient of each MoEWeights field
_GRAD_OF = {
    "w_gate": "dw_gate",
    "w_up": "dw_up",
    "w_down": "dw_down",
    "shared_w_gate": "d_shared_w_gate",
    "shared_w_up": "d_shared_w_up",
    "shared_w_down": "d_shared_w_down",
}


def oracle_grads(go, x, idx, tw, w: MoEWeights) -> dict[str, torch.Tensor]:
    """Autograd of :func:`dense_oracle` (fp64): gradients of <grad_out, out>, keyed by the
    :class:`reference.moe.MoEGrads` field."""
    leaves = {"dx": x.double(), "d_topk_weights": tw.double()}
    for name, grad in _GRAD_OF.items():
        if getattr(w, name) is not None:
            leaves[grad] = getattr(w, name).double()
    leaves = {n: t.clone().requires_grad_(True) for n, t in leaves.items()}
    wd = MoEWeights(**{n: leaves.get(g) for n, g in _GRAD_OF.items()})
    out = dense_oracle(leaves["dx"], idx, leaves["d_topk_weights"], wd)
    # the zero term keeps every leaf in the graph (no tokens, or experts nobody routes to)
    loss = (out * go.double()).sum() + sum((0 * t).sum() for t in leaves.values())
    grads = torch.autograd.grad(loss, list(leaves.values()))
    return dict(zip(leaves, grads, strict=True))


@settings(max_examples=50, deadline=None)
@given(layers())
@example({**_LARGEST, "mode": "bfloat16"})
@example({**_LARGEST, "mode": "float32"})
@example({**_LARGEST, "mode": "float64"})
def test_layer_forward_against_dense_oracle(case):
    mode = MODES[case["mode"]]
    x, go, idx, tw, w = _problem(case)
    xm, _, twm, wm = _in_mode(mode, x, go, tw, w)
    got = moe_forward(xm, idx, twm, wm, mode)
    want = dense_oracle(xm, idx, twm, wm)  # of the rounded inputs
    assert got.shape == (case["tokens"], case["hidden"]) and got.dtype == output_dtype(mode)
    if mode == torch.bfloat16:
        tol.assert_bf16_ref_bound(got, want)
    else:
        rtol, atol = TOLS[mode]
        torch.testing.assert_close(got.double(), want, rtol=rtol, atol=atol)


@settings(max_examples=30, deadline=None)
@given(layers(max_tokens=24, modes=("float64", "float32")))
@example({**_LARGEST, "tokens": 24, "mode": "float32"})
@example({**_LARGEST, "tokens": 24, "mode": "float64"})
def test_layer_backward_against_autograd_of_the_oracle(case):
    mode = MODES[case["mode"]]
    x, go, idx, tw, w = _problem(case)
    xm, gom, twm, wm = _in_mode(mode, x, go, tw, w)
    got = moe_backward(gom, xm, idx, twm, wm, mode)
    want = oracle_grads(gom, xm, idx, twm, wm)
    rtol, atol = TOLS[mode]
    for name, g in want.items():
        mine = getattr(got, name)
        assert mine.shape == g.shape, name
        torch.testing.assert_close(mine.double(), g, rtol=rtol, atol=atol, msg=name)


# ---- the schedule with a token count per rank ------------------------------------------------


@st.composite
def ragged_routings(draw):
    num_ranks = draw(st.integers(1, 4))
    num_experts = num_ranks * draw(st.integers(1, 3))
    num_topk = draw(st.integers(0, min(num_experts, 4)))
    tokens = draw(st.lists(st.integers(0, 12), min_size=num_ranks, max_size=num_ranks))
    width = max(tokens) + draw(st.integers(0, 2))  # padding past the largest count too
    seed = draw(st.integers(0, 2**16))
    idx = torch.zeros(num_ranks, width, num_topk, dtype=torch.int64)
    if num_topk:
        t = make_routing(num_ranks * width, num_experts, num_topk, 1, "zipf:1.0", seed)
        idx = torch.from_numpy(t.topk_idx).reshape(num_ranks, width, num_topk)
    for r, n in enumerate(tokens):  # padding holds anything, even repeated experts
        idx[r, n:] = 0
    return idx, tokens, num_experts, draw(st.sampled_from([1, 4]))


@settings(max_examples=50, deadline=None)
@given(ragged_routings())
def test_schedule_with_a_token_count_per_rank(case):
    idx, tokens, num_experts, row_tile = case
    num_topk = idx.shape[2]
    scheds = build_all_schedules(idx, num_experts, row_tile, num_tokens_all=tokens)
    for s in scheds:
        off, rows = brute_force_pull_rows(idx, num_experts, s.rank, row_tile, tokens)
        assert off == s.offsets.tolist()
        assert rows == list(zip(s.src_rank.tolist(), s.src_index.tolist(), strict=True))
        n = tokens[s.rank]
        assert s.num_tokens == n and s.dst_rank.shape == s.dst_index.shape == (n, num_topk)
        for t in range(n):  # the push view lands where the pull view reads
            for k in range(num_topk):
                dst = scheds[int(s.dst_rank[t, k])]
                p = int(s.dst_index[t, k])
                assert (int(dst.src_rank[p]), int(dst.src_index[p])) == (s.rank, t * num_topk + k)
        # dedup: one row per (source rank, real token) with an expert on this rank
        num_local = num_experts // len(tokens)
        pairs = set(zip(s.dedup_src_rank.tolist(), s.dedup_src_token.tolist(), strict=True))
        want = {
            (r, t)
            for r, n_r in enumerate(tokens)
            for t in range(n_r)
            if bool((idx[r, t] // num_local == s.rank).any())
        }
        assert pairs == want and len(pairs) == s.num_dedup_rows
    # the same counts given for a routing without padding: the plain schedule
    dense = idx[:, : min(tokens)]
    plain = build_all_schedules(dense, num_experts, row_tile)
    again = build_all_schedules(dense, num_experts, row_tile, [dense.shape[1]] * len(tokens))
    for a, b in zip(plain, again, strict=True):
        assert all(torch.equal(getattr(a, f), getattr(b, f)) for f in ("src_index", "fanout"))


# ---- the expert-parallel layer on gloo ranks -------------------------------------------------


@st.composite
def ep_cases(draw):
    num_local = draw(st.integers(1, 3))
    num_topk = draw(st.integers(0, min(num_local * EP_RANKS, 4)))
    return {
        "tokens": draw(st.lists(st.integers(0, 16), min_size=EP_RANKS, max_size=EP_RANKS)),
        "num_local": num_local,
        "num_topk": num_topk,
        "hidden": 8 * draw(st.integers(1, 3)),
        "intermediate": 8 * draw(st.integers(1, 3)),
        "shared": draw(st.sampled_from([0, 8])),
        "skew": _skew(draw, num_local * EP_RANKS, num_topk),
        "seed": draw(st.integers(0, 2**16)),
        "row_tile": draw(st.sampled_from([1, 4, 8])),
        "mode": draw(st.sampled_from(sorted(MODES))),
    }


# Always run: ranks with zero tokens between ranks with tokens, in each mode and with num_topk 0.
_EXPLICIT = [
    {"tokens": [0, 9, 0], "num_topk": 2, "mode": "float64"},
    {"tokens": [7, 0, 3], "num_topk": 3, "mode": "float32"},
    {"tokens": [0, 5, 11], "num_topk": 2, "mode": "bfloat16"},
    {"tokens": [4, 0, 6], "num_topk": 0, "mode": "float64"},
    {"tokens": [0, 0, 0], "num_topk": 2, "mode": "float64"},
]
_BASE = {"num_local": 2, "hidden": 16, "intermediate": 8, "shared": 8, "skew": "uniform"}
_BASE.update(seed=7, row_tile=4)


def draw_ep_cases(max_examples: int) -> list[dict]:
    """The explicit cases, then up to ``max_examples`` drawn ones. Derandomized and without
    shrinking (one launch runs them all), so a failing launch fails again on a rerun."""
    cases: list[dict] = []

    @settings(
        max_examples=max_examples,
        derandomize=True,
        database=None,
        deadline=None,
        phases=[Phase.explicit, Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    @given(ep_cases())
    def collect(case):
        cases.append(case)

    for c in reversed(_EXPLICIT):
        collect = example({**_BASE, **c})(collect)
    collect()
    return cases


def test_ep_cases_cover_zero_token_ranks():
    cases = draw_ep_cases(20)
    assert len(cases) >= 20
    assert all(len(c["tokens"]) == EP_RANKS for c in cases)
    assert any(0 in c["tokens"] and sum(c["tokens"]) for c in cases)
    assert {c["mode"] for c in cases} == set(MODES)
    assert any(c["num_topk"] == 0 for c in cases)


def test_ep_reference_against_single_device_on_gloo_ranks(tmp_path, monkeypatch):
    """Every dispatch/combine mode (tests/dist/ep_worker.py run_case) on each drawn case."""
    cases = draw_ep_cases(20)
    path = tmp_path / "cases.json"
    path.write_text(json.dumps(cases))
    monkeypatch.setenv("MOK_EP_CASES", str(path))
    out = torchrun("ep_worker.py", EP_RANKS, "EP-PROPS-OK")
    assert f"cases={len(cases)}" in out


def test_ep_worker_runs_every_transfer_mode():
    from tests.dist.ep_worker import COMBOS

    assert {d for d, _ in COMBOS} == set(DISPATCH_MODES)
    assert {c for _, c in COMBOS} == set(COMBINE_MODES)
