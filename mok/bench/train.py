"""One training step of the MoE layer: forward and backward, with gradients for x, the routing
weights and every weight tensor, mok's layer against the best torch layer under autograd, on one
GPU or at expert parallelism R.

``python -m mok.bench train``: one GPU, mok's backward at one rank. ``--emulate-ep N`` (default
2) runs the per-rank work of EP N as ``mok.bench layer`` does: the model's experts / N, all on
this GPU, and the same tokens, so the same rows per expert as a rank of EP N gets; its mok rows
keep the dispatch that a rank of EP N runs (:func:`mok.bench.common.one_rank_gather`), where a
run of one rank (``--emulate-ep 1``, ``--suite``) reads its rows from x inside the experts' kernel.

``torchrun --nproc-per-node=R -m mok.bench train`` (R >= 2, one GPU per rank, NCCL): EP R for
real. Each rank holds the model's experts / R (``--emulate-ep`` is refused: the EP size is the
world size; a model whose experts do not split over R is refused, naming the nearest EP sizes
that work) and ``--tokens`` tokens, routed over all the model's experts as the other EP
benchmarks draw it (:func:`mok.bench.common.draw_routing`); every rank draws its own x,
grad_out and weights (seed + rank). The step is the one-GPU step on every rank at once; times are
the max over ranks. The rows: the mok implementations below with ``group`` the world (each a
:class:`mok.MoE` of the rank's experts), and torch-best with its rows moved to their experts'
owners and back (:mod:`mok.bench.train_ep`): ``torch-best+nccl`` (NCCL ``all_to_all_single``,
the split sizes read by the host after an all-to-all of the counts, as a real pipeline does;
eager only, as :mod:`mok.bench.layer`'s forward-only ``nccl`` layer) and ``torch-best+deepep``
(DeepEP dispatch / combine, their backward each other's, per ``--deepep-sms``; where
``deep_ep`` imports, else skipped with the reason printed; untested so far). ``torch-best`` and
its compiled mode are one-GPU rows (every expert local).

``MOK_SHARED_GPU=1 torchrun --nproc-per-node=R -m mok.bench train``: the R ranks share one GPU
(:mod:`mok.ranks`: a gloo group, so the NCCL / DeepEP baselines cannot run; one printed line
says so). The mok rows then run as a correctness smoke test, small by default (512 tokens, 3
steps after 1 warm-up call, no ``--warm-s``; the options override it): forward and backward
complete, every gradient finite and dx / d_topk_weights bitwise equal over two more steps (also
checked on every other run, where a failure stops the benchmark on every rank); each row has
``shared_gpu`` True and a ``note`` saying its times are time-sliced, not NVLink measurements,
and the printed header says so too. Implementations:

- ``torch-best``: the ``torch-best`` layer of :mod:`mok.bench.layer` under autograd
  (:func:`torch_best_train_layer`): a stable argsort of the (token, k) pairs by expert, one
  ``index_select`` gather, gate and up as one ``torch._grouped_mm`` over the ``[L, 2I, H]``
  weight, bf16 SwiGLU, the down projection as a second grouped GEMM, the inverse-permutation
  gather and a ``bmm`` weighted k-sum, plus the bf16 shared expert with gate and up as one
  ``mm``. Its leaves are the weights in that fused layout (``gate_up`` ``[L, 2I, H]``, ``down``
  ``[L, H, I]``, ``shared_gate_up`` ``[2Is, H]``, ``shared_down`` ``[H, Is]``), so autograd
  produces the fused weight's gradient directly, and SwiGLU is written without in-place or
  ``out=`` ops (:func:`swiglu`; :mod:`mok.experts`'s forward helper has both). Autograd saves
  the activations (no recompute). Timed eager (mode ``eager``) and ``torch.compile``d
  (``compile``: the forward function, ``dynamic=False``; a compile that fails drops the row and
  says why);
- ``mok-saved``: ``mok-unfused`` with ``recompute=False`` (the forward keeps the routed and the
  shared experts' fp32 gate / up for the backward, which then recomputes nothing);
- ``mok-fused-saved``: ``mok-fused`` with ``recompute=False`` (the fused kernel's gate / up tiles
  write their fp32 g / u too; the backward schedules its rows as the fused forward padded them);
- ``mok-unfused`` / ``mok-fused``: a :class:`mok.MoE` (what a model holds: its ``gate_up``
  ``[L, 2I, H]``, ``down`` and shared-expert Parameters, so gate and up run as one GEMM forward
  and backward and both gradients land in ``gate_up``) with ``fused=False`` (the default config,
  run under :func:`mok.functional.unfused_config`; the row records the SMs and mode that ran)
  or ``fused=True`` for each ``--sms`` (the communication SMs; the rest of the config is
  :class:`mok.MoKConfig`'s defaults, which are ``mok.bench layer``'s).
- ``mok-auto`` / ``mok-auto-saved``: ``fused="auto"`` (:mod:`mok.path_choice`) with the default
  config, recomputing / keeping g / u: the layer's first call times the fused and the unfused
  forward and keeps the faster; the row's ``mode`` is ``auto:fused`` or ``auto:unfused`` and its
  ``note`` the logged choice with both times (also printed). Not in the default ``--impls``.

The mok rows share the backward of :mod:`mok.autograd`: ``mok-unfused`` and ``mok-fused`` save
only the inputs and recompute the gate / up GEMMs (in the experts' backward kernel on Hopper, with
the down dgrad and the SwiGLU backward; :func:`mok.experts.swiglu_backward`); ``mok-saved`` and
``mok-fused-saved`` run the routed experts' backward from the kept g / u as one launch.

A step: every leaf's gradient set to None, the forward, ``out.backward(grad_out)`` with a fixed
random ``grad_out``. ``step_us`` is the CUDA-event median of back-to-back steps after warm-up
(:func:`mok.bench.common.time_cuda`; ``p20_us`` / ``p80_us`` are the step's), ``fwd_us`` that of
the forward alone (grad mode on, the same call, its graph dropped), ``bwd_us`` their difference.
Each is timed after ``--warm-s`` seconds of the same calls (default 1), so both run at the
sustained, power-capped clock a training step runs at; ``sm_mhz`` is the median SM clock sampled
during the timed steps (empty where neither NVML nor ``nvidia-smi`` answers).
FLOPs count the real rows (no padding), as ``layer``: ``flops_fwd`` = tokens x k x 6 H I + tokens
x 6 H Is (at EP R: the world's useful FLOPs / R, each rank's tokens' rows wherever they run, so
the rates are per GPU over the slowest rank's time); a step does 3 x ``flops_fwd`` of useful work
(the backward's dgrad and wgrad are 2 x the forward), so ``step_tflops`` = 3 ``flops_fwd`` / step
time, ``fwd_tflops`` = ``flops_fwd`` / forward time and ``bwd_tflops`` = 2 ``flops_fwd`` /
backward time (without a shared expert these are SonicMoE's counts, 6 T K d n and twice that;
``--suite sonicmoe`` runs its four throughput shapes and prints its published figures beside
mok's, :mod:`mok.bench.sonicmoe`); ``flops_recompute`` is what the
backward computes again on top (mok: the gate / up GEMMs; torch-best: 0), counted in neither
rate. Memory: one more step after the timed ones, after ``torch.cuda.reset_peak_memory_stats``:
``peak_mem_gib`` its ``max_memory_allocated``, ``step_mem_gib`` that minus the memory allocated
before the step (what the step adds: activations, temporaries and the gradients; the weights,
inputs and mok's workspaces are already there; at EP R each is the max over ranks). Each
implementation holds only its own weights while it runs. Every row checks that the step left
every leaf a finite gradient; the mok rows also that two more steps give bitwise the same dx and
d_topk_weights.

Columns: the one-GPU rows' (``num_experts`` is the world's: the model's at EP R, the model's / N
on one GPU emulating EP N) and ``ep`` (the EP size: the world's ranks, 1 on one GPU;
``emulated_ep`` = ``ep`` at EP > 1), ``shared_gpu`` and ``note`` (see above). The CSV defaults to
``mok-bench-train.csv``, ``mok-bench-train-epR.csv`` at EP R and
``mok-bench-train-epR-shared.csv`` on shared-GPU ranks (mok/bench/results/README.md).

The process group (a world of one on one GPU), the timer, the CSV recorder with its provenance
columns and the routing draw are the benchmarks' shared ones (:mod:`mok.bench.common`).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

from mok import experts
from mok import functional as mf
from mok.bench.common import (
    OneGpuRecorder,
    add_warm_s,
    case_jobs,
    compiled,
    draw_routing,
    init_dist,
    is_rank0,
    max_over_ranks,
    one_rank_gather,
    parse_choices,
    provenance,
    run_cases,
    time_cuda,
)
from mok.bench.kernel_times import KernelRecorder, kernel_times, kernels_csv, summary_lines
from mok.bench.layer import DEEPEP_MAX_LOCAL_EXPERTS, MODELS, emulated_shape
from mok.bench.sonicmoe import SONICMOE_H100, comparison_lines
from mok.bench.train_ep import DeepEPTrainLayer, nccl_train_layer
from mok.bench.train_layers import (  # noqa: F401 - swiglu, shared_expert: this module's API too
    grouped_experts,
    shared_expert,
    swiglu,
    torch_best_train_layer,
)
from mok.experts import clear_cache
from mok.path_choice import AUTO, choices, clear_choices
from mok.ranks import shared_gpu
from mok.spec.limits import (
    nearest_ep_sizes,  # noqa: F401 - this module's API too
    rank_count_problem,
)
from mok.spec.rows import bench_routing_seed
from mok.spec.workload import ModelShape, get_shape

ONE_RANK_IMPLS = ("torch-best",)  # every expert local: one GPU only
EP_IMPLS = ("torch-best+nccl", "torch-best+deepep")  # EP > 1, one GPU per rank (NCCL) only
MOK_IMPLS = (
    "mok-unfused",
    "mok-fused",
    "mok-saved",
    "mok-fused-saved",
    "mok-auto",
    "mok-auto-saved",
)
IMPLS = ONE_RANK_IMPLS + EP_IMPLS + MOK_IMPLS
# --impls by world: one GPU, EP > 1
DEFAULT_IMPLS = (
    "torch-best,mok-unfused,mok-saved,mok-fused,mok-fused-saved",
    "torch-best+nccl,torch-best+deepep,mok-unfused,mok-saved,mok-fused,mok-fused-saved",
)
TIMES = ("fwd_us", "bwd_us", "step_us", "p20_us", "p80_us")
GIB = float(2**30)
# the options' defaults, and on shared-GPU ranks (a smoke test: small, a few steps, seconds per
# model; the ranks' launches time-slice the GPU)
DEFAULT_TOKENS, SHARED_GPU_TOKENS = "4096", "512"
DEFAULTS = {"tokens": DEFAULT_TOKENS, "iters": 10, "warmup": 3, "warm_s": 1.0}
SHARED_GPU_DEFAULTS = {"tokens": SHARED_GPU_TOKENS, "iters": 3, "warmup": 1, "warm_s": 0.0}
# mok's bound on every wait across ranks where they time-slice one GPU (MoKConfig's default:
# 10 s), as mok.bench lm sets it
SHARED_GPU_WAIT_MS = 120_000.0
# the `note` of every row of shared-GPU ranks
SHARED_GPU_NOTE = (
    "shared-GPU smoke test (MOK_SHARED_GPU=1): ranks time-slice one GPU, times are not NVLink "
    "measurements; gradients finite, mok's dx / d_topk_weights bitwise repeatable"
)


class TrainRecorder(OneGpuRecorder):
    """The rows of the train CSV."""

    times = TIMES

    def describe(self, row: dict) -> str:
        return (
            f"{row['model']:>14} EP{row['ep']:<2} N={row['tokens_per_rank']:>5} "
            f"{row['skew']:>8} {row['impl']:>17} {row['mode']:>10} sms={row['sms']:>3} "
            f"fwd {row['fwd_us']:>8.1f} bwd {row['bwd_us']:>8.1f} step {row['step_us']:>8.1f} us "
            f"{row['step_tflops']:>6.1f} TFLOP/s (fwd {row['fwd_tflops']:>6.1f}, bwd "
            f"{row['bwd_tflops']:>6.1f}) "
            f"mem +{row['step_mem_gib']:.2f} of {row['peak_mem_gib']:.2f} GiB"
            + (" [shared-GPU smoke test]" if row.get("shared_gpu") else "")
        )


def step_flops(shape: ModelShape, tokens: int, recompute: bool) -> tuple[int, int]:
    """(forward GEMM FLOPs, FLOPs the backward recomputes) of one step on ``tokens`` tokens at
    one rank (every routed row local), real rows only: the forward is tokens x k x 6 H I (gate,
    up and down of each routed row) + tokens x 6 H Is (the shared expert). ``recompute``: the
    backward computes the gate / up GEMMs again, routed and shared (tokens x (k x 4 H I + 4 H
    Is); mok's backward saves only its inputs), else nothing (torch-best saves its
    activations)."""
    fwd = tokens * (shape.routed_flops_per_token() + shape.shared_flops_per_token())
    again = fwd // 3 * 2  # gate / up: 4 of the 6 H I (H Is) of every routed (shared) row
    return fwd, again if recompute else 0


def shared_kept(shape: ModelShape) -> bool:
    """Whether a ``recompute=False`` forward keeps the shared expert's gate / up too (it has
    none, or :func:`mok.experts.shared_kept` holds for its shapes)."""

    si = shape.shared_intermediate
    if not si:
        return True

    def meta(*size):
        return torch.empty(*size, dtype=torch.bfloat16, device="meta")

    return experts.shared_kept(meta(1, shape.hidden), meta(2 * si, shape.hidden), None,
                               meta(shape.hidden, si))  # fmt: skip


def train_weights(
    shape: ModelShape, device, seed: int = 7, num_local_experts: int | None = None
) -> dict:
    """This rank's bf16 weights (variance 1/fan_in, the same values for the same seed), the
    routed ones in the fused layout ``gate_up`` [L, 2I, H] / ``down`` [L, H, I] (L:
    ``num_local_experts``, default all of ``shape``'s) and the shared expert's
    ``shared_gate_up`` [2Is, H] / ``shared_down`` [H, Is] (absent without one). Plain tensors:
    the caller makes them leaves."""
    g = torch.Generator(device=device).manual_seed(seed)
    L = shape.num_experts if num_local_experts is None else num_local_experts
    H, inter, si = shape.hidden, shape.intermediate, shape.shared_intermediate

    def rnd(*size):
        t = torch.randn(*size, generator=g, device=device, dtype=torch.bfloat16)
        return t.mul_(size[-1] ** -0.5)

    w = {"gate_up": rnd(L, 2 * inter, H), "down": rnd(L, H, inter)}
    if si:
        w.update(shared_gate_up=rnd(2 * si, H), shared_down=rnd(H, si))
    return w


def step_memory(step: Callable[[], None], leaves: dict, world: int = 1) -> tuple[float, float]:
    """(peak GiB allocated during one ``step()``, GiB of that above what was allocated before
    it), the leaves' gradients dropped first; each the max over ranks where ``world`` > 1."""
    for t in leaves.values():
        t.grad = None
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    step()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated()
    got = [peak / GIB, (peak - before) / GIB]
    return tuple(max_over_ranks(got) if world > 1 else got)


def _tflops(flops: int, us: float) -> float:
    return round(flops / (us * 1e6), 1) if us > 0 else 0.0


def _agree(failure: str | None, world: int, what: str) -> None:
    """Raise RuntimeError(``failure``) where this rank found one, and on every other rank of the
    world too (so that no rank waits on a collective the failing rank never enters)."""
    failed = failure is not None
    if world > 1:
        failed = max_over_ranks([float(failed)])[0] > 0
    if failed:
        raise RuntimeError(failure or f"{what}: failed on another rank")


def check_gradients(what: str, leaves: dict, world: int = 1) -> None:
    """Every leaf has a gradient and every gradient is finite, on every rank (RuntimeError
    naming the leaves otherwise)."""
    missing = [name for name, t in leaves.items() if t.grad is None]
    bad = [n for n, t in leaves.items() if t.grad is not None and not torch.isfinite(t.grad).all()]
    failure = None
    if missing:
        failure = f"{what}: the step left no gradient for {missing}"
    elif bad:
        failure = f"{what}: the step left non-finite gradients in {bad}"
    _agree(failure, world, what)


def check_repeatable(what: str, step: Callable[[], None], x, tw, world: int = 1) -> None:
    """Two more steps give bitwise the same dx and d_topk_weights (mok's backward is
    deterministic), on every rank (RuntimeError otherwise)."""
    got = []
    for _ in range(2):
        step()
        got.append((x.grad.clone(), tw.grad.clone()))
    (dx0, dw0), (dx1, dw1) = got
    failure = None
    if not (torch.equal(dx0, dx1) and torch.equal(dw0, dw1)):
        failure = f"{what}: dx / d_topk_weights differ between two identical steps"
    _agree(failure, world, what)


def _deepep_layers(hidden: int, num_experts: int, sms: Sequence[int], world: int):
    """(SMs, :class:`mok.bench.train_ep.DeepEPTrainLayer`) for each of ``sms``, or none with the
    reason printed (rank 0) where DeepEP does not import or takes too many local experts."""
    try:
        import deep_ep  # noqa: F401
    except ImportError as e:
        if is_rank0():
            print(f"DeepEP not importable ({e}): torch-best+deepep skipped", flush=True)
        return []

    if num_experts // world > DEEPEP_MAX_LOCAL_EXPERTS:
        if is_rank0():
            print(
                f"DeepEP's intranode dispatch takes at most {DEEPEP_MAX_LOCAL_EXPERTS} experts "
                f"per rank ({num_experts // world} at EP{world}): torch-best+deepep skipped",
                flush=True,
            )
        return []
    return [(s, DeepEPTrainLayer(hidden, num_experts, s)) for s in sms]


def run_model(
    rec, model, n, skew, impls, sms, iters, warmup, emulate_ep=0, device="cuda", warm_s=0.0,
    group=None, deepep_sms=(), shared=False, kernels=None,
):  # fmt: skip
    """The rows of one (model, tokens, skew) case: every implementation of ``impls`` (mok-fused
    once per comm-SM count of ``sms``, torch-best+deepep once per ``deepep_sms``) on the same
    routing, x, grad_out and weight values. ``group`` None: one GPU (the per-rank work of EP
    ``emulate_ep``); else EP = its ranks, each holding the model's experts / ranks.
    ``shared``: the ranks share one GPU (the rows are a smoke test, labelled so).
    ``kernels``: a :class:`~mok.bench.kernel_times.KernelRecorder` (one GPU): each row's step
    profiled again, its kernels' device time per step recorded and the largest printed."""
    import mok

    world = 1 if group is None else dist.get_world_size(group)
    rank = 0 if group is None else dist.get_rank(group)
    shape = emulated_shape(get_shape(model), 1, emulate_ep) if world == 1 else get_shape(model)
    E, H, inter, K = shape.num_experts, shape.hidden, shape.intermediate, shape.num_topk
    num_local = E // world
    seed = bench_routing_seed(n)  # recorded in every row
    idx, tw, _ = draw_routing(n, E, K, skew, seed=seed)
    g = torch.Generator(device=device).manual_seed(11 + rank)
    x = torch.randn(n, H, device=device, generator=g).to(torch.bfloat16).requires_grad_()
    grad_out = torch.randn(n, H, device=device, generator=g).to(torch.bfloat16)
    tw = tw.float().requires_grad_()
    flops_fwd, flops_again = step_flops(shape, n, recompute=True)
    base = dict(model=model, hidden=H, intermediate=inter, num_experts=E, num_topk=K, skew=skew)
    emulated = (emulate_ep or 1) if world == 1 else world
    base.update(tokens_per_rank=n, routing_seed=seed, emulated_ep=emulated, ep=world)
    inputs = {"x": x, "topk_weights": tw}

    def weights() -> dict:
        return train_weights(shape, device, seed=7 + rank, num_local_experts=num_local)

    def add(impl, mode, sms_count, build, recomputed, chosen=False):
        """Time, check and record one implementation; ``build()`` makes its weights and returns
        (forward, {name: leaf}), or None to drop the row. Its weights are freed on return.
        ``chosen``: a ``fused="auto"`` layer, whose row names the path its first call kept."""
        made = build()
        if made is None:
            return
        fwd, leaves = made
        note = SHARED_GPU_NOTE if shared else ""
        if chosen:
            fwd()  # the first call times both paths and keeps one (mok.path_choice)
            choice = list(choices().values())[-1]
            mode, sms_count = f"auto:{choice.path}", 0
            note = "; ".join(t for t in (choice.text, note) if t)
            if is_rank0():
                print(choice.text)
        what = f"{impl} ({mode})"

        def step():
            for t in leaves.values():
                t.grad = None
            fwd().backward(grad_out)

        tf = time_cuda(fwd, iters, warmup, warm_s=warm_s, clocks=True)
        ts = time_cuda(step, iters, warmup, warm_s=warm_s, clocks=True)
        peak, added = step_memory(step, leaves, world)
        check_gradients(what, leaves, world)
        if impl.startswith("mok"):
            check_repeatable(what, step, x, tw, world)
        if kernels is not None:
            times = kernel_times(step)
            kernels.add_step({**base, "impl": impl, "mode": mode, "sms": sms_count}, times)
            if is_rank0():
                print("\n".join(summary_lines(times)), flush=True)
        for t in leaves.values():
            t.grad = None
        bwd = ts.median_us - tf.median_us
        rec.add(
            **base,
            impl=impl,
            mode=mode,
            sms=sms_count,
            fwd_us=tf.median_us,
            bwd_us=bwd,
            step_us=ts.median_us,
            p20_us=ts.p20_us,
            p80_us=ts.p80_us,
            flops_fwd=flops_fwd,
            flops_recompute=recomputed,
            step_tflops=_tflops(3 * flops_fwd, ts.median_us),
            fwd_tflops=_tflops(flops_fwd, tf.median_us),
            bwd_tflops=_tflops(2 * flops_fwd, bwd),
            peak_mem_gib=round(peak, 3),
            step_mem_gib=round(added, 3),
            sm_mhz=ts.sm_mhz,
            shared_gpu=shared,
            note=note,
        )

    def torch_layer(layer, mode="eager"):
        """A torch layer under autograd: ``layer(x, idx, tw, gate_up, down, shared_gate_up,
        shared_down)`` on this rank's weights as leaves."""

        def build():
            fn = layer if mode == "eager" else compiled(layer)
            if fn is None:
                return None
            w = {k: t.requires_grad_() for k, t in weights().items()}
            args = (w["gate_up"], w["down"], w.get("shared_gate_up"), w.get("shared_down"))

            def fwd():
                return fn(x, idx, tw, *args)

            if mode == "compile":
                # torch.compile builds the forward at the first call, the backward at the first
                # backward: one step before the timed ones, and a failure drops the row
                try:
                    fwd().backward(grad_out)
                except Exception as e:  # noqa: BLE001 - a compile failure drops the row, says why
                    if is_rank0():
                        print(f"torch.compile of torch-best failed ({type(e).__name__}: {e})")
                    return None
            return fwd, {**inputs, **w}

        return build

    def mok_layer(fused, cfg=None, recompute=True):
        """What a model runs: :class:`mok.MoE` on its fused ``gate_up`` / ``down`` Parameters."""

        def build():
            w = weights()
            m = mok.MoE.from_weights(
                E,
                w["gate_up"],
                w["down"],
                w.get("shared_gate_up"),
                w.get("shared_down"),
                config=cfg,
                group=group,
                fused=fused,
            )

            def fwd():  # what mok.MoE.forward calls on CUDA
                return mf.moe(
                    x, idx, tw, m.weights(), E, cfg, group=group, fused=fused, recompute=recompute
                )

            return fwd, {**inputs, **dict(m.named_parameters())}

        return build

    if world == 1 and "torch-best" in impls:
        add("torch-best", "eager", 0, torch_layer(torch_best_train_layer), 0)
        add("torch-best", "compile", 0, torch_layer(torch_best_train_layer, "compile"), 0)
    if world > 1 and not shared:  # NCCL and DeepEP need a GPU per rank (an NCCL group)
        if "torch-best+nccl" in impls:

            def nccl(*a):
                return nccl_train_layer(*a, E, group)

            add("torch-best+nccl", "eager", 0, torch_layer(nccl), 0)
        if "torch-best+deepep" in impls:
            for s, layer in _deepep_layers(H, E, deepep_sms, world):
                add("torch-best+deepep", "eager", s, torch_layer(layer), 0)
    # shared-GPU ranks time-slice the GPU: every wait across ranks takes longer
    wait = {"wait_timeout_ms": SHARED_GPU_WAIT_MS} if shared else {}
    # the unfused rows say what ran: the unfused path's own SMs and mode (unfused_config)
    sms_count = torch.cuda.get_device_properties(device).multi_processor_count
    ran = mf.unfused_config(mok.MoKConfig(), sms_count)
    unfused_cfg = mok.MoKConfig(**wait) if shared else None  # None: the default config
    if "mok-unfused" in impls:
        add("mok-unfused", ran.dispatch_mode, ran.num_comm_sms, mok_layer(False, unfused_cfg),
            flops_again)  # fmt: skip
        mok.clear_workspaces()
    # recompute=False: the forward keeps the routed experts' fp32 gate / up for the backward, and
    # the shared expert's where the kernel takes its shape (else it recomputes those 4 of its
    # 6 H Is per token)
    shared_again = 0 if shared_kept(shape) else n * shape.shared_flops_per_token() // 3 * 2
    if "mok-saved" in impls:
        add("mok-saved", ran.dispatch_mode, ran.num_comm_sms, mok_layer(False, unfused_cfg, False),
            shared_again)  # fmt: skip
        mok.clear_workspaces()
    for impl, recompute in (("mok-fused", True), ("mok-fused-saved", False)):
        if impl not in impls:
            continue
        for s in sms:
            cfg = mok.MoKConfig(num_comm_sms=s, **wait)
            again = flops_again if recompute else shared_again
            add(impl, cfg.dispatch_mode, s, mok_layer(True, cfg, recompute), again)
            mok.clear_workspaces()
    for impl, recompute in (("mok-auto", True), ("mok-auto-saved", False)):
        if impl not in impls:
            continue
        again = flops_again if recompute else shared_again
        # fused="auto" with the default config: the path its first call timed and kept
        add(impl, "auto", 0, mok_layer(AUTO, unfused_cfg, recompute), again, chosen=True)
        mok.clear_workspaces()
        clear_choices()
    clear_cache()  # the next model's weights replace these


# ---- the command line --------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m mok.bench train",
        description="One training step of the MoE layer: on one GPU (python -m mok.bench train), "
        "or at EP R under torchrun --nproc-per-node=R (one GPU per rank; MOK_SHARED_GPU=1: a "
        "smoke test with every rank on one GPU).",
    )
    ap.add_argument(
        "--suite",
        choices=("sonicmoe",),
        default=None,
        help="sonicmoe: SonicMoE's four throughput shapes at its token counts (one GPU, every "
        "expert local, uniform routing; --models / --tokens / --skews / --emulate-ep ignored) "
        "and a table against its published H100 figures (mok.bench.sonicmoe)",
    )
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument(
        "--tokens",
        default=None,
        help=f"tokens per rank (comma list; default {DEFAULT_TOKENS}, {SHARED_GPU_TOKENS} on "
        "shared-GPU ranks)",
    )
    ap.add_argument("--skews", default="uniform,hot:0.5")
    ap.add_argument(
        "--impls",
        default=None,
        help=f"comma list of {', '.join(IMPLS)} (default: {DEFAULT_IMPLS[0]} on one GPU, "
        f"{DEFAULT_IMPLS[1]} at EP > 1)",
    )
    ap.add_argument(
        "--emulate-ep",
        type=int,
        default=None,
        help="one GPU only: run the per-rank work of this EP size (the model's experts / N, "
        "same tokens; 0 or 1: all of the model's experts; default 2); under torchrun the EP "
        "size is the world size",
    )
    ap.add_argument(
        "--sms", default="8,16", help="mok-fused's (and mok-fused-saved's) comm SMs (comma list)"
    )
    ap.add_argument(
        "--deepep-sms", default="24", help="torch-best+deepep's DeepEP SMs (comma list; EP > 1)"
    )
    ap.add_argument(
        "--iters", type=int, default=None, help="timed steps (default 10, 3 on shared-GPU ranks)"
    )
    ap.add_argument(
        "--warmup", type=int, default=None, help="untimed calls first (default 3, 1 shared)"
    )
    add_warm_s(ap, default=None)
    ap.add_argument(
        "--kernels",
        action="store_true",
        help="one GPU: after each row, profile 3 more steps (torch.profiler) and write each "
        "kernel's device time per step to <csv stem>-kernels.csv, printing the largest",
    )
    ap.add_argument(
        "--csv",
        default=None,
        help="default mok-bench-train.csv (one GPU), mok-bench-train-epR.csv (EP R), "
        "mok-bench-train-epR-shared.csv (shared-GPU ranks)",
    )
    return ap


