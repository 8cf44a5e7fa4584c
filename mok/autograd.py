"""The MoE layer under autograd: :func:`moe` is :func:`mok.functional.moe_forward` that
``loss.backward()`` differentiates (gradients for x, the routing weights and every weight).

Forward: :func:`mok.functional.moe_forward` as it is (fused or not); nothing but the inputs is
saved. Backward (:class:`_MoE`), at any number of ranks, through mok's communication kernels and
GEMMs, recomputing the forward activations (MoK's design: the expert's owner pulls, then pushes):

* the schedule is built again from the saved routing and weights (the workspace's table may
  belong to a later call by then; the build is deterministic, so the rows are the forward's),
  or at one rank copied back from the tables the unfused forward kept (:data:`RESTORE_SCHEDULE`);
  each receive row's routing weight is read from the routing its home rank published in that
  build (:meth:`mok.schedule.DeviceSchedule.row_weights`: no transfer);
* reverse combine: ``dispatch(grad_out)`` brings each token's output gradient to its receive
  rows on the experts' owners (a pull; rows that hold no token are zero);
* the experts (:func:`mok.experts.swiglu_backward`): x dispatched again; on Hopper the experts'
  backward kernel computes the down projection's dgrad and gate / up again in fp32
  accumulators, with the SwiGLU backward, the routing weight and the router-weight gradient
  ``<h, dY @ W_down>`` in its epilogue (elsewhere torch ops do); the gate / up dgrad and the
  weight gradients are grouped GEMMs over the token axis (one fp32 accumulation each, no
  atomics); weight gradients stay on the owner;
* reverse dispatch: the combine kernel with unit weights pushes each row's input gradient into
  its token's (token, k) slot on the home rank, which sums the k rows in fixed k order onto the
  shared expert's fp32 input gradient (rounded to bf16 once); each row's router-weight gradient
  goes home beside it (:func:`mok.comm.stage_row_grads` before the combine,
  :func:`mok.comm.pull_row_grads` after it).

With :data:`TRANSFERS_IN_LAUNCH` (off by default) and saved activations, the two dispatches
and the reverse dispatch run as tasks of the routed experts' one launch instead
(:func:`mok.experts.swiglu_backward_tokens`), with the same bits: at one rank as local copies,
at more ranks over the workspace's symmetric memory (the rows staged by their home ranks and
pulled by the experts' owners, the input gradients pushed into the home ranks' slots, each
row's router-weight gradient staged in the launch and pulled after it), except with
``dispatch_mode="dedup_pull"`` at more ranks, whose transfers stay in the communication
kernels.

Off CUDA the layer is the reference (:func:`reference.moe.moe_forward`, its gradients from
:func:`reference.moe.moe_backward`). Under torch.compile the layer is two custom ops,
``mok::moe`` and ``mok::moe_backward`` (autograd registered, fake implementations for the
shapes), which run the same code inside: the graph holds no op that writes mok's workspace.
"""

from __future__ import annotations

import dataclasses
import functools
from pathlib import Path

import torch
from torch.autograd.function import once_differentiable

from mok import layer
from mok.comm import combine, dispatch, pull_row_grads, stage_row_grads
from mok.errors import MoKInputError, MoKUnsupportedError
from mok.experts import (
    _kernel_fits,
    gate_up_weight,
    gathered_backward_fits,
    shared_kept,
    swiglu_backward,
    swiglu_backward_gathered,
    swiglu_backward_tokens,
    tokens_backward_misfit,
)
from mok.layer import (
    as_config,
    moe_forward,
    resolve_path,
    unfused_config,
    unfused_row_tile,
)
from mok.ops import TAGS, traced
from mok.path_choice import check_fused_arg
from mok.reference_layer import check_reference_inputs, group_size, reference_grads, reference_layer
from mok.schedule import restore_schedule, routed_rows_bound
from mok.sms import budget_sms, sm_budget
from mok.spec.arch import arch_paths, refusal
from mok.spec.config import MoKConfig
from mok.workspace import get_workspace
from reference.moe import MoEGrads
from reference.weights import MoEWeights

__all__ = ["moe", "moe_backward"]

# True: the backward from saved g / u moves its tokens inside the routed experts' launch where
# that launch takes the operands (mok.experts.swiglu_backward_tokens) instead of running the
# communication kernels around it, at one rank and at more (not dedup_pull there). The same
# bits either way (tests compare them). Off by default: at one rank it measured 0.2-0.6 ms
# slower per step at DeepSeek-V3 and up to 0.5 ms at Kimi-K2, 0.07 ms faster at Qwen3-30B
# (docs/perf-notes.md, "The backward's transfers in its launch"); at more ranks not measured
# on NVLink yet.
TRANSFERS_IN_LAUNCH = False

