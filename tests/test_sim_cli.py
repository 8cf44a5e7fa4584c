"""CLI smoke tests, outputs (CSV, Chrome trace, figures, tune JSON) and the default run's golden
output."""

from __future__ import annotations

import csv
import json
import re
import sys
from pathlib import Path

import pytest
from matplotlib.figure import Figure

from sim.app import plots
from sim.app.cli import build_parser, main
from sim.app.trace import chrome_trace
from sim.config import SimConfig, Workload
from sim.layer.model import simulate
from sim.measured import measured_path

SMALL = ["--shape", "tiny", "--tokens", "256", "--ep", "8", "--topology", "hgx-h200"]

# `mok-sim` with no arguments: the table lines it must print (deterministic for seed 0).
# Recomputed with the measured push signalling (fence_us 1.569 us, jitter 0.086 us): every
# mode pays the fixed fence somewhere (push rounds, the push combine, pull flags), so the layer
# times move by about 1 us and the exposed signalling by 1.0-1.1 us.
GOLDEN_DEFAULT = """
deepseek-v3 T4096 EP64 gb300-nvl72 zipf:0.2  (sms=24 mb=4096 ring=4)
push/push             2691.9   1.000x  2646.8     40.4     4.7     71.6  28.0%     53/70       924.8
pull/push             2691.9   1.000x  2646.8     40.4     4.7     18.4  28.0%     52/64       924.8
pull/pull             2688.4   1.001x  2646.8     36.9     4.7     53.7  27.9%     52/63       924.8
dedup_pull/push       2689.8   1.001x  2644.2     40.9     4.7     18.4  28.0%     50/61       887.3
deepseek-v3 T4096 EP8 hgx-h200 zipf:0.2  (sms=24 mb=4096 ring=4)
push/push             5181.6   1.000x  5056.6    120.0     5.0     56.8   6.1%     46/49       821.8
pull/push             5181.6   1.000x  5056.6    120.0     5.0     19.1   6.1%     47/49       821.8
pull/pull             5176.5   1.001x  5056.6    115.3     4.6     53.7   6.0%     48/49       821.8
dedup_pull/push       5151.2   1.006x  5019.1    127.1     5.0     19.1   6.3%     31/32       545.0
"""


def test_default_run_matches_golden_output(tmp_path, capsys):
    png = tmp_path / "default.png"
    assert main(["--out", str(png)]) == 0
    out = capsys.readouterr().out
    assert png.stat().st_size > 10_000
    assert f"wrote {png.resolve()}" in out
    keep = re.compile(r"^(deepseek|push|pull|dedup)")
    got = [ln.rstrip() for ln in out.splitlines() if keep.match(ln)]
    assert got == GOLDEN_DEFAULT.strip().splitlines()


def test_compare_prints_every_policy(capsys, tmp_path):
    assert main(["compare", *SMALL, "--csv", str(tmp_path / "c.csv")]) == 0
    out = capsys.readouterr().out
    for pol in ("push/push", "pull/push", "pull/pull", "dedup_pull/push"):
        assert pol in out
    rows = list(csv.DictReader((tmp_path / "c.csv").read_text().splitlines()))
    assert len(rows) == 4 and float(rows[0]["layer_us"]) > 0


def test_compare_prints_signalling_and_utilisation_terms(capsys, tmp_path):
    assert main(["compare", *SMALL, "--csv", str(tmp_path / "c.csv")]) == 0
    out = capsys.readouterr().out
    assert "sig/rank" in out and "NVL util%" in out
    rows = {
        (r["dispatch_mode"], r["combine_mode"]): r
        for r in csv.DictReader((tmp_path / "c.csv").read_text().splitlines())
    }
    for r in rows.values():
        assert 0 < float(r["nvl_util_mean"]) <= float(r["nvl_util_max"]) <= 1
        assert float(r["signal_rank_us"]) <= float(r["signal_rank_max_us"])
    # push dispatch: a fence, a jittered flag and one polled flag per sender every round
    assert float(rows[("push", "push")]["signal_rank_us"]) > float(
        rows[("pull", "push")]["signal_rank_us"]
    )


