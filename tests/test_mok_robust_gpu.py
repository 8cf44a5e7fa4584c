"""Robustness of the kernels' host path on one GPU (EP1, no process group): zero and varying
token counts on one workspace, recovery after bad routing, too many tokens, freeing memory.

Every output is checked against the reference (BF16 rule). The fused layer's output for a token
does not depend on the other tokens of the call (every sum runs in a fixed order, tile by
tile), so there a smaller call must also equal, bitwise, the same tokens' rows of a larger one.
The unfused path's torch GEMMs choose their kernels by the row count, so it is held to the rule
only."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

import mok  # noqa: E402
from mok import functional as mf  # noqa: E402
from mok import sizing  # noqa: E402
from mok.spec.workload import ModelShape  # noqa: E402
from reference.moe import moe_forward as ref_moe_forward  # noqa: E402
from tests import tolerances as tol  # noqa: E402
from tests.layer_problem import layer_problem  # noqa: E402
from tests.marks import LAYER_PATHS, hopper  # noqa: E402

# Every test runs where mok's kernels build; the fused layer's cases need sm_90 (hopper()).
pytestmark = [pytest.mark.gpu, pytest.mark.kernels, pytest.mark.usefixtures("fresh_workspaces")]

SEED = 1234
SHAPE = ModelShape("robust", 16, 512, 256, 4, shared_intermediate=256)
# (dispatch, combine, fused) paths of the layer.
PATHS = LAYER_PATHS


@pytest.fixture(scope="module")
def problem():
    return layer_problem(SHAPE, 700, SEED)


def _cfg(dm: str, cm: str, **kw) -> mok.MoKConfig:
    kw.setdefault("num_comm_sms", 8)
    kw.setdefault("minibatch_size", 256)
    return mok.MoKConfig(dispatch_mode=dm, combine_mode=cm, wait_timeout_ms=10_000.0, **kw)


def _layer(w, x, idx, tw, cfg, fused):
    out = mf.moe_forward(x, idx, tw, w, SHAPE.num_experts, cfg, fused=fused)
    torch.cuda.synchronize()
    return out


def _check_rule(out, w, x, idx, tw):
    oracle = ref_moe_forward(x.double(), idx, tw.double(), w.to(torch.float64), torch.float64)
    ref_b = ref_moe_forward(x, idx, tw, w, torch.bfloat16)
    tol.assert_bf16_rule(out.cpu(), ref_b.cpu(), oracle.cpu())


@pytest.mark.parametrize("dm,cm,fused", PATHS)
def test_zero_tokens_return_empty_outputs(problem, dm, cm, fused):
    w, x, idx, tw = problem
    cfg = _cfg(dm, cm, max_tokens=512)
    out = _layer(w, x[:0], idx[:0], tw[:0], cfg, fused)
    assert out.shape == (0, SHAPE.hidden) and out.dtype == torch.bfloat16
    # The same workspace serves a call with tokens right after, and zero again.
    out = _layer(w, x[:300], idx[:300], tw[:300], cfg, fused)
    _check_rule(out, w, x[:300], idx[:300], tw[:300])
    assert _layer(w, x[:0], idx[:0], tw[:0], cfg, fused).shape == (0, SHAPE.hidden)
    assert len(mok.cached_workspaces()) == 1


def test_zero_tokens_every_stage_function(problem):
    w, x, idx, tw = problem
    H = SHAPE.hidden
    ws = mok.get_workspace(0, H, SHAPE.num_topk, SHAPE.num_experts, config=_cfg("pull", "push"))
    assert ws.max_tokens == sizing.DEFAULT_MAX_TOKENS  # max_tokens=0: the default size
    s = mf.build_schedule(idx[:0], tw[:0], ws)
    assert s.num_tokens == 0 and s.dst_rank.shape == (0, SHAPE.num_topk)
    for mode in ("pull", "push", "dedup_pull"):
        mf.dispatch(x[:0], s, mode)
    dd = mf.dispatch(x[:0], s, "dedup_pull", fan_out=False)
    mf.fanout(dd, s)
    y = torch.zeros(ws.capacity, H, dtype=torch.bfloat16, device="cuda")
    for mode in ("push", "pull"):
        assert mf.combine(y, s, mode, dedup=False).shape == (0, H)
    assert mf.combine(y, s, "push", dedup=True).shape == (0, H)
    mf.dedup_partials(y, s)
    assert mf.dedup_sum(s, torch.zeros(0, H, device="cuda")).shape == (0, H)
    ws.check()
    host = s.to_host()
    assert int(host["tokens_per_expert"].sum()) == 0 and host["src_rank"].numel() == 0


@pytest.mark.parametrize("dm,cm,fused", PATHS)
def test_twenty_token_counts_one_workspace(problem, dm, cm, fused):
    w, x, idx, tw = problem
    N = x.shape[0]
    cfg = _cfg(dm, cm, max_tokens=N)
    full = _layer(w, x, idx, tw, cfg, fused)
    _check_rule(full, w, x, idx, tw)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    counts = [0, 1, 2, 3, 17, 63, 64, 65, 127, 128, 129, 255, 333, 400, 511, 512, 513, 640, 699]
    counts.append(N)
    assert len(set(counts)) == 20
    for n in counts:
        out = _layer(w, x[:n], idx[:n], tw[:n], cfg, fused)
        assert out.shape == (n, SHAPE.hidden)
        if fused:
            assert torch.equal(out, full[:n]), f"{n} tokens differ from the first {n} rows"
        elif n in (1, 129, 640):
            _check_rule(out, w, x[:n], idx[:n], tw[:n])
        del out
    torch.cuda.synchronize()
    assert len(mok.cached_workspaces()) == 1
    # The workspace allocated nothing per call (only the outputs came and went).
    assert torch.cuda.memory_allocated() <= before


@pytest.mark.parametrize("fused", [hopper(True), False])
def test_max_tokens_then_too_many_tokens_raise_and_recover(problem, fused):
    w, x, idx, tw = problem
    cfg = _cfg("dedup_pull", "push", max_tokens=300)
    first = _layer(w, x[:300], idx[:300], tw[:300], cfg, fused)
    (ws,) = mok.cached_workspaces()
    assert ws.max_tokens == 300
    less = _layer(w, x[:100], idx[:100], tw[:100], cfg, fused)
    if fused:
        assert torch.equal(less, first[:100])
    else:
        _check_rule(less, w, x[:100], idx[:100], tw[:100])
    too_many = "rank 0 passed 301 tokens but the workspace holds at most 300 per rank"
    with pytest.raises(mok.MoKCapacityError, match=too_many):
        _layer(w, x[:301], idx[:301], tw[:301], cfg, fused)
    again = _layer(w, x[:300], idx[:300], tw[:300], cfg, fused)
    assert torch.equal(again, first)


def _bad_routings(idx):
    E = SHAPE.num_experts
    out_of_range = idx.clone()
    out_of_range[5, 2] = E
    repeated = idx.clone()
    repeated[7, 1] = repeated[7, 0]
    wrapped = idx.clone()
    wrapped[9, 3] = 2**32 + 3  # int64 id that int32 would wrap to 3
    return [
        (out_of_range, f"token 5 \\(k=2\\) to expert {E} outside"),
        (repeated, "token 7 \\(k=1\\) to expert .* twice"),
        (wrapped, "token 9 \\(k=3\\) to expert 2147483647 outside"),
    ]


def _bad_call(w, x, bad, tw, cfg, fused) -> bool:
    """One layer call with bad routing; True if it raised the error itself (the unfused path
    can see the device's report at one of its later launches)."""
    try:
        mf.moe_forward(x, bad, tw, w, SHAPE.num_experts, cfg, fused=fused)
    except mok.MoKInputError:
        return True
    return False


@pytest.mark.parametrize("dm,cm,fused", PATHS)
def test_bad_routing_raises_then_the_next_call_works(problem, dm, cm, fused):
    w, x, idx, tw = problem
    n = 400
    x, idx, tw = x[:n], idx[:n], tw[:n]
    cfg = _cfg(dm, cm, max_tokens=n)
    good = _layer(w, x, idx, tw, cfg, fused)
    (ws,) = mok.cached_workspaces()
    for bad, msg in _bad_routings(idx):
        # mok.check() right after the bad call attributes the error to it.
        if not _bad_call(w, x, bad, tw, cfg, fused):
            with pytest.raises(mok.MoKInputError, match=msg) as e:
                mok.check()
            assert "has recovered" in str(e.value)
        assert torch.equal(_layer(w, x, idx, tw, cfg, fused), good)
        # Without a check: once the GPU got past the bad call, the next mok call raises its
        # error (before launching anything) and the one after runs normally.
        if not _bad_call(w, x, bad, tw, cfg, fused):
            torch.cuda.synchronize()
            with pytest.raises(mok.MoKInputError, match=msg):
                _layer(w, x, idx, tw, cfg, fused)
        assert torch.equal(_layer(w, x, idx, tw, cfg, fused), good)
        mok.check()
    assert len(mok.cached_workspaces()) == 1


@pytest.mark.sm90
def test_capacity_overflow_raises_then_the_next_call_works(problem):
    w, x, idx, tw = problem
    # 0.25 * 512 * 4 rows plus the padding allowance: any 128 tokens fit, 512 tokens on the same
    # four experts (2048 rows) do not.
    n, m = 128, 512
    cfg = _cfg("pull", "push", capacity_factor=0.25, row_tile=64, max_tokens=m)
    good = _layer(w, x[:n], idx[:n], tw[:n], cfg, True)
    _check_rule(good, w, x[:n], idx[:n], tw[:n])
    hot = torch.arange(SHAPE.num_topk, device="cuda").repeat(m, 1)  # every token on 4 experts
    with pytest.raises(mok.MoKCapacityError, match="never drops tokens"):
        # Raised by the layer call itself once the GPU got there first, else by the check.
        mf.moe_forward(x[:m], hot, tw[:m], w, SHAPE.num_experts, cfg, fused=True)
        mok.check()
    assert torch.equal(_layer(w, x[:n], idx[:n], tw[:n], cfg, True), good)


@pytest.mark.sm90
def test_clear_workspaces_frees_memory(problem):
    w, x, idx, tw = problem
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    _layer(w, x, idx, tw, _cfg("dedup_pull", "push"), True)
    _layer(w, x, idx, tw, _cfg("pull", "pull"), False)
    assert len(mok.cached_workspaces()) == 2
    assert torch.cuda.memory_allocated() > base
    mok.clear_workspaces()
    assert mok.cached_workspaces() == []
    assert torch.cuda.memory_allocated() <= base


def test_writing_tokens_into_the_x_buffer_after_wait_x_free(problem):
    w, x, idx, tw = problem
    n, K = 300, SHAPE.num_topk
    cfg = _cfg("pull", "push", max_tokens=n)
    ws = mok.get_workspace(n, SHAPE.hidden, K, SHAPE.num_experts, config=cfg)
    for step in range(3):
        xs = torch.roll(x[:n], shifts=step, dims=0)
        ws.wait_x_free()  # the previous dispatch's readers are done
        ws.x_buffer[:n].copy_(xs)
        s = mf.build_schedule(idx[:n], tw[:n], ws)
        recv = mf.dispatch(ws.x_buffer[:n], s, "pull")
        mok.check()
        h = s.to_host()
        real = (h["src_rank"] >= 0).nonzero().squeeze(1)
        want = xs[(h["src_index"][real] // K).cuda()]
        assert torch.equal(recv[real.cuda()], want), step


@pytest.mark.sm90
def test_a_refused_kernel_launch_raises_with_its_shape():
    """A launcher that refuses its arguments raises RuntimeError naming the kernel and the shape
    (formatting that message once crashed the process), and the next call works."""
    from mok import _ext, record

    ext = _ext.load()
    stream = torch.cuda.current_stream().cuda_stream
    with pytest.raises(RuntimeError, match=r"weight-gradient kernel \(16 rows, 100 x 256"):
        # m not a multiple of 128; then the 5 gather words (none) and the transposed switch
        ext.launch_wgrad(0, 0, 0, 0, 16, 100, 256, 1, 0, *([0] * 5), 0, 1, stream)
    with pytest.raises(RuntimeError, match=r"experts' backward kernel \(0 rows, hidden 512"):
        # 11 operand words, the 5 gather words, the mode, then the shape (0 rows)
        ext.launch_swiglu_bwd(*([0] * 11), *([0] * 5), 0, 0, 512, 256, 1, 1, stream)
    params = record.record_for(torch.device("cuda")).params()
    with pytest.raises(RuntimeError, match=r"fused experts' backward \(0 rows, hidden 512"):
        # 18 operand words, the shape, the 13 transfer words (grad_out .. off_row_grads), then
        # the staged-d_a and transposed dW_gate_up switches
        ext.launch_bwd_fused(params, *([0] * 18), 0, 512, 256, 1, *([0] * 15), 1, stream)
    w, x, idx, tw = layer_problem(SHAPE, 64, SEED)
    _check_rule(_layer(w, x, idx, tw, _cfg("pull", "push"), False), w, x, idx, tw)