# Whether the backward at one rank reads its rows from the tokens inside the experts' kernels
# (_gathers_backward) instead of dispatching x and grad_out first: True, False, or "auto" (only
# where the experts' intermediate size is at most GATHER_BACKWARD_MAX_INTER). Also needs the
# forward's switch, mok.layer.GATHER_AT_ONE_RANK. Its own switch so that one build times both.
# "auto" follows one H100 (docs/perf-notes.md, the gathering weight gradients' outcome): the
# gathering weight-gradient kernel runs 1.3-1.6x the TMA one's time, which the two dispatches it
# saves outweigh at intermediate 256 (backward 257 -> 280 TFLOP/s at 24576 x 1536) but not at
# 512 and above (423 -> 389, 468 -> 427, 526 -> 451).
GATHER_BACKWARD: bool | str = "auto"
GATHER_BACKWARD_MAX_INTER = 256

# True: at one rank the unfused forward keeps a device copy of the schedule tables its backward
# reads (mok.schedule.DeviceSchedule.save: 4.2 MB at 24576 tokens, top-8 of 128 experts; only
# where autograd records the call) and the backward copies them back
# (mok.schedule.restore_schedule) instead of running the schedule kernel again: one schedule
# kernel a step instead of two. The same bits either way (the build is deterministic); the fused
# forward and more ranks build again, as does the traced layer (mok::moe / mok::moe_backward).
# Its own switch so that one build times both. Measured on one H100 at 24576 x 1536 x 256
# (docs/perf-notes.md, "Outcomes: the schedule's steps, the restored schedule"): one schedule
# kernel a step instead of two; `mok-saved`'s backward 3.02 -> 2.98 ms (the kernel it saves is
# 71 us since the schedule's walk takes 32 / K tokens a step).
RESTORE_SCHEDULE = True


def moe(
    x: torch.Tensor,
    topk_idx: torch.Tensor,
    topk_weights: torch.Tensor,
    weights: MoEWeights,
    num_experts: int,
    config: MoKConfig | dict | str | Path | None = None,
    group=None,
    fused: bool | str = False,
    recompute: bool = True,
    main_grad: bool = False,
) -> torch.Tensor:
    """:func:`mok.functional.moe_forward` (same arguments, same result), differentiable: when
    autograd records (grad mode on and x, topk_weights or a weight requires grad), the backward
    gives gradients for x (bf16), topk_weights (its dtype) and every weight tensor of
    ``weights`` (their dtype), at any number of ranks of ``group``: each rank gets the
    gradients of its tokens (x, topk_weights), of its experts (over every rank's rows) and of
    its shared expert (over its own tokens). With ``MoKConfig(row_order="source")`` and a
    non-dedup dispatch, every result is bitwise that of one rank over the concatenated batch.

    ``recompute=False`` (Hopper) keeps the routed experts' fp32 gate / up outputs from the
    forward ([rows, 2I] fp32, 1.03 GiB at DeepSeek-V3's per-rank work of EP2), and the shared
    expert's ([num_tokens, 2Is] fp32, 64 MiB there) where the backward's kernel takes its
    shapes, instead of computing them again in the backward. The unfused forward keeps them
    from its saving kernel (its output is then that kernel's, h from fp32 g / u, rather than
    torch's); the fused one writes them from its gate / up tiles (its output unchanged, its rows
    padded to its row tile, so up to ``L * (row_tile - 16)`` more rows). The gradients are the
    backward's that recomputes them, bit for bit. Under torch.compile the kept g / u are the
    forward op's second and third outputs (routed rows: what one call can fill,
    :func:`_saved_rows`).

    Where w_gate and w_up (or the shared expert's) are views of the two halves of one tensor
    (``mok.MoE``'s ``gate_up``), that tensor is what autograd differentiates: its gradient is
    the backward's one [L, 2I, H] weight gradient, not two half gradients scattered into it.

    ``main_grad=True``: a weight that has a ``main_grad`` attribute (an fp32 tensor of its
    shape, as Megatron's optimizer keeps) gets its gradient added there instead of into
    ``.grad`` (which stays None; ``grad_added_to_main_grad`` is set where the weight has that
    attribute). On CUDA the routed experts' one gate_up tensor and w_down get the weight-gradient
    kernel's fp32 sums added directly (one add per element, never rounded to bf16); any other
    such weight gets its gradient added after it is formed. Eager only (MoKUnsupportedError
    under torch.compile).

    Off CUDA (any float dtype) it is the reference layer on one device, which needs every expert
    (MoKInputError otherwise). ``torch.compile`` traces it, ``fullgraph=True`` included, as the
    ops ``mok::moe`` / ``mok::moe_backward``: compiled and eager results are bitwise equal.
    """
    w = weights
    # NOTE: traced, the leaves are the weights as given (torch.compile does not trace the
    # storage offsets _leaves reads); mok.MoE names its gate_up leaves itself.
    tracing = traced([x, topk_idx, topk_weights, w.w_gate, w.w_up, w.w_down])
    pair = (lambda g, u: [g, u]) if tracing else _leaves
    leaves = [*pair(w.w_gate, w.w_up), w.w_down, None, None, None]
    if getattr(w, "shared_w_gate", None) is not None:
        leaves[3:] = [*pair(w.shared_w_gate, w.shared_w_up), w.shared_w_down]
    return moe_on_leaves(
        x, topk_idx, topk_weights, w, leaves, num_experts, config, group, fused, recompute,
        main_grad,
    )  # fmt: skip