def test_sweep_writes_csv_and_heatmap(tmp_path, capsys):
    out = tmp_path / "s.csv"
    args = ["sweep", *SMALL, "--sms", "8,16", "--minibatch", "256,512", "--ring-slots", "2"]
    args += ["--out", str(out), "--heatmap", str(tmp_path / "h.png"), "--jobs", "1", "--quiet"]
    assert main(args) == 0
    rows = list(csv.DictReader(out.read_text().splitlines()))
    assert len(rows) == 5 * 2 * 2  # dedup_pull only with push combine
    assert {r["dispatch_mode"] for r in rows} == {"push", "pull", "dedup_pull"}
    assert {"signalling_us", "signal_rank_us", "nvl_util_mean", "nvl_util_max"} <= set(rows[0])
    assert (tmp_path / "h.png").exists()
    # the best row of each mode, with its signalling and NVLink utilisation, on the console
    text = capsys.readouterr().out
    lines = text[text.index("best per mode:") :].splitlines()[2:7]
    assert len(lines) == 5
    modes = [line.split()[0] for line in lines]
    assert sorted(modes) == sorted({f"{r['dispatch_mode']}/{r['combine_mode']}" for r in rows})
    for line in lines:
        mode = line.split()[0]
        best = min(
            (r for r in rows if f"{r['dispatch_mode']}/{r['combine_mode']}" == mode),
            key=lambda r: float(r["layer_us"]),
        )
        assert line.split()[1] == f"{float(best['layer_us']):.1f}"


def test_tune_emits_a_mok_config(tmp_path, capsys):
    path = tmp_path / "cfg.json"
    args = ["tune", *SMALL, "--sms", "8,16", "--minibatch", "256,512", "--jobs", "1"]
    assert main([*args, "--quiet", "--emit-config", str(path)]) == 0
    doc = json.loads(path.read_text())
    assert doc["format"] == "mok-config/1"
    cfg = doc["config"]
    from dataclasses import fields

    from mok.spec.config import MoKConfig

    # written by MoKConfig itself: every field, the ones the tuner does not choose at defaults
    assert set(cfg) == {f.name for f in fields(MoKConfig)}
    assert cfg["capacity_factor"] == MoKConfig().capacity_factor and cfg["max_tokens"] == 0
    assert cfg["dispatch_mode"] in ("push", "pull", "dedup_pull")
    assert cfg["combine_mode"] in ("push", "pull")
    assert cfg["macrobatch_size"] % cfg["minibatch_size"] == 0
    assert doc["predicted_us"] > 0 and doc["workload"]["topology"] == "hgx-h200"
    assert set(doc) == {"format", "config", "workload", "predicted_us", "breakdown"}

    loaded = MoKConfig.from_json(path)  # the kernel's loader takes the file as written
    assert loaded.dispatch_mode == cfg["dispatch_mode"]
    assert loaded.num_comm_sms == cfg["num_comm_sms"]
    assert loaded.minibatch_size == cfg["minibatch_size"]
    assert '"format": "mok-config/1"' in capsys.readouterr().out  # also printed


def test_trace_writes_a_chrome_trace(tmp_path, capsys):
    path = tmp_path / "t.json"
    args = ["trace", *SMALL, "--minibatch", "256", "--out", str(path)]
    args += ["--csv", str(tmp_path / "t.csv"), "--gantt", str(tmp_path / "g.png")]
    assert main([*args, "--links", str(tmp_path / "l.png")]) == 0
    doc = json.loads(path.read_text())
    phases = {e["ph"] for e in doc["traceEvents"]}
    assert {"X", "M", "C"} <= phases
    spans = [e for e in doc["traceEvents"] if e["ph"] == "X"]
    assert all(e["dur"] > 0 and e["ts"] >= 0 for e in spans)
    assert {"gemm", "dispatch", "combine"} <= {e["name"].split()[0] for e in spans}
    # signalling tasks (flags, fences, polls, credits) on their own lane and category
    sig = [e for e in spans if e["cat"] == "signalling"]
    assert sig and {e["tid"] for e in sig} == {3}
    assert {"signal_rank_us", "nvl_util_mean"} <= set(doc["otherData"])
    assert "exposed signalling" in capsys.readouterr().out


