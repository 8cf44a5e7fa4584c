"""``fused="auto"``: the faster of the fused and the unfused forward, measured once per layer.

The fused forward kernel and the unfused path (mok's dispatch / combine around grouped GEMMs)
compute the same layer with different kernels, so which one is faster depends on the shape, the
GPU and, at EP > 1, the fabric. With ``fused="auto"`` (:class:`mok.MoE`, :func:`mok.functional.moe`,
:func:`mok.functional.moe_forward`) the first call of a layer on CUDA times both forwards on its
own inputs (:data:`WARMUP` untimed calls of each, then :data:`ITERS` timed calls of each,
alternating; CUDA events, the median), takes each path's slowest rank (every rank of ``group``
then picks the same path), and keeps the faster one for every later call with that key
(:func:`choice_key`: the shapes, the config, the group, the device and ``recompute``; not the
token count, which may differ between ranks and calls). The fused path must beat the unfused one
by :data:`MARGIN` to be chosen. Where the fused kernel does not run (the GPU, the shapes or the
config; :func:`fused_refusals`) nothing is timed and the unfused path is taken. Each choice is
logged on the ``mok`` logger at INFO with both times (:attr:`PathChoice.text`) and kept in
:func:`choices`.

The two paths do not give the same bits (their GEMMs sum in different orders), and a choice made
from timings may differ between runs, so ``"auto"`` is opt-in: pin the logged choice
(``fused=True`` / ``False``), or keep the choices in a file: with ``MOK_PATH_CHOICES`` naming a
JSON file, a layer whose key (:func:`file_key`: the GPU's name, the EP size, the sizes, the
config, ``recompute``) is in it takes the stored path without timing (when every rank of its
group finds the same one), and each new choice is added to it by the group's first rank, so
later runs repeat the first one's bits. The choice costs one
workspace of each path (both stay cached) and ``2 * (WARMUP + ITERS)`` forward calls, once.
Under ``torch.compile`` the choice must already have been made by an eager call of that key;
otherwise the unfused path runs (and a warning says so).
"""

from __future__ import annotations

import json
import logging
import os
import statistics
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from mok.errors import MoKInputError
from mok.reference_layer import group_size
from mok.spec.arch import arch_paths
from mok.spec.config import MoKConfig
from mok.spec.limits import why_unsupported
from mok.workspace import group_key

__all__ = [
    "AUTO",
    "ITERS",
    "MARGIN",
    "WARMUP",
    "PathChoice",
    "CHOICES_ENV",
    "check_fused_arg",
    "choice_key",
    "file_key",
    "choices",
    "clear_choices",
    "fused_refusals",
    "pick",
    "measured_choice",
    "resolve_fused",
    "time_paths",
]

AUTO = "auto"
CHOICES_ENV = "MOK_PATH_CHOICES"  # a JSON file of choices kept across runs
WARMUP = 2  # untimed calls of each path first
ITERS = 5  # timed calls of each path, alternating; the median is kept
MARGIN = 0.02  # the fused path is chosen when it is this much faster (ties: the unfused path)

_log = logging.getLogger("mok")
_choices: dict[tuple, PathChoice] = {}


@dataclass(frozen=True)
class PathChoice:
    """One ``fused="auto"`` decision: the path kept, the two forwards' median times (ms, the
    slowest rank's; ``fused_ms`` None where the fused kernel does not run) and why."""

    fused: bool
    unfused_ms: float | None
    fused_ms: float | None
    why: str

    @property
    def path(self) -> str:
        return "fused" if self.fused else "unfused"

    @property
    def text(self) -> str:
        return f"mok: fused='auto' runs the {self.path} forward: {self.why}"


def check_fused_arg(fused) -> None:
    """Raise :class:`MoKInputError` unless ``fused`` is True, False or ``"auto"``."""
    if not (isinstance(fused, bool) or fused == AUTO):
        raise MoKInputError(f"fused must be True, False or 'auto' (found {fused!r})")


