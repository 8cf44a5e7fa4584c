"""CPU contract of the mok API: config validation and JSON, import without CUDA, error text."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import mok
from mok import MoKConfig, MoKConfigError

ROOT = Path(__file__).resolve().parents[1]


def test_defaults_and_roundtrip(tmp_path):
    c = MoKConfig()
    assert (c.dispatch_mode, c.combine_mode, c.num_comm_sms, c.row_tile) == (
        "dedup_pull",
        "push",
        24,
        128,
    )
    p = tmp_path / "cfg.json"
    c2 = MoKConfig(dispatch_mode="pull", minibatch_size=1024, macrobatch_size=4096)
    c2.to_json(p)
    assert json.loads(p.read_text())["format"] == "mok-config/1"
    assert MoKConfig.from_json(p) == c2
    assert MoKConfig.from_json(c2.to_json()) == c2
    assert MoKConfig.from_json(c2.to_dict()) == c2


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"dispatch_mode": "scatter"}, "unknown dispatch_mode 'scatter'; supported: pull, push"),
        ({"combine_mode": "gather"}, "unknown combine_mode 'gather'"),
        ({"combine_mode": "pull"}, "dedup_pull' pairs with the dedup push combine"),
        ({"num_comm_sms": 0}, r"num_comm_sms must be in \[1, 1024\] \(found 0\)"),
        ({"num_comm_sms": 2.5}, "num_comm_sms must be an int"),
        ({"row_tile": 96}, "row_tile must be a positive power of two"),
        ({"minibatch_size": 100}, "minibatch_size must be a positive multiple of row_tile=128"),
        ({"macrobatch_size": 6144}, "macrobatch_size must be >= minibatch_size=4096"),
        ({"capacity_factor": 0}, "capacity_factor must be > 0"),
        ({"wait_timeout_ms": float("nan")}, "wait_timeout_ms must be a finite number"),
    ],
)
def test_validation_messages(kwargs, match):
    with pytest.raises(MoKConfigError, match=match):
        MoKConfig(**kwargs)


def test_json_errors_name_keys():
    with pytest.raises(MoKConfigError, match=r"unknown MoKConfig keys \['num_sm'\]; supported: "):
        MoKConfig.from_json({"format": "mok-config/1", "config": {"num_sm": 3}})
    with pytest.raises(MoKConfigError, match="config format 'sim/2' is not supported"):
        MoKConfig.from_json({"format": "sim/2", "config": {}})
    with pytest.raises(MoKConfigError, match=r"unknown top-level keys \['extra'\]"):
        MoKConfig.from_json({"format": "mok-config/1", "config": {}, "extra": 1})


def test_capacity_rows():
    c = MoKConfig(capacity_factor=1.0, row_tile=128)
    assert c.capacity_rows(100, 8, 4) == 1408  # 800 + 4 * 127 = 1308 -> 11 tiles
    # the factor capped at the number of ranks (R ranks' rows are the most one rank receives)
    d = MoKConfig(capacity_factor=2.0, row_tile=128)
    assert d.capacity_rows(100, 8, 4, num_ranks=1) == 1408  # one rank: its own 800 rows
    assert d.capacity_rows(100, 8, 4, num_ranks=2) == d.capacity_rows(100, 8, 4) == 2176
    assert d.capacity_rows(100, 8, 4, num_ranks=8) == 2176


def test_import_never_touches_cuda():
    code = (
        "import sys, mok, mok.functional, mok.ops, mok.workspace, mok.bench.comm\n"
        "assert 'mok._ext' not in sys.modules or mok._ext._module is None\n"
        "import torch; assert not torch.cuda.is_initialized()\n"
        "print('ok')\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0 and "ok" in out.stdout, out.stderr


def test_unsupported_without_gpu_is_clear(monkeypatch):
    import torch

    from mok import _ext

    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    monkeypatch.delenv("MOK_CUDA_ARCH", raising=False)
    with pytest.raises(mok.MoKUnsupportedError, match="need a CUDA GPU .*torch .*CUDA .*nvcc"):
        _ext.detect_arch()


def test_exports():
    for name in ("MoKConfig", "MoKTimeoutError", "MoKCapacityError", "MoKInputError"):
        assert hasattr(mok, name)
    assert issubclass(mok.MoKTimeoutError, mok.MoKError)


def test_custom_ops_trace_with_fake_tensors():
    # torch.compile traces through the fake implementations; make_fx in fake mode does the same
    # without a GPU and never runs a kernel. Each mutating op must appear in the graph.
    import torch
    from torch.fx.experimental.proxy_tensor import make_fx

    import mok.ops  # noqa: F401  (registers the mok:: ops)

    def layer(x, idx, w, sched, recv, y, partials, out):
        torch.ops.mok.build_schedule(idx, w, sched, 0)
        torch.ops.mok.dispatch(x, sched, recv, 0, "dedup_pull")
        torch.ops.mok.fanout(recv, sched, recv, 0)
        torch.ops.mok.combine(y, sched, idx, w, None, out, 0, "push")
        torch.ops.mok.dedup_partials(y, sched, partials, 0)
        torch.ops.mok.dedup_sum(sched, None, out, 0)
        wg = torch.zeros(2, 128, h).bfloat16()
        wd = torch.zeros(2, h, 128).bfloat16()
        none3 = (None, None, None)
        torch.ops.mok.layer_forward(x, sched, w, wg, wg, wd, *none3, out, None, None, 0, None)
        # the experts' backward kernels (gate/up as one [L, 2I, H] tensor)
        gu = torch.zeros(2, 256, h).bfloat16()
        rows = recv.shape[0]
        ends = torch.zeros(2, dtype=torch.int32)
        hw, dgu = torch.zeros(rows, 128).bfloat16(), torch.zeros(rows, 256).bfloat16()
        part = torch.zeros(1, rows)
        torch.ops.mok.swiglu_backward_sm90(recv, recv, gu, wd, ends, None, hw, dgu, part, None, 0)
        torch.ops.mok.wgrad_sm90(dgu, recv, ends, gu.transpose(1, 2).contiguous())
        # the transposed form (dW_gate_up as x^T dgu into [L, 2I, H]), and the gathering op
        torch.ops.mok.wgrad_sm90(recv, dgu, ends, gu, False, True)
        src = torch.zeros(rows, dtype=torch.int32)
        torch.ops.mok.wgrad_gather_sm90(dgu, x, src, k, 0, ends, gu, False, True)
        return out

    n, h, k = 8, 64, 2
    args = (
        torch.randn(n, h).bfloat16(),
        torch.zeros(n, k, dtype=torch.int32),
        torch.rand(n, k),
        torch.zeros(1024, dtype=torch.int32),
        torch.zeros(64, h).bfloat16(),
        torch.zeros(64, h).bfloat16(),
        torch.zeros(2 * n, h).bfloat16(),
        torch.zeros(n, h).bfloat16(),
    )
    gm = make_fx(layer, tracing_mode="fake")(*args)
    called = {str(nd.target) for nd in gm.graph.nodes if nd.op == "call_function"}
    ops = ("build_schedule", "dispatch", "fanout", "combine", "dedup_partials", "dedup_sum")
    for op in (*ops, "layer_forward", "swiglu_backward_sm90", "wgrad_sm90", "wgrad_gather_sm90"):
        assert any(f"mok.{op}" in c for c in called), (op, called)


def test_functional_takes_the_tuner_json(tmp_path):
    # mok-sim tune --emit-config writes this file; mok.functional accepts it directly.
    from mok.functional import as_config

    cfg = MoKConfig(dispatch_mode="pull", num_comm_sms=12, minibatch_size=2048)
    path = tmp_path / "mok-config.json"
    cfg.to_json(path)
    assert as_config(path) == cfg
    assert as_config(str(path)) == cfg
    assert as_config(cfg.to_dict()) == cfg
    assert as_config(cfg) is cfg
    assert as_config(None) == MoKConfig()


def test_auto_engine_follows_the_row_size():
    from types import SimpleNamespace

    from mok.comm import _engine

    assert _engine(SimpleNamespace(row_bytes=7168 * 2), "auto") == "tma"
    assert _engine(SimpleNamespace(row_bytes=2048 * 2), "auto") == "vector"
    assert _engine(SimpleNamespace(row_bytes=2048 * 2), "tma") == "tma"
    with pytest.raises(mok.MoKInputError, match="supported: auto, tma, vector"):
        _engine(SimpleNamespace(row_bytes=4096), "fast")


@pytest.mark.filterwarnings("ignore:.*Profiler clears events")
def test_eager_calls_skip_the_dispatcher_but_keep_its_bookkeeping():
    # Eager calls run the op body directly (host time) and still bump the mutated tensors'
    # version counters; fake tensors go through the registered op and its fake implementation.
    from torch._subclasses.fake_tensor import FakeTensorMode

    from mok.ops import _mok_op

    seen = []

    @_mok_op("mok_test::touch", ("b",))
    def touch(a: torch.Tensor, b: torch.Tensor, h: int) -> None:
        seen.append("body")

    @touch.register_fake
    def _(a, b, h) -> None:
        seen.append("fake")

    def dispatched(fn) -> bool:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            fn()
        return any(e.name == "mok_test::touch" for e in prof.events())

    a, b = torch.zeros(2), torch.zeros(2)
    v = b._version
    assert not dispatched(lambda: touch(a, b, 1))
    assert b._version == v + 1 and seen == ["body"]
    assert dispatched(lambda: touch.op(a, b, 1))
    with FakeTensorMode() as mode:
        touch(mode.from_tensor(a), mode.from_tensor(b), 1)
    assert seen[-1] == "fake"


def test_unfused_path_gives_every_sm_to_communication_and_pads_little():
    from mok.functional import UNFUSED_ROW_TILE, unfused_config

    cfg = MoKConfig(num_comm_sms=16, row_tile=128, minibatch_size=4096)
    got = unfused_config(cfg, 132)
    assert (got.num_comm_sms, got.row_tile) == (132, UNFUSED_ROW_TILE)
    assert got.minibatch_size == cfg.minibatch_size  # everything else is the caller's
    assert unfused_config(cfg, 148).num_comm_sms == 148  # a B200: every SM (no 132 cap)
    small = MoKConfig(num_comm_sms=16, row_tile=8, minibatch_size=4096)
    assert unfused_config(small, 132).row_tile == 8  # never padded more than asked
    assert unfused_config(got, 132) is got
