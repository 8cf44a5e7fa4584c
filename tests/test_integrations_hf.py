"""``mok.integrations.hf``: mok as HF transformers' experts implementation ``"mok"``.

On a CPU (mok's reference layer, fp32; CI): tiny Qwen3-MoE and Qwen2-MoE models (the latter with
transformers' shared expert) built from a config with seeded random weights, no download, give
transformers' own logits, every parameter's gradient and the losses of a few SGD steps;
transformers' expert parallelism, emulated rank by rank on one process (its "not on this rank"
ids) and run for real at two gloo ranks (torchrun), matches the unsharded model; a checkpoint
saved and loaded with ``experts_implementation="mok"``; the README snippet; the refusals. On a
Hopper GPU (bf16, mok's kernels): logits and every gradient against an fp64 CPU run of
transformers' own experts under the bf16 rule, with transformers' own bf16 run as the rule's
reference, and a short training loop the same way.
"""

from __future__ import annotations

import copy
import gc
import importlib.metadata
import os
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import mok.integrations.hf as hf
from mok import MoKUnsupportedError
from tests import tolerances as tol

ROOT = Path(__file__).resolve().parents[1]


def _transformers_version() -> tuple[int, ...] | None:
    try:
        found = importlib.metadata.version("transformers")
    except importlib.metadata.PackageNotFoundError:
        return None
    return tuple(int(p) for p in re.findall(r"\d+", found)[:2])


_FOUND = _transformers_version()
needs_hf = pytest.mark.skipif(
    _FOUND is None or _FOUND < hf.MIN_TRANSFORMERS,
    reason=f'needs HF transformers >= 5.7 (found {_FOUND}): pip install -e ".[hf]"',
)


# ---- without transformers -------------------------------------------------------------------


def test_importing_the_integration_imports_no_transformers():
    code = "import sys, mok, mok.integrations.hf; print('transformers' in sys.modules)"
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == "False"


def test_register_without_transformers_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "transformers", None)  # `import transformers` fails
    with pytest.raises(ImportError, match=r'transformers >= 5.7.*pip install "mok\[hf\]"'):
        hf.register()


def _hf_local_ids(idx: torch.Tensor, rank: int, num_local: int) -> torch.Tensor:
    """transformers' EpRouterParallel on global ids: the rank's local ids, num_local elsewhere."""
    mine = idx // num_local == rank
    return torch.where(mine, idx % num_local, torch.full_like(idx, num_local))


@pytest.mark.parametrize("ranks", [1, 2, 4, 8])
def test_local_routing_keeps_this_ranks_slots_and_zeroes_the_others(ranks):
    num_experts, k, n = 8, 4, 200
    g = torch.Generator().manual_seed(ranks)
    idx = torch.rand(n, num_experts, generator=g).argsort(dim=1)[:, :k]
    w = torch.rand(n, k, generator=g, dtype=torch.float64)
    num_local = num_experts // ranks
    for rank in range(ranks):
        local = _hf_local_ids(idx, rank, num_local)
        wr = w.clone().requires_grad_(True)
        got_idx, got_w = hf.local_routing(local, wr, num_local)
        assert got_idx.shape == (n, min(k, num_local)) and got_idx.dtype == torch.int64
        assert int(got_idx.min()) >= 0 and int(got_idx.max()) < num_local
        assert (got_idx.sort(dim=1).values.diff(dim=1) > 0).all(), "ids repeat within a token"
        for t in range(n):  # this rank's (id, weight) pairs survive as they were, no other
            want = {
                (int(e), float(v)) for e, v in zip(local[t], w[t], strict=True) if e < num_local
            }
            pairs = zip(got_idx[t], got_w[t].detach(), strict=True)
            have = {(int(e), float(v)) for e, v in pairs if v}
            assert have == want, f"token {t}"
        got_w.sum().backward()
        assert torch.equal(wr.grad, (local < num_local).double())  # zero on the others' slots


# ---- tiny models on the CPU -----------------------------------------------------------------

VOCAB, SEQ, BATCH = 96, 16, 2