def choice_key(x, weights, num_experts: int, num_topk: int, config: MoKConfig, group,
               recompute: bool) -> tuple:  # fmt: skip
    """The key a choice is kept under: what is the same on every rank and every call of one
    layer (hidden, intermediate, shared intermediate, top-k, experts, dtype, config, group,
    device, recompute). The token count is not in it: ranks and calls may differ there."""
    sg = getattr(weights, "shared_w_gate", None)
    return (
        group_key(group),
        x.device.index,
        int(x.shape[1]),
        int(weights.w_gate.shape[1]),
        0 if sg is None else int(sg.shape[0]),
        int(num_topk),
        int(num_experts),
        x.dtype,
        config,
        bool(recompute),
    )


def file_key(key: tuple, device_name: str) -> str:
    """:func:`choice_key` as the text a ``MOK_PATH_CHOICES`` file keeps it under: the GPU's name
    and the EP size instead of the device index and the group's name (which differ between
    runs and hosts)."""
    group, _, hidden, inter, shared, topk, experts, dtype, config, recompute = key
    ranks = group[1] if len(group) > 1 else 1
    cfg = json.dumps(asdict(config), sort_keys=True, separators=(",", ":"))
    return (
        f"{device_name}|ep={ranks}|hidden={hidden}|intermediate={inter}|shared={shared}|"
        f"topk={topk}|experts={experts}|{str(dtype).removeprefix('torch.')}|"
        f"recompute={recompute}|{cfg}"
    )


def _stored(path: str, name: str) -> PathChoice | None:
    """The choice kept under ``name`` in the JSON file at ``path`` (None: no file or no entry)."""
    try:
        entry = json.loads(Path(path).read_text()).get(name)
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        raise MoKInputError(f"{CHOICES_ENV}={path} is not a readable JSON object ({e})") from e
    if entry is None:
        return None
    why = f"{entry['why']} (stored in {path})"
    return PathChoice(bool(entry["fused"]), entry.get("unfused_ms"), entry.get("fused_ms"), why)


