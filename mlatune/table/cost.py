"""What one call of a route's step costs its caller: the one definition every ranking uses.

The sweep's race, the row a route keeps per problem (``measure.records``), the table's
stored rank (``frame.assign_ranks``), ``mlatune show`` and the dispatcher all rank by
``step_cost`` under a ``Caller``, so they agree on which route wins.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# Calls that share one device plan unless a caller says otherwise: an engine plans once per
# step for all its attention layers (``attention.decode(reuse_plan=True)`` after the
# first), and DeepSeek-V3/R1 have 61 MLA layers. A caller that plans every call passes 1.
DEFAULT_PLAN_CALLS = 61


@dataclass(frozen=True)
class Caller:
    """Who pays: one that replays CUDA graphs (``capturable``) or calls eagerly, and how
    many calls share one device plan."""

    capturable: bool = False
    plan_calls: int = DEFAULT_PLAN_CALLS


DEFAULT_CALLER = Caller()


def step_cost(time_us: Any, plan_on: Any, plan_us: Any, plan_host_us: Any, capturable: bool,
              plan_calls: int = DEFAULT_PLAN_CALLS, shares_host_plan: Any = False) -> Any:
    """What one call costs a caller, in microseconds (numbers or numpy arrays alike).

    A caller that replays CUDA graphs pays the launch and its share of the device plan; an
    eager caller pays a host plan too (a whole prepare with its device sync), shared by the
    ``plan_calls`` only where the route can share it (``shares_host_plan``, per row).
    Costs a table did not measure (NaN) count as 0.
    """
    import numpy as np

    calls = max(1, plan_calls)
    cost = time_us + np.nan_to_num(plan_us) / calls
    if not capturable:
        host = np.nan_to_num(plan_host_us) / np.where(shares_host_plan, calls, 1)
        cost = cost + np.where(plan_on == "host", host, 0.0)
    return cost


def caller_cost(caller: Caller, time_us: Any, plan_on: Any, plan_us: Any, plan_host_us: Any,
                shares_host_plan: Any = False) -> Any:
    """``step_cost`` for ``caller``."""
    return step_cost(time_us, plan_on, plan_us, plan_host_us, caller.capturable,
                     caller.plan_calls, shares_host_plan)
