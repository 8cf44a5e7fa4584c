"""Every multi-rank path on one GPU: the tests/dist workers at EP2, EP4 and EP8 with all ranks on
GPU 0 (``MOK_SHARED_GPU=1``: gloo group, symmetric memory mapping one device several times, the
ranks' kernels time-sliced), each rank checked against the reference of the whole problem. The
same workers run one GPU per rank under the ``multigpu`` marker (test_mok_gpu.py,
test_mok_layer_gpu.py, and the training ones below)."""

from __future__ import annotations

import csv

import pytest

from mok.bench import signals
from tests.dist.launch import skip_unless_gpu_memory_for, skip_unless_gpus, torchrun

EP_SIZES = [2, 4, 8]


def _train(nproc: int, *args: str, shared: bool = True) -> str:
    return torchrun(
        "train_worker.py", nproc, "MOK-TRAIN-OK", *args, timeout=1500, shared_gpu=shared
    )


@pytest.mark.gpu
@pytest.mark.sm90
def test_training_ep1_against_reference_and_itself():
    _train(1, "--quick", shared=False)


# Per EP size: every mode and case at EP2 (20 runs compared, 12 fuzz cases), fewer at EP4 / EP8
# (the ranks time-slice one GPU: EP8 steps take about 4x EP2's).
TRAIN_ARGS = {
    2: ("--repeats", "20", "--fuzz", "12"),
    4: ("--quick", "--repeats", "5", "--fuzz", "8"),
    8: ("--quick", "--repeats", "3", "--fuzz", "4"),
}


@pytest.mark.gpu
@pytest.mark.sm90
@pytest.mark.parametrize("nproc", EP_SIZES)
def test_training_on_shared_gpu_ranks(nproc):
    """Gradients of every mode against the reference, bitwise against EP1 of the whole batch,
    determinism, a rank without tokens, bad routing on one rank, the SM budget, MoE / compile /
    main_grad, fuzz cases."""
    _train(nproc, *TRAIN_ARGS[nproc])


@pytest.mark.gpu
@pytest.mark.sm90
def test_training_with_dw_gate_up_plain_on_shared_gpu_ranks():
    """``mok.ops.WGRAD_GU_TRANSPOSED`` off in every process (dW_gate_up as dgu^T x, not the
    default transposed form, EP1's run included): EP2's gradients against the reference and
    bitwise against EP1 of the whole batch (the one-rank gathered backward against the
    dispatched and the fused ones), determinism, a rank without tokens."""
    _train(2, "--quick", "--repeats", "3", "--wgrad-gu-plain")


# Above eight ranks (an NVL72 rack's EP sizes): a tiny 64-expert layer, every rank on GPU 0.
WIDE_EP_SIZES = [16, 32, 64]


@pytest.mark.gpu
@pytest.mark.sm90
@pytest.mark.parametrize("nproc", WIDE_EP_SIZES)
def test_training_above_eight_ranks_on_shared_gpu(nproc):
    """Forward and backward (unfused, dedup, fused, the backward's transfers in its launch)
    against the reference and bitwise against EP1; bad routing on one rank."""
    skip_unless_gpu_memory_for(nproc)
    _train(nproc, "--wide")


@pytest.mark.gpu
@pytest.mark.sm90
def test_missing_peer_above_eight_ranks_raises_timeout_on_shared_gpu():
    out = _train(16, "--timeout", "--wide")
    for how in ("kernels", "in-launch"):
        assert f"rank 0 ({how}) raised after" in out, out[-3000:]


@pytest.mark.gpu
@pytest.mark.sm90
def test_training_missing_peer_raises_timeout_on_shared_gpu():
    out = _train(2, "--timeout")
    for how in ("kernels", "in-launch"):
        assert f"rank 0 ({how}) raised after" in out, out[-3000:]


@pytest.mark.gpu
@pytest.mark.kernels  # mok_worker.py skips the fused layer's cases off sm_90
@pytest.mark.parametrize("nproc", EP_SIZES)
def test_comm_kernels_and_layer_on_shared_gpu_ranks(nproc):
    torchrun("mok_worker.py", nproc, "MOK-WORKER-OK", "--quick", timeout=1500, shared_gpu=True)


@pytest.mark.gpu
@pytest.mark.kernels
@pytest.mark.parametrize("nproc", [2, 3, 4])
def test_preflight_checks_every_pair_on_shared_gpu_ranks(nproc):
    """Every pair reachable, copies right, flags answered (an odd count: a bye per round)."""
    out = torchrun("bench_worker.py", nproc, "MOK-BENCH-OK", "preflight", "--mib", "4",
                   timeout=600, shared_gpu=True)  # fmt: skip
    pairs = nproc * (nproc - 1) // 2
    assert f"{pairs} pairs: 0 failed" in out, out[-3000:]
    assert "not NVLink's" in out, out[-3000:]


@pytest.mark.gpu
@pytest.mark.sm90
@pytest.mark.parametrize("nproc", [2, 4])
def test_signal_counts_on_shared_gpu_ranks(nproc, tmp_path):
    """Every path's flags counted on every rank: what the kernels send by construction, one flag
    per peer per handshake (mok.bench.signals.flags_per_peer)."""
    out = torchrun("bench_worker.py", nproc, "MOK-BENCH-OK", "signals", "--csv",
                   str(tmp_path / "s.csv"), timeout=600, shared_gpu=True)  # fmt: skip
    with open(tmp_path / "s.csv") as f:
        rows = list(csv.DictReader(f))
    assert [r["path"] for r in rows] == list(signals.PATHS), out[-3000:]
    comm = signals.build_parser().parse_args([]).comm_sms
    for r in rows:
        want = signals.flags_per_peer(r["path"], comm)
        assert int(r["ep"]) == nproc and int(r["expected"]) == want * (nproc - 1), r
        assert float(r["remote_flags"]) == float(r["remote_flags_min"]) == want * (nproc - 1), r
        assert float(r["own_flags"]) == want, r


@pytest.mark.gpu
@pytest.mark.sm90
@pytest.mark.parametrize("nproc", EP_SIZES)
def test_fused_layer_on_shared_gpu_ranks(nproc):
    torchrun("layer_worker.py", nproc, "MOK-LAYER-OK", "--quick", timeout=1500, shared_gpu=True)


@pytest.mark.multigpu
@pytest.mark.sm90
@pytest.mark.parametrize("nproc", EP_SIZES)
def test_training_one_gpu_per_rank(nproc):
    skip_unless_gpus(nproc)
    _train(nproc, "--quick", shared=False)