def _store(path: str, name: str, got: PathChoice) -> None:
    """Add ``got`` under ``name`` to the JSON file at ``path`` (written whole, then renamed)."""
    p = Path(path)
    data = json.loads(p.read_text()) if p.exists() else {}
    data[name] = {"fused": got.fused, "unfused_ms": got.unfused_ms, "fused_ms": got.fused_ms,
                  "why": got.why}  # fmt: skip
    tmp = p.with_name(p.name + f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
    os.replace(tmp, p)


def choices() -> dict[tuple, PathChoice]:
    """Every choice made in this process, by :func:`choice_key` (a copy)."""
    return dict(_choices)


def clear_choices() -> None:
    """Forget every choice (the next ``"auto"`` call of each layer measures again)."""
    _choices.clear()


def fused_refusals(x, weights, config: MoKConfig, num_local_experts: int, num_sms: int) -> list:
    """Why the fused forward cannot run this layer here (empty: it can): the GPU's path
    (:func:`mok.spec.arch.arch_paths`) and the fused layer's limits on the config and the sizes
    (:func:`mok.spec.limits.why_unsupported`). The same on every rank of a layer."""
    paths = arch_paths(torch.cuda.get_device_capability(x.device))
    if not paths.fused_forward:
        return [f"the fused layer does not run on {paths.name}"]
    if x.dtype != torch.bfloat16:
        return [f"the fused layer takes bf16 tokens (found {x.dtype})"]
    sg = getattr(weights, "shared_w_gate", None)
    return why_unsupported(
        config,
        int(x.shape[1]),
        int(weights.w_gate.shape[1]),
        0 if sg is None else int(sg.shape[0]),
        "bf16",
        num_sms,
        num_local_experts,
    )


def pick(unfused_ms: float, fused_ms: float, margin: float = MARGIN) -> bool:
    """True (fused) when ``fused_ms`` is below ``unfused_ms`` by more than ``margin``."""
    return fused_ms < unfused_ms * (1.0 - margin)


def resolve_fused(fused, key: tuple, measure: Callable[[], PathChoice], tracing: bool,
                  name: str | None = None, group=None) -> bool:  # fmt: skip
    """``fused`` as a bool: itself unless ``"auto"``; then the choice kept under ``key``, else
    the one stored under ``name`` in the ``MOK_PATH_CHOICES`` file (where every rank of
    ``group`` finds the same), else one made now by ``measure`` (collective over the layer's
    group: every rank of the layer calls this at the same call) and stored there. Under
    tracing a missing choice runs the unfused path, with a warning."""
    check_fused_arg(fused)
    if fused != AUTO:
        return bool(fused)
    got = _choices.get(key)
    if got is not None:
        return got.fused
    if tracing:
        warnings.warn(
            "mok: fused='auto' under torch.compile before any eager call of this layer: "
            "the unfused forward runs (call the layer once eagerly first, or pin fused)",
            stacklevel=3,
        )
        return False
    path = os.environ.get(CHOICES_ENV) if name is not None else None
    got = _stored(path, name) if path else None
    if path and not _agreed(got, group):
        got = None  # some rank has no entry, or another one: every rank measures
    if got is None:
        got = measure()
        if path and _first_rank(group):
            _store(path, name, got)
    _choices[key] = got
    _log.info(got.text)
    return got.fused


def measured_choice(run: Callable[[bool], object], refusals: list, group, shape_text: str,
                    timer: Callable | None = None) -> PathChoice:  # fmt: skip
    """Time ``run(fused)`` for both paths (``timer(run)``: [unfused ms, fused ms] on this rank;
    default :func:`time_paths`), take each path's slowest rank over ``group`` and keep the
    faster (:func:`pick`). ``refusals`` not empty: the unfused path, nothing run.
    ``shape_text`` names the layer in the explanation."""
    if refusals:
        return PathChoice(False, None, None, f"{shape_text}; the fused kernel does not run "
                          f"it ({'; '.join(refusals)})")  # fmt: skip
    unfused_ms, fused_ms = _max_over((timer or time_paths)(run), group)
    chosen = pick(unfused_ms, fused_ms)
    ranks = group_size(group)
    return PathChoice(
        chosen,
        unfused_ms,
        fused_ms,
        f"{shape_text}: fused {fused_ms:.3f} ms, unfused {unfused_ms:.3f} ms (median of {ITERS}"
        f"{', slowest of ' + str(ranks) + ' ranks' if ranks > 1 else ''}; the fused path must "
        f"be {MARGIN:.0%} faster); pin fused={chosen} for repeatable bits",
    )


def time_paths(run: Callable[[bool], object], warmup: int = WARMUP, iters: int = ITERS) -> list:
    """[unfused, fused] median ms of ``run(fused)`` on this rank: ``warmup`` untimed calls of
    each, then ``iters`` timed calls of each, alternating (CUDA events; no gradients)."""
    with torch.no_grad():
        for _ in range(warmup):
            run(False)
            run(True)
        torch.cuda.synchronize()
        events = {False: [], True: []}
        for _ in range(iters):
            for fused in (False, True):
                s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                s.record()
                run(fused)
                e.record()
                events[fused].append((s, e))
        torch.cuda.synchronize()
    return [statistics.median(s.elapsed_time(e) for s, e in events[f]) for f in (False, True)]


def _agreed(got: PathChoice | None, group) -> bool:
    """Whether every rank of ``group`` found a stored choice, and the same path."""
    mine = -1.0 if got is None else float(got.fused)
    lo, hi = _max_over([-mine, mine], group)
    return mine >= 0 and -lo == hi == mine


def _first_rank(group) -> bool:
    import torch.distributed as dist

    return group_size(group) == 1 or dist.get_rank(group) == 0


def _max_over(values: list[float], group) -> list[float]:
    """Each value's maximum over the ranks of ``group`` (on the device the group's backend
    takes: the CPU for gloo, as ranks sharing one GPU use)."""
    import torch.distributed as dist

    if group_size(group) == 1:
        return list(values)
    dev = "cpu" if dist.get_backend(group) == "gloo" else "cuda"
    q = torch.tensor(values, dtype=torch.float64, device=dev)
    dist.all_reduce(q, op=dist.ReduceOp.MAX, group=group)
    return [float(v) for v in q.cpu()]
