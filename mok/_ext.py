"""Build and load the CUDA extension (csrc/) on first use.

JIT through ``torch.utils.cpp_extension.load`` (ninja) into ``$MOK_CACHE_DIR`` (default
``~/.cache/mok``); one log line when it compiles. The arch is detected from the current GPU
(:func:`mok.spec.arch.arch_paths`: sm_90a for Hopper, sm_100a / sm_103a for B200 / GB300)
unless ``MOK_CUDA_ARCH`` is set (e.g. ``90a``).
Nothing here runs at import time.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
from pathlib import Path

from mok.errors import MoKUnsupportedError
from mok.spec import limits

__all__ = [
    "load",
    "Params",
    "LayerArgs",
    "KERNELS",
    "MAX_RANKS",
    "MAX_TOPK",
    "csrc_dir",
    "detect_arch",
]

log = logging.getLogger("mok")

# The translation units of the extension, relative to csrc/ (everything else is headers).
SOURCES = (
    "torch/bindings.cpp",
    "comm/launch.cu",
    "layer/launch_sm90.cu",
    "layer/launch_sm90_bwd.cu",
    "probe/probe.cu",
)

MAX_RANKS = limits.MAX_RANKS
MAX_TOPK = 32
NUM_SIGNALS = 20
META_WORDS = 16
# mirrors csrc/params.h
KERNELS = {
    "schedule": 0,
    "dispatch_pull": 1,
    "dispatch_dedup_pull": 2,
    "dispatch_push": 3,
    "combine_push": 4,
    "combine_dedup_push": 5,
    "combine_pull": 6,
    "fanout": 7,
    "dedup_partials": 8,
    "dedup_sum": 9,
    "wait_x_free": 10,
    "zero_padding": 11,
}
FLAG_STAGE, FLAG_SHARED_FP32, FLAG_HAS_SHARED, FLAG_VECTOR, FLAG_NO_FANOUT = 1, 2, 4, 8, 16
FLAG_SKIP_LOCAL, FLAG_GATHER, FLAG_DEDUP = 32, 64, 128
FLAG_STAMPS, NUM_STAMPS = 256, 4  # per-block phase stamps (csrc/common/waits.cuh stamp())
FLAG_FAULT = 512  # tests only: a fused-layer worker fails at tile in3
FLAG_KEEP = 1024  # dedup_sum: more sums of these partials follow (no "consumed" signal)
FLAG_SOURCE_ORDER = 2048  # schedule: each expert's rows by source rank, then token
META = {
    "num_rows": 0,
    "num_dedup": 1,
    "abort": 2,
    "err_claim": 3,
    "bar_count": 4,
    "bar_gen": 5,
    "bad_input": 6,
    "bad_detail": 7,
    "last_count": 8,
}
SIGNALS = [
    "route_ready",
    "x_ready",
    "x_consumed",
    "recv_free",
    "recv_filled",
    "slots_free",
    "slots_filled",
    "y_ready",
    "y_consumed",
    "partials_ready",
    "partials_consumed",
    "layer_x_ready",
    "layer_x_consumed",
    "layer_slots_free",
    "layer_slots_filled",
    "bwd_staged",
    "bwd_slots_free",
    "bwd_slots_filled",
]
# Signals whose raiser stores an epoch (the others are added to, one per event; see
# csrc/common/waits.cuh: grid_signal_all, block_store_all and the direct st_release_sys stores).
STORED_SIGNALS = frozenset(
    SIGNALS.index(n)
    for n in (
        "x_consumed",
        "recv_filled",
        "slots_filled",
        "y_consumed",
        "partials_ready",
        "partials_consumed",
        "layer_x_consumed",
        "layer_slots_filled",
        "bwd_staged",
        "bwd_slots_free",
        "bwd_slots_filled",
    )
)
WAIT_GRID_BARRIER = 100
# Waits on local counters of the fused layer (csrc/params.h WaitId).
LOCAL_WAITS = {
    100: "grid barrier",
    101: "layer minibatch ready",
    102: "layer gate/up row block done",
    103: "layer receive ring free",
    104: "layer h ring free",
    105: "layer x staged",
    106: "layer dedup rows pulled",
    107: "layer GEMM pipeline stage",
    108: "backward dh tiles done",
    109: "backward rows copied",
    110: "backward d_a tiles done",
    111: "backward x / dy staged",
}
ERR_TIMEOUT, ERR_CAPACITY, ERR_BAD_EXPERT, ERR_DUP_EXPERT, ERR_UNSUPPORTED = 1, 2, 3, 4, 5
ERR_TOO_MANY_TOKENS = 6
ERR_FAULT = 7
ERR_FIELDS = 8  # int64 words of the error record (csrc/params.h kErrFieldCount)
# Routing status words per (parity, rank) (csrc/params.h RouteStatus).
ROUTE_STATUS_WORDS = 4

_I32 = ctypes.c_int32
_I64 = ctypes.c_int64
_U64 = ctypes.c_uint64


class Params(ctypes.Structure):
    """ctypes mirror of ``mok::Params`` (csrc/params.h)."""

    _fields_ = [
        *[
            (n, _I32)
            for n in (
                "rank",
                "num_ranks",
                "num_tokens",
                "num_topk",
                "num_experts",
                "num_local_experts",
                "row_tile",
                "capacity",
                "chunk_tokens",
                "num_chunks",
                "minibatch_rows",
                "num_minibatches",
                "hidden",
                "flags",
            )
        ],
        ("row_bytes", _I64),
        ("epoch", _I64),
        ("timeout_ns", _U64),
        ("sym_base", _U64 * MAX_RANKS),
        *[
            (n, _I64)
            for n in (
                "off_signals",
                "off_route_status",
                "off_route_idx",
                "off_route_w",
                "off_x",
                "off_recv",
                "off_slots",
                "off_y",
                "off_partials",
            )
        ],
        ("sched", _U64),
        *[
            (n, _I64)
            for n in (
                "o_counts",
                "o_offsets",
                "o_src_rank",
                "o_src_index",
                "o_dst_rank",
                "o_dst_index",
                "o_dedup_src_rank",
                "o_dedup_src_token",
                "o_dedup_slot",
                "o_fanout",
                "o_fan_rows",
                "o_fan_w",
                "o_hist",
                "o_dhist",
                "o_dcount",
                "o_meta",
                "o_ready",
            )
        ],
        ("error", _U64),
        ("in0", _U64),
        ("in1", _U64),
        ("in2", _U64),
        ("in3", _U64),
        ("out0", _U64),
        ("max_tokens", _I32),
        ("pad0", _I32),
    ]


class LayerArgs(ctypes.Structure):
    """ctypes mirror of ``mok::LayerArgs`` (csrc/params.h)."""

    _fields_ = [
        ("inter", _I32),
        ("shared_inter", _I32),
        ("num_comm_blocks", _I32),
        ("ring_rows", _I32),
        *[
            (n, _U64)
            for n in (
                "w_gate",
                "w_up",
                "w_down",
                "shared_w_gate",
                "shared_w_up",
                "shared_w_down",
                "h",
                "shared_h",
                "dedup",
                "counters",
            )
        ],
        ("counters_len", _I64),
        ("trace", _U64),
        ("trace_entries", _I64),
        ("gate_up_stride", _I64),
        ("gu32", _U64),
        ("shared_gu32", _U64),
    ]


_module = None


def csrc_dir() -> Path:
    env = os.environ.get("MOK_CSRC_DIR")
    return Path(env) if env else Path(__file__).resolve().parents[1] / "csrc"


def _versions() -> str:
    import torch

    nvcc = "not found"
    exe = shutil.which("nvcc") or (
        os.path.join(os.environ["CUDA_HOME"], "bin", "nvcc") if "CUDA_HOME" in os.environ else None
    )
    if exe and os.path.exists(exe):
        try:
            out = subprocess.run([exe, "--version"], capture_output=True, text=True, timeout=30)
            nvcc = out.stdout.strip().splitlines()[-1].split(",")[-1].strip() or "unknown"
        except (OSError, subprocess.SubprocessError):
            nvcc = "unusable"
    return f"torch {torch.__version__}, CUDA {torch.version.cuda}, nvcc {nvcc}"


def detect_arch() -> str:
    """The extension's nvcc target for the current GPU (``90a``, ``100a``, ``103a``), or
    ``$MOK_CUDA_ARCH``."""
    import torch

    env = os.environ.get("MOK_CUDA_ARCH")
    if env:
        return env.removeprefix("sm_")
    if not torch.cuda.is_available():
        raise MoKUnsupportedError(
            f"mok's kernels need a CUDA GPU (torch.cuda.is_available() is False; {_versions()}); "
            "the reference and the simulator run on the CPU"
        )
    from mok.spec.arch import arch_paths, supported_text

    cap = torch.cuda.get_device_capability()
    paths = arch_paths(cap)
    if paths.build is None:
        raise MoKUnsupportedError(
            f"mok's kernels are built for compute capability {supported_text()}; found "
            f"{paths.name} on {torch.cuda.get_device_name()} ({_versions()}). The reference "
            "layer runs on the CPU (device='cpu'); MOK_CUDA_ARCH (e.g. 90a) forces a target"
        )
    return paths.build


def load():
    """The compiled extension (built on first call, then cached on disk and in memory)."""
    global _module
    if _module is not None:
        return _module
    import torch
    from torch.utils import cpp_extension

    arch = detect_arch()
    src = csrc_dir()
    sources = [src / s for s in SOURCES]
    missing = [str(s) for s in sources if not s.exists()]
    if missing:
        raise MoKUnsupportedError(f"mok's CUDA sources are missing: {missing} (MOK_CSRC_DIR?)")
    digest = hashlib.sha256()
    for f in sorted(src.rglob("*")):
        if f.suffix in (".h", ".cuh", ".cu", ".cpp"):
            digest.update(f.relative_to(src).as_posix().encode() + f.read_bytes())
    digest.update(f"{torch.__version__} {torch.version.cuda} {arch}".encode())
    name = f"mok_ext_{arch}_{digest.hexdigest()[:12]}"
    cache = Path(os.environ.get("MOK_CACHE_DIR", Path.home() / ".cache" / "mok"))
    build_dir = cache / name
    build_dir.mkdir(parents=True, exist_ok=True)
    if not any(build_dir.glob(f"{name}*.so")):
        log.warning("mok: compiling the CUDA extension for sm_%s into %s (once)", arch, build_dir)
    major = arch.rstrip("a")
    arch_list = f"{major[:-1]}.{major[-1]}" + ("a" if arch.endswith("a") else "")
    old = os.environ.get("TORCH_CUDA_ARCH_LIST")
    os.environ["TORCH_CUDA_ARCH_LIST"] = arch_list
    try:
        mod = cpp_extension.load(
            name=name,
            sources=[str(s) for s in sources],
            extra_include_paths=[str(src)],
            extra_cflags=["-O3", "-std=c++17"],
            extra_cuda_cflags=["-O3", "-std=c++17", "-lineinfo"],
            build_directory=str(build_dir),
            verbose=os.environ.get("MOK_VERBOSE_BUILD", "0") == "1",
        )
    except Exception as e:  # noqa: BLE001 - re-raised with the environment attached
        raise MoKUnsupportedError(
            f"building mok's CUDA extension for sm_{arch} failed ({_versions()}): {e}"
        ) from e
    finally:
        if old is None:
            os.environ.pop("TORCH_CUDA_ARCH_LIST", None)
        else:
            os.environ["TORCH_CUDA_ARCH_LIST"] = old
    if mod.params_size() != ctypes.sizeof(Params):
        raise MoKUnsupportedError(
            f"csrc/params.h Params is {mod.params_size()} bytes but mok/_ext.py mirrors "
            f"{ctypes.sizeof(Params)}; keep them in sync"
        )
    if mod.layer_args_size() != ctypes.sizeof(LayerArgs):
        raise MoKUnsupportedError(
            f"csrc/params.h LayerArgs is {mod.layer_args_size()} bytes but mok/_ext.py mirrors "
            f"{ctypes.sizeof(LayerArgs)}; keep them in sync"
        )
    _module = mod
    return mod
