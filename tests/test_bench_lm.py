"""``mok.bench lm`` on the CPU (fp32, the reference layer): EP1 is notebook 05's training loop
bit for bit, EP4 over four gloo processes (torchrun) follows EP1's loss curve, the experts are
sharded from the EP1 model's, the refusals, and the loss-curve figure of ``sim.app.plots``."""

from __future__ import annotations

import csv
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from mok.bench import lm, tiny_lm
from mok.bench.__main__ import main as bench_main
from mok.ranks import NO_MULTICAST, init_ranks
from tests import tolerances as tol

ROOT = Path(__file__).resolve().parents[1]
STEPS = 5
_LAUNCH_VARS = ["RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "MOK_SHARED_GPU"]


@pytest.fixture
def clean_env(monkeypatch):
    """No torchrun variables before the test; whatever init_ranks sets is undone after it."""
    for name in [*_LAUNCH_VARS, *NO_MULTICAST]:
        monkeypatch.setenv(name, "unset")  # recorded, so the test's changes are undone
        monkeypatch.delenv(name)
    monkeypatch.setenv("MOK_GIT_SHA", "test")
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def _losses(path: Path) -> list[float]:
    with open(path, newline="") as f:
        return [float(r["loss"]) for r in csv.DictReader(f)]


def _rows(path: Path) -> list[dict]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def _notebook_losses(steps: int, seed: int = 0) -> list[float]:
    """Notebook 05's loop (mok.bench.tiny_lm.train) on the tiny model, one thread."""
    torch.set_num_threads(1)
    shape, run = tiny_lm.SIZES["tiny"]
    model = tiny_lm.build(shape, seed=seed)
    data = tiny_lm.batches(tiny_lm.markov_chain(shape.vocab, seed), run.batch, run.seq, seed + 2)
    return tiny_lm.train(model, data, steps, run.lr)


def test_ep1_is_the_notebook_loop_bit_for_bit(clean_env, tmp_path, capsys):
    path = tmp_path / "ep1.csv"
    args = ["lm", "--device", "cpu", "--size", "tiny", "--steps", str(STEPS), "--csv", str(path)]
    assert bench_main(args) == 0
    assert not (dist.is_available() and dist.is_initialized())  # the group is torn down
    out = capsys.readouterr().out
    assert "EP1 (cpu, float32)" in out and "bitwise equal on all 1 ranks: True" in out
    assert _losses(path) == _notebook_losses(STEPS)
    row = _rows(path)[0]
    assert (row["ep"], row["num_ranks"], row["device"], row["gpu"]) == ("1", "1", "cpu", "cpu")
    assert (row["dtype"], row["layer"], row["seed"], row["git_sha"]) == (
        "float32",
        "reference",
        "0",
        "test",
    )
    assert row["shared_gpu"] == "0" and float(row["loss_floor"]) > 0


def test_ep4_on_cpu_processes_follows_ep1(tmp_path):
    """Four gloo ranks (torchrun), each with 2 of the 8 experts of every layer and 2 of the 8
    sequences of every batch: the loss curve of EP1, within an fp32 summation order."""
    path = tmp_path / "ep4.csv"
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", MOK_GIT_SHA="test")
    env.update(NO_MULTICAST)
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=4",
        "-m", "mok.bench", "lm", "--device", "cpu", "--size", "tiny", "--steps", str(STEPS),
        "--csv", str(path),
    ]  # fmt: skip
    p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    out = p.stdout + p.stderr
    assert p.returncode == 0, out[-6000:]
    assert "EP4 (cpu, float32)" in out and "bitwise equal on all 4 ranks: True" in out, out[-3000:]
    got, want = _losses(path), _notebook_losses(STEPS)
    assert len(got) == STEPS
    for step, (g, w) in enumerate(zip(got, want, strict=True)):
        assert abs(g - w) <= tol.LM_EP_LOSS_RTOL * abs(w), f"step {step}: EP4 {g} vs EP1 {w}"
    assert got[-1] < got[0] - 1.0, got  # it learns (5.28 -> ~2.6 nats in 5 steps)
    rows = _rows(path)
    assert {(r["ep"], r["num_ranks"], r["device"]) for r in rows} == {("4", "4", "cpu")}


def test_gradients_of_the_mean_over_ranks(monkeypatch):
    """As if all 4 ranks held these gradients: the replicated ones are their sum / 4 (unchanged),
    the experts' (mok: already the sum over the ranks' losses) / 4. AdamW hardly sees a constant
    gradient scale, so the loss curves alone would not catch a missing / 4."""
    monkeypatch.setattr(dist, "get_world_size", lambda *a: 4)
    monkeypatch.setattr(dist, "get_backend", lambda *a: "gloo")
    monkeypatch.setattr(dist, "all_reduce", lambda t, *a, **kw: t.mul_(4))
    rep, exp = torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(2, 2))
    rep.grad, exp.grad = torch.tensor([1.0, -2.0, 0.5]), torch.full((2, 2), 8.0)
    lm.average_gradients([rep], [exp], 4)
    assert torch.equal(rep.grad, torch.tensor([1.0, -2.0, 0.5]))
    assert torch.equal(exp.grad, torch.full((2, 2), 2.0))


