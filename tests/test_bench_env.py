"""Every entry point that starts torch.distributed (the benchmarks' CLI commands, the gloo test
worker) turns NVLink multicast off before the process group starts (CPU only: the process group,
CUDA and the environment are stand-ins)."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

from mok.bench import __main__ as bench_main
from mok.bench.env import NO_MULTICAST, disable_multicast
from tests.dist import (
    ep_worker,
    launch,
    layer_worker,
    mok_worker,
    torchtitan_worker,
    train_worker,
)

# what the entry points set when torchrun has not (probe: a world of one)
_LAUNCH_VARS = ["RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "MOK_SHARED_GPU"]


class _Started(Exception):
    """Raised by the stand-in init_process_group: the entry point got that far."""


@pytest.fixture
def at_init(monkeypatch):
    """The environment each init_process_group call saw, with multicast left on beforehand."""
    for name in [*NO_MULTICAST, *_LAUNCH_VARS]:
        monkeypatch.setenv(name, "unset")  # recorded, so the test's changes are undone
        monkeypatch.delenv(name)
    monkeypatch.setenv("NCCL_NVLS_ENABLE", "1")  # inherited from the shell: must be overridden
    seen: list[dict[str, str | None]] = []

    def init_process_group(*args, **kwargs):
        seen.append({name: os.environ.get(name) for name in NO_MULTICAST})
        raise _Started

    monkeypatch.setattr(dist, "init_process_group", init_process_group)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "set_device", lambda dev: None)
    return seen


@pytest.mark.parametrize("command", bench_main.COMMANDS)
def test_bench_commands_disable_multicast_before_init(at_init, command, tmp_path):
    with pytest.raises(_Started):
        bench_main.main([command, "--csv", str(tmp_path / "x.csv")])
    assert at_init == [NO_MULTICAST]


@pytest.mark.parametrize(
    "worker", [ep_worker, mok_worker, layer_worker, train_worker, torchtitan_worker]
)
def test_test_workers_disable_multicast_before_init(at_init, monkeypatch, worker):
    monkeypatch.setattr("sys.argv", [worker.__file__])
    with pytest.raises(_Started):
        worker.main()
    assert at_init == [NO_MULTICAST]


def test_disable_multicast_overrides_and_launcher_passes_the_same(monkeypatch):
    monkeypatch.setenv("NCCL_NVLS_ENABLE", "1")
    for name in NO_MULTICAST:
        monkeypatch.setenv(name, os.environ.get(name, "unset"))  # restored afterwards
    disable_multicast()
    assert {name: os.environ[name] for name in NO_MULTICAST} == NO_MULTICAST
    assert NO_MULTICAST["NCCL_NVLS_ENABLE"] == "0"
    assert launch.NO_MULTICAST is NO_MULTICAST