def moe_on_leaves(
    x: torch.Tensor,
    topk_idx: torch.Tensor,
    topk_weights: torch.Tensor,
    weights: MoEWeights,
    leaves: list,
    num_experts: int,
    config: MoKConfig | dict | str | Path | None = None,
    group=None,
    fused: bool | str = False,
    recompute: bool = True,
    main_grad: bool = False,
) -> torch.Tensor:
    """:func:`moe` with the tensors autograd differentiates named: ``leaves`` is [w_gate, w_up,
    w_down, shared_w_gate, shared_w_up, shared_w_down] (None for no shared expert) where a
    gate_up tensor whose halves ``weights``' w_gate and w_up are takes the w_gate place (and
    None the w_up place); see :func:`_leaves`."""
    tensors = [x, topk_weights, *leaves]
    into = None
    if main_grad:
        if traced([topk_idx, *tensors]):
            raise MoKUnsupportedError(
                "main_grad=True adds gradients into main_grad eagerly; under torch.compile "
                "leave it False and add the .grad of each weight yourself"
            )
        leaves, into = _main_grad_leaves(leaves, x.is_cuda)
        tensors = [x, topk_weights, *leaves]
    tracing = traced([topk_idx, *tensors])
    if x.is_cuda:  # "auto": the faster forward of this layer, measured once (mok.path_choice)
        fused = resolve_path(fused, x, topk_idx, topk_weights, weights, num_experts,
                             as_config(config), group, not recompute, tracing)  # fmt: skip
    else:
        check_fused_arg(fused)
        fused = fused is True  # the reference layer runs: fused is ignored
    if not x.is_cuda and not tracing:
        check_reference_inputs(x, topk_idx, topk_weights, weights, num_experts)
    if tracing or not x.is_cuda:
        out, _, _ = _moe_op(
            x, topk_idx, topk_weights, *leaves, num_experts, _config_text(config),
            _group_name(group), fused, recompute,
        )  # fmt: skip
        return out
    if not (torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)):
        return moe_forward(x, topk_idx, topk_weights, weights, num_experts, config, group, fused)
    _check_saving(x, weights, fused, recompute)
    return _MoE.apply(
        topk_idx, weights, num_experts, config, group, fused, recompute, into, *tensors
    )


def _main_grad_leaves(leaves: list, cuda: bool) -> tuple[list, tuple | None]:
    """(the leaves autograd differentiates, the fp32 accumulators mok's backward adds the
    routed gate_up / w_down weight gradients into (None where it adds none)): on CUDA the one
    gate_up leaf and w_down keep their place and their ``main_grad`` goes to the backward;
    every other leaf with a ``main_grad`` is wrapped so that its gradient is added there."""
    leaves, into = list(leaves), [None, None]
    for i, t in enumerate(leaves):
        acc = None if t is None else getattr(t, "main_grad", None)
        if acc is None:
            continue
        if acc.dtype != torch.float32 or acc.shape != t.shape:
            raise MoKInputError(
                f"main_grad must be an fp32 tensor of its weight's shape {tuple(t.shape)} "
                f"(found {acc.dtype} {tuple(acc.shape)})"
            )
        slot = {0: 0, 2: 1}.get(i) if cuda and (i != 0 or leaves[1] is None) else None
        if slot is None:
            leaves[i] = _AddToMainGrad.apply(t)
        else:
            into[slot] = acc
    return leaves, (None if into == [None, None] else tuple(into))


class _AddToMainGrad(torch.autograd.Function):
    """The identity; its backward adds the gradient (as fp32) onto the weight's main_grad and
    gives the weight none."""

    @staticmethod
    def forward(ctx, w):
        ctx.w = w
        return w.view_as(w)

    @staticmethod
    def backward(ctx, grad):
        _added(ctx.w).main_grad.add_(grad.float())
        return None


def _in_main_grad(grads: list, routed, into) -> list:
    """``grads`` (leading with the routed leaves' gradients, in :func:`_leaves` order) with None
    for each routed leaf whose gradient went into its main_grad (``into``: the gate_up leaf's
    accumulator, slot 0, and w_down's, slot 2), those leaves marked (:func:`_added`)."""
    for i, acc in zip((0, 2), into, strict=True):
        if acc is not None:
            grads[i] = None
            _added(routed[i])
    return grads


def _added(w: torch.Tensor) -> torch.Tensor:
    """``w``, marked as having its gradient in main_grad (Megatron's flag, where it has one)."""
    if hasattr(w, "grad_added_to_main_grad"):
        w.grad_added_to_main_grad = True
    return w


