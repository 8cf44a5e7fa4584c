"""``python -m mok.bench experts``: the routed experts' GEMM pieces of one training step, each
alone, on one GPU, mok's kernels against torch's on the same operands.

A case is a model at the per-rank work of EP ``--emulate-ep`` (its experts / N), ``--tokens``
tokens and a routing skew: the rows each expert gets are the routing's, each group padded to the
layer's row tile (as the backward's groups are). Pieces (useful FLOPs: the routed rows only):

- ``dW_gate_up`` = dgu^T x and ``dW_down`` = dy^T hw per expert: mok's weight-gradient kernel
  (``mok.ops.wgrad_sm90``) against torch's grouped GEMM over the rows
  (``torch._grouped_mm(dgu.T, x, offs)``: of the layouts measured on the H200, MN-major operands
  as they lie were its fastest; K-major copies were slower, docs/perf-notes.md);
  ``mok-gather`` rows (at one rank's backward): the same GEMM with x's (dy's) rows gathered from
  the tokens inside the kernel (``mok.experts._wgrad_gathered``), where the others read the
  dispatched copy; ``dW_gate_up``'s ``mok-t`` / ``mok-gather-t`` rows: its transpose x^T dgu
  ([H, 2I] per expert, not transposed back), so x's rows are the kernel's 128-column operand A
  (gathered: a third of a k-block's bytes instead of two thirds); its ``mok-ts`` /
  ``mok-gather-ts`` rows: that transpose with each tile stored transposed into the weight's
  [L, 2I, H] layout (the kernels' ``transposed`` form, what ``mok.ops.WGRAD_GU_TRANSPOSED``
  runs); ``bwd_recompute``, ``bwd_from_saved`` and ``bwd_saved_all`` have ``mok-gather`` rows
  too
  (the experts' kernel gathering x and dy, ``mok.ops.swiglu_backward_gather_sm90``; the whole
  gathered backward, ``mok.experts.swiglu_backward_gathered``, one launch per GEMM);
- ``gate_up_dgrad`` = dgu @ W_gu: mok's GEMM (``mok.experts.gate_up_dgrad``, the fused
  backward's d_a tiles alone) against torch's grouped GEMM on the fused [L, 2I, H] weight;
- ``bwd_recompute``: mok's experts' backward kernel (dh and gate / up recomputed, the SwiGLU
  backward in the epilogue) against the torch path of ``mok.experts.swiglu_backward`` (on the
  GPU bf16 grouped GEMMs, which have no fp32 output in torch, with the fused [L, 2I, H] gate /
  up weight, then the SwiGLU backward as elementwise ops);
- ``bwd_from_saved``: the kernel from saved fp32 g / u (the dh GEMM only; torch has no
  counterpart that keeps fp32 g / u);
- ``bwd_saved_all``: the routed experts' whole backward from saved g / u (dh with the SwiGLU
  backward, the gate / up dgrad, both weight gradients): mok's fused kernel, one launch
  (``swiglu_backward(..., fused=True)``), against mok's kernels one launch per GEMM
  (``mok-serial``, the same bits), these and ``mok-gather`` with ``mok.ops.WGRAD_GU_TRANSPOSED``
  off; ``mok-ts`` / ``mok-gather-ts``: the fused and the gathered backward with it on (the
  default); torch has no counterpart;
- ``fwd_gate_up``: the forward's gate / up GEMM with h = bf16(silu(g) u): mok's saving kernel
  (which writes the fp32 g / u too) against torch's grouped GEMM on the fused weight and the
  elementwise SwiGLU (``mok.experts.grouped_swiglu``'s first half);
- ``fwd_down``: the forward's down projection h @ W_down^T per expert, torch's grouped GEMM
  (what every mok path but the fused kernel runs);
- ``fwd_saving``: the forward that keeps g / u (the kernel's gate / up, torch's down) against
  torch-best's forward experts: bf16 grouped GEMMs on the fused gate / up weight, prepared once
  (``mok.experts.grouped_swiglu``, ``exact=False``).

Their ``torch`` rows take the weights as torch-best does (``mok.bench.train_layers``: the fused
[L, 2I, H] gate / up weight and [L, H, I] down weight, prepared once, passed as their
transposed views, no copy; bf16). ``fwd_gate_up`` and ``fwd_down`` also have a ``torch-dense``
row: the same rows through one dense ``torch.mm`` with the first expert's weight (the same FLOPs
and operand shapes without the grouping; not the layer's result), the rate a dense GEMM of that
shape reaches on this GPU.

Each piece is timed after ``--warm-s`` seconds of the same calls (default 1: the sustained,
power-capped clock of a training step; a burst of a few calls runs faster, docs/perf-notes.md).
Rows: ``model, hidden, intermediate, num_experts, num_topk, skew, tokens_per_rank, routing_seed,
emulated_ep, rows, padded_rows, piece, impl, median_us, p20_us, p80_us, flops, tflops, sm_mhz``
(the median SM clock sampled during the timed calls) and the run's provenance. Speeds are
printed and written, never asserted.
"""

