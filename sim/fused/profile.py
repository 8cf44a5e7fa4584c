"""The fused-layer profile: the fitted knobs of the fused model (:mod:`sim.fused.model`) as data
(``sim/profiles/mok-fused-*.json``, format ``mok-fused-profile/1``)."""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path

from sim.core.gemm_waves import kernel_waves
from sim.core.hardware import FUSED_PROFILE_FORMAT, GemmWaves, GpuProfile, profile_path

__all__ = ["FusedProfile", "FUSED_PROFILE_FORMAT", "DEFAULT_FUSED_PROFILE", "load_fused_profile"]

DEFAULT_FUSED_PROFILE = "mok-fused-h200x2"


@dataclass(frozen=True)
class FusedProfile:
    """Fused-kernel knobs (units in the names); the comm side and the fixed per-call costs come
    from the comm-kernel profile ``comm_profile`` (:mod:`sim.comm.profile`)."""

    topology: str = "h200x2"
    # comm-kernel profile (name under sim/profiles or a path): copy-loop rates, schedule kernel,
    # launch (call_fixed_us) and host floors
    comm_profile: str = "mok-comm-h200x2"
    # one worker's k-loop rate (128 x 256 x 64 wgmma per k-block, wait_group 0 between
    # k-blocks) / its share of the measured dense bf16 rate (tensor_tflops / num_sms); fitted
    gemm_efficiency: float = 0.75
    # us per tile outside the k-loop: SwiGLU / staging epilogue and row stores (the down tiles'
    # pushes to the home rank), pipeline restart, counter release; fitted
    tile_fixed_us: float = 0.0
    # chip-wide ceiling (TB/s) on the workers' operand loads (TMA A + B boxes, 48 KiB per
    # k-block, through L2), approached smoothly (kblock_us); fitted (inf: none)
    operand_tbps: float = math.inf
    # fused comm blocks' per-SM rate on local rows / the probe's (local_st): the GEMMs load
    # the memory system the copies go through; fitted
    comm_rate_factor: float = 1.0
    # their rate on remote rows (probe: pull_ld) relative to local rows: a remote load also
    # waits on the peer's memory, which the peer's GEMMs load too; fitted
    remote_rate_factor: float = 1.0
    # a 64-row sub-tile (row_tile 64: a block split at an expert boundary, or its lower half
    # alone at the end) streams the same 48 KiB per k-block as a full tile for half its MMA work
    # (64 x 256 outputs): its k-block is the 2-norm of the worker's own k-block time x this
    # factor and the unchanged operand share (kblock_us), i.e. 0.5x (own rate binds) to 1x
    # (operand ceiling binds) a full tile's. 1.0, measured, not fitted: per-tile traces on 2x
    # H200 (docs/perf-notes.md, 64-row sub-tiles) show a sub-tile's k-loop as long as a full
    # tile's, so the k-loop is bound by the delivery of its operand stages, not by the MMAs
    half_kblock_factor: float = 1.0
    # its part outside the k-loop / tile_fixed_us. The epilogue's SwiGLU staging and row stores
    # scale with its 64 rows (0.5x); its barriers, destination loads, fence and the pipeline
    # hand-over do not, and the block's counter release follows its last sub-tile only. The
    # per-tile trace of DeepSeek-V3 (docs/perf-notes.md, v2: 7.7 us of epilogue per tile, the
    # fitted tile_fixed_us is 7.95) has stores and staging at 100 of its 120 worker-ms (84 %):
    # 0.5 x 0.84 + 0.16 = 0.58, rounded up to 0.6; not fitted
    half_fixed_factor: float = 0.6
    fit_subset: str = ""  # which rows the fitted values came from
    source: str = ""
    assumptions: tuple[str, ...] = ()
    fit: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        for k in ("gemm_efficiency", "operand_tbps", "comm_rate_factor", "remote_rate_factor"):
            if not getattr(self, k) > 0:
                raise ValueError(f"{k} must be > 0 (found {getattr(self, k)})")
        if not self.tile_fixed_us >= 0:
            raise ValueError(f"tile_fixed_us must be >= 0 (found {self.tile_fixed_us})")
        if not 0 < self.half_kblock_factor <= 1:
            raise ValueError(
                f"half_kblock_factor must be in (0, 1]: a 64-row sub-tile's share of a full "
                f"tile's MMA work per k-block (found {self.half_kblock_factor})"
            )
        if not 0 <= self.half_fixed_factor <= 1:
            raise ValueError(
                f"half_fixed_factor must be in [0, 1]: a 64-row sub-tile's share of "
                f"tile_fixed_us (found {self.half_fixed_factor})"
            )

    def gemm_waves(self, gpu: GpuProfile) -> GemmWaves:
        """The layer model's GEMM parameters at this kernel's rates
        (:func:`sim.core.gemm_waves.kernel_waves`)."""
        return kernel_waves(gpu, self.gemm_efficiency, self.tile_fixed_us, self.operand_tbps)

    def replace(self, **kw) -> FusedProfile:
        # NOTE: fields are shared with self, not copied: profiles are never changed in place.
        return dataclasses.replace(self, **kw)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["assumptions"] = list(self.assumptions)
        d["operand_tbps"] = None if math.isinf(self.operand_tbps) else self.operand_tbps
        return {"format": FUSED_PROFILE_FORMAT, **d}

    @classmethod
    def from_dict(cls, d: dict) -> FusedProfile:
        d = dict(d)
        fmt = d.pop("format", FUSED_PROFILE_FORMAT)
        if fmt != FUSED_PROFILE_FORMAT:
            raise ValueError(
                f"unsupported fused profile format {fmt!r} (want {FUSED_PROFILE_FORMAT})"
            )
        if d.get("operand_tbps") is None:
            d["operand_tbps"] = math.inf
        d["assumptions"] = tuple(d.get("assumptions", ()))
        return cls(**d)

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=1) + "\n")


def load_fused_profile(name_or_path: str | Path = DEFAULT_FUSED_PROFILE) -> FusedProfile:
    """A fused profile by name (``sim/profiles/<name>.json``) or path."""
    try:
        return FusedProfile.from_dict(json.loads(profile_path(name_or_path).read_text()))
    except OSError as e:
        raise ValueError(
            f"fused profile {str(name_or_path)!r} not found ({e.strerror}); give a name under "
            f"sim/profiles (e.g. {DEFAULT_FUSED_PROFILE}) or a path to a "
            f"{FUSED_PROFILE_FORMAT} JSON"
        ) from None
