"""Routes: the contract, the registry, and the built-in routes (registered on import)."""

from mlatune.routes.base import YES, Params, Prepared, Route, Verdict, no
from mlatune.routes.registry import (
    all_routes,
    backend_status,
    get,
    register,
    unregister,
    verdicts,
    viable,
)
from mlatune.routes.torch_ref import TorchReferenceRoute
from mlatune.routes.triton_decode import TRITON_DECODE_ROUTES

register(TorchReferenceRoute())
for _route in TRITON_DECODE_ROUTES:
    register(_route())

__all__ = [
    "YES",
    "Params",
    "Prepared",
    "Route",
    "Verdict",
    "all_routes",
    "backend_status",
    "get",
    "no",
    "register",
    "unregister",
    "verdicts",
    "viable",
]
