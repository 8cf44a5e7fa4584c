"""The workspace's host logic without a GPU: one workspace per layer shape and config for any
token count, its size, the cache bound, and the recovery after an input error the device
reported (epochs back to the state right after the failing schedule build)."""

from __future__ import annotations

import pytest
import torch

import mok
from mok import _ext, sizing, workspace
from mok.errors import MoKCapacityError, MoKInputError, MoKTimeoutError
from tests.test_ep_rank_counts import fake_group  # noqa: F401 - fixture

H, K, E = 512, 4, 16


class _Recorder:
    """Stands in for Workspace in get_workspace: records how it was built (one rank)."""

    built: list = []
    checked: list = []

    def __init__(self, shapes, config, group, device, fused=False):
        self.shapes, self.config, self.num_ranks = shapes, config, 1
        self.id = len(_Recorder.built)
        _Recorder.built.append(shapes)

    @property
    def max_tokens(self) -> int:
        return self.shapes.max_tokens

    def check(self) -> None:  # the device synchronised, pending errors raised
        _Recorder.checked.append(self.id)


GPU_MEMORY = 80 * 2**30


@pytest.fixture
def recorder(monkeypatch):
    monkeypatch.setattr(workspace, "Workspace", _Recorder)
    monkeypatch.setattr(workspace, "_cache", {})
    monkeypatch.setattr(workspace, "_device_memory", lambda device: GPU_MEMORY)
    _Recorder.built, _Recorder.checked = [], []
    return _Recorder


def _get(n, config=None):
    return mok.get_workspace(n, H, K, E, torch.bfloat16, config, device="cuda:0")


def test_a_small_first_call_does_not_cap_later_calls(recorder):
    """The first-call trap of max_tokens=0 is gone: the default size holds every later ordinary
    call, whatever came first (0, 1 or 777 tokens, or the largest first)."""
    for counts in ([0, 1, 777, 1024, 4096], [4096, 1024, 777, 1, 0]):
        workspace._cache.clear()
        ws = _get(counts[0])
        assert ws.max_tokens == sizing.DEFAULT_MAX_TOKENS
        for n in counts[1:]:
            assert _get(n) is ws
    assert len(recorder.built) == 2 and not recorder.checked


def test_a_first_call_above_the_default_sizes_the_workspace(recorder):
    ws = _get(10_000)
    assert ws.max_tokens == 10_000
    for n in [0, 1, 8192, 10_000]:
        assert _get(n) is ws


def test_one_rank_grows_when_a_call_passes_more(recorder):
    """At one rank a call with more tokens than the workspace holds replaces it by one at least
    twice as large (after raising the old one's errors), and it stays for smaller calls."""
    ws = _get(300)
    big = _get(sizing.DEFAULT_MAX_TOKENS + 1)
    assert big is not ws and big.max_tokens == 2 * sizing.DEFAULT_MAX_TOKENS
    assert recorder.checked == [ws.id]
    assert list(workspace._cache.values()) == [big]
    for n in [0, 1, 300, 2 * sizing.DEFAULT_MAX_TOKENS]:
        assert _get(n) is big
    huge = _get(5 * sizing.DEFAULT_MAX_TOKENS)
    assert huge.max_tokens == 5 * sizing.DEFAULT_MAX_TOKENS
    assert len(recorder.built) == 3


def test_no_growth_inside_a_cuda_graph_capture(recorder, monkeypatch):
    ws = _get(300)
    monkeypatch.setattr(workspace, "_capturing", lambda: True)
    assert _get(sizing.DEFAULT_MAX_TOKENS) is ws
    with pytest.raises(MoKCapacityError, match="cannot grow during a CUDA graph capture; set"):
        _get(sizing.DEFAULT_MAX_TOKENS + 1)
    assert list(workspace._cache.values()) == [ws] and not recorder.checked


def test_max_tokens_from_the_config_wins_and_never_grows(recorder):
    ws = _get(10, mok.MoKConfig(max_tokens=500))
    assert ws.max_tokens == 500
    other = _get(0)  # another config (the default): another workspace
    assert other is not ws and other.max_tokens == sizing.DEFAULT_MAX_TOKENS
    assert _get(0, mok.MoKConfig(max_tokens=500)) is ws
    # more than max_tokens: the device's error to report (MoKCapacityError), no growth
    assert _get(501, mok.MoKConfig(max_tokens=500)) is ws
    assert not recorder.checked


