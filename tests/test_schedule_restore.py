"""The forward's schedule kept for its backward (``mok.schedule``: ``DeviceSchedule.save``,
``restore_schedule``) without a GPU: which tables a copy holds and their sizes, and a restore
on a one-rank workspace in CPU memory after another layer's build, against a build of the same
routing by a stand-in for the schedule kernel (the tables of ``reference.schedule``, the route
weights and the route signal as the kernel writes them at one rank). Then the switch's routing
through ``mok.autograd`` with the layer's forward and backward stood in.
tests/test_schedule_restore_gpu.py runs the real kernels."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from mok import _ext, ops, workspace
from mok.errors import MoKInputError
from mok.schedule import (
    UNSAVED_TABLES,
    DeviceSchedule,
    build_schedule,
    restore_schedule,
    saved_tables,
)
from mok.sizing import Shapes, plan
from mok.spec.config import MoKConfig
from mok.spec.workload import make_routing
from reference.schedule import build_schedule as reference_schedule

N, H, K, E = 48, 64, 4, 8  # max_tokens 48; calls of fewer tokens
CFG = MoKConfig(row_tile=16, minibatch_size=256)
ROUTE = _ext.SIGNALS.index("route_ready")


def _shapes_ws(n: int, num_topk: int, num_experts: int, cfg: MoKConfig = CFG):
    """What saved_tables reads of a one-rank workspace of ``n`` tokens, from its plan."""
    shapes = Shapes(n, 1536, num_topk, num_experts, torch.bfloat16)
    p = plan(shapes, cfg, 1)
    return SimpleNamespace(
        shapes=shapes, config=cfg, num_ranks=1, capacity=p.capacity, num_local_experts=num_experts
    ), p


def test_every_table_of_the_plan_is_saved_or_named_unsaved():
    """A table added to the workspace's plan fails here until it is either copied or named in
    UNSAVED_TABLES with the reason a backward does not need it back."""
    ws, p = _shapes_ws(N, K, E)
    saved = [name for name, _ in saved_tables(ws, N)]
    assert len(set(saved)) == len(saved)
    assert not set(saved) & set(UNSAVED_TABLES)
    assert set(saved) | set(UNSAVED_TABLES) == {name for name, _ in p.sched_sizes}


@pytest.mark.parametrize(
    ("n", "num_topk", "num_experts", "total"),
    [(24576, 8, 128, 4_243_472), (32768, 8, 128, 5_652_496), (32768, 4, 64, 3_022_864)],
)
def test_the_copy_at_sonicmoes_shapes(n, num_topk, num_experts, total):
    """The bytes docs/perf-notes.md quotes: the receive-row tables up to the host's row bound
    (n K rows and each region's padding to the unfused path's 16-row tile), n K words of each
    (token, k) table, one dedup row per token; each inside its table."""
    ws, p = _shapes_ws(n, num_topk, num_experts)
    tables = dict(saved_tables(ws, n))
    rows = n * num_topk + num_experts * 15
    assert tables["src_rank"] == tables["src_index"] == rows
    assert tables["dst_index"] == tables["fan_rows"] == n * num_topk
    assert tables["dedup_slot"] == n and tables["meta"] == 2
    assert 4 * sum(tables.values()) == total
    sizes = dict(p.sched_sizes)
    for name, words in tables.items():
        assert words <= sizes[name], name


def test_the_copy_of_a_smaller_call_and_a_smaller_receive_buffer():
    """Tokens below max_tokens copy their own rows only; a receive buffer below the host bound
    (capacity_factor < 1) caps the receive-row tables at its capacity."""
    ws, _ = _shapes_ws(1000, 8, 64)
    tables = dict(saved_tables(ws, 100))
    assert tables["dst_rank"] == 800 and tables["dedup_src_token"] == 100
    assert tables["src_rank"] == 800 + 64 * 15
    small = MoKConfig(row_tile=16, capacity_factor=0.5)
    ws, _ = _shapes_ws(1000, 8, 64, small)
    assert dict(saved_tables(ws, 1000))["src_rank"] == ws.capacity < 8000 + 64 * 15


# ---- a one-rank workspace in CPU memory -----------------------------------------------------


@pytest.fixture
def cpu_ws(monkeypatch):
    """``make()``: a real one-rank Workspace (N tokens, CFG) whose buffers are CPU tensors; the
    CUDA calls of its constructor are no-ops. ``make.built``: the routing of every build the
    stand-in schedule kernel ran."""
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
    props = SimpleNamespace(multi_processor_count=132)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda *a, **k: props)
    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda self, *a, **k: self)
    monkeypatch.setattr(_ext, "load", lambda: SimpleNamespace(host_device_pointer=lambda p: 0))
    built: list[torch.Tensor] = []

    def kernel(idx, w, sched, handle):
        built.append(idx.clone())
        _fake_build(workspace.workspace_by_id(handle), idx, w)

    monkeypatch.setattr(ops, "build_schedule", kernel)

    def make():
        shapes = Shapes(N, H, K, E, torch.bfloat16)
        return workspace.Workspace(shapes, CFG, None, torch.device("cpu"))

    make.built = built
    return make


def _fake_build(ws, idx: torch.Tensor, w: torch.Tensor) -> None:
    """What the schedule kernel writes at one rank (csrc/common/schedule_kernel.cuh), from the
    reference table: every table (the scratch ones with noise), the routing in its parity of
    the route buffers, the route signal; then the host's epoch bookkeeping."""
    n = idx.shape[0]
    epoch = ws.epochs["route"] + 1
    if not ws.sched_view("meta", _ext.META_WORDS)[_ext.META["abort"]]:
        ref = reference_schedule(idx.long()[None], E, 0, row_tile=CFG.row_tile)
        P, D = int(ref.offsets[-1]), len(ref.dedup_slot)
        g = torch.Generator().manual_seed(epoch)

        def put(name, values):
            values = values.reshape(-1)
            ws.sched_view(name, values.numel()).copy_(values.to(torch.int32))

        put("counts", ref.counts.reshape(-1))  # [E, 1] at one rank
        put("offsets", ref.offsets)
        for name in ("src_rank", "src_index", "fanout", "dst_rank", "dst_index"):
            put(name, getattr(ref, name))
        for name in ("dedup_src_rank", "dedup_src_token", "dedup_slot"):
            put(name, getattr(ref, name))
        # dedup row d = token d here, its fan-out in k order: the (token, k) receive rows
        put("fan_rows", ref.dst_index)
        put("fan_w", w.view(torch.int32))
        put("hist", torch.randint(0, 99, (ws.num_chunks * E,), generator=g))
        put("dhist", torch.randint(0, 99, (ws.num_chunks,), generator=g))
        put("dcount", torch.tensor([D]))
        put("meta", torch.tensor([P, D]))
        nk = n * K
        route = ws.sym_view("route_idx", torch.int32, (2, 1, N * K))
        route[epoch & 1, 0, :nk] = idx.reshape(-1)
        ws.sym_view("route_w", torch.float32, (2, 1, N * K))[epoch & 1, 0, :nk] = w.reshape(-1)
        _signals(ws)[ROUTE, 0] += 1
    ws.advance("route")