def moe_backward(
    grad_out: torch.Tensor,
    x: torch.Tensor,
    topk_idx: torch.Tensor,
    topk_weights: torch.Tensor,
    weights: MoEWeights,
    num_experts: int,
    config: MoKConfig | dict | str | Path | None = None,
    group=None,
) -> MoEGrads:
    """The layer's backward as one explicit call, without autograd: the gradients that
    ``loss.backward()`` through :func:`moe` gives for ``grad_out`` (dL / d of the output of
    :func:`mok.functional.moe_forward` with these arguments), as
    :class:`reference.moe.MoEGrads` (the pair of :func:`reference.moe.moe_backward`): dx in x's
    dtype, d_topk_weights in topk_weights', every weight gradient in its weight's dtype
    (dw_gate / dw_up views of one [L, 2I, H] gradient on CUDA). The forward activations are
    recomputed from the inputs. On CUDA mok's backward (any number of ranks, collective over
    ``group``); elsewhere the reference's."""
    if tuple(grad_out.shape) != tuple(x.shape) or grad_out.device != x.device:
        raise MoKInputError(
            f"grad_out must be like the layer's output, {tuple(x.shape)} on {x.device} (found "
            f"{tuple(grad_out.shape)} on {grad_out.device})"
        )
    w = weights
    if not x.is_cuda:
        check_reference_inputs(x, topk_idx, topk_weights, w, num_experts)
    leaves = [w.w_gate, w.w_up, w.w_down]
    leaves += [getattr(w, f"shared_w_{n}", None) for n in ("gate", "up", "down")]
    grads = _layer_grads(grad_out, x, topk_idx, topk_weights, leaves, num_experts, config, group)
    return MoEGrads(*grads)


def _layer_grads(
    grad_out, x, topk_idx, topk_weights, leaves, num_experts, config, group, saved=None,
    fused=False,
) -> list:  # fmt: skip
    """The gradients of (x, topk_weights, *leaves) (None for a None leaf), each in its input's
    dtype: mok's backward on CUDA (:func:`_backward`, ``saved`` and ``fused`` as there), else
    the reference's."""
    if x.is_cuda:
        grads = _backward(
            grad_out, x, topk_idx, topk_weights, leaves[:3], leaves[3:], num_experts, config,
            group, saved, fused=fused,
        )  # fmt: skip
    else:
        grads = _reference_grads(grad_out, x, topk_idx, topk_weights, leaves, num_experts, group)
    inputs = [x, topk_weights, *leaves]
    return [None if g is None else g.to(t.dtype) for g, t in zip(grads, inputs, strict=True)]


def _check_saving(x, weights, fused: bool, recompute: bool) -> None:
    """MoKUnsupportedError where ``recompute=False`` cannot keep gate / up (on CUDA): the
    backward from them runs in mok's Hopper kernel (the fused forward checks the rest)."""
    if recompute:
        return
    if x.is_cuda:
        paths = arch_paths(torch.cuda.get_device_capability(x.device))
        if not paths.expert_kernels:
            what = "recompute=False (the backward from kept gate / up, in mok's kernel)"
            raise MoKUnsupportedError(refusal(paths, what, "Use recompute=True."))
    gu = gate_up_weight(weights.w_gate, weights.w_up)
    if not _kernel_fits(x, gu, weights.w_down, x):
        raise MoKUnsupportedError(
            "recompute=False keeps gate / up for mok's Hopper backward kernel, which does not "
            f"take these operands (x {tuple(x.shape)} {x.dtype} on {x.device}, w_down "
            f"{tuple(weights.w_down.shape)}; it needs a Hopper GPU, bf16, H a multiple of 64, "
            "I of 128); use recompute=True"
        )


def _saved_rows(
    num_tokens: int,
    num_topk: int,
    num_local_experts: int,
    config: MoKConfig,
    fused: bool,
    num_ranks: int = 1,
) -> int:
    """Rows of the fp32 gate / up that a traced ``recompute=False`` forward outputs: the receive
    rows one call can fill, known from the shapes (regions padded to the fused layer's row
    tile, or to the unfused path's). One rank: its own rows; with peers: the receive buffer,
    sized by ``config.max_tokens`` (which must then be set: the peers' counts are not known
    when the graph is traced)."""
    tile = _kept_row_tile(config, fused)
    if num_ranks == 1:
        return routed_rows_bound(num_tokens, num_topk, num_local_experts, tile)
    if not config.max_tokens:
        raise MoKUnsupportedError(
            f"recompute=False under torch.compile at {num_ranks} ranks keeps the gate / up of "
            "every receive row, whose count the graph needs before the peers' token counts are "
            "known: set MoKConfig.max_tokens (the most tokens any rank passes), or use "
            "recompute=True"
        )
    return dataclasses.replace(config, row_tile=tile).capacity_rows(
        config.max_tokens, num_topk, num_local_experts, num_ranks
    )


def _kept_row_tile(config: MoKConfig, fused: bool) -> int:
    """The row tile the expert regions of a ``recompute=False`` forward's kept rows are padded
    to: the config's in the fused forward, the unfused path's otherwise."""
    return config.row_tile if fused else unfused_row_tile(config)


def _leaves(w_gate: torch.Tensor, w_up: torch.Tensor) -> list:
    """[gate_up, None] where w_gate / w_up are views of the two halves of the tensor gate_up
    (itself [..., 2I, H] and dense), else [w_gate, w_up]."""
    base = w_gate._base
    if base is None or w_up._base is not base or not base.is_contiguous():
        return [w_gate, w_up]
    *lead, inter, hidden = w_gate.shape
    if tuple(w_up.shape) != tuple(w_gate.shape) or tuple(base.shape) != (*lead, 2 * inter, hidden):
        return [w_gate, w_up]
    if w_gate.stride() != base.stride() or w_up.stride() != base.stride():
        return [w_gate, w_up]
    at = base.storage_offset()
    if w_gate.storage_offset() != at or w_up.storage_offset() != at + inter * hidden:
        return [w_gate, w_up]
    return [base, None]


