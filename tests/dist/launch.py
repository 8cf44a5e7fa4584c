"""Launch a tests/dist worker through torchrun and check every rank's sentinel line."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from mok.ranks import NO_MULTICAST, SHARED_GPU_ENV  # every worker: NVLink multicast off

ROOT = Path(__file__).resolve().parents[2]


def skip_unless_gpus(n: int) -> None:
    """Skip the calling test on a machine with fewer than ``n`` CUDA GPUs."""
    import pytest
    import torch

    found = torch.cuda.device_count()
    if found < n:
        pytest.skip(f"needs {n} CUDA GPUs (found {found})")


# What one rank of the tests/dist workers holds on its GPU at the tiny shapes (CUDA context,
# torch, cuBLAS, mok's workspaces): up to 1.42 GiB per process, measured when 64 ranks on one
# 80 GB H100 ran out of memory in the EP64 --wide training worker (2026-12-07).
GIB_PER_SHARED_RANK = 1.5


def skip_unless_gpu_memory_for(nproc: int, gib_per_rank: float = GIB_PER_SHARED_RANK) -> None:
    """Skip the calling test when the shared-GPU ranks' GPU (the first of CUDA_VISIBLE_DEVICES,
    else 0) has too little free memory for ``nproc`` ranks of ``gib_per_rank`` each (read with
    nvidia-smi, so this process makes no CUDA context)."""
    import pytest

    gpu = os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0] or "0"  # the ranks' GPU
    q = [
        "nvidia-smi",
        f"--id={gpu}",
        "--query-gpu=memory.free,name",
        "--format=csv,noheader,nounits",
    ]
    try:
        answer = subprocess.run(q, capture_output=True, text=True, timeout=30).stdout
        free_mib, name = answer.split(",", 1)
        free = float(free_mib) / 1024
    except (OSError, ValueError, subprocess.SubprocessError):
        return  # no nvidia-smi answer: let the run itself find out
    need = nproc * gib_per_rank
    if free < need:
        pytest.skip(
            f"{nproc} ranks on one GPU need about {need:.0f} GiB ({gib_per_rank} GiB each); "
            f"{name.strip()} has {free:.0f} GiB free: run it on a larger GPU (an H200 holds EP64)"
        )


def torchrun(
    worker: str,
    nproc: int,
    sentinel: str,
    *args: str,
    timeout: int = 600,
    shared_gpu: bool = False,
) -> str:
    """Run ``tests/dist/<worker>`` on ``nproc`` ranks; assert exit code 0 and that every rank
    printed ``<sentinel> rank=<r>``. Returns the combined output.

    ``shared_gpu``: every rank on GPU 0 (``MOK_SHARED_GPU=1``, :mod:`mok.ranks`): the kernels
    of ``nproc`` GPUs, time-sliced on one. Without it each rank takes a GPU of its own."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", **NO_MULTICAST)
    env[SHARED_GPU_ENV] = "1" if shared_gpu else "0"
    if shared_gpu:
        env["CUDA_VISIBLE_DEVICES"] = env.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0]
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={nproc}",
        str(ROOT / "tests" / "dist" / worker),
        *args,
    ]
    p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    out = p.stdout + p.stderr
    if os.environ.get("MOK_TEST_LOG_DIR"):  # keep every worker's output (GPU machine runs)
        log = (
            Path(os.environ["MOK_TEST_LOG_DIR"])
            / f"{Path(worker).stem}-ep{nproc}{'-shared' if shared_gpu else ''}{''.join(args)}.log"
        )
        log.parent.mkdir(parents=True, exist_ok=True)
        log.write_text(out)
    assert p.returncode == 0, out[-6000:]
    for r in range(nproc):
        assert f"{sentinel} rank={r}" in out, out[-6000:]
    return out