def test_calibrate_writes_a_profile(tmp_path, capsys):
    probe = measured_path("h200x2-probe-2026-11-29.json")
    out = tmp_path / "p.json"
    assert main(["calibrate", str(probe), "--out", str(out)]) == 0
    assert json.loads(out.read_text())["format"] == "mok-gpu-profile/1"
    assert "max error" in capsys.readouterr().out


def test_bad_arguments_report_an_error(capsys):
    assert main(["compare", *SMALL[:-2], "--topology", "nope"]) == 2
    assert "unknown topology" in capsys.readouterr().err


def test_list_arguments_are_parsed_by_the_parser(capsys):
    a = build_parser().parse_args(["sweep", "--sms", "8,,16", "--dispatch", "pull, push"])
    assert a.sms == [8, 16] and a.dispatch == ["pull", "push"]
    assert a.minibatch == [2048, 4096] and a.ring_slots == [2, 4]  # the defaults, parsed
    assert build_parser().parse_args(["tune"]).sms is None
    with pytest.raises(SystemExit):
        main(["sweep", "--combine", "push,gather"])
    assert (
        "argument --combine: expected a comma-separated list of combine modes (push, pull), "
        "found 'push,gather'" in capsys.readouterr().err
    )
    assert main(["sweep", *SMALL, "--dispatch", "dedup_pull", "--combine", "pull"]) == 2
    assert "no configuration to sweep: --dispatch dedup_pull x --combine pull" in (
        capsys.readouterr().err
    )


def test_plots_return_figures():
    res = simulate(
        Workload("tiny", 256, 8, "hgx-h200"),
        SimConfig(minibatch_size=256, macrobatch_size=512),
        record_links=True,
    )
    assert isinstance(plots.gantt(res), Figure)
    assert isinstance(plots.link_utilisation(res), Figure)
    rows = [dict(res.summary(), num_comm_sms=n, minibatch_size=m) for n in (8, 16) for m in (1, 2)]
    assert isinstance(plots.sweep_heatmap(rows), Figure)
    assert isinstance(plots.compare_bars({"x": [res]}), Figure)
    assert res.link_records() and all(0 <= r["utilisation"] <= 1 + 1e-9 for r in res.link_records())
    assert chrome_trace(res)["traceEvents"]


@pytest.mark.parametrize(
    "sub", ["compare", "sweep", "tune", "trace", "calibrate", "validate", "bench"]
)
def test_help_for_every_subcommand(sub, capsys):
    with pytest.raises(SystemExit) as e:
        main([sub, "--help"])
    assert e.value.code == 0


def test_bench_sweep_has_500_distinct_configs():
    from sim.app.bench import _sweep_configs

    cfgs = _sweep_configs(500)
    assert len(cfgs) == len(set(cfgs)) == 500


# -- outputs under build/, table legends, --strict, the first-run compile line -------------------
README = Path(__file__).resolve().parents[1] / "README.md"
OUTPUT_FLAGS = ("--out", "--csv", "--heatmap", "--emit-config", "--gantt", "--links", "--plot")


def _readme_sim_lines() -> list[str]:
    """The README's `mok-sim ...` command lines, continuation lines joined."""
    lines, out = README.read_text().splitlines(), []
    for i, line in enumerate(lines):
        if line.startswith("mok-sim "):
            text = line
            while text.rstrip().endswith("\\"):
                i += 1
                text = text.rstrip()[:-1] + " " + lines[i].strip()
            out.append(text.split("  #")[0])
    return out


def test_readme_mok_sim_lines_write_under_build():
    cmds = _readme_sim_lines()
    assert len(cmds) >= 10
    for cmd in cmds:
        words = cmd.split()
        for flag, value in zip(words, words[1:], strict=False):
            if flag in OUTPUT_FLAGS:
                assert value.startswith("build/"), f"README: {cmd!r} writes {value} outside build/"


