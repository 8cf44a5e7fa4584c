"""One training step of the MoE layer on one GPU: forward and backward, with gradients for x, the
routing weights and every weight tensor, mok's layer against the best torch layer under autograd.

Run with ``python -m mok.bench train`` (one GPU: mok's backward runs at one rank). ``--emulate-ep
N`` runs the per-rank work of EP N as ``mok.bench layer`` does: the model's experts / N, all on
this GPU, and the same tokens, so the same rows per expert as a rank of EP N gets. Implementations:

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
x 6 H Is; a step does 3 x ``flops_fwd`` of useful work (the backward's dgrad and wgrad are 2 x the
forward), so ``step_tflops`` = 3 ``flops_fwd`` / step time and ``bwd_tflops`` = 2 ``flops_fwd`` /
backward time; ``flops_recompute`` is what the backward computes again on top (mok: the gate /
up GEMMs; torch-best: 0), counted in neither rate. Memory: one more step after the timed
ones, after ``torch.cuda.reset_peak_memory_stats``: ``peak_mem_gib`` its
``max_memory_allocated``, ``step_mem_gib`` that minus the memory allocated before the step (what
the step adds: activations, temporaries and the gradients; the weights, inputs and mok's
workspaces are already there). Each implementation holds only its own weights while it runs.

The process group (a world of one), the timer, the CSV recorder with its provenance columns and
the routing draw are the benchmarks' shared ones (:mod:`mok.bench.common`).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable

import torch
import torch.nn.functional as F

from mok.bench.common import (
    OneGpuRecorder,
    add_warm_s,
    case_jobs,
    check_one_gpu,
    compiled,
    draw_routing,
    init_dist,
    is_rank0,
    parse_choices,
    provenance,
    run_cases,
    time_cuda,
)
from mok.bench.layer import MODELS, emulated_shape, permuted_layer
from mok.experts import clear_cache
from mok.spec.rows import bench_routing_seed
from mok.spec.workload import ModelShape

IMPLS = ("torch-best", "mok-unfused", "mok-fused", "mok-saved", "mok-fused-saved")
TIMES = ("fwd_us", "bwd_us", "step_us", "p20_us", "p80_us")
GIB = float(2**30)


class TrainRecorder(OneGpuRecorder):
    """The rows of the train CSV."""

    times = TIMES

    def describe(self, row: dict) -> str:
        return (
            f"{row['model']:>14} N={row['tokens_per_rank']:>5} {row['skew']:>8} "
            f"{row['impl']:>12} {row['mode']:>10} sms={row['sms']:>3} "
            f"fwd {row['fwd_us']:>8.1f} bwd {row['bwd_us']:>8.1f} step {row['step_us']:>8.1f} us "
            f"{row['step_tflops']:>6.1f} TFLOP/s (bwd {row['bwd_tflops']:>6.1f}) "
            f"mem +{row['step_mem_gib']:.2f} of {row['peak_mem_gib']:.2f} GiB"
        )


def swiglu(gu: torch.Tensor) -> torch.Tensor:
    """``silu(g) * u`` of ``gu`` = [R, 2I] (g | u) in its dtype, differentiable: no in-place or
    ``out=`` op (:func:`torch.chunk`'s backward writes both halves' gradients into one
    [R, 2I] tensor)."""
    g, u = gu.chunk(2, dim=-1)
    return F.silu(g) * u


def torch_best_train_layer(
    x: torch.Tensor,
    idx: torch.Tensor,
    tw: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    shared_gate_up: torch.Tensor | None = None,
    shared_down: torch.Tensor | None = None,
) -> torch.Tensor:
    """:func:`mok.bench.layer.torch_best_layer` that autograd differentiates: x [n, H], idx
    [n, K] (local expert ids), tw [n, K], the routed weights ``gate_up`` [L, 2I, H] (gate rows,
    then up rows) / ``down`` [L, H, I] and optionally the shared expert's ``shared_gate_up``
    [2Is, H] / ``shared_down`` [H, Is] -> [n, H] in x's dtype (bf16 on the GPU; fp32 runs too,
    for the tests). Gradients flow to x, tw and every weight; the routing is data."""

    def experts(rows, offs):
        h = swiglu(torch._grouped_mm(rows, gate_up.transpose(1, 2), offs=offs))
        return torch._grouped_mm(h, down.transpose(1, 2), offs=offs)

    out = permuted_layer(x, idx, tw, gate_up.shape[0], experts)
    if shared_gate_up is None:
        return out
    return out + swiglu(x @ shared_gate_up.T) @ shared_down.T


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
    from mok import experts

    si = shape.shared_intermediate
    if not si:
        return True

    def meta(*size):
        return torch.empty(*size, dtype=torch.bfloat16, device="meta")

    return experts.shared_kept(meta(1, shape.hidden), meta(2 * si, shape.hidden), None,
                               meta(shape.hidden, si))  # fmt: skip


def train_weights(shape: ModelShape, device, seed: int = 7) -> dict:
    """This rank's bf16 weights (variance 1/fan_in, the same values for the same seed), the
    routed ones in the fused layout ``gate_up`` [L, 2I, H] / ``down`` [L, H, I] and the shared
    expert's ``shared_gate_up`` [2Is, H] / ``shared_down`` [H, Is] (absent without one).
    Plain tensors: the caller makes them leaves."""
    g = torch.Generator(device=device).manual_seed(seed)
    L, H, inter, si = shape.num_experts, shape.hidden, shape.intermediate, shape.shared_intermediate

    def rnd(*size):
        t = torch.randn(*size, generator=g, device=device, dtype=torch.bfloat16)
        return t.mul_(size[-1] ** -0.5)

    w = {"gate_up": rnd(L, 2 * inter, H), "down": rnd(L, H, inter)}
    if si:
        w.update(shared_gate_up=rnd(2 * si, H), shared_down=rnd(H, si))
    return w


def step_memory(step: Callable[[], None], leaves: dict) -> tuple[float, float]:
    """(peak GiB allocated during one ``step()``, GiB of that above what was allocated before
    it), the leaves' gradients dropped first."""
    for t in leaves.values():
        t.grad = None
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    step()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated()
    return peak / GIB, (peak - before) / GIB