def _signals(ws) -> torch.Tensor:
    return ws.sym_view("signals", torch.int64, (_ext.NUM_SIGNALS, _ext.MAX_RANKS))


def _routing(n: int, seed: int, skew: str = "uniform"):
    t = make_routing(n, E, K, 1, skew, seed=seed)
    return torch.from_numpy(t.topk_idx).long(), torch.from_numpy(t.topk_weights).float()


def _views(s: DeviceSchedule) -> dict[str, torch.Tensor]:
    """Every view a backward reads, cloned, and the receive rows' routing weights."""
    P = int(s.num_rows.item())
    return {
        "counts": s.counts_all.clone(),
        "offsets": s.offsets.clone(),
        "src_rank": s.src_rank[:P].clone(),
        "src_index": s.src_index[:P].clone(),
        "dst_rank": s.dst_rank.clone(),
        "dst_index": s.dst_index.clone(),
        "dedup_src_rank": s.dedup_src_rank[: s.num_tokens].clone(),
        "dedup_src_token": s.dedup_src_token[: s.num_tokens].clone(),
        "dedup_slot": s.dedup_slot[: s.num_tokens].clone(),
        "fan_rows": s.ws.sched_view("fan_rows", s.num_tokens * K).clone(),
        "dcount": s.ws.sched_view("dcount", 1).clone(),
        "num_rows": s.num_rows.clone(),
        "num_dedup_rows": s.num_dedup_rows.clone(),
        "row_weights": s.row_weights(),
        "topk_idx": s.topk_idx.clone(),
        "topk_weights": s.topk_weights.clone(),
    }


