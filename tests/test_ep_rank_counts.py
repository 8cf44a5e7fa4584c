"""Rank-count assumptions of the multi-rank paths, checked on the CPU at EP1, EP2, EP4 and EP8.

The EP4/EP8 GPU tests need 4 or 8 NVLink-connected GPUs; what does not need them is checked
here: the parameter block that mok/_ext.py packs against csrc/params.h (compiled with the host
C++ compiler), the workspace layout and parameter values built by :class:`mok.workspace.Workspace`
for 4 and 8 ranks (its CUDA and symmetric-memory calls replaced by stand-ins on the meta device,
so nothing is allocated), the index extents the kernels touch, int32 headroom at the DeepSeek-V3
EP8 shape, the error above kMaxRanks ranks, the reference schedule at 4 and 8 ranks against
loop-by-loop transcriptions, the device-side formulas that only matter above 2 ranks, and the
receive capacity of the GPU workers' EP4/EP8 problems.
"""

from __future__ import annotations

import ctypes
import math
import shutil
import subprocess
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from mok import MoKConfig, _ext
from mok.errors import MoKInputError, MoKUnsupportedError
from mok.spec.workload import make_routing
from mok.workspace import HOST_REGIONS
from reference.schedule import build_all_schedules, build_schedule, required_rows
from tests.schedule_bruteforce import brute_force_pull_rows

ROOT = Path(__file__).resolve().parents[1]
INT32_MAX = 2**31 - 1
RANK_COUNTS = [1, 2, 4, 8, 16, 32, 64, 72]


# ---- parameter block: mok/_ext.py against csrc/params.h -------------------------------------


def _camel(name: str) -> str:
    return "".join(part.capitalize() for part in name.lower().split("_"))


# Python constant -> C++ constant of csrc/params.h (values must agree).
_SIGNALS_CPP = [
    "kSigRoute",
    "kSigXReady",
    "kSigXConsumed",
    "kSigRecvFree",
    "kSigRecvFilled",
    "kSigSlotsFree",
    "kSigSlotsFilled",
    "kSigYReady",
    "kSigYConsumed",
    "kSigPartReady",
    "kSigPartConsumed",
    "kSigLayerXReady",
    "kSigLayerXConsumed",
    "kSigLayerSlotsFree",
    "kSigLayerSlotsFilled",
    "kSigBwdStaged",
    "kSigBwdSlotsFree",
    "kSigBwdSlotsFilled",
]
_WAITS_CPP = {
    100: "kWaitGridBarrier",
    101: "kWaitLayerReady",
    102: "kWaitLayerGateUp",
    103: "kWaitLayerRecvFree",
    104: "kWaitLayerHFree",
    105: "kWaitLayerStaged",
    106: "kWaitLayerPulled",
    107: "kWaitLayerPipeline",
    108: "kWaitBwdDgrad",
    109: "kWaitBwdCopy",
    110: "kWaitBwdDa",
    111: "kWaitBwdStaged",
}
_ERROR_FIELDS_CPP = ["Code", "Wait", "Peer", "Observed", "Expected", "Rank", "Epoch", "Extra"]


def _constants() -> dict[str, int]:
    """Python value of every mirrored constant, keyed by its C++ name."""
    c = {
        "kMaxRanks": _ext.MAX_RANKS,
        "kMaxTopk": _ext.MAX_TOPK,
        "kNumSignals": _ext.NUM_SIGNALS,
        "kMetaWords": _ext.META_WORDS,
        "kErrFieldCount": len(_ERROR_FIELDS_CPP),
        "kErrTimeout": _ext.ERR_TIMEOUT,
        "kErrCapacity": _ext.ERR_CAPACITY,
        "kErrBadExpert": _ext.ERR_BAD_EXPERT,
        "kErrDuplicateExpert": _ext.ERR_DUP_EXPERT,
        "kErrUnsupported": _ext.ERR_UNSUPPORTED,
        "kErrTooManyTokens": _ext.ERR_TOO_MANY_TOKENS,
        "kErrFault": _ext.ERR_FAULT,
        "kRouteStatusWords": _ext.ROUTE_STATUS_WORDS,
    }
    c |= {f"kKernel{_camel(k)}": v for k, v in _ext.KERNELS.items()}
    c |= {f"kMeta{_camel(k)}": v for k, v in _ext.META.items()}
    for name in dir(_ext):
        if name.startswith("FLAG_"):
            c[f"kFlag{_camel(name[5:])}"] = getattr(_ext, name)
    c |= {cpp: i for i, cpp in enumerate(_SIGNALS_CPP)}
    assert len(_SIGNALS_CPP) == len(_ext.SIGNALS)
    c |= {cpp: v for v, cpp in _WAITS_CPP.items()}
    assert set(_WAITS_CPP) == set(_ext.LOCAL_WAITS) and _ext.WAIT_GRID_BARRIER == 100
    c |= {f"kErrField{f}": i for i, f in enumerate(_ERROR_FIELDS_CPP)}
    return c


