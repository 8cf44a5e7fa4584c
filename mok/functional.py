"""Functional layer: schedule, dispatch, combine and an MoE forward built from them.

The stages live in their own modules (:mod:`mok.schedule`, :mod:`mok.comm`, :mod:`mok.fused`);
this module is their public namespace, with :func:`moe_forward` (:mod:`mok.layer`), which
composes them, :func:`moe`, the same layer under autograd (:mod:`mok.autograd`), and
:func:`moe_backward` (also named :func:`backward`), its backward as one explicit call.

All calls are asynchronous: no ``.item()``, no host-side counts, no shape-dependent host
allocation. Sizes that depend on the routing (rows received, dedup rows) stay on the device; the
receive buffer has the fixed capacity of the workspace (:meth:`MoKConfig.capacity_rows`).

:func:`forward` runs the whole layer (dispatch, routed and shared SwiGLU experts, combine) as
one fused kernel on Hopper; :func:`moe_forward` builds the schedule and calls it
(``fused=True``) or composes the communication kernels with the experts (gate / up in mok's
kernel on Hopper, ``torch._grouped_mm`` elsewhere and for the down projection).
Wherever a config is taken, a :class:`MoKConfig`, a dict or the path of the JSON that
``mok-sim tune --emit-config`` writes are accepted.

Errors: arguments are checked on the host and raise at once (:class:`mok.MoKInputError` for bad
shapes, dtypes, devices or option values; :class:`mok.MoKUnsupportedError` for a GPU or config
mok does not run, or a call inside a CUDA graph capture). What only the device can see is
recorded by the kernel and raised, on every rank, by the next mok call on the workspace or by
:func:`mok.check`: expert ids out of range or repeated within a token
(:class:`mok.MoKInputError`), a receive buffer too small or more than ``max_tokens`` tokens on
some rank (:class:`mok.MoKCapacityError`), a peer that does not arrive
(:class:`mok.MoKTimeoutError`). After an input or capacity error the workspace recovers and the
next call runs normally; after a timeout it is unusable until :func:`mok.clear_workspaces`.
"""

from __future__ import annotations

from mok.autograd import moe, moe_backward
from mok.comm import combine, dedup_partials, dedup_sum, dispatch, fanout
from mok.fused import forward
from mok.layer import UNFUSED_ROW_TILE, as_config, moe_forward, unfused_config
from mok.schedule import DeviceSchedule, build_schedule

backward = moe_backward

__all__ = [
    "DeviceSchedule",
    "moe",
    "moe_backward",
    "backward",
    "build_schedule",
    "dispatch",
    "fanout",
    "combine",
    "dedup_partials",
    "dedup_sum",
    "forward",
    "moe_forward",
    "as_config",
    "unfused_config",
    "UNFUSED_ROW_TILE",
]
