"""How an engine calls a route's step: where its per-step plan runs, and whether plan and
launch replay from one CUDA graph. Routes declare it; tables store it; the cost of a step
(``mlatune.table.cost``) depends on it."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal, Protocol

PlanOn = Literal["none", "device", "host"]
PLAN_PLACES: tuple[PlanOn, ...] = ("none", "device", "host")


@dataclass(frozen=True)
class StepKind:
    """How an engine calls a route's step.

    ``capturable``: plan and launch can be captured in one CUDA graph and replayed
    with new lengths (and block-table entries) written in place.
    """

    plan_on: PlanOn
    capturable: bool

    def __post_init__(self) -> None:
        if self.plan_on not in PLAN_PLACES:
            raise ValueError(f"plan_on must be one of {PLAN_PLACES}, got {self.plan_on!r}")
        if self.plan_on == "host" and self.capturable:
            raise ValueError("a step planned on the host cannot be captured")


LAUNCH_ONLY = StepKind("none", True)  # a capturable launch that reads the lengths itself
HOST_PLANNED = StepKind("host", False)  # prepared again from the lengths every step
DEVICE_PLANNED = StepKind("device", True)  # a device plan, captured with the launch

UNKNOWN_STEP_KIND = ("host", False)  # a step kind nobody declared: never captured


class RouteFacts(Protocol):
    """What a table is told of the routes, which it does not import (``mlatune.routes.FACTS``
    answers for the registered ones)."""

    def step_kind(self, route_id: str, params: Mapping[str, Any] | str) -> tuple[str, bool]:
        """(plan_on, capturable) the route declares for ``params`` (a dict or its JSON);
        UNKNOWN_STEP_KIND for a route not known."""
        ...

    def route_of(self, route_id: str, params: Mapping[str, Any]) -> str:
        """The route a stored parameter set of ``route_id`` belongs to: ``route_id``, or the
        route its kernel form became (asked before ``upgrade_params``); as stored for a route
        not known."""
        ...

    def upgrade_params(self, route_id: str, params: Mapping[str, Any]
                       ) -> Mapping[str, Any] | None:
        """A stored parameter set in the route's current spelling; None where it names a
        deleted kernel form (the row is stale); as stored for a route not known."""
        ...

    def param_problem(self, route_id: str, params: Mapping[str, Any]) -> str | None:
        """Why the route cannot run a stored parameter set (None: it can, or the route is not
        known)."""
        ...

    def plan_sharing(self) -> frozenset[str]:
        """The routes whose host plan the calls of one engine step share (the cost's
        ``shares_host_plan``)."""
        ...
