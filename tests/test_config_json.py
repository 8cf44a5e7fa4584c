"""MoKConfig.from_json: every malformed source raises MoKConfigError (never another exception
type), and random valid configs round-trip through to_json / to_dict / a file."""

from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, fields
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mok.errors import MoKConfigError
from mok.spec.config import COMBINE_MODES, DISPATCH_MODES, MAX_COMM_SMS, ROW_ORDERS, MoKConfig

FIELDS = {f.name for f in fields(MoKConfig)}
GOOD = MoKConfig().to_dict()
# derandomize: the same examples on every run (reproducible CI)
PROPERTY = settings(max_examples=50, deadline=None, derandomize=True)

_positive = st.one_of(
    st.floats(min_value=0, exclude_min=True, allow_nan=False, allow_infinity=False),
    st.integers(1, 10**6),
)


@st.composite
def configs(draw) -> MoKConfig:
    """Random valid configs (the constraints of MoKConfig.__post_init__)."""
    dispatch = draw(st.sampled_from(DISPATCH_MODES))
    combine = "push" if dispatch == "dedup_pull" else draw(st.sampled_from(COMBINE_MODES))
    row_tile = 2 ** draw(st.integers(0, 10))
    minibatch = row_tile * draw(st.integers(1, 64))
    kw = {
        "dispatch_mode": dispatch,
        "combine_mode": combine,
        "num_comm_sms": draw(st.integers(1, MAX_COMM_SMS)),
        "num_comm_sms_bwd": draw(st.integers(1, MAX_COMM_SMS)),
        "row_tile": row_tile,
        "minibatch_size": minibatch,
        "macrobatch_size": draw(st.sampled_from([0, 1])) * minibatch * draw(st.integers(1, 8)),
        "capacity_factor": draw(_positive),
        "wait_timeout_ms": draw(_positive),
    }
    if "max_tokens" in FIELDS:
        kw["max_tokens"] = draw(st.integers(0, 2**40))
    kw["row_order"] = draw(st.sampled_from(ROW_ORDERS))
    kw["num_sms"] = draw(st.integers(0, 200))
    return MoKConfig(**kw)


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("config_json")


@pytest.fixture(scope="module")
def empty(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("config_json_empty")


@PROPERTY
@given(configs())
def test_round_trip(folder, c):
    assert MoKConfig.from_json(c.to_json()) == c
    assert MoKConfig.from_json(c.to_dict()) == c
    path = folder / "cfg.json"
    c.to_json(path)
    assert MoKConfig.from_json(path) == c
    assert MoKConfig.from_json(str(path)) == c


# values no field of its kind accepts
_not_a_mode = st.one_of(
    st.text(max_size=12).filter(lambda s: s not in DISPATCH_MODES + COMBINE_MODES + ROW_ORDERS),
    st.integers(),
    st.none(),
    st.floats(),
    st.lists(st.integers(), max_size=2),
)
_not_an_int = st.one_of(
    st.text(max_size=8),
    st.floats(),  # a float is not an int, even 24.0
    st.booleans(),
    st.none(),
    st.lists(st.integers(), max_size=2),
    st.dictionaries(st.text(max_size=3), st.integers(), max_size=2),
)
_not_a_positive_number = st.one_of(
    st.sampled_from([math.nan, math.inf, -math.inf]),
    st.floats(max_value=0),
    st.integers(max_value=0),
    st.integers(min_value=10**309, max_value=10**320),  # too large for a float
    st.text(max_size=8),
    st.booleans(),
    st.none(),
)
_BAD = {
    "dispatch_mode": _not_a_mode,
    "combine_mode": _not_a_mode,
    "num_comm_sms": st.one_of(_not_an_int, st.integers(max_value=0), st.integers(MAX_COMM_SMS + 1)),
    "num_comm_sms_bwd": st.one_of(_not_an_int, st.integers(max_value=0)),
    "minibatch_size": st.one_of(_not_an_int, st.integers(max_value=127)),
    "macrobatch_size": st.one_of(_not_an_int, st.integers(max_value=-1)),
    "row_tile": st.one_of(_not_an_int, st.sampled_from([0, -128, 3, 96, 100])),
    "capacity_factor": _not_a_positive_number,
    "wait_timeout_ms": _not_a_positive_number,
    "max_tokens": st.one_of(_not_an_int, st.integers(max_value=-1)),
    "row_order": _not_a_mode,
    "num_sms": st.one_of(_not_an_int, st.integers(max_value=-1)),
}


@PROPERTY
@given(
    st.sampled_from(sorted(FIELDS & set(_BAD))).flatmap(lambda k: st.tuples(st.just(k), _BAD[k]))
)
def test_a_bad_field_value_raises_config_error(case):
    name, value = case
    doc = {"format": GOOD["format"], "config": dict(GOOD["config"], **{name: value})}
    with pytest.raises(MoKConfigError, match="MoKConfig"):
        MoKConfig.from_json(doc)
    # the same as JSON text (json writes NaN / Infinity, and reads them back)
    with pytest.raises(MoKConfigError, match="MoKConfig"):
        MoKConfig.from_json(json.dumps(doc))


@PROPERTY
@given(
    st.text(min_size=1, max_size=12).filter(lambda k: k not in FIELDS),
    st.one_of(st.integers(), st.text(max_size=5), st.none()),
)
def test_unknown_keys_are_named(key, value):
    doc = {"format": GOOD["format"], "config": dict(GOOD["config"], **{key: value})}
    with pytest.raises(MoKConfigError, match=r"unknown MoKConfig keys \[") as e:
        MoKConfig.from_json(json.dumps(doc))
    assert repr(key) in str(e.value) and "supported: dispatch_mode" in str(e.value)
    top = dict(GOOD, **{f"x{key}": value})
    with pytest.raises(MoKConfigError, match=r"unknown top-level keys \["):
        MoKConfig.from_json(top)


_json = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(), st.floats(), st.text(max_size=8)),
    lambda inner: st.one_of(
        st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=6), inner, max_size=3)
    ),
    max_leaves=8,
)


