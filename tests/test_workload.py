import re

import numpy as np
import pytest

from mok.spec.workload import (
    PRESETS,
    SKEW_SYNTAX,
    ModelShape,
    RoutingTrace,
    Skew,
    get_shape,
    imbalance,
    make_routing,
)


def _distinct_rows(idx: np.ndarray) -> bool:
    s = np.sort(idx, axis=1)
    return bool((s[:, 1:] != s[:, :-1]).all())


def test_presets_match_design_table():
    want = {
        "deepseek-v3": (256, 7168, 2048, 8),
        "kimi-k2": (384, 7168, 2048, 8),
        "qwen3-30b-a3b": (128, 2048, 768, 8),
        "qwen3-235b-a22b": (128, 4096, 1536, 8),
        "glm-4.5": (160, 5120, 1536, 8),
        "gpt-oss-120b": (128, 2880, 2880, 4),
    }
    for name, dims in want.items():
        s = get_shape(name)
        assert (s.num_experts, s.hidden, s.intermediate, s.num_topk) == dims
    assert "tiny" in PRESETS


def test_unknown_shape_and_bad_shape():
    with pytest.raises(ValueError, match="unknown model shape 'nope'"):
        get_shape("nope")
    with pytest.raises(ValueError, match="num_topk=9 exceeds num_experts=8"):
        ModelShape("x", 8, 16, 16, 9)


@pytest.mark.parametrize("skew", ["uniform", "zipf:1.2", "hot:0.5", "hot:0.3:2", "zipf:1.0@0.5"])
def test_routing_distinct_in_range_and_seeded(skew):
    a = make_routing(500, 64, 8, num_ranks=4, skew=skew, seed=3)
    b = make_routing(500, 64, 8, num_ranks=4, skew=skew, seed=3)
    c = make_routing(500, 64, 8, num_ranks=4, skew=skew, seed=4)
    assert a.topk_idx.shape == (2000, 8) and a.topk_idx.dtype == np.int64
    assert _distinct_rows(a.topk_idx)
    assert a.topk_idx.min() >= 0 and a.topk_idx.max() < 64
    np.testing.assert_allclose(a.topk_weights.sum(axis=1), 1.0, rtol=1e-5)
    assert np.array_equal(a.topk_idx, b.topk_idx) and np.array_equal(a.topk_weights, b.topk_weights)
    assert not np.array_equal(a.topk_idx, c.topk_idx)


def test_extreme_zipf_still_distinct():
    t = make_routing(300, 32, 8, skew="zipf:6", seed=0)
    assert _distinct_rows(t.topk_idx)


def test_hot_expert_takes_its_share():
    t = make_routing(20000, 64, 8, skew="hot:0.5", seed=0)
    share = np.mean((t.topk_idx == 63).any(axis=1))
    assert abs(share - 0.5) < 0.02
    m = imbalance(t)
    # The hot expert gets ~0.5 of tokens vs 8/64 on average: max/mean ~ 0.5 / (8/64) = 4.
    assert 3.5 < m["expert_max_over_mean"] < 4.5


def test_uniform_is_balanced_and_zipf_is_not():
    u = imbalance(make_routing(20000, 64, 8, num_ranks=8, seed=0))
    z = imbalance(make_routing(20000, 64, 8, num_ranks=8, skew="zipf:1.2", seed=0))
    assert u["expert_max_over_mean"] < 1.1
    assert z["expert_max_over_mean"] > 3
    # 1/8 of rows stay on the token's own rank when routing is uniform over 8 ranks.
    assert abs(u["remote_fraction"] - 7 / 8) < 0.01


def test_rank_correlation_changes_per_rank_preference():
    t = make_routing(4000, 64, 4, num_ranks=2, skew="zipf:1.5@1.0", seed=0)
    top = [np.bincount(t.rank_slice(r)[0].ravel(), minlength=64).argmax() for r in range(2)]
    assert top[0] != top[1]


def test_skew_parse_and_errors():
    assert Skew.parse("zipf:1.5@0.25") == Skew("zipf", alpha=1.5, rank_correlation=0.25)
    assert Skew.parse("hot:0.4:3").hot_experts == 3
    assert Skew.parse("hot:0.4:3").label() == "hot:0.4:3"
    with pytest.raises(ValueError, match="cannot parse skew 'zipf'"):
        Skew.parse("zipf")
    with pytest.raises(ValueError, match="hot_share must be in"):
        Skew("hot", hot_share=1.5)
    with pytest.raises(ValueError, match="unknown skew kind"):
        Skew("lognormal")


