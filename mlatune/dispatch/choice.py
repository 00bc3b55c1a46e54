"""What ``Dispatcher.select`` answers (a route, how to call it, where that came from), and the
sentences ``explain`` says of a measured or nearest answer."""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from mlatune.problem import MLAProblem


@dataclass(frozen=True, slots=True)
class Choice:
    """The answer to select(): which route, how to call it, and where that came from."""

    route_id: str
    params: Mapping[str, Any]  # read-only; pass as route.prepare(..., params=dict(params))
    source: str  # "table", "predicted", "nearest", "law" or "rule"
    key: str = ""  # the measured problem the choice comes from; "" for a rule
    # Its measured step cost (``step_cost``): the launch plus the plan the caller pays;
    # for a predicted or law answer the prediction.
    time_us: float = math.nan
    # A predicted answer's expected relative error (0.1: about 10%; Prediction.uncertainty):
    # far from measured points or where the neighbours disagree. NaN for other answers.
    uncertainty: float = math.nan


def nearest_notes(winner: Choice, choice: Choice) -> list[str]:
    """``explain``'s sentences for a nearest answer: the point, and its parameters redone."""
    near = MLAProblem.from_key(winner.key)
    notes = [f"nearest measured point: batch={near.batch} kv_len={near.kv_len}, won by "
             f"{winner.route_id} ({winner.time_us:.4g} us there)"]
    if choice.params != winner.params:
        notes.append(f"its parameters redone for these sizes: "
                     f"{json.dumps(dict(winner.params), sort_keys=True)} there")
    return notes


def law_notes(found: Sequence[Any]) -> list[str]:
    """``explain``'s sentences for a law answer: the fastest usable routes' predictions
    (``laws.LawPrediction``), the first answering."""
    if not found:
        return ["law: no route with a cost law serves this problem"]
    notes = [f"law: {p.route_id} {json.dumps(dict(p.params), sort_keys=True)} "
             f"{p.time_us:.4g} us (+-{100 * p.uncertainty:.0f}%; its nearest measured row: "
             f"{p.nearest.label})" for p in found]
    notes.append(f"law: {found[0].route_id} predicted fastest by its cost law in device terms "
                 f"(bytes over bandwidth, FLOPs over tensor throughput, waves over SMs), "
                 f"corrected by its nearest measured rows")
    return notes


def measured_note(choice: Choice, ranked: Sequence[Choice]) -> str:
    i = ranked.index(choice)
    text = f"measured: {choice.route_id} {choice.time_us:.4g} us"
    if i:
        text += f" (usable rank {i + 1}: the faster routes refuse this problem)"
    if i + 1 < len(ranked):
        runner = ranked[i + 1]
        text += (f"; next {runner.route_id} {runner.time_us:.4g} us "
                 f"(+{(runner.time_us / choice.time_us - 1) * 100:.1f}%)")
    return text


def held_notes(policy: str, held: Sequence[tuple[str, str, float, float]] | None,
               choice: Choice) -> list[str]:
    """``explain``'s sentences for the measured rows an accuracy policy held back at this
    problem ((route, class, recorded error, step cost), cheapest first): what each would
    have saved against the answer."""
    notes = []
    for route_id, cls, error, cost in held or ():
        if choice.source != "table" or not choice.time_us > 0:  # not measured at this key
            gain = "the answer has no cost measured here to set it against"
        else:
            saved = (1 - cost / choice.time_us) * 100
            gain = f"{saved:.1f}% less time than the answer" if saved > 0 else "no faster"
        notes.append(f"accuracy policy {policy} held back {route_id} ({cls}, recorded error "
                     f"{error:.2g}): {cost:.4g} us, {gain}")
    return notes
