"""Accuracy policies: which rounding beyond a problem's own dtypes a caller lets be served.

A route declares its numeric class per parameter set (``Route.rounding``); a policy admits
some classes, and a measured row only when its recorded error is within its class's bound
(``check.accuracy.tolerance_for``). The cache's dtype is the user's choice, a kernel's extra
rounding is not: under ``strict`` a bf16 q over an fp8 cache is held to the bf16 bound.
Over an fp8 q every class is the problem's own (the fp8 bound), so every policy admits it.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

from mlatune.check.accuracy import Rounding, tolerance_for
from mlatune.errors import SettingError
from mlatune.problem import FP8_DTYPES

ACCURACY_ENV = "MLATUNE_ACCURACY"  # the policy when a caller names none


@dataclass(frozen=True)
class Policy:
    name: str
    admits: frozenset[Rounding]
    description: str

    def admits_class(self, q_dtype: str, rounding: Rounding) -> bool:
        """Whether a route rounding so may serve a problem with this q dtype."""
        return q_dtype in FP8_DTYPES or Rounding(rounding) in self.admits

    def admits_row(self, q_dtype: str, kv_dtype: str, rounding: Rounding,
                   rel_err: float) -> bool:
        """Whether a measured row may serve: its class admitted, and its recorded output
        error (NaN: none recorded) within that class's bound for the problem's dtypes."""
        return self.admits_class(q_dtype, rounding) and (
            math.isnan(rel_err) or rel_err <= self.bound(q_dtype, kv_dtype, rounding))

    @staticmethod
    def bound(q_dtype: str, kv_dtype: str, rounding: Rounding) -> float:
        """The output's relative L2 error bound of a row of this class."""
        return tolerance_for(q_dtype, kv_dtype, rounding=Rounding(rounding)).rel_l2


STRICT = Policy("strict", frozenset({Rounding.NONE}),
                "only the problem's own dtypes: a 16-bit q keeps its bound over an fp8 cache")
FP8_MMA = Policy("fp8-mma", frozenset({Rounding.NONE, Rounding.P_FP8}),
                 "also P rounded to fp8 for P.V, q kept near 16 bits")
FAST = Policy("fast", frozenset(Rounding),
              "also a 16-bit q quantized to fp8 per tensor: whatever is fastest")
POLICIES = {p.name: p for p in (STRICT, FP8_MMA, FAST)}
DEFAULT_POLICY = STRICT


def policy_named(name: str | Policy | None) -> Policy:
    """The policy ``name`` names; None: ``MLATUNE_ACCURACY``'s, else ``strict``. An unknown
    name is a ValueError naming the argument, or a SettingError naming the variable, and the
    names there are."""
    if isinstance(name, Policy):
        return name
    error: type[ValueError] = ValueError
    where = "accuracy"
    if name is None:
        name = os.environ.get(ACCURACY_ENV) or DEFAULT_POLICY.name
        error, where = SettingError, ACCURACY_ENV
    policy = POLICIES.get(str(name).strip().lower())
    if policy is None:
        raise error(f"{where}: unknown accuracy policy {name!r}; one of {', '.join(POLICIES)}")
    return policy