def _model(family: str, seed: int = 0, dtype=torch.float32, **kw):
    """A tiny model of ``family`` from a config (seeded random init; no download)."""
    from transformers import AutoModelForCausalLM, Qwen2MoeConfig, Qwen3MoeConfig

    shape = {
        "vocab_size": VOCAB,
        "hidden_size": 64,
        "intermediate_size": 96,
        "moe_intermediate_size": 32,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "max_position_embeddings": 64,
        "initializer_range": 0.1,  # activations well above rounding (0.02 hides the experts)
    }
    shape.update(kw)
    if family == "qwen2_moe":
        config = Qwen2MoeConfig(shared_expert_intermediate_size=48, **shape)
    else:
        config = Qwen3MoeConfig(**shape)
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config, dtype=dtype)


def _ids(seed: int = 1, batch: int = BATCH, seq: int = SEQ, vocab: int = VOCAB) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (batch, seq), generator=g)


def _step(model, ids, impl: str) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """(logits, loss, {name: grad}) of one forward and backward with experts ``impl``."""
    model.set_experts_implementation(impl)
    model.zero_grad(set_to_none=True)
    out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    return out.logits.detach(), out.loss.detach(), grads


def _assert_close(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    """Within tol.HF_FP32_RTOL of the tensor's scale (max |want|)."""
    err = tol.max_abs_err(got, want)
    bound = tol.HF_FP32_RTOL * want.abs().max().item() + tol.FP32_ATOL * 1e-2
    assert err <= bound, f"{what}: error {err:.3e} > {bound:.3e}"


@pytest.fixture(scope="module")
def mok_registered():
    if _FOUND is None or _FOUND < hf.MIN_TRANSFORMERS:
        pytest.skip("needs HF transformers >= 5.7")
    return hf.register()


@needs_hf
@pytest.mark.parametrize("family", ["qwen3_moe", "qwen2_moe"])
@pytest.mark.parametrize("own", ["grouped_mm", "eager"])
def test_logits_and_every_gradient_match_transformers(mok_registered, family, own):
    """``own``: transformers' default experts implementation (grouped_mm) and its loop."""
    model = _model(family)
    ids = _ids()
    want_logits, want_loss, want = _step(model, ids, own)
    got_logits, got_loss, got = _step(model, ids, "mok")
    assert model.config._experts_implementation == "mok"
    _assert_close(got_logits, want_logits, "logits")
    _assert_close(got_loss, want_loss, "loss")
    assert got.keys() == want.keys()
    experts = [n for n in want if "experts.gate_up_proj" in n or "experts.down_proj" in n]
    assert len(experts) == 4 and all(want[n].abs().max() > 0 for n in experts)
    for name, g in want.items():
        _assert_close(got[name], g, name)


@needs_hf
@pytest.mark.parametrize("family", ["qwen3_moe", "qwen2_moe"])
def test_sgd_steps_follow_transformers(mok_registered, family):
    steps, lr = 4, 0.5
    losses = {}
    for impl in ("grouped_mm", "mok"):
        model = _model(family, seed=3)
        model.set_experts_implementation(impl)
        opt = torch.optim.SGD(model.parameters(), lr=lr)
        ids = _ids(seed=4)
        run = []
        for _ in range(steps):
            opt.zero_grad(set_to_none=True)
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            opt.step()
            run.append(loss.detach())
        losses[impl] = torch.stack(run)
    assert losses["mok"][-1] < losses["mok"][0], "the loss does not go down"
    _assert_close(losses["mok"], losses["grouped_mm"], "losses")


@needs_hf
def test_a_saved_checkpoint_loads_with_mok(mok_registered, tmp_path):
    from transformers import AutoModelForCausalLM

    model = _model("qwen3_moe", seed=5)
    ids = _ids(seed=6)
    model.set_experts_implementation("eager")
    want = model(input_ids=ids).logits.detach()
    model.save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path, experts_implementation="mok")
    assert loaded.config._experts_implementation == "mok"
    _assert_close(loaded(input_ids=ids).logits.detach(), want, "logits")


