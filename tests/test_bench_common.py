"""What the benchmarks share (mok.bench.common), on the CPU: the process-group start, the
provenance columns, the CSV recorders of comm and layer / sweep (read back by the simulator), the
routing draw, the local timer and the command-line parsers. The GPU, NCCL and CUDA events are
stand-ins."""

from __future__ import annotations

import ast
import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from mok.bench import comm, common, layer
from mok.errors import MoKUnsupportedError
from mok.spec.rows import PROVENANCE_COLUMNS, bench_routing_seed
from mok.spec.workload import make_routing
from sim.measured import read_measured

BENCH = Path(common.__file__).parent
META = {"gpu": "NVIDIA H200", "num_ranks": 2, "torch": "2.11", "cuda": "13.0", "git_sha": "abc"}
COMM_COLUMNS = (
    "model,hidden,num_experts,num_topk,skew,tokens_per_rank,routing_seed,what,impl,mode,engine,"
    "scope,sms,median_us,p20_us,p80_us,nvlink_bytes,nvlink_gbps,frac_ceiling,gpu,num_ranks,torch,"
    "cuda,git_sha"
)
LAYER_COLUMNS = (
    "model,hidden,intermediate,num_experts,num_topk,skew,tokens_per_rank,routing_seed,impl,mode,"
    "sms,minibatch,row_tile,median_us,p20_us,p80_us,tflops,nvlink_bytes,nvlink_gbps,frac_ceiling,"
    "gpu,num_ranks,torch,cuda,git_sha"
)