def test_the_default_shrinks_with_the_gpus_memory(recorder, monkeypatch):
    """8192 tokens per rank where the workspace takes at most 1/16 of the GPU's memory, halved
    until it does (never below MIN_DEFAULT_TOKENS); ranks sharing one GPU split it."""
    shape = (7168, 8, 256)  # DeepSeek-V3's hidden, top-k and experts
    cfg = mok.MoKConfig()

    def default(memory, ranks=1, per_gpu=1, fused=False):
        s = sizing.Shapes(0, *shape, torch.bfloat16)
        return sizing.default_max_tokens(s, cfg, ranks, fused, memory, per_gpu)

    def nbytes(n, ranks=1, fused=False):
        p = sizing.plan(sizing.Shapes(n, *shape, torch.bfloat16), cfg, ranks, fused)
        return p.sym_bytes + p.sched_bytes + p.dedup_bytes + (n * shape[0] * 2 if fused else 0)

    for memory in (8 * 2**30, 80 * 2**30, 141 * 2**30, 2**40):
        for ranks, per_gpu in ((1, 1), (8, 1), (4, 4)):
            for fused in (False, True):
                n = default(memory, ranks, per_gpu, fused)
                budget = memory // sizing.MEMORY_SHARE // per_gpu
                assert sizing.MIN_DEFAULT_TOKENS <= n <= sizing.DEFAULT_MAX_TOKENS
                assert n == sizing.MIN_DEFAULT_TOKENS or nbytes(n, ranks, fused) <= budget
                if n < sizing.DEFAULT_MAX_TOKENS:
                    assert nbytes(2 * n, ranks, fused) > budget
    assert default(2**40) == sizing.DEFAULT_MAX_TOKENS
    assert default(8 * 2**30) < sizing.DEFAULT_MAX_TOKENS
    assert default(80 * 2**30, 4, 4) < default(80 * 2**30, 4, 1)


