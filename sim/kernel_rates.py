"""Comm-engine rates of the measured mok kernels, shared by the standalone kernel model
(:mod:`sim.phases`) and the layer model's opt-in kernel profile (:mod:`sim.model`,
``SimConfig.kernel_profile``): the engine whose probe curves and congestion constant a kernel knob
uses (:func:`curve_engine`), the row-size scale of a knob's per-SM rate for the layer
(:func:`layer_row_scale`) and the layer's rate law (:func:`kernel_rates`).

The standalone kernel model keeps its own rate law (:meth:`sim.phases.PhaseBuilder.
set_phase_rates`: the busiest warps' share of the grid as the SM count, remote loads left to the
NVLink port caps); both take the per-SM rate as probe x in-flight factor x row-size scale x
``1 / (1 + n / sm_congestion_sms[engine])``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from sim.kernel_rows import warp_row_scale
from sim.kernel_specs import kernel_engine, knob_routine

if TYPE_CHECKING:  # pragma: no cover
    from sim.hardware import GpuProfile
    from sim.kernel_profile import KernelProfile
    from sim.topology import Topology

__all__ = ["curve_engine", "layer_row_scale", "kernel_rates"]


@dataclass
class _Rates:
    push: float  # comm-engine payload bytes/us of remote stores
    pull: float  # of remote loads
    local: float  # of local copies


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
    per_sm_scale: float = 1.0,
) -> _Rates:
    """Comm-engine rates (bytes/us) of ``num_sms`` SMs running the copy loop of the measured
    kernel ``knob`` of ``prof`` on rows of ``row_bytes`` (see :meth:`sim.model.LayerBuilder.
    _kernel_rates`); ``per_sm_scale`` multiplies the per-SM rate before the probe ceilings (the
    fused layer's comm blocks: fewer warps, :mod:`sim.fused`)."""
    n = float(num_sms)
    engine = curve_engine(knob)
    push, pull, local = _CURVES[engine]
    probe = gpu.curve(pull).per_sm_gbps
    rs = layer_row_scale(prof, knob, row_bytes, probe)
    cong = 1.0 / (1.0 + n / prof.sm_congestion_sms.get(engine, math.inf))
    per_sm = prof.factor(knob) * rs * cong * per_sm_scale
    lat_factor = topo.per_sm_latency_factor(gpu)

    def rate(name: str, scale: float) -> float:
        return gpu.curve(name).scaled(per_sm=scale).gbps(n) * 1e3  # bytes per us

    return _Rates(
        push=rate(push, per_sm * lat_factor),
        pull=rate(pull, per_sm * lat_factor),
        local=rate(local, per_sm),
    )
