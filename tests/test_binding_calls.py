"""Every call of a compiled binding (``csrc/torch/bindings.cpp``) from Python passes as many
arguments as the C++ function takes, read from the source (no compiler, no GPU).

The calls run only on a GPU, so a binding that gains a parameter while a caller keeps the old
count is otherwise found on the device machine, as a ``TypeError`` (a GPU test once passed 10 of
the fused backward's 13 transfer words). Calls whose count cannot be read statically (a
``*args`` forwarded from elsewhere) are skipped; at least the launch calls must be checked.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CSRC = ROOT / "csrc"
DEF = re.compile(r'm\.def\("(\w+)",\s*&([\w:]+)')


def _param_count(cpp_name: str) -> int:
    """Parameters of the C++ function ``cpp_name``: an unqualified name is bindings.cpp's own
    wrapper, a qualified one (``mok::...``) is looked up in csrc/'s other files (its first
    definition or declaration with a return type)."""
    name = cpp_name.split("::")[-1]
    head = re.compile(r"\b(?:void|int|int64_t|uint64_t|double|float|bool)\s+" + name + r"\s*\(")
    bindings = CSRC / "torch" / "bindings.cpp"
    files = [bindings] if "::" not in cpp_name else sorted(CSRC.rglob("*"))
    for f in files:
        if f.suffix not in (".cpp", ".cu", ".h", ".cuh") or ("::" in cpp_name and f == bindings):
            continue
        text = f.read_text()
        m = head.search(text)
        if not m:
            continue
        depth, i = 1, m.end()
        while depth:
            depth += {"(": 1, ")": -1}.get(text[i], 0)
            i += 1
        params = text[m.end() : i - 1].strip()
        if not params or params == "void":
            return 0
        depth, count = 0, 1
        for ch in params:
            depth += {"(": 1, "<": 1, ")": -1, ">": -1}.get(ch, 0)
            count += ch == "," and depth == 0
        return count
    raise AssertionError(f"no definition of {cpp_name} under csrc/")


def _bindings() -> dict[str, int]:
    text = (CSRC / "torch" / "bindings.cpp").read_text()
    return {py: _param_count(cpp) for py, cpp in DEF.findall(text)}


def _tuple_lengths(tree: ast.AST) -> dict[str, int]:
    """Names a file assigns only tuple literals of one length to (``peers = (0, 0, 0)``)."""
    seen: dict[str, set[int]] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and len(node.targets) == 1:
            t = node.targets[0]
            if isinstance(t, ast.Name):
                n = len(node.value.elts) if isinstance(node.value, ast.Tuple) else -1
                seen.setdefault(t.id, set()).add(n)
    return {k: v.pop() for k, v in seen.items() if len(v) == 1 and -1 not in v}


def _arg_count(call: ast.Call, tuples: dict[str, int]) -> int | None:
    """Positional arguments of ``call``, or None where a starred one's length is unknown."""
    n = 0
    for a in call.args:
        if not isinstance(a, ast.Starred):
            n += 1
        elif isinstance(a.value, ast.Name) and a.value.id in tuples:
            n += tuples[a.value.id]
        elif isinstance(a.value, (ast.List, ast.Tuple)):
            n += len(a.value.elts)
        elif (
            isinstance(a.value, ast.BinOp)
            and isinstance(a.value.op, ast.Mult)
            and isinstance(a.value.left, (ast.List, ast.Tuple))
            and isinstance(a.value.right, ast.Constant)
        ):
            n += len(a.value.left.elts) * a.value.right.value
        else:
            return None
    return n


def _on_extension(obj: ast.expr) -> bool:
    """``ext``, ``self._ext`` or ``_ext.load()``: the names the code gives the loaded module."""
    if isinstance(obj, ast.Name):
        return obj.id == "ext"
    if isinstance(obj, ast.Attribute):
        return obj.attr == "_ext"
    return (
        isinstance(obj, ast.Call)
        and isinstance(obj.func, ast.Attribute)
        and obj.func.attr == "load"
        and isinstance(obj.func.value, ast.Name)
        and obj.func.value.id == "_ext"
    )


def _calls(names: set[str]):
    for root in ("mok", "tests"):
        for f in sorted((ROOT / root).rglob("*.py")):
            tree = ast.parse(f.read_text())
            tuples = _tuple_lengths(tree)
            for node in ast.walk(tree):
                if (
                    isinstance(node, ast.Call)
                    and isinstance(node.func, ast.Attribute)
                    and node.func.attr in names
                    and _on_extension(node.func.value)
                ):
                    yield f.relative_to(ROOT), node, _arg_count(node, tuples)


def test_the_bindings_are_found_with_their_parameters():
    b = _bindings()
    assert {"launch", "launch_layer", "launch_bwd_fused", "launch_wgrad"} <= set(b)
    assert b["launch"] == 4 and b["launch_layer"] == 4  # (kind,) params, (args,) grid, stream


def test_every_readable_call_passes_the_bindings_parameter_count():
    b = _bindings()
    checked, wrong = set(), []
    for path, call, n in _calls(set(b)):
        if n is None or call.keywords:
            continue
        name = call.func.attr
        checked.add(name)
        if n != b[name]:
            wrong.append(f"{path}:{call.lineno}: {name} with {n} arguments, takes {b[name]}")
    assert not wrong, "\n".join(wrong)
    assert {
        "launch",
        "launch_layer",
        "launch_bwd_fused",
        "launch_wgrad",
        "launch_swiglu_bwd",
    } <= checked
    # mok's own fused-backward launch is among them (its transfer words as a named tuple)
    assert any(
        str(p) == "mok/ops.py" and c.func.attr == "launch_bwd_fused" and n is not None
        for p, c, n in _calls({"launch_bwd_fused"})
    )
