"""Import structure of the simulator package (``sim/*.py``): no import circles between its modules.

The graph is read from the source with :mod:`ast`, nothing is imported. Module-level ``import`` /
``from`` statements (also those in module-level ``if`` / ``try`` blocks and class bodies) are the
edges Python runs when a module loads; imports inside functions (deferred) and under ``if
TYPE_CHECKING:`` (type hints only) are edges too, but the interpreter never sees a circle through
them, so they are where circles hide. A circle of module-level edges fails outright; a circle that
closes only through deferred or type-only edges must be listed in :data:`ALLOWED_CYCLES`, which can
only shrink: a new circle fails, and so does a listed one that no longer exists (drop its entry).
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

import pytest

SIM = Path(__file__).resolve().parents[1] / "sim"
MODULES = sorted(p.stem for p in SIM.glob("*.py"))  # "__init__" is the package itself

# Circles that close only through a deferred (function-level) or TYPE_CHECKING import, each as
# the modules in import order from the smallest name (a -> b -> ... -> a).
ALLOWED_CYCLES = {
    # policies imports sim.model.LayerBuilder under TYPE_CHECKING; model imports policies
    ("model", "policies"),
}


@dataclass(frozen=True)
class Edge:
    src: str
    dst: str
    line: int
    kind: str  # "module" (runs at import), "deferred" (in a function), "type" (TYPE_CHECKING)


def _targets(module: str, node: ast.Import | ast.ImportFrom) -> list[str]:
    """The sim modules an import statement of ``sim/<module>.py`` names (``__init__`` for the
    package itself); other packages are left out."""
    names: list[str] = []
    if isinstance(node, ast.Import):
        for alias in node.names:
            parts = alias.name.split(".")
            if parts[0] == "sim":
                names.append(parts[1] if len(parts) > 1 else "__init__")
        return names
    if node.level > 1:  # above the sim package
        return []
    if node.level == 1 or node.module == "sim":
        base = None if node.level == 0 else node.module
    elif node.module and node.module.split(".")[0] == "sim":
        base = node.module.split(".")[1]
    else:
        return []
    if base is not None:
        return [base.split(".")[0]]
    # `from sim import x` / `from . import x`: x is a submodule, or a name of the package
    return [a.name if a.name in MODULES else "__init__" for a in node.names]


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def module_edges(module: str, source: str) -> list[Edge]:
    """Every import of a sim module in ``source`` (the text of ``sim/<module>.py``), by kind."""
    out: list[Edge] = []

    def visit(nodes, kind: str) -> None:
        for node in nodes:
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                out.extend(Edge(module, t, node.lineno, kind) for t in _targets(module, node))
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                visit(ast.iter_child_nodes(node), "deferred" if kind == "module" else kind)
            elif isinstance(node, ast.If) and _is_type_checking(node.test):
                visit(node.body, "type" if kind == "module" else kind)
                visit(node.orelse, kind)
            else:
                visit(ast.iter_child_nodes(node), kind)

    visit(ast.parse(source).body, "module")
    return [e for e in out if e.dst != module]  # the package's own names, in its __init__


def all_edges() -> list[Edge]:
    return [e for m in MODULES for e in module_edges(m, (SIM / f"{m}.py").read_text())]


def graph(edges: list[Edge], kinds: tuple[str, ...]) -> dict[str, set[str]]:
    g: dict[str, set[str]] = {m: set() for m in MODULES}
    for e in edges:
        if e.kind in kinds:
            g[e.src].add(e.dst)
    return g


def cycles(g: dict[str, set[str]]) -> set[tuple[str, ...]]:
    """Every elementary cycle of ``g`` once (depth-first from each node through larger nodes
    only), as its nodes in edge order from the smallest."""
    found: set[tuple[str, ...]] = set()

    def dfs(start: str, node: str, path: list[str]) -> None:
        for nxt in sorted(g.get(node, ())):
            if nxt == start:
                found.add(tuple(path))
            elif nxt > start and nxt not in path:
                path.append(nxt)
                dfs(start, nxt, path)
                path.pop()

    for start in sorted(g):
        dfs(start, start, [start])
    return found


def _describe(cyc: tuple[str, ...], edges: list[Edge]) -> str:
    hops = []
    for a, b in zip(cyc, cyc[1:] + cyc[:1], strict=True):
        how = sorted({f"{e.kind}@{e.line}" for e in edges if (e.src, e.dst) == (a, b)})
        hops.append(f"sim/{a}.py -> sim.{b} ({', '.join(how)})")
    return "; ".join(hops)


EDGES = all_edges()


def test_graph_reader_resolves_sim_imports():
    src = """
import os
import sim
import sim.fused as f
from sim import fused, plots
from sim.validate import summarise
from . import engine
from .flows import maxmin_rates
from .. import elsewhere
from numpy import array
from typing import TYPE_CHECKING
if TYPE_CHECKING:
    from sim.model import LayerBuilder
try:
    from sim.trace import write_chrome_trace
except ImportError:
    pass
class C:
    from sim.gemm import gemm_us
def f():
    from sim.simpy_engine import run_graph_simpy
    def g():
        import sim.bench
"""
    got = {(e.dst, e.kind) for e in module_edges("cli", src)}
    assert got == {
        ("__init__", "module"),
        ("fused", "module"),
        ("plots", "module"),
        ("validate", "module"),
        ("engine", "module"),
        ("flows", "module"),
        ("trace", "module"),
        ("gemm", "module"),
        ("model", "type"),
        ("simpy_engine", "deferred"),
        ("bench", "deferred"),
    }
    assert cycles({"a": {"b"}, "b": {"a", "c"}, "c": {"a"}}) == {("a", "b"), ("a", "b", "c")}
    assert cycles({"a": {"b"}, "b": {"c"}, "c": set()}) == set()


def test_no_module_level_import_circle():
    found = cycles(graph(EDGES, ("module",)))
    assert not found, "import circles among module-level imports:\n" + "\n".join(
        _describe(c, EDGES) for c in sorted(found)
    )


def test_hidden_circles_only_the_allowed_ones():
    found = cycles(graph(EDGES, ("module", "deferred", "type")))
    new = found - ALLOWED_CYCLES
    assert not new, (
        "import circles hidden by deferred / TYPE_CHECKING imports (move the shared pieces into a "
        "module both can import instead of listing them in ALLOWED_CYCLES):\n"
        + "\n".join(_describe(c, EDGES) for c in sorted(new))
    )
    gone = ALLOWED_CYCLES - found
    assert not gone, f"no longer import circles, remove them from ALLOWED_CYCLES: {sorted(gone)}"


@pytest.mark.parametrize("module", ["kernel_fit", "validate", "measured"])
def test_fit_and_validation_modules_in_no_circle(module):
    for cyc in cycles(graph(EDGES, ("module", "deferred", "type"))):
        assert module not in cyc, _describe(cyc, EDGES)


def test_kernel_fit_and_validate_import_one_way_at_module_level():
    between = {
        (e.src, e.dst, e.kind) for e in EDGES if {e.src, e.dst} == {"kernel_fit", "validate"}
    }
    assert between == {("validate", "kernel_fit", "module")}
    # the fits and validate read the measured rows and subsets from sim.measured, at module
    # level; it imports no other sim module
    edges = {(e.src, e.dst, e.kind) for e in EDGES}
    for src in ("kernel_fit", "fused_fit", "validate"):
        assert (src, "measured", "module") in edges, src
    assert [e for e in EDGES if e.src == "measured"] == []