def test_a_restore_after_another_build_is_the_build(cpu_ws):
    """Forward A, forward B on the same workspace, then A's tables back: every view a backward
    reads (the tables, the receive rows' routing weights from the new epoch's route weights)
    and the device and host state after it (the route signal counts the epochs, the epoch's
    snapshot kept) are those of a build of A's routing in its place, and the stand-in kernel
    did not run."""
    ws = cpu_ws()
    a, b = _routing(40, 1), _routing(33, 2, "hot:0.5")
    saved = build_schedule(*a, ws).save()
    build_schedule(*b, ws)
    unsaved = {name: ws.sched_view(name, 64).clone() for name in UNSAVED_TABLES}
    route_idx = ws.sym_view("route_idx", torch.int32, (2 * N * K,)).clone()
    before = len(cpu_ws.built)
    got = restore_schedule(saved, *a, ws)
    assert len(cpu_ws.built) == before, "the restore ran the schedule kernel"
    assert got.route_epoch == ws.epochs["route"] == 3
    assert ws._snapshots[3] == ws.epochs
    assert int(_signals(ws)[ROUTE, 0]) == 3
    restored = _views(got)
    for name, t in unsaved.items():  # the restore leaves them as they were
        assert torch.equal(ws.sched_view(name, 64), t), name
    assert torch.equal(ws.sym_view("route_idx", torch.int32, (2 * N * K,)), route_idx)
    want = _views(build_schedule(*a, ws))
    assert int(_signals(ws)[ROUTE, 0]) == ws.epochs["route"] == 4
    for name, t in want.items():
        assert torch.equal(restored[name], t), name
    assert restored["row_weights"].count_nonzero() == 40 * K


def test_the_restored_weights_go_into_the_new_epochs_half(cpu_ws):
    """The route weights are double-buffered by epoch parity: the restore writes A's into the
    half of its new epoch and leaves B's (the epoch before) in the other."""
    ws = cpu_ws()
    a, b = _routing(40, 3), _routing(40, 4)
    saved = build_schedule(*a, ws).save()
    sb = build_schedule(*b, ws)
    b_weights = sb.row_weights()
    got = restore_schedule(saved, *a, ws)
    halves = ws.sym_view("route_w", torch.float32, (2, N * K))
    assert torch.equal(halves[got.route_epoch & 1, : 40 * K], a[1].reshape(-1))
    assert torch.equal(halves[sb.route_epoch & 1, : 40 * K], b[1].reshape(-1))
    assert not torch.equal(got.row_weights(), b_weights)


def test_an_aborted_workspace_gets_no_route_signal(cpu_ws):
    """With the abort word set (an earlier kernel failed, not yet raised) a build returns before
    its signal; a restore then adds none either, so the counter stays at the signalled builds
    that the host's recovery rolls back to."""
    ws = cpu_ws()
    a = _routing(40, 5)
    saved = build_schedule(*a, ws).save()
    ws.sched_view("meta", _ext.META_WORDS)[_ext.META["abort"]] = 1
    restore_schedule(saved, *a, ws)
    assert ws.epochs["route"] == 2 and int(_signals(ws)[ROUTE, 0]) == 1


