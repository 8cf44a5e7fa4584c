"""mok.spec.arch on the CPU: which of mok's paths run at compute capability 9.0, 10.0, 10.3 and
12.0 (and before Hopper), decided in one place; the extension's build target, the fused layer's,
the expert kernels' and recompute=False's refusals all follow it; the README's table says the
same."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from mok import _ext, autograd, experts, fused
from mok.errors import MoKUnsupportedError
from mok.spec.arch import BUILD_TARGETS, arch_paths

ROOT = Path(__file__).resolve().parents[1]
# capability -> (build target, comm kernels, fused forward, expert kernels)
EXPECTED = {
    (9, 0): ("90a", True, True, True),
    (10, 0): ("100a", True, False, False),
    (10, 3): ("103a", True, False, False),
    (12, 0): (None, False, False, False),
    (8, 0): (None, False, False, False),
}


@pytest.mark.parametrize("cap", sorted(EXPECTED))
def test_the_paths_of_each_capability(cap):
    p = arch_paths(cap)
    assert (p.build, p.comm_kernels, p.fused_forward, p.expert_kernels) == EXPECTED[cap]
    assert p.name == f"sm_{cap[0]}{cap[1]}"
    assert p.describe().startswith(p.name)


@pytest.fixture
def gpu(monkeypatch):
    """A fake current GPU of the capability the test sets (no CUDA here)."""
    state = {"cap": (9, 0)}
    monkeypatch.delenv("MOK_CUDA_ARCH", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: state["cap"])
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "a test GPU")
    return state


@pytest.mark.parametrize("cap", sorted(EXPECTED))
def test_the_extension_builds_for_the_capabilitys_target_or_refuses(gpu, cap):
    gpu["cap"] = cap
    target = EXPECTED[cap][0]
    if target is not None:
        assert _ext.detect_arch() == target
        return
    with pytest.raises(MoKUnsupportedError) as e:
        _ext.detect_arch()
    msg = str(e.value)
    assert f"found sm_{cap[0]}{cap[1]} on a test GPU" in msg
    assert all(f"sm_{t}" in msg for t in BUILD_TARGETS.values()) and "device='cpu'" in msg


def test_mok_cuda_arch_forces_a_target(gpu, monkeypatch):
    gpu["cap"] = (12, 0)
    monkeypatch.setenv("MOK_CUDA_ARCH", "sm_90a")
    assert _ext.detect_arch() == "90a"


@pytest.mark.parametrize("cap", [(10, 0), (10, 3)])
def test_off_hopper_the_fused_layer_and_saving_refuse_and_say_what_runs(gpu, cap):
    gpu["cap"] = cap
    ws = SimpleNamespace(device=torch.device("cuda", 0))
    with pytest.raises(MoKUnsupportedError) as e:
        fused._check_fused(ws, None, None, 0)
    msg = str(e.value)
    assert (
        f"the fused layer has a Hopper (sm_90a) path only; this GPU is sm_{cap[0]}{cap[1]}" in msg
    )
    assert "dispatch / combine with torch's grouped GEMMs" in msg and "fused=False" in msg
    x = _FakeCuda(torch.empty(8, 256, dtype=torch.bfloat16, device="meta"))
    with pytest.raises(MoKUnsupportedError, match="Use recompute=True"):
        autograd._check_saving(x, None, fused=False, recompute=False)
    autograd._check_saving(x, None, fused=False, recompute=True)  # nothing kept: no refusal


class _FakeCuda:
    """A meta tensor that says it is on CUDA (the kernels' operand checks read only metadata)."""

    is_cuda = True
    device = torch.device("cuda", 0)

    def __init__(self, t: torch.Tensor):
        self._t = t

    def __getattr__(self, name):
        return getattr(self._t, name)


@pytest.mark.parametrize("cap", sorted(EXPECTED))
def test_the_expert_kernels_run_where_the_paths_say(gpu, cap):
    gpu["cap"] = cap

    def meta(*s):
        return _FakeCuda(torch.empty(*s, dtype=torch.bfloat16, device="meta"))

    a, wgu, wd = meta(256, 512), meta(4, 512, 512), meta(4, 512, 256)
    assert experts._kernel_fits(a, wgu, wd, a) == EXPECTED[cap][3]


def test_the_readme_lists_each_targets_paths():
    text = (ROOT / "README.md").read_text()
    for cap in BUILD_TARGETS:
        assert arch_paths(cap).describe() in text, arch_paths(cap).describe()


def test_gpu_tests_split_by_capability():
    """conftest's markers follow mok.spec.arch: ``kernels`` tests run on every GPU mok builds
    for, ``sm90`` ones on Hopper only; the fused and recompute=False cases carry ``sm90``."""
    from tests import test_mok_robust_gpu as robust
    from tests import test_mok_sizing_gpu as sizing
    from tests.conftest import _builds_for

    assert all(_builds_for(cap) for cap in BUILD_TARGETS)
    assert not _builds_for((12, 0)) and not _builds_for((8, 0)) and not _builds_for(None)

    def hopper_only(p) -> bool:
        return any(m.name == "sm90" for m in getattr(p, "marks", ()))

    def values(p):
        return p.values if hasattr(p, "values") else p

    for p in (*robust.PATHS, *sizing.FORWARD_PATHS):
        assert hopper_only(p) == values(p)[-1]  # fused
    for p in sizing.TRAIN_PATHS:
        fused, recompute = values(p)
        assert hopper_only(p) == (fused or not recompute)
