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

Flow coupling per mechanism (:data:`COUPLING`, ``flow_granularity="round"``): a push transfer is
one flow per *sender* (its stores to every destination advance together), a pull transfer one
per *receiver* (the receiver paces its reads from every source). The writers that share a
destination's port are therefore the push senders into it, each with its own flow; a pull
receiver's responses count as one writer. ``"peer"`` splits both into one flow per peer.
On an NVSwitch fabric, N concurrent push writers into one port reach
``GpuProfile.incast.efficiency(N)`` of its wire rate: a push transfer given ``writers`` (the
number of senders into each destination in that round) charges the destination's data port
``1 / efficiency`` per wire byte.

Push signalling (``GpuProfile.signalling``): :meth:`TransferBuilder.fence_us` is the release fence
after a round of remote stores (fixed part plus the drain of the stores still in flight),
:meth:`TransferBuilder.poll_us` the receiver's sweep over its flags and
:meth:`TransferBuilder.completion_jitter` the seeded per-sender completion delays.

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
from numba import njit

from sim.core.engine import Graph
from sim.core.topology import ENGINE, NIC_RX, NIC_TX, NVL_RX, NVL_TX, RES_PER_GPU, Topology

__all__ = ["Rates", "TransferBuilder", "COUPLING"]

# what one flow of a transfer is, per mechanism, at flow_granularity "round" ("peer": one flow per
# peer for both)
COUPLING = {"push": "sender", "pull": "receiver"}
# completion-jitter tags of the all-rank handshakes (the policies use 0 and 1)
HANDSHAKE_TAG = 100


_NO_EFF = np.empty(0)


