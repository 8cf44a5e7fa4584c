"""Import structure of the simulator package (``sim/``): no import circles between its modules, and
its subpackages import one way.

The graph is read from the source with :mod:`ast`, nothing is imported. Modules are named by
their path under ``sim/`` (``core.engine``, ``config``; a subpackage's ``__init__.py`` by the
subpackage, ``core``; ``sim/__init__.py`` as ``__init__``). Module-level ``import`` / ``from``
statements (also those in module-level ``if`` / ``try`` blocks and class bodies) are the edges
Python runs when a module loads; imports inside functions (deferred) and under ``if
TYPE_CHECKING:`` (type hints only) are edges too, but the interpreter never sees a circle through
them, so they are where circles hide. A circle of module-level edges fails outright; a circle that
closes only through deferred or type-only edges must be listed in :data:`ALLOWED_CYCLES`, which can
only shrink (it is empty): a new circle fails, and so does a listed one that no longer exists.

Layers (:data:`LAYERS`): ``core`` <- ``config`` / ``measured`` <- ``comm`` <- ``layer`` <-
``fused`` <- ``app`` <- the package's own ``__init__``. Every edge of every kind goes to the
module's own level or a lower one; an import from a lower level to a higher one fails.
"""

from __future__ import annotations

import ast
import importlib
from dataclasses import dataclass
from pathlib import Path

import pytest

SIM = Path(__file__).resolve().parents[1] / "sim"


def _name(path: Path) -> str:
    """``sim/core/engine.py`` -> ``core.engine``, ``sim/core/__init__.py`` -> ``core``,
    ``sim/__init__.py`` -> ``__init__``."""
    parts = list(path.relative_to(SIM).with_suffix("").parts)
    if parts[-1] == "__init__" and len(parts) > 1:
        parts.pop()
    return ".".join(parts)


FILES = {_name(p): p for p in sorted(SIM.rglob("*.py"))}
MODULES = sorted(FILES)
PACKAGES = sorted(m for m in MODULES if FILES[m].name == "__init__.py")  # "__init__" is sim

# level of each top-level name under sim/ (a subpackage, or a module of the sim package itself)
LAYERS = {
    "core": 0,
    "config": 1,
    "measured": 1,
    "comm": 2,
    "layer": 3,
    "fused": 4,
    "app": 5,
    "__init__": 6,
}

# Circles that close only through a deferred (function-level) or TYPE_CHECKING import, each as
# the modules in import order from the smallest name (a -> b -> ... -> a). Empty: keep it so.
ALLOWED_CYCLES: set[tuple[str, ...]] = set()


@dataclass(frozen=True)
class Edge:
    src: str
    dst: str
    line: int
    kind: str  # "module" (runs at import), "deferred" (in a function), "type" (TYPE_CHECKING)


def _targets(module: str, node: ast.Import | ast.ImportFrom, modules=None) -> list[str]:
    """The sim modules an import statement of ``module`` names (``__init__`` for the package
    itself, a subpackage by its name); other packages are left out."""
    modules = FILES if modules is None else modules

    def resolve(dotted: str) -> str:
        parts = dotted.split(".") if dotted else []
        for k in range(len(parts), 0, -1):
            if ".".join(parts[:k]) in modules:
                return ".".join(parts[:k])
        return "__init__"

    if isinstance(node, ast.Import):
        out = []
        for alias in node.names:
            parts = alias.name.split(".")
            if parts[0] == "sim":
                out.append(resolve(".".join(parts[1:])))
        return out
    if node.level:  # relative to the module's own package
        pkg = module.split(".") if module in PACKAGES else module.split(".")[:-1]
        if module == "__init__":
            pkg = []
        if node.level - 1 > len(pkg):
            return []  # above the sim package
        base = pkg[: len(pkg) - (node.level - 1)] + (node.module.split(".") if node.module else [])
    elif node.module and node.module.split(".")[0] == "sim":
        base = node.module.split(".")[1:]
    else:
        return []
    prefix = ".".join(base)
    out = []
    for alias in node.names:  # `from sim.core import engine`: engine is a submodule, or a name
        sub = f"{prefix}.{alias.name}" if prefix else alias.name
        out.append(sub if sub in modules else resolve(prefix))
    return out


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def module_edges(module: str, source: str, modules=None) -> list[Edge]:
    """Every import of a sim module in ``source`` (the text of ``module``), by kind."""
    out: list[Edge] = []

    def visit(nodes, kind: str) -> None:
        for node in nodes:
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                out.extend(
                    Edge(module, t, node.lineno, kind) for t in _targets(module, node, modules)
                )
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                visit(ast.iter_child_nodes(node), "deferred" if kind == "module" else kind)
            elif isinstance(node, ast.If) and _is_type_checking(node.test):
                visit(node.body, "type" if kind == "module" else kind)
                visit(node.orelse, kind)
            else:
                visit(ast.iter_child_nodes(node), kind)

    visit(ast.parse(source).body, "module")
    return [e for e in out if e.dst != module]  # a package's own names, in its __init__


def all_edges() -> list[Edge]:
    return [e for m in MODULES for e in module_edges(m, FILES[m].read_text())]


def graph(edges: list[Edge], kinds: tuple[str, ...]) -> dict[str, set[str]]:
    g: dict[str, set[str]] = {m: set() for m in MODULES}
    for e in edges:
        if e.kind in kinds:
            g.setdefault(e.src, set()).add(e.dst)
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


def level(module: str) -> int:
    return LAYERS[module.split(".")[0]]


def layering_violations(edges: list[Edge]) -> list[Edge]:
    """The edges that go from a lower level to a higher one (:data:`LAYERS`)."""
    return [e for e in edges if level(e.dst) > level(e.src)]


