"""The backward's transfers as mok builds them (sim.layer.backward: the dY and x pulls, the dX
push, the router-weight gradient), counted by hand on a tiny routing, and the DeepEP +
torch-best baseline (sim.comm.deepep, sim.layer.baseline) that `mok-sim compare --pass both`
prints beside mok's rows."""

from __future__ import annotations

import numpy as np
import pytest

from sim.app.cli import main
from sim.comm.deepep import DEEPEP_SMS, DEEPEP_SOURCE, deepep_rates, nvlink_payload_gbps
from sim.config import SimConfig, Workload
from sim.core.hardware import load_gpu
from sim.layer.backward import backward_config
from sim.layer.baseline import BASELINE_NAME, deepep_torch_step, pair_rows, run_stages
from sim.layer.model import BackwardBuilder, kernel_knobs, plan_for, simulate
from sim.layer.policies import DedupPullDispatch, PullDispatch
from sim.measured import measured_path, read_rows

TINY = Workload("tiny", 64, 2, "h200x2", "hot:0.3")  # 16 experts (8 per rank), H 256, top-4
SMALL_ROUNDS = SimConfig(minibatch_size=256, macrobatch_size=512)


def _hand_counts(wl: Workload) -> tuple[np.ndarray, np.ndarray]:
    """[R_owner, R_home] (token, k) rows and distinct (token, owner) pairs, from the routing
    itself, one token at a time."""
    tr = wl.make_trace()
    nr, t = wl.ep, wl.tokens_per_rank
    local = wl.model_shape.num_experts // nr
    rows, pairs = np.zeros((nr, nr), int), np.zeros((nr, nr), int)
    for i, experts in enumerate(tr.topk_idx.reshape(nr * t, -1)):
        home = i // t
        owners = [int(e) // local for e in experts]
        for d in owners:
            rows[d, home] += 1
        for d in set(owners):
            pairs[d, home] += 1
    return rows, pairs


def _remote(m: np.ndarray) -> np.ndarray:
    out = m.astype(float).copy()
    np.fill_diagonal(out, 0.0)
    return out


@pytest.mark.parametrize("dedup", [False, True])
def test_backward_bytes_per_direction_are_the_hand_counts(dedup):
    """home -> owner: dY and x, one bf16 row each per (token, k) row (per (token, owner) with
    dedup); owner -> home: one bf16 dX row per (token, k) row (one partial per (token, owner)
    with dedup) and 4 bytes of router-weight gradient per (token, k) row."""
    cfg = SMALL_ROUNDS.replace(dispatch_mode="dedup_pull" if dedup else "pull")
    rows, pairs = _hand_counts(TINY)
    moved = pairs if dedup else rows
    row = 2.0 * TINY.model_shape.hidden
    into_owner = _remote(moved) * 2 * row  # [R_owner, R_home]: dY + x, home -> owner
    out_of_owner = _remote(moved) * row + _remote(rows) * 4.0  # dX + router grad, owner -> home
    b = BackwardBuilder(TINY, backward_config(cfg), plan_for(TINY, cfg.row_tile))
    pull = DedupPullDispatch() if dedup else PullDispatch()
    for d in range(TINY.ep):
        rounds = range(int(b.rc.num_rounds[d]))
        got_in = np.sum([pull.parts(b, d, m)[0] for m in rounds], axis=0)  # [R_home]
        got_out = np.sum([b.combine_bytes(d, m)[0] for m in rounds], axis=0)
        got_in[d] = got_out[d] = 0.0  # a rank's own rows stay local
        np.testing.assert_array_equal(got_in, into_owner[d])
        np.testing.assert_array_equal(got_out, out_of_owner[d])
    res = simulate(TINY, backward_config(cfg))
    assert res.payload_bytes["nvlink"] == pytest.approx(into_owner.sum() + out_of_owner.sum())


def test_dedup_reverse_dispatch_runs_at_the_dedup_combine_kernels_rates():
    cfg = SimConfig(dispatch_mode="dedup_pull", kernel_profile="mok-comm-h200x2")
    knobs = kernel_knobs(backward_config(cfg))
    assert knobs["rev_combine"].startswith("dispatch.dedup_pull+fanout")
    assert knobs["rev_dispatch"].startswith("combine.dedup_push")
    assert simulate(TINY, backward_config(cfg.replace(minibatch_size=256))).layer_us > 0


def test_router_weight_gradient_is_four_bytes_per_row_and_rank_local_weights_move_nothing():
    """Only the gradient travels (4 bytes per (token, k) row); the rows' router weights come
    with the schedule: the backward's NVLink bytes are 3 bf16 rows + 4 bytes per remote row."""
    rows, _ = _hand_counts(TINY)
    res = simulate(TINY, backward_config(SMALL_ROUNDS))
    remote = _remote(rows).sum()
    assert res.payload_bytes["nvlink"] == remote * (3 * 2 * TINY.model_shape.hidden + 4)


def test_pair_rows_are_the_hand_counts():
    rows, pairs = _hand_counts(TINY)
    # pair_rows is [R_src (home), R_dst (owner)]
    np.testing.assert_array_equal(pair_rows(plan_for(TINY)), pairs.T)
    assert (pairs <= rows).all()


def test_deepep_fit_reproduces_its_rows():
    """Each measured DeepEP row at the fitted SM count within 10 % of its fit; every fitted
    rate below the H200's NVLink payload ceiling."""
    rates = deepep_rates()
    fits = {(f.phase, f.hidden): f for f in rates.fits}
    assert set(fits) == {(p, h) for p in ("dispatch", "combine") for h in (2048, 7168)}
    ceiling = nvlink_payload_gbps(load_gpu("h200"))
    rows = read_rows(measured_path(DEEPEP_SOURCE))
    n = 0
    for r in rows:
        if r["impl"] != "deepep" or int(r["sms"]) != DEEPEP_SMS:
            continue
        f = fits[(r["what"], int(r["hidden"]))]
        assert float(f.us(float(r["nvlink_bytes"]), ceiling)) == pytest.approx(
            float(r["median_us"]), rel=0.10
        )
        n += 1
    assert n == 24
    assert all(0 < f.payload_frac < 1 for f in rates.fits)


def test_deepep_phase_is_the_busier_direction_of_each_port():
    rates = deepep_rates()
    gpu = Workload("deepseek-v3", 64, 2, "h200x2").topo.gpu
    pairs = np.array([[5, 100], [300, 7]])  # [src, dst]; the diagonal stays on the rank
    us = rates.phase_us("dispatch", 7168, gpu, pairs)
    f = next(f for f in rates.fits if f.phase == "dispatch" and f.hidden == 7168)
    want = f.us(300 * 7168 * 2, nvlink_payload_gbps(gpu))  # both ranks: 300 rows one way
    np.testing.assert_allclose(us, [want, want])
    with pytest.raises(ValueError, match="unknown DeepEP phase"):
        rates.phase_us("alltoall", 7168, gpu, pairs)


@pytest.mark.parametrize(
    "wl",
    [
        Workload("qwen3-30b-a3b", 512, 8, "hgx-h200", "hot:0.3"),
        Workload("deepseek-v3", 256, 2, "h200x2"),
        Workload("tiny", 256, 1, "h200x2"),
    ],
    ids=lambda w: w.label(),
)
def test_baseline_is_never_faster_than_its_parts(wl):
    """No overlap: each pass takes at least the sum of any one rank's stages (equal at one
    rank), and at most the sum of every stage's slowest rank; the step is the two passes."""
    b = deepep_torch_step(wl)
    for stages, total in ((b.forward, b.fwd_us), (b.backward, b.bwd_us)):
        per_rank = np.sum([s.rank_us for s in stages], axis=0)  # [R]
        assert total >= per_rank.max() - 1e-9
        assert total <= sum(s.us for s in stages) + 1e-9
        assert total == pytest.approx(run_stages(stages))
        assert all((s.rank_us >= 0).all() for s in stages)
        if wl.ep == 1:
            assert total == pytest.approx(per_rank[0])
            assert all(s.us == 0 for s in stages if s.kind == "comm")
        else:
            assert min(s.us for s in stages if s.kind == "comm") > 0
    assert b.step_us == pytest.approx(b.fwd_us + b.bwd_us)
    assert b.bwd_us > b.fwd_us  # dgrad + wgrad: twice the forward's GEMMs
    assert {k for k in b.summary() if k.endswith("_us")} >= {"fwd_us", "bwd_us", "step_us"}


def test_compare_both_prints_the_baseline(capsys):
    argv = ["compare", "--shape", "tiny", "--tokens", "256", "--ep", "2", "--topology", "h200x2"]
    assert main([*argv, "--pass", "both"]) == 0
    text = capsys.readouterr().out
    table = text.split(f"{BASELINE_NAME} (sim.layer.baseline")[1].splitlines()
    base = next(line for line in table if line.startswith(BASELINE_NAME))
    fwd, bwd, step = map(float, base[len(BASELINE_NAME) :].split()[:3])
    want = deepep_torch_step(Workload("tiny", 256, 2, "h200x2"))
    assert (fwd, bwd, step) == pytest.approx((want.fwd_us, want.bwd_us, want.step_us), abs=0.06)
    mok = [line for line in table if line.startswith("mok ")]
    assert len(mok) == 4 and all(line.endswith("x") for line in mok)
    assert main(argv) == 0  # the forward alone: no baseline
    assert BASELINE_NAME not in capsys.readouterr().out
