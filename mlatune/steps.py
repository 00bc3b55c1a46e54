"""How an engine calls a route's step: where its per-step plan runs, and whether plan and
launch replay from one CUDA graph. Routes declare it; tables store it; the cost of a step
(``mlatune.table.cost``) depends on it."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

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

# (route id, params) -> (plan_on, capturable) as the route declares it: handed to the table
# where it fills rows stored without a step kind (``mlatune.routes.declared_step_kind``).
StepKinds = Callable[[str, Mapping[str, Any] | str], tuple[str, bool]]
UNKNOWN_STEP_KIND = ("host", False)  # a step kind nobody declared: never captured