@pytest.fixture(scope="module")
def cpp_layout(tmp_path_factory) -> dict[str, int]:
    """Sizes, field offsets and constants of csrc/params.h as the host C++ compiler lays them
    out (params.h is plain C++; the bindings only compare sizeof(Params) at run time)."""
    cxx = shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")
    if cxx is None:
        pytest.skip("needs a host C++ compiler (c++, g++ or clang++)")
    lines = []
    for struct in (_ext.Params, _ext.LayerArgs):
        s = struct.__name__
        lines.append(f'std::printf("sizeof.{s} %zu\\n", sizeof(mok::{s}));')
        for name, _ in struct._fields_:
            lines.append(
                f'std::printf("{s}.{name} %zu %zu\\n", offsetof(mok::{s}, {name}), '
                f"sizeof(static_cast<mok::{s}*>(nullptr)->{name}));"
            )
    for cpp in _constants():
        lines.append(f'std::printf("const.{cpp} %lld\\n", static_cast<long long>(mok::{cpp}));')
    body = "\n  ".join(lines)
    src = (
        f'#include <cstddef>\n#include <cstdio>\n#include "params.h"\nint main() {{\n  {body}\n}}\n'
    )
    d = tmp_path_factory.mktemp("params_layout")
    (d / "layout.cpp").write_text(src)
    exe = d / "layout"
    build = subprocess.run(
        [cxx, "-std=c++17", f"-I{ROOT / 'csrc'}", str(d / "layout.cpp"), "-o", str(exe)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert build.returncode == 0, f"csrc/params.h lacks a name mok/_ext.py uses:\n{build.stderr}"
    out = subprocess.run([str(exe)], capture_output=True, text=True, timeout=60, check=True)
    layout = {}
    for line in out.stdout.splitlines():
        key, *vals = line.split()
        layout[key] = tuple(int(v) for v in vals) if len(vals) > 1 else int(vals[0])
    return layout


@pytest.mark.parametrize("struct", [_ext.Params, _ext.LayerArgs], ids=lambda s: s.__name__)
def test_ctypes_mirror_matches_params_h(cpp_layout, struct):
    # Field by field: a swap of two fields of one size keeps sizeof equal, which is all the
    # bindings check on a launch.
    s = struct.__name__
    assert ctypes.sizeof(struct) == cpp_layout[f"sizeof.{s}"]
    for name, ctype in struct._fields_:
        field = getattr(struct, name)
        assert (field.offset, ctypes.sizeof(ctype)) == cpp_layout[f"{s}.{name}"], name
    # One symmetric base address per rank, kMaxRanks of them.
    assert _ext.Params.sym_base.size == cpp_layout["Params.sym_base"][1] == 8 * _ext.MAX_RANKS


def test_mirrored_constants_match_params_h(cpp_layout):
    for cpp, value in _constants().items():
        assert cpp_layout[f"const.{cpp}"] == value, cpp
    assert len(_ext.SIGNALS) <= _ext.NUM_SIGNALS


def test_more_than_max_ranks_cannot_reach_the_parameter_block():
    p = _ext.Params()
    for r in range(_ext.MAX_RANKS):
        p.sym_base[r] = (r + 1) << 40
    with pytest.raises(IndexError):
        p.sym_base[_ext.MAX_RANKS] = 1
    assert list(p.sym_base) == [(r + 1) << 40 for r in range(_ext.MAX_RANKS)]


# ---- the workspace at 4 and 8 ranks, without a GPU ------------------------------------------


class _Handle:
    """Stand-in for the symmetric-memory rendezvous handle."""

    def __init__(self, ptrs: list[int]):
        self.buffer_ptrs = ptrs

    def barrier(self) -> None:
        pass


@pytest.fixture
def fake_group(monkeypatch):
    """``make(num_ranks, rank, ...)`` builds a real :class:`Workspace` as rank ``rank`` of a
    ``num_ranks`` group: torch.distributed answers for the group, the symmetric allocation is a
    meta tensor, and the CUDA calls of the constructor are no-ops. Records the allocations."""
    import torch.distributed as dist
    import torch.distributed._symmetric_memory as symm_mem

    from mok import workspace

    allocs: list[int] = []
    state = {"rank": 0, "world": 1}
    monkeypatch.setattr(dist, "is_available", lambda: True)
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_rank", lambda group=None: state["rank"])
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: state["world"])

    def empty(nbytes, dtype, device):
        allocs.append(nbytes)
        return torch.empty(nbytes, dtype=dtype, device="meta")

    def rendezvous(t, group):
        # Peers at distinct fake addresses; mine is the tensor's (0 on the meta device).
        ptrs = [(r + 1) << 40 for r in range(state["world"])]
        ptrs[state["rank"]] = t.data_ptr()
        return _Handle(ptrs)

    monkeypatch.setattr(symm_mem, "empty", empty)
    monkeypatch.setattr(symm_mem, "rendezvous", rendezvous)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
    monkeypatch.setattr(
        torch.cuda,
        "get_device_properties",
        lambda *a, **k: SimpleNamespace(multi_processor_count=132),
    )
    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda self, *a, **k: self)
    monkeypatch.setattr(_ext, "load", lambda: SimpleNamespace(host_device_pointer=lambda p: 0x1000))
    monkeypatch.setattr(workspace, "_by_handle", {})

    def make(num_ranks, rank, num_tokens, hidden, num_topk, num_experts, config=None, fused=False):
        state["rank"], state["world"] = rank, num_ranks
        shapes = workspace.Shapes(num_tokens, hidden, num_topk, num_experts, torch.bfloat16)
        cfg = config or MoKConfig()
        return workspace.Workspace(shapes, cfg, object(), torch.device("meta"), fused)

    make.allocs = allocs
    return make


