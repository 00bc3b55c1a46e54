"""Routes: the contract, the registry, and the built-in routes (registered on import)."""

import importlib
import os

from mlatune.errors import SettingError
from mlatune.routes.aiter import AITER_ROUTES
from mlatune.routes.base import (
    DEVICE_PLANNED,
    HOST_PLANNED,
    LAUNCH_ONLY,
    YES,
    Params,
    Prepared,
    Route,
    SharedPlan,
    StepKind,
    Verdict,
    no,
    params_at,
    rounding,
    step_kind_of,
    with_defaults,
)
from mlatune.routes.flashinfer import FLASHINFER_ROUTES
from mlatune.routes.flashmla import FlashMLARoute
from mlatune.routes.gluon_hopper import (
    SeesawGluonRoute,
    TransposedGluonRoute,
    TransposedMma8GluonRoute,
    WgmmaGluonRoute,
)
from mlatune.routes.prefill_triton import BF16PersistentPrefillRoute, FP8PersistentPrefillRoute
from mlatune.routes.registry import (
    FACTS,
    all_routes,
    backend_status,
    declared_step_kind,
    get,
    plan_sharing,
    register,
    unregister,
    verdicts,
    viable,
)
from mlatune.routes.sdpa import SdpaPrefillRoute
from mlatune.routes.torch_ref import TorchReferenceRoute
from mlatune.routes.triton_decode import TRITON_DECODE_ROUTES


def _built_in(route: Route) -> None:
    """Register a route of mlatune's own; one an earlier import of this package registered
    before it stopped (a plugin's error, raised below) is this very route, kept."""
    try:
        known = get(route.id)
    except KeyError:
        known = None
    if type(known) is not type(route):
        register(route)  # (a route of another class under its id: the registry refuses it)


_built_in(TorchReferenceRoute())
_built_in(FP8PersistentPrefillRoute())
_built_in(BF16PersistentPrefillRoute())
_built_in(SdpaPrefillRoute())
for _route in TRITON_DECODE_ROUTES:
    _built_in(_route())
_built_in(WgmmaGluonRoute())  # Hopper only; needs triton 3.6 (checked when asked)
_built_in(SeesawGluonRoute())  # the same, warp-specialized
_built_in(TransposedGluonRoute())  # keys as the MMA's M; also fp8 caches
_built_in(TransposedMma8GluonRoute())  # the same with fp8 MMAs over an fp8 cache
_built_in(FlashMLARoute())  # NVIDIA vendor kernels: their libraries are imported when asked
for _route in FLASHINFER_ROUTES:
    _built_in(_route)
for _route in AITER_ROUTES:  # refuse off AMD; import aiter only when asked on an AMD device
    _built_in(_route)

PLUGINS_ENV = "MLATUNE_PLUGINS"


def _load_plugins() -> None:
    """Import the modules named in MLATUNE_PLUGINS (comma-separated); they register routes.

    Sweep workers are fresh processes: an environment variable reaches them where
    a registration made in the parent would not. A module that fails to import is a
    ``SettingError`` naming the variable and the module (the cause chained), not an
    error of whatever was being loaded when the routes were first imported.
    """
    for name in os.environ.get(PLUGINS_ENV, "").split(","):
        if not name.strip():
            continue
        try:
            importlib.import_module(name.strip())
        except Exception as exc:  # whatever a plugin raises on import
            cause = (str(exc).splitlines() or [""])[0]
            raise SettingError(f"{PLUGINS_ENV}: plugin module {name.strip()!r} does not "
                               f"import ({type(exc).__name__}: {cause})") from exc


_load_plugins()

__all__ = [
    "DEVICE_PLANNED",
    "FACTS",
    "HOST_PLANNED",
    "LAUNCH_ONLY",
    "YES",
    "Params",
    "Prepared",
    "Route",
    "SharedPlan",
    "StepKind",
    "Verdict",
    "all_routes",
    "backend_status",
    "declared_step_kind",
    "get",
    "no",
    "params_at",
    "plan_sharing",
    "register",
    "rounding",
    "step_kind_of",
    "unregister",
    "verdicts",
    "viable",
    "with_defaults",
]
