"""Inputs the simulator and the routing generator refuse: mok-sim path errors (one line on stderr,
exit status 2, checked before the long work), numeric arguments and skew specs (NaN and inf
never pass), files validate / calibrate cannot use, and make_routing's arguments; with property
tests over random skew specs, command-line values and routing arguments."""

from __future__ import annotations

import contextlib
import io
import json
import math
import re

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mok.spec.workload import Skew, make_routing
from sim.app.cli import build_parser, main
from sim.core.hardware import profiles_dir
from sim.measured import measured_path

SMALL = ["--shape", "tiny", "--tokens", "256", "--ep", "8", "--topology", "hgx-h200"]
PROFILES = profiles_dir()
COMM = measured_path("h200x2-comm-2026-11-30.csv")
PROBE = measured_path("h200x2-probe-2026-11-29.json")
MISSING = "/nonexistent/dir"
# derandomize: the same examples on every run (reproducible CI)
PROPERTY = settings(max_examples=60, deadline=None, derandomize=True)


def _error_line(capsys) -> str:
    """The one stderr line of a refused command (nothing on stdout: no work was done)."""
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert out == "", out
    return lines[0]


# -- paths ---------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("argv", "flag"),
    [
        (["--out", f"{MISSING}/d.png"], "--out"),
        (["compare", *SMALL, "--csv", f"{MISSING}/c.csv"], "--csv"),
        (["sweep", *SMALL, "--out", f"{MISSING}/s.csv"], "--out"),
        (["sweep", *SMALL, "--heatmap", f"{MISSING}/h.png"], "--heatmap"),
        (["tune", *SMALL, "--emit-config", f"{MISSING}/x.json"], "--emit-config"),
        (["tune", "--fused", "--emit-config", f"{MISSING}/x.json"], "--emit-config"),
        (["trace", *SMALL, "--out", f"{MISSING}/t.json"], "--out"),
        (["trace", *SMALL, "--csv", f"{MISSING}/t.csv"], "--csv"),
        (["trace", *SMALL, "--gantt", f"{MISSING}/g.png"], "--gantt"),
        (["trace", *SMALL, "--links", f"{MISSING}/l.png"], "--links"),
        (["calibrate", str(PROBE), "--out", f"{MISSING}/p.json"], "--out"),
        (["validate", str(COMM), "--csv", f"{MISSING}/v.csv"], "--csv"),
        (["validate", str(COMM), "--plot", f"{MISSING}/v.png"], "--plot"),
        (["validate", str(COMM), "--save-profile", f"{MISSING}/k.json"], "--save-profile"),
    ],
)
def test_unwritable_output_is_one_line_before_any_work(argv, flag, capsys):
    assert main(argv) == 2
    path = argv[argv.index(flag) + 1]
    assert _error_line(capsys) == (
        f"mok-sim: cannot write {path}: No such file or directory (create the folder "
        f"{MISSING} first or give {flag} another path)"
    )


def test_output_path_that_is_a_folder_or_under_a_file(tmp_path, capsys):
    assert main(["compare", *SMALL, "--csv", str(tmp_path)]) == 2
    assert _error_line(capsys) == (
        f"mok-sim: cannot write {tmp_path}: Is a directory (give --csv a file name)"
    )
    (tmp_path / "f").write_text("")
    assert main(["trace", *SMALL, "--out", str(tmp_path / "f" / "t.json")]) == 2
    assert _error_line(capsys).endswith(f"{tmp_path / 'f'} is not a directory")
    assert main(["compare", *SMALL, "--csv", ""]) == 2
    assert _error_line(capsys) == "mok-sim: --csv needs a file name (found an empty string)"


def test_figure_extension_is_checked_up_front(tmp_path, capsys):
    assert main(["sweep", *SMALL, "--heatmap", str(tmp_path / "h.foo")]) == 2
    assert re.fullmatch(
        r"mok-sim: cannot write \S+h\.foo: matplotlib does not write \.foo figures "
        r"\(give --heatmap one of .*\.png.*\)",
        _error_line(capsys),
    )


