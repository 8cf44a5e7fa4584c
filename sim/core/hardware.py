"""GPU profiles: validated hardware data with units in the field names.

A profile is plain JSON under ``sim/profiles/<name>.json`` (format ``mok-gpu-profile/1``). The H200
profile is produced by :mod:`sim.app.calibrate` from our probe measurements; the others are
datasheet leads scaled from it, and every such step is listed in the profile's ``assumptions``.

Communication bandwidth is modelled per *mechanism* (``push_st``: 16-byte stores to a peer,
``pull_ld``: 16-byte loads from a peer, ``push_tma`` / ``pull_tma``: TMA bulk copies, ``local_*``:
copies inside one GPU) as a function of the number of communication SMs::

    bw(n) = min(per_sm_gbps * n, ceiling(n))
    ceiling(n) = ceiling_knee_gbps + (ceiling_max_gbps - ceiling_knee_gbps)
                 * clip(log(n / sm_knee) / log(sm_max / sm_knee), 0, 1)

i.e. a per-SM rate (bytes in flight / latency) that saturates at a ceiling drifting slowly with the
SM count. The curve is the *engine* limit of the issuing GPU in payload GB/s; the NVLink wire
limit (with per-direction protocol overhead) is applied separately by the flow network.

The grouped-GEMM parameters of the layer model are a section of the profile as well
(``gemm_waves``, :class:`sim.core.gemm_waves.GemmWaves`): fitted for the H200 and the H100 by
:mod:`sim.app.gemm_fit`, the H200's carried over to the other derived profiles.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field, replace
from importlib import resources
from pathlib import Path

import numpy as np

__all__ = [
    "CommCurve",
    "Protocol",
    "Signalling",
    "Incast",
    "GemmWaves",
    "GpuProfile",
    "MECHANISMS",
    "load_gpu",
    "list_gpus",
    "PROFILE_FORMAT",
    "profiles_dir",
]

PROFILE_FORMAT = "mok-gpu-profile/1"
MECHANISMS = ("push_st", "pull_ld", "local_st", "push_tma", "pull_tma", "local_tma")


@dataclass(frozen=True)
class CommCurve:
    """Payload bandwidth (GB/s, one direction) of one mechanism versus communication SMs."""

    per_sm_gbps: float
    sm_knee: float
    ceiling_knee_gbps: float
    sm_max: float
    ceiling_max_gbps: float

    def __post_init__(self) -> None:
        if self.per_sm_gbps <= 0 or self.ceiling_knee_gbps <= 0 or self.ceiling_max_gbps <= 0:
            raise ValueError(f"CommCurve rates must be positive (found {self})")
        if not 0 < self.sm_knee <= self.sm_max:
            raise ValueError(f"CommCurve needs 0 < sm_knee <= sm_max (found {self})")

    def ceiling_gbps(self, num_sms: float) -> float:
        if num_sms <= self.sm_knee or self.sm_max <= self.sm_knee:
            return self.ceiling_knee_gbps
        x = math.log(num_sms / self.sm_knee) / math.log(self.sm_max / self.sm_knee)
        x = min(1.0, x)
        return self.ceiling_knee_gbps + (self.ceiling_max_gbps - self.ceiling_knee_gbps) * x

    def gbps(self, num_sms: float) -> float:
        """Payload GB/s that ``num_sms`` SMs move with this mechanism (one direction)."""
        if num_sms <= 0:
            return 0.0
        return min(self.per_sm_gbps * num_sms, self.ceiling_gbps(num_sms))

    def scaled(self, per_sm: float = 1.0, ceiling: float = 1.0) -> CommCurve:
        return CommCurve(
            self.per_sm_gbps * per_sm,
            self.sm_knee,
            self.ceiling_knee_gbps * ceiling,
            self.sm_max,
            self.ceiling_max_gbps * ceiling,
        )


@dataclass(frozen=True)
class Protocol:
    """NVLink bytes per payload byte, on the data direction and on the reverse direction.

    Push: the data direction carries the stores and their headers, the reverse direction the
    write acknowledgements. Pull: the data direction carries the read responses, the reverse
    direction the read requests.
    """

    data_bytes_per_byte: float
    reverse_bytes_per_byte: float

    def __post_init__(self) -> None:
        if self.data_bytes_per_byte < 1.0 or self.reverse_bytes_per_byte < 0.0:
            raise ValueError(
                f"protocol overhead must be >= 1 payload byte on the data direction and >= 0 on "
                f"the reverse (found {self})"
            )


@dataclass(frozen=True)
class Signalling:
    """Push completion signalling (docs/sim-validation.md, "Push signalling").

    A push sender ends a round with a system-scope release fence and one flag per destination;
    the destination polls one flag per sender and waits for the last. Three terms:

    * fence: ``fence_us + outstanding / drain``, ``outstanding = min(remote bytes of the round,
      fence_inflight_bytes_per_sm x comm SMs)`` (the stores not yet acknowledged when the fence
      issues), ``drain`` the sender's NVLink payload rate (wire rate / push protocol bytes);
    * polling: ``ceil(N / flag_poll_lanes) x local_load_latency_us`` for N flags (one load per
      lane per sweep; 0 lanes: no sweep term);
    * per-sender completion jitter: an exponential delay of mean ``completion_jitter_us`` per
      (sender, round), drawn from a seeded generator, so that the wait for the last of N
      senders grows as the N-th harmonic number H_N times the mean.

    The defaults are the values assumed before the one-H200 signalling probe; the GPU profiles
    carry the calibrated ones (``h200.json``, the calibration's output: polling lanes and the
    jitter mean measured, 0.086 us one way on one GPU; the fence window assumed).
    ``Signalling.off()`` switches the three terms off (the constant fence of before).
    """

    fence_inflight_bytes_per_sm: float = 16384.0  # 1024 threads x 16 B stores per SM
    flag_poll_lanes: int = 32  # flags one warp polls per sweep (one per lane)
    completion_jitter_us: float = 0.1  # mean of the exponential per-sender term (assumed)

    def __post_init__(self) -> None:
        if self.fence_inflight_bytes_per_sm < 0 or self.completion_jitter_us < 0:
            raise ValueError(f"Signalling terms must be >= 0 (found {self})")
        if self.flag_poll_lanes < 0:
            raise ValueError(f"flag_poll_lanes must be >= 0 (found {self})")

    @classmethod
    def off(cls) -> Signalling:
        return cls(0.0, 0, 0.0)

    def fence_us(self, fixed_us: float, remote_bytes: float, num_sms: int, drain: float) -> float:
        """Release-fence time after a round of ``remote_bytes`` remote stores issued by
        ``num_sms`` comm SMs; ``drain`` in payload bytes per us."""
        out = min(float(remote_bytes), self.fence_inflight_bytes_per_sm * num_sms)
        return fixed_us + (out / drain if out > 0 and drain > 0 else 0.0)

    def poll_us(self, num_flags: int, load_us: float) -> float:
        """Sweep time of a receiver that polls ``num_flags`` flags, ``load_us`` per load."""
        if self.flag_poll_lanes <= 0 or num_flags <= 0:
            return 0.0
        return -(-num_flags // self.flag_poll_lanes) * load_us


@dataclass(frozen=True)
class Incast:
    """Many writers into one NVSwitch port (docs/sim-validation.md, "Incast").

    N concurrent push writers into one destination port reach ``efficiency(N)`` of its wire
    rate: ``e_min + (1 - e_min) x n_half / (n_half + N - 1)``: 1 at one writer, half-way to
    ``e_min`` at ``1 + n_half`` writers, ``e_min`` for many. Receiver-paced reads (pull) count
    as one writer. Applied on NVSwitch fabrics only (a direct link has one writer per port).
    """

    efficiency_min: float = 0.8
    writers_half: float = 8.0

    def __post_init__(self) -> None:
        if not 0 < self.efficiency_min <= 1 or self.writers_half <= 0:
            raise ValueError(f"Incast needs 0 < efficiency_min <= 1, writers_half > 0 ({self})")

    @classmethod
    def off(cls) -> Incast:
        return cls(1.0, 1.0)

    def efficiency(self, writers):
        """Port efficiency with ``writers`` (scalar or array, >= 1) concurrent writers."""
        n = np.maximum(np.asarray(writers, dtype=np.float64), 1.0)
        e = self.efficiency_min
        out = e + (1.0 - e) * self.writers_half / (self.writers_half + n - 1.0)
        return float(out) if out.ndim == 0 else out


@dataclass(frozen=True)
class GemmWaves:
    """Grouped-GEMM parameters of a GPU profile (its ``gemm_waves`` section): the tile queue of
    :mod:`sim.core.gemm_waves`, whose docstring gives the model each term belongs to."""

    tile_efficiency: float  # per-SM rate with few SMs busy / (tensor_tflops / num_sms)
    sustained_efficiency: float  # the chip-wide ceiling of all SMs together / tensor_tflops
    tile_fixed_us: float  # per tile: prologue + epilogue not hidden by the main loop
    fill_us: float  # per GEMM on the device, as back-to-back standalone launches see it
    host_us: float  # host time of one standalone call: the floor of back-to-back calls
    weight_gbps: float  # weight-streaming rate from HBM
    launch_us: float  # part of fill_us that a standalone launch pays (the megakernel not)
    reference_hbm_gbps: float  # hbm_gbps of the fitted GPU: weight_gbps scales with it
    source: str = ""
    # chip-wide ceiling (TB/s) on the tiles' operand loads, approached smoothly (the 2-norm in
    # sim.core.gemm_waves.gemm_spec); None: none (the standalone kernel's fit has no such term;
    # a fused profile sets it: sim.fused.profile.FusedProfile.gemm_waves)
    operand_tbps: float | None = None

    def __post_init__(self) -> None:
        if not (self.tile_efficiency > 0 and self.sustained_efficiency > 0):
            raise ValueError(f"GemmWaves efficiencies must be positive ({self})")
        if self.weight_gbps <= 0 or self.reference_hbm_gbps <= 0:
            raise ValueError(f"GemmWaves bandwidths must be positive ({self})")
        for f in ("tile_fixed_us", "fill_us", "host_us", "launch_us"):
            if getattr(self, f) < 0:
                raise ValueError(f"GemmWaves.{f} must be >= 0 ({self})")
        if self.operand_tbps is not None and not self.operand_tbps > 0:
            raise ValueError(f"GemmWaves.operand_tbps must be positive or None ({self})")

    @property
    def layer_fill_us(self) -> float:
        """Per-GEMM fill/drain inside the megakernel: ``fill_us`` less the launch."""
        return max(0.0, self.fill_us - self.launch_us)

    def replace(self, **kw) -> GemmWaves:
        return replace(self, **kw)

    def to_dict(self) -> dict:
        d = asdict(self)
        if d["operand_tbps"] is None:  # profiles written before the term keep their form
            del d["operand_tbps"]
        return d


@dataclass(frozen=True)
class GpuProfile:
    name: str
    num_sms: int
    l2_mb: float
    hbm_gbps: float  # datasheet HBM bandwidth
    hbm_copy_gbps: float  # achieved device-to-device copy rate (bytes copied / s, not r+w)
    tensor_tflops: dict[str, float]  # achieved dense rate of a large GEMM, per dtype
    gemm_efficiency: float  # grouped-GEMM tile rate as a fraction of tensor_tflops
    gemm_n_tile: int  # N of a 128 x N output tile computed by one SM
    flag_latency_remote_us: float  # one-way st.release.sys / ld.acquire.sys over NVLink
    flag_latency_local_us: float  # same between two blocks on one GPU
    remote_load_latency_us: float  # dependent load from peer memory
    local_load_latency_us: float
    nvlink_gbps_per_direction: float  # datasheet, whole GPU (all links), one direction
    nvlink_wire_efficiency: float  # usable fraction of the datasheet wire rate (fitted)
    protocol: dict[str, Protocol]  # "push" / "pull"
    comm_curves: dict[str, CommCurve]  # by mechanism, see MECHANISMS
    fence_us: float  # membar.sys before a remote completion flag (fixed part)
    signalling: Signalling = Signalling()  # push fence drain, flag polling, completion jitter
    incast: Incast = Incast()  # many writers into one NVSwitch port
    gemm_waves: GemmWaves | None = None  # grouped-GEMM tile queue (sim.core.gemm_waves)
    source: str = ""
    assumptions: tuple[str, ...] = ()
    fit: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.num_sms <= 0:
            raise ValueError(f"{self.name}: num_sms must be positive (found {self.num_sms})")
        if "bf16" not in self.tensor_tflops:
            raise ValueError(f"{self.name}: tensor_tflops needs a 'bf16' entry")
        if not 0 < self.gemm_efficiency <= 1:
            raise ValueError(f"{self.name}: gemm_efficiency must be in (0, 1]")
        if not 0 < self.nvlink_wire_efficiency <= 1:
            raise ValueError(f"{self.name}: nvlink_wire_efficiency must be in (0, 1]")
        missing = [m for m in MECHANISMS if m not in self.comm_curves]
        if missing:
            raise ValueError(f"{self.name}: comm_curves lacks {', '.join(missing)}")
        for p in ("push", "pull"):
            if p not in self.protocol:
                raise ValueError(f"{self.name}: protocol lacks {p!r}")
        for f in (
            "flag_latency_remote_us",
            "flag_latency_local_us",
            "remote_load_latency_us",
            "local_load_latency_us",
            "fence_us",
        ):
            if getattr(self, f) < 0:
                raise ValueError(f"{self.name}: {f} must be >= 0")

    @property
    def nvlink_wire_gbps(self) -> float:
        """Usable wire bytes per second per direction of the GPU's NVLink port."""
        return self.nvlink_gbps_per_direction * self.nvlink_wire_efficiency

    def tflops(self, dtype: str) -> float:
        try:
            return self.tensor_tflops[dtype]
        except KeyError:
            raise ValueError(
                f"{self.name} has no tensor rate for {dtype!r}; known: {sorted(self.tensor_tflops)}"
            ) from None

    def curve(self, mechanism: str) -> CommCurve:
        try:
            return self.comm_curves[mechanism]
        except KeyError:
            raise ValueError(
                f"unknown comm mechanism {mechanism!r}; known: {', '.join(MECHANISMS)}"
            ) from None

    def waves(self) -> GemmWaves:
        """The ``gemm_waves`` section; a clear error for a profile without one."""
        if self.gemm_waves is None:
            raise ValueError(
                f"GPU profile {self.name!r} has no gemm_waves section (the grouped-GEMM "
                "parameters of sim.core.gemm_waves; python -m sim.app.calibrate writes them for "
                "the presets from sim.app.gemm_fit)"
            )
        return self.gemm_waves

    def to_dict(self) -> dict:
        d = asdict(self)
        d["assumptions"] = list(self.assumptions)
        if d["gemm_waves"] is None:  # profiles fitted without GEMM points keep their old form
            del d["gemm_waves"]
        else:
            d["gemm_waves"] = self.gemm_waves.to_dict()
        return {"format": PROFILE_FORMAT, **d}

    @classmethod
    def from_dict(cls, d: dict) -> GpuProfile:
        d = dict(d)
        fmt = d.pop("format", PROFILE_FORMAT)
        if fmt != PROFILE_FORMAT:
            raise ValueError(f"unsupported GPU profile format {fmt!r} (expected {PROFILE_FORMAT})")
        d["protocol"] = {k: Protocol(**v) for k, v in d["protocol"].items()}
        d["comm_curves"] = {k: CommCurve(**v) for k, v in d["comm_curves"].items()}
        d["tensor_tflops"] = {k: float(v) for k, v in d["tensor_tflops"].items()}
        if "signalling" in d:
            d["signalling"] = Signalling(**d["signalling"])
        if "incast" in d:
            d["incast"] = Incast(**d["incast"])
        if d.get("gemm_waves") is not None:
            d["gemm_waves"] = GemmWaves(**d["gemm_waves"])
        d["assumptions"] = tuple(d.get("assumptions", ()))
        return cls(**d)

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=1) + "\n")