@PROPERTY
@given(
    st.one_of(
        st.text(max_size=40),
        _json.map(json.dumps),  # JSON text that is not a config
        _json,  # values of every JSON type (dicts without a config among them)
        st.binary(max_size=16),
        st.builds(object),
        st.tuples(st.integers()),
    )
)
def test_junk_always_raises_config_error(empty, junk):
    cwd = os.getcwd()
    os.chdir(empty)  # a junk string names no file (but "." and "..", folders)
    try:
        with pytest.raises(MoKConfigError):
            MoKConfig.from_json(junk)
    finally:
        os.chdir(cwd)


@pytest.mark.parametrize(
    ("source", "match"),
    [
        ("", "config source is an empty or blank string; expected a path to a mok-config/1"),
        ("  \n\t", "config source is an empty or blank string"),
        (5, r"config source must be a path, a JSON string or a dict \(found int 5\)"),
        (None, r"\(found NoneType None\)"),
        ([GOOD], r"\(found list \["),
        (b"{}", r"\(found bytes b'\{\}'\)"),
        ("[1, 2]", r"config JSON must be an object \(found list\)"),
        ("5", r"config JSON must be an object \(found int\)"),
        ("null", r"config JSON must be an object \(found NoneType\)"),
        ("{bad", "config is not valid JSON"),
        ("[" * 100_000, "config is not valid JSON"),
        ("/nonexistent/mok.json", "config file '/nonexistent/mok.json' does not exist"),
        (".", "config path '.' is a directory"),
        (Path(""), "config path '.' is a directory"),
        ("a\0b", "cannot read config file"),
        (
            {"config": GOOD["config"]},
            "config format None is not supported; expected 'mok-config/1'",
        ),
        ({"format": ["mok-config/1"]}, r"config format \['mok-config/1'\] is not supported"),
        ({"format": "mok-config/1"}, r"needs a 'config' object .* \(found NoneType\)"),
        ({"format": "mok-config/1", "config": [1]}, r"needs a 'config' object .* \(found list\)"),
        ({"format": "mok-config/1", "config": {1: 2}}, r"unknown MoKConfig keys \[1\]"),
        ({"format": "mok-config/1", 0: 1, "a": 2}, r"unknown top-level keys \['a', 0\]"),
        (
            '{"format": "mok-config/1", "config": {"capacity_factor": 1' + "0" * 400 + "}}",
            r"capacity_factor must be a finite number \(found 10000",
        ),
        (
            '{"format": "mok-config/1", "config": {"max_tokens": 1' + "0" * 5000 + "}}",
            "config is not valid JSON .*digits",
        ),
    ],
)
def test_malformed_sources(source, match):
    with pytest.raises(MoKConfigError, match=match):
        MoKConfig.from_json(source)


def test_malformed_files(tmp_path):
    cases = {
        "list.json": ("[1]", r"config file '.*list.json' JSON must be an object \(found list\)"),
        "text.json": ("not json", r"config file '.*text.json' is not valid JSON"),
        "empty.json": ("", r"config file '.*empty.json' is not valid JSON"),
    }
    for name, (text, match) in cases.items():
        (tmp_path / name).write_text(text)
        with pytest.raises(MoKConfigError, match=match):
            MoKConfig.from_json(tmp_path / name)
    (tmp_path / "bin.json").write_bytes(b"\xff\xfe\x00")
    with pytest.raises(MoKConfigError, match="cannot read config file .*bin.json.*utf-8"):
        MoKConfig.from_json(str(tmp_path / "bin.json"))
    with pytest.raises(MoKConfigError, match="is a directory"):
        MoKConfig.from_json(tmp_path)
    # a file wins over JSON text of the same spelling
    (tmp_path / "5").write_text(MoKConfig(num_comm_sms=5).to_json())
    cwd = os.getcwd()
    os.chdir(tmp_path)
    try:
        assert MoKConfig.from_json("5").num_comm_sms == 5
    finally:
        os.chdir(cwd)


def test_tune_output_keys_are_accepted():
    doc = dict(GOOD, workload={"shape": "tiny"}, predicted_us=1.0, breakdown={})
    assert MoKConfig.from_json(doc) == MoKConfig()
    assert asdict(MoKConfig.from_json(json.dumps(doc))) == GOOD["config"]