@pytest.mark.parametrize(
    ("argv", "what"),
    [
        (["calibrate", f"{MISSING}/probe.json"], "probe JSON"),
        (["validate", f"{MISSING}/m.csv"], "measured CSV"),
        (["validate", str(COMM), f"{MISSING}/m.csv"], "measured CSV"),
    ],
)
def test_missing_input_file(argv, what, capsys):
    assert main(argv) == 2
    assert _error_line(capsys) == (
        f"mok-sim: cannot read {MISSING}/{argv[-1].rsplit('/', 1)[1]}: No such file or "
        f"directory (check the {what} path)"
    )


def test_input_that_is_a_folder(tmp_path, capsys):
    assert main(["validate", str(tmp_path)]) == 2
    assert _error_line(capsys) == (
        f"mok-sim: cannot read {tmp_path}: Is a directory (give the measured CSV file)"
    )


@pytest.mark.parametrize(
    ("argv", "match"),
    [
        (
            ["compare", *SMALL, "--kernel-profile", "no-such-profile"],
            r"--kernel-profile no-such-profile: profile not found \(no no-such-profile.json under "
            r"sim/profiles; the mok-kernel-profile/1 profiles there: .*mok-comm-h200x2.*\)",
        ),
        (
            ["compare", *SMALL, "--kernel-profile", f"{MISSING}/k.json"],
            f"cannot read {MISSING}/k.json: No such file or directory",
        ),
        (
            ["compare", *SMALL, "--kernel-profile", str(PROFILES / "mok-fused-h200x2.json")],
            r"it is a 'mok-fused-profile/1' file, not a mok-kernel-profile/1 JSON",
        ),
        (
            ["validate", str(COMM), "--fused-profile", str(PROFILES / "mok-comm-h200x2.json")],
            r"\(--fused-profile\): it is a 'mok-kernel-profile/1' file, not a "
            r"mok-fused-profile/1 JSON",
        ),
        (["tune", "--fused", "--fused-profile", "nope"], "--fused-profile nope: profile not found"),
        (["validate", str(COMM), "--profile", str(COMM)], r"\(--profile\): not valid JSON"),
    ],
)
def test_profile_arguments(argv, match, capsys):
    assert main(argv) == 2
    assert re.search(match, _error_line(capsys))


def test_profile_json_with_wrong_fields(tmp_path, capsys):
    bad = tmp_path / "k.json"
    bad.write_text(json.dumps({"format": "mok-kernel-profile/1", "no_such_knob": 1}))
    assert main(["compare", *SMALL, "--kernel-profile", str(bad)]) == 2
    assert "not a valid mok-kernel-profile/1 JSON (TypeError: " in _error_line(capsys)


# -- files validate and calibrate cannot use ----------------------------------------------------
KINDS = (
    "mok-sim validate reads comm kernel rows (the CSV of `mok.bench comm`: columns model, "
    "tokens_per_rank, skew, what, impl, mode, sms, median_us), fused-layer rows (the CSVs "
    "of `mok.bench layer` / `sweep`: columns model, tokens_per_rank, skew, impl, mode, sms, "
    "minibatch, median_us), training-step rows (the CSV of `mok.bench train`: columns model, "
    "tokens_per_rank, skew, impl, mode, sms, fwd_us, bwd_us, step_us) and expert GEMM pieces "
    "(the CSV of `mok.bench experts`: columns model, tokens_per_rank, skew, num_experts, piece, "
    "impl, median_us)"
)
HEADER = COMM.read_text().splitlines()[0]
ROW = COMM.read_text().splitlines()[1]
TRAIN_HEADER, TRAIN_ROW = measured_path("h200x1-train.csv").read_text().splitlines()[:2]


def _train_row_with(column: str, value: str) -> str:
    """The committed train CSV's first row with one field replaced."""
    fields = TRAIN_ROW.split(",")
    fields[TRAIN_HEADER.split(",").index(column)] = value
    return ",".join(fields)


