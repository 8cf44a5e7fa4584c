"""``mok.integrations.torchtitan``: mok as torchtitan's routed experts.

torchtitan does not install here (no wheel, no network), so the test compares against an
equivalent written in this file from the semantics of pytorch/torchtitan at commit
b5bcd76c66d0acb1a08b176d9639425bc55e0b2a (``torchtitan/models/common/moe.py`` and
``token_dispatcher.py``), not torchtitan's code: ``GroupedExperts`` with ``w1_EFD`` / ``w3_EFD``
[E, F, D] and ``w2_EDF`` [E, D, F] computing ``w2 (silu(w1 x) * (w3 x))`` on rows sorted by expert
(per-expert counts), the local dispatcher's stable argsort of the flattened expert ids and its
combine (each row's output times its score, scatter-added onto its token), ``RoutedExperts``
calling the three, and ``MoE`` (sigmoid top-k router, routed experts plus a SwiGLU shared
expert). One difference on purpose: torchtitan casts the grouped GEMMs to bf16; the equivalent
computes in the inputs' dtype, so fp64 compares to 1e-10.

On a CPU in fp64: output and gradients of x, the scores and w1 / w2 / w3 (mok's gate_up / down
mapped back); the state dict both ways; no weight copy per step; the refusals; mok's expert
parallelism at two gloo ranks (torchrun, tests/dist/torchtitan_worker.py) against the one-rank
equivalent for each rank's slice; the README snippet.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from mok import MoKUnsupportedError
from mok.integrations.torchtitan import MoKRoutedExperts, replace_routed_experts
from tests import tolerances as tol
from tests.dist.launch import torchrun

ROOT = Path(__file__).resolve().parents[1]
DIM, HIDDEN, EXPERTS, TOPK = 16, 12, 8, 3


# ---- the equivalent of torchtitan's modules (from their semantics) --------------------------


class GroupedExperts(nn.Module):
    """torchtitan's GroupedExperts: per expert e, its rows of x (sorted by expert) ->
    w2[e] (silu(w1[e] x) * (w3[e] x))."""

    def __init__(self, dim: int, hidden_dim: int, num_experts: int, seed: int = 0) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.num_experts = num_experts

        def rand(*shape):
            return nn.Parameter(torch.randn(*shape, generator=g, dtype=torch.float64) * 0.3)

        self.w1_EFD = rand(num_experts, hidden_dim, dim)
        self.w2_EDF = rand(num_experts, dim, hidden_dim)
        self.w3_EFD = rand(num_experts, hidden_dim, dim)

    def forward(self, x_RD: torch.Tensor, num_tokens_per_expert_E: torch.Tensor) -> torch.Tensor:
        outs = []
        for e, rows in enumerate(x_RD.split(num_tokens_per_expert_E.tolist())):
            h = F.silu(rows @ self.w1_EFD[e].T) * (rows @ self.w3_EFD[e].T)
            outs.append(h @ self.w2_EDF[e].T)
        return torch.cat(outs)


class LocalTokenDispatcher:
    """Sort the (token, k) rows by expert id (stable), then weight each row's output by its
    score and add it onto its token."""

    def __init__(self, top_k: int, score_before_experts: bool = False) -> None:
        self.top_k, self.score_before_experts = top_k, score_before_experts

    def dispatch(self, x_TD, topk_scores_TK, topk_expert_ids_TK, counts_E):
        order_N = torch.argsort(topk_expert_ids_TK.reshape(-1), stable=True)
        token_N = order_N // self.top_k
        return x_TD[token_N], counts_E, (token_N, topk_scores_TK.reshape(-1)[order_N])

    def combine(self, y_RD, meta, x_TD):
        token_N, score_N = meta
        return torch.zeros_like(x_TD).index_add(0, token_N, y_RD * score_N[:, None])


class RoutedExperts(nn.Module):
    def __init__(self, experts: GroupedExperts, top_k: int) -> None:
        super().__init__()
        self.inner_experts = experts
        self.token_dispatcher = LocalTokenDispatcher(top_k)

    def forward(self, x_TD, topk_scores_TK, topk_expert_ids_TK, counts_E):
        rows, counts, meta = self.token_dispatcher.dispatch(
            x_TD, topk_scores_TK, topk_expert_ids_TK, counts_E
        )
        return self.token_dispatcher.combine(self.inner_experts(rows, counts), meta, x_TD)


class MoE(nn.Module):
    """Router (sigmoid scores, top-k, the chosen scores), routed experts, SwiGLU shared
    expert, summed."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(seed + 100)
        self.gate = nn.Linear(DIM, EXPERTS, bias=False, dtype=torch.float64)
        self.shared = nn.ModuleList(
            nn.Linear(a, b, bias=False, dtype=torch.float64)
            for a, b in ((DIM, HIDDEN), (HIDDEN, DIM), (DIM, HIDDEN))
        )
        with torch.no_grad():
            for p in [self.gate.weight, *(m.weight for m in self.shared)]:
                p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float64) * 0.3)
        self.routed_experts = RoutedExperts(GroupedExperts(DIM, HIDDEN, EXPERTS, seed), TOPK)

    def forward(self, x_TD: torch.Tensor) -> torch.Tensor:
        scores_TE = torch.sigmoid(self.gate(x_TD))
        ids_TK = torch.topk(scores_TE, TOPK, dim=-1, sorted=False).indices
        scores_TK = scores_TE.gather(-1, ids_TK)
        counts_E = torch.zeros_like(scores_TE, dtype=torch.bool).scatter_(-1, ids_TK, True).sum(0)
        out = self.routed_experts(x_TD, scores_TK, ids_TK, counts_E)
        w1, w2, w3 = self.shared
        return out + w2(F.silu(w1(x_TD)) * w3(x_TD))


