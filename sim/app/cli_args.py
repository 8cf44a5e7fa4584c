"""Argument types and path checks of ``mok-sim``: numbers that must be finite and in range,
lists, skew specs, and the input and output files a command names (checked before any work
starts, so that a bad path costs one line, not a traceback after a long run)."""

from __future__ import annotations

import argparse
import json
import math
import os
from collections.abc import Callable, Sequence
from pathlib import Path

from mok.spec.workload import Skew
from sim.comm.profile import KERNEL_PROFILE_FORMAT, load_kernel_profile
from sim.config import COMBINE_MODES, DISPATCH_MODES
from sim.core.hardware import profiles_dir
from sim.fused.profile import FUSED_PROFILE_FORMAT, load_fused_profile

__all__ = [
    "CliError",
    "int_arg",
    "positive_float",
    "int_list",
    "choice_list",
    "skew_arg",
    "dispatch_modes_arg",
    "combine_modes_arg",
    "check_output",
    "OUTPUT_DIR",
    "check_input",
    "read_text",
    "json_format",
    "check_profile",
    "check_paths",
    "read_probe",
    "PROBE_KINDS",
]


class CliError(Exception):
    """A bad path or input file: ``main`` prints it as one line on stderr and exits 2."""


# -- argument types: each rejects what it cannot use (NaN and inf included) with a message ------
def int_arg(lo: int = 1) -> Callable[[str], int]:
    """An argparse type: an integer >= ``lo``."""

    def parse(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"expected an integer >= {lo}, found {text!r}"
            ) from None
        if v < lo:
            raise argparse.ArgumentTypeError(f"expected an integer >= {lo}, found {v}")
        return v

    return parse


def positive_float(text: str) -> float:
    """An argparse type: a finite number > 0."""
    try:
        v = float(text)
    except ValueError:
        v = math.nan
    if not math.isfinite(v) or v <= 0:
        raise argparse.ArgumentTypeError(f"expected a finite number > 0, found {text!r}")
    return v


def int_list(lo: int = 1) -> Callable[[str], list[int]]:
    """An argparse type: a comma-separated list of integers >= ``lo`` (``8,16,24``)."""
    one = int_arg(lo)

    def parse(text: str) -> list[int]:
        try:
            out = [one(x) for x in text.split(",") if x.strip()]
        except argparse.ArgumentTypeError as e:
            raise argparse.ArgumentTypeError(f"{e} in the list {text!r}") from None
        if not out:
            raise argparse.ArgumentTypeError(
                f"expected an integer >= {lo} or a comma-separated list of them, found {text!r}"
            )
        return out

    return parse


def choice_list(choices: Sequence[str], what: str) -> Callable[[str], list[str]]:
    """An argparse type: a comma-separated list of ``choices`` (``pull,push``)."""

    def parse(text: str) -> list[str]:
        out = [x.strip() for x in text.split(",") if x.strip()]
        bad = [x for x in out if x not in choices]
        if bad or not out:
            raise argparse.ArgumentTypeError(
                f"expected a comma-separated list of {what}s ({', '.join(choices)}), found {text!r}"
            )
        return out

    return parse


dispatch_modes_arg = choice_list(DISPATCH_MODES, "dispatch mode")
combine_modes_arg = choice_list(COMBINE_MODES, "combine mode")


