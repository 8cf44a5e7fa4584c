"""Process environment of every entry point that starts NCCL (the benchmarks, the GPU test
workers): NVLink multicast off.

NVLink multicast (NVLS, and torch symmetric memory's multicast objects) must stay off on the GPU
hosts mok runs on: enabling it can take a shared host's GPUs out of service. mok never needs it:
its symmetric memory is used for plain peer mappings only, and the NCCL baselines do not need
NCCL's NVLS algorithms. The variables are read when NCCL, NVSHMEM or symmetric memory starts, so
:func:`disable_multicast` runs before ``torch.distributed.init_process_group``.
"""

from __future__ import annotations

import os

__all__ = ["NO_MULTICAST", "disable_multicast"]

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
