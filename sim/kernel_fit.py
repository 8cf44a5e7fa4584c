"""Fit the kernel profile of the comm-phase model (:mod:`sim.phases`) on measured rows.

Fitted on the fit rows only (:func:`sim.validate.is_fit_row`), by least sum of
|log(predicted / measured)| over the rows of single-knob kernels (composite kernels have no
knob of their own and are predicted from their parts):

* per kernel knob, its in-flight factor ``f``;
* ``call_fixed_us`` and ``handshake_us`` (per launch / per cross-GPU wait, us);
* ``host_floor_us``: first one floor shared by every entry point ("default"), then one per
  Python entry point whose fit rows prefer another value (an entry point whose fit rows are all
  device-bound keeps the default);
* ``schedule_us_per_token``;
* the in-graph knobs of :data:`SEARCH` (``tma_item_us``, ``tma_store_us``, the warp routines'
  ``warp_lookup_rounds``), coordinate-wise on their grids, :data:`SWEEPS` sweeps.

Fixed costs are delays and the host floor a max outside the task graph, so each row's makespan
T(f) is tabulated once (per value of the in-graph knobs it depends on) on a grid of its own
factor, log-interpolated, and the rest is grid search. ``sm_congestion_sms`` is kept. A full
fit runs a few minutes (``mok-sim validate --refit``).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence

import numpy as np

from sim.engine import run_graph
from sim.phases import (
    ENTRY_POINTS,
    KERNELS,
    KernelProfile,
    build_kernel_graph,
    kernel_engine,
    kernel_key,
    schedule_device_us,
)

__all__ = ["fit_kernel_profile", "SEARCH", "SWEEPS"]

# in-graph knobs: name (dotted for a dict entry) -> grid searched
SEARCH: dict[str, tuple[float, ...]] = {
    "tma_item_us": tuple(np.round(np.arange(0.30, 0.701, 0.02), 3)),
    "tma_store_us": tuple(np.round(np.arange(0.0, 0.161, 0.02), 3)),
    "tma_pad_us": tuple(np.round(np.arange(0.0, 0.601, 0.02), 3)),
    "warp_lookup_rounds.copy": (0.0, 0.25, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0),
    "warp_lookup_rounds.fan": (0.0, 0.25, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0),
    "warp_lookup_rounds.sum": (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0),
    "warp_lookup_rounds.seg": (0.0, 0.25, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0),
}
SWEEPS = 1  # a second sweep moved nothing on the committed CSVs
_F_GRID = np.exp(np.linspace(math.log(0.05), math.log(6.0), 28))  # in-flight factors tabulated
_F_FINE = np.exp(np.linspace(math.log(0.05), math.log(6.0), 600))
_CALL_FIXED = tuple(range(0, 41))
_HANDSHAKE = tuple(range(0, 21, 2))
_FLOORS = np.arange(60.0, 261.0, 1.0)  # host floors searched, us
DEVICE_MARGIN = 1.2  # see _Fit.mark_device_rows
_SCHED_PER_TOKEN = np.linspace(0.0, 0.05, 501)


def _get(prof: KernelProfile, name: str) -> float:
    if "." in name:
        field, key = name.split(".", 1)
        return getattr(prof, field).get(key, 0.0)
    return getattr(prof, name)


def _set(prof: KernelProfile, name: str, value: float) -> KernelProfile:
    if "." in name:
        field, key = name.split(".", 1)
        return prof.replace(**{field: {**getattr(prof, field), key: float(value)}})
    return prof.replace(**{name: float(value)})


def _depends_on(key: tuple[str, str, str]) -> tuple[str, ...]:
    """The in-graph knobs of :data:`SEARCH` a kernel's graph depends on."""
    out = []
    for ph in KERNELS[key].phases:
        eng = kernel_engine(ph.knob)
        if eng == "tma" and ph.routine in ("copy", "fan"):
            out += ["tma_item_us", "tma_store_us"] + (["tma_pad_us"] if ph.loop == "recv" else [])
        elif eng == "vector":
            out.append(f"warp_lookup_rounds.{ph.routine}")
    return tuple(dict.fromkeys(out))


def _workload(row: dict) -> tuple:
    return (
        row["model"],
        int(row["tokens_per_rank"]),
        int(row.get("num_ranks") or 2),
        row["skew"],
    )