def resolve_args(ap, args, world: int, shared: bool) -> argparse.Namespace:
    """``args`` checked against the world (``world`` ranks; ``shared``: sharing one GPU) and
    with its defaults filled in, before any GPU work; ``ap.error`` (exit 2) for: an unknown
    implementation or one of the other mode (``torch-best`` at EP > 1, the EP baselines on one
    GPU), ``--emulate-ep`` below 0 or given under torchrun at EP > 1, a model whose experts do
    not split over the EP size (naming the nearest sizes that do)."""

    if args.emulate_ep is not None and args.emulate_ep < 0:
        ap.error(f"--emulate-ep must be >= 0 (found {args.emulate_ep})")
    if world > 1 and args.emulate_ep is not None:
        ap.error(
            f"--emulate-ep {args.emulate_ep} runs the per-rank work of an EP size on one GPU; "
            f"under torchrun the EP size is the world size ({world}): drop --emulate-ep, or run "
            "python -m mok.bench train --emulate-ep N on one GPU"
        )
    impls = parse_choices(ap, args.impls or DEFAULT_IMPLS[world > 1], IMPLS, "--impls")
    other = sorted(set(impls) & set(EP_IMPLS if world == 1 else ONE_RANK_IMPLS))
    if other and world == 1:
        ap.error(
            f"{', '.join(other)}: EP > 1 only, under torchrun --nproc-per-node=R (R >= 2, one "
            "GPU per rank) -m mok.bench train"
        )
    if other:
        ap.error(
            f"torch-best runs at one rank (every expert local); at EP{world} its rows are "
            f"{' / '.join(EP_IMPLS)}"
        )
    if args.kernels and world > 1:
        ap.error(
            f"--kernels profiles one GPU's step (python -m mok.bench train --kernels), not a "
            f"world of {world}"
        )
    if args.suite and world > 1:
        ap.error(f"--suite {args.suite} runs on one GPU (python -m mok.bench train --suite ...)")
    if args.suite:  # SonicMoE's shapes: the whole problem on one GPU
        args.models = ",".join(p.model for p in SONICMOE_H100)
        args.emulate_ep, args.skews = 1, "uniform"
    emulate_ep = (2 if args.emulate_ep is None else args.emulate_ep) if world == 1 else 0
    ep = world if world > 1 else emulate_ep
    ranks = rank_count_problem(ep) if ep > 1 else None
    if ranks:
        ap.error(ranks)
    for model in args.models.split(","):
        try:
            num = get_shape(model).num_experts
        except ValueError as err:
            ap.error(str(err))
        if ep > 1 and num % ep:
            near = " / ".join(f"EP{d}" for d in nearest_ep_sizes(num, ep))
            ap.error(
                f"{model}: {num} experts do not split over EP{ep}; the nearest EP sizes that do: "
                f"{near}"
            )
    suffix = "" if world == 1 else f"-ep{world}" + ("-shared" if shared else "")
    given = vars(args)
    defaults = SHARED_GPU_DEFAULTS if shared else DEFAULTS
    filled = {k: defaults[k] if given[k] is None else given[k] for k in defaults}
    filled.update(
        impls=impls, emulate_ep=emulate_ep, csv=args.csv or f"mok-bench-train{suffix}.csv"
    )
    return argparse.Namespace(**{**given, **filled})


