"""mok: mixture-of-experts layers as one persistent GPU megakernel.

Importing mok never touches CUDA or compiles anything; the CUDA extension is built lazily on the
first kernel call.
"""

from mok.workload import PRESETS, ModelShape, RoutingTrace, Skew, get_shape, make_routing

__all__ = ["PRESETS", "ModelShape", "RoutingTrace", "Skew", "get_shape", "make_routing"]
__version__ = "0.1.0"