def _gate_up(first: torch.Tensor, second: torch.Tensor | None) -> torch.Tensor:
    """The [.., 2I, H] gate / up weight of the leaves :func:`_leaves` made: the one tensor
    itself, or :func:`mok.experts.gate_up_weight` of w_gate / w_up."""
    return first if second is None else gate_up_weight(first, second)


def _weights(*leaves: torch.Tensor | None) -> MoEWeights:
    """The :class:`MoEWeights` of the six leaves (routed gate, up, down, then the shared
    expert's) of :func:`_leaves`: the halves of a gate_up leaf as views."""

    def pair(first, second):
        return [first, second] if second is not None or first is None else _halves(first)

    return MoEWeights(*pair(*leaves[:2]), leaves[2], *pair(*leaves[3:5]), leaves[5])


def _halves(gate_up: torch.Tensor) -> list:
    """The gate and up halves ([.., I, H] views) of a [.., 2I, H] tensor."""
    i = gate_up.shape[-2] // 2
    return [gate_up[..., :i, :], gate_up[..., i:, :]]


class _MoE(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx, topk_idx, weights, num_experts, config, group, fused, recompute, into, *tensors
    ):
        saved = None if recompute else []
        # the unfused forward's schedule (its workspace and row tile are the backward's)
        scheds = [] if RESTORE_SCHEDULE and not fused else None
        out = moe_forward(
            tensors[0], topk_idx, tensors[1], weights, num_experts, config, group, fused,
            _saved=saved, _schedule=scheds,
        )  # fmt: skip
        ctx.save_for_backward(topk_idx, *tensors, *(saved or [None, None]))
        ctx.args, ctx.into, ctx.fused = (num_experts, config, group), into, fused
        # NOTE: a copy of its tables now, before a later call (another layer) builds on the
        # same workspace; None at more ranks (DeviceSchedule.save)
        ctx.schedule = scheds[0].save() if scheds else None
        return out

    @staticmethod
    @once_differentiable  # its kernels are not recorded: a second derivative would be wrong
    def backward(ctx, grad_out):
        topk_idx, x, topk_weights, *leaves, saved_gu, saved_shared = ctx.saved_tensors
        grads = _backward(
            grad_out, x, topk_idx, topk_weights, leaves[:3], leaves[3:], *ctx.args,
            (saved_gu, saved_shared), ctx.into, ctx.fused, ctx.schedule,
        )  # fmt: skip
        return (None,) * 8 + grads


def _backward(
    grad_out, x, topk_idx, topk_weights, routed, shared, num_experts, config, group,
    saved=None, into=None, fused=False, schedule=None,
):  # fmt: skip
    """:func:`_backward_on` under the config's SM budget (``MoKConfig.num_sms``)."""
    config = as_config(config)
    with sm_budget(config.num_sms):
        return _backward_on(
            grad_out, x, topk_idx, topk_weights, routed, shared, num_experts, config, group,
            saved, into, fused, schedule,
        )  # fmt: skip