def routing(num_tokens: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [T, D], scores [T, K] (leaves, fp64) and distinct global ids [T, K]."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, DIM, generator=g, dtype=torch.float64).requires_grad_()
    ids = torch.rand(num_tokens, EXPERTS, generator=g).argsort(dim=1)[:, :TOPK]
    scores = torch.rand(num_tokens, TOPK, generator=g, dtype=torch.float64).requires_grad_()
    return x, scores, ids


def counts(ids: torch.Tensor) -> torch.Tensor:
    return torch.bincount(ids.reshape(-1), minlength=EXPERTS)


def torchtitan_grads(experts: GroupedExperts) -> list[torch.Tensor]:
    return [experts.w1_EFD.grad, experts.w2_EDF.grad, experts.w3_EFD.grad]


def mok_grads(module: MoKRoutedExperts) -> list[torch.Tensor]:
    """gate_up / down's gradients as w1 / w2 / w3's."""
    f = module.inner_experts.hidden_dim
    g = module.inner_experts.gate_up.grad
    return [g[:, :f], module.inner_experts.down.grad, g[:, f:]]


def close(a: torch.Tensor, b: torch.Tensor) -> None:
    torch.testing.assert_close(a, b, rtol=tol.FP64_RTOL, atol=tol.FP64_ATOL)


# ---- one rank ---------------------------------------------------------------------------------


def test_output_and_every_gradient_match_torchtitan():
    tt = RoutedExperts(GroupedExperts(DIM, HIDDEN, EXPERTS), TOPK)
    mk = MoKRoutedExperts.from_grouped_experts(tt)
    x, s, ids = routing(40, seed=1)
    x2, s2 = x.detach().clone().requires_grad_(), s.detach().clone().requires_grad_()
    go = torch.randn(40, DIM, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    want = tt(x, s, ids, counts(ids))
    got = mk(x2, s2, ids, counts(ids))
    close(got, want)
    want.backward(go)
    got.backward(go)
    close(x2.grad, x.grad)
    close(s2.grad, s.grad)
    for a, b in zip(mok_grads(mk), torchtitan_grads(tt.inner_experts), strict=True):
        close(a, b)


def test_replaced_in_a_moe_block_keeps_the_layer():
    """The drop-in swap inside the MoE block: router and shared expert stay, same result."""
    ref, moe = MoE(), MoE()
    assert replace_routed_experts(moe) == 1
    assert isinstance(moe.routed_experts, MoKRoutedExperts)
    x, _, _ = routing(30, seed=3)
    x2 = x.detach().clone().requires_grad_()
    close(moe(x2), ref(x))
    ref(x).square().sum().backward()
    moe(x2).square().sum().backward()
    close(x2.grad, x.grad)
    close(moe.gate.weight.grad, ref.gate.weight.grad)  # through the scores
    for a, b in zip(moe.shared, ref.shared, strict=True):
        close(a.weight.grad, b.weight.grad)
    for a, b in zip(
        mok_grads(moe.routed_experts), torchtitan_grads(ref.routed_experts.inner_experts),
        strict=True,
    ):  # fmt: skip
        close(a, b)


def test_weights_are_converted_once_and_not_copied_per_step():
    tt = RoutedExperts(GroupedExperts(DIM, HIDDEN, EXPERTS), TOPK)
    mk = MoKRoutedExperts.from_grouped_experts(tt)
    w = mk.inner_experts
    assert w.down.data_ptr() == tt.inner_experts.w2_EDF.data_ptr()  # w2 is mok's down
    assert w.gate_up.shape == (EXPERTS, 2 * HIDDEN, DIM)
    assert torch.equal(w.gate_up[:, :HIDDEN], tt.inner_experts.w1_EFD)
    assert torch.equal(w.gate_up[:, HIDDEN:], tt.inner_experts.w3_EFD)
    ptrs = [w.gate_up.data_ptr(), w.down.data_ptr()]
    x, s, ids = routing(20, seed=4)
    mk(x, s, ids).sum().backward()
    assert [w.gate_up.data_ptr(), w.down.data_ptr()] == ptrs
    assert [n for n, _ in mk.named_parameters()] == ["inner_experts.gate_up", "inner_experts.down"]


def test_state_dict_keeps_torchtitan_names_and_layout_both_ways():
    tt = RoutedExperts(GroupedExperts(DIM, HIDDEN, EXPERTS, seed=5), TOPK)
    mk = MoKRoutedExperts.from_grouped_experts(RoutedExperts(GroupedExperts(DIM, HIDDEN, 8), TOPK))
    mk.load_state_dict(tt.state_dict())  # torchtitan's checkpoint into mok
    sd = mk.state_dict()
    assert list(sd) == list(tt.state_dict())
    assert sd.keys() == mk.to_torchtitan_state_dict().keys()
    for k, v in tt.state_dict().items():
        assert torch.equal(sd[k], v), k
    back = RoutedExperts(GroupedExperts(DIM, HIDDEN, EXPERTS, seed=6), TOPK)
    back.load_state_dict(sd)  # mok's checkpoint into torchtitan
    for k, v in back.state_dict().items():
        assert torch.equal(v, tt.state_dict()[k]), k
    again = MoKRoutedExperts.from_grouped_experts(back)
    again.load_state_dict(mk.state_dict())  # mok into mok
    assert torch.equal(again.inner_experts.gate_up, mk.inner_experts.gate_up)


def test_score_before_experts_is_refused():
    tt = RoutedExperts(GroupedExperts(DIM, HIDDEN, EXPERTS), TOPK)
    with pytest.raises(MoKUnsupportedError, match=r"score_before_experts=True scales each"):
        MoKRoutedExperts.from_grouped_experts(tt, score_before_experts=True)
    tt.token_dispatcher.score_before_experts = True  # an older torchtitan's dispatcher flag
    with pytest.raises(MoKUnsupportedError, match=r"differs from mok's s \* w2"):
        MoKRoutedExperts.from_grouped_experts(tt)


def test_other_experts_are_refused():
    class LowPrecision(GroupedExperts):
        def forward(self, x_RD, num_tokens_per_expert_E):
            return super().forward(x_RD, num_tokens_per_expert_E)

    with pytest.raises(MoKUnsupportedError, match=r"LowPrecision has its own forward"):
        MoKRoutedExperts.from_grouped_experts(LowPrecision(DIM, HIDDEN, EXPERTS))
    biased = nn.Module()
    biased.mlp1_weight = nn.Parameter(torch.zeros(EXPERTS, 2 * HIDDEN, DIM))
    with pytest.raises(MoKUnsupportedError, match=r"has no w1_EFD / w2_EDF / w3_EFD"):
        MoKRoutedExperts.from_grouped_experts(biased)


def test_importing_the_integration_imports_no_layer():
    code = (
        "import sys, mok.integrations.torchtitan; "
        "print('mok.autograd' in sys.modules, 'torchtitan' in sys.modules)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True
    )
    assert out.stdout.split() == ["False", "False"]


# ---- expert parallelism -----------------------------------------------------------------------


def test_mok_expert_parallelism_at_two_gloo_ranks():
    """Each rank holds 4 of the 8 experts, mok's dispatch moves the rows (no torchtitan
    all-to-all); each rank's output, x / score gradients and its experts' weight gradients
    match the one-rank equivalent over both ranks' tokens."""
    torchrun("torchtitan_worker.py", 2, "TORCHTITAN-EP-OK", timeout=120)


# ---- README ------------------------------------------------------------------------------------


def test_readme_snippet_runs():
    """README.md's torchtitan snippet on a stand-in ``model`` (two of this file's MoE blocks)."""
    text = (ROOT / "README.md").read_text()
    block = re.search(
        r"<!-- snippet: torchtitan -->\s*```python\n(.*?)```\s*<!-- /snippet -->", text, re.S
    )
    assert block, "README.md has no <!-- snippet: torchtitan --> python block"
    model, ref = nn.ModuleDict({"0": MoE(0), "1": MoE(1)}), [MoE(0), MoE(1)]
    scope: dict = {"model": model}
    exec(compile(block.group(1), "README.md[snippet: torchtitan]", "exec"), scope)
    x, _, _ = routing(12, seed=7)
    for blk, want in zip(model.values(), ref, strict=True):
        assert isinstance(blk.routed_experts, MoKRoutedExperts)
        close(blk(x), want(x))
        assert blk.state_dict().keys() == want.state_dict().keys()
