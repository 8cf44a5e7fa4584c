"""mok kernels on real GPUs: EP1 and EP2 through torchrun (tests/dist/mok_worker.py), each rank
checked against the reference of the whole problem, plus the timeout behaviour."""

from __future__ import annotations

import pytest

from tests.dist.launch import skip_unless_gpus, torchrun


def _torchrun(nproc: int, *args: str) -> str:
    return torchrun("mok_worker.py", nproc, "MOK-WORKER-OK", *args, timeout=900)


@pytest.mark.gpu
@pytest.mark.kernels  # mok_worker.py skips the fused layer's cases off sm_90
def test_ep1_against_reference():
    _torchrun(1)


@pytest.mark.multigpu
@pytest.mark.kernels
def test_ep2_against_reference():
    _torchrun(2)


@pytest.mark.multigpu
@pytest.mark.kernels
@pytest.mark.parametrize("nproc", [4, 8])
def test_ep4_ep8_against_reference(nproc):
    # One NVLink domain of Hopper GPUs holds up to 8 ranks (kMaxRanks in csrc/params.h).
    skip_unless_gpus(nproc)
    _torchrun(nproc)


@pytest.mark.multigpu
@pytest.mark.kernels
def test_missing_peer_raises_timeout():
    out = _torchrun(2, "--timeout")
    assert "rank 0 raised after" in out, out[-3000:]


@pytest.mark.gpu
@pytest.mark.kernels
def test_single_gpu_without_process_group():
    import torch

    import mok
    from mok import functional as mf
    from mok.spec.workload import make_routing
    from reference.schedule import build_schedule

    N, H, K, E = 333, 1024, 8, 64
    t = make_routing(N, E, K, 1, "uniform", seed=3)
    idx, w = torch.from_numpy(t.topk_idx), torch.from_numpy(t.topk_weights)
    ws = mok.get_workspace(N, H, K, E, torch.bfloat16, mok.MoKConfig(num_comm_sms=4))
    s = mf.build_schedule(idx.cuda(), w.cuda(), ws)
    got, want = s.to_host(), build_schedule(idx.unsqueeze(0), E, 0)
    for f in ("offsets", "src_rank", "src_index", "dst_index", "fanout", "dedup_slot"):
        assert torch.equal(got[f], getattr(want, f)), f
    x = torch.randn(N, H, device="cuda").to(torch.bfloat16)
    recv = mf.dispatch(x, s, "pull")
    real = (want.src_rank >= 0).nonzero().squeeze(1)
    assert torch.equal(recv[real.cuda()], x[(want.src_index[real] // K).cuda()])


@pytest.mark.gpu
@pytest.mark.kernels
@pytest.mark.parametrize(
    ("tokens", "topk", "experts"),
    [(333, 1, 8), (200, 2, 16), (301, 3, 64), (257, 6, 64), (1000, 8, 128), (97, 10, 32),
     (130, 32, 64), (64, 5, 16)],
)  # fmt: skip
def test_schedule_tables_at_every_top_k(tokens, topk, experts):
    """The schedule kernel's walk takes 32 // K tokens a step (the lanes of one step's tokens
    share experts): at one rank its tables equal the reference's at top-k values that fill the
    warp's lanes and values that leave some idle, token counts that end mid-step and mid-chunk."""
    import torch

    import mok
    from mok import functional as mf
    from mok.spec.workload import make_routing
    from reference.schedule import build_schedule

    t = make_routing(tokens, experts, topk, 1, "uniform", seed=tokens + topk)
    idx, w = torch.from_numpy(t.topk_idx), torch.from_numpy(t.topk_weights)
    ws = mok.get_workspace(
        tokens, 256, topk, experts, torch.bfloat16, mok.MoKConfig(num_comm_sms=4)
    )
    got = mf.build_schedule(idx.cuda(), w.cuda(), ws).to_host()
    want = build_schedule(idx.unsqueeze(0), experts, 0)
    for f, v in got.items():  # every table, flattened (the views' shapes are not the point)
        assert torch.equal(v.reshape(-1), getattr(want, f).reshape(-1).to(torch.int64)), f