@needs_hf
@pytest.mark.parametrize("ranks", [2, 4])
def test_transformers_expert_parallelism_sums_to_the_whole_layer(mok_registered, ranks):
    """Each rank's experts module as transformers' expert parallelism leaves it (its slice of the
    experts, ``num_experts`` local, local ids with "not on this rank" ones) runs with "mok"; the
    ranks' outputs and input gradients add up to the unsharded layer's under transformers' own
    loop, and each rank's weight gradients are its slice of the whole ones. At 4 ranks a rank
    holds 2 experts for top-4 routing (mok's routing is cut to 2). Where transformers keeps its
    ``ep_router`` hook as 5.17 does, the local ids are checked against that hook too."""
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    try:
        from transformers.distributed.tensor_parallel import EpRouterParallel
    except ImportError:  # later releases moved expert parallelism to transformers.distributed
        EpRouterParallel = None

    num_experts, k, n, hidden = 8, 4, 40, 32
    config = Qwen3MoeConfig(
        hidden_size=hidden, moe_intermediate_size=16, num_experts=num_experts,
        num_experts_per_tok=k, experts_implementation="eager",
    )  # fmt: skip
    torch.manual_seed(7)
    whole = Qwen3MoeExperts(config)
    with torch.no_grad():
        whole.gate_up_proj.normal_(0, 0.2)
        whole.down_proj.normal_(0, 0.2)
    x = torch.randn(n, hidden, requires_grad=True)
    scores, idx = torch.randn(n, num_experts).softmax(-1).topk(k, dim=-1)
    scores.requires_grad_(True)
    grad_out = torch.randn(n, hidden)
    want = whole(x, idx, scores)
    want.backward(grad_out)
    want_grads = [t.grad.clone() for t in (x, scores, whole.gate_up_proj, whole.down_proj)]

    num_local = num_experts // ranks
    router = SimpleNamespace(num_experts=num_experts)
    outs, d_x, d_scores = [], torch.zeros_like(x), torch.zeros_like(scores)
    for rank in range(ranks):
        local_idx = _hf_local_ids(idx, rank, num_local)
        if EpRouterParallel is not None:
            mesh = SimpleNamespace(get_local_rank=lambda r=rank: r, size=lambda: ranks)
            hook = EpRouterParallel().transform_output_post_forward(
                router, (None, scores.detach(), idx), mesh
            )
            assert torch.equal(hook[2], local_idx)
        part = copy.deepcopy(whole)
        part.config._experts_implementation = "mok"
        rows = slice(rank * num_local, (rank + 1) * num_local)
        part.gate_up_proj = torch.nn.Parameter(whole.gate_up_proj.detach()[rows].clone())
        part.down_proj = torch.nn.Parameter(whole.down_proj.detach()[rows].clone())
        part.num_experts = num_local
        xr = x.detach().clone().requires_grad_(True)
        # the hook zeroes the weights of the other ranks' slots too; "mok" does not rely on it
        sr = scores.detach().clone().requires_grad_(True)
        out = part(xr, local_idx, sr)
        out.backward(grad_out)
        outs.append(out.detach())
        d_x += xr.grad
        d_scores += sr.grad
        _assert_close(part.gate_up_proj.grad, want_grads[2][rows], f"rank {rank} d gate_up_proj")
        _assert_close(part.down_proj.grad, want_grads[3][rows], f"rank {rank} d down_proj")
    _assert_close(torch.stack(outs).sum(0), want.detach(), "output")
    _assert_close(d_x, want_grads[0], "d hidden_states")
    _assert_close(d_scores, want_grads[1], "d top_k_weights")


@needs_hf
def test_transformers_expert_parallelism_runs_with_mok(tmp_path):
    """transformers' own expert parallelism, two gloo ranks (torchrun): a checkpoint loaded with
    ``DistributedConfig(enable_expert_parallel=True)`` and "mok" gives each rank 4 of the 8
    experts of a top-6 model (mok's routing cut to 4); every rank checks the logits and every
    gradient against the unsharded model under transformers' own experts (:func:`_ep_worker`)."""
    pytest.importorskip("accelerate", reason="transformers' parallel loading needs accelerate")
    _model("qwen3_moe", seed=11, num_experts_per_tok=6).save_pretrained(tmp_path)
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    env = dict(os.environ, PYTHONPATH=path, OMP_NUM_THREADS="1")
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
        "-m", "tests.test_integrations_hf", str(tmp_path),
    ]  # fmt: skip
    p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    out = p.stdout + p.stderr
    assert p.returncode == 0, out[-6000:]
    for rank in range(2):
        assert f"rank {rank} of 2: mok ran 2 layers of 4 local experts" in out, out[-3000:]