def _backward_on(
    grad_out, x, topk_idx, topk_weights, routed, shared, num_experts, config, group,
    saved=None, into=None, fused=False, schedule=None,
):  # fmt: skip
    """Gradients for (x, topk_weights, *routed, *shared), the leaves of :func:`_leaves`: one
    [L, 2I, H] gradient (and None) where gate and up came as one tensor. ``saved``: the fp32
    gate / up outputs the forward kept (recompute=False), (routed, shared), either None
    (computed again); ``fused``: the fused forward kept them (its receive rows, regions padded
    to its row tile). ``into``: the fp32 accumulators of the one gate_up leaf and of w_down
    (either None) that their weight gradients are added onto; those leaves then get None.
    ``schedule``: the forward's :class:`mok.schedule.SavedSchedule` (:data:`RESTORE_SCHEDULE`),
    or None (the schedule is built again)."""
    saved_gu, saved_shared = (None, None) if saved is None else saved
    wd = routed[2]
    num_tokens, hidden = x.shape
    cfg = unfused_config(config, budget_sms(x.device, config.num_sms))
    if saved_gu is not None:
        # NOTE: the kept rows are where the forward put them: this schedule must pad the expert
        # regions as it did (the comm kernels still get every SM)
        cfg = dataclasses.replace(cfg, row_tile=_kept_row_tile(config, fused))
    ws = get_workspace(
        num_tokens, hidden, topk_idx.shape[1], num_experts, x.dtype, cfg, group, x.device
    )
    into = (None, None) if into is None else into
    if num_tokens == 0 and ws.num_ranks == 1:
        # no rows: zero weight gradients (nothing to add), empty input gradients. With peers
        # the rank takes part as always: its experts get the peers' rows.
        zeros = [None if t is None else torch.zeros_like(t) for t in (*routed, *shared)]
        return (
            torch.zeros_like(x),
            torch.zeros_like(topk_weights),
            *_in_main_grad(zeros, routed, into),
        )
    # NOTE: the forward's schedule again (the routing, hence every row index, is the forward's):
    # copied back from the tables the forward kept where that copy is of this workspace (one
    # rank, mok.schedule.restore_schedule), else built again. Each receive row's routing weight
    # comes from the routing its home rank published in the build; the reverse dispatch's
    # combine sums the row gradients unweighted (unit_weights).
    sched = restore_schedule(schedule, topk_idx, topk_weights, ws)
    cap = ws.capacity
    row_w = sched.row_weights()
    unit = sched.unit_weights()
    # reverse combine: each receive row gets its token's output gradient (a copy; the routing
    # weight is applied inside the experts' backward, after the down projection's dgrad). Into
    # buffers of our own (the second dispatch does not overwrite the first's rows) whose padding
    # rows get zeros (the weight gradients sum over them: 0 x garbage could be NaN); rows past
    # the last group are never read.
    mode = "pull" if cfg.dispatch_mode == "push" else None
    g_out = grad_out.to(torch.bfloat16).contiguous()
    empty = torch.empty(cap, hidden, dtype=x.dtype, device=x.device)
    recv = torch.empty_like(empty)
    gu = _gate_up(routed[0], routed[1])
    dedup = cfg.dispatch_mode == "dedup_pull"
    peers = ws.num_ranks > 1
    in_launch = (
        TRANSFERS_IN_LAUNCH
        and not (peers and dedup)  # the dedup combine's partials are the kernels' at EP > 1
        and saved_gu is not None
        and not tokens_backward_misfit(
            empty, gu, wd, sched.group_ends, saved_gu, cfg.row_tile, into
        )
    )
    if in_launch:
        # one launch: the reverse combine, the routed experts, the reverse dispatch onto the
        # shared expert's input gradient (computed first)
        dx_shared, d_shared = _shared_backward(x, g_out, shared, saved_shared)
        row_src = torch.where(sched.real_rows(), sched.src_index, -1).to(torch.int32)
        dx, d_row_w, d_wgu, d_wd = swiglu_backward_tokens(
            g_out, x.contiguous(), row_src, topk_idx.shape[1], (empty, recv), gu, wd, row_w,
            sched.group_ends, saved_gu, dx_shared, into, dedup, ws.id if peers else 0,
        )  # fmt: skip
        # with peers staged by the launch (every rank's before it ended); at one rank every
        # row is local
        d_topk = pull_row_grads(sched) if peers else d_row_w[sched.dst_index.long()]
    else:
        if _gathers_backward(ws, x, gu, wd, cfg):
            # one rank: the experts' kernels read each row's input and output gradient from
            # the tokens themselves (no dispatch of either; one launch per GEMM, where the
            # dispatched rows from saved g / u would run the fused backward kernel: the same
            # bits)
            d_recv, d_row_w, d_wgu, d_wd = swiglu_backward_gathered(
                x.contiguous(), g_out, sched.src_index, topk_idx.shape[1], cap, gu, wd, row_w,
                sched.group_ends, into, saved_gu,
            )  # fmt: skip
        else:
            dy = dispatch(g_out, sched, mode, out=empty, zero_padding=True)
            # the experts, recomputed from x dispatched again
            recv = dispatch(x, sched, mode, out=recv, zero_padding=True)
            d_recv, d_row_w, d_wgu, d_wd = swiglu_backward(
                recv, gu, wd, dy, row_w, sched.group_ends, group_align=cfg.row_tile,
                saved_gu=saved_gu, wgrad_into=into,
            )  # fmt: skip
            del recv, dy
        dx_shared, d_shared = _shared_backward(x, g_out, shared, saved_shared)
        # reverse dispatch: dx = dx_shared + sum_k dRecv[t, k], fixed k order, fp32, bf16 once
        # (the combine reads only the rows that hold a token); each row's router-weight
        # gradient travels home beside it (staged before the combine, read after it)
        stage_row_grads(d_row_w, sched)
        dx = combine(d_recv, unit, shared_y=dx_shared)
        d_topk = pull_row_grads(sched)
    d_topk = d_topk.to(topk_weights.dtype)
    d_routed = _in_main_grad([*_split(d_wgu, routed), d_wd], routed, into)
    return (dx.to(x.dtype), d_topk, *d_routed, *d_shared)