def header_lines(world: int, shared: bool, impls: Sequence[str]) -> list[str]:
    """What rank 0 prints before the rows at EP > 1 (nothing on one GPU)."""
    if world == 1:
        return []
    if not shared:
        return [
            f"mok.bench train at EP{world}, one GPU per rank: each rank holds the model's "
            "experts / ranks and its own tokens; times are the max over ranks"
        ]
    lines = [
        f"mok.bench train at EP{world} on shared-GPU ranks (MOK_SHARED_GPU=1, {world} ranks on "
        "one GPU, a gloo group): a correctness smoke test of mok's rows (forward and backward "
        "complete, every gradient finite, dx / d_topk_weights bitwise equal over two steps); "
        "the ranks time-slice the GPU, so the times are not NVLink measurements"
    ]
    skipped = [i for i in impls if i in EP_IMPLS]
    if skipped:
        lines.append(
            f"{' / '.join(skipped)} skipped: they need NCCL, one GPU per rank (shared-GPU ranks "
            "run over gloo; NCCL refuses two ranks on one GPU)"
        )
    return lines


def main(argv: list[str]) -> int:
    ap = build_parser()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    shared = world > 1 and shared_gpu()
    args = resolve_args(ap, ap.parse_args(argv), world, shared)
    dev = init_dist("mok.bench train")
    group = dist.group.WORLD if world > 1 else None
    meta = provenance()
    rec = TrainRecorder(args.csv, meta)
    krec = KernelRecorder(kernels_csv(args.csv), meta) if args.kernels else None
    sms = tuple(int(v) for v in args.sms.split(","))
    deepep_sms = tuple(int(v) for v in args.deepep_sms.split(","))
    if is_rank0():
        for line in header_lines(world, shared, args.impls):
            print(line, flush=True)

    def run(model, n, skew):
        with one_rank_gather(args.emulate_ep if world == 1 else world):
            run_model(
                rec, model, n, skew, args.impls, sms, args.iters, args.warmup, args.emulate_ep,
                dev, args.warm_s, group, deepep_sms, shared, krec,
            )  # fmt: skip
        if krec is not None:
            krec.write()

    if args.suite:
        jobs = [(p.model, p.tokens, "uniform") for p in SONICMOE_H100]
    else:
        jobs = case_jobs(args)
    status = run_cases(rec, jobs, "train", run)
    if args.suite and rec.rows:
        print("\n".join(["", "against SonicMoE's published H100 figures:"]
                        + comparison_lines(rec.rows)), flush=True)  # fmt: skip
    return status


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
