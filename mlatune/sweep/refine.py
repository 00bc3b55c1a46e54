"""Where a sweep measures next: the shapes between a table's grid points whose answer the
dispatcher is least sure of (``mlatune sweep --refine SECONDS``).

A grid measures every bucket (every key field but batch and kv_len) at the same batches
and KV lengths, whether the choice there is easy or hard. Refining asks the table's own
dispatcher about the points between its grid points (the geometric midpoints of adjacent
batches and KV lengths, and both at once) and measures first those whose answer is most
uncertain: a prediction far from measured points or whose neighbours disagree
(``Choice.uncertainty``), and any that only the nearest point or the rule could answer.
A point's cost is estimated from the journal: the worker seconds its bucket's problems
took on average. Points are taken, most uncertain first, until the budget is spent.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable
from dataclasses import dataclass

from mlatune.measure.records import Record
from mlatune.problem import MLAProblem

# The uncertainty given an answer the predictor could not make (nearest or rule): above
# any prediction's, so such points come first.
UNPREDICTED = 1.0


@dataclass(frozen=True)
class Refinement:
    problem: MLAProblem
    uncertainty: float  # the dispatcher's expected relative error there (UNPREDICTED: none)
    route_id: str  # what the dispatcher answers there now
    seconds: float  # the worker time measuring it is expected to take


def _midpoints(values: Iterable[int]) -> list[int]:
    """Rounded geometric means of adjacent values, each strictly between them."""
    ordered = sorted(set(values))
    mids = []
    for lo, hi in itertools.pairwise(ordered):
        mid = round(math.sqrt(lo * hi))
        if lo < mid < hi:
            mids.append(mid)
    return mids


def between_points(measured: Iterable[MLAProblem]) -> list[MLAProblem]:
    """Per bucket, the unmeasured points between its measured batches and KV lengths."""
    by_bucket: dict[tuple, list[MLAProblem]] = {}
    for p in measured:
        by_bucket.setdefault(p.bucket, []).append(p)
    found: dict[str, MLAProblem] = {}
    for problems in by_bucket.values():
        seen = {(p.batch, p.kv_len) for p in problems}
        batches = sorted({p.batch for p in problems})
        kv_lens = sorted({p.kv_len for p in problems})
        mid_b, mid_k = _midpoints(batches), _midpoints(kv_lens)
        shapes = [(b, k) for b in mid_b for k in kv_lens] + \
                 [(b, k) for b in batches for k in mid_k] + \
                 [(b, k) for b in mid_b for k in mid_k]
        base = problems[0]
        for batch, kv_len in shapes:
            if (batch, kv_len) in seen:
                continue
            try:
                p = base.with_(batch=batch, kv_len=kv_len)
            except ValueError:  # a shape the problem rules refuse (a qlen past kv_len)
                continue
            found.setdefault(p.key, p)
    return list(found.values())


def bucket_seconds(records: Iterable[Record]) -> tuple[dict[tuple, float], float]:
    """Mean worker seconds per measured problem, per bucket and overall, from a journal."""
    per_problem: dict[str, float] = {}
    buckets: dict[str, tuple] = {}
    for r in records:
        spent = r.worker_s
        if spent <= 0 or not r.key:
            continue
        problem = r.problem
        per_problem[problem.key] = per_problem.get(problem.key, 0.0) + spent
        buckets[problem.key] = problem.bucket
    sums: dict[tuple, list[float]] = {}
    for key, spent in per_problem.items():
        sums.setdefault(buckets[key], []).append(spent)
    means = {b: sum(v) / len(v) for b, v in sums.items()}
    overall = sum(per_problem.values()) / len(per_problem) if per_problem else 1.0
    return means, overall


def propose(dispatcher, measured: Iterable[MLAProblem], records: Iterable[Record],
            budget_s: float) -> list[Refinement]:
    """The points to measure next within ``budget_s`` worker seconds, most uncertain
    first; ``dispatcher`` answers from the table measured so far."""
    measured = list(measured)
    means, overall = bucket_seconds(records)
    ranked = []
    for problem in between_points(measured):
        choice = dispatcher.select(problem)
        uncertainty = choice.uncertainty if choice.source == "predicted" else UNPREDICTED
        ranked.append(Refinement(problem, uncertainty, choice.route_id,
                                 means.get(problem.bucket, overall)))
    ranked.sort(key=lambda r: (-r.uncertainty, r.problem.key))
    chosen, spent = [], 0.0
    for refinement in ranked:
        if spent + refinement.seconds > budget_s:
            continue  # a cheaper point further down may still fit
        chosen.append(refinement)
        spent += refinement.seconds
    return chosen
