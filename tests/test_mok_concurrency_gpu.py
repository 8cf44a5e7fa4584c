"""How a call starts and ends, on one GPU (EP1): CUDA-graph capture is refused with a clear
error, a call that fails at its launch leaves the workspace as it was, and an abort in the
middle of the fused kernel raises instead of hanging, every time: faults injected at one tile
(its dependency wait fails, or its wait for a free pipeline stage sees an abort after the tile's
first stage went out), at row tiles 128 and 64, with the ring wrapping around."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

import mok  # noqa: E402
from mok import functional as mf  # noqa: E402
from mok.spec.workload import ModelShape  # noqa: E402
from tests.layer_problem import layer_problem  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.sm90, pytest.mark.usefixtures("fresh_workspaces")]

ROOT = Path(__file__).resolve().parents[1]
SEED = 99
SHAPE = ModelShape("conc", 16, 512, 256, 4, shared_intermediate=256)
PATHS = [("pull", True), ("dedup_pull", True), ("pull", False), ("push", False)]


@pytest.fixture(scope="module")
def problem():
    return layer_problem(SHAPE, 600, SEED)


def _cfg(dm: str, **kw) -> mok.MoKConfig:
    return mok.MoKConfig(dispatch_mode=dm, num_comm_sms=8, minibatch_size=256, **kw)


def _layer(problem, cfg, fused, x=None):
    w, x0, idx, tw = problem
    out = mf.moe_forward(x0 if x is None else x, idx, tw, w, SHAPE.num_experts, cfg, fused=fused)
    mok.check()
    return out


@pytest.mark.parametrize("dm,fused", PATHS)
def test_cuda_graph_capture_is_refused_and_leaves_the_workspace_usable(problem, dm, fused):
    cfg = _cfg(dm)
    eager = _layer(problem, cfg, fused)  # creates the workspace outside the capture
    w, x, idx, tw = problem
    g = torch.cuda.CUDAGraph()
    refused = pytest.raises(mok.MoKUnsupportedError, match="cannot be captured in a CUDA graph")
    with refused, torch.cuda.graph(g):
        mf.moe_forward(x, idx, tw, w, SHAPE.num_experts, cfg, fused=fused)
    torch.cuda.synchronize()
    assert torch.equal(_layer(problem, cfg, fused), eager)
    x2 = x.flip(0).contiguous()
    again = _layer(problem, cfg, fused, x2)
    assert not torch.equal(again, eager)  # new inputs give new outputs, eagerly


class _FailingExt:
    """The extension, with its `which`-th launch refused (as a launch error would be)."""

    def __init__(self, ext, which: int):
        self._ext, self.calls, self.which = ext, 0, which

    def __getattr__(self, name):
        return getattr(self._ext, name)

    def _maybe_fail(self):
        self.calls += 1
        if self.calls == self.which:
            raise RuntimeError("mok: launching kernel failed: injected launch error")

    def launch(self, *args):
        self._maybe_fail()
        return self._ext.launch(*args)

    def launch_layer(self, *args):
        self._maybe_fail()
        return self._ext.launch_layer(*args)


@pytest.mark.parametrize("dm,fused", PATHS)
@pytest.mark.parametrize("which", [1, 2, 3])
def test_a_call_that_fails_at_launch_leaves_the_workspace_as_it_was(problem, dm, fused, which):
    # A short timeout: a wait for a signal that never comes would show up in seconds.
    cfg = _cfg(dm, wait_timeout_ms=2000.0)
    good = _layer(problem, cfg, fused)
    (ws,) = mok.cached_workspaces()
    ext = ws._ext
    ws._ext = _FailingExt(ext, which)
    try:
        _layer(problem, cfg, fused)
        failed = False
    except RuntimeError as e:
        assert "injected launch error" in str(e)
        failed = True
    ws._ext = ext
    assert failed or which == 3  # the fused call has two launches (schedule, layer)
    for _ in range(3):
        assert torch.equal(_layer(problem, cfg, fused), good)


_FAULT_SCRIPT = textwrap.dedent(
    """
    import torch
    import mok
    from mok import functional as mf
    from mok.spec.workload import ModelShape, make_routing
    from reference.weights import MoEWeights

    shape = ModelShape("fault", 16, 512, 256, 4, shared_intermediate=256)
    w = MoEWeights.random(shape, seed=7, dtype=torch.float32, device="cuda").to(torch.bfloat16)
    t = make_routing(600, 16, 4, 1, "hot:0.5", seed=7)
    x = torch.randn(600, 512, device="cuda").to(torch.bfloat16)
    idx = torch.from_numpy(t.topk_idx).cuda()
    tw = torch.from_numpy(t.topk_weights).cuda()
    for rep in range(3):
        for row_tile, mb in ((128, 256), (64, 256), (64, 128)):
            for tile, mode in ((0, 0), (13, 1), (30, 0), (61, 1), (90, 1), (25, 1)):
                cfg = mok.MoKConfig(num_comm_sms=8, minibatch_size=mb, macrobatch_size=mb,
                                    row_tile=row_tile, wait_timeout_ms=3000.0)
                ref = mf.moe_forward(x, idx, tw, w, 16, cfg, fused=True)
                mok.check()
                (ws,) = mok.cached_workspaces()
                ws.fault = (tile, mode)
                try:
                    mf.moe_forward(x, idx, tw, w, 16, cfg, fused=True)
                    mok.check()
                    raise SystemExit(f"no error for a fault at tile {tile}")
                except mok.MoKTimeoutError as e:
                    assert "fault injected" in str(e), e
                mok.clear_workspaces()
                again = mf.moe_forward(x, idx, tw, w, 16, cfg, fused=True)
                mok.check()
                assert torch.equal(again, ref), (row_tile, tile, mode)
                mok.clear_workspaces()
        print(f"repeat {rep} ok", flush=True)
    print("FAULT-OK", flush=True)
    """
)


def test_an_abort_mid_kernel_raises_instead_of_hanging():
    # Under a watchdog: a hang would be a kernel that never returns, so the process is killed.
    try:
        p = subprocess.run(
            [sys.executable, "-c", _FAULT_SCRIPT],
            cwd=ROOT,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
            capture_output=True,
            text=True,
            timeout=240,
        )
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"the fused layer hung after an injected fault: {e.stdout}{e.stderr}")
    out = p.stdout + p.stderr
    assert p.returncode == 0 and "FAULT-OK" in out, out[-4000:]