class _Group:
    """A stand-in process group of ``size`` ranks (build reads only its size and rank)."""

    def __init__(self, size: int, rank: int):
        self.size, self.rank = size, rank


def test_sharded_experts_are_the_ep1_models(monkeypatch):
    """Every rank's experts are its slice of the EP1 model's; everything else is EP1's."""
    monkeypatch.setattr(dist, "get_world_size", lambda g=None: g.size)
    monkeypatch.setattr(dist, "get_rank", lambda g=None: g.rank)
    shape, _ = tiny_lm.SIZES["tiny"]
    ep1 = tiny_lm.build(shape, seed=3)
    shards = [tiny_lm.build(shape, seed=3, group=_Group(4, r)) for r in range(4)]
    for b, blk in enumerate(ep1.blocks):
        for name in ("gate_up", "down"):
            cat = torch.cat([getattr(s.blocks[b].moe, name) for s in shards])
            assert torch.equal(cat, getattr(blk.moe, name)), f"block {b} {name}"
        assert all(s.blocks[b].moe.gate_up.shape[0] == 2 for s in shards)
    names = [n for n, _ in ep1.named_parameters()]
    for s in shards:
        assert [n for n, _ in s.named_parameters()] == names
        reps = dict(zip(names, [p for _, p in s.named_parameters()], strict=True))
        for n, p in ep1.named_parameters():
            if not n.endswith(("moe.gate_up", "moe.down")):
                assert torch.equal(reps[n], p), n
    assert len(ep1.expert_parameters()) == 2 * shape.blocks
    assert len(ep1.replicated_parameters()) + 2 * shape.blocks == len(names)


def test_build_refusals():
    shape, _ = tiny_lm.SIZES["tiny"]
    with pytest.raises(Exception, match="unknown kind 'jax'; supported: mok, torch"):
        tiny_lm.build(shape, kind="jax")


def test_lm_refuses_a_world_that_does_not_split_the_batch(clean_env, monkeypatch, capsys):
    monkeypatch.setenv("WORLD_SIZE", "3")
    with pytest.raises(SystemExit) as e:
        lm.main(["--device", "cpu", "--size", "tiny"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "EP3 needs the batch (8 sequences) and the experts (8) to split evenly" in err


def test_init_ranks_on_cpu_joins_gloo_without_a_gpu(clean_env, monkeypatch):
    calls = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(dist, "init_process_group", lambda *a, **kw: calls.append(a))
    assert init_ranks("x", device="auto") == torch.device("cpu")
    assert calls == [("gloo",)] and os.environ["WORLD_SIZE"] == "1"
    assert os.environ["NCCL_NVLS_ENABLE"] == "0"  # multicast off on every path
    assert init_ranks("x", device="cpu") == torch.device("cpu")
    with pytest.raises(ValueError, match="unknown device 'tpu'; supported: cuda, cpu, auto"):
        init_ranks("x", device="tpu")


def _write_lm_csv(path: Path, ep: int, losses: list[float]) -> None:
    cols = dict(ep=ep, device="cuda", shared_gpu=int(ep > 1), dtype="bfloat16", gpu="NVIDIA H100",
                hidden=64, num_experts=8, num_topk=2, tokens_per_step=256, seed=0,
                loss_floor=1.6)  # fmt: skip
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=["step", "loss", *cols])
        w.writeheader()
        w.writerows({"step": i, "loss": v, **cols} for i, v in enumerate(losses))


def test_train_loss_figure_from_two_csvs(tmp_path):
    a, b = tmp_path / "ep1.csv", tmp_path / "ep4.csv"
    _write_lm_csv(a, 1, [5.0, 3.0, 2.5, 2.0])
    _write_lm_csv(b, 4, [5.0, 3.01, 2.49, 2.0])
    out = tmp_path / "fig" / "loss.png"
    cmd = [sys.executable, "-m", "sim.app.plots", "train-loss", "--csv", str(a), "--csv", str(b),
           "--out", str(out)]  # fmt: skip
    env = dict(os.environ, PYTHONPATH=str(ROOT), MPLBACKEND="Agg")
    p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stdout + p.stderr
    assert f"wrote {out}" in p.stdout
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    from sim.app.plots import lm_run_label, train_loss
    from sim.measured import read_rows

    runs = {lm_run_label(read_rows(p)): read_rows(p) for p in (b, a)}
    assert list(runs) == ["EP4 (4 ranks on one NVIDIA H100, bfloat16)",
                          "EP1 (NVIDIA H100, bfloat16)"]  # fmt: skip
    fig = train_loss(runs)  # the EP1 run is the reference, wherever it is
    top, bottom = fig.axes
    assert "EP4 (4 ranks on one NVIDIA H100, bfloat16) vs EP1" in top.get_title()
    (diff,) = [ln for ln in bottom.get_lines() if ln.get_label().startswith("EP4")]
    assert list(diff.get_ydata()) == pytest.approx([0.0, 0.01, -0.01, 0.0])
    assert top.get_xlabel() == "" and bottom.get_xlabel() == "step"