def _gathers_backward(ws, x, w_gate_up, w_down, cfg) -> bool:
    """Whether the backward reads its rows from the tokens
    (:func:`mok.experts.swiglu_backward_gathered`) instead of dispatching them: at one rank,
    with :data:`GATHER_BACKWARD` and :data:`mok.layer.GATHER_AT_ONE_RANK` (the forward's
    switch), where the kernels take the operands (:func:`mok.experts.gathered_backward_fits`).
    :data:`GATHER_BACKWARD` "auto" gathers only where the intermediate size is at most
    :data:`GATHER_BACKWARD_MAX_INTER`."""
    if GATHER_BACKWARD not in (True, False, "auto"):
        raise MoKInputError(
            f"mok.autograd.GATHER_BACKWARD is {GATHER_BACKWARD!r}; supported: True, False, 'auto'"
        )
    wanted = GATHER_BACKWARD is True or (
        GATHER_BACKWARD == "auto" and w_down.shape[-1] <= GATHER_BACKWARD_MAX_INTER
    )
    return (
        wanted
        and layer.GATHER_AT_ONE_RANK
        and ws.num_ranks == 1
        and gathered_backward_fits(x, w_gate_up, w_down, cfg.row_tile)
    )


def _shared_backward(x, g_out, shared, saved_shared) -> tuple:
    """(the shared expert's input gradient, fp32 for the reverse dispatch's sum, or None; its
    weight gradients, the leaves' layout)."""
    if shared[2] is None:
        return None, (None, None, None)
    if x.shape[0] == 0:  # a rank without tokens (its peers have some): nothing to differentiate
        d_shared = [None if t is None else torch.zeros_like(t) for t in shared]
        return x.new_zeros(x.shape, dtype=torch.float32), tuple(d_shared)
    sgu = _gate_up(shared[0], shared[1])
    dx_shared, _, d_sgu, d_swd = swiglu_backward(
        x, sgu, shared[2], g_out, d_a_dtype=torch.float32, saved_gu=saved_shared
    )
    return dx_shared, _split(d_sgu, shared) + (d_swd,)


def _split(d_gate_up: torch.Tensor, leaves) -> tuple:
    """The gradients of leaves[0:2]: (the [.., 2I, H] one, None) for one gate_up leaf, else its
    two halves."""
    return (d_gate_up, None) if leaves[1] is None else tuple(_halves(d_gate_up))


# ---- the layer as two custom ops, for torch.compile ---------------------------------------
# Traced, the layer is one opaque op (its backward another), so the graph holds no op that
# mutates mok's workspace buffers; eager calls skip the dispatcher (:class:`_MoE`).


def _config_text(config) -> str:
    """The op's config argument (MoKConfig JSON). NOTE: traced, a MoKConfig goes in as its field
    values: torch.compile turns plain constants into a constant result, not a frozen dataclass
    (torch 2.11: "can't reconstruct arbitrary frozen dataclass instances")."""
    if isinstance(config, MoKConfig):
        return _fields_text(*[getattr(config, name) for name in _CONFIG_FIELDS])
    return _any_text(config)


_CONFIG_FIELDS = tuple(f.name for f in dataclasses.fields(MoKConfig))


@torch.compiler.assume_constant_result
def _fields_text(*values) -> str:
    return MoKConfig(**dict(zip(_CONFIG_FIELDS, values, strict=True))).to_json()


@torch.compiler.assume_constant_result
def _any_text(config) -> str:  # None, a dict, a JSON path or text
    return as_config(config).to_json()


@torch.compiler.assume_constant_result
def _group_name(group) -> str:
    return "" if group is None else group.group_name


@functools.cache
def _config(text: str) -> MoKConfig:
    return MoKConfig.from_json(text)


def _group(name: str):
    return None if not name else torch.distributed.distributed_c10d._resolve_process_group(name)