@njit(cache=True, error_model="numpy")
def _nv_flow(nv, b_nv, c0, a, r, sw, port_eff, total, route):  # pragma: no cover - numba
    """(resources, coefficients per byte) of a one-flow transfer over the NVLink-only route
    (:meth:`TransferBuilder._nv_route`), zero coefficients dropped: the values of
    :meth:`TransferBuilder._coefs` over ``total``, each computed by the same operations.
    ``port_eff`` [R] or empty (all 1); ``c0`` the engine entry, ``sw`` the switch entry."""
    n = nv.shape[0]
    res = np.empty(2 * n + 4, np.int64)
    coef = np.empty(2 * n + 4)
    j = 0
    x = c0 / total
    if x > 0.0:
        res[j], coef[j] = route[0], x
        j += 1
    eff = port_eff.shape[0] > 0
    for i in range(n):
        x = (a * nv[i] / port_eff[i] if eff else a * nv[i]) / total
        if x > 0.0:
            res[j], coef[j] = route[1 + i], x
            j += 1
    x = a * b_nv / total
    if x > 0.0:
        res[j], coef[j] = route[n + 1], x
        j += 1
    x = r * b_nv / total
    if x > 0.0:
        res[j], coef[j] = route[n + 2], x
        j += 1
    for i in range(n):
        x = r * nv[i] / total
        if x > 0.0:
            res[j], coef[j] = route[n + 3 + i], x
            j += 1
    x = sw / total
    if x > 0.0:
        res[j], coef[j] = route[2 * n + 3], x
        j += 1
    return res[:j].copy(), coef[:j].copy()


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
        self.flow_granularity = flow_granularity  # "round": COUPLING, "peer": one per peer
        self.coupling = (
            dict(COUPLING) if flow_granularity == "round" else dict.fromkeys(COUPLING, "peer")
        )
        self.flag_remote = gpu.flag_latency_remote_us + topo.switch_hop_latency_us
        self.fence = gpu.fence_us  # fixed part of a release fence
        self.signalling = gpu.signalling
        # many writers into one port: NVSwitch ports only (a direct link has one writer)
        self.incast = gpu.incast if topo.fabric == "nvswitch" else None
        # (task, remote bytes, extra us) of every fence delay: re-timed with the comm SMs
        self._fences: list[tuple[int, float, float]] = []
        self.g = Graph()
        self.payload_bytes = {"nvlink": 0.0, "nic": 0.0, "local": 0.0}
        self.rates = Rates(1.0, 1.0, 1.0)
        # flow, kind, nv/B, local/B, role (index into roles, -1: self.rates)
        self._eng: list[tuple[int, int, float, float, int]] = []
        self._eng_arrays: tuple | None = None  # (len(_eng), its columns as arrays)
        self._proto = {
            k: (gpu.protocol[k].data_bytes_per_byte, gpu.protocol[k].reverse_bytes_per_byte)
            for k in ("push", "pull")
        }
        dom = np.arange(num_ranks) // topo.gpus_per_domain
        self._same_domain = dom[:, None] == dom[None, :]
        self._routes: dict[tuple[int, bool], np.ndarray] = {}
        # NVLink-only routes (engine, peer data [R], issuer pair, peer reverse [R], switch) of
        # issuers whose NVLink domain holds every rank: their NIC coefficients are all zero
        self._nv_routes: dict[tuple[int, bool], np.ndarray] = {}
        self._one_domain = self._same_domain.all(axis=1).tolist()
        self._remote_lat = topo.remote_latency_us(gpu)
        self._nvswitch = topo.fabric == "nvswitch"
        # incast efficiency per writers vector (None: all 1)
        self._port_eff: dict[tuple, np.ndarray | None] = {}

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

    def _nv_route(self, issuer: int, into: bool) -> np.ndarray:
        """:meth:`_static_route` without its NIC entries (for :func:`_nv_flow`)."""
        key = (issuer, into)
        route = self._nv_routes.get(key)
        if route is None:
            full = self._static_route(issuer, into)
            n = self.num_ranks
            route = np.concatenate((full[: 2 * n + 3], full[-1:]))
            self._nv_routes[key] = route
        return route

    def _coefs(
        self,
        kind: str,
        nv: np.ndarray,
        nic: np.ndarray,
        local: float,
        rates: Rates,
        port_eff: np.ndarray | None = None,
    ) -> np.ndarray:
        """Coefficients (totals, not per byte) matching :meth:`_static_route`; ``port_eff`` [R]:
        the incast efficiency of each peer's data port (None: 1)."""
        b_nv, b_nic = float(nv.sum()), float(nic.sum())
        a, r = self._proto[kind]
        peer_data = a * nv if port_eff is None else a * nv / port_eff
        na, nr = self.topo.nic_data_bytes_per_byte, self.topo.nic_reverse_bytes_per_byte
        sw = (a + r) * b_nv if self.topo.fabric == "nvswitch" else 0.0
        return np.concatenate(
            (
                [b_nv / (rates.push if kind == "push" else rates.pull) + local / rates.local],
                peer_data,
                [a * b_nv, r * b_nv],
                r * nv,
                na * nic,
                [na * b_nic, nr * b_nic],
                nr * nic,
                [sw],
            )
        )

    def transfer(
        self, issuer, kind, into, peer_bytes, local_bytes, deps, rank, phase, rnd, writers=None
    ):
        """Add a transfer issued by ``issuer``'s comm SMs with mechanism ``kind`` ("push" /
        "pull"): ``peer_bytes`` [R] payload to (``into=False``) or from (``into=True``) each
        peer, plus ``local_bytes`` copied inside the issuer. ``writers`` [R] (push stores only):
        the concurrent writers into each peer's port, for the incast efficiency."""
        b = np.array(peer_bytes, dtype=np.float64)
        local = float(local_bytes) + float(b[issuer])
        b[issuer] = 0.0
        one_domain = self._one_domain[issuer]
        if one_domain:  # every peer over NVLink: nv == b * same == b, nic == 0
            nv = b
            b_nv, b_nic = float(np.add.reduce(b)), 0.0
        else:
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
        # (size, NVLink bytes, local bytes, NIC bytes) of each flow
        port_eff = None
        if writers is not None and self.incast is not None and kind == "push" and not into:
            w = np.asarray(writers)
            key = (w.dtype.str, w.shape, w.tobytes())
            if key in self._port_eff:
                port_eff = self._port_eff[key]
            else:
                port_eff = self.incast.efficiency(w)
                if np.all(port_eff == 1.0):
                    port_eff = None
                self._port_eff[key] = port_eff
        k = 0 if kind == "push" else 1
        role = self.roles.index(phase) if phase in self._roles else -1
        rates = self._roles[phase] if role >= 0 else self.rates
        if one_domain and self.coupling[kind] != "peer":
            # fast path: one flow over the NVLink-only route (the NIC coefficients it leaves out
            # are zero, which the flow table drops anyway)
            total = b_nv + b_nic + local
            flows = []
            if total > 0:
                a, r = self._proto[kind]
                c0 = b_nv / (rates.push if kind == "push" else rates.pull) + local / rates.local
                if c0 > 0:
                    self._eng.append((len(self.g.flows), k, b_nv / total, local / total, role))
                sw = (a + r) * b_nv if self._nvswitch else 0.0
                eff = _NO_EFF if port_eff is None else port_eff
                route = self._nv_route(issuer, into)
                res, coef = _nv_flow(nv, b_nv, c0, a, r, sw, eff, total, route)
                flows.append((total, res, coef))
            return self.g.transfer_filtered(flows, lat, deps, rank, phase, rnd)
        if one_domain:
            nic = np.zeros_like(b)
        route = self._static_route(issuer, into)
        if self.coupling[kind] == "peer":
            parts = [(float(b[p]), float(nv[p]), 0.0, float(nic[p]), p) for p in np.flatnonzero(b)]
            if local > 0:
                parts.append((local, 0.0, local, 0.0, -1))
        else:
            total = b_nv + b_nic + local
            parts = [(total, b_nv, local, b_nic, -1)] if total > 0 else []
        flows = []
        zero = np.zeros_like(b)
        for size, f_nv, f_local, f_nic, p in parts:
            if p < 0 and len(parts) == 1:
                c = self._coefs(kind, nv, nic, local, rates, port_eff)
            else:  # one flow per peer (and one for the local part)
                one_nv, one_nic = zero.copy(), zero.copy()
                if p >= 0:
                    one_nv[p], one_nic[p] = f_nv, f_nic
                c = self._coefs(kind, one_nv, one_nic, f_local, rates, port_eff)
            if c[0] > 0:  # the engine entry (first in the route) survives the zero filter
                fid = len(self.g.flows) + len(flows)
                self._eng.append((fid, k, f_nv / size, f_local / size, role))
            flows.append((size, (route, c / size)))
        return self.g.transfer(flows, lat, deps, rank, phase, rnd)

    # -- push signalling ------------------------------------------------------------------------
    @property
    def comm_sms(self) -> int:
        """Comm SMs that issue the transfers (``cfg.num_comm_sms`` of a subclass with a config;
        1 otherwise)."""
        return int(getattr(getattr(self, "cfg", None), "num_comm_sms", 1))

    @property
    def push_drain(self) -> float:
        """Payload bytes per us at which a sender's outstanding remote stores drain (its NVLink
        port's wire rate over the push protocol bytes)."""
        return self.gpu.nvlink_wire_gbps * 1e3 / self._proto["push"][0]

    def fence_us(self, remote_bytes: float) -> float:
        """System-scope release fence after a round of ``remote_bytes`` remote stores."""
        return self.signalling.fence_us(self.fence, remote_bytes, self.comm_sms, self.push_drain)

    def fence_delay(self, remote_bytes, extra_us, deps, rank, phase, rnd) -> int:
        """A delay task of the fence after ``remote_bytes`` remote stores plus ``extra_us`` (the
        flag, the jitter); re-timed by :meth:`retime_engine` when the comm SMs change."""
        t = self.g.delay(self.fence_us(remote_bytes) + extra_us, deps, rank, phase, rnd)
        self._fences.append((t, float(remote_bytes), float(extra_us)))
        return t

    def poll_us(self, num_flags: int) -> float:
        """A receiver's sweep over ``num_flags`` completion flags (local loads)."""
        return self.signalling.poll_us(num_flags, self.gpu.local_load_latency_us)

    def handshake_us(self, tag: int) -> float:
        """One all-rank handshake of the kernels: every rank raises a flag on every rank and
        waits for the last (``python -m mok.bench signals`` names them per call; two come before
        a call's first row moves: the routing exchange and x ready). The flag's one-way latency,
        the waiting block's sweep over the ``num_ranks`` flags (:meth:`poll_us`) and the latest
        of the other ranks' completion jitters (seeded by ``tag``)."""
        n = self.num_ranks
        late = self.completion_jitter(HANDSHAKE_TAG + tag, (n - 1,)).max() if n > 1 else 0.0
        return self.flag_remote + self.poll_us(n) + float(late)

    @property
    def jitter_seed(self) -> int:
        """Seed of the completion jitter: the workload's (``wl.seed`` of a subclass), else 0."""
        return int(getattr(getattr(self, "wl", None), "seed", 0) or 0)

    def completion_jitter(self, tag: int, shape: tuple[int, ...]) -> np.ndarray:
        """Per-sender completion delays (us), exponential of mean
        ``signalling.completion_jitter_us``, one per entry of ``shape`` (e.g. [senders,
        rounds]); reproducible for a (seed, tag)."""
        mean = self.signalling.completion_jitter_us
        if mean <= 0:
            return np.zeros(shape)
        return np.random.default_rng((self.jitter_seed, tag)).exponential(mean, size=shape)

    def retime_engine(self) -> None:
        """Re-set the comm-engine coefficient of every flow built so far from the current
        ``rates`` and ``_roles`` (the rest of a flow's route does not depend on them), and the
        fence delays from the current comm SMs."""
        if self._fences:
            dur = self.g.duration
            for t, nbytes, extra in self._fences:
                dur[t] = self.fence_us(nbytes) + extra
        if not self._eng:
            return
        ptr, _, coef, _ = self.g.flows.arrays()
        # the _eng columns as arrays, kept while no flow is added
        if self._eng_arrays is None or self._eng_arrays[0] != len(self._eng):
            f, k, nv, loc, role = (np.asarray(x) for x in zip(*self._eng, strict=True))
            self._eng_arrays = (len(self._eng), f.astype(np.int64), k, nv, loc, role)
        _, f, k, nv, loc, role = self._eng_arrays
        # rates by role index (roles order, then -1 = self.rates)
        tab = [self._roles.get(r, self.rates) for r in self.roles] + [self.rates]
        push = np.array([t.push for t in tab])[role]
        pull = np.array([t.pull for t in tab])[role]
        local = np.array([t.local for t in tab])[role]
        rate = np.where(k == 0, push, pull)
        coef[ptr[f]] = nv / rate + loc / local
