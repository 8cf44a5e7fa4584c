"""The one writer of ``mok-config/1`` JSON in the simulator: the tuners' picks as the document that
:meth:`mok.MoKConfig.from_json` loads (the config itself is :meth:`mok.MoKConfig.to_dict`, the
kernel's format; the simulator adds the workload it was tuned for, the prediction and its
breakdown).

* :func:`tune_document`: a layer-model pick (:func:`sim.layer.sweep.tune`, ``mok-sim tune``);
* :func:`fused_tune_document`: a fused-model pick (:func:`sim.fused.tune.tune_fused`, ``mok-sim
  tune --fused``), its config :func:`fused_mok_config`;
* :func:`write_json`: either, to a file.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

from mok.spec.config import MoKConfig
from mok.spec.rows import bench_routing_seed
from sim.config import SimConfig, Workload
from sim.fused.profile import FusedProfile
from sim.fused.tune import TUNE_TERMS
from sim.layer.model import kernel_knobs, layer_kernel_profile
from sim.layer.results import LayerResult

__all__ = ["tune_document", "fused_mok_config", "fused_tune_document", "write_json"]


def tune_document(wl: Workload, cfg: SimConfig, result: LayerResult) -> dict:
    """The JSON that ``mok.MoKConfig.from_json`` loads (format ``mok-config/1``)."""
    return {
        **cfg.mok_config().to_dict(),
        "workload": {
            **wl.to_dict(),
            "gpu": wl.topo.gpu_name,
            "num_experts": wl.model_shape.num_experts,
            "hidden": wl.model_shape.hidden,
            "intermediate": wl.model_shape.intermediate,
            "num_topk": wl.model_shape.num_topk,
            "mechanism": cfg.mechanism,
            "dtype": cfg.dtype,
            "simulated_pass": "forward",
            **_comm_rates_source(cfg),
        },
        "predicted_us": round(result.layer_us, 3),
        "breakdown": {
            **{k: round(v, 3) for k, v in result.breakdown.items()},
            "compute_idle_frac": round(result.compute_idle_frac, 4),
            "nvlink_payload_mb": round(result.payload_bytes["nvlink"] / 1e6, 3),
        },
    }


def _comm_rates_source(cfg: SimConfig) -> dict:
    """Where the tuned config's comm rates came from: the probe curves (``kernel_profile``
    null) or a kernel profile, with the knob that played each role and the profile's source."""
    if cfg.kernel_profile is None:
        return {"kernel_profile": None}
    prof = layer_kernel_profile(cfg.kernel_profile)
    return {
        "kernel_profile": cfg.kernel_profile,
        "kernel_profile_topology": prof.topology,
        "kernel_knobs": kernel_knobs(cfg),
    }


def fused_mok_config(row: dict) -> MoKConfig:
    """The kernel's configuration of a tuner row."""
    return MoKConfig(
        dispatch_mode=row["dispatch_mode"],
        combine_mode="push",
        num_comm_sms=row["num_comm_sms"],
        # NOTE: the fused layer is forward only; the backward keeps the forward's split.
        num_comm_sms_bwd=row["num_comm_sms"],
        minibatch_size=row["minibatch_size"],
        macrobatch_size=row["macrobatch_size"],
        row_tile=row["row_tile"],
    )


def fused_tune_document(
    wl: Workload, row: dict, prof: FusedProfile, profile_name: str, searched: int
) -> dict:
    """The JSON that ``mok.MoKConfig.from_json`` loads (``mok-config/1``) for a fused pick."""
    s = wl.model_shape
    return {
        **fused_mok_config(row).to_dict(),
        "workload": {
            **replace(wl, seed=bench_routing_seed(wl.tokens_per_rank)).to_dict(),
            "gpu": wl.topo.gpu_name,
            "num_experts": s.num_experts,
            "hidden": s.hidden,
            "intermediate": s.intermediate,
            "shared_intermediate": s.shared_intermediate,
            "num_topk": s.num_topk,
            "dtype": "bf16",
            "simulated_pass": "forward",
            "layer": "fused",
            "fused_profile": profile_name,
            "fused_profile_topology": prof.topology,
            "comm_profile": prof.comm_profile,
            "configs_searched": searched,
        },
        "predicted_us": round(row["layer_us"], 3),
        "breakdown": {k: round(row[k], 3) for k in ("device_us", "host_us", *TUNE_TERMS)},
    }


def write_json(doc: dict, path: str | Path) -> None:
    """Write a document of :func:`tune_document` / :func:`fused_tune_document` to ``path``."""
    Path(path).write_text(json.dumps(doc, indent=1) + "\n")