def test_a_recorded_input_error_is_raised_as_a_build_raises_it(cpu_ws):
    """An error the saved build recorded (bad routing) is raised by the restore, and the
    workspace recovers to the state after that build, as at a build."""
    ws = cpu_ws()
    a = _routing(40, 6)
    saved = build_schedule(*a, ws).save()
    failing = ws.epochs["route"]
    ws.error.copy_(torch.tensor([_ext.ERR_BAD_EXPERT, 0, 0, 99, E, 0, failing, 5]))
    with pytest.raises(MoKInputError, match="has recovered"):
        restore_schedule(saved, *a, ws)
    assert ws.epochs["route"] == failing


def test_a_copy_that_does_not_apply_builds(cpu_ws):
    """No copy, a copy of another workspace or of another token count: the schedule kernel
    runs; a copy of no tokens, or at more ranks, is not taken."""
    ws, other = cpu_ws(), cpu_ws()
    a = _routing(40, 7)
    saved = build_schedule(*a, ws).save()
    for copy, idx, tw, into in (
        (None, *a, ws),
        (saved, *a, other),
        (saved, a[0][:39], a[1][:39], ws),
    ):
        before = len(cpu_ws.built)
        restore_schedule(copy, idx, tw, into)
        assert len(cpu_ws.built) == before + 1
    assert build_schedule(a[0][:0], a[1][:0], ws).save() is None
    s = build_schedule(*a, ws)
    s.ws.num_ranks = 2  # as a rank of two
    assert s.save() is None


def test_the_copy_holds_its_own_memory(cpu_ws):
    """The copy is its own tensor: later builds do not change it."""
    ws = cpu_ws()
    saved = build_schedule(*_routing(40, 8), ws).save()
    data = saved.data.clone()
    build_schedule(*_routing(48, 9), ws)
    assert torch.equal(saved.data, data)
    assert saved.data.numel() == sum(words for _, words in saved.tables)


# ---- the switch in mok.autograd --------------------------------------------------------------


@pytest.fixture
def stand_ins(monkeypatch):
    """mok.autograd's forward and backward stood in on CPU tensors: the forward hands out a
    schedule whose save() gives a token, the backward records the copy it got."""
    import mok.autograd as ma

    seen = {"lists": [], "copies": []}

    class _Schedule:
        def save(self):
            return "copy"

    def forward(x, *args, _saved=None, _schedule=None):
        seen["lists"].append(_schedule)
        if _schedule is not None:
            _schedule.append(_Schedule())
        return 2 * x

    def backward(grad_out, x, idx, tw, routed, shared, *rest):
        seen["copies"].append(rest[-1])
        zeros = [None if t is None else torch.zeros_like(t) for t in (*routed, *shared)]
        return (2 * grad_out, torch.zeros_like(tw), *zeros)

    monkeypatch.setattr(ma, "moe_forward", forward)
    monkeypatch.setattr(ma, "_backward", backward)
    return seen


@pytest.mark.parametrize(("switch", "fused", "copy"), [
    (True, False, "copy"), (False, False, None), (True, True, None),
])  # fmt: skip
def test_the_switch_keeps_the_unfused_forwards_schedule_for_the_backward(
    stand_ins, monkeypatch, switch, fused, copy
):
    """RESTORE_SCHEDULE on and the unfused forward: the forward asks for its schedule and the
    backward gets its copy; switched off, or the fused forward (its schedule is not the
    backward's): nothing asked, nothing kept."""
    import mok.autograd as ma

    monkeypatch.setattr(ma, "RESTORE_SCHEDULE", switch)
    x = torch.randn(5, 8, dtype=torch.float64, requires_grad=True)
    idx, tw = torch.zeros(5, 2, dtype=torch.int64), torch.rand(5, 2, dtype=torch.float64)
    w = torch.randn(2, 4, 8, dtype=torch.float64)
    leaves = [w, w.clone(), w.transpose(1, 2).clone(), None, None, None]
    out = ma._MoE.apply(idx, None, 2, None, None, fused, True, None, x, tw, *leaves)
    out.backward(torch.ones_like(out))
    assert (stand_ins["lists"][0] is not None) == (copy is not None)
    assert stand_ins["copies"] == [copy]
    assert torch.equal(x.grad, torch.full_like(x, 2.0))
