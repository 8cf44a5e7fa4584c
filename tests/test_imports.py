"""No import circles between the modules of mok, reference and sim (read with :mod:`ast`: every
import statement counts, also those inside functions or under ``TYPE_CHECKING``), and the
contract (mok.spec) imports nothing of the project but mok.errors. sim's own layering is checked
in test_sim_imports.py."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("mok", "reference", "sim")


def _modules() -> dict[str, Path]:
    out = {}
    for pkg in PACKAGES:
        for p in (ROOT / pkg).rglob("*.py"):
            parts = p.relative_to(ROOT).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            out[name] = p
    return out


def _resolve(name: str, mods: dict[str, Path]) -> str | None:
    while name and name not in mods:
        name = name.rpartition(".")[0]
    return name or None


def _edges(mods: dict[str, Path]) -> dict[str, set[str]]:
    edges: dict[str, set[str]] = {m: set() for m in mods}
    for m, path in mods.items():
        for node in ast.walk(ast.parse(path.read_text())):
            targets = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                targets = [f"{node.module}.{a.name}" for a in node.names]
            for t in targets:
                dst = _resolve(t, mods)
                if dst and dst != m:
                    edges[m].add(dst)
    return edges


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    state: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[list[str]] = []

    def visit(u: str) -> None:
        state[u] = 1
        stack.append(u)
        for v in sorted(edges[u]):
            if state.get(v) == 1:
                cycles.append(stack[stack.index(v) :] + [v])
            elif v not in state:
                visit(v)
        stack.pop()
        state[u] = 2

    for m in sorted(edges):
        if m not in state:
            visit(m)
    return cycles


def test_the_cycle_finder_finds_a_planted_circle():
    edges = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert _cycles(edges) == [["a", "b", "c", "a"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_circles_anywhere():
    cycles = _cycles(_edges(_modules()))
    assert not cycles, "\n".join(" -> ".join(c) for c in cycles)


def test_the_contract_depends_on_nothing_of_the_project():
    mods = _modules()
    edges = _edges(mods)
    for m in (k for k in mods if k.startswith("mok.spec")):
        outside = {d for d in edges[m] if not d.startswith("mok.spec") and d != "mok.errors"}
        # "mok" is the package itself, which every "mok.x" import passes through
        assert outside <= {"mok"}, f"{m} imports {sorted(outside)}"