def test_the_plan_is_what_the_workspace_allocates():
    """mok.sizing.plan's bytes are the workspace's memory_report (the README's table)."""
    cfg = mok.MoKConfig()
    p = sizing.plan(sizing.Shapes(777, H, K, E, torch.bfloat16), cfg, 2)
    assert p.capacity == cfg.capacity_rows(777, K, E // 2)
    assert p.sym_sizes["x"] == 777 * H * 2 and p.sym_sizes["recv"] == p.capacity * H * 2
    rows = min(2 * 777, p.capacity)  # a row per dedup row, then the partials index
    assert p.sym_sizes["partials"] == rows * H * 2 + 777 * K * 4 and p.dedup_bytes == rows * H * 2
    fused = sizing.plan(sizing.Shapes(777, H, K, E, torch.bfloat16), cfg, 2, fused=True)
    assert fused.sym_sizes["y"] == 0 and fused.sym_bytes < p.sym_bytes


def test_token_count_must_be_a_non_negative_int(recorder):
    for bad in (-1, 2.5, True, "8"):
        with pytest.raises(MoKInputError, match="num_tokens must be an int >= 0"):
            _get(bad)


def test_the_cache_is_bounded(recorder):
    for i in range(workspace.MAX_WORKSPACES):
        _get(64, mok.MoKConfig(num_comm_sms=1 + i))
    with pytest.raises(MoKInputError, match="the most it keeps; call mok.clear_workspaces"):
        _get(64, mok.MoKConfig(num_comm_sms=100))
    assert _get(64, mok.MoKConfig(num_comm_sms=3)) is not None  # cached ones still served


def _record(ws, code, epoch, observed=16, expected=16, extra=9):
    ws.error[:] = torch.tensor([code, 0, 0, observed, expected, ws.rank, epoch, extra])


def _schedule_build(ws, *families):
    """What ops.build_schedule does to the host state, then the bumps of later launches."""
    ws.advance("route")
    for f in families:
        ws.advance(f)


@pytest.mark.parametrize(
    "code,err,text",
    [
        (_ext.ERR_BAD_EXPERT, MoKInputError, "to expert 16 outside"),
        (_ext.ERR_DUP_EXPERT, MoKInputError, "twice"),
        (_ext.ERR_CAPACITY, MoKCapacityError, "never drops tokens"),
        (_ext.ERR_TOO_MANY_TOKENS, MoKCapacityError, "passed 16 tokens but the workspace"),
    ],
)
def test_input_errors_recover_to_the_state_after_the_failing_schedule(
    fake_group,  # noqa: F811
    code,
    err,
    text,
):
    ws = fake_group(2, 1, 64, H, K, E)
    _schedule_build(ws, "x", "slots")  # a good call
    _schedule_build(ws, "x")  # the bad call's schedule, then its dispatch
    failing = ws.epochs["route"]
    after = dict(ws.epochs, x=ws.epochs["x"] - 1)
    _schedule_build(ws, "slots", "layer")  # launched before the host saw the error
    _record(ws, code, failing)
    with pytest.raises(err, match=text) as e:
        ws.raise_if_failed()
    assert "has recovered and the next call runs normally" in str(e.value)
    assert ws.epochs == after
    assert ws.error.tolist() == [0] * 8 and ws.broken is None
    ws.raise_if_failed()  # nothing left to raise
    _schedule_build(ws, "x")
    assert ws.epochs["route"] == failing + 1


def test_timeouts_leave_the_workspace_broken(fake_group):  # noqa: F811
    ws = fake_group(2, 0, 64, H, K, E)
    _schedule_build(ws, "x")
    _record(ws, _ext.ERR_TIMEOUT, ws.epochs["x"], observed=0, expected=1)
    for _ in range(2):
        with pytest.raises(MoKTimeoutError, match="unusable now; call mok.clear_workspaces"):
            ws.raise_if_failed()


def test_an_error_older_than_the_kept_snapshots_is_not_recovered(fake_group):  # noqa: F811
    ws = fake_group(1, 0, 64, H, K, E)
    _schedule_build(ws)
    old = ws.epochs["route"]
    for _ in range(workspace._SNAPSHOTS):
        _schedule_build(ws)
    _record(ws, _ext.ERR_BAD_EXPERT, old)
    with pytest.raises(MoKInputError, match="unusable now"):
        ws.raise_if_failed()


class _Ext:
    """Stands in for the extension: records launches, refuses the ones it is told to."""

    def __init__(self):
        self.launched: list[int] = []
        self.refuse = False

    def launch(self, kind, params, grid, stream):
        if self.refuse:
            raise RuntimeError("mok: launching kernel failed: refused")
        self.launched.append(kind)


def test_an_epoch_advances_only_once_its_launch_went_through(fake_group, monkeypatch):  # noqa: F811
    from mok import ops

    ws = fake_group(2, 0, 64, H, K, E)
    ext = _Ext()
    ws._ext = ext
    monkeypatch.setattr(ws, "stream", lambda: 0)
    monkeypatch.setattr(ws, "raise_if_failed", lambda: None)
    idx = torch.zeros(64, K, dtype=torch.int32)
    w = torch.zeros(64, K)
    x = torch.zeros(64, H, dtype=torch.bfloat16)
    before = dict(ws.epochs)
    ext.refuse = True
    for call in (
        lambda: ops.build_schedule(idx, w, ws.sched, ws.id),
        lambda: ops.dispatch(x, ws.sched, x, ws.id, "pull"),
        lambda: ops.dispatch(x, ws.sched, x, ws.id, "push"),
        lambda: ops.dedup_partials(x, ws.sched, x, ws.id),
    ):
        with pytest.raises(RuntimeError, match="refused"):
            call()
    assert ws.epochs == before and not ws._snapshots
    ext.refuse = False
    ops.build_schedule(idx, w, ws.sched, ws.id)
    ops.dispatch(x, ws.sched, x, ws.id, "pull")
    assert ws.epochs == {**before, "route": 1, "x": 1}
    assert list(ws._snapshots) == [1]


def test_mok_ops_are_tagged_cudagraph_unsafe():
    from mok import ops

    if not hasattr(torch.Tag, "cudagraph_unsafe"):
        pytest.skip(f"torch {torch.__version__} has no cudagraph_unsafe tag")
    for name in ops.__all__:
        assert torch.Tag.cudagraph_unsafe in getattr(torch.ops.mok, name).default.tags, name


def test_a_fused_workspace_holds_only_what_the_fused_kernel_touches(fake_group):  # noqa: F811
    # DeepSeek-V3 at EP8, 131072 tokens per rank: the full workspace's symmetric allocation
    # against the fused layer's (no expert-output or partials buffers; default ring = every
    # receive row).
    R, N, H, K, E = 8, 131072, 7168, 8, 256
    full = fake_group(R, 7, N, H, K, E).memory_report()
    fused = fake_group(R, 7, N, H, K, E, fused=True).memory_report()
    assert fused["symmetric"]["y"] == fused["symmetric"]["partials"] == 0
    assert fused["symmetric"]["dy"] == 0 and full["symmetric"]["dy"] == N * H * 2
    assert full["symmetric"]["y"] == full["symmetric"]["recv"] > 0
    assert fused["symmetric"]["recv"] == full["symmetric"]["recv"]
    assert fused["symmetric"]["slots"] == full["symmetric"]["slots"] == N * K * H * 2
    assert 93e9 < full["total"]["symmetric"] < 95e9
    assert fused["total"]["symmetric"] < 0.52 * full["total"]["symmetric"]
    # A ring of two 4096-row minibatches: the receive buffer shrinks to the ring.
    ring = fake_group(
        R, 7, N, H, K, E, mok.MoKConfig(minibatch_size=4096, macrobatch_size=8192), fused=True
    )
    assert ring.memory_report()["symmetric"]["recv"] == 8192 * H * 2


def test_the_stage_functions_refuse_a_fused_workspace(fake_group):  # noqa: F811
    ws = fake_group(2, 0, 64, H, K, E, fused=True)
    for view in ("recv_buffer", "y_buffer", "partials_buffer"):
        with pytest.raises(MoKInputError, match="serves the fused layer only"):
            getattr(ws, view)


def test_the_last_dedup_sum_of_a_partials_epoch_releases_it(fake_group, monkeypatch):  # noqa: F811
    # Owners overwrite their partials once every rank said "consumed": only the releasing sum
    # says it, and nothing may read the partials after it.
    from mok import ops

    ws = fake_group(2, 0, 64, H, K, E)
    ws._ext = _Ext()
    monkeypatch.setattr(ws, "stream", lambda: 0)
    monkeypatch.setattr(ws, "raise_if_failed", lambda: None)
    y = torch.zeros(8, H, dtype=torch.bfloat16)
    out = torch.zeros(64, H, dtype=torch.bfloat16)
    with pytest.raises(MoKInputError, match="before any dedup_partials"):
        ops.dedup_sum(ws.sched, None, out, ws.id)
    ops.dedup_partials(y, ws.sched, y, ws.id)
    ops.dedup_sum(ws.sched, None, out, ws.id, "vector", False)
    ops.dedup_sum(ws.sched, None, out, ws.id, "tma", False)
    with pytest.raises(MoKInputError, match="end the previous sums with dedup_sum"):
        ops.dedup_partials(y, ws.sched, y, ws.id)
    ops.dedup_sum(ws.sched, None, out, ws.id, "vector", True)
    with pytest.raises(MoKInputError, match="run dedup_partials again"):
        ops.dedup_sum(ws.sched, None, out, ws.id, "vector", False)
    ops.dedup_partials(y, ws.sched, y, ws.id)
    ops.dedup_sum(ws.sched, None, out, ws.id)
    kinds = [_ext.KERNELS["dedup_partials"], _ext.KERNELS["dedup_sum"]]
    assert ws._ext.launched == [kinds[0], kinds[1], kinds[1], kinds[1], kinds[0], kinds[1]]


def test_wait_x_free_waits_for_the_last_pull_dispatch(fake_group, monkeypatch):  # noqa: F811
    from mok import ops

    ws = fake_group(2, 1, 64, H, K, E, mok.MoKConfig(num_comm_sms=12))
    seen = []
    monkeypatch.setattr(ws, "stream", lambda: 0)
    monkeypatch.setattr(ws, "raise_if_failed", lambda: None)
    monkeypatch.setattr(ws, "launch", lambda kind, p, grid: seen.append((kind, p.epoch, grid)))
    x = torch.zeros(64, H, dtype=torch.bfloat16)
    for _ in range(2):
        ops.dispatch(x, ws.sched, x, ws.id, "pull")
    ws.wait_x_free()
    # the last dispatch's epoch (its last block stores it into every peer's signal), one block
    assert seen[-1] == ("wait_x_free", 2, 1)