@pytest.mark.parametrize(
    ("text", "why"),
    [
        ('{"rows": [1, 2', "is JSON, not a measured CSV"),
        ("[]", "is JSON, not a measured CSV"),
        ("", "is empty"),
        ("a,b\n1,2\n", "is not a measured CSV (its columns: 'a', 'b')"),
        (HEADER + "\n", "has a header but no rows"),
        (HEADER.replace(",median_us", ",med") + "\n" + ROW, "looks like a comm CSV but lacks "),
        (HEADER + "\n" + ROW.replace(",154.9,", ",nan,"), "row 1: median_us 'nan' is not a "),
        (HEADER + "\n" + ROW.replace(",154.9,", ",-1,"), "row 1: median_us '-1' is not a "),
        (HEADER + "\n" + ROW.replace(",64,154.9", ",x,154.9"), "row 1: sms 'x' is not an integ"),
        (HEADER + "\n" + ROW + "\n" + ROW.rsplit(",", 3)[0], "row 2 has fewer fields than "),
        (HEADER + "\n" + ROW + ",extra", "row 1 has more fields than its header (23)"),
        (
            "model,impl,minibatch,median_us\nx,mok-fused,64,1.0\n",
            "looks like a layer CSV but lacks the columns tokens_per_rank, skew, mode, sms",
        ),
        (
            "model,impl,fwd_us,bwd_us,step_us\nx,mok-fused,1.0,2.0,3.0\n",
            "looks like a train CSV but lacks the columns tokens_per_rank, skew, mode, sms",
        ),
        (
            "model,piece,impl,median_us\nx,dW_down,mok,1.0\n",
            "looks like an experts CSV but lacks the columns tokens_per_rank, skew, num_experts",
        ),
        (
            TRAIN_HEADER + "\n" + _train_row_with("bwd_us", "0"),
            "row 1: bwd_us '0' is not a positive finite number",
        ),
    ],
)
def test_validate_refuses_what_is_not_a_measured_csv(tmp_path, text, why, capsys):
    path = tmp_path / "m.csv"
    path.write_text(text)
    assert main(["validate", str(path)]) == 2
    line = _error_line(capsys)
    assert line.startswith(f"mok-sim: {path} {why}") and line.endswith(KINDS)


def test_validate_refuses_binary_files(tmp_path, capsys):
    path = tmp_path / "m.csv"
    path.write_bytes(b"\x89PNG\r\n\x1a\n\xff\x00")
    assert main(["validate", str(path)]) == 2
    assert _error_line(capsys) == f"mok-sim: {path} is not a text file (not UTF-8); {KINDS}"


def test_validate_refuses_the_csvs_mok_sim_writes(tmp_path, capsys):
    compare_csv, pred_csv = tmp_path / "c.csv", tmp_path / "p.csv"
    assert main(["compare", *SMALL, "--minibatch", "256", "--csv", str(compare_csv)]) == 0
    assert main(["validate", str(COMM), "--csv", str(pred_csv)]) == 0
    capsys.readouterr()
    for path in (compare_csv, pred_csv):
        assert main(["validate", str(path)]) == 2
        line = _error_line(capsys)
        assert line.startswith(f"mok-sim: {path} is a mok-sim output CSV (predictions, not ")
        assert line.endswith(KINDS)


@pytest.mark.parametrize(
    ("doc", "why"),
    [
        ("not json", r"is not a probe JSON: not valid JSON \(Expecting value"),
        ("[1, 2]", "is not a probe JSON: a JSON list, not an object"),
        ('{"format": "mok-gpu-profile/1"}', r"is not a probe JSON \(a 'mok-gpu-profile/1' file\)"),
        ('{"results": [1]}', r"is not a probe JSON \(no 'results' object\)"),
    ],
)
def test_calibrate_refuses_what_is_not_a_probe(tmp_path, doc, why, capsys):
    path = tmp_path / "p.json"
    path.write_text(doc)
    assert main(["calibrate", str(path), "--out", str(tmp_path / "o.json")]) == 2
    line = _error_line(capsys)
    assert re.match(f"mok-sim: {re.escape(str(path))} {why}", line)
    assert line.endswith(
        "calibrate reads the probe JSON of `torchrun --nproc-per-node=2 -m "
        "mok.bench probe` (an object with a 'results' object)"
    )
    assert not (tmp_path / "o.json").exists()


def test_calibrate_on_a_malformed_probe(tmp_path, capsys):
    doc = json.loads(PROBE.read_text())
    doc["results"]["signal_latency"]["0<->1"] = 2.4  # a number where the fit reads a dict
    path = tmp_path / "p.json"
    path.write_text(json.dumps(doc))
    assert main(["calibrate", str(path), "--out", str(tmp_path / "o.json")]) == 2
    assert _error_line(capsys).startswith(
        f"mok-sim: cannot fit {path}: a malformed probe JSON (TypeError: "
    )