def _ep_worker(checkpoint: str) -> None:
    """One torchrun rank of :func:`test_transformers_expert_parallelism_runs_with_mok`."""
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM
    from transformers.distributed import DistributedConfig
    from transformers.integrations.moe import ExpertsInterface

    forward, calls = hf.register(), []

    def counted(*args):
        calls.append(args[0].num_experts)
        return forward(*args)

    ExpertsInterface.register("mok", counted)
    ep = AutoModelForCausalLM.from_pretrained(
        checkpoint,
        distributed_config=DistributedConfig(enable_expert_parallel=True, tp_plan="auto"),
        experts_implementation="mok",
    )
    whole = AutoModelForCausalLM.from_pretrained(checkpoint, experts_implementation="eager")
    ids = _ids(seed=12)
    got, want = ep(input_ids=ids, labels=ids), whole(input_ids=ids, labels=ids)
    got.loss.backward()
    want.loss.backward()

    def full(t: torch.Tensor) -> torch.Tensor:
        return t.full_tensor() if hasattr(t, "full_tensor") else t

    _assert_close(full(got.logits).detach(), want.logits.detach(), "logits")
    named = dict(whole.named_parameters())
    for name, param in ep.named_parameters():
        _assert_close(full(param.grad), named[name].grad, name)
    rank, ranks = dist.get_rank(), dist.get_world_size()
    print(f"rank {rank} of {ranks}: mok ran {len(calls)} layers of {calls[0]} local experts")
    # the models hold the process group: released first, so that it ends inside
    # destroy_process_group and not at interpreter exit (mok/bench/lm.py says why)
    del ep, whole, got, want, named
    gc.collect()
    dist.destroy_process_group()


@needs_hf
def test_readme_snippet_runs():
    """README.md's "Use it in your model" HF snippet, as written."""
    text = (ROOT / "README.md").read_text()
    block = re.search(r"<!-- snippet: hf -->\s*```python\n(.*?)```\s*<!-- /snippet -->", text, re.S)
    assert block, "README.md has no <!-- snippet: hf --> python block"
    lines = [ln for ln in block.group(1).splitlines() if ln.strip()]
    assert 3 <= len([ln for ln in lines if not ln.startswith(("import", "from"))]) <= 8
    scope: dict = {}
    exec(compile(block.group(1), "README.md[snippet: hf]", "exec"), scope)
    model = scope["model"]
    assert model.config._experts_implementation == "mok"
    experts = model.model.layers[0].mlp.experts
    assert experts.gate_up_proj.grad is not None and experts.gate_up_proj.grad.abs().max() > 0


@needs_hf
def test_other_expert_layouts_are_refused(mok_registered):
    from transformers import GptOssConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

    config = GptOssConfig(
        hidden_size=64, intermediate_size=32, num_local_experts=4, num_experts_per_tok=2,
        num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, vocab_size=32,
    )  # fmt: skip
    experts = GptOssExperts(config)
    x, idx, w = torch.randn(3, 64), torch.tensor([[0, 1]] * 3), torch.full((3, 2), 0.5)
    with pytest.raises(MoKUnsupportedError, match=r"GptOssExperts has is_transposed=True"):
        mok_registered(experts, x, idx, w)


@needs_hf
def test_a_group_of_several_ranks_is_refused(monkeypatch):
    monkeypatch.setattr("mok.reference_layer.group_size", lambda group: 4)
    with pytest.raises(MoKUnsupportedError, match=r"group of 4 ranks.*global ids"):
        hf.register("mok-ep", group=object())