@torch.library.custom_op("mok::moe", mutates_args=(), tags=TAGS)
def _moe_op(
    x: torch.Tensor,
    topk_idx: torch.Tensor,
    topk_weights: torch.Tensor,
    w_gate: torch.Tensor,  # or the [L, 2I, H] gate_up, then w_up is None
    w_up: torch.Tensor | None,
    w_down: torch.Tensor,
    shared_w_gate: torch.Tensor | None,  # or the [2Is, H] gate_up, then shared_w_up is None
    shared_w_up: torch.Tensor | None,
    shared_w_down: torch.Tensor | None,
    num_experts: int,
    config: str,  # MoKConfig.to_json()
    group: str,  # the process group's name, "" for None
    fused: bool,
    recompute: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(the layer's output, the fp32 gate / up kept for the backward: the routed experts'
    [:func:`_saved_rows`, 2I] and the shared expert's [num_tokens, 2Is] with ``recompute=False``
    on CUDA (the shared one where :func:`mok.experts.shared_kept` holds), else empty)."""
    weights = _weights(w_gate, w_up, w_down, shared_w_gate, shared_w_up, shared_w_down)
    none = functools.partial(_nothing, x)
    cfg, grp = _config(config), _group(group)
    if not x.is_cuda:
        return reference_layer(x, topk_idx, topk_weights, weights, num_experts, grp), none(), none()
    _check_saving(x, weights, fused, recompute)
    saved = None if recompute else []
    out = moe_forward(
        x, topk_idx, topk_weights, weights, num_experts, cfg, grp, fused, _saved=saved
    )
    if recompute:
        return out, none(), none()
    rows = _saved_rows(x.shape[0], topk_idx.shape[1], w_down.shape[0], cfg, fused, group_size(grp))
    gu32, shared32 = saved
    if gu32.shape[0] < rows:  # a receive buffer smaller than the bound (capacity_factor < 1)
        gu32 = torch.cat([gu32, gu32.new_zeros(rows - gu32.shape[0], gu32.shape[1])])
    return out, gu32[:rows], none() if shared32 is None else shared32


@_moe_op.register_fake
def _(x, topk_idx, topk_weights, w_gate, w_up, w_down, *rest) -> tuple:
    shared, config, fused, recompute = rest[:3], rest[4], rest[6], rest[7]
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    none = functools.partial(_nothing, x)
    if recompute or x.device.type != "cuda":
        return out, none(), none()
    rows = _saved_rows(
        x.shape[0], topk_idx.shape[1], w_down.shape[0], _config(config), fused,
        group_size(_group(rest[5])),
    )  # fmt: skip
    gu32 = x.new_empty(rows, 2 * w_down.shape[-1], dtype=torch.float32)
    if not shared_kept(x, *shared):
        return out, gu32, none()
    return out, gu32, x.new_empty(x.shape[0], 2 * shared[2].shape[-1], dtype=torch.float32)


def _nothing(x: torch.Tensor) -> torch.Tensor:
    """An empty fp32 output (a new one each: an op's outputs must not alias each other)."""
    return x.new_empty(0, dtype=torch.float32)


@torch.library.custom_op("mok::moe_backward", mutates_args=(), tags=TAGS)
def _moe_backward_op(
    grad_out: torch.Tensor,
    x: torch.Tensor,
    topk_idx: torch.Tensor,
    topk_weights: torch.Tensor,
    w_gate: torch.Tensor,
    w_up: torch.Tensor | None,
    w_down: torch.Tensor,
    shared_w_gate: torch.Tensor | None,
    shared_w_up: torch.Tensor | None,
    shared_w_down: torch.Tensor | None,
    num_experts: int,
    config: str,
    group: str,
    saved: torch.Tensor,  # the forward op's second output
    saved_shared: torch.Tensor,  # its third
    recompute: bool,
    fused: bool,  # the forward was the fused kernel (its saved rows' layout)
) -> list[torch.Tensor]:
    """[dx, d_topk_weights, then the gradient of each weight that is not None], contiguous, in
    the dtypes of their inputs."""
    leaves = [w_gate, w_up, w_down, shared_w_gate, shared_w_up, shared_w_down]
    kept = None if recompute else (saved, saved_shared if saved_shared.numel() else None)
    grads = _layer_grads(
        grad_out, x, topk_idx, topk_weights, leaves, num_experts, _config(config),
        _group(group), kept, fused,
    )  # fmt: skip
    # NOTE: an op's outputs alias neither its inputs nor each other: the two halves of one
    # gate_up gradient (gate and up given as separate leaves) are copied apart.
    halves = {2, 3} if w_up is not None else set()
    halves |= {5, 6} if shared_w_up is not None else set()
    return [
        g.clone() if i in halves else g.contiguous() for i, g in enumerate(grads) if g is not None
    ]


@_moe_backward_op.register_fake
def _(grad_out, x, topk_idx, topk_weights, *rest) -> list[torch.Tensor]:
    leaves = rest[:6]
    return [torch.empty_like(t, memory_format=torch.contiguous_format)
            for t in (x, topk_weights, *leaves) if t is not None]  # fmt: skip


def _reference_grads(grad_out, x, topk_idx, topk_weights, leaves, num_experts, group) -> list:
    """The gradients of the layer off CUDA for (x, topk_weights, *leaves), in the leaves' layout
    (:func:`mok.reference_layer.reference_grads`)."""
    g = reference_grads(grad_out, x, topk_idx, topk_weights, _weights(*leaves), num_experts, group)

    def gate_up(d_gate, d_up, one: bool) -> list:
        return [torch.cat([d_gate, d_up], -2), None] if one else [d_gate, d_up]

    routed = gate_up(g.dw_gate, g.dw_up, leaves[1] is None) + [g.dw_down]
    shared = [None, None, None]
    if leaves[5] is not None:
        shared = gate_up(g.d_shared_w_gate, g.d_shared_w_up, leaves[4] is None)
        shared.append(g.d_shared_w_down)
    return [g.dx, g.d_topk_weights, *routed, *shared]


def _setup(ctx, inputs, output) -> None:
    ctx.save_for_backward(*inputs[:9], output[1], output[2])
    ctx.args = inputs[9:12]  # num_experts, config, group
    ctx.fused, ctx.recompute = inputs[12], inputs[13]


def _moe_grad(ctx, grad_out, _grad_saved, _grad_saved_shared):
    x, topk_idx, topk_weights, *leaves, saved, saved_shared = ctx.saved_tensors
    args = (*leaves, *ctx.args, saved, saved_shared, ctx.recompute, ctx.fused)
    got = iter(torch.ops.mok.moe_backward(grad_out, x, topk_idx, topk_weights, *args))
    dx, d_topk = next(got), next(got)
    d_leaves = [None if t is None else next(got) for t in leaves]
    return (dx, None, d_topk, *d_leaves, None, None, None, None, None)


_moe_op.register_autograd(_moe_grad, setup_context=_setup)
