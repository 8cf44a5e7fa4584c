"""Flow-level max-min fair bandwidth sharing (numba hot loop, testable without any event loop).

A flow is a byte count plus a *route*: a sparse list of (resource, coefficient) pairs meaning
"each payload byte per microsecond of this flow uses ``coefficient`` units of the resource's
capacity". Coefficients carry protocol overhead (an NVLink direction carries 1.19 wire bytes per
pushed payload byte) and comm-SM cost (1 / engine bandwidth), so one solver handles links,
switches and communication SMs alike.

:func:`maxmin_rates` is progressive filling: all unfrozen flows grow at one common rate until a
resource saturates; its flows freeze at that rate; repeat. The result is the max-min fair
allocation (no flow can grow without shrinking one that is no faster).

Two kernels run the same progressive filling, operation for operation, so they give bitwise the
same rates and capacity use:

* :func:`maxmin_rates` (sparse): builds per-resource flow lists from the CSR routes at every call
  and scans every resource each round; cost per call grows with the active routes' entries;
* :func:`maxmin_dense`: every route is a dense row over a compact column set (the resources
  that some flow touches; :mod:`sim.core.engine` builds the rows once per run); sums, updates
  and the bottleneck search run over contiguous rows, a screening test spares most divisions
  and a saturated column finds its few flows in a small bit matrix. A flow that skips a column
  adds ``0.0`` there, which leaves every sum unchanged, so each resource's sums see the same
  operands in the same order. For routes that touch most columns (a transfer to or from every
  EP peer) it is several times faster; for sparse routes (one flow per peer) the sparse kernel
  is.

tests/test_sim_fast_paths.py checks that both give the same bits.
"""

from __future__ import annotations

import numpy as np
from numba import njit

__all__ = ["maxmin_rates", "maxmin_dense", "add_rows", "FlowTable"]

_EPS_DEMAND = 1e-15


@njit(cache=True, error_model="numpy")
def maxmin_rates(active, ptr, res, coef, cap, rates, used):  # pragma: no cover - numba
    """Max-min fair rates of the ``active`` flows.

    active: [F] int64 flow ids; ptr: [num_flows + 1] int64 CSR offsets into res/coef;
    res: [nnz] int64 resource ids; coef: [nnz] float64 usage per unit rate; cap: [R] float64.
    Writes rates[a] for active[a] (payload bytes per unit time) and used[r] (capacity in use).
    """
    num_res = cap.shape[0]
    demand = np.empty(num_res)
    cnt = np.empty(num_res + 1, np.int64)
    fill = np.empty(num_res, np.int64)
    lst = np.empty(res.shape[0], np.int64)
    frozen = np.empty(active.shape[0], np.bool_)
    sat = np.empty(num_res, np.bool_)
    maxmin_sparse(active, ptr, res, coef, cap, rates, used, demand, cnt, fill, lst, frozen, sat)


@njit(cache=True, error_model="numpy")
def maxmin_sparse(
    active, ptr, res, coef, cap, rates, used, demand, cnt, fill, lst, frozen, sat
):  # pragma: no cover - numba
    """:func:`maxmin_rates` with its work arrays passed in (any contents): demand, fill, sat [R],
    cnt [R + 1], lst [entries of the active routes or more], frozen [F]."""
    num_res = cap.shape[0]
    nf = active.shape[0]
    for r in range(num_res):
        used[r] = 0.0
        demand[r] = 0.0
    # per-resource lists of active flows (CSC)
    for r in range(num_res + 1):
        cnt[r] = 0
    for a in range(nf):
        f = active[a]
        for j in range(ptr[f], ptr[f + 1]):
            cnt[res[j] + 1] += 1
            demand[res[j]] += coef[j]
    for r in range(num_res):
        cnt[r + 1] += cnt[r]
    for r in range(num_res):
        fill[r] = cnt[r]
    for a in range(nf):
        f = active[a]
        for j in range(ptr[f], ptr[f + 1]):
            lst[fill[res[j]]] = a
            fill[res[j]] += 1
    for a in range(nf):
        frozen[a] = False
    left = nf
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


