"""Process environment of every entry point that starts NCCL (the benchmarks, the GPU test
workers): NVLink multicast off.

NVLink multicast (NVLS, and torch symmetric memory's multicast objects) must stay off on the GPU
hosts mok runs on: enabling it can take a shared host's GPUs out of service. mok never needs it:
its symmetric memory is used for plain peer mappings only, and the NCCL baselines do not need
NCCL's NVLS algorithms. The variables are read when NCCL, NVSHMEM or symmetric memory starts, so
:func:`disable_multicast` runs before ``torch.distributed.init_process_group``. Both live in
:mod:`mok.ranks` (which joins the group); this module keeps their benchmark-side name.
"""

from __future__ import annotations

from mok.ranks import NO_MULTICAST, disable_multicast

__all__ = ["NO_MULTICAST", "disable_multicast"]