class _Fit:
    """The fit rows and their T(f) tables."""

    def __init__(self, pts: list[tuple], prof: KernelProfile) -> None:
        self.pts = pts  # (key, row, measured us)
        self.us = np.array([u for _, _, u in pts])
        self.specs = [KERNELS[k] for k, _, _ in pts]
        self.entries = [s.calls[0] for s in self.specs]  # single-knob kernels: one call
        self.calls = np.array([len(s.calls) for s in self.specs], dtype=float)
        self.waits = np.array([sum(ph.remote_waits for ph in s.phases) for s in self.specs], float)
        self._tables: dict[tuple, np.ndarray] = {}
        self.device = np.ones(len(pts))  # 1: the row's kernel knobs are fitted on it

    def mark_device_rows(self, prof: KernelProfile) -> None:
        """Device rows: measured at least DEVICE_MARGIN x their host floor. A row closer to its
        floor says little about its kernel: near the crossover the measured time exceeds both
        (launch latency and host jitter, which the model does not carry), so fitting kernel
        knobs on it would bend them; it still counts for the host floors."""
        self.device = (self.us >= DEVICE_MARGIN * self.host(prof)).astype(float)

    def table(self, i: int, prof: KernelProfile) -> np.ndarray:
        """T(f) on :data:`_F_FINE` for fit row ``i`` (fixed costs zero)."""
        key, row, _ = self.pts[i]
        ck = (i, tuple(_get(prof, d) for d in _depends_on(key)))
        if ck not in self._tables:
            zero = prof.replace(call_fixed_us=0.0, handshake_us=0.0)
            knob = KERNELS[key].knobs[0]
            t = []
            for f in _F_GRID:
                p = zero.replace(inflight_factor={**prof.inflight_factor, knob: f})
                b, g = build_kernel_graph(KERNELS[key], key[2], *_workload(row), int(row["sms"]), p)
                t.append(run_graph(g, b.topo.capacities(b.gpu)).makespan_us)
            self._tables[ck] = np.exp(np.interp(np.log(_F_FINE), np.log(_F_GRID), np.log(t)))
        return self._tables[ck]

    def host(self, prof: KernelProfile) -> np.ndarray:
        return np.array([prof.host_us(e) for e in self.entries])


def _inner(fit: _Fit, prof: KernelProfile):
    """(loss, call_fixed, handshake, factors, device us per row) for fixed in-graph knobs and
    host floors: for each (call_fixed, handshake) every knob takes its best factor. The loss
    counts the device rows only (:attr:`_Fit.device`)."""
    host = fit.host(prof)
    by_knob: dict[str, list[int]] = {}
    for i, (key, _, _) in enumerate(fit.pts):
        by_knob.setdefault(KERNELS[key].knobs[0], []).append(i)
    blocks = {k: (idx, np.array([fit.table(i, prof) for i in idx])) for k, idx in by_knob.items()}
    best = None
    for cf in _CALL_FIXED:
        for hs in _HANDSHAKE:
            loss, fs, dev = 0.0, {}, np.empty(len(fit.pts))
            for knob, (idx, t) in blocks.items():
                d = t + (fit.calls[idx] * cf + fit.waits[idx] * hs)[:, None]
                pred = np.maximum(d, host[idx, None])
                err = fit.device[idx] @ np.abs(np.log(pred / fit.us[idx, None]))
                j = int(np.argmin(err))
                fs[knob] = round(float(_F_FINE[j]), 5)
                loss += float(err[j])
                dev[idx] = d[:, j]
            if best is None or loss < best[0]:
                best = (loss, float(cf), float(hs), fs, dev)
    return best


def _floor_loss(dev: np.ndarray, us: np.ndarray) -> np.ndarray:
    """Sum over rows of |log(max(dev, floor) / us)| for every floor of :data:`_FLOORS`."""
    return np.abs(np.log(np.maximum(dev[None, :], _FLOORS[:, None]) / us[None, :])).sum(axis=1)