# -- numeric arguments and skew specs ------------------------------------------------------------
def _parse(argv: list[str]) -> tuple[object, str]:
    """(namespace or None, stderr) of the mok-sim parser on argv."""
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        try:
            return build_parser().parse_args(argv), ""
        except SystemExit as e:
            assert e.code == 2
            return None, err.getvalue()


# (command prefix, flag, attribute, smallest value, is a float, is a list)
NUMERIC = [
    (["compare"], "--tokens", "tokens", 1, False, False),
    (["compare"], "--ep", "ep", 1, False, False),
    (["compare"], "--seed", "seed", 0, False, False),
    (["compare"], "--sms", "sms", 1, False, False),
    (["compare"], "--minibatch", "minibatch", 1, False, False),
    (["compare"], "--ring-slots", "ring_slots", 1, False, False),
    (["trace"], "--row-tile", "row_tile", 1, False, False),
    (["sweep"], "--sms", "sms", 1, False, True),
    (["sweep"], "--minibatch", "minibatch", 1, False, True),
    (["sweep"], "--ring-slots", "ring_slots", 1, False, True),
    (["sweep"], "--jobs", "jobs", 1, False, False),
    (["tune"], "--sms", "sms", 1, False, True),
    (["tune"], "--top", "top", 1, False, False),
    (["calibrate", "p.json"], "--num-sms", "num_sms", 1, False, False),
    (["calibrate", "p.json"], "--nvlink-gbps", "nvlink_gbps", 0, True, False),
    (["bench"], "--sweep-configs", "sweep_configs", 1, False, False),
]


@pytest.mark.parametrize("value", ["nan", "inf", "-inf", "NaN", "1e400", "-1", "1.5", "x", ""])
@pytest.mark.parametrize(("cmd", "flag", "attr", "lo", "real", "many"), NUMERIC)
def test_numeric_arguments_refuse_nan_inf_and_out_of_range(cmd, flag, attr, lo, real, many, value):
    ns, err = _parse([*cmd, f"{flag}={value}"])
    if value == "1.5" and real:
        assert ns is not None and getattr(ns, attr) == 1.5
        return
    assert ns is None
    kind = "a finite number > 0" if real else f"an integer >= {lo}"
    assert f"argument {flag}: expected {kind}" in err


_numbers = st.one_of(
    st.integers(-5, 10**12).map(str),
    st.floats().map(repr),
    st.sampled_from(["nan", "inf", "-inf", "Infinity", "+nan", "1e999", "0", "00", " 7 "]),
    st.text(max_size=6),
)


@PROPERTY
@given(st.sampled_from(NUMERIC), st.lists(_numbers, min_size=1, max_size=3))
def test_numeric_arguments_accept_only_finite_values_in_range(case, values):
    cmd, flag, attr, lo, real, many = case
    text = ",".join(values) if many else values[0]
    ns, err = _parse([*cmd, f"{flag}={text}"])
    if ns is None:
        assert f"argument {flag}: expected" in err
        assert len(err.strip().splitlines()[-1]) > 0
        return
    got = getattr(ns, attr)
    for v in got if many else [got]:
        if real:
            assert isinstance(v, float) and math.isfinite(v) and v > 0
        else:
            assert isinstance(v, int) and v >= lo
    used = values if many else values[:1]  # a single-valued flag parses the first value only
    assert not any(w.strip().lower().lstrip("+-") in ("nan", "inf", "infinity") for w in used)


