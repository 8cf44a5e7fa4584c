"""Joining the expert-parallel process group: one GPU per rank, or several ranks sharing a GPU.

mok's multi-rank kernels address their peers through torch symmetric memory, so they run the
same code whether the peers are other GPUs or other processes on the same GPU. Sharing one GPU
between R ranks (``MOK_SHARED_GPU=1``) is how every multi-rank path is tested where only one GPU
is lent:

* torch symmetric memory maps the ranks' allocations into each other as on R GPUs; it accepts
  two ranks on one device only with ``TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES=1``, which
  :func:`init_ranks` sets;
* NCCL (2.28, torch 2.11's) refuses two ranks on one GPU, so the group is gloo: mok's host-side
  collectives (the workspace's shape check, the rendezvous) run on it, and so does any
  collective the caller issues (gloo moves CUDA tensors through the host);
* every mok kernel is a cooperative launch over all SMs: the ranks' launches time-slice on the
  GPU (measured: a cross-rank round trip takes milliseconds instead of microseconds), so waits
  that cross ranks finish, slowly, and timings say nothing about NVLink.

A command that also runs without a GPU (``mok.bench lm``) joins with ``device="cpu"`` or
``"auto"``: a gloo group of CPU processes, where mok runs its expert-parallel reference.

Nothing here touches CUDA before :func:`init_ranks` is called.
"""

from __future__ import annotations

import os
import socket
from typing import Any

import torch
import torch.distributed as dist

from mok.errors import MoKUnsupportedError

__all__ = [
    "NO_MULTICAST",
    "SHARED_GPU_ENV",
    "disable_multicast",
    "init_ranks",
    "shared_gpu",
    "solo_group",
]

# NVLink multicast (NVLS, and torch symmetric memory's multicast objects) must stay off on the
# GPU hosts mok runs on: enabling it can take a shared host's GPUs out of service. mok never
# needs it (plain peer mappings only), nor do the NCCL baselines.
NO_MULTICAST: dict[str, str] = {
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",  # torch symmetric memory: no multicast objects
    "NCCL_NVLS_ENABLE": "0",  # NCCL: no NVLink SHARP (NVLS) algorithms
    "NVSHMEM_DISABLE_NVLS": "1",  # NVSHMEM (DeepEP's transport): no NVLS
}


def disable_multicast() -> None:
    """Turn NVLink multicast off for this process and the processes it starts. Call it before
    NCCL starts. The values are assigned, not defaulted: a setting inherited from the caller's
    environment (``NCCL_NVLS_ENABLE=1``, say) must not turn multicast back on."""
    os.environ.update(NO_MULTICAST)


# Set to 1 to run every rank of the torchrun group on one GPU (LOCAL_RANK modulo the GPUs seen).
SHARED_GPU_ENV = "MOK_SHARED_GPU"
_OVERLAP_ENV = "TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def shared_gpu() -> bool:
    """Whether this process runs with ranks sharing GPUs (``MOK_SHARED_GPU=1``)."""
    return os.environ.get(SHARED_GPU_ENV, "0") not in ("", "0")


def init_ranks(command: str = "mok", device: str = "cuda") -> torch.device:
    """Join the torchrun group and return this rank's device.

    ``device="cuda"`` (the default): one GPU per rank, NCCL, device ``LOCAL_RANK``. With
    ``MOK_SHARED_GPU=1``: gloo, device ``LOCAL_RANK % torch.cuda.device_count()`` (so R ranks on
    one GPU, or R ranks spread over fewer GPUs), symmetric memory allowed to map one device
    several times. ``device="cpu"``: a gloo group of CPU processes (mok's reference path; for
    commands that also run without a GPU); ``device="auto"``: ``cuda`` where a CUDA GPU is
    visible, else ``cpu``. NVLink multicast is turned off first in every case. Without torchrun
    (no ``RANK``) the process is a world of one.

    Raises:
        MoKUnsupportedError: ``device="cuda"`` and no CUDA GPU; more ranks on this node than
            GPUs without ``MOK_SHARED_GPU=1`` (the message says to set it).
        ValueError: a ``device`` other than ``cuda``, ``cpu`` or ``auto``.
    """
    if device not in ("cuda", "cpu", "auto"):
        raise ValueError(f"init_ranks: unknown device {device!r}; supported: cuda, cpu, auto")
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise MoKUnsupportedError(
            f"{command} needs a CUDA GPU (torch.cuda.is_available() is False; torch "
            f"{torch.__version__})"
        )
    disable_multicast()  # before NCCL or symmetric memory starts
    if "RANK" not in os.environ:  # plain `python ...`: a world of one
        os.environ.update(
            RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(_free_port()),
        )  # fmt: skip
    if device == "cpu":
        dist.init_process_group("gloo")
        return torch.device("cpu")
    local = int(os.environ.get("LOCAL_RANK", "0"))
    gpus = torch.cuda.device_count()
    if shared_gpu():
        os.environ[_OVERLAP_ENV] = "1"
        dev = torch.device("cuda", local % gpus)
        torch.cuda.set_device(dev)
        dist.init_process_group("gloo")
        return dev
    if local >= gpus:
        raise MoKUnsupportedError(
            f"{command}: local rank {local} has no GPU of its own ({gpus} visible); to run "
            f"several ranks on one GPU (tests, debugging: timings say nothing about NVLink) set "
            f"{SHARED_GPU_ENV}=1"
        )
    dev = torch.device("cuda", local)
    torch.cuda.set_device(dev)
    dist.init_process_group("nccl", device_id=dev)
    return dev


_SELF_GROUP: list[Any] = [None, None]  # [the default group it was made under, the group]


def solo_group(group=None):
    """The group an adapter runs mok in when its framework handles the experts of one rank
    (mok.integrations): ``group`` where given; else None without torch.distributed or with one
    rank, and otherwise a group of this rank alone (mok's None would mean the default group,
    every rank). Created once, by this rank alone (no collective over the world)."""
    if group is not None or not (dist.is_available() and dist.is_initialized()):
        return group
    if dist.get_world_size() == 1:
        return None
    world = dist.group.WORLD
    if _SELF_GROUP[0] is not world:
        # NOTE: only this rank takes part in creating it (no collective over the world)
        _SELF_GROUP[:] = [world, dist.new_group([dist.get_rank()], use_local_synchronization=True)]
    return _SELF_GROUP[1]
