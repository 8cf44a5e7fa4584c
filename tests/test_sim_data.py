"""Where the simulator's data lives: raw measurements once, in ``mok/bench/results`` (listed in its
README), and only fitted profiles in ``sim/profiles``, each naming the raw file it was fitted
from."""

from __future__ import annotations

import hashlib
import json
import re

import pytest

from sim.comm.profile import KERNEL_PROFILE_FORMAT
from sim.core.hardware import PROFILE_FORMAT, profiles_dir
from sim.fused.profile import FUSED_PROFILE_FORMAT
from sim.measured import measured_path, results_dir

FITTED = {PROFILE_FORMAT, KERNEL_PROFILE_FORMAT, FUSED_PROFILE_FORMAT}
RAW = sorted(p for p in results_dir().rglob("*") if p.is_file() and p.name != "README.md")


def test_sim_profiles_hold_fitted_profiles_only():
    files = sorted(profiles_dir().iterdir())
    assert files and all(p.suffix == ".json" for p in files), [p.name for p in files]
    for p in files:
        assert json.loads(p.read_text()).get("format") in FITTED, p.name


def test_each_measurement_is_stored_once():
    seen: dict[str, str] = {}
    for p in RAW:
        digest = hashlib.sha256(p.read_bytes()).hexdigest()
        assert digest not in seen, f"{p.name} is a copy of {seen[digest]}"
        seen[digest] = p.name
    for p in profiles_dir().iterdir():  # no copy of a measurement among the profiles either
        assert hashlib.sha256(p.read_bytes()).hexdigest() not in seen, p.name


def test_results_readme_lists_every_file():
    readme = (results_dir() / "README.md").read_text()
    named = set(re.findall(r"`((?:experiments/)?[\w.-]+\.(?:csv|json))`", readme))
    have = {p.relative_to(results_dir()).as_posix() for p in RAW}
    assert have <= named, f"not in mok/bench/results/README.md: {sorted(have - named)}"


def test_fitted_profiles_name_the_file_they_were_fitted_from():
    names = {p.name for p in RAW}
    for p in sorted(profiles_dir().glob("*.json")):
        doc = json.loads(p.read_text())
        if "datasheet lead" in doc.get("source", ""):
            continue  # derived from h200.json, not fitted (its assumptions list each step)
        cited = set(re.findall(r"[\w-]+\.(?:csv|json)", doc["source"]))
        assert cited & names, f"{p.name}: its source names no file of mok/bench/results"


def test_measured_path_finds_a_file_by_name():
    assert measured_path("h200x2-comm-grid-v4-2026-11-30.csv").parent == results_dir()
    with pytest.raises(FileNotFoundError, match="no measured file nope.csv"):
        measured_path("nope.csv")
