"""mok: mixture-of-experts layers as one persistent GPU megakernel.

Importing mok never touches CUDA or compiles anything; the CUDA extension is built lazily on the
first kernel call.
"""

from mok.errors import (
    MoKCapacityError,
    MoKConfigError,
    MoKError,
    MoKInputError,
    MoKTimeoutError,
    MoKUnsupportedError,
)
from mok.spec.config import MoKConfig
from mok.spec.workload import PRESETS, ModelShape, RoutingTrace, Skew, get_shape, make_routing

__all__ = [
    "PRESETS",
    "ModelShape",
    "RoutingTrace",
    "Skew",
    "get_shape",
    "make_routing",
    "MoKConfig",
    "MoKError",
    "MoKConfigError",
    "MoKInputError",
    "MoKUnsupportedError",
    "MoKTimeoutError",
    "MoKCapacityError",
    "Workspace",
    "get_workspace",
    "cached_workspaces",
    "clear_workspaces",
    "check",
    "MoE",
]
__version__ = "0.1.0"


def __getattr__(name: str):
    # Workspace pulls in torch; keep `import mok` light and lazy.
    if name in ("Workspace", "get_workspace", "cached_workspaces", "clear_workspaces", "check"):
        from mok import workspace

        return getattr(workspace, name)
    if name == "MoE":
        from mok.module import MoE

        return MoE
    raise AttributeError(f"module 'mok' has no attribute {name!r}")
