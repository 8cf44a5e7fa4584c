"""Fit the kernel profile of the comm-phase model (:mod:`sim.comm.model`) on measured rows.

Fitted on the fit rows only (:func:`sim.measured.is_fit_row`), by least sum of
|log(predicted / measured)| over the rows of single-knob kernels (composite kernels have no
knob of their own and are predicted from their parts):

* per kernel knob, its in-flight factor ``f``;
* ``call_fixed_us`` and ``handshake_us`` (per launch / per cross-GPU wait, us);
* ``host_floor_us`` on the fit rows that show host jitter (p20-p80 band wider than
  :data:`HOST_JITTER`): first one floor shared by every entry point ("default"), then one per
  Python entry point whose rows prefer another value; without such rows no floor is fitted
  ({"default": 0}: a device-bound row only bounds the host time from above);
* ``schedule_fixed_us`` and ``schedule_load_us`` (the schedule rows);
* the in-graph knobs of :data:`SEARCH` (``sum_ring_turn_us``, ``sm_congestion_sms``,
  ``tma_item_us``, ``tma_store_us``, ``tma_pad_us``, the warp routines'
  ``warp_lookup_rounds``), coordinate-wise on their grids, :data:`SWEEPS` sweeps.

Fixed costs are delays and the host floor a max outside the task graph, so each row's makespan
T(f) is tabulated once (per value of the in-graph knobs it depends on) on a grid of its own
factor, log-interpolated, and the rest is grid search. A full fit runs 10-20 minutes
(``mok-sim validate --refit``).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence

import numpy as np

from mok.spec.rows import row_routing_seed
from sim.comm.catalog import ENTRY_POINTS, KERNELS, kernel_engine, kernel_key
from sim.comm.model import build_kernel_graph, schedule_device_us, schedule_serial_loads
from sim.comm.profile import KernelProfile
from sim.comm.rates import curve_engine
from sim.core.engine import run_graph
from sim.measured import is_fit_row

__all__ = ["fit_kernel_profile", "SEARCH", "SWEEPS"]

# in-graph knobs: name (dotted for a dict entry) -> grid searched
SEARCH: dict[str, tuple[float, ...]] = {
    "sum_ring_turn_us": tuple(np.round(np.arange(4.0, 14.01, 0.25), 2)),
    # fitted on the 24- vs 132-SM partials (the only fit rows at two SM counts)
    "sm_congestion_sms.tma": (300.0, 400.0, 450.0, 500.0, 550.0, 600.0, 750.0),
    "sm_congestion_sms.vector": (60.0, 70.0, 80.0, 90.0, 100.0, 110.0, 125.0, 150.0),
    "tma_item_us": tuple(np.round(np.arange(0.30, 0.701, 0.02), 3)),
    "tma_store_us": tuple(np.round(np.arange(0.0, 0.161, 0.02), 3)),
    "tma_pad_us": tuple(np.round(np.arange(0.0, 0.601, 0.02), 3)),
    "warp_lookup_rounds.copy": (0.0, 0.25, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0),
    "warp_lookup_rounds.fan": (0.0, 0.25, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0),
    "warp_lookup_rounds.sum": (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0),
    "warp_lookup_rounds.seg": (0.0, 0.25, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0),
}
SWEEPS = 2  # the second sweep moves nothing on the committed grid (a fixed point)
_F_GRID = np.exp(np.linspace(math.log(0.05), math.log(6.0), 28))  # in-flight factors tabulated
_F_FINE = np.exp(np.linspace(math.log(0.05), math.log(6.0), 600))
_CALL_FIXED = tuple(range(0, 41))
_HANDSHAKE = tuple(range(0, 21, 2))
_FLOORS = np.arange(10.0, 261.0, 1.0)  # host floors searched, us
DEVICE_MARGIN = 1.2  # see _Fit.mark_device_rows
# p20-p80 band (over the median) above which a row shows host jitter (_fit_host); the
# device-bound rows of the committed grids measure within 4 %
HOST_JITTER = 0.05
_SCHED_FIXED = np.arange(0.0, 250.01, 0.5)  # schedule_fixed_us searched
_SCHED_LOAD = np.round(np.arange(0.0, 0.5001, 0.005), 3)  # schedule_load_us searched


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
        out.append(f"sm_congestion_sms.{curve_engine(ph.knob)}")
        if eng == "tma" and ph.routine in ("copy", "fan"):
            out += ["tma_item_us", "tma_store_us"] + (["tma_pad_us"] if ph.loop == "recv" else [])
        elif eng == "tma" and ph.routine == "ring_sum":
            out.append("sum_ring_turn_us")
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
        self.waits = np.array(  # waits that pay handshake_us
            [sum(ph.remote_waits for ph in s.phases if ph.rendezvous) for s in self.specs], float
        )
        self._tables: dict[tuple, np.ndarray] = {}
        self.device = np.ones(len(pts))  # 1: the row's kernel knobs are fitted on it
        # rows whose measured p20-p80 band shows host jitter (CSVs without bands: every row)
        band = np.array([_band(row) for _, row, _ in pts])
        self.jitter = np.isnan(band) | (band > HOST_JITTER)

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
                spec, sms, seed = KERNELS[key], int(row["sms"]), row_routing_seed(row)
                b, g = build_kernel_graph(spec, key[2], *_workload(row), sms, p, seed)
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


def _band(row: dict) -> float:
    """Width of a row's measured p20-p80 band over its median (NaN without the columns)."""
    try:
        return (float(row["p80_us"]) - float(row["p20_us"])) / float(row["median_us"])
    except (KeyError, TypeError, ValueError):
        return math.nan