# the format of a fused-layer profile (sim.fused.profile), whose GEMM terms the layer model can
# run at (sim.core.gemm_waves.load_kernel_waves)
FUSED_PROFILE_FORMAT = "mok-fused-profile/1"


def profiles_dir() -> Path:
    """``sim/profiles``: the fitted profiles (GPU, comm-kernel, fused-layer JSON) that the loaders
    find by name (package data of ``sim``)."""
    return Path(str(resources.files("sim") / "profiles"))


def profile_path(name_or_path: str | Path) -> Path:
    """A profile's JSON: ``sim/profiles/<name>.json`` for a name (no file extension), else the
    path as given."""
    p = Path(str(name_or_path))
    return profiles_dir() / f"{name_or_path}.json" if not p.suffix else p


def list_gpus() -> list[str]:
    return sorted(
        p.stem
        for p in profiles_dir().glob("*.json")
        if json.loads(p.read_text()).get("format") == PROFILE_FORMAT
    )


_CACHE: dict[str, GpuProfile] = {}


def load_gpu(name_or_path: str | Path) -> GpuProfile:
    """Load a GPU profile by preset name (``h200``, ``h100``, ``b200``, ``gb200``, ``gb300``) or
    from a JSON path."""
    key = str(name_or_path)
    if key in _CACHE:
        return _CACHE[key]
    p = profile_path(key)
    if not Path(key).suffix and not p.exists():
        raise ValueError(f"unknown GPU profile {key!r}; presets are {', '.join(list_gpus())}")
    prof = GpuProfile.from_dict(json.loads(p.read_text()))
    _CACHE[key] = prof
    return prof