@njit(cache=True)
def _min(x, n):  # pragma: no cover - numba
    """Smallest of x[:n] (no NaN), with eight independent running minima (a min is exact, so the
    grouping does not change it)."""
    b0 = b1 = b2 = b3 = b4 = b5 = b6 = b7 = np.inf
    m = n - n % 8
    for c in range(0, m, 8):
        v0, v1, v2, v3 = x[c], x[c + 1], x[c + 2], x[c + 3]
        v4, v5, v6, v7 = x[c + 4], x[c + 5], x[c + 6], x[c + 7]
        b0 = v0 if v0 < b0 else b0
        b1 = v1 if v1 < b1 else b1
        b2 = v2 if v2 < b2 else b2
        b3 = v3 if v3 < b3 else b3
        b4 = v4 if v4 < b4 else b4
        b5 = v5 if v5 < b5 else b5
        b6 = v6 if v6 < b6 else b6
        b7 = v7 if v7 < b7 else b7
    for c in range(m, n):
        v = x[c]
        b0 = v if v < b0 else b0
    b0 = b1 if b1 < b0 else b0
    b2 = b3 if b3 < b2 else b2
    b4 = b5 if b5 < b4 else b4
    b6 = b7 if b7 < b6 else b6
    b0 = b2 if b2 < b0 else b0
    b4 = b6 if b6 < b4 else b4
    return b4 if b4 < b0 else b0


@njit(cache=True, error_model="numpy")
def add_rows(row, lo, hi, rows, total):  # pragma: no cover - numba
    """total[c] += rows[row[a], c] for a = lo .. hi - 1, in that order (the demand sum of
    :func:`maxmin_dense`: a caller whose active flows only grew since the last solve extends
    its previous sum instead of starting again from zero, which gives the same floats)."""
    nc = total.shape[0]
    for a in range(lo, hi):
        ra = row[a]
        for c in range(nc):
            total[c] += rows[ra, c]


# a saturated column with at most this many active flows has them looked up in ``hit`` rather
# than by a pass over every unfrozen flow
_NARROW = 8
# 1 + this bounds the rounding of the screening product in :func:`maxmin_dense` (see there)
_SCREEN_SLACK = 1e-12
# columns a full round of :func:`maxmin_dense` keeps, smallest shares first, as the next
# rounds' screening guesses
_GUESSES = 16


@njit(cache=True, error_model="numpy", inline="always")
def _take_row(rows, ra, best, nc, used, demand):  # pragma: no cover - numba
    """A frozen flow of route rows[ra] at rate ``best``: its share added to ``used`` and its
    coefficients taken out of ``demand``, column by column."""
    for q in range(nc):
        used[q] += best * rows[ra, q]
        demand[q] -= rows[ra, q]


