"""What ``Dispatcher.select`` answers: a route, how to call it, and where that came from."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class Choice:
    """The answer to select(): which route, how to call it, and where that came from."""

    route_id: str
    params: Mapping[str, Any]  # read-only; pass as route.prepare(..., params=dict(params))
    source: str  # "table", "predicted", "nearest" or "rule"
    key: str = ""  # the measured problem the choice comes from; "" for a rule
    # Its measured step cost (``step_cost``): the launch plus the plan the caller pays;
    # for a predicted answer the prediction.
    time_us: float = math.nan
    # A predicted answer's expected relative error (0.1: about 10%; Prediction.uncertainty):
    # far from measured points or where the neighbours disagree. NaN for other answers.
    uncertainty: float = math.nan
