"""Transfers as flows of the flow network: the one builder behind the layer model and the
standalone comm-kernel model.

A transfer is issued by one rank's comm SMs with one mechanism (``push``: stores to the peers,
``pull``: loads from them) and moves payload bytes to or from every peer plus bytes copied
inside the issuer. It becomes a latency followed by one flow (``flow_granularity="round"``) or
one flow per peer (``"peer"``) whose coefficients charge, per payload byte:

* the issuer's comm engine: ``1 / rate`` of the mechanism (:class:`Rates`, bytes per us), local
  bytes at the local copy rate;
* the per-direction NVLink ports of both ends: protocol bytes on the data direction, acks or
  read requests on the reverse one (``GpuProfile.protocol``); across NVLink domains the NICs
  instead (the topology's NIC overheads);
* the NVSwitch of the issuer's domain (data and reverse bytes).

The rates are the builder's ``rates``, or per phase name in ``roles`` the rates in ``_roles``
(the layer model's opt-in kernel profile gives dispatch and combine their own); a subclass sets
them before it adds transfers, and :meth:`TransferBuilder.retime_engine` re-sets the
comm-engine coefficients of the flows already built after the rates changed.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

import numpy as np

from sim.core.engine import Graph
from sim.core.topology import ENGINE, NIC_RX, NIC_TX, NVL_RX, NVL_TX, RES_PER_GPU, Topology

__all__ = ["Rates", "TransferBuilder"]


@dataclass
class Rates:
    push: float  # comm-engine payload bytes/us of remote stores
    pull: float  # of remote loads
    local: float  # of local copies


class TransferBuilder:
    """A task graph (:class:`sim.core.engine.Graph`) and the transfers of ``num_ranks`` ranks
    (the first GPUs of ``topo``) on it; :meth:`transfer` adds one."""

    # phase names that may run at their own rates (``_roles``), in a fixed order
    roles: tuple[str, ...] = ()
    # per-role comm rates; a phase not listed runs at ``self.rates``
    _roles: Mapping[str, Rates] = MappingProxyType({})

    def __init__(
        self, topo: Topology, num_ranks: int, push_latency_fraction: float, flow_granularity: str
    ) -> None:
        self.topo = topo
        self.gpu = gpu = topo.gpu
        self.num_ranks = num_ranks
        # store -> remote visibility as a fraction of a dependent remote load
        self.push_latency_fraction = push_latency_fraction
        self.flow_granularity = flow_granularity  # "round": one flow, "peer": one per peer
        self.flag_remote = gpu.flag_latency_remote_us + topo.switch_hop_latency_us
        self.fence = gpu.fence_us
        self.g = Graph()
        self.payload_bytes = {"nvlink": 0.0, "nic": 0.0, "local": 0.0}
        self.rates = Rates(1.0, 1.0, 1.0)
        # flow, kind, nv/B, local/B, role (index into roles, -1: self.rates)
        self._eng: list[tuple[int, int, float, float, int]] = []
        self._proto = {
            k: (gpu.protocol[k].data_bytes_per_byte, gpu.protocol[k].reverse_bytes_per_byte)
            for k in ("push", "pull")
        }
        dom = np.arange(num_ranks) // topo.gpus_per_domain
        self._same_domain = dom[:, None] == dom[None, :]
        self._routes: dict[tuple[int, bool], np.ndarray] = {}
        self._remote_lat = topo.remote_latency_us(gpu)

    def _static_route(self, issuer: int, into: bool) -> np.ndarray:
        """Resource ids of a transfer between ``issuer`` and all ranks, in the order that
        :meth:`_coefs` fills coefficients: engine, then for NVLink and for the NIC:
        peer data port [R], issuer data port, issuer reverse port, peer reverse port [R];
        then the switch of the issuer's domain."""
        key = (issuer, into)
        if key not in self._routes:
            topo = self.topo
            pr = np.arange(self.num_ranks, dtype=np.int64) * RES_PER_GPU
            me = issuer * RES_PER_GPU
            parts = [np.array([me + ENGINE])]
            for tx, rx in ((NVL_TX, NVL_RX), (NIC_TX, NIC_RX)):
                if into:  # data peer -> issuer, requests / acks issuer -> peer
                    parts += [pr + tx, np.array([me + rx, me + tx]), pr + rx]
                else:
                    parts += [pr + rx, np.array([me + tx, me + rx]), pr + tx]
            parts.append(np.array([topo.switch_res(topo.domain(issuer))]))
            self._routes[key] = np.concatenate(parts).astype(np.int64)
        return self._routes[key]

    def _coefs(
        self, kind: str, nv: np.ndarray, nic: np.ndarray, local: float, rates: Rates
    ) -> np.ndarray:
        """Coefficients (totals, not per byte) matching :meth:`_static_route`."""
        b_nv, b_nic = float(nv.sum()), float(nic.sum())
        a, r = self._proto[kind]
        na, nr = self.topo.nic_data_bytes_per_byte, self.topo.nic_reverse_bytes_per_byte
        sw = (a + r) * b_nv if self.topo.fabric == "nvswitch" else 0.0
        return np.concatenate(
            (
                [b_nv / (rates.push if kind == "push" else rates.pull) + local / rates.local],
                a * nv,
                [a * b_nv, r * b_nv],
                r * nv,
                na * nic,
                [na * b_nic, nr * b_nic],
                nr * nic,
                [sw],
            )
        )

    def transfer(self, issuer, kind, into, peer_bytes, local_bytes, deps, rank, phase, rnd):
        """Add a transfer issued by ``issuer``'s comm SMs with mechanism ``kind`` ("push" /
        "pull"): ``peer_bytes`` [R] payload to (``into=False``) or from (``into=True``) each
        peer, plus ``local_bytes`` copied inside the issuer."""
        b = np.array(peer_bytes, dtype=np.float64)
        local = float(local_bytes) + float(b[issuer])
        b[issuer] = 0.0
        same = self._same_domain[issuer]
        nv = b * same
        nic = b - nv
        b_nv, b_nic = float(nv.sum()), float(nic.sum())
        pb = self.payload_bytes
        pb["nvlink"] += b_nv
        pb["nic"] += b_nic
        pb["local"] += local
        lat = 0.0
        if b_nv > 0:
            lat = self._remote_lat * (self.push_latency_fraction if kind == "push" else 1.0)
        if b_nic > 0:
            lat = max(lat, self.topo.nic_latency_us)
        if local > 0:
            lat = max(lat, self.gpu.local_load_latency_us)
        route = self._static_route(issuer, into)
        # (size, NVLink bytes, local bytes, NIC bytes) of each flow
        if self.flow_granularity == "peer":
            parts = [(float(b[p]), float(nv[p]), 0.0, float(nic[p]), p) for p in np.flatnonzero(b)]
            if local > 0:
                parts.append((local, 0.0, local, 0.0, -1))
        else:
            total = b_nv + b_nic + local
            parts = [(total, b_nv, local, b_nic, -1)] if total > 0 else []
        flows = []
        zero = np.zeros_like(b)
        k = 0 if kind == "push" else 1
        role = self.roles.index(phase) if phase in self._roles else -1
        rates = self._roles[phase] if role >= 0 else self.rates
        for size, f_nv, f_local, f_nic, p in parts:
            if p < 0 and len(parts) == 1:
                c = self._coefs(kind, nv, nic, local, rates)
            else:  # one flow per peer (and one for the local part)
                one_nv, one_nic = zero.copy(), zero.copy()
                if p >= 0:
                    one_nv[p], one_nic[p] = f_nv, f_nic
                c = self._coefs(kind, one_nv, one_nic, f_local, rates)
            if c[0] > 0:  # the engine entry (first in the route) survives the zero filter
                fid = len(self.g.flows) + len(flows)
                self._eng.append((fid, k, f_nv / size, f_local / size, role))
            flows.append((size, (route, c / size)))
        return self.g.transfer(flows, lat, deps, rank, phase, rnd)

    def retime_engine(self) -> None:
        """Re-set the comm-engine coefficient of every flow built so far from the current
        ``rates`` and ``_roles`` (the rest of a flow's route does not depend on them)."""
        if not self._eng:
            return
        ptr, _, coef, _ = self.g.flows.arrays()
        f, k, nv, loc, role = (np.asarray(x) for x in zip(*self._eng, strict=True))
        # rates by role index (roles order, then -1 = self.rates)
        tab = [self._roles.get(r, self.rates) for r in self.roles] + [self.rates]
        push = np.array([t.push for t in tab])[role]
        pull = np.array([t.pull for t in tab])[role]
        local = np.array([t.local for t in tab])[role]
        rate = np.where(k == 0, push, pull)
        coef[ptr[f.astype(np.int64)]] = nv / rate + loc / local