@njit(cache=True, error_model="numpy")
def maxmin_dense(
    row, slot, nf, rows, hit, cap, total, rates, used, demand, share, left, work, mask
):  # pragma: no cover - numba
    """:func:`maxmin_rates` of ``nf`` active flows whose routes are dense rows.

    row: [>= nf] int64, the route of active flow a is rows[row[a]] (a in the order of the
    sparse kernel's ``active``); rows: [F, C] float64 coefficients over the C compact columns
    (0.0 where a route does not go), columns in increasing resource id; slot: [>= nf] int64
    distinct slots < S8 of the active flows; hit: [C, S8] uint8 with S8 a multiple of 8,
    hit[c, slot[a]] = 1 where rows[row[a], c] > 0, 0 there otherwise and in every slot that
    no active flow holds (the active part of the matrix, transposed and small enough to stay
    in cache); cap: [C]; total: [C] the in-order sum of the active rows
    from 0.0 (:func:`add_rows`). Writes rates[a] and used[c]. Work arrays (any contents):
    demand, share [C]; left [>= nf] int64; work [S8 + nf + C + 24] int64; mask [C8] uint8
    with C8 >= C a multiple of 8 whose entries past C are 0.

    Same operations and results as the sparse kernel: demand starts as the in-order sum of the
    active rows; each round finds the smallest fair share (cap - used) / demand over the
    columns with demand above the threshold, then, in increasing column order, every column
    within 1e-9 of it freezes its unfrozen flows in order, adding their rows to used and
    removing them from demand. A column a route skips receives ``+ best * 0.0`` and ``- 0.0``,
    which change no value (used is never -0.0).

    Two shortcuts leave those values alone. (1) Screening: a round that computes every share
    keeps the ``_GUESSES`` columns with the smallest shares above the threshold; a later round
    takes the exact share T of the first of them still in use (or of a column it computed just
    behind the minimum), and computes the exact share only of the columns that a
    multiplication cannot prove to be above
    T' = T (1 + 1e-9) + 1e-300 (which bounds the threshold: the minimum is <= T); every other
    column is neither the minimum nor within the threshold. The proof: with P = (T' d)(1 + 1e-12)
    rounded twice, cap - used > P gives (cap - used) / d > T' (1 + 1e-12 - 3 eps), so its
    rounded quotient exceeds T'. Used for 1e-280 < T < 1e280 (no underflow), else the round
    computes every share. (2) A saturated column with at most ``_NARROW`` active flows finds
    them in ``hit`` and freezes them in flow order, instead of testing every unfrozen flow.
    """
    nc = cap.shape[0]
    s8 = hit.shape[1]
    hw = hit.reshape(-1).view(np.uint64)  # 8 slots per word
    mw = mask.view(np.uint64)
    w_per_col = s8 // 8
    pos = work[:s8]  # slot -> position of its flow
    frozen = work[s8 : s8 + nf]
    cand = work[s8 + nf : s8 + nf + nc]  # columns whose share was computed this round
    few = work[s8 + nf + nc : s8 + nf + nc + _NARROW]
    guesses = work[s8 + nf + nc + _NARROW : s8 + nf + nc + _NARROW + _GUESSES]
    gshare = np.empty(_GUESSES)
    nguess = 0
    iguess = 0
    for c in range(nc):
        used[c] = 0.0
        demand[c] = total[c]
    for a in range(nf):
        left[a] = a
        frozen[a] = 0
        pos[slot[a]] = a
    nleft = nf  # entries of left: the unfrozen flows in order (plus some already frozen)
    todo = nf  # unfrozen flows
    guess = -1  # a column just behind the last minimum, or -1
    while todo > 0:
        while guess < 0 and iguess < nguess:  # next kept column still in use
            if demand[guesses[iguess]] > _EPS_DEMAND:
                guess = guesses[iguess]
            iguess += 1
        t = np.inf
        if guess >= 0 and demand[guess] > _EPS_DEMAND:
            t = (cap[guess] - used[guess]) / demand[guess]
        ncand = 0
        full = not 1e-280 < t < 1e280
        if not full:
            tp = t * (1.0 + 1e-9) + 1e-300
            for c in range(nc):
                d = demand[c]
                mask[c] = (d > _EPS_DEMAND) & (cap[c] - used[c] <= tp * d * (1.0 + _SCREEN_SLACK))
            mask[guess] = 1
            best = np.inf
            for w in range(mw.shape[0]):
                if mw[w] == 0:
                    continue
                for c in range(8 * w, 8 * w + 8):
                    if mask[c]:
                        x = (cap[c] - used[c]) / demand[c]
                        share[c] = x
                        cand[ncand] = c
                        ncand += 1
                        if x < best:
                            best = x
        else:
            for c in range(nc):
                d = demand[c]
                x = (cap[c] - used[c]) / d
                share[c] = x if d > _EPS_DEMAND else np.inf
            best = _min(share, nc)
            if best == np.inf:  # flows that touch no capacity: should not exist
                for i in range(nleft):
                    if not frozen[left[i]]:
                        rates[left[i]] = np.inf
                break
            for c in range(nc):
                if share[c] < np.inf:
                    cand[ncand] = c
                    ncand += 1
        if best < 0.0:
            best = 0.0
        thr = best * (1.0 + 1e-9) + 1e-300
        guess = -1
        next_share = np.inf
        if full:
            nguess = iguess = 0
        for i in range(ncand):
            c = cand[i]
            x = share[c]
            if not x <= thr:
                if full:  # keep the smallest shares, sorted
                    if nguess < _GUESSES or x < gshare[nguess - 1]:
                        j = nguess if nguess < _GUESSES else _GUESSES - 1
                        while j > 0 and gshare[j - 1] > x:
                            gshare[j] = gshare[j - 1]
                            guesses[j] = guesses[j - 1]
                            j -= 1
                        gshare[j] = x
                        guesses[j] = c
                        if nguess < _GUESSES:
                            nguess += 1
                elif x < next_share:
                    next_share = x
                    guess = c
                continue
            # the active flows of column c: few -> from hit, else by a pass over left
            nhit = 0
            for w in range(c * w_per_col, (c + 1) * w_per_col):
                if hw[w] == 0:
                    continue
                s0 = (w - c * w_per_col) * 8
                for sl in range(s0, s0 + 8):
                    if hit[c, sl]:
                        if nhit < _NARROW:
                            few[nhit] = pos[sl]
                        nhit += 1
                if nhit > _NARROW:
                    break
            if nhit <= _NARROW:
                m = 0
                for k in range(nhit):
                    a = few[k]
                    if frozen[a]:
                        continue
                    j = m  # insertion sort: flow order
                    while j > 0 and few[j - 1] > a:
                        few[j] = few[j - 1]
                        j -= 1
                    few[j] = a
                    m += 1
                for k in range(m):
                    a = few[k]
                    frozen[a] = 1
                    todo -= 1
                    rates[a] = best
                    _take_row(rows, row[a], best, nc, used, demand)
            else:
                k = 0
                for i2 in range(nleft):  # the unfrozen flows, in order
                    a = left[i2]
                    if frozen[a]:
                        continue
                    if hit[c, slot[a]]:
                        frozen[a] = 1
                        todo -= 1
                        rates[a] = best
                        _take_row(rows, row[a], best, nc, used, demand)
                    else:
                        left[k] = a
                        k += 1
                nleft = k
            demand[c] = 0.0