from __future__ import annotations

import argparse
import sys

import torch

from mok.bench.common import (
    OneGpuRecorder,
    add_warm_s,
    case_jobs,
    check_one_gpu,
    draw_routing,
    init_dist,
    parse_choices,
    provenance,
    run_cases,
    time_cuda,
)
from mok.bench.layer import MODELS, emulated_shape
from mok.spec.rows import bench_routing_seed

PIECES = (
    "dW_gate_up",
    "dW_down",
    "gate_up_dgrad",
    "bwd_recompute",
    "bwd_from_saved",
    "bwd_saved_all",
    "fwd_saving",
    "fwd_gate_up",
    "fwd_down",
)


class ExpertsRecorder(OneGpuRecorder):
    """The rows of the experts CSV."""

    def describe(self, row: dict) -> str:
        return (
            f"{row['model']:>14} {row['skew']:>8} {row['piece']:>15} {row['impl']:>10} "
            f"{row['median_us']:>9.1f} us {row['tflops']:>6.1f} TFLOP/s"
        )


def piece_flops(piece: str, rows: int, hidden: int, inter: int) -> int:
    """Useful FLOPs of a piece over ``rows`` routed rows."""
    gemm = 2 * rows * hidden * inter  # one [rows, H] x [H, I] GEMM
    return {
        "dW_gate_up": 2 * gemm,
        "dW_down": gemm,
        "gate_up_dgrad": 2 * gemm,
        "bwd_recompute": 3 * gemm,
        "bwd_from_saved": gemm,
        "bwd_saved_all": 6 * gemm,
        "fwd_saving": 3 * gemm,
        "fwd_gate_up": 2 * gemm,
        "fwd_down": gemm,
    }[piece]


def gathered_rows(idx: torch.Tensor, num_experts: int, align: int):
    """The one-rank schedule of routing ``idx`` [n, K] (:func:`reference.schedule.build_schedule`):
    (int32 group ends, each expert's region padded to a multiple of ``align``; the padded row
    total; int32 [total] row sources: the flat routing entry token * K + k of each receive row,
    each expert's entries in token order, -1 for a padding row), on ``idx``'s device."""
    from reference.schedule import build_schedule

    s = build_schedule(idx.cpu()[None], num_experts, 0, row_tile=align)
    to = dict(dtype=torch.int32, device=idx.device)
    return s.offsets[1:].to(**to), s.num_rows, s.src_index.to(**to)