def _tflops(flops: int, us: float) -> float:
    return round(flops / (us * 1e6), 1) if us > 0 else 0.0


def run_model(
    rec, model, n, skew, impls, sms, iters, warmup, emulate_ep=0, device="cuda", warm_s=0.0
):
    """The rows of one (model, tokens, skew) case: every implementation of ``impls`` (mok-fused
    once per comm-SM count of ``sms``) on the same routing, x, grad_out and weight values."""
    import mok
    from mok import functional as mf
    from mok.spec.workload import get_shape

    shape = emulated_shape(get_shape(model), 1, emulate_ep)  # one GPU: a world of one
    E, H, inter, K = shape.num_experts, shape.hidden, shape.intermediate, shape.num_topk
    seed = bench_routing_seed(n)  # recorded in every row
    idx, tw, _ = draw_routing(n, E, K, skew, seed=seed)
    g = torch.Generator(device=device).manual_seed(11)
    x = torch.randn(n, H, device=device, generator=g).to(torch.bfloat16).requires_grad_()
    grad_out = torch.randn(n, H, device=device, generator=g).to(torch.bfloat16)
    tw = tw.float().requires_grad_()
    flops_fwd, flops_again = step_flops(shape, n, recompute=True)
    base = dict(model=model, hidden=H, intermediate=inter, num_experts=E, num_topk=K, skew=skew)
    base.update(tokens_per_rank=n, routing_seed=seed, emulated_ep=emulate_ep or 1)
    inputs = {"x": x, "topk_weights": tw}

    def add(impl, mode, sms_count, build, recomputed):
        """Time and record one implementation; ``build()`` makes its weights and returns
        (forward, {name: leaf}), or None to drop the row. Its weights are freed on return."""
        made = build()
        if made is None:
            return
        fwd, leaves = made

        def step():
            for t in leaves.values():
                t.grad = None
            fwd().backward(grad_out)

        tf = time_cuda(fwd, iters, warmup, warm_s=warm_s, clocks=True)
        ts = time_cuda(step, iters, warmup, warm_s=warm_s, clocks=True)
        peak, added = step_memory(step, leaves)
        missing = [name for name, t in leaves.items() if t.grad is None]
        if missing:
            raise RuntimeError(f"{impl} ({mode}): the step left no gradient for {missing}")
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
            bwd_tflops=_tflops(2 * flops_fwd, bwd),
            peak_mem_gib=round(peak, 3),
            step_mem_gib=round(added, 3),
            sm_mhz=ts.sm_mhz,
        )

    def torch_best(mode):
        def build():
            fn = torch_best_train_layer if mode == "eager" else compiled(torch_best_train_layer)
            if fn is None:
                return None
            w = {k: t.requires_grad_() for k, t in train_weights(shape, device).items()}
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
            w = train_weights(shape, device)
            m = mok.MoE.from_weights(
                E,
                w["gate_up"],
                w["down"],
                w.get("shared_gate_up"),
                w.get("shared_down"),
                config=cfg,
                fused=fused,
            )

            def fwd():  # what mok.MoE.forward calls on CUDA
                return mf.moe(x, idx, tw, m.weights(), E, cfg, fused=fused, recompute=recompute)

            return fwd, {**inputs, **dict(m.named_parameters())}

        return build

    if "torch-best" in impls:
        add("torch-best", "eager", 0, torch_best("eager"), 0)
        add("torch-best", "compile", 0, torch_best("compile"), 0)
    # the unfused rows say what ran: the unfused path's own SMs and mode (unfused_config)
    sms_count = torch.cuda.get_device_properties(device).multi_processor_count
    ran = mf.unfused_config(mok.MoKConfig(), sms_count)
    if "mok-unfused" in impls:
        add("mok-unfused", ran.dispatch_mode, ran.num_comm_sms, mok_layer(False), flops_again)
        mok.clear_workspaces()
    # recompute=False: the forward keeps the routed experts' fp32 gate / up for the backward, and
    # the shared expert's where the kernel takes its shape (else it recomputes those 4 of its
    # 6 H Is per token)
    shared_again = 0 if shared_kept(shape) else n * shape.shared_flops_per_token() // 3 * 2
    if "mok-saved" in impls:
        add("mok-saved", ran.dispatch_mode, ran.num_comm_sms, mok_layer(False, None, False),
            shared_again)  # fmt: skip
        mok.clear_workspaces()
    for impl, recompute in (("mok-fused", True), ("mok-fused-saved", False)):
        if impl not in impls:
            continue
        for s in sms:
            cfg = mok.MoKConfig(num_comm_sms=s)
            again = flops_again if recompute else shared_again
            add(impl, cfg.dispatch_mode, s, mok_layer(True, cfg, recompute), again)
            mok.clear_workspaces()
    clear_cache()  # the next model's weights replace these


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m mok.bench train")
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--tokens", default="4096")
    ap.add_argument("--skews", default="uniform,hot:0.5")
    ap.add_argument(
        "--impls",
        default="torch-best,mok-unfused,mok-saved,mok-fused,mok-fused-saved",
        help=f"comma list of {', '.join(IMPLS)}",
    )
    ap.add_argument(
        "--emulate-ep",
        type=int,
        default=2,
        help="run the per-rank work of this EP size on the one GPU (the model's experts / N, "
        "same tokens; 0 or 1: all of the model's experts)",
    )
    ap.add_argument(
        "--sms", default="8,16", help="mok-fused's (and mok-fused-saved's) comm SMs (comma list)"
    )
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    add_warm_s(ap)
    ap.add_argument("--csv", default="mok-bench-train.csv")
    return ap


def main(argv: list[str]) -> int:
    ap = build_parser()
    args = ap.parse_args(argv)
    impls = parse_choices(ap, args.impls, IMPLS, "--impls")
    check_one_gpu(
        ap,
        args.emulate_ep,
        " (mok's backward runs at one rank)",
        "; --emulate-ep N runs the per-rank work of EP N",
    )
    dev = init_dist("mok.bench train")
    rec = TrainRecorder(args.csv, provenance())
    sms = tuple(int(v) for v in args.sms.split(","))

    def run(model, n, skew):
        run_model(
            rec, model, n, skew, impls, sms, args.iters, args.warmup, args.emulate_ep, dev,
            args.warm_s,
        )  # fmt: skip

    return run_cases(rec, case_jobs(args), "train", run)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