@njit(cache=True)
def _columns(ptr, res, num_res):  # pragma: no cover - numba
    """(sorted resource ids that some route touches, column of every entry, whether some route
    lists a resource twice)."""
    seen = np.full(num_res, -1, np.int64)
    dup = False
    for f in range(ptr.shape[0] - 1):
        for j in range(ptr[f], ptr[f + 1]):
            r = res[j]
            if seen[r] == f:
                dup = True
            seen[r] = f
    col = np.full(num_res, -1, np.int64)
    nc = 0
    for r in range(num_res):
        if seen[r] >= 0:
            col[r] = nc
            nc += 1
    cols = np.empty(nc, np.int64)
    for r in range(num_res):
        if col[r] >= 0:
            cols[col[r]] = r
    cres = np.empty(res.shape[0], np.int64)
    for j in range(res.shape[0]):
        cres[j] = col[res[j]]
    return cols, cres, dup


class FlowTable:
    """Append-only store of flows (size + route) as CSR arrays for :func:`maxmin_rates`."""

    def __init__(self) -> None:
        self._len: list[int] = []
        self._res: list[np.ndarray] = []
        self._coef: list[np.ndarray] = []
        self._size: list[float] = []
        self._arrays: tuple | None = None
        self._columns: tuple | None = None

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
        self._arrays = self._columns = None
        return len(self._size) - 1

    def add_filtered(self, size: float, res: np.ndarray, coef: np.ndarray) -> int:
        """:meth:`add` of a route already filtered: ``res`` int64, ``coef`` float64, all > 0."""
        if not res.shape[0]:
            raise ValueError("a flow needs at least one resource on its route")
        self._res.append(res)
        self._coef.append(coef)
        self._len.append(res.shape[0])
        self._size.append(float(size))
        self._arrays = self._columns = None
        return len(self._size) - 1

    def __len__(self) -> int:
        return len(self._size)

    def copy(self, coef: np.ndarray | None = None) -> FlowTable:
        """A table of the same flows with a coefficient array of its own: ``coef`` (as
        :meth:`arrays` returns it, e.g. a copy taken before this table's were patched in place)
        or a copy of this table's. The other arrays, which nothing modifies, are shared, so
        runs of either table see the same ones."""
        new = FlowTable()
        new._len, new._res, new._coef = list(self._len), list(self._res), list(self._coef)
        new._size = list(self._size)
        ptr, res, own, size = self.arrays()
        new._arrays = (ptr, res, (own if coef is None else coef).copy(), size)
        new._columns = self._columns
        return new

    def arrays(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """(ptr, res, coef, size) as numpy arrays (cached until the next :meth:`add`; callers
        may patch ``coef`` in place, see
        :meth:`sim.core.transfer.TransferBuilder.retime_engine`)."""
        if self._arrays is None:
            self._arrays = self._build_arrays()
        return self._arrays

    def columns(self) -> tuple[np.ndarray, np.ndarray, bool]:
        """(cols, cres, dup) for :func:`maxmin_dense`: the sorted resource ids that some flow
        touches, the column (index into cols) of every route entry, and whether some route lists
        one resource twice (then only the sparse kernel reproduces its sums). Cached until the
        next :meth:`add`."""
        if self._columns is None:
            ptr, res, _, _ = self.arrays()
            num_res = int(res.max()) + 1 if res.shape[0] else 0
            self._columns = _columns(ptr, res, num_res)
        return self._columns

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
