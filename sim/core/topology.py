"""Topologies as validated data, and the flow-network resources they expose.

Every GPU owns five resources (capacities in bytes per microsecond, except the engine):

* ``engine``: its communication SMs, capacity 1.0 (fraction of their time); a flow of a mechanism
  with curve ``bw(n)`` uses ``1 / bw(num_comm_sms)`` of it per byte per microsecond;
* ``nvl_tx`` / ``nvl_rx``: its NVLink port, one resource per direction (wire bytes incl. protocol);
* ``nic_tx`` / ``nic_rx``: its scale-out NIC, one per direction (only used between NVLink domains).

An NVSwitch fabric is non-blocking between ports, so the GPU ports are where it bottlenecks; each
domain also gets one ``switch`` resource with the aggregate capacity so an oversubscribed fabric
can be modelled (``switch_oversubscription > 1``). A ``direct`` fabric (two GPUs joined by their
links, h200x2) uses the same per-direction port resources: GPU a's ``nvl_tx`` and GPU b's
``nvl_rx`` are then the same wires with the same capacity.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from sim.core.hardware import GpuProfile, load_gpu

__all__ = ["Topology", "get_topology", "list_topologies", "RES_PER_GPU"]

ENGINE, NVL_TX, NVL_RX, NIC_TX, NIC_RX = range(5)
RES_PER_GPU = 5
RESOURCE_NAMES = ("engine", "nvl_tx", "nvl_rx", "nic_tx", "nic_rx")


@dataclass(frozen=True)
class Topology:
    name: str
    gpu_name: str
    num_gpus: int
    gpus_per_domain: int  # GPUs in one NVLink domain
    fabric: str  # "direct" | "nvswitch"
    switch_hop_latency_us: float = 0.0  # extra one-way latency through the switch
    switch_oversubscription: float = 1.0  # aggregate switch capacity = ports / this
    nic_gbps_per_direction: float = 0.0  # scale-out NIC per GPU, one direction
    nic_wire_efficiency: float = 0.9  # usable fraction of the NIC line rate
    nic_latency_us: float = 0.0  # one-way GPU-initiated RDMA latency between domains
    nic_data_bytes_per_byte: float = 1.02  # RoCE/IB headers per payload byte
    nic_reverse_bytes_per_byte: float = 0.01  # acks / read requests per payload byte
    notes: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.fabric not in ("direct", "nvswitch"):
            raise ValueError(f"{self.name}: fabric must be 'direct' or 'nvswitch'")
        if self.num_gpus < 1 or self.gpus_per_domain < 1:
            raise ValueError(f"{self.name}: need >= 1 GPU and >= 1 GPU per domain")
        if self.num_gpus % self.gpus_per_domain:
            raise ValueError(
                f"{self.name}: {self.num_gpus} GPUs do not split into domains of "
                f"{self.gpus_per_domain}"
            )
        if self.fabric == "direct" and self.gpus_per_domain != 2:
            raise ValueError(f"{self.name}: a direct fabric joins exactly two GPUs per domain")
        if self.num_domains > 1 and self.nic_gbps_per_direction <= 0:
            raise ValueError(f"{self.name}: several NVLink domains need a scale-out NIC rate")
        if self.switch_oversubscription < 1.0:
            raise ValueError(f"{self.name}: switch_oversubscription must be >= 1")

    @property
    def gpu(self) -> GpuProfile:
        return load_gpu(self.gpu_name)

    @property
    def num_domains(self) -> int:
        return self.num_gpus // self.gpus_per_domain

    def domain(self, gpu: int) -> int:
        return gpu // self.gpus_per_domain

    @property
    def num_resources(self) -> int:
        return self.num_gpus * RES_PER_GPU + self.num_domains

    def res(self, gpu: int, kind: int) -> int:
        return gpu * RES_PER_GPU + kind

    def switch_res(self, domain: int) -> int:
        return self.num_gpus * RES_PER_GPU + domain

    def resource_name(self, r: int) -> str:
        if r >= self.num_gpus * RES_PER_GPU:
            return f"switch{r - self.num_gpus * RES_PER_GPU}"
        return f"gpu{r // RES_PER_GPU}.{RESOURCE_NAMES[r % RES_PER_GPU]}"

    def capacities(self, gpu: GpuProfile | None = None) -> list[float]:
        """Capacity of every resource (engine: 1.0; links: wire bytes per microsecond)."""
        gpu = gpu or self.gpu
        nvl = gpu.nvlink_wire_gbps * 1e3
        nic = self.nic_gbps_per_direction * self.nic_wire_efficiency * 1e3
        per = [1.0, nvl, nvl, nic, nic]
        caps = per * self.num_gpus
        # aggregate switch capacity, both directions: every port's tx and rx
        sw = 2 * nvl * self.gpus_per_domain / self.switch_oversubscription
        return caps + [sw] * self.num_domains

    def remote_latency_us(self, gpu: GpuProfile | None = None) -> float:
        gpu = gpu or self.gpu
        return gpu.remote_load_latency_us + self.switch_hop_latency_us

    def per_sm_latency_factor(self, gpu: GpuProfile | None = None) -> float:
        """Per-SM remote rate is bytes in flight / latency: scale it for a switch hop."""
        gpu = gpu or self.gpu
        return gpu.remote_load_latency_us / self.remote_latency_us(gpu)


_NVL72_NOTES = (
    "72 GPUs in one NVLink domain through 18 NVSwitch chips (9 trays), every GPU with one "
    "link to every chip: non-blocking, so the GPU ports bound the traffic",
    "switch hop adds 0.25 us one way (assumption: NVSwitch + cable)",
)


def _base_presets() -> dict[str, Topology]:
    return {
        t.name: t
        for t in (
            Topology(
                "h200x2",
                "h200",
                2,
                2,
                "direct",
                notes=("our measurement machine: two H200 SXM joined by NV18",),
            ),
            Topology(
                "hgx-h200",
                "h200",
                8,
                8,
                "nvswitch",
                switch_hop_latency_us=0.15,
                notes=(
                    "8 GPUs, each with 18 NVLink4 links spread over 4 NVSwitch chips: non-blocking",
                    "switch hop adds 0.15 us one way (assumption)",
                ),
            ),
            Topology(
                "hgx-h100",
                "h100",
                8,
                8,
                "nvswitch",
                switch_hop_latency_us=0.15,
                notes=("as hgx-h200 with H100 SXM GPUs",),
            ),
            Topology(
                "hgx-b200",
                "b200",
                8,
                8,
                "nvswitch",
                switch_hop_latency_us=0.15,
                notes=("8 B200 through NVLink5 switches (datasheet lead)",),
            ),
            Topology(
                "gb200-nvl72",
                "gb200",
                72,
                72,
                "nvswitch",
                switch_hop_latency_us=0.25,
                notes=_NVL72_NOTES,
            ),
            Topology(
                "gb300-nvl72",
                "gb300",
                72,
                72,
                "nvswitch",
                switch_hop_latency_us=0.25,
                notes=_NVL72_NOTES,
            ),
        )
    }


# scale-out NIC per GPU for multi-domain variants: (GB/s per direction, one-way latency us)
_NICS = {
    "hgx-h200": (50.0, 3.0),  # ConnectX-7 400 Gb/s
    "hgx-h100": (50.0, 3.0),
    "hgx-b200": (50.0, 3.0),
    "gb200-nvl72": (50.0, 3.0),  # ConnectX-7 400 Gb/s
    "gb300-nvl72": (100.0, 3.0),  # ConnectX-8 800 Gb/s
}

_MULTI = re.compile(r"^(?P<base>.+)x(?P<n>\d+)$")


def list_topologies() -> list[str]:
    return sorted(_base_presets()) + [f"{b}xN" for b in sorted(_NICS)]


def get_topology(name: str) -> Topology:
    """A preset by name; ``<preset>xN`` (e.g. ``gb300-nvl72x4``) is N domains joined by the
    scale-out NIC of every GPU."""
    presets = _base_presets()
    if name in presets:
        return presets[name]
    m = _MULTI.match(name)
    if m and m.group("base") in _NICS:
        base = presets[m.group("base")]
        n = int(m.group("n"))
        if n < 1:
            raise ValueError(f"{name}: need at least one domain")
        nic, lat = _NICS[base.name]
        return Topology(
            name,
            base.gpu_name,
            base.num_gpus * n,
            base.gpus_per_domain,
            base.fabric,
            switch_hop_latency_us=base.switch_hop_latency_us,
            nic_gbps_per_direction=nic,
            nic_latency_us=lat,
            notes=base.notes
            + (
                f"{n} NVLink domains; between them every GPU uses its own {nic * 8:g} Gb/s NIC "
                f"(90% usable, {lat} us one way, GPU-initiated RDMA; the NIC's DMA engine moves "
                "the bytes, so they cost no comm-SM time)",
                "the scale-out fabric (rail-optimised fat tree) is assumed non-blocking",
            ),
        )
    raise ValueError(f"unknown topology {name!r}; presets are {', '.join(list_topologies())}")