def _sym_extents(ws) -> dict[str, int]:
    """Bytes past each symmetric region's start that the kernels touch (largest index + 1),
    from their index expressions, every rank and parity included."""
    R, N, K = ws.num_ranks, ws.shapes.max_tokens, ws.shapes.num_topk
    H, NK, cap = ws.shapes.hidden, N * K, ws.capacity
    M, par = _ext.MAX_RANKS, 1  # the odd parity of the double-buffered route area
    return {
        # sync.cuh my_signal / peer_signal: kind * kMaxRanks + peer
        "signals": ((_ext.NUM_SIGNALS - 1) * M + (R - 1) + 1) * 8,
        # schedule.cuh phase 0: status[(par * kMaxRanks + me) * kRouteStatusWords + word]
        "route_status": ((par * M + R - 1) * _ext.ROUTE_STATUS_WORDS + 2 + 1) * 4,
        # schedule.cuh phase 0: [(par * R + me) * NK + i]
        "route_idx": ((par * R + R - 1) * NK + NK - 1 + 1) * 4,
        "route_w": ((par * R + R - 1) * NK + NK - 1 + 1) * 4,
        # dispatch.cuh PullMeta / DedupMeta: token * row_bytes, token < N
        "x": N * ws.row_bytes,
        # sm90_bwd_fused.cuh fused_stage_tokens / fused_copy_rows: token * H, token < N
        "dy": N * H * 2,
        # dispatch_push_kernel: pos * row_bytes, pos < capacity
        "recv": cap * ws.row_bytes,
        # combine_push_kernel: src_index (token * K + k) * hidden * 2
        "slots": NK * H * 2,
        "y": cap * H * 2,
        # combine.cuh PartialsMeta: row < partials_rows = min(R * N, capacity) (the dedup rows);
        # partials_index: after those rows, int32 [token * K + j]
        "partials": min(R * N, cap) * H * 2 + ((N - 1) * K + K - 1 + 1) * 4,
        # mok.comm.stage_row_grads / pull_row_grads, sm90_bwd_fused.cuh fused_stage_row_grads:
        # one fp32 per receive row
        "row_grads": cap * 4,
    }


