"""Registry of routes by id, and which of them can serve a problem."""

from __future__ import annotations

import importlib
import json
import re
from collections.abc import Mapping
from typing import Any

from mlatune.arch import DeviceInfo
from mlatune.problem import MLAProblem
from mlatune.routes.base import Route, Verdict
from mlatune.steps import UNKNOWN_STEP_KIND

_ROUTE_ID = re.compile(r"^[a-z0-9][a-z0-9-]*/[a-z0-9][a-z0-9-]*$")
_ROUTES: dict[str, Route] = {}


def register(route: Route) -> Route:
    """Add a route; ids are unique and shaped ``<family>/<backend>``."""
    if not _ROUTE_ID.match(route.id):
        raise ValueError(f"route id {route.id!r} is not '<family>/<backend>' in lower case")
    if route.id in _ROUTES and _ROUTES[route.id] is not route:
        raise ValueError(f"route id {route.id!r} is already registered")
    _ROUTES[route.id] = route
    return route


def unregister(route_id: str) -> None:
    _ROUTES.pop(route_id, None)


def get(route_id: str) -> Route:
    try:
        return _ROUTES[route_id]
    except KeyError:
        raise KeyError(f"unknown route {route_id!r}; known: {', '.join(sorted(_ROUTES))}") from None


def all_routes() -> list[Route]:
    return [_ROUTES[k] for k in sorted(_ROUTES)]


def verdicts(problem: MLAProblem, device: DeviceInfo,
             only: list[str] | None = None) -> list[tuple[Route, Verdict]]:
    """Every (selected) route with its answer for this problem on this device."""
    routes = all_routes() if only is None else [get(r) for r in only]
    return [(r, r.supports(problem, device)) for r in routes]


def viable(problem: MLAProblem, device: DeviceInfo, only: list[str] | None = None) -> list[Route]:
    return [r for r, v in verdicts(problem, device, only) if v.ok]


def plan_sharing() -> frozenset[str]:
    """The registered routes whose plan the calls of one engine step share (``shares_plan``):
    what ``table.cost.step_cost`` calls ``shares_host_plan``."""
    return frozenset(r.id for r in _ROUTES.values() if r.shares_plan)


class RegistryFacts:
    """The registered routes' facts a table needs (``steps.RouteFacts``)."""

    def step_kind(self, route_id: str, params: Mapping[str, Any] | str) -> tuple[str, bool]:
        return declared_step_kind(route_id, params)

    def route_of(self, route_id: str, params: Mapping[str, Any]) -> str:
        route = _ROUTES.get(route_id)
        return route_id if route is None else route.route_of(dict(params))

    def upgrade_params(self, route_id: str, params: Mapping[str, Any]
                       ) -> Mapping[str, Any] | None:
        route = _ROUTES.get(route_id)
        return params if route is None else route.upgrade_params(dict(params))

    def param_problem(self, route_id: str, params: Mapping[str, Any]) -> str | None:
        route = _ROUTES.get(route_id)
        return None if route is None else route.check_params(dict(params))

    def plan_sharing(self) -> frozenset[str]:
        return plan_sharing()


FACTS = RegistryFacts()


def declared_step_kind(route_id: str, params: Mapping[str, Any] | str) -> tuple[str, bool]:
    """(plan_on, capturable) that ``route_id`` declares for ``params`` (a dict or its JSON);
    UNKNOWN_STEP_KIND for a route not registered here or params that are not an object.
    A ``steps.RouteFacts``: what the table is handed to fill rows stored without a kind."""
    try:
        route = get(route_id)
        params = json.loads(params) if isinstance(params, str) else params
    except (KeyError, ValueError):
        return UNKNOWN_STEP_KIND
    if not isinstance(params, Mapping):
        return UNKNOWN_STEP_KIND
    kind = route.step_kind(dict(params))
    return kind.plan_on, kind.capturable


# The library each built-in route backend (a route id's part after "/") imports.
BACKEND_MODULES = {"torch": "torch", "triton": "triton", "gluon": "triton.experimental.gluon",
                   "aiter": "aiter", "flashmla": "flash_mla", "flashinfer": "flashinfer"}


def backend_status(name: str) -> tuple[bool, str]:
    """Whether a route backend's library imports here, with its version or the error (a
    plugin's backend: registered, so its module imported)."""
    module = BACKEND_MODULES.get(name)
    if module is None:
        return True, "a plugin's routes (registered)"
    try:
        mod = importlib.import_module(module)
    except Exception as exc:  # any import failure means the backend is unusable here
        return False, f"{type(exc).__name__}: {exc}".splitlines()[0]
    return True, str(getattr(mod, "__version__", "installed"))
