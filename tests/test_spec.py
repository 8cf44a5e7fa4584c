"""The shared contract (mok.spec): torch-free, its fused limits match the CUDA header, and the
reasons it gives are the ones the simulator's tuner and the torch API report."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from mok.spec.config import MoKConfig
from mok.spec.limits import (
    FUSED_BLOCK_ROWS,
    FUSED_HIDDEN_TILE,
    FUSED_INTER_TILE,
    FUSED_MAX_LOCAL_EXPERTS,
    FUSED_ROW_TILES,
    config_problems,
    shape_problems,
    why_unsupported,
)
from mok.spec.rows import bench_routing_seed, row_routing_seed

ROOT = Path(__file__).resolve().parents[1]


def _constexpr(header: str, name: str) -> int:
    text = (ROOT / "csrc" / header).read_text()
    m = re.search(rf"constexpr\s+int\s+{name}\s*=\s*(\d+)\s*;", text)
    assert m, f"{name} not found in csrc/{header}"
    return int(m.group(1))


def test_fused_tiles_match_the_kernel():
    tile_m, tile_n = (
        _constexpr("layer/sm90_gemm.cuh", "kTileM"),
        _constexpr("layer/sm90_gemm.cuh", "kTileN"),
    )
    assert tile_m == FUSED_BLOCK_ROWS
    assert tile_n == FUSED_HIDDEN_TILE  # down-projection output columns per tile
    assert tile_n // 2 == FUSED_INTER_TILE  # a gate/up tile: half gate, half up columns
    assert (tile_m // 2, tile_m) == FUSED_ROW_TILES  # 64-row regions run as half tiles
    assert _constexpr("layer/sm90_fwd.cuh", "kMaxLocalExperts") == FUSED_MAX_LOCAL_EXPERTS


def test_too_many_local_experts_is_refused_with_the_count():
    cfg = MoKConfig(minibatch_size=2048, row_tile=128, num_comm_sms=16)
    ok = FUSED_MAX_LOCAL_EXPERTS
    assert why_unsupported(cfg, 7168, 2048, 2048, "bf16", 132, num_local_experts=ok) == []
    (why,) = why_unsupported(cfg, 7168, 2048, 2048, "bf16", 132, num_local_experts=ok + 1)
    assert f"at most {ok} experts per rank" in why and f"found {ok + 1}" in why


def test_spec_and_sim_import_without_torch():
    code = (
        "import sys; sys.modules['torch'] = None\n"
        "import mok, mok.spec.config, mok.spec.limits, mok.spec.rows, mok.spec.workload\n"
        "import sim.fused.tune, sim.layer.sweep, sim.app.validate, sim.app.cli\n"
        "assert 'torch' not in {m for m in sys.modules if sys.modules[m] is not None}\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr


def test_supported_config_has_no_reasons():
    cfg = MoKConfig(minibatch_size=2048, row_tile=128, num_comm_sms=16)
    assert why_unsupported(cfg, 7168, 2048, 2048, "bf16", num_sms=132) == []


@pytest.mark.parametrize(
    ("changes", "needle"),
    [
        ({"dispatch_mode": "pull", "combine_mode": "pull"}, "combine_mode push"),
        ({"dispatch_mode": "push"}, "dispatch_mode pull or dedup_pull"),
        ({"row_tile": 16}, "row_tile in (64, 128)"),
        ({"row_tile": 64, "minibatch_size": 1088}, "minibatch_size % 128 == 0"),
        ({"num_comm_sms": 132}, "1 <= num_comm_sms < 132"),
    ],
)
def test_config_reasons(changes, needle):
    cfg = MoKConfig(**{"minibatch_size": 2048, "row_tile": 128, "num_comm_sms": 16, **changes})
    why = config_problems(cfg, num_sms=132)
    assert len(why) == 1 and needle in why[0], why


def test_shape_reasons_name_every_problem():
    why = shape_problems(1000, 100, 64, "fp32", name="toy")
    assert len(why) == 4, why
    assert why[0].startswith("toy: ") and "hidden % 256" in why[0]
    assert "intermediate % 128 == 0 (found 100)" in why[1]
    assert "shared intermediate % 128 == 0 (found 64)" in why[2]
    assert "bf16 tokens (found fp32)" in why[3]
    assert shape_problems(7168, 2048, 0) == []  # no shared expert is fine


def test_routing_seed_rule():
    assert bench_routing_seed(4096) == 4096
    assert row_routing_seed({"tokens_per_rank": "512"}) == 512  # files before the column
    assert row_routing_seed({"tokens_per_rank": "512", "routing_seed": ""}) == 512
    assert row_routing_seed({"tokens_per_rank": "512", "routing_seed": "7"}) == 7


def test_git_sha_names_the_commit_and_flags_uncommitted_changes(monkeypatch):
    from mok.spec.rows import git_sha

    monkeypatch.setenv("MOK_GIT_SHA", "feed123")
    assert git_sha() == "feed123"
    monkeypatch.delenv("MOK_GIT_SHA")
    sha = git_sha()
    assert sha == "unknown" or re.fullmatch(r"[0-9a-f]{7,}(-dirty)?", sha), sha
