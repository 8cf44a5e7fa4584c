"""Central marker handling: GPU tests skip with a reason on machines without the hardware, so
plain ``pytest`` passes on a CPU box and never hangs in distributed init."""

from __future__ import annotations

import pytest


def _cuda_info() -> tuple[int, tuple[int, int] | None]:
    try:
        import torch
    except ImportError:
        return 0, None
    if not torch.cuda.is_available():
        return 0, None
    return torch.cuda.device_count(), torch.cuda.get_device_capability(0)


def _builds_for(cap: tuple[int, int] | None) -> bool:
    """Whether mok builds its kernels for this capability (mok.spec.arch)."""
    if cap is None:
        return False
    from mok.spec.arch import arch_paths

    return arch_paths(cap).build is not None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    num_gpus, cap = _cuda_info()
    reasons = {
        "gpu": None if num_gpus >= 1 else "needs a CUDA GPU (none found)",
        "multigpu": None if num_gpus >= 2 else f"needs >= 2 CUDA GPUs (found {num_gpus})",
        "sm90": None if cap == (9, 0) else f"needs sm_90 (found {cap})",
        "kernels": None if _builds_for(cap) else f"needs a GPU mok's kernels build for ({cap})",
        "sm100": None if cap is not None and cap[0] == 10 else f"needs sm_100 (found {cap})",
    }
    for item in items:
        for name, reason in reasons.items():
            if reason and item.get_closest_marker(name):
                item.add_marker(pytest.mark.skip(reason=reason))
                break


@pytest.fixture
def fresh_workspaces():
    """No mok workspace before and after the test (each test sizes its own)."""
    import mok

    mok.clear_workspaces()
    yield
    mok.clear_workspaces()