def _sched_extents(ws) -> dict[str, int]:
    """int32 elements past each schedule region's start that the kernels touch."""
    R, N, K, E = ws.num_ranks, ws.shapes.max_tokens, ws.shapes.num_topk, ws.shapes.num_experts
    L, NC, cap = ws.num_local_experts, ws.num_chunks, ws.capacity
    D = R * N  # most dedup rows a rank can hold (test_dedup_rows_reach_num_ranks_times_tokens)
    return {
        "counts": (E - 1) * R + R - 1 + 1,  # counts[e * R + r]
        "offsets": (R - 1) * (L + 1) + L + 1,  # offsets[d * (L + 1) + l + 1]
        "src_rank": cap,
        "src_index": cap,
        "dst_rank": N * K,
        "dst_index": N * K,
        "dedup_src_rank": D,
        "dedup_src_token": D,
        "dedup_slot": D,
        "fanout": cap,
        "fan_rows": (D - 1) * K + K - 1 + 1,  # fan_rows[dpos * K + j]
        "fan_w": (D - 1) * K + K - 1 + 1,
        "hist": ((R - 1) * NC + NC - 1) * E + E - 1 + 1,  # hist[(r * NC + ch) * E + e]
        "dhist": (R - 1) * NC + NC - 1 + 1,
        "dcount": R,
        "meta": _ext.META_WORDS,
        "ready": ws.num_minibatches,
    }


def _assert_regions_fit(offsets: dict[str, int], extents: dict[str, int], total: int, align: int):
    names = sorted(offsets, key=offsets.get)
    assert set(names) == set(extents)
    for a, b in zip(names, names[1:], strict=False):
        assert offsets[a] + extents[a] <= offsets[b], f"{a} overlaps {b}"
    last = names[-1]
    assert offsets[last] + extents[last] <= total
    assert all(off % align == 0 for off in offsets.values())


@pytest.mark.parametrize("num_ranks", RANK_COUNTS)
def test_workspace_layout_covers_every_rank(fake_group, num_ranks):
    N, H, K, E = 333, 2048, 8, 16 * num_ranks
    for rank in sorted({0, num_ranks - 1}):
        ws = fake_group(num_ranks, rank, N, H, K, E, MoKConfig(minibatch_size=512))
        assert (ws.rank, ws.num_ranks, ws.num_local_experts) == (rank, num_ranks, 16)
        _assert_regions_fit(ws.sym_off, _sym_extents(ws), ws.sym.numel(), 256)
        _assert_regions_fit(ws.sched_off, _sched_extents(ws), ws.sched.numel(), 64)
        assert ws.error.numel() == len(_ERROR_FIELDS_CPP)  # kErrFieldCount int64 words
        p = ws.params("x")
        assert (p.rank, p.num_ranks, p.num_local_experts) == (rank, num_ranks, 16)
        assert list(p.sym_base[:num_ranks]) == ws.sym_ptrs
        assert all(ptr == 0 for ptr in p.sym_base[num_ranks:])
        # Peers' bases are distinct: a kernel's c.sym(peer, off) never aliases another rank.
        assert len(set(ws.sym_ptrs)) == num_ranks
        for name, off in ws.sym_off.items():
            if name not in HOST_REGIONS:  # regions no kernel addresses have no Params field
                assert getattr(p, f"off_{name}") == off
        for name, off in ws.sched_off.items():
            assert getattr(p, f"o_{name}") == off
        # Views the Python API hands out: a row per dedup row, at most num_ranks * num_tokens
        # and at most the receive rows (a dedup row has one there at least)
        rows = min(num_ranks * N, ws.capacity)
        assert tuple(ws.partials_buffer.shape) == (rows, H)
        assert tuple(ws.dedup_buffer.shape) == (rows, H)
    assert len(fake_group.allocs) == (2 if num_ranks > 1 else 1)