def run_case(rec, model, n, skew, pieces, iters, warmup, emulate_ep, device, warm_s=0.0):
    """The rows of one (model, tokens, skew): every piece of ``pieces``, mok and torch, on the
    same operands."""
    import mok
    from mok import experts as me
    from mok import ops
    from mok.layer import unfused_row_tile
    from mok.spec.workload import get_shape

    shape = emulated_shape(get_shape(model), 1, emulate_ep)
    E, H, inter, K = shape.num_experts, shape.hidden, shape.intermediate, shape.num_topk
    seed = bench_routing_seed(n)
    idx, _, _ = draw_routing(n, E, K, skew, seed=seed)
    # receive row r holds routing entry row_src[r] (token row_src[r] // K), each group's entries
    # in token order, padding rows -1: the gathering kernels read `tokens` through it, the
    # others the rows as a dispatched copy
    offs, R, row_src = gathered_rows(idx, E, unfused_row_tile(mok.MoKConfig()))
    real = idx.numel()
    g = torch.Generator(device=device).manual_seed(13)

    def rnd(*s, scale=1.0):
        return (torch.randn(*s, device=device, generator=g) * scale).to(torch.bfloat16)

    x, dy, hw = rnd(R, H), rnd(R, H), rnd(R, inter)
    dgu = rnd(R, 2 * inter)
    wgu, wd = rnd(E, 2 * inter, H, scale=H**-0.5), rnd(E, H, inter, scale=inter**-0.5)
    row_w = torch.rand(R, device=device, generator=g)
    base = dict(model=model, hidden=H, intermediate=inter, num_experts=E, num_topk=K, skew=skew)
    base.update(tokens_per_rank=n, routing_seed=seed, emulated_ep=emulate_ep or 1)
    base.update(rows=real, padded_rows=R)
    tokens, dy_tokens = rnd(n, H), rnd(n, H)
    row_w32 = row_w.float().contiguous()

    def dh_gathered(gu32):  # the experts' kernel with x's / dy's rows gathered from the tokens
        hw_g, dgu_g = torch.empty_like(hw), torch.empty_like(dgu)
        part = torch.empty(inter // 128, R, device=device)
        ops.swiglu_backward_gather_sm90(
            tokens, dy_tokens, row_src, K, wgu, wd, offs, row_w32, hw_g, dgu_g, part, gu32
        )

    c_gu = torch.empty(E, 2 * inter, H, device=device, dtype=torch.bfloat16)
    c_gu_t = torch.empty(E, H, 2 * inter, device=device, dtype=torch.bfloat16)
    c_d = torch.empty(E, H, inter, device=device, dtype=torch.bfloat16)
    saved = None
    if "bwd_from_saved" in pieces or "bwd_saved_all" in pieces:
        saved = me.grouped_swiglu_saving(x, wgu, wd, offs)[1]
    saving = dict(group_align=unfused_row_tile(mok.MoKConfig()), saved_gu=saved)

    def switched(fn, on):  # fn with dW_gate_up as x^T dgu stored transposed (on) or as dgu^T x
        def call():
            old, ops.WGRAD_GU_TRANSPOSED = ops.WGRAD_GU_TRANSPOSED, on
            try:
                return fn()
            finally:
                ops.WGRAD_GU_TRANSPOSED = old

        return call

    def whole_fused():
        return me.swiglu_backward(x, wgu, wd, dy, row_w, offs, fused=True, **saving)

    def whole_gathered():
        return me.swiglu_backward_gathered(
            tokens, dy_tokens, row_src, K, R, wgu, wd, row_w, offs, None, saved
        )

    calls = {
        "dW_gate_up": {
            "mok": lambda: ops.wgrad_sm90(dgu, x, offs, c_gu),
            "torch": lambda: torch._grouped_mm(dgu.T, x, offs=offs),
            "mok-gather": lambda: me._wgrad_gathered(dgu, tokens, row_src, K, 1, offs, None),
            # its transpose x^T dgu [H, 2I]: x's rows the 128-wide operand A (no transpose back)
            "mok-t": lambda: ops.wgrad_sm90(x, dgu, offs, c_gu_t),
            "mok-gather-t": lambda: me._wgrad_gathered(dgu, tokens, row_src, K, 0, offs, None),
            # the same, each tile stored transposed into [L, 2I, H]
            "mok-ts": lambda: ops.wgrad_sm90(x, dgu, offs, c_gu, False, True),
            "mok-gather-ts": lambda: me._wgrad_gathered(
                dgu, tokens, row_src, K, 1, offs, None, True
            ),
        },
        "dW_down": {
            "mok": lambda: ops.wgrad_sm90(dy, hw, offs, c_d),
            "torch": lambda: torch._grouped_mm(dy.T, hw, offs=offs),
            "mok-gather": lambda: me._wgrad_gathered(hw, dy_tokens, row_src, K, 0, offs, None),
        },
        "gate_up_dgrad": {
            "mok": lambda: me.gate_up_dgrad(dgu, wgu, offs),
            "torch": lambda: torch._grouped_mm(dgu, wgu, offs=offs),
        },
        "bwd_recompute": {
            "mok": lambda: me._swiglu_backward_sm90(x, wgu, wd, dy, row_w, offs),
            "torch": lambda: me._swiglu_backward_torch(x, wgu, wd, dy, row_w, offs),
            "mok-gather": lambda: dh_gathered(None),
        },
        "bwd_from_saved": {
            "mok": lambda: me._swiglu_backward_sm90(x, wgu, wd, dy, row_w, offs, saved),
            "mok-gather": lambda: dh_gathered(saved),
        },
        "bwd_saved_all": {
            "mok": switched(whole_fused, False),
            "mok-serial": switched(
                lambda: me.swiglu_backward(x, wgu, wd, dy, row_w, offs, fused=False, **saving),
                False,
            ),
            "mok-gather": switched(whole_gathered, False),
            "mok-ts": switched(whole_fused, True),
            "mok-gather-ts": switched(whole_gathered, True),
        },
        "fwd_saving": {
            "mok": lambda: me.grouped_swiglu_saving(x, wgu, wd, offs),
            "torch": lambda: me.grouped_swiglu(
                x, wgu[:, :inter], wgu[:, inter:], wd, offs, exact=False, w_gate_up=wgu
            ),
        },
        "fwd_gate_up": {
            "mok": lambda: me._saving(x, wgu, wd, offs),
            "torch": lambda: me._swiglu(me._mm(x, wgu.transpose(1, 2), offs), inter),
            "torch-dense": lambda: me._swiglu(x @ wgu[0].T, inter),
        },
        "fwd_down": {
            "torch": lambda: me._mm(hw, wd.transpose(1, 2), offs),
            "torch-dense": lambda: hw @ wd[0].T,
        },
    }
    for piece in pieces:
        flops = piece_flops(piece, real, H, inter)
        for impl, fn in calls[piece].items():
            t = time_cuda(fn, iters, warmup, warm_s=warm_s, clocks=True)
            rec.add(
                **base,
                piece=piece,
                impl=impl,
                median_us=t.median_us,
                p20_us=t.p20_us,
                p80_us=t.p80_us,
                flops=flops,
                tflops=round(flops / (t.median_us * 1e6), 1),
                sm_mhz=t.sm_mhz,
            )


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m mok.bench experts")
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--tokens", default="4096")
    ap.add_argument("--skews", default="uniform,hot:0.5")
    ap.add_argument("--pieces", default=",".join(PIECES), help=f"comma list of {', '.join(PIECES)}")
    ap.add_argument(
        "--emulate-ep",
        type=int,
        default=2,
        help="the per-rank work of this EP size (the model's experts / N, same tokens)",
    )
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    add_warm_s(ap)
    ap.add_argument("--csv", default="mok-bench-experts.csv")
    return ap


def main(argv: list[str]) -> int:
    ap = build_parser()
    args = ap.parse_args(argv)
    pieces = parse_choices(ap, args.pieces, PIECES, "--pieces")
    check_one_gpu(ap, args.emulate_ep)
    dev = init_dist("mok.bench experts")
    rec = ExpertsRecorder(args.csv, provenance())

    def run(model, n, skew):
        run_case(
            rec, model, n, skew, pieces, args.iters, args.warmup, args.emulate_ep, dev, args.warm_s
        )

    return run_cases(rec, case_jobs(args), "experts", run)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
