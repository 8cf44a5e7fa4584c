"""Max-min fair solver (sim.core.flows) in isolation: closed forms and the optimality condition."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sim.core.flows import FlowTable, solve


def _table(routes):
    ft = FlowTable()
    for r in routes:
        ft.add(1.0, r)
    ptr, res, coef, _ = ft.arrays()
    return ptr, res, coef


def test_one_flow_one_resource():
    ptr, res, coef = _table([{0: 2.0}])
    rates, used = solve([0], ptr, res, coef, np.array([10.0]))
    assert rates[0] == pytest.approx(5.0)
    assert used[0] == pytest.approx(10.0)


def test_classic_maxmin_example():
    # link 0 (cap 1) carries flows a, b; link 1 (cap 2) carries b, c.
    # max-min: a = b = 0.5 (link 0 bottleneck), c = 1.5.
    ptr, res, coef = _table([{0: 1.0}, {0: 1.0, 1: 1.0}, {1: 1.0}])
    rates, used = solve([0, 1, 2], ptr, res, coef, np.array([1.0, 2.0]))
    np.testing.assert_allclose(rates, [0.5, 0.5, 1.5])
    np.testing.assert_allclose(used, [1.0, 2.0])


def test_protocol_coefficients_share_a_direction():
    # push-like flow a->b uses 1.19 on a.tx and 0.02 on b.tx; the reverse flow mirrors it
    ptr, res, coef = _table([{0: 1.19, 1: 0.02}, {1: 1.19, 0: 0.02}])
    rates, _ = solve([0, 1], ptr, res, coef, np.array([436.0, 436.0]))
    np.testing.assert_allclose(rates, [436.0 / 1.21, 436.0 / 1.21])


def test_inactive_flows_are_ignored():
    ptr, res, coef = _table([{0: 1.0}, {0: 1.0}])
    rates, _ = solve([1], ptr, res, coef, np.array([3.0]))
    assert rates[0] == pytest.approx(3.0)


@settings(max_examples=60, deadline=None)
@given(
    st.integers(1, 6).flatmap(
        lambda nres: st.tuples(
            st.lists(st.floats(0.5, 100.0), min_size=nres, max_size=nres),
            st.lists(
                st.dictionaries(st.integers(0, nres - 1), st.floats(0.05, 3.0), min_size=1),
                min_size=1,
                max_size=8,
            ),
        )
    )
)
def test_maxmin_is_feasible_and_every_flow_has_a_bottleneck(case):
    caps, routes = case
    cap = np.array(caps)
    ptr, res, coef = _table(routes)
    rates, used = solve(list(range(len(routes))), ptr, res, coef, cap)
    assert np.all(rates > 0)
    load = np.zeros_like(cap)
    for f, r in enumerate(routes):
        for k, c in r.items():
            load[k] += c * rates[f]
    np.testing.assert_allclose(load, used, rtol=1e-9, atol=1e-9)
    assert np.all(load <= cap * (1 + 1e-7))
    # max-min condition: each flow crosses a saturated resource on which no flow is faster
    for f, r in enumerate(routes):
        ok = False
        for k in r:
            if load[k] >= cap[k] * (1 - 1e-6):
                others = [rates[g] for g, rr in enumerate(routes) if k in rr]
                if rates[f] >= max(others) * (1 - 1e-6):
                    ok = True
        assert ok, f"flow {f} has no bottleneck"
