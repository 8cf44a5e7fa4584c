"""The simulator's fast paths give the bits of the plain ones.

* the dense max-min kernel (:func:`sim.core.flows.maxmin_dense`) against the sparse one
  (:func:`sim.core.flows.maxmin_rates`), on random problems and inside the event loop;
* a ring-size variant copied from a build (:meth:`sim.layer.model.LayerBuilder.for_ring`)
  against a fresh build of it, and the sweep that uses it against one simulation per config;
* the successor lists the event loop caches on a graph, the comm-free run, the per-phase sums
  over phase codes and the compiled dedup round counts, against the constructions they
  replaced.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import sim.core.engine as engine
from sim.config import SimConfig, Workload
from sim.core.engine import DELAY, TRANSFER, Graph, run_graph
from sim.core.flows import FlowTable, add_rows, maxmin_dense, solve
from sim.layer.model import LayerBuilder, plan_for, simulate, simulate_many
from sim.layer.plan import _dedup_rounds
from sim.layer.results import COMPUTE_PHASES, PHASE_CATEGORY, comm_free_run

TINY = Workload("tiny", 256, 8, "hgx-h200", "uniform", seed=1)
CFG = SimConfig(minibatch_size=256, macrobatch_size=512, num_comm_sms=16)
GRAPH_LISTS = ("kind", "duration", "deps", "flow_lo", "flow_hi", "rank", "phase", "round")
GRAPH_LISTS += ("payload_bytes",)


def dense_solve(active, ptr, res, coef, cap, slot_of=None):
    """:func:`maxmin_dense` set up as the event loop does: (rates, used over every resource)."""
    cols = np.unique(res)
    col = np.full(cap.shape[0], -1)
    col[cols] = np.arange(cols.shape[0])
    nc, nflows = cols.shape[0], ptr.shape[0] - 1
    rows = np.zeros((nflows, nc))
    for f in range(nflows):
        rows[f, col[res[ptr[f] : ptr[f + 1]]]] = coef[ptr[f] : ptr[f + 1]]
    nf = len(active)
    slots = np.arange(nf) if slot_of is None else np.asarray(slot_of)
    s8 = -(-(int(slots.max()) + 1 if nf else 1) // 8) * 8
    hit = np.zeros((nc, s8), np.uint8)
    for a, f in enumerate(active):
        hit[:, slots[a]] = rows[f] > 0
    act = np.asarray(active, dtype=np.int64)
    total = np.zeros(nc)
    add_rows(act, 0, nf, rows, total)
    rates, used = np.zeros(nf), np.zeros(nc)
    maxmin_dense(
        act,
        slots.astype(np.int64),
        nf,
        rows,
        hit,
        np.asarray(cap, dtype=np.float64)[cols],
        total,
        rates,
        used,
        np.empty(nc),
        np.empty(nc),
        np.empty(max(nf, 1), np.int64),
        np.empty(s8 + nf + nc + 24, np.int64),
        np.zeros(-(-nc // 8) * 8, np.uint8),
    )
    full = np.zeros(cap.shape[0])
    full[cols] = used
    return rates, full


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_dense_kernel_gives_the_bits_of_the_sparse_one(data):
    nres = data.draw(st.integers(1, 12))
    nflows = data.draw(st.integers(1, 14))
    # few distinct values make ties (several columns saturating in one round) common
    value = st.sampled_from([0.25, 0.5, 1.0, 1.0 / 3.0, 2.0, 3.0, 1e-3, 7.5])
    cap = np.array(data.draw(st.lists(value, min_size=nres, max_size=nres)))
    table = FlowTable()
    for _ in range(nflows):
        rs = data.draw(st.lists(st.integers(0, nres - 1), min_size=1, max_size=nres, unique=True))
        cs = data.draw(st.lists(value, min_size=len(rs), max_size=len(rs)))
        table.add(1.0, (np.array(rs), np.array(cs)))
    ptr, res, coef, _ = table.arrays()
    active = data.draw(st.permutations(range(nflows)))[: data.draw(st.integers(1, nflows))]
    slots = data.draw(st.permutations(range(len(active) + 5)))[: len(active)]
    want_rates, want_used = solve(active, ptr, res, coef, cap)
    rates, used = dense_solve(active, ptr, res, coef, cap, slots)
    assert rates.tobytes() == want_rates.tobytes()
    assert used.tobytes() == want_used.tobytes()


def test_dense_kernel_on_many_rounds_and_narrow_columns():
    # one private column per flow at distinct levels (one round each) plus shared ports, more
    # flows than a narrow column holds on some ports
    rng = np.random.default_rng(3)
    nflows, nports = 40, 12
    table = FlowTable()
    for f in range(nflows):
        ports = rng.choice(nports, size=rng.integers(1, nports), replace=False)
        res = np.concatenate(([nports + f], ports))
        table.add(1.0, (res, np.concatenate(([1.0 / (f + 1)], rng.uniform(0.01, 0.2, len(ports))))))
    cap = np.concatenate((rng.uniform(1.0, 3.0, nports), np.ones(nflows)))
    ptr, res, coef, _ = table.arrays()
    active = list(rng.permutation(nflows))
    want = solve(active, ptr, res, coef, cap)
    got = dense_solve(active, ptr, res, coef, cap)
    assert all(a.tobytes() == b.tobytes() for a, b in zip(want, got, strict=True))


@pytest.mark.parametrize("dispatch", ["push", "pull", "dedup_pull"])
@pytest.mark.parametrize("granularity", ["round", "peer"])
def test_event_loop_is_the_same_with_either_kernel(dispatch, granularity, monkeypatch):
    cfg = CFG.replace(dispatch_mode=dispatch, flow_granularity=granularity)
    b = LayerBuilder(TINY, cfg, plan_for(TINY))
    g = b.build()
    caps = b.topo.capacities(b.gpu)
    runs = []
    for fill in (0.0, 2.0):  # every graph dense, every graph sparse
        monkeypatch.setattr(engine, "DENSE_MIN_FILL", fill)
        runs.append(run_graph(g, caps, record_series=True))
    a, s = runs
    for x, y in (
        (a.start_us, s.start_us),
        (a.end_us, s.end_us),
        (a.crit_pred, s.crit_pred),
        (a.resource_bytes, s.resource_bytes),
    ):
        assert x.tobytes() == y.tobytes()
    assert (a.num_events, a.num_solves) == (s.num_events, s.num_solves)
    assert all(
        ta == tb and ua.tobytes() == ub.tobytes()
        for (ta, ua), (tb, ub) in zip(a.link_series, s.link_series, strict=True)
    )


def test_dense_rows_grow_past_their_first_slots(monkeypatch):
    # one flow per peer: far more than the 64 first slots are active at once
    wl = Workload("tiny", 256, 16, "hgx-h200x2", seed=2)
    b = LayerBuilder(wl, CFG.replace(dispatch_mode="push", flow_granularity="peer"), plan_for(wl))
    g = b.build()
    caps = b.topo.capacities(b.gpu)
    runs = []
    for fill in (2.0, 0.0):
        monkeypatch.setattr(engine, "DENSE_MIN_FILL", fill)
        runs.append(run_graph(g, caps))
    ref, dense = runs
    assert dense.end_us.tobytes() == ref.end_us.tobytes()
    assert dense.resource_bytes.tobytes() == ref.resource_bytes.tobytes()


def _same_graph(a: Graph, b: Graph) -> None:
    for name in GRAPH_LISTS:
        x, y = getattr(a, name), getattr(b, name)
        assert x == y, name
        assert [type(v) for v in x] == [type(v) for v in y], name
    for x, y in zip(a.flows.arrays(), b.flows.arrays(), strict=True):
        assert x.dtype == y.dtype and x.tobytes() == y.tobytes()


@pytest.mark.parametrize(
    "dispatch, combine",
    [
        ("push", "push"),
        ("push", "pull"),
        ("pull", "push"),
        ("pull", "pull"),
        ("dedup_pull", "push"),
    ],
)
def test_ring_variant_copy_is_a_fresh_build(dispatch, combine):
    wl = Workload("tiny", 1024, 8, "hgx-h200", "zipf:1.2", seed=4)
    plan = plan_for(wl)
    base = CFG.replace(dispatch_mode=dispatch, combine_mode=combine, num_comm_sms=8)
    first = LayerBuilder(wl, base, plan)
    first.build()
    first.retime(32)  # a copy starts from the build, whatever the template was retimed to
    for slots in (1, 2, 3, 5, 64):
        cfg = base.replace(macrobatch_size=base.minibatch_size * slots)
        assert first.can_share_with(cfg)
        copied = first.for_ring(cfg)
        fresh = LayerBuilder(wl, cfg, plan)
        fresh.build()
        _same_graph(copied.g, fresh.g)
        assert copied._ffn == fresh._ffn and copied._fences == fresh._fences
        assert copied.payload_bytes == fresh.payload_bytes and copied.cfg == cfg
        copied.retime(24)
        fresh.retime(24)
        _same_graph(copied.g, fresh.g)
    assert not first.can_share_with(base.replace(minibatch_size=512, macrobatch_size=1024))
    assert not first.can_share_with(base.replace(minibatch_size=1024, macrobatch_size=1024))
    with pytest.raises(ValueError, match="not a ring variant"):
        first.for_ring(base.replace(num_comm_sms=16))


def test_sweep_with_shared_builds_equals_one_build_per_group():
    # simulate_many builds the first config of each group of comm-SM variants and retimes the
    # rest (a retimed graph is not bitwise a fresh build); a group that copies another's build
    # must give what its own build gives
    plan = plan_for(TINY)
    cfgs = [
        CFG.replace(dispatch_mode=d, combine_mode=c, num_comm_sms=n, macrobatch_size=256 * r)
        for d, c in (("push", "pull"), ("pull", "push"))
        for r in (1, 2, 4)
        for n in (8, 24)
    ]
    shared = list(simulate_many(TINY, cfgs, plan))
    for i in range(0, len(cfgs), 2):
        alone = list(simulate_many(TINY, cfgs[i : i + 2], plan))
        for got, one in zip(shared[i : i + 2], alone, strict=True):
            assert got.config == one.config
            assert got.layer_us == one.layer_us
            assert got.link_bytes.tobytes() == one.link_bytes.tobytes()
            assert got.run.end_us.tobytes() == one.run.end_us.tobytes()
            assert (got.num_events, got.num_solves) == (one.num_events, one.num_solves)
    assert shared[2].layer_us == pytest.approx(simulate(TINY, cfgs[2], plan).layer_us, rel=1e-12)


def _successors_by_sort(graph: Graph):
    n = len(graph)
    indeg = np.array([len(d) for d in graph.deps], dtype=np.int64)
    src = np.repeat(np.arange(n, dtype=np.int64), indeg)
    dst = np.array([x for d in graph.deps for x in d], dtype=np.int64)
    order = np.argsort(dst, kind="stable")
    ptr = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(np.bincount(dst, minlength=n), out=ptr[1:])
    return ptr, src[order], indeg


def test_cached_structure_matches_a_sort_and_follows_new_tasks():
    g = Graph()
    a = g.delay(1.0)
    b = g.delay(2.0, [a, a, None])  # a dependency listed twice counts twice
    c = g.join([b, a])
    _, ptr, idx, indeg = g.structure()
    for x, y in zip((ptr, idx, indeg), _successors_by_sort(g), strict=True):
        assert np.array_equal(x, y)
    g.add_dep(c, b)
    d = g.delay(0.5, [c])
    _, ptr, idx, indeg = g.structure()
    assert len(indeg) == d + 1
    for x, y in zip((ptr, idx, indeg), _successors_by_sort(g), strict=True):
        assert np.array_equal(x, y)
    layer = LayerBuilder(TINY, CFG.replace(dispatch_mode="push"), plan_for(TINY))
    layer.build()
    for x, y in zip(layer.g.structure()[1:], _successors_by_sort(layer.g), strict=True):
        assert np.array_equal(x, y)


def test_comm_free_run_is_the_graph_with_free_transfers():
    b = LayerBuilder(TINY, CFG.replace(combine_mode="pull"), plan_for(TINY))
    g = b.build()
    free = comm_free_run(g)
    ref = Graph()  # the construction the comm-free run replaced
    ref.kind = [DELAY if k == TRANSFER else k for k in g.kind]
    ref.duration = [0.0 if k == TRANSFER else d for k, d in zip(g.kind, g.duration, strict=True)]
    ref.deps = g.deps
    ref.flow_lo = ref.flow_hi = [0] * len(g)
    ref.rank, ref.phase, ref.round, ref.payload_bytes = g.rank, g.phase, g.round, g.payload_bytes
    want = run_graph(ref, np.ones(1))
    assert free.start_us.tobytes() == want.start_us.tobytes()
    assert free.end_us.tobytes() == want.end_us.tobytes()
    assert free.crit_pred.tobytes() == want.crit_pred.tobytes()
    assert free.num_events == want.num_events


def test_flow_table_copy_owns_its_coefficients():
    t = FlowTable()
    t.add(2.0, {0: 1.0, 3: 0.5})
    t.add(1.0, {1: 2.0})
    _, _, coef, _ = t.arrays()
    saved = coef.copy()
    coef[0] = 9.0  # patched in place, as a retime does
    c = t.copy(saved)
    assert c.arrays()[2].tolist() == saved.tolist() and t.arrays()[2][0] == 9.0
    c.arrays()[2][1] = 7.0
    assert t.arrays()[2][1] == saved[1]
    assert len(c) == len(t) and c.columns()[0].tolist() == [0, 1, 3]


def _dedup_rounds_by_sort(dest, rnd, src, max_rounds, num_ranks):
    """The numpy construction that :func:`sim.layer.plan._dedup_rounds` replaced."""
    key = np.sort(dest * max_rounds + rnd, axis=1)
    d, r = np.divmod(key, max_rounds)
    start = np.ones(key.shape, dtype=bool)
    start[:, 1:] = d[:, 1:] != d[:, :-1]
    stop = np.ones(key.shape, dtype=bool)
    stop[:, :-1] = start[:, 1:]
    s = np.broadcast_to(src[:, None], key.shape)
    size = num_ranks * max_rounds * num_ranks
    first = np.bincount(((d * max_rounds + r) * num_ranks + s)[start], minlength=size)
    last = np.bincount(((d * max_rounds + r) * num_ranks + s)[stop], minlength=size)
    return first.astype(np.int64), last.astype(np.int64)


@settings(max_examples=100, deadline=None)
@given(st.data())
def test_dedup_round_counts_match_a_sort(data):
    nr, rounds = data.draw(st.integers(1, 5)), data.draw(st.integers(1, 4))
    n, k = data.draw(st.integers(0, 12)), data.draw(st.integers(1, 6))

    def ints(hi, count):
        return np.array(data.draw(st.lists(st.integers(0, hi - 1), min_size=count, max_size=count)))

    # few ranks and rounds: a token's k rows often share a destination, or a (dest, round)
    dest = ints(nr, n * k).reshape(n, k).astype(np.int64)
    rnd = ints(rounds, n * k).reshape(n, k).astype(np.int64)
    src = ints(nr, n).astype(np.int64)
    got = _dedup_rounds(dest, rnd, src, rounds, nr)
    want = _dedup_rounds_by_sort(dest, rnd, src, rounds, nr)
    for x, y in zip(got, want, strict=True):
        assert x.dtype == y.dtype and np.array_equal(x, y)


@pytest.mark.parametrize("combine", ["push", "pull"])
def test_phase_code_sums_match_string_masks(combine):
    r = simulate(TINY, CFG.replace(dispatch_mode="push", combine_mode=combine))
    g, run = r.graph, r.run
    phase, rank = np.asarray(g.phase), np.asarray(g.rank)
    dur = run.end_us - run.start_us
    busy = np.zeros(TINY.ep)
    for p in COMPUTE_PHASES:
        sel = phase == p
        np.add.at(busy, rank[sel], dur[sel])
    sel = phase == "reduce"
    done = np.zeros(TINY.ep)
    done[rank[sel]] = run.end_us[sel]
    sig = np.isin(phase, [p for p, c in PHASE_CATEGORY.items() if c == "signalling"])
    per = np.zeros(TINY.ep)
    np.add.at(per, rank[sig & (rank >= 0)], dur[sig & (rank >= 0)])
    assert r.compute_busy_us.tobytes() == busy.tobytes()
    assert r.rank_done_us.tobytes() == done.tobytes()
    assert r.signalling_per_rank() == (float(per.mean()), float(per.max()))
    assert not g.phase_mask(("no such phase",)).any()