def _fit_host(fit: _Fit, dev: np.ndarray, prof: KernelProfile) -> KernelProfile:
    """Host floors from device predictions ``dev``: the shared floor over all rows, then one per
    entry point whose rows prefer another value."""
    shared = float(_FLOORS[int(np.argmin(_floor_loss(dev, fit.us)))])
    floors = {"default": shared}
    for entry in ENTRY_POINTS:
        rows = [i for i, e in enumerate(fit.entries) if e == entry]
        if not rows or entry == "schedule":
            continue
        losses = _floor_loss(dev[rows], fit.us[rows])
        j = int(np.argmin(losses))
        if losses[j] < losses[int(np.searchsorted(_FLOORS, shared))] - 1e-6:
            floors[entry] = float(_FLOORS[j])
    sched = prof.host_floor_us.get("schedule")
    return prof.replace(host_floor_us=floors if sched is None else {**floors, "schedule": sched})


def _fit_schedule(sched: list[dict], prof: KernelProfile) -> KernelProfile:
    """schedule_us_per_token and the schedule's host floor, jointly (grid search)."""
    tokens = np.array([int(r["tokens_per_rank"]) for r in sched], dtype=float)
    us = np.array([float(r["median_us"]) for r in sched])
    dev = schedule_device_us(0, prof) + _SCHED_PER_TOKEN[:, None] * tokens  # [x, rows]
    losses = np.array([np.abs(np.log(np.maximum(dev, fl) / us)).sum(axis=1) for fl in _FLOORS])
    # NOTE: rows of one size cannot tell a per-token cost from a host floor; the smallest
    # per-token cost within 2 % of the best loss wins (host-bound unless the rows say otherwise)
    ok = losses.min(axis=0) <= losses.min() * 1.02 + 1e-9
    jx = int(np.flatnonzero(ok)[0])
    fl, x = float(_FLOORS[int(np.argmin(losses[:, jx]))]), float(_SCHED_PER_TOKEN[jx])
    return prof.replace(
        schedule_us_per_token=round(x, 6), host_floor_us={**prof.host_floor_us, "schedule": fl}
    )


def _fit_given_search(fit: _Fit, prof: KernelProfile) -> tuple[float, KernelProfile]:
    """Alternate the host floors and (call_fixed, handshake, factors)."""
    p = prof
    loss, cf, hs, fs, dev = _inner(fit, p)
    for _ in range(2):
        p = _fit_host(fit, dev, p)
        loss, cf, hs, fs, dev = _inner(fit, p)
        p = p.replace(
            call_fixed_us=cf, handshake_us=hs, inflight_factor={**p.inflight_factor, **fs}
        )
    return loss, p


def fit_kernel_profile(
    rows: Iterable[dict],
    prof: KernelProfile,
    search: Mapping[str, Sequence[float]] = SEARCH,
    sweeps: int = SWEEPS,
    log=None,
) -> KernelProfile:
    """Refit ``prof`` on the fit rows of ``rows`` (see the module docstring); ``search`` maps
    in-graph knobs to the grids searched (empty: keep them)."""
    from sim.validate import is_fit_row  # sim.validate imports this module

    pts, sched = [], []
    for row in rows:
        if row.get("impl", "mok") != "mok" or not is_fit_row(row):
            continue
        if row.get("what") == "schedule":
            sched.append(row)
            continue
        key = kernel_key(row)
        if key is not None and len(KERNELS[key].knobs) == 1:
            pts.append((key, row, float(row["median_us"])))
    if not pts:
        raise ValueError("no fit rows (see sim.validate.is_fit_row)")
    if "default" not in prof.host_floor_us:
        prof = prof.replace(host_floor_us={**prof.host_floor_us, "default": 145.0})
    fit = _Fit(pts, prof)
    loss, best = _fit_given_search(fit, prof)
    fit.mark_device_rows(best)  # from the fitted floors, then fixed for the search
    loss, best = _fit_given_search(fit, best)
    for _ in range(sweeps if search else 0):
        for name, grid in search.items():
            for v in grid:
                if math.isclose(v, _get(best, name)):
                    continue
                cand_loss, cand = _fit_given_search(fit, _set(best, name, v))
                if cand_loss < loss - 1e-9:
                    loss, best = cand_loss, cand
            if log:
                log(f"{name} = {_get(best, name)} (loss {loss / fit.device.sum():.5f})")
    if sched:
        best = _fit_schedule(sched, best)
    return best.replace(
        fit={
            "num_rows": len(pts) + len(sched),
            "num_kernel_rows_fitted": len(pts),
            "num_device_rows": int(fit.device.sum()),
            "mean_abs_log_err_device_rows": round(float(loss / fit.device.sum()), 5),
        }
    )
