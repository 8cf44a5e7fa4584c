"""The layout of csrc/, read from the source (no compiler needed).

* Includes point one way: ``params.h`` / ``api.h`` (the ABI and the host entry points),
  ``ptx/`` (PTX wrappers) <- ``common/`` (waits, rings, rows, schedule)
  <- ``comm/`` (communication kernels) <- ``layer/`` (fused layer kernels); ``probe/`` uses only
  ``ptx/``; ``torch/`` is the host glue.
* Every ``__global__`` kernel is compiled in exactly one translation unit of the extension (a
  kernel defined in a header that two units include would be defined twice at link time).
* The fixed-order fp32 sum of bf16 terms, on which bitwise determinism rests, is written once
  (``OrderedSum8`` in ``common/rows.cuh``).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from mok._ext import SOURCES

CSRC = Path(__file__).resolve().parents[1] / "csrc"
INCLUDE = re.compile(r'^#include "([^"]+)"', re.M)
KERNEL = re.compile(r"__global__\s+void\s+(?:__launch_bounds__\([^)]*\)\s+)?(\w+)\s*\(")

# folder -> the folders its files may include ("." is csrc/ itself: params.h)
ALLOWED = {
    "ptx": {"ptx"},
    "common": {".", "ptx", "common"},
    "comm": {".", "ptx", "common", "comm"},
    "layer": {".", "ptx", "common", "comm", "layer"},
    "probe": {"ptx", "probe"},
    "torch": {".", "torch", "probe"},
    ".": {"."},  # params.h (the ABI) and api.h (the launchers' host entry points)
}


def _files() -> list[Path]:
    return sorted(p for p in CSRC.rglob("*") if p.suffix in (".h", ".cuh", ".cu", ".cpp"))


def _folder(rel: str) -> str:
    return rel.split("/")[0] if "/" in rel else "."


def _includes(path: Path) -> list[str]:
    return INCLUDE.findall(path.read_text())


def _closure(unit: str) -> set[str]:
    seen, todo = set(), [unit]
    while todo:
        rel = todo.pop()
        if rel in seen:
            continue
        seen.add(rel)
        todo += _includes(CSRC / rel)
    return seen


def test_every_include_resolves_and_points_one_way():
    bad = []
    for f in _files():
        rel = f.relative_to(CSRC).as_posix()
        for inc in _includes(f):
            if not (CSRC / inc).is_file():
                bad.append(f"{rel}: {inc} does not exist")
            elif _folder(inc) not in ALLOWED[_folder(rel)]:
                bad.append(f"{rel} includes {inc} ({_folder(rel)}/ may not use {_folder(inc)}/)")
    assert not bad, "\n".join(bad)


def test_sources_list_every_translation_unit():
    units = {p.relative_to(CSRC).as_posix() for p in _files() if p.suffix in (".cu", ".cpp")}
    assert units == set(SOURCES)


def test_each_kernel_is_compiled_in_one_unit():
    owner: dict[str, str] = {}
    clashes = []
    for unit in SOURCES:
        for rel in sorted(_closure(unit)):
            for name in KERNEL.findall((CSRC / rel).read_text()):
                key = f"{rel}:{name}"
                if key in owner and owner[key] != unit:
                    clashes.append(f"{name} ({rel}) is compiled by {owner[key]} and {unit}")
                owner.setdefault(key, unit)
    assert owner, "no kernels found"
    assert not clashes, "\n".join(clashes)


@pytest.mark.parametrize("op", ["__fadd_rn(", "bf16_lo(w4"])
def test_ordered_sum_is_one_helper(op):
    users = [f.relative_to(CSRC).as_posix() for f in _files() if op in f.read_text()]
    assert users == ["common/rows.cuh"], users