def _floor_loss(dev: np.ndarray, us: np.ndarray) -> np.ndarray:
    """Sum over rows of |log(max(dev, floor) / us)| for every floor of :data:`_FLOORS`."""
    return np.abs(np.log(np.maximum(dev[None, :], _FLOORS[:, None]) / us[None, :])).sum(axis=1)


def _fit_host(fit: _Fit, dev: np.ndarray, prof: KernelProfile) -> KernelProfile:
    """Host floors from device predictions ``dev`` on the rows that show host jitter
    (:attr:`_Fit.jitter`): the shared floor over them, then one per entry point whose rows
    prefer another value. NOTE: a device-bound row (a tight p20-p80 band) only bounds the host
    time from above, and near its device time a floor would stand in for kernel-model error;
    without jitter rows the floors are not identified and are left out (0: every call
    device-bound)."""
    if not fit.jitter.any():
        return prof.replace(host_floor_us={"default": 0.0})
    sel = np.flatnonzero(fit.jitter)
    shared = float(_FLOORS[int(np.argmin(_floor_loss(dev[sel], fit.us[sel])))])
    floors = {"default": shared}
    for entry in ENTRY_POINTS:
        rows = [i for i in sel if fit.entries[i] == entry]
        if not rows:
            continue
        losses = _floor_loss(dev[rows], fit.us[rows])
        j = int(np.argmin(losses))
        if losses[j] < losses[int(np.searchsorted(_FLOORS, shared))] - 1e-6:
            floors[entry] = float(_FLOORS[j])
    return prof.replace(host_floor_us=floors)


def _fit_schedule(sched: list[dict], prof: KernelProfile) -> KernelProfile:
    """schedule_fixed_us and schedule_load_us, jointly (grid search), against max(device, the
    schedule's host floor). The load cost is told apart from the fixed cost by the expert
    count (DeepSeek-V3 256, Qwen3 128), and then sets the per-token slope too."""
    us = np.array([float(r["median_us"]) for r in sched])
    base = schedule_device_us(0, prof.replace(schedule_fixed_us=0.0, schedule_load_us=0.0))
    loads = np.array(
        [schedule_serial_loads(int(r["tokens_per_rank"]), r["model"]) for r in sched], float
    )
    dev = base + _SCHED_FIXED[:, None, None] + _SCHED_LOAD[None, :, None] * loads  # [f, l, rows]
    pred = np.maximum(dev, prof.host_us("schedule"))
    losses = np.abs(np.log(pred / us)).sum(axis=2)
    i, j = np.unravel_index(int(np.argmin(losses)), losses.shape)
    return prof.replace(
        schedule_fixed_us=float(_SCHED_FIXED[i]), schedule_load_us=float(_SCHED_LOAD[j])
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
        raise ValueError("no fit rows (see sim.app.validate.is_fit_row)")
    if "default" not in prof.host_floor_us:
        prof = prof.replace(host_floor_us={**prof.host_floor_us, "default": 50.0})
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
