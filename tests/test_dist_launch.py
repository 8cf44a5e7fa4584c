"""tests/dist/launch.py's memory guard for ranks sharing one GPU (nvidia-smi answers faked)."""

from __future__ import annotations

import subprocess
from types import SimpleNamespace

import pytest

from tests.dist import launch


def _smi(monkeypatch, out: str | None):
    calls = []

    def run(cmd, **kw):
        calls.append(cmd)
        if out is None:
            raise FileNotFoundError("nvidia-smi")
        return SimpleNamespace(stdout=out)

    monkeypatch.setattr(subprocess, "run", run)
    return calls


def test_too_many_ranks_for_the_free_memory_skip_with_what_they_need(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,4")
    calls = _smi(monkeypatch, "81000, NVIDIA H100 80GB HBM3\n")
    with pytest.raises(pytest.skip.Exception, match=r"64 ranks on one GPU need about 96 GiB"):
        launch.skip_unless_gpu_memory_for(64)
    assert "--id=3" in calls[0]  # the GPU the shared ranks run on


def test_ranks_that_fit_do_not_skip(monkeypatch):
    _smi(monkeypatch, "81000, NVIDIA H100 80GB HBM3\n")
    launch.skip_unless_gpu_memory_for(32)  # 48 GiB of 79


def test_no_answer_from_nvidia_smi_lets_the_run_find_out(monkeypatch):
    _smi(monkeypatch, None)
    launch.skip_unless_gpu_memory_for(64)
    _smi(monkeypatch, "")
    launch.skip_unless_gpu_memory_for(64)
