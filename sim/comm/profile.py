"""The kernel profile of the comm-phase model: the fitted knobs of :mod:`sim.comm.model` as data
(``sim/profiles/mok-*.json``, format ``mok-kernel-profile/1``)."""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path

from sim.core.hardware import profile_path

__all__ = ["KernelProfile", "load_kernel_profile", "KERNEL_PROFILE_FORMAT"]

KERNEL_PROFILE_FORMAT = "mok-kernel-profile/1"


@dataclass(frozen=True)
class KernelProfile:
    """Kernel-specific knobs of the comm-phase model (units in the names)."""

    topology: str = "h200x2"
    # us per kernel call on the device, every kernel: launch as CUDA events see it, pipeline
    # fill and drain, the final system fence + done signal; fitted
    call_fixed_us: float = 5.0
    # us per cross-GPU wait that meets the peers' launches of the same call (x-ready / y-ready /
    # slots / route-ready: PhaseSpec.rendezvous) on top of the probed one-way flag latency: the
    # two ranks' launches are not aligned, so the first to arrive waits for the other; fitted
    handshake_us: float = 0.0
    # per Python entry point of the benchmark (sim.comm.catalog.ENTRY_POINTS): us of host time per
    # call (argument checks, Params packing, custom-op dispatch, launch, event records); calls
    # are issued back to back, so a run measures max(device time, host time of its calls) (see
    # sim.comm.model.host_bound); fitted on the fit rows whose p20-p80 band shows host jitter (an
    # entry point without such rows keeps "default"; no such row at all: {"default": 0}, no
    # floor modelled, sim.comm.fit._fit_host)
    host_floor_us: dict[str, float] = field(default_factory=dict)
    # us per item of the one-thread bulk-copy ring (csrc/tma.cuh tma_copy_rows): wait for the
    # oldest stage, issue its store, wait until the store two items back has read its stage.
    # Every row item of a block's range pays it (padding items: tma_pad_us); fitted
    tma_item_us: float = 0.0
    # us per further bulk store of one ring item (fan-out: a loaded row stored n times); fitted
    tma_store_us: float = 0.0
    # us per padding item of a ring that walks the padded receive buffer (pull dispatch): no
    # load and no store, but the wait / commit / store-lag bookkeeping of an item. Padding runs
    # (the tail of every expert region) stall the ring's byte flow, so they add to the phase
    # instead of overlapping it (sim.comm.rows.ring_split); fitted
    tma_pad_us: float = 0.0
    # us for one stage of dedup_sum's row ring (engine "tma", csrc/combine.cuh tma_sum_rows) to
    # turn over: the producer thread's wait for the free stage, the peer rows' bulk loads into
    # it, and its consumer warp's pass over the row (local terms from L2, adds, vector stores).
    # A block keeps sum_ring_stages() rows in flight, so it retires that many rows per turnover
    # (sim.comm.rows.sum_ring_turns); fitted
    sum_ring_turn_us: float = 0.0
    # per 16-byte warp routine ("copy" / "fan" / "sum" / "seg", csrc/rows.cuh, combine.cuh):
    # dependent index-load rounds per row before its data rounds, in units of one data round
    # (sim.comm.rows.warp_row_scale); fitted
    warp_lookup_rounds: dict[str, float] = field(default_factory=dict)
    # us of the schedule kernel beyond call_fixed_us and handshake_us: its four grid barriers
    # and the walk of one 64-token chunk per warp (csrc/schedule.cuh); fitted
    schedule_fixed_us: float = 0.0
    # us per dependent load of the schedule kernel's one-thread scans (one per 64-token chunk,
    # one per expert: sim.comm.model.schedule_serial_loads), an L2 round trip; fitted
    schedule_load_us: float = 0.0
    # per engine ("vector" / "tma"), SMs: per-SM rate x 1 / (1 + n / this), the loaded latency
    # growing with the issuing SMs; fitted (on fit rows at more than one SM count)
    sm_congestion_sms: dict[str, float] = field(default_factory=dict)
    # per kernel knob: its per-SM rate / the probe's at 16 KiB rows (dimensionless); fitted
    inflight_factor: dict[str, float] = field(default_factory=dict)
    fit_subset: str = ""  # which rows the fitted values came from
    source: str = ""
    assumptions: tuple[str, ...] = ()
    fit: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        for k in (
            "call_fixed_us",
            "handshake_us",
            "tma_item_us",
            "tma_store_us",
            "tma_pad_us",
            "sum_ring_turn_us",
            "schedule_fixed_us",
            "schedule_load_us",
        ):
            if not getattr(self, k) >= 0:
                raise ValueError(f"{k} must be >= 0 (found {getattr(self, k)})")
        if any(not v >= 0 for v in self.host_floor_us.values()):
            raise ValueError(f"host_floor_us must be >= 0 (found {self.host_floor_us})")
        if any(not v >= 0 for v in self.warp_lookup_rounds.values()):
            raise ValueError(f"warp_lookup_rounds must be >= 0 (found {self.warp_lookup_rounds})")
        if any(not v > 0 for v in self.sm_congestion_sms.values()):
            raise ValueError(f"sm_congestion_sms must be > 0 (found {self.sm_congestion_sms})")
        bad = {k: v for k, v in self.inflight_factor.items() if not v > 0}
        if bad:
            raise ValueError(f"inflight_factor values must be > 0 (found {bad})")

    def host_us(self, entry: str) -> float:
        """Host time per call of Python entry point ``entry`` (sim.comm.catalog.ENTRY_POINTS)."""
        return self.host_floor_us.get(entry, self.host_floor_us.get("default", 0.0))

    def factor(self, kernel: str) -> float:
        try:
            return self.inflight_factor[kernel]
        except KeyError:
            raise ValueError(
                f"kernel profile has no in-flight factor for {kernel!r}; refit with "
                "`mok-sim validate --refit` (known: "
                + ", ".join(sorted(self.inflight_factor))
                + ")"
            ) from None

    def replace(self, **kw) -> KernelProfile:
        # NOTE: fields are shared with self, not copied: profiles are never changed in place.
        return dataclasses.replace(self, **kw)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["assumptions"] = list(self.assumptions)
        d["sm_congestion_sms"] = {
            k: (None if math.isinf(v) else v) for k, v in d["sm_congestion_sms"].items()
        }
        return {"format": KERNEL_PROFILE_FORMAT, **d}

    @classmethod
    def from_dict(cls, d: dict) -> KernelProfile:
        d = dict(d)
        fmt = d.pop("format", KERNEL_PROFILE_FORMAT)
        if fmt != KERNEL_PROFILE_FORMAT:
            raise ValueError(f"unsupported kernel profile format {fmt!r}")
        d["sm_congestion_sms"] = {
            k: (math.inf if v is None else float(v))
            for k, v in d.get("sm_congestion_sms", {}).items()
        }
        d["inflight_factor"] = {k: float(v) for k, v in d.get("inflight_factor", {}).items()}
        d["assumptions"] = tuple(d.get("assumptions", ()))
        # profiles of format 1 before the fixed-cost knobs: a launch and a constant schedule
        if "launch_us" in d:
            d.setdefault("call_fixed_us", float(d.pop("launch_us")))
        d.pop("schedule_us", None)
        # a per-token schedule cost (fitted 0 while the schedule rows were host-bound): replaced
        # by the scans' loads (schedule_load_us)
        d.pop("schedule_us_per_token", None)
        d.pop("tma_row_issue_us", None)  # replaced by tma_item_us (per ring item, not per byte)
        floor = d.get("host_floor_us", {})
        if not isinstance(floor, dict):  # one floor for every entry point (older profiles)
            floor = {"default": floor}
        d["host_floor_us"] = {k: float(v) for k, v in floor.items()}
        d["warp_lookup_rounds"] = {k: float(v) for k, v in d.get("warp_lookup_rounds", {}).items()}
        return cls(**d)

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=1) + "\n")


DEFAULT_KERNEL_PROFILE = "mok-comm-h200x2"


def load_kernel_profile(name_or_path: str | Path = DEFAULT_KERNEL_PROFILE) -> KernelProfile:
    return KernelProfile.from_dict(json.loads(profile_path(name_or_path).read_text()))
