"""Flow-level max-min fair bandwidth sharing (numba hot loop, testable without any event loop).

A flow is a byte count plus a *route*: a sparse list of (resource, coefficient) pairs meaning
"each payload byte per microsecond of this flow uses ``coefficient`` units of the resource's
capacity". Coefficients carry protocol overhead (an NVLink direction carries 1.19 wire bytes per
pushed payload byte) and comm-SM cost (1 / engine bandwidth), so one solver handles links,
switches and communication SMs alike.

:func:`maxmin_rates` is progressive filling: all unfrozen flows grow at one common rate until a
resource saturates; its flows freeze at that rate; repeat. The result is the max-min fair
allocation (no flow can grow without shrinking one that is no faster).
"""

from __future__ import annotations

import numpy as np
from numba import njit

__all__ = ["maxmin_rates", "FlowTable"]

_EPS_DEMAND = 1e-15


@njit(cache=True, error_model="numpy")
def maxmin_rates(active, ptr, res, coef, cap, rates, used):  # pragma: no cover - numba
    """Max-min fair rates of the ``active`` flows.

    active: [F] int64 flow ids; ptr: [num_flows + 1] int64 CSR offsets into res/coef;
    res: [nnz] int64 resource ids; coef: [nnz] float64 usage per unit rate; cap: [R] float64.
    Writes rates[a] for active[a] (payload bytes per unit time) and used[r] (capacity in use).
    """
    num_res = cap.shape[0]
    nf = active.shape[0]
    demand = np.zeros(num_res)
    for r in range(num_res):
        used[r] = 0.0
    # per-resource lists of active flows (CSC)
    cnt = np.zeros(num_res + 1, np.int64)
    for a in range(nf):
        f = active[a]
        for j in range(ptr[f], ptr[f + 1]):
            cnt[res[j] + 1] += 1
            demand[res[j]] += coef[j]
    for r in range(num_res):
        cnt[r + 1] += cnt[r]
    fill = np.empty(num_res, np.int64)
    for r in range(num_res):
        fill[r] = cnt[r]
    lst = np.empty(cnt[num_res], np.int64)
    for a in range(nf):
        f = active[a]
        for j in range(ptr[f], ptr[f + 1]):
            lst[fill[res[j]]] = a
            fill[res[j]] += 1
    frozen = np.zeros(nf, np.bool_)
    left = nf
    sat = np.zeros(num_res, np.bool_)
    while left > 0:
        best = np.inf
        for r in range(num_res):
            if demand[r] > _EPS_DEMAND:
                x = (cap[r] - used[r]) / demand[r]
                if x < best:
                    best = x
        if best == np.inf:  # flows that touch no capacity: should not exist
            for a in range(nf):
                if not frozen[a]:
                    rates[a] = np.inf
            break
        if best < 0.0:
            best = 0.0
        thr = best * (1.0 + 1e-9) + 1e-300
        for r in range(num_res):
            sat[r] = demand[r] > _EPS_DEMAND and (cap[r] - used[r]) / demand[r] <= thr
        for r in range(num_res):
            if not sat[r]:
                continue
            for i in range(cnt[r], cnt[r + 1]):
                a = lst[i]
                if frozen[a]:
                    continue
                frozen[a] = True
                left -= 1
                rates[a] = best
                f = active[a]
                for j in range(ptr[f], ptr[f + 1]):
                    used[res[j]] += best * coef[j]
                    demand[res[j]] -= coef[j]
            demand[r] = 0.0


class FlowTable:
    """Append-only store of flows (size + route) as CSR arrays for :func:`maxmin_rates`."""

    def __init__(self) -> None:
        self._len: list[int] = []
        self._res: list[np.ndarray] = []
        self._coef: list[np.ndarray] = []
        self._size: list[float] = []
        self._arrays: tuple | None = None

    def add(self, size: float, route) -> int:
        """Add a flow of ``size`` payload bytes over ``route``: {resource: coefficient} or a pair
        of arrays (resources, coefficients)."""
        if isinstance(route, dict):
            res = np.fromiter(route.keys(), dtype=np.int64, count=len(route))
            coef = np.fromiter(route.values(), dtype=np.float64, count=len(route))
        else:
            res, coef = (np.asarray(x) for x in route)
        keep = coef > 0.0
        if not keep.any():
            raise ValueError("a flow needs at least one resource on its route")
        if not keep.all():
            res, coef = res[keep], coef[keep]
        self._res.append(res.astype(np.int64, copy=False))
        self._coef.append(coef.astype(np.float64, copy=False))
        self._len.append(res.shape[0])
        self._size.append(float(size))
        self._arrays = None
        return len(self._size) - 1

    def add_filtered(self, size: float, res: np.ndarray, coef: np.ndarray) -> int:
        """:meth:`add` of a route already filtered: ``res`` int64, ``coef`` float64, all > 0."""
        if not res.shape[0]:
            raise ValueError("a flow needs at least one resource on its route")
        self._res.append(res)
        self._coef.append(coef)
        self._len.append(res.shape[0])
        self._size.append(float(size))
        self._arrays = None
        return len(self._size) - 1

    def __len__(self) -> int:
        return len(self._size)

    def arrays(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """(ptr, res, coef, size) as numpy arrays (cached until the next :meth:`add`; callers
        may patch ``coef`` in place, see
        :meth:`sim.core.transfer.TransferBuilder.retime_engine`)."""
        if self._arrays is None:
            self._arrays = self._build_arrays()
        return self._arrays

    def _build_arrays(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        ptr = np.zeros(len(self._len) + 1, dtype=np.int64)
        np.cumsum(self._len, out=ptr[1:])
        if not self._res:
            return ptr, np.empty(0, np.int64), np.empty(0), np.empty(0)
        return (
            ptr,
            np.concatenate(self._res),
            np.concatenate(self._coef),
            np.asarray(self._size, dtype=np.float64),
        )


def solve(active, ptr, res, coef, cap) -> tuple[np.ndarray, np.ndarray]:
    """Convenience wrapper: (rates [F], used [R]) for the active flows."""
    active = np.asarray(active, dtype=np.int64)
    rates = np.zeros(active.shape[0])
    used = np.zeros(cap.shape[0])
    maxmin_rates(active, ptr, res, coef, np.asarray(cap, dtype=np.float64), rates, used)
    return rates, used