@pytest.mark.parametrize("num_ranks", [73, 128])
def test_more_than_max_ranks_is_a_clear_error_before_any_allocation(fake_group, num_ranks):
    with pytest.raises(MoKUnsupportedError, match=rf"1 to 72 ranks .*; found {num_ranks}"):
        fake_group(num_ranks, num_ranks - 1, 64, 256, 4, 16 * num_ranks)
    assert fake_group.allocs == []


def test_experts_must_split_evenly_at_ep8(fake_group):
    split = (
        "num_experts=20 does not split evenly over 8 ranks .* nearest EP sizes that do: EP5 / EP10"
    )
    with pytest.raises(MoKInputError, match=split):
        fake_group(8, 3, 64, 256, 4, 20)
    assert fake_group.allocs == []


def test_dedup_rows_reach_num_ranks_times_tokens():
    # The dedup schedule arrays hold num_ranks * num_tokens rows (the dedup buffer and the
    # partials min(that, capacity)): the worst case, every token of every rank on one rank, is
    # a row for every (rank, token).
    R, N, K, E = 8, 37, 4, 64
    idx = torch.stack([torch.arange(K) for _ in range(R * N)]).view(R, N, K)  # all on rank 0
    s = build_schedule(idx, E, rank=0, row_tile=8)
    assert s.num_dedup_rows == R * N
    partial_rows = s.dedup_src_rank * N + s.dedup_src_token
    assert sorted(partial_rows.tolist()) == list(range(R * N))


# ---- int32 headroom at the largest shape in use ----------------------------------------------