def skew_arg(text: str) -> str:
    """An argparse type: a skew spec that :meth:`mok.spec.workload.Skew.parse` reads (kept as
    written)."""
    try:
        Skew.parse(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


# -- paths: every file a command reads or writes is checked before the long work ----------------
# per command: (attribute, flag, is a figure) of the files it writes
_OUTPUTS: dict[str | None, tuple[tuple[str, str, bool], ...]] = {
    None: (("out", "--out", True),),
    "compare": (("csv", "--csv", False),),
    "sweep": (("out", "--out", False), ("heatmap", "--heatmap", True)),
    "tune": (("emit_config", "--emit-config", False),),
    "trace": (
        ("out", "--out", False),
        ("csv", "--csv", False),
        ("gantt", "--gantt", True),
        ("links", "--links", True),
    ),
    "calibrate": (("out", "--out", False),),
    "validate": (
        ("csv", "--csv", False),
        ("plot", "--plot", True),
        ("save_profile", "--save-profile", False),
    ),
}
# (attribute, flag, kind) of the profile arguments: a name under sim/profiles or a JSON path
_PROFILE_ARGS = (
    ("kernel_profile", "--kernel-profile", "kernel"),
    ("profile", "--profile", "kernel"),
    ("fused_profile", "--fused-profile", "fused"),
    ("gemm_profile", "--gemm-profile", "fused"),
)
PROBE_KINDS = (
    "calibrate reads the probe JSON of `torchrun --nproc-per-node=2 -m mok.bench probe` "
    "(an object with a 'results' object)"
)


OUTPUT_DIR = "build"  # git-ignored; the default home of every file the commands write


def check_output(path: str, flag: str, figure: bool) -> None:
    """Raise :class:`CliError` unless ``path`` can be written (its folder exists and is
    writable, it is not a folder, a figure's extension is one matplotlib writes). A missing
    folder of a relative path under :data:`OUTPUT_DIR` (``build/...``) is created; any other
    missing folder is an error."""
    if not path.strip():
        raise CliError(f"{flag} needs a file name (found an empty string)")
    p = Path(path)
    parent = p.parent
    if p.is_dir():
        raise CliError(f"cannot write {path}: Is a directory (give {flag} a file name)")
    if not parent.exists() and not p.is_absolute() and p.parts[0] == OUTPUT_DIR:
        try:
            parent.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise CliError(f"cannot create the folder {parent}: {e.strerror or e}") from None
    if not parent.exists():
        raise CliError(
            f"cannot write {path}: No such file or directory (create the folder {parent} first "
            f"or give {flag} another path)"
        )
    if not parent.is_dir():
        raise CliError(f"cannot write {path}: {parent} is not a directory")
    if not (os.access(p, os.W_OK) if p.exists() else os.access(parent, os.W_OK | os.X_OK)):
        raise CliError(
            f"cannot write {path}: Permission denied (give {flag} a path in a writable folder)"
        )
    if figure and p.suffix:
        from matplotlib.backend_bases import FigureCanvasBase

        kinds = sorted(FigureCanvasBase.get_supported_filetypes())
        if p.suffix[1:].lower() not in kinds:
            raise CliError(
                f"cannot write {path}: matplotlib does not write {p.suffix} figures (give "
                f"{flag} one of .{', .'.join(kinds)})"
            )


def check_input(path: str, what: str) -> None:
    """Raise :class:`CliError` unless ``path`` is a readable file."""
    p = Path(path)
    if not p.exists():
        raise CliError(f"cannot read {path}: No such file or directory (check the {what} path)")
    if p.is_dir():
        raise CliError(f"cannot read {path}: Is a directory (give the {what} file)")
    if not os.access(p, os.R_OK):
        raise CliError(f"cannot read {path}: Permission denied")


def read_text(path: str, what: str) -> str:
    check_input(path, what)
    try:
        return Path(path).read_text()
    except UnicodeDecodeError:
        raise CliError(f"cannot read {path}: not a text file (expected a {what})") from None
    except OSError as e:
        raise CliError(f"cannot read {path}: {e.strerror or e}") from None


def json_format(path: Path) -> str | None:
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError, RecursionError):
        return None
    return doc.get("format") if isinstance(doc, dict) else None


def check_profile(value: str, flag: str, kind: str) -> None:
    """Raise :class:`CliError` unless the profile argument loads: a name under sim/profiles
    (as the loaders resolve it: no file extension) or a path to a JSON of the right format."""
    fmt, load = {
        "kernel": (KERNEL_PROFILE_FORMAT, load_kernel_profile),
        "fused": (FUSED_PROFILE_FORMAT, load_fused_profile),
    }[kind]
    p = Path(value)
    if not p.suffix:
        folder = profiles_dir()
        p = folder / f"{value}.json"
        if not p.is_file():
            names = sorted(q.stem for q in folder.glob("*.json") if json_format(q) == fmt)
            raise CliError(
                f"{flag} {value}: profile not found (no {value}.json under sim/profiles; the "
                f"{fmt} profiles there: {', '.join(names)}); give one of those names or a path "
                f"to a {fmt} JSON"
            )
    text = read_text(str(p), f"{fmt} JSON")
    try:
        doc = json.loads(text)
    except (ValueError, RecursionError) as e:
        raise CliError(
            f"cannot use {p} ({flag}): not valid JSON ({e}); expected a {fmt} JSON"
        ) from None
    found = doc.get("format", fmt) if isinstance(doc, dict) else None
    if found != fmt:
        what = f"a {found!r} file" if isinstance(found, str) else "not a JSON object"
        raise CliError(f"cannot use {p} ({flag}): it is {what}, not a {fmt} JSON")
    try:
        load(p)
    except (TypeError, KeyError, ValueError, AttributeError) as e:
        raise CliError(
            f"cannot use {p} ({flag}): not a valid {fmt} JSON ({type(e).__name__}: {e})"
        ) from None


def check_paths(a: argparse.Namespace) -> None:
    """Every path argument of the command, before it runs (:class:`CliError` if one is bad)."""
    for attr, flag, figure in _OUTPUTS.get(a.cmd, ()):
        v = getattr(a, attr, None)
        if v is not None:
            check_output(v, flag, figure)
    if a.cmd == "calibrate":
        check_input(a.probe, "probe JSON")
    if a.cmd == "validate":
        for m in a.measured:
            check_input(m, "measured CSV")
    for attr, flag, kind in _PROFILE_ARGS:
        v = getattr(a, attr, None)
        if v is not None:
            check_profile(v, flag, kind)


def read_probe(path: str) -> dict:
    text = read_text(path, "probe JSON")
    try:
        doc = json.loads(text)
    except (ValueError, RecursionError) as e:
        raise CliError(f"{path} is not a probe JSON: not valid JSON ({e}); {PROBE_KINDS}") from None
    if not isinstance(doc, dict):
        raise CliError(
            f"{path} is not a probe JSON: a JSON {type(doc).__name__}, not an object; {PROBE_KINDS}"
        )
    if not isinstance(doc.get("results"), dict):
        fmt = doc.get("format")
        what = f"a {fmt!r} file" if isinstance(fmt, str) else "no 'results' object"
        raise CliError(f"{path} is not a probe JSON ({what}); {PROBE_KINDS}")
    return doc