@pytest.mark.parametrize(
    "spec",
    [
        "zipf:nan",
        "zipf:inf",
        "zipf:-inf",
        "zipf:-1",
        "hot:nan",
        "hot:inf",
        "hot:1.5",
        "hot:-0.1",
        "hot:0.5:0",
        "hot:0.5:nan",
        "hot:0.5:1.5",
        "uniform@nan",
        "zipf:1@inf",
        "zipf:1@-0.5",
        "zipf:1@2",
        "zipf:1@x",
        "zipf:1@0.5@0.5",
        "zipf",
        "zipf:",
        "lognormal:1",
        "",
        "@0.5",
    ],
)
def test_cli_rejects_bad_skews(spec, capsys):
    with pytest.raises(SystemExit) as e:
        main(["compare", *SMALL, f"--skew={spec}"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert f"argument --skew: cannot parse skew {spec!r}" in err
    assert "supported: uniform, zipf:ALPHA (finite, >= 0), hot:SHARE[:NUM_HOT]" in err
    with pytest.raises(ValueError, match=f"cannot parse skew {re.escape(repr(spec))}"):
        make_routing(4, 8, 2, skew=spec)


_bad_num = st.one_of(
    st.floats().map(repr),
    st.integers(-3, 300).map(str),
    st.sampled_from(["nan", "inf", "-inf", "NaN", "Infinity", "1e999", "-0", "", "1e-400"]),
    st.text(max_size=4),
)
_share = st.one_of(st.floats(0, 1).map(str), st.sampled_from(["0", "1", "0.5", " 0.25 "]))


@st.composite
def skew_specs(draw) -> str:
    """Specs close to the grammar (the right kinds and arity, numbers mostly in range) with a
    part replaced by junk one time in four."""
    kind = draw(st.sampled_from(["uniform", "zipf", "hot"] * 3 + ["Zipf", "", "hot "]))
    arity = {"uniform": 0, "zipf": 1}.get(kind, draw(st.sampled_from([1, 2])))
    if draw(st.integers(0, 4)) == 0:  # the wrong number of parts now and then
        arity = draw(st.integers(0, 3))
    good = [st.floats(0, 20).map(repr)] if kind == "zipf" else [_share, st.integers(1, 4).map(str)]
    parts = []
    for i in range(arity):
        ok = good[min(i, len(good) - 1)]
        parts.append(draw(ok if draw(st.integers(0, 3)) else _bad_num))
    corr = draw(st.one_of(st.none(), st.none(), _share, _bad_num))
    return ":".join([kind, *parts]) + ("" if corr is None else f"@{corr}")


_spec = st.one_of(skew_specs(), skew_specs(), skew_specs(), st.text(max_size=20))


@PROPERTY
@given(_spec)
def test_random_skew_specs_parse_or_raise_the_clear_error(spec):
    try:
        s = Skew.parse(spec)
    except ValueError as e:
        assert str(e).startswith(f"cannot parse skew {spec!r}")
        assert "supported: uniform, zipf:ALPHA" in str(e)
        ns, err = _parse(["compare", f"--skew={spec}"])
        assert ns is None and f"argument --skew: cannot parse skew {spec!r}" in err
        return
    for v in (s.alpha, s.hot_share, s.rank_correlation):
        assert math.isfinite(v)
    assert s.alpha >= 0 and 0 <= s.hot_share <= 1 and 0 <= s.rank_correlation <= 1
    assert isinstance(s.hot_experts, int) and s.hot_experts >= 1
    assert s.kind == spec.strip().split("@")[0].split(":")[0]
    numbers = spec.replace("@", ":").split(":")[1:]
    assert not any(w.strip().lower().lstrip("+-") in ("nan", "inf", "infinity") for w in numbers)
    ns, _ = _parse(["compare", f"--skew={spec}"])
    assert ns is not None and ns.skew == spec


# -- make_routing ---------------------------------------------------------------------------------
@st.composite
def routing_args(draw):
    num_experts = draw(st.integers(1, 48))
    num_topk = draw(st.integers(1, min(num_experts, 8)))
    skew = draw(
        st.one_of(
            st.just("uniform"),
            st.floats(0, 60, allow_nan=False).map(lambda a: Skew("zipf", alpha=a)),
            st.builds(
                lambda share, n: f"hot:{share!r}:{n}",
                st.floats(0, 1, allow_nan=False),
                st.integers(1, max(1, num_experts - num_topk + 1)),
            ),
        )
    )
    corr = draw(st.one_of(st.just(0.0), st.floats(0, 1, allow_nan=False)))
    if corr:
        skew = (
            Skew(skew.kind, alpha=skew.alpha, rank_correlation=corr)
            if isinstance(skew, Skew)
            else f"{skew}@{corr!r}"
        )
    return {
        "num_tokens": draw(st.one_of(st.sampled_from([0, 1]), st.integers(0, 64))),
        "num_experts": num_experts,
        "num_topk": num_topk,
        "num_ranks": draw(st.integers(1, 4)),
        "skew": skew,
        "seed": draw(st.integers(0, 2**32)),
    }


@PROPERTY
@given(routing_args())
def test_make_routing_properties(kw):
    skew = kw["skew"] if isinstance(kw["skew"], Skew) else Skew.parse(kw["skew"])
    if skew.kind == "hot" and skew.hot_experts + kw["num_topk"] > kw["num_experts"]:
        with pytest.raises(ValueError, match=r"needs hot_experts \+ num_topk <= num_experts"):
            make_routing(**kw)
        return
    t = make_routing(**kw)
    n, k = kw["num_ranks"] * kw["num_tokens"], kw["num_topk"]
    assert t.topk_idx.shape == t.topk_weights.shape == (n, k)
    assert t.topk_idx.dtype == np.int64 and t.topk_weights.dtype == np.float32
    assert (t.num_tokens, t.num_topk, t.num_ranks) == (kw["num_tokens"], k, kw["num_ranks"])
    if n:
        assert t.topk_idx.min() >= 0 and t.topk_idx.max() < kw["num_experts"]
        s = np.sort(t.topk_idx, axis=1)
        assert (s[:, 1:] != s[:, :-1]).all()  # distinct experts per token
    assert np.isfinite(t.topk_weights).all() and (t.topk_weights >= 0).all()
    np.testing.assert_allclose(t.topk_weights.sum(axis=1), 1.0, rtol=1e-5)
    assert t.meta["skew"] == skew.label() and t.meta["seed"] == kw["seed"]
    u = make_routing(**kw)  # seeded
    assert np.array_equal(t.topk_idx, u.topk_idx)
    assert np.array_equal(t.topk_weights, u.topk_weights)


_BAD_ROUTING = [
    ({"num_tokens": -1}, "need num_tokens >= 0"),
    ({"num_tokens": 2.0}, r"num_tokens must be an integer \(found float 2.0\)"),
    ({"num_tokens": True}, r"num_tokens must be an integer \(found bool True\)"),
    ({"num_experts": 0}, "num_experts >= 1"),
    ({"num_experts": "8"}, r"num_experts must be an integer \(found str '8'\)"),
    ({"num_topk": 0}, r"num_topk must be in \[1, num_experts=8\] \(found 0\)"),
    ({"num_topk": 9}, r"num_topk must be in \[1, num_experts=8\] \(found 9\)"),
    ({"num_topk": None}, r"num_topk must be an integer \(found NoneType None\)"),
    ({"num_ranks": 0}, "num_ranks >= 1"),
    ({"seed": -1}, "seed >= 0"),
    ({"seed": 0.5}, "seed must be an integer"),
    ({"skew": None}, r"skew must be a Skew or a spec string \(found NoneType None\)"),
    ({"skew": 1.2}, r"skew must be a Skew or a spec string \(found float 1.2\); supported specs"),
    ({"skew": "hot:0.5:7"}, r"hot routing 'hot:0.5:7' needs hot_experts \+ num_topk <= num_ex"),
    ({"skew": "zipf:nan"}, "cannot parse skew 'zipf:nan': skew alpha must be a finite number"),
]


@pytest.mark.parametrize(("over", "match"), _BAD_ROUTING)
def test_make_routing_argument_errors(over, match):
    kw = {"num_tokens": 4, "num_experts": 8, "num_topk": 2, "num_ranks": 1, "seed": 0, **over}
    with pytest.raises(ValueError, match=match):
        make_routing(**kw)


@PROPERTY
@given(
    st.sampled_from(["num_tokens", "num_experts", "num_topk", "num_ranks", "seed"]),
    st.one_of(
        st.integers(max_value=-1),
        st.floats(),
        st.text(max_size=3),
        st.none(),
        st.booleans(),
        st.lists(st.integers(), max_size=2),
    ),
)
def test_make_routing_bad_integers_raise_value_error(name, value):
    kw = {"num_tokens": 4, "num_experts": 8, "num_topk": 2, "num_ranks": 1, "seed": 0}
    with pytest.raises(ValueError, match=name):
        make_routing(**{**kw, name: value})
