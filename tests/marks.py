"""Marks shared by the GPU tests (tests/conftest.py skips them where the hardware is missing)."""

from __future__ import annotations

import pytest


def hopper(*values):
    """A parameter set that runs the fused layer or mok's expert kernels: skipped off sm_90
    (mok.spec.arch) while the unfused and communication sets of the same test still run."""
    return pytest.param(*values, marks=pytest.mark.sm90)


# The layer's (dispatch, combine, fused) paths at one rank; the fused ones need sm_90.
LAYER_PATHS = [
    hopper("pull", "push", True),
    hopper("dedup_pull", "push", True),
    ("pull", "push", False),
    ("push", "push", False),
    ("pull", "pull", False),
    ("dedup_pull", "push", False),
]