def _where(module: str) -> str:
    return str(FILES[module].relative_to(SIM.parent)) if module in FILES else module


def _describe(cyc: tuple[str, ...], edges: list[Edge]) -> str:
    hops = []
    for a, b in zip(cyc, cyc[1:] + cyc[:1], strict=True):
        how = sorted({f"{e.kind}@{e.line}" for e in edges if (e.src, e.dst) == (a, b)})
        hops.append(f"{_where(a)} -> sim.{b} ({', '.join(how)})")
    return "; ".join(hops)


EDGES = all_edges()


def test_graph_reader_resolves_sim_imports():
    src = """
import os
import sim
import sim.fused.model as f
from sim import fused, config
from sim.app.validate import summarise
from sim.core import engine, Graph
from . import flows
from .plots import gantt
from .. import config as c2
from ... import elsewhere
from numpy import array
from typing import TYPE_CHECKING
if TYPE_CHECKING:
    from sim.layer.model import LayerBuilder
try:
    from sim.app.trace import write_chrome_trace
except ImportError:
    pass
class C:
    from sim.core.gemm import gemm_us
def f():
    from sim.core.simpy_engine import run_graph_simpy
    def g():
        import sim.app.bench
"""
    mods = {
        "__init__",
        "config",
        "fused",
        "fused.model",
        "core",
        "core.engine",
        "core.gemm",
        "core.simpy_engine",
        "app",
        "app.cli",
        "app.flows",
        "app.plots",
        "app.trace",
        "app.validate",
        "app.bench",
        "layer.model",
    }
    got = {(e.dst, e.kind) for e in module_edges("app.cli", src, mods)}
    assert got == {
        ("__init__", "module"),
        ("fused.model", "module"),
        ("fused", "module"),
        ("config", "module"),
        ("app.validate", "module"),
        ("core.engine", "module"),
        ("core", "module"),  # Graph: a name of the core package
        ("app.flows", "module"),
        ("app.plots", "module"),
        ("app.trace", "module"),
        ("core.gemm", "module"),
        ("layer.model", "type"),
        ("core.simpy_engine", "deferred"),
        ("app.bench", "deferred"),
    }
    assert cycles({"a": {"b"}, "b": {"a", "c"}, "c": {"a"}}) == {("a", "b"), ("a", "b", "c")}
    assert cycles({"a": {"b"}, "b": {"c"}, "c": set()}) == set()


def test_every_sim_module_is_on_a_level():
    assert {m.split(".")[0] for m in MODULES} == set(LAYERS)
    assert {"core.engine", "core.transfer", "comm.model", "layer.model", "fused.model"} <= set(
        MODULES
    )


def test_layering_check_fails_an_import_from_a_lower_level():
    up = [
        Edge("core.transfer", "layer.model", 1, "type"),
        Edge("comm.model", "layer.model", 2, "module"),
        Edge("config", "comm.profile", 3, "deferred"),
        Edge("fused.model", "app.emit", 4, "deferred"),
    ]
    down = [
        Edge("layer.model", "core.transfer", 5, "module"),
        Edge("app.cli", "fused.tune", 6, "deferred"),
        Edge("comm.model", "config", 7, "module"),
        Edge("config", "measured", 8, "module"),  # one level
        Edge("__init__", "app.cli", 9, "deferred"),
    ]
    assert layering_violations(up + down) == up


def test_subpackages_import_one_way():
    bad = layering_violations(EDGES)
    assert not bad, "imports from a lower level to a higher one (core <- config / measured <- "
    "comm <- layer <- fused <- app):\n" + "\n".join(
        f"{_where(e.src)}:{e.line} imports sim.{e.dst} ({e.kind})" for e in bad
    )


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


def test_package_inits_import_no_sim_module():
    """``import sim.measured`` loads ``sim/__init__.py`` first: it, and every subpackage's
    ``__init__.py``, imports no sim module, so importing one module loads no model."""
    assert [e for e in EDGES if e.src in PACKAGES] == []


def test_package_entry_points_resolve():
    import sim

    for name, module in sim._ENTRY_POINTS.items():
        assert level(module.removeprefix("sim.")) <= LAYERS["__init__"]
        assert getattr(sim, name) is getattr(importlib.import_module(module), name)


@pytest.mark.parametrize("module", ["comm.fit", "fused.fit", "app.validate", "measured"])
def test_fit_and_validation_modules_in_no_circle(module):
    for cyc in cycles(graph(EDGES, ("module", "deferred", "type"))):
        assert module not in cyc, _describe(cyc, EDGES)


def test_fits_and_validate_read_measured_rows_from_sim_measured():
    # the fits and validate read the measured rows and subsets from sim.measured, at module
    # level; it imports no other sim module
    edges = {(e.src, e.dst, e.kind) for e in EDGES}
    for src in ("comm.fit", "fused.fit", "app.validate"):
        assert (src, "measured", "module") in edges, src
    assert [e for e in EDGES if e.src == "measured"] == []
    # validate scores predictions, the fits live with their models
    assert not [e for e in EDGES if (e.src, e.dst) == ("app.validate", "comm.fit")]


def test_one_transfer_builder():
    """The layer model and the standalone kernel model build transfers with the same class."""
    from sim.comm.model import PhaseBuilder
    from sim.core.transfer import TransferBuilder
    from sim.layer.model import LayerBuilder

    assert PhaseBuilder.__mro__[1] is TransferBuilder
    assert LayerBuilder.__mro__[1] is TransferBuilder
    assert "transfer" not in vars(PhaseBuilder) and "transfer" not in vars(LayerBuilder)