def test_no_bench_module_imports_another_ones_private_names():
    for path in sorted(BENCH.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("mok.bench"):
                private = [a.name for a in node.names if a.name.startswith("_")]
                assert not private, f"{path.relative_to(BENCH)} imports {private} of {node.module}"


def test_provenance_is_the_spec_columns_in_order(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA H200")
    monkeypatch.setenv("MOK_GIT_SHA", "abc1234")
    got = common.provenance()
    assert list(got) == [c for c in PROVENANCE_COLUMNS if c != "routing_seed"]
    assert got["gpu"] == "NVIDIA H200" and got["num_ranks"] == 1  # no process group: one rank
    assert (got["torch"], got["cuda"], got["git_sha"]) == (
        torch.__version__,
        torch.version.cuda,
        "abc1234",
    )
    # every column has a getter, but the routing seed, which each row records itself
    assert set(PROVENANCE_COLUMNS) - set(common.PROVENANCE) == {"routing_seed"}
    assert {"driver", "date"} <= set(common.PROVENANCE)  # the probe's meta


def _comm_row(rec, **kw):
    base = dict(model="deepseek-v3", hidden=7168, num_experts=256, num_topk=8, skew="uniform")
    base.update(tokens_per_rank=4096, routing_seed=bench_routing_seed(4096))
    row = dict(what="dispatch", impl="mok", mode="dedup_pull", engine="tma", scope="comparable")
    row.update(sms=24, median_us=100.0, p20_us=99.96, p80_us=101.25, nvlink_bytes=37_000_000)
    rec.add(**{**base, **row, **kw})


def test_comm_recorder_writes_the_columns_validate_reads(tmp_path, capsys):
    path = tmp_path / "sub" / "comm.csv"
    rec = comm.CommRecorder(str(path), META)
    _comm_row(rec)
    _comm_row(rec, impl="nccl", mode="a2a", engine="-", median_us=50.0, nvlink_bytes=0)
    out = capsys.readouterr().out
    assert "deepseek-v3 N= 4096" in out and "100.0 us  370.0 GB/s (1.00)" in out
    rec.write()
    lines = path.read_text().splitlines()
    assert lines[0] == COMM_COLUMNS and len(lines) == 3
    assert f"wrote {path}" in capsys.readouterr().out
    row = rec.rows[0]
    assert (row["median_us"], row["p20_us"], row["p80_us"]) == (100.0, 100.0, 101.2)
    assert (row["nvlink_gbps"], row["frac_ceiling"]) == (370.0, 1.0)
    assert (rec.rows[1]["nvlink_gbps"], rec.rows[1]["frac_ceiling"]) == (0.0, 0.0)
    untimed = comm.CommRecorder(None, META)
    _comm_row(untimed, median_us=0.0)
    assert untimed.rows[0]["nvlink_gbps"] == 0.0  # no division by a zero time
    kind, rows = read_measured(path)
    assert kind == "comm" and rows[0]["routing_seed"] == "4096" and rows[0]["git_sha"] == "abc"


def test_layer_recorder_writes_the_columns_validate_reads(tmp_path, capsys):
    path = tmp_path / "sweep.csv"
    rec = layer.LayerRecorder(str(path), META)
    base = dict(model="qwen3-30b-a3b", hidden=2048, intermediate=768, num_experts=128, num_topk=8)
    base.update(skew="hot:0.5", tokens_per_rank=2048, routing_seed=2048)
    rec.add(
        **base,
        impl="mok-fused",
        mode="pull",
        sms=16,
        minibatch=2048,
        row_tile=128,
        median_us=250.0,
        p20_us=240.0,
        p80_us=260.0,
        tflops=123.4,
        nvlink_bytes=0,
    )
    assert "mok-fused       pull sms= 16 mb= 2048 rt=128" in capsys.readouterr().out
    rec.write()
    assert path.read_text().splitlines()[0] == LAYER_COLUMNS
    kind, rows = read_measured(path)
    assert kind == "layer" and rows[0]["minibatch"] == "2048"


def test_recorder_writes_nothing_without_a_path_or_rows(tmp_path):
    common.Recorder(None, META).write()
    common.Recorder(str(tmp_path / "x.csv"), META).write()
    assert not (tmp_path / "x.csv").exists()


def test_only_rank_zero_prints_and_writes(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_rank", lambda *a: 1)
    rec = comm.CommRecorder(str(tmp_path / "x.csv"), META)
    _comm_row(rec)
    rec.write()
    assert capsys.readouterr().out == "" and not (tmp_path / "x.csv").exists()
    assert not common.is_rank0()


@pytest.fixture
def fake_nccl(monkeypatch):
    """init_process_group and set_device recorded instead of run; a GPU 'present'."""
    calls = []
    names = ["RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "MOK_SHARED_GPU"]
    for name in [*names, "TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES"]:
        monkeypatch.setenv(name, "unset")  # restored afterwards
        monkeypatch.delenv(name)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    monkeypatch.setattr(torch.cuda, "set_device", lambda dev: calls.append(("set_device", dev)))
    monkeypatch.setattr(
        dist,
        "init_process_group",
        lambda *a, **kw: calls.append(("init", a, kw.get("device_id"))),
    )
    return calls


def test_init_dist_without_torchrun_is_a_world_of_one(fake_nccl):
    dev = common.init_dist()
    assert dev == torch.device("cuda", 0)
    assert (os.environ["RANK"], os.environ["WORLD_SIZE"], os.environ["LOCAL_RANK"]) == (
        "0",
        "1",
        "0",
    )
    assert int(os.environ["MASTER_PORT"]) > 0 and os.environ["NCCL_NVLS_ENABLE"] == "0"
    assert fake_nccl == [("set_device", dev), ("init", ("nccl",), dev)]


def test_init_dist_under_torchrun_takes_its_local_rank(fake_nccl, monkeypatch):
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("LOCAL_RANK", "3")
    assert common.init_dist() == torch.device("cuda", 3)
    assert "MASTER_PORT" not in os.environ  # torchrun's rendezvous, untouched


def test_shared_gpu_ranks_join_a_gloo_group_on_one_gpu(fake_nccl, monkeypatch):
    monkeypatch.setenv("RANK", "5")
    monkeypatch.setenv("LOCAL_RANK", "5")
    monkeypatch.setenv("MOK_SHARED_GPU", "1")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert common.init_dist() == torch.device("cuda", 0)
    assert fake_nccl == [("set_device", torch.device("cuda", 0)), ("init", ("gloo",), None)]
    assert os.environ["TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES"] == "1"
    assert os.environ["NCCL_NVLS_ENABLE"] == "0"


def test_more_ranks_than_gpus_says_how_to_share_them(fake_nccl, monkeypatch):
    monkeypatch.setenv("RANK", "2")
    monkeypatch.setenv("LOCAL_RANK", "2")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(MoKUnsupportedError, match=r"local rank 2 has no GPU .* MOK_SHARED_GPU=1"):
        common.init_dist()
    assert fake_nccl == []


def test_init_dist_without_a_gpu_names_the_command(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(MoKUnsupportedError, match=r"^mok.bench comm needs a CUDA GPU \(torch"):
        common.init_dist("mok.bench comm")


def test_draw_routing_is_the_spec_trace_of_the_bench_seed(monkeypatch):
    monkeypatch.setattr(dist, "get_world_size", lambda *a: 2)
    monkeypatch.setattr(dist, "get_rank", lambda *a: 1)
    monkeypatch.setattr(torch.Tensor, "cuda", lambda self, *a, **kw: self)
    idx, w, t = common.draw_routing(64, 16, 4, "hot:0.5")
    want = make_routing(64, 16, 4, 2, "hot:0.5", seed=bench_routing_seed(64))
    i1, w1 = want.rank_slice(1)
    assert torch.equal(idx, torch.from_numpy(i1)) and torch.equal(w, torch.from_numpy(w1))
    assert (t.topk_idx == want.topk_idx).all()
    other, _, _ = common.draw_routing(64, 16, 4, "hot:0.5", seed=5)
    assert not torch.equal(other, idx)


class _Event:
    """A CUDA event stand-in: call k (0-based, timed calls only) lasts (k % 5) ms."""

    calls = 0

    def __init__(self, enable_timing=False):
        self.t = None

    def record(self):
        self.t = _Event.calls

    def elapsed_time(self, end):
        return float(self.t % 5)


def test_time_cuda_local_warms_up_then_takes_the_median(monkeypatch):
    monkeypatch.setattr(torch.cuda, "Event", _Event)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    ran = []

    def fn():
        ran.append(1)
        _Event.calls += 1

    _Event.calls = 0
    us = common.time_cuda_local(fn, iters=5, warmup=2)
    assert len(ran) == 7
    # timed calls start at count 2: durations 2, 3, 4, 0, 1 ms -> sorted median 2 ms
    assert us == 2000.0


def test_warm_up_runs_for_its_seconds_then_times(monkeypatch):
    """``warm_s``: untimed calls go on past ``warmup`` until that much host time has passed
    (synchronised after each, so the host's clock follows the GPU's); the timed calls are
    ``iters`` more, and a sampler brackets only them."""
    monkeypatch.setattr(torch.cuda, "Event", _Event)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    now = [0.0]
    monkeypatch.setattr(common.time, "perf_counter", lambda: now[0])
    ran, opened = [], []

    def fn():
        ran.append(1)
        now[0] += 0.25  # each call: a quarter second
        _Event.calls += 1

    class Sampler:
        def __enter__(self):
            opened.append(len(ran))

        def __exit__(self, *exc):
            opened.append(len(ran))

    _Event.calls = 0
    common._event_times_us(fn, 3, 2, None, False, warm_s=1.0, sampler=Sampler())
    assert len(ran) == 4 + 3 and opened == [4, 7]  # 4 warm-up calls fill the second
    ran.clear()
    common._event_times_us(fn, 3, 6, None, False, warm_s=1.0)
    assert len(ran) == 6 + 3  # the count wins where it is longer


def test_clock_sampler_reads_in_the_background_and_gives_the_median(monkeypatch):
    from mok.bench import clocks

    values = [1980.0, 1700.0, 1650.0, 1600.0, 1500.0]

    def read():
        if not values:
            raise ValueError("no more")  # a failed read ends the sampling
        return values.pop(0)

    monkeypatch.setattr(clocks, "_reader", lambda device: read)
    with clocks.ClockSampler(0, period_s=0.001) as s:
        while values:
            pass
    assert s.samples == [1980.0, 1700.0, 1650.0, 1600.0, 1500.0]
    assert s.median_mhz() == 1650.0
    monkeypatch.setattr(clocks, "_reader", lambda device: None)  # nothing answers
    with clocks.ClockSampler(0) as s:
        pass
    assert s.samples == [] and s.median_mhz() is None


def test_parsers_keep_their_defaults():
    a = comm.build_parser().parse_args([])
    assert (a.csv, a.sms, a.engines, a.iters, a.warmup) == (
        "mok-bench-comm.csv",
        "24",
        "tma,vector",
        30,
        5,
    )
    la, sw = layer.build_parser().parse_args([]), layer.build_parser(sweep=True).parse_args([])
    assert (la.csv, la.modes, la.sms, la.minibatch) == (
        "mok-bench-layer.csv",
        "dedup_pull",
        "16",
        "4096",
    )
    assert (sw.csv, sw.modes, sw.sms, sw.minibatch) == (
        "mok-bench-sweep.csv",
        "pull,dedup_pull",
        "8,16,24,32",
        "1024,2048,4096,8192",
    )
    assert layer.build_parser(sweep=True).prog == "python -m mok.bench sweep"


def test_the_sm_budget_caps_every_launch_at_the_gpus_count(monkeypatch):
    from mok.sms import budget_sms, sm_budget

    class Props:
        multi_processor_count = 132

    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda *a, **k: Props())
    assert budget_sms(0) == 132  # no budget: every SM
    assert budget_sms(0, 40) == 40 and budget_sms(0, 500) == 132
    with sm_budget(33):
        assert budget_sms(0) == 33
        with sm_budget(0):
            assert budget_sms(0) == 132
        assert budget_sms(0, 50) == 50  # an explicit budget wins
    assert budget_sms(0) == 132


def test_one_rank_gather_only_where_the_run_stands_for_one_rank():
    """The per-rank work of EP N > 1 keeps its dispatch (a rank of EP N moves its rows); a run
    of one rank gathers; the switch is restored afterwards, also after an error."""
    import mok.layer as ml
    from mok.bench.common import one_rank_gather

    assert ml.GATHER_AT_ONE_RANK
    for emulated, want in ((0, True), (1, True), (2, False), (8, False)):
        with one_rank_gather(emulated):
            assert ml.GATHER_AT_ONE_RANK is want
        assert ml.GATHER_AT_ONE_RANK
    with pytest.raises(RuntimeError), one_rank_gather(2):
        raise RuntimeError("boom")
    assert ml.GATHER_AT_ONE_RANK


def test_phase_split_of_per_block_stamps():
    """Two calls of two blocks (us): the first call is left out; each phase runs from the last
    block past the one before it (the first from the first entry), the gap from the previous
    call's last exit."""
    t = torch.tensor(
        [
            [[0.0, 5.0, 9.0, 10.0], [1.0, 6.0, 8.0, 11.0]],
            [[20.0, 23.0, 30.0, 31.0], [21.0, 24.0, 33.0, 35.0]],
        ]
    )
    split = comm.phase_split(t, comm.SCHEDULE_PHASES)
    got = {k: v.tolist() for k, v in split.items()}
    assert got == {
        "exchange": [4.0],  # 24 - 20
        "tables": [9.0],  # 33 - 24
        "spread": [3.0],  # 33 - 30
        "positions": [2.0],  # 35 - 33
        "span": [15.0],  # 35 - 20
        "gap": [9.0],  # 20 - 11
    }
    assert list(comm.phase_split(t))[:2] == ["handshake", "stream"]