def test_trace_roundtrip_and_no_pickle(tmp_path):
    t = make_routing(100, 16, 4, num_ranks=2, skew="zipf:1.1", seed=5)
    p = tmp_path / "trace.npz"
    t.save(p)
    u = RoutingTrace.load(p)
    assert np.array_equal(u.topk_idx, t.topk_idx)
    assert np.array_equal(u.topk_weights, t.topk_weights)
    assert (u.num_experts, u.num_ranks, u.meta["skew"]) == (16, 2, "zipf:1.1")
    bad = tmp_path / "bad.npz"
    np.savez(bad, topk_idx=np.array([object()], dtype=object), meta_json=np.array("{}"))
    with pytest.raises(ValueError, match="pickle"):
        RoutingTrace.load(bad)


def test_zero_and_one_tokens():
    for n in (0, 1):
        for skew in ("uniform", "zipf:1.2@0.5", "hot:0.5:2"):
            t = make_routing(n, 16, 4, num_ranks=3, skew=skew, seed=1)
            assert t.topk_idx.shape == t.topk_weights.shape == (3 * n, 4)
            assert t.topk_idx.dtype == np.int64 and t.topk_weights.dtype == np.float32
            assert t.num_tokens == n and t.per_rank().shape == (3, n, 4)


def test_hot_routing_needs_room_for_the_cold_slots():
    # every token that skips the hot experts draws num_topk distinct cold ones
    t = make_routing(200, 8, 4, skew="hot:1.0:4", seed=0)
    assert _distinct_rows(t.topk_idx) and (t.topk_idx >= 4).any(axis=1).all()
    with pytest.raises(ValueError, match=r"'hot:0.5:5' needs hot_experts \+ num_topk <= num_ex"):
        make_routing(10, 8, 4, skew="hot:0.5:5")
    with pytest.raises(ValueError, match=r"\(4 \+ 1 > 4\)"):
        make_routing(10, 4, 1, skew="hot:0.5:4")


@pytest.mark.parametrize(
    ("spec", "why"),
    [
        ("zipf:nan", "skew alpha must be a finite number (found nan)"),
        ("zipf:inf", "skew alpha must be a finite number (found inf)"),
        ("zipf:-0.5", "zipf alpha must be >= 0 (found -0.5)"),
        ("hot:nan", "skew hot_share must be a finite number (found nan)"),
        ("hot:0.5:0", "hot_experts must be >= 1 (found 0)"),
        ("uniform@nan", "skew rank_correlation must be a finite number (found nan)"),
        ("zipf:1@x", "could not convert string to float: 'x'"),
    ],
)
def test_skew_specs_with_bad_numbers_name_the_spec(spec, why):
    match = re.escape(f"cannot parse skew {spec!r}: {why}; supported: {SKEW_SYNTAX}")
    with pytest.raises(ValueError, match=match):
        Skew.parse(spec)
    with pytest.raises(ValueError, match=match):
        make_routing(10, 16, 2, skew=spec)


def test_skew_fields_must_be_finite_numbers():
    with pytest.raises(ValueError, match=r"skew alpha must be a finite number \(found nan\)"):
        Skew("zipf", alpha=float("nan"))
    with pytest.raises(ValueError, match=r"skew hot_share must be a finite number \(found '0.5'\)"):
        Skew("hot", hot_share="0.5")
    with pytest.raises(ValueError, match=r"hot_experts must be an integer \(found 1.0\)"):
        Skew("hot", hot_experts=1.0)
    with pytest.raises(ValueError, match=r"a skew spec must be a string \(found int 3\)"):
        Skew.parse(3)


def test_aligned_routing_gives_every_expert_the_same_rows():
    import numpy as np

    for experts, topk, ranks in ((128, 8, 1), (256, 8, 2), (64, 8, 1), (384, 8, 2)):
        t = make_routing(4096, experts, topk, ranks, "aligned", seed=3)
        counts = np.bincount(t.topk_idx.ravel(), minlength=experts)
        rows = 4096 * ranks * topk
        assert counts.sum() == rows and counts.max() - counts.min() <= 1
        if rows % experts == 0:
            assert counts.min() == rows // experts
        assert all(len(set(row)) == topk for row in t.topk_idx.tolist())
        np.testing.assert_allclose(t.topk_weights.sum(1), 1.0, rtol=1e-6)
    assert Skew.parse("aligned").label() == "aligned"
    with pytest.raises(ValueError, match="no per-rank correlation"):
        Skew.parse("aligned@0.5")
