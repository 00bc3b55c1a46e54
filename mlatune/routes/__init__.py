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

register(TorchReferenceRoute())

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
