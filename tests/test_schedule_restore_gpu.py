"""The backward at one rank restores the forward's schedule (``mok.autograd.RESTORE_SCHEDULE``,
``mok.schedule.restore_schedule``) on real GPUs: a restore after another layer's build is that
build (tables, routing weights, and the next builds still meet their route signal); a training
step gives every gradient bitwise with the switch on and off, with one schedule kernel instead of
two where the forward is unfused (recomputing, from kept g / u, the gathered backward at I = 256)
and two with the fused forward; two layers on one workspace, their backwards after both
forwards; at EP2 (ranks on one GPU) the backward still builds. tests/test_schedule_restore.py
checks the host side on the CPU."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from mok import _ext, ops
from mok.spec.workload import ModelShape, make_routing
from tests.dist.launch import torchrun
from tests.test_mok_autograd_gpu import CASES, WEIGHTS, _inputs, _mok_grads

ROUTE = _ext.SIGNALS.index("route_ready")
# the gathered backward's shape: I = 256 (GATHER_BACKWARD "auto" gathers there), H and I
# multiples of 256
GATHER = (ModelShape("gather-256", 32, 1024, 256, 8), 700, "uniform")


@pytest.fixture
def builds(monkeypatch):
    """The schedule kernel's launches (mok.ops.build_schedule calls), recorded."""
    calls = []
    inner = ops.build_schedule

    def counted(*args, **kwargs):
        calls.append(1)
        return inner(*args, **kwargs)

    monkeypatch.setattr(ops, "build_schedule", counted)
    return calls


def _route_signal(ws) -> int:
    signals = ws.sym_view("signals", torch.int64, (_ext.NUM_SIGNALS, _ext.MAX_RANKS))
    return int(signals[ROUTE, ws.rank].item())


def _host(s) -> dict[str, torch.Tensor]:
    """What a backward reads of a schedule, on the host: the trimmed tables, the fan-out rows,
    the receive rows' routing weights (of the schedule's route epoch)."""
    n, k = s.num_tokens, s.ws.shapes.num_topk
    got = s.to_host()
    got.pop("fanout")  # read by the fused forward only: not kept
    got["fan_rows"] = s.ws.sched_view("fan_rows", n * k).cpu()
    got["num_rows"] = s.num_rows.cpu()
    got["row_weights"] = s.row_weights().cpu()
    return got


@pytest.mark.gpu
@pytest.mark.kernels
@pytest.mark.usefixtures("fresh_workspaces")
def test_a_restore_after_another_build_is_the_build(builds):
    """Forward A, forward B (another routing) on one workspace, then A's tables back: every
    table a backward reads and the receive rows' routing weights are those of a build of A in
    its place, without the schedule kernel; the route signal counts the epochs, so the builds
    after it (A, B, A again) meet their signal (no timeout)."""
    import mok
    from mok import functional as mf
    from mok.schedule import restore_schedule

    n, hidden, k, e = 777, 1024, 8, 64
    ws = mok.get_workspace(n, hidden, k, e, torch.bfloat16, mok.MoKConfig(row_tile=16))
    routing = []
    for seed, skew in ((1, "uniform"), (2, "hot:0.5")):
        t = make_routing(n, e, k, 1, skew, seed=seed)
        routing.append(
            (torch.from_numpy(t.topk_idx).cuda(), torch.from_numpy(t.topk_weights).cuda())
        )
    a, b = routing
    saved = mf.build_schedule(*a, ws).save()
    mf.build_schedule(*b, ws)
    before = len(builds)
    got = _host(restore_schedule(saved, *a, ws))
    assert len(builds) == before, "the restore ran the schedule kernel"
    assert _route_signal(ws) == ws.epochs["route"]
    want = _host(mf.build_schedule(*a, ws))
    for name, t in want.items():
        assert torch.equal(got[name], t), name
    for r in (b, a):
        mf.build_schedule(*r, ws)
    ws.check()
    assert _route_signal(ws) == ws.epochs["route"]


def _switched(monkeypatch, builds, on: bool, run):
    """``run()`` with mok.autograd.RESTORE_SCHEDULE ``on``: (its result, schedule kernels)."""
    import mok.autograd as ma

    monkeypatch.setattr(ma, "RESTORE_SCHEDULE", on)
    before = len(builds)
    got = run()
    return got, len(builds) - before


STEPS = [  # (case, fused forward, recompute)
    (CASES[0], False, True),
    (CASES[0], False, False),
    (CASES[1], False, True),  # no shared expert, hot routing (empty experts)
    (CASES[1], False, False),
    (GATHER, False, True),
    (GATHER, False, False),
    (CASES[0], True, True),
    (CASES[0], True, False),
]
STEP_IDS = [f"{c[0].name}-{'fused' if f else 'unfused'}-{'recompute' if r else 'saved'}"
            for c, f, r in STEPS]  # fmt: skip