def test_default_outputs_go_under_build(tmp_path, monkeypatch, capsys):
    """A command's default output path is under build/, created on demand: a run from a clean
    folder leaves only build/ there."""
    monkeypatch.chdir(tmp_path)
    assert main(["trace", *SMALL]) == 0
    assert (
        main(["sweep", *SMALL, "--sms", "8", "--minibatch", "256", "--jobs", "1", "--quiet"]) == 0
    )
    assert sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*")) == [
        "build",
        "build/mok-sim-sweep.csv",
        "build/mok-sim-trace.json",
    ]
    parser = build_parser()
    assert parser.parse_args([]).out == "build/mok-sim-default.png"
    assert parser.parse_args(["calibrate", "p.json"]).out == "build/gpu-profile.json"


def test_tables_are_explained_in_help_and_under_the_table(capsys, tmp_path):
    with pytest.raises(SystemExit):
        main(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    for term in ("exp.comm", "sig/rank", "T4096", "NVL util%", "ring = ring slots"):
        assert term in text
    assert main(["compare", *SMALL]) == 0
    out = capsys.readouterr().out
    assert "columns: layer us = one layer forward" in out
    # no line of the legend starts like a table row (the golden test keeps those)
    legend = out[out.index("columns:") :].splitlines()
    assert all(not re.match(r"^(deepseek|push|pull|dedup)", ln) for ln in legend)


def test_validate_strict_exits_1_when_a_target_is_missed(capsys):
    """The committed fused-layer sweep misses the spearman target (docs/sim-validation.md):
    the last line names it; --strict turns it into exit status 1."""
    csv_path = str(measured_path("h200x2-layer-sweep-2026-11-30.csv"))
    assert main(["validate", csv_path]) == 0
    last = capsys.readouterr().out.splitlines()[-1]
    assert last == "targets: 1 of 4 MISSED (spearman); exit status 0 (--strict exits 1)"
    assert main(["validate", csv_path, "--strict"]) == 1
    assert capsys.readouterr().out.splitlines()[-1].endswith("--strict: exit status 1")


def test_missed_targets_of_both_summaries():
    from sim.app.validate import applicable_targets, missed_targets

    comm = {
        "targets": {"median_abs_err": True, "max_abs_err": False, "spearman": False, "gap": True},
        "validation": {"n": 3},
        "ranking": {"validation groups": {"spearman_min": float("nan"), "gap_max": 0.01}},
    }
    assert applicable_targets(comm) == ["median_abs_err", "max_abs_err", "gap"]
    assert missed_targets(comm) == ["max_abs_err"]  # spearman: n/a (no ranked group)
    train = {"targets": {"fwd": {"median_abs_err": True, "max_abs_err": False},
                         "bwd": {"median_abs_err": None, "max_abs_err": None}}}  # fmt: skip
    assert applicable_targets(train) == ["fwd median_abs_err", "fwd max_abs_err"]
    assert missed_targets(train) == ["fwd max_abs_err"]


def test_compile_line_only_before_a_first_compile(tmp_path, monkeypatch, capsys):
    """sim.app.jit_cache: a module whose cached numba function has no cache entry is reported
    (and the line printed once per process); after the function ran, it is not."""
    from sim.app import jit_cache

    (tmp_path / "mok_jit_probe.py").write_text(
        "from numba import njit\n\n\n@njit(cache=True)\ndef twice(x):\n    return 2 * x\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))  # numba caches it in tmp_path/__pycache__
    monkeypatch.setattr(jit_cache, "_said", False)
    assert jit_cache.uncompiled_modules(["mok_jit_probe"]) == ["mok_jit_probe"]
    assert jit_cache.say_if_compiling(["mok_jit_probe"]) is True
    assert jit_cache.say_if_compiling(["mok_jit_probe"]) is False  # once per process
    assert capsys.readouterr().err == jit_cache.COMPILING_LINE + "\n"
    import mok_jit_probe

    assert mok_jit_probe.twice(21) == 42  # compiles and writes numba's cache
    assert jit_cache.uncompiled_modules(["mok_jit_probe"]) == []
    monkeypatch.delitem(sys.modules, "mok_jit_probe")