# ---- on a Hopper GPU: mok's kernels in bf16 ---------------------------------------------------

GPU_VOCAB, GPU_SEQ, GPU_BATCH = 512, 64, 4


def _gpu_models(seed: int = 0):
    """(fp64 CPU oracle, transformers' own in bf16 on CUDA, mok's in bf16 on CUDA): one bf16
    model (rounded once) in three copies. Layer 0 is the MoE layer, layer 1 dense: the one
    router sees the same bf16 inputs in both CUDA copies, so their routing is the same."""
    model = _model(
        "qwen3_moe", seed, hidden_size=512, intermediate_size=512, moe_intermediate_size=256,
        num_attention_heads=8, num_key_value_heads=4, num_experts=16, num_experts_per_tok=4,
        mlp_only_layers=[1], vocab_size=GPU_VOCAB, max_position_embeddings=GPU_SEQ,
        initializer_range=0.05,
    ).to(torch.bfloat16)  # fmt: skip
    oracle = copy.deepcopy(model).double()
    oracle.set_experts_implementation("eager")
    own = copy.deepcopy(model).cuda()
    own.set_experts_implementation("grouped_mm")
    ours = copy.deepcopy(model).cuda()
    ours.set_experts_implementation("mok")
    return oracle, own, ours


def _run(model, ids) -> tuple[torch.Tensor, dict]:
    model.zero_grad(set_to_none=True)
    out = model(input_ids=ids.to(model.device), labels=ids.to(model.device))
    out.loss.backward()
    grads = {n: p.grad.detach().cpu().double() for n, p in model.named_parameters()}
    return out.logits.detach().cpu().double(), grads


@pytest.mark.gpu
@pytest.mark.sm90
@pytest.mark.parametrize(
    "options",
    [{}, {"fused": True}, {"recompute": False}],
    ids=["unfused", "fused", "saved"],
)
def test_gpu_bf16_logits_and_gradients_under_the_bf16_rule(options, fresh_workspaces):
    hf.register("mok", **options)
    try:
        oracle, own, ours = _gpu_models()
        ids = _ids(seed=8, batch=GPU_BATCH, seq=GPU_SEQ, vocab=GPU_VOCAB)
        want_logits, want = _run(oracle, ids)
        ref_logits, ref = _run(own, ids)
        got_logits, got = _run(ours, ids)
        tol.assert_bf16_rule(got_logits, ref_logits, want_logits)
        for name, g in want.items():
            try:
                tol.assert_bf16_rule(got[name], ref[name], g)
            except AssertionError as e:
                raise AssertionError(f"{name}: {e}") from None
    finally:
        hf.register("mok")  # the defaults again for the other tests


@pytest.mark.gpu
@pytest.mark.sm90
def test_gpu_training_loop_follows_transformers_under_the_bf16_rule(fresh_workspaces):
    """Eight SGD steps on one batch: the losses of mok's bf16 model against an fp64 CPU run of
    transformers' own experts, with transformers' own bf16 run as the rule's reference (the loss
    is one number per step: the rule's one-bf16-ulp floor applies)."""
    hf.register("mok")
    steps, lr = 8, 0.5
    ids = _ids(seed=9, batch=GPU_BATCH, seq=GPU_SEQ, vocab=GPU_VOCAB)
    losses = {}
    for name, model in zip(("oracle", "own", "ours"), _gpu_models(seed=1), strict=True):
        opt = torch.optim.SGD(model.parameters(), lr=lr)
        run = []
        for _ in range(steps):
            opt.zero_grad(set_to_none=True)
            loss = model(input_ids=ids.to(model.device), labels=ids.to(model.device)).loss
            loss.backward()
            opt.step()
            run.append(loss.detach().cpu().double())
        losses[name] = torch.stack(run)
    assert torch.isfinite(losses["ours"]).all() and losses["ours"][-1] < losses["ours"][0]
    tol.assert_bf16_rule(losses["ours"], losses["own"], losses["oracle"])


if __name__ == "__main__":  # a torchrun rank of test_transformers_expert_parallelism_runs_with_mok
    _ep_worker(sys.argv[1])
