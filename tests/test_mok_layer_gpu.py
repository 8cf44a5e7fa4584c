"""The fused layer on real GPUs: EP1 and EP2 through torchrun (tests/dist/layer_worker.py), each
rank checked against the reference of the whole problem, plus the timeout behaviour."""

from __future__ import annotations

import pytest

from tests.dist.launch import skip_unless_gpus, torchrun


def _torchrun(nproc: int, *args: str) -> str:
    return torchrun("layer_worker.py", nproc, "MOK-LAYER-OK", *args, timeout=1200)


@pytest.mark.gpu
@pytest.mark.sm90
def test_fused_layer_ep1():
    _torchrun(1)


@pytest.mark.multigpu
@pytest.mark.sm90
def test_fused_layer_ep2():
    _torchrun(2)


@pytest.mark.multigpu
@pytest.mark.sm90
@pytest.mark.parametrize("nproc", [4, 8])
def test_fused_layer_ep4_ep8(nproc):
    skip_unless_gpus(nproc)
    _torchrun(nproc, "--quick")


@pytest.mark.multigpu
@pytest.mark.sm90
def test_fused_layer_missing_peer_raises_timeout():
    out = _torchrun(2, "--timeout")
    assert "rank 0 raised after" in out, out[-3000:]
