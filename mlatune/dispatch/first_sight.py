"""On first sight: a shape the table answers unsurely is timed once, at run time, among
the routes predicted fastest there, and the result joins the user's table.

Opt-in (``Dispatcher.load(first_sight=PATH)``, or ``MLATUNE_FIRST_SIGHT=PATH`` for
``from_bundled``; PATH is the user table, ``MLATUNE_USER_TABLE`` overlays it at the next
load). ``attention.decode`` calls ``measure`` when it makes a step for a problem whose
answer is ``unsure`` and no CUDA graph is being captured: each candidate is prepared on
the caller's own tensors (its own output buffers), run, and timed as a sweep times
(``measure.timers``: CUDA-graph replay on a GPU, wall clock on the CPU). The candidates are
checked against each other, not against the reference (that would cost an fp32
attention of the engine's size): one whose output differs from the dispatcher's own
answer by more than the problem's tolerance is dropped (the looser tolerance of either
one's declared rounding, ``routes.rounding``: a quantized q, P in fp8). The fastest one
that agrees is remembered for the problem at once and written to the user table
(atomically, its earlier rows for the problem replaced).

Under a process group (``Dispatcher.load(group=)``) every rank times the candidates on its
own tensors and ``mlatune.dispatch.ranks.agree_on_timings`` makes the timings one (each
candidate at its slowest rank's time): every rank remembers and records the same pick.
"""

from __future__ import annotations

import logging
import math
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from mlatune import table
from mlatune.check.accuracy import check, looser
from mlatune.dispatch import ranks
from mlatune.measure import timers
from mlatune.measure.records import table_rows
from mlatune.problem import MLAProblem
from mlatune.routes import FACTS, plan_sharing, rounding
from mlatune.table import user
from mlatune.table.schema import Provenance

log = logging.getLogger("mlatune")

if TYPE_CHECKING:
    from mlatune.check.inputs import DecodeInputs
    from mlatune.dispatch.dispatcher import Choice, Dispatcher

CANDIDATES = 3  # the dispatcher's answer and the next predicted routes
UNSURE = 0.10  # a predicted answer's expected error past which a shape is timed
BUDGET = timers.Budget(warmup=1, min_reps=5, max_reps=30, max_seconds=0.05, race_ratio=0.0)
FIRST_SIGHT_SPEC = "first-sight"  # the spec_sha256 its rows carry: not from a sweep spec


def unsure(choice: Choice) -> bool:
    """Whether the dispatcher's answer is a guess worth timing: a neighbour's, a cost law's
    (a bucket never measured) or a rule's, or a prediction expected to be off by more than
    UNSURE."""
    if choice.source in ("nearest", "law", "rule"):
        return True
    return choice.source == "predicted" and choice.uncertainty > UNSURE


def measure(dispatcher: Dispatcher, problem: MLAProblem, prepared_for: MLAProblem,
            inputs: DecodeInputs, rank: int, want_lse: bool) -> Choice | None:
    """Time the candidates for ``problem`` on these tensors (prepared for
    ``prepared_for``, as ``attention`` prepares its steps); remember and record the
    fastest that agrees with the dispatcher's answer. None when none could run."""
    first = dispatcher.select(problem)
    candidates = [first, *(c for c in dispatcher.predicted_choices(problem, CANDIDATES)
                           if (c.route_id, dict(c.params)) != (first.route_id,
                                                                dict(first.params)))]
    timed: list[tuple[float, Choice, Any]] = []
    anchor, anchor_rounding = None, {}
    for choice in candidates[:CANDIDATES]:
        try:
            route = dispatcher.route(choice.route_id)
            prepared = route.prepare(prepared_for, inputs, rank=rank,
                                     params=dict(choice.params), want_lse=want_lse)
            prepared.step()
            out = prepared.out.float().clone()
            timing = timers.measure(prepared.step, inputs.q.device, BUDGET,
                                   graph_safe=prepared.step_kind.capturable)
            rounds = rounding(route, problem, dict(choice.params))
        except Exception:  # a candidate that cannot run here is no candidate
            continue
        if anchor is None:
            anchor, anchor_rounding = out, rounds
        elif not check(problem, out, anchor, rounding=looser(rounds, anchor_rounding)).ok:
            continue  # disagrees with the dispatcher's answer: not trusted
        timed.append((timing.median_us, choice, prepared.params))
    provenance = Provenance.here(FIRST_SIGHT_SPEC)
    timed, provenance = ranks.agree_on_timings(dispatcher.group, problem,
                                               candidates[:CANDIDATES], timed, provenance)
    if not timed:
        return None
    time_us, choice, _ = min(timed, key=lambda t: t[0])
    won = replace(choice, source="table", key=problem.key, time_us=time_us,
                  uncertainty=math.nan)
    dispatcher.remember(problem, won)
    if dispatcher.first_sight is not None:
        try:
            _record(dispatcher, problem, timed, Path(dispatcher.first_sight), provenance)
        # The step serves on; the pick is not kept. ImportError: the runtime install, whose
        # first sight remembers picks in this process but cannot write a table (pandas).
        except (OSError, ValueError, ImportError) as exc:
            log.warning("mlatune: MLATUNE_FIRST_SIGHT=%s: cannot record the pick for %s (%s); "
                        "served, not recorded", dispatcher.first_sight, problem.key,
                        str(exc).splitlines()[0] if str(exc) else type(exc).__name__)
    return won


def _record(dispatcher: Dispatcher, problem: MLAProblem,
            timed: list[tuple[float, Choice, Any]], path: Path, provenance: Provenance) -> None:
    """Add the problem's timed candidates to the user table, replacing its earlier rows
    (under the table's lock: a tuning process may be merging into it)."""
    import json

    records = [{"key": problem.key_dict(), "route": c.route_id,
                "route_params": json.dumps({**dict(c.params), **dict(p or {})},
                                           sort_keys=True, default=str),
                "status": "ok", "time_us": t} for t, c, p in timed]
    new = table.build(table_rows(records, dispatcher.device), provenance, facts=FACTS,
                      sharing=plan_sharing())
    user.merge(path, new, FACTS, plan_sharing())


def enabled(dispatcher: Dispatcher) -> bool:
    """First sight is on for this dispatcher and nothing is being captured."""
    return dispatcher.first_sight is not None and not (
        torch.cuda.is_available() and torch.cuda.is_current_stream_capturing())