@pytest.mark.gpu
@pytest.mark.sm90
@pytest.mark.usefixtures("fresh_workspaces")
@pytest.mark.parametrize(("case", "fused", "recompute"), STEPS, ids=STEP_IDS)
def test_a_training_step_gives_the_same_bits(case, fused, recompute, builds, monkeypatch):
    """The output and every gradient (x, routing weights, routed and shared weights) bitwise
    with the switch on and off; on, the unfused forward's step runs one schedule kernel (the
    backward restores), the fused forward's two (its schedule is not the backward's). At I = 256
    the backward reads its rows from the tokens (the gathered backward), both ways."""
    import mok.autograd as ma

    shape, n, skew = case
    x, idx, tw, w, grad_out = _inputs(shape, n, skew, seed=17)
    gathered = []
    if case is GATHER:
        inner = ma.swiglu_backward_gathered

        def counted(*args, **kwargs):
            gathered.append(1)
            return inner(*args, **kwargs)

        monkeypatch.setattr(ma, "swiglu_backward_gathered", counted)

    def step():
        return _mok_grads(shape, x, idx, tw, w, grad_out, fused=fused, recompute=recompute)

    (out1, on), n_on = _switched(monkeypatch, builds, True, step)
    (out0, off), n_off = _switched(monkeypatch, builds, False, step)
    assert (n_on, n_off) == ((2, 2) if fused else (1, 2))
    assert len(gathered) == (2 if case is GATHER else 0), "the gathered backward did not run"
    assert torch.equal(out1, out0)
    for name, g in off.items():
        assert g is not None and torch.equal(on[name], g), f"{name} differs with the restore"
    import mok

    mok.check()


@pytest.mark.gpu
@pytest.mark.sm90
@pytest.mark.usefixtures("fresh_workspaces")
@pytest.mark.parametrize("recompute", [True, False])
@pytest.mark.parametrize("stacked", [False, True])
def test_two_layers_on_one_workspace(stacked, recompute, builds, monkeypatch):
    """Two layers of one shape and config share a workspace: forward A, forward B, then B's
    backward and A's (``stacked``: B on A's output, autograd's order; else two graphs, B's
    backward called first). Each backward restores its own forward's tables: the same bits as
    building them again, two schedule kernels for the four calls instead of four."""
    import mok
    from mok import functional as mf

    shape, n, _ = CASES[0]
    x, idx_a, tw_a, w_a, g_a = _inputs(shape, n, "uniform", seed=5)
    x_b, idx_b, tw_b, w_b, g_b = _inputs(shape, n, "hot:0.5", seed=6)
    cfg = mok.MoKConfig(num_comm_sms=16, minibatch_size=1024)

    def leaves(w):
        return dataclasses.replace(
            w, **{k: v.detach().clone().requires_grad_(True) for k, v in vars(w).items()
                  if v is not None}
        )  # fmt: skip

    def run():
        la, lb = leaves(w_a), leaves(w_b)
        xa = x.clone().requires_grad_(True)
        ta, tb = tw_a.clone().requires_grad_(True), tw_b.clone().requires_grad_(True)
        ya = mf.moe(xa, idx_a, ta, la, shape.num_experts, cfg, recompute=recompute)
        xb = ya if stacked else x_b.clone().requires_grad_(True)
        yb = mf.moe(xb, idx_b, tb, lb, shape.num_experts, cfg, recompute=recompute)
        yb.backward(g_b)
        if not stacked:
            ya.backward(g_a)
        got = {"ya": ya.detach(), "yb": yb.detach(), "dxa": xa.grad, "dta": ta.grad,
               "dtb": tb.grad}  # fmt: skip
        if not stacked:
            got["dxb"] = xb.grad
        for tag, lw in (("a", la), ("b", lb)):
            got.update({f"{g}_{tag}": getattr(lw, k).grad for g, k in WEIGHTS.items()
                        if getattr(lw, k) is not None})  # fmt: skip
        return got

    on, n_on = _switched(monkeypatch, builds, True, run)
    off, n_off = _switched(monkeypatch, builds, False, run)
    mok.check()
    assert (n_on, n_off) == (2, 4)
    assert len(mok.cached_workspaces()) == 1, "the two layers did not share a workspace"
    for name, t in off.items():
        assert t is not None and torch.equal(on[name], t), f"{name} differs with the restore"


@pytest.mark.gpu
@pytest.mark.sm90
def test_at_ep2_the_backward_builds_again():
    """Two ranks on one GPU (tests/dist/train_worker.py --schedule-restore): with peers the
    backward builds its schedule again with the switch on (two schedule kernels a step), on a
    group of one rank it restores (one); every result bitwise the switch off's."""
    torchrun(
        "train_worker.py", 2, "MOK-TRAIN-OK", "--schedule-restore", timeout=900, shared_gpu=True
    )
