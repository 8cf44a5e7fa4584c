"""Whether numba's on-disk cache already holds the simulator's compiled hot loops, so that the
command line can say, once and before it starts, that a first run is compiling them (10-20 s on
two cores for the layer model) instead of sitting silent.

The check reads numba's cache index of each ``@njit(cache=True)`` function of a module, the
file numba itself consults (in ``__pycache__`` beside the source, or under
``NUMBA_CACHE_DIR``); an index written for another version of the source does not count. A
module counts as compiled when any of its functions has an index: a run compiles the functions
it calls, and one module's other functions (paths another command takes) are not a first run.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Iterable
from typing import TextIO

__all__ = [
    "LAYER_MODULES",
    "FUSED_MODULES",
    "PLAN_MODULES",
    "COMPILING_LINE",
    "uncompiled_modules",
    "say_if_compiling",
]

# the modules whose compiled functions each kind of run needs (the layer model's event loop,
# flow solver and transfer model; the fused model's tile scheduler; the routing plan alone)
LAYER_MODULES = ("sim.core.engine", "sim.core.flows", "sim.core.transfer")
FUSED_MODULES = ("sim.fused.tiles",)
PLAN_MODULES = ("sim.layer.plan",)

COMPILING_LINE = (
    "mok-sim: first run: numba is compiling the simulator's hot loops (10-20 s for the layer "
    "model on two cores; later runs load them from numba's cache)"
)
_said = False


def _has_cache(dispatcher) -> bool:
    """Whether numba's cache holds an entry of ``dispatcher`` for its current source."""
    cache = getattr(dispatcher, "_cache", None)
    load = getattr(getattr(cache, "_cache_file", None), "_load_index", None)
    if load is None:  # a numba without these internals, or cache=False: nothing to say
        return True
    try:
        return bool(load())
    except Exception:  # noqa: BLE001 - an unreadable index: numba recompiles, so do we
        return False


def uncompiled_modules(modules: Iterable[str]) -> list[str]:
    """The ``modules`` (dotted names, imported here) none of whose cached numba functions has an
    entry in numba's cache for the current source: the ones a run will compile first."""
    from numba.core.registry import CPUDispatcher

    missing = []
    for name in modules:
        mod = importlib.import_module(name)
        jitted = [
            obj
            for obj in vars(mod).values()
            if isinstance(obj, CPUDispatcher)
            and getattr(obj, "__module__", name) == name
            and obj.targetoptions.get("inline", "never") != "always"  # compiled into callers
        ]
        if jitted and not any(_has_cache(d) for d in jitted):
            missing.append(name)
    return missing


def say_if_compiling(modules: Iterable[str], stream: TextIO | None = None) -> bool:
    """Print :data:`COMPILING_LINE` to ``stream`` (stderr) when one of ``modules`` is not in
    numba's cache; at most once per process. Returns whether it printed."""
    global _said
    if _said or not uncompiled_modules(modules):
        return False
    _said = True
    print(COMPILING_LINE, file=stream or sys.stderr, flush=True)
    return True