def test_deepseek_v3_ep8_shape_fits_int32_indices_and_int64_offsets(fake_group):
    # DeepSeek-V3: hidden 7168, 256 experts, top-8; 16384 tokens per rank; capacity factor 2.
    R, N, H, K, E = 8, 16384, 7168, 8, 256
    ws = fake_group(R, R - 1, N, H, K, E, MoKConfig(capacity_factor=2.0))
    # 2 * 16384 * 8 routed rows + 32 local experts * 127 padding rows, to 128-row tiles.
    assert ws.capacity == 266240
    assert ws.capacity * ws.row_bytes == 3_816_816_640  # receive buffer > 2 GiB
    assert ws.sym_off["slots"] > INT32_MAX and ws.sym_off["partials"] > INT32_MAX
    p = ws.params("x")
    for name, ctype in _ext.Params._fields_:
        if name.startswith(("off_", "o_")) or name == "row_bytes":
            assert ctype is ctypes.c_int64, f"{name} holds byte/element offsets: needs int64"
    for name, off in ws.sym_off.items():
        if name not in HOST_REGIONS:
            assert getattr(p, f"off_{name}") == off  # no truncation through ctypes
    # Every int32 field of Params holds its value (ctypes truncates silently).
    expect = {
        "rank": R - 1,
        "num_ranks": R,
        "num_tokens": N,
        "max_tokens": N,
        "num_topk": K,
        "num_experts": E,
        "num_local_experts": E // R,
        "capacity": ws.capacity,
        "num_chunks": ws.num_chunks,
        "num_minibatches": ws.num_minibatches,
        "hidden": H,
    }
    for name, value in expect.items():
        assert getattr(p, name) == value, name
    # int32 indices of the device code (region offsets o_* / off_* are int64; indices inside a
    # region are int): rows, schedule entries and route entries.
    NK = N * K
    int32_extents = {
        "route index (schedule.cuh phase 0)": 2 * R * NK,
        "fan_rows index (dpos * K + j)": R * N * K,
        "hist index ((r * NC + ch) * E + e)": R * ws.num_chunks * E,
        "receive row (capacity)": ws.capacity,
        "padded rows needed in the worst case (R * N * K + L * (row_tile - 1))": R * NK
        + (E // R) * (ws.config.row_tile - 1),
    }
    for what, n in int32_extents.items():
        assert n <= INT32_MAX, what
    # Headroom: the largest of them is > 1000x below int32 at this shape.
    assert max(int32_extents.values()) * 1000 < INT32_MAX


# ---- the reference schedule at 4 and 8 ranks against transcriptions -------------------------


def _brute_force_dedup(idx: torch.Tensor, num_experts: int, rank: int):
    """Loop-by-loop dedup rows of ``rank``: (src_rank, token, slot) in dedup-row order."""
    R, N, K = (int(v) for v in idx.shape)
    L = num_experts // R
    per_src = [
        [t for t in range(N) if any(int(e) // L == rank for e in idx[r, t])] for r in range(R)
    ]
    counts = [len(v) for v in per_src]
    rows: list = [None] * sum(counts)
    for r in range(R):
        for o, t in enumerate(per_src[r]):
            pos = sum(min(c, o) for c in counts) + sum(1 for q in range(r) if counts[q] > o)
            ordinal = len({int(e) // L for e in idx[r, t] if int(e) // L < rank})
            rows[pos] = (r, t, t * K + ordinal)
    return rows


# (num_ranks, num_tokens, num_topk, num_local_experts, skew, row_tile)
CASES = [
    (4, 40, 6, 3, "uniform", 8),
    (4, 33, 4, 2, "hot:0.9", 1),
    (8, 29, 8, 1, "uniform", 8),  # num_experts == num_ranks: every rank is a top-8 destination
    (8, 40, 8, 4, "zipf:1.5@0.7", 128),
    (8, 17, 1, 2, "hot:0.5", 4),
    (8, 0, 4, 2, "uniform", 8),
]


def _routing(num_ranks, num_tokens, num_topk, num_local, skew, seed=11):
    E = num_ranks * num_local
    t = make_routing(num_tokens, E, num_topk, num_ranks, skew, seed)
    return torch.from_numpy(t.per_rank().copy()), E


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"ep{c[0]}-n{c[1]}-k{c[2]}-{c[4]}")
def test_reference_schedule_against_transcriptions(case):
    R, N, K, L, skew, row_tile = case
    idx, E = _routing(R, N, K, L, skew)
    scheds = build_all_schedules(idx, E, row_tile)
    seen = torch.zeros(R, N * K, dtype=torch.int64)
    for s in scheds:
        off, rows = brute_force_pull_rows(idx, E, s.rank, row_tile)
        assert off == s.offsets.tolist()
        assert rows == list(zip(s.src_rank.tolist(), s.src_index.tolist(), strict=True))
        real = s.src_rank >= 0
        seen[s.src_rank[real], s.src_index[real]] += 1
        dedup = _brute_force_dedup(idx, E, s.rank)
        got = [s.dedup_src_rank.tolist(), s.dedup_src_token.tolist(), s.dedup_slot.tolist()]
        assert list(zip(*got, strict=True)) == dedup
        # Fan-out: each real receive row reads the dedup row of its (source, token).
        f = s.fanout[real]
        assert torch.equal(s.dedup_src_rank[f], s.src_rank[real])
        assert torch.equal(s.dedup_src_token[f], s.src_index[real] // K)
        # Push view of this rank's (token, k) agrees with the destination's pull view.
        for t in range(N):
            for k in range(K):
                d, p = int(s.dst_rank[t, k]), int(s.dst_index[t, k])
                assert d == int(idx[s.rank, t, k]) // L
                assert (int(scheds[d].src_rank[p]), int(scheds[d].src_index[p])) == (
                    s.rank,
                    t * K + k,
                )
    assert bool((seen == 1).all())


def test_ranks_that_receive_nothing_at_ep8():
    # Every token goes to experts of ranks 2 and 5 only: six ranks get empty schedules.
    R, N, K, L = 8, 12, 3, 2
    choices = torch.tensor([4, 5, 10, 11])
    g = torch.Generator().manual_seed(3)
    idx = torch.stack([choices[torch.randperm(4, generator=g)[:K]] for _ in range(R * N)])
    idx = idx.view(R, N, K)
    for s in build_all_schedules(idx, R * L, row_tile=4):
        if s.rank in (2, 5):
            assert s.num_rows > 0 and s.num_dedup_rows > 0
        else:
            assert s.num_rows == 0 and s.num_dedup_rows == 0 and s.offsets.tolist() == [0, 0, 0]
        assert brute_force_pull_rows(idx, R * L, s.rank, 4)[0] == s.offsets.tolist()


# ---- device-side formulas that only matter above two ranks ----------------------------------


def _round_robin_pos(counts: list[int], occ: int, src: int) -> int:
    """csrc/common/schedule.cuh round_robin_pos."""
    return sum(min(m, occ) + (1 if q < src and m > occ else 0) for q, m in enumerate(counts))


def _remote_dedup_row(dcount: list[int], me: int, i: int) -> int:
    """csrc/comm/dispatch.cuh remote_dedup_row: item i of the remote dedup rows -> its dedup row."""
    r = 0
    while r < len(dcount):
        if r != me:
            if i < dcount[r]:
                break
            i -= dcount[r]
        r += 1
    return _round_robin_pos(dcount, i, r)


@pytest.mark.parametrize("case", CASES[:5], ids=lambda c: f"ep{c[0]}-n{c[1]}-k{c[2]}-{c[4]}")
def test_remote_dedup_items_cover_the_peers_rows_once(case):
    # Dedup pull without this rank's own rows (skip_local, the fused layer's dedup pull): with
    # three or more sources the item numbering skips this rank between other sources' blocks.
    R, N, K, L, skew, _ = case
    idx, E = _routing(R, N, K, L, skew)
    for s in build_all_schedules(idx, E, 8):
        dcount = [int((s.dedup_src_rank == r).sum()) for r in range(R)]
        num_remote = s.num_dedup_rows - dcount[s.rank]  # num_remote_dedup
        rows = [_remote_dedup_row(dcount, s.rank, i) for i in range(num_remote)]
        want = (s.dedup_src_rank != s.rank).nonzero().squeeze(1).tolist()
        assert sorted(rows) == want
        # Source by source in ascending rank, each source's tokens in order.
        keys = [(int(s.dedup_src_rank[j]), int(s.dedup_src_token[j])) for j in rows]
        assert keys == sorted(keys)


@pytest.mark.parametrize("case", CASES[:5], ids=lambda c: f"ep{c[0]}-n{c[1]}-k{c[2]}-{c[4]}")
def test_dedup_sum_terms_match_the_owners_partials(case):
    # dedup_partials on owner d writes dedup row j's partial into its row j and stores j into
    # slot dedup_slot[j] (= token * K + d's place among the token's owners) of the home rank's
    # partials index (csrc/comm/combine_kernels.cuh). dedup_sum on home rank h reads, for token
    # t, term q of its owner mask (ascending rank) at row index[t * K + q] of that owner
    # (combine.cuh partials_row). Every entry read must have been written once, by that owner,
    # naming its row of (h, t); no other entry is written.
    R, N, K, L, skew, _ = case
    idx, E = _routing(R, N, K, L, skew)
    scheds = build_all_schedules(idx, E, 8)
    index: list[dict[int, tuple[int, int]]] = [{} for _ in range(R)]  # home: slot -> (owner, row)
    for d, sd in enumerate(scheds):
        for j in range(int(sd.num_dedup_rows)):
            h, slot = int(sd.dedup_src_rank[j]), int(sd.dedup_slot[j])
            assert slot not in index[h], (h, slot)
            index[h][slot] = (d, j)
    for h, s in enumerate(scheds):
        read = set()
        for t in range(N):
            mask = 0
            for d in s.dst_rank[t].tolist():
                mask |= 1 << d
            owners = [d for d in range(R) if (mask >> d) & 1]
            for q, d in enumerate(owners):
                owner, j = index[h][t * K + q]
                assert owner == d
                sd = scheds[d]
                assert (int(sd.dedup_src_rank[j]), int(sd.dedup_src_token[j])) == (h, t)
                read.add(t * K + q)
        assert read == set(index[h])
        # Dedup push combine: the owners of token t wrote slots t * K + 0 .. t * K + n - 1 of
        # its home rank (n distinct owners), the slots reduce_tokens reads (combine.cuh mode 1).
        for t in range(N):
            slots = sorted(
                int(sd.dedup_slot[j])
                for sd in scheds
                for j in (sd.dedup_src_rank == h).nonzero().squeeze(1).tolist()
                if int(sd.dedup_src_token[j]) == t
            )
            assert slots == [t * K + j for j in range(len(set(s.dst_rank[t].tolist())))]


# ---- the GPU workers' EP4/EP8 problems fit the receive buffer ---------------------------------


@pytest.mark.parametrize("num_ranks", [4, 8])
def test_layer_worker_problems_fit_at_ep4_ep8(num_ranks):
    from tests.dist import layer_worker as lw

    for hidden, inter, E, K, N, shared, skew in lw.SHAPES:
        assert E % num_ranks == 0
        t = make_routing(N, E, K, num_ranks, skew, seed=lw.SEED + K + N)
        idx = torch.from_numpy(t.topk_idx).view(num_ranks, N, K)
        for c in lw.CONFIGS:
            cfg = MoKConfig(**c)
            need = int(required_rows(idx, E, cfg.row_tile)[:, -1].max())
            cap = cfg.capacity_rows(N, K, E // num_ranks, num_ranks)
            assert need <= cap, (hidden, E, K, N, skew, c)
            # Fused-layer limits that do not depend on the GPU (functional._check_fused).
            assert hidden % 256 == 0 and inter % 128 == 0 and shared % 128 == 0


# Cases of tests/dist/mok_worker.py main() (hidden, num_topk, num_experts, tokens, skew).
MOK_WORKER_CASES = [
    (2048, 8, 128, 1000, "uniform"),
    (4096, 6, 64, 777, "hot:0.5"),
    (7168, 8, 256, 512, "hot:0.5"),
    (7168, 10, 64, 300, "uniform"),
    (2048, 1, 32, 513, "uniform"),
]


@pytest.mark.parametrize("num_ranks", [4, 8])
def test_mok_worker_problems_fit_at_ep4_ep8(num_ranks):
    from tests.dist import mok_worker as mw

    cfg = MoKConfig(num_comm_sms=8, minibatch_size=512)  # comm_case's config
    for hidden, K, E, N, skew in MOK_WORKER_CASES:
        assert E % num_ranks == 0
        t = make_routing(N, E, K, num_ranks, skew, seed=mw.SEED + hidden + K)
        idx = torch.from_numpy(t.topk_idx).view(num_ranks, N, K)
        need = int(required_rows(idx, E, cfg.row_tile)[:, -1].max())
        assert need <= cfg.capacity_rows(N, K, E // num_ranks, num_ranks), (hidden, K, E, N, skew)


def test_symmetric_bytes_per_rank_grow_with_num_ranks(fake_group):
    # Partials (symmetric) and the dedup buffer (local) are [min(num_ranks * num_tokens,
    # capacity), hidden]; everything else shrinks or stays as the ranks grow. DeepSeek-V3, 4096
    # tokens per rank.
    N, H, K, E = 4096, 7168, 8, 256
    sizes = {}
    counts = [R for R in RANK_COUNTS if E % R == 0]  # 256 experts: not 72 ranks
    for R in counts:
        ws = fake_group(R, 0, N, H, K, E)
        sizes[R] = ws.sym.numel()
        part, tail = ws.sym_off["partials"], ws.sym_off["row_grads"]
        rows = min(R * N, ws.capacity)
        assert tail - part == math.ceil((rows * H * 2 + N * K * 4) / 256) * 256
        assert ws.sym.numel() - tail == math.ceil(ws.capacity * 4 / 256) * 256
    # From two ranks on the receive buffer depends on tokens, not ranks (the default factor, 2,
    # is below the cap); the partials add N * H * 2 per rank. One rank receives its own rows
    # only (the factor capped at 1): a smaller receive buffer.
    for a, b in zip(counts, counts[1:], strict=False):
        if a < 2:
            assert sizes[a] < sizes[b]
            continue
        assert sizes[b] - sizes[a] <= (b - a) * (N * H * 2 + 2 * N * K * 4 * 2)
