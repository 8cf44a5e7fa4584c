"""The comm-engine rate law of the measured mok kernels, for the standalone kernel model
(:mod:`sim.comm.model`, :func:`phase_rates`) and the layer model's opt-in kernel profile
(:mod:`sim.layer.model`, ``SimConfig.kernel_profile``, :func:`kernel_rates`).

Both take a kernel knob's per-SM rate as the probe's per-SM rate of its engine's curves
(:func:`curve_engine`) x its in-flight factor x a row-size scale x the SM congestion
``1 / (1 + n / sm_congestion_sms[engine])`` (:func:`congestion`), remote bytes x the switch-hop
latency factor, times ``n`` SMs. They differ where the two models differ:

==================== ====================================== ======================================
                     :func:`phase_rates` (standalone)        :func:`kernel_rates` (layer)
==================== ====================================== ======================================
SMs ``n``            the busiest warps' share of the grid   the config's ``num_comm_sms``
                     (``sms / busiest_share``, a float)
row-size scale       given: the warp routine's               :func:`layer_row_scale`: the warp
                     :func:`warp_row_scale`; 1 for bulk      routine's, or a bulk-copy ring's item-
                     copies, whose item cost is a task of    rate cap (the layer has no ring task)
                     its own (the ring's issue bound)
remote loads (pull)  not capped by the probe ceiling: the    capped by the probe ceiling, as the
                     NVLink port resources cap them          layer's probe rates are
==================== ====================================== ======================================

They also multiply the same factors in different orders (``probe x (f x scale x lat) x cong x
n`` against ``probe x (f x scale x cong x lat) x n``). One expression for both (with the pull cap
and the row scale as arguments) was tried: it moves the standalone predictions in their last bits
(about 1e-10 relative once through the event loop), so each keeps its own expression, next to the
other, and the committed profiles and reports stay reproducible.
"""

from __future__ import annotations

import math

from sim.comm.catalog import kernel_engine, knob_routine
from sim.comm.profile import KernelProfile
from sim.comm.rows import warp_row_scale
from sim.core.hardware import GpuProfile
from sim.core.topology import Topology
from sim.core.transfer import Rates

__all__ = ["curve_engine", "congestion", "layer_row_scale", "kernel_rates", "phase_rates"]


# engine label -> the probe curves / congestion constant it uses (gather: 16-byte cp.async)
_CURVE_ENGINE = {"gather": "vector"}
# engine -> the probe curves of its (push, pull, local) copies
_CURVES = {
    "vector": ("push_st", "pull_ld", "local_st"),
    "tma": ("push_tma", "pull_tma", "local_tma"),
}


def curve_engine(knob: str) -> str:
    """The engine whose probe curves and congestion constant kernel ``knob`` runs on."""
    e = kernel_engine(knob)
    return _CURVE_ENGINE.get(e, e)


def congestion(prof: KernelProfile, engine: str, num_sms: float) -> float:
    """The SM congestion of ``num_sms`` SMs on engine ``engine``: ``1 / (1 + n /
    sm_congestion_sms[engine])`` (1 without a constant for the engine)."""
    return 1.0 / (1.0 + num_sms / prof.sm_congestion_sms.get(engine, math.inf))


def layer_row_scale(prof: KernelProfile, knob: str, row_bytes: float, per_sm_gbps: float) -> float:
    """Row-size scale of kernel ``knob``'s per-SM rate for the layer model, which has no
    per-row term: the 16-byte warp routine's :func:`warp_row_scale`, or for a bulk-copy ring
    the item-rate cap (``row_bytes`` per ``tma_item_us``) over the ring's byte rate ``f x
    per_sm_gbps``, at most 1; 1 for the reduce pipelines, the gather ring and dedup_sum's row
    ring (no layer role runs them)."""
    eng, routine = kernel_engine(knob), knob_routine(knob)
    if eng == "vector":
        return warp_row_scale(routine, row_bytes, prof.warp_lookup_rounds.get(routine, 0.0))
    if eng == "tma" and routine in ("copy", "fan") and prof.tma_item_us > 0:
        cap_gbps = row_bytes / prof.tma_item_us / 1e3
        return min(1.0, cap_gbps / (prof.factor(knob) * per_sm_gbps))
    return 1.0


def kernel_rates(
    gpu: GpuProfile,
    topo: Topology,
    prof: KernelProfile,
    knob: str,
    num_sms: int,
    row_bytes: float,
) -> Rates:
    """Comm-engine rates (bytes/us) of ``num_sms`` SMs running the copy loop of the measured
    kernel ``knob`` of ``prof`` on rows of ``row_bytes``, for the layer model (see
    :meth:`sim.layer.model.LayerBuilder._kernel_rates`)."""
    n = float(num_sms)
    engine = curve_engine(knob)
    push, pull, local = _CURVES[engine]
    probe = gpu.curve(pull).per_sm_gbps
    rs = layer_row_scale(prof, knob, row_bytes, probe)
    cong = congestion(prof, engine, n)
    per_sm = prof.factor(knob) * rs * cong
    lat_factor = topo.per_sm_latency_factor(gpu)

    def rate(name: str, scale: float) -> float:
        return gpu.curve(name).scaled(per_sm=scale).gbps(n) * 1e3  # bytes per us

    return Rates(
        push=rate(push, per_sm * lat_factor),
        pull=rate(pull, per_sm * lat_factor),
        local=rate(local, per_sm),
    )


def phase_rates(
    gpu: GpuProfile,
    topo: Topology,
    prof: KernelProfile,
    knob: str,
    sms: float,
    scale: float = 1.0,
) -> Rates:
    """Comm-engine payload rates (bytes/us) of kernel ``knob`` of ``prof`` run as if on ``sms``
    SMs (the busiest warps' share of the grid), each at the probe's per-SM rate x the kernel's
    in-flight factor x ``scale`` (the row-size scale of its warp routine), for the standalone
    kernel model (:class:`sim.comm.model.PhaseBuilder`)."""
    n = float(sms)
    engine = curve_engine(knob)
    f = prof.factor(knob) * scale
    cong = congestion(prof, engine, n)
    push, pull, local = _CURVES[engine]
    lat = topo.per_sm_latency_factor(gpu)

    def rate(mech: str, per_sm: float, capped: bool = True) -> float:
        c = gpu.curve(mech)
        r = c.per_sm_gbps * per_sm * cong * n
        return (min(r, c.ceiling_gbps(n)) if capped else r) * 1e3

    # Remote loads overlap the local copies and are capped by the NVLink port resources
    # (wire rate, protocol both ways); remote stores come from the same instruction stream
    # as the local ones, so the engine serialises them at the probe's push ceiling.
    return Rates(
        push=rate(push, f * lat),
        pull=rate(pull, f * lat, capped=False),
        local=rate(local, f),
    )
