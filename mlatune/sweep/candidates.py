"""The sweep's first stage: what to run. A candidate is one route with one parameter
set on one problem (``Candidate``, the task a worker gets); ``plan`` lists a spec's
candidates from the routes' rules and parameter spaces; ``Shard`` takes one share of a
spec's problems for a sweep spread over machines; ``problem_seed`` gives each problem
its inputs' seed. Seeds and shards derive from the problem's key (``MLAProblem.key``).
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from typing import Any

from mlatune import routes
from mlatune.arch import DeviceInfo
from mlatune.measure.records import Record, Status
from mlatune.problem import MLAProblem
from mlatune.routes.torch_ref import REFERENCE_ID as REFERENCE
from mlatune.sweep.spec import SweepSpec


@dataclass(frozen=True)
class Candidate:
    problem: MLAProblem
    route_id: str
    params: dict[str, Any] = field(default_factory=dict)

    @property
    def params_json(self) -> str:
        return json.dumps(self.params, sort_keys=True)

    @property
    def id(self) -> str:
        text = f"{self.problem.key}#{self.route_id}#{self.params_json}"
        return hashlib.sha1(text.encode()).hexdigest()[:20]

    def record(self, **result: Any) -> Record:
        """The candidate's journal record with ``result``'s fields (a ``route_params`` there,
        what the route reports it ran with, replaces the candidate's own)."""
        return Record.from_json({"id": self.id, "key": self.problem.key_dict(),
                                 "route": self.route_id, "route_params": self.params_json,
                                 **result})


def plan(spec: SweepSpec, device: DeviceInfo, only: Iterable[str] | None = None,
         prior: Prior | None = None) -> tuple[list[Candidate], list[Record]]:
    """Candidates to run, and records of those that will not: ``unsupported`` for the routes
    that refuse a problem, ``pruned`` for those ``prior`` puts far behind its best.

    By default every viable route runs, except the eager reference where another
    route serves the problem: it is the fallback of last resort, and timing it
    costs more than all the others together. Naming routes (spec or --routes)
    runs exactly those. Each route's parameter sets are cut to the spec's
    ``max_params_per_route`` (or its ``max_params`` entry for the route), keeping the
    first: routes list theirs most promising first.
    """
    selected = list(only) if only else (list(spec.routes) or None)
    candidates, refused = [], []
    for problem in spec.problems:
        answers = routes.verdicts(problem, device, selected)
        serving = [r for r, v in answers if v.ok]
        if selected is None and len(serving) > 1:
            serving = [r for r in serving if r.id != REFERENCE]
        for route in serving:
            space = route.param_space(problem, device)
            kept = spec.params_kept(route.id)
            if kept:
                space = space[:kept]
            candidates += [Candidate(problem, route.id, p) for p in space]
        refused += [Candidate(problem, r.id).record(status=Status.UNSUPPORTED, reason=v.reason)
                    for r, v in answers if not v.ok]
    if prior is not None:
        candidates, pruned = prior.split(candidates)
        refused += pruned
    return candidates, refused


def _sized(route_id: str) -> tuple[str, ...]:
    """The route's parameters derived from the problem's sizes (none for one not registered)."""
    try:
        return tuple(routes.get(route_id).sized_params)
    except KeyError:
        return ()


def _rounding(route_id: str, problem: MLAProblem, params: dict[str, Any]) -> str:
    """The numeric class of a route's set at a problem ("none" for a route not registered)."""
    try:
        route = routes.get(route_id)
    except KeyError:
        return "none"
    return routes.rounding(route, problem, params).value


def stable_hash(text: str) -> int:
    """A stable 64-bit hash of text (sha1's first 8 bytes, little-endian): the same on
    every machine and Python, unlike ``hash``. Seeds and shards both derive from it."""
    return int.from_bytes(hashlib.sha1(text.encode()).digest()[:8], "little")


def problem_seed(base: int, problem: MLAProblem) -> int:
    """Each problem's inputs depend only on the spec seed and the problem."""
    return stable_hash(f"{base}#{problem.key}") & 0xFFFF_FFFF


@dataclass(frozen=True)
class Shard:
    """One share of a spec's problems, for running a sweep on several machines: problem
    p belongs to share ``stable_hash(p.key) % count``, so the shares are disjoint, together
    cover the spec, do not depend on the order of its grids or axes, and are balanced in
    expectation. ``index`` counts from 0 (``I/N`` with 0 <= I < N), as Slurm's
    SLURM_ARRAY_TASK_ID does under ``--array=0-(N-1)``."""

    index: int
    count: int

    def __post_init__(self):
        if not 0 <= self.index < self.count:
            raise ValueError(f"shard {self.index}/{self.count}: expected I/N with "
                             f"0 <= I < N (I counts from 0)")

    @classmethod
    def parse(cls, text: str) -> Shard:
        """``"I/N"``; ValueError, one line, for anything else."""
        found = re.fullmatch(r"\s*(\d+)\s*/\s*(\d+)\s*", text, re.ASCII)
        if not found:
            raise ValueError(f"{text!r} is not I/N (two whole numbers, 0 <= I < N; e.g. 0/4)")
        return cls(int(found[1]), int(found[2]))

    def __str__(self) -> str:
        return f"{self.index}/{self.count}"

    @property
    def tag(self) -> str:
        """For file names: ``shard-I-of-N``."""
        return f"shard-{self.index}-of-{self.count}"

    def holds(self, problem: MLAProblem) -> bool:
        return stable_hash(problem.key) % self.count == self.index

    def of(self, spec: SweepSpec) -> SweepSpec:
        """The spec with only this share's problems (its sha256 stays the spec's)."""
        return replace(spec, problems=tuple(p for p in spec.problems if self.holds(p)))


@dataclass(frozen=True)
class Prior:
    """A measured table that prunes a sweep (Triton's ``prune_configs_by``, with measured
    costs for a model). Routes compete within their numeric class (``Route.rounding``), as
    the accuracy policies serve by class, at what a step costs the default caller, as the
    table ranks: at a problem it measured ok, a route whose step there cost over ``ratio``
    times the cheapest of its class does not run; a route that does runs its first parameter
    set of each class and the set that won there, not the others. Only the routes this sweep
    runs at a problem compete there (a route it does not run, or that is not installed, prunes
    nothing). A problem, route or winning set the table does not hold runs as without it.
    Only prunes: nothing it holds enters the new table."""

    times: dict[tuple[str, str], float]  # (problem key, route) -> step cost, us
    params: dict[tuple[str, str], dict[str, Any]]  # (problem key, route) -> what won
    ratio: float
    source: str

    @classmethod
    def read(cls, path: str, ratio: float) -> Prior:
        """The ok rows of the table at ``path`` (every device it holds), each at what a step
        costs the default caller (``table.cost.step_cost``), as the table ranks them."""
        from mlatune import table
        from mlatune.table.cost import step_cost
        from mlatune.table.frame import key_strings

        rows = table.read(path, facts=routes.FACTS)
        rows = rows[(rows["status"] == Status.OK.value) & rows["time_us"].notna()]
        costs = step_cost(rows["time_us"].to_numpy(), rows["plan_on"].to_numpy(dtype=object),
                          rows["plan_us"].to_numpy(), rows["plan_host_us"].to_numpy(), False,
                          shares_host_plan=rows["route"].isin(routes.plan_sharing()).to_numpy())
        times: dict[tuple[str, str], float] = {}
        params: dict[tuple[str, str], dict[str, Any]] = {}
        for key, route, t, ran in zip(key_strings(rows), rows["route"].tolist(),
                                      costs.tolist(), rows["route_params"].tolist(),
                                      strict=True):
            if t < times.get((key, route), math.inf):
                times[key, route], params[key, route] = t, json.loads(ran or "{}")
        return cls(times, params, ratio, str(path))

    def split(self, candidates: list[Candidate]) -> tuple[list[Candidate], list[Record]]:
        """The candidates that run, and a ``pruned`` record for each of the others."""
        best = self._best({(c.problem, c.route_id) for c in candidates})
        winners = self._winners(candidates)
        kept, pruned = [], []
        seen: set[tuple[str, str, str]] = set()  # (problem, route, class) whose first went by
        for c in candidates:
            rounding = _rounding(c.route_id, c.problem, c.params)
            kind = (c.problem.key, c.route_id, rounding)
            why = self._reason(c, rounding, best, first=kind not in seen or c.id in winners)
            seen.add(kind)
            if why:
                pruned.append(c.record(status=Status.PRUNED, reason=why))
            else:
                kept.append(c)
        return kept, pruned

    def _best(self, running: set[tuple[MLAProblem, str]]
              ) -> dict[tuple[str, str], tuple[float, str]]:
        """(problem key, class) -> (the cheapest step there, its route), among the routes
        that run at the problem."""
        best: dict[tuple[str, str], tuple[float, str]] = {}
        for problem, route in running:
            t = self.times.get((problem.key, route))
            if t is None:
                continue
            kind = (problem.key, _rounding(route, problem, self.params[problem.key, route]))
            if kind not in best or t < best[kind][0]:
                best[kind] = (t, route)
        return best

    def _reason(self, candidate: Candidate, rounding: str,
                best: dict[tuple[str, str], tuple[float, str]], first: bool) -> str:
        """Why ``candidate`` (of numeric class ``rounding``) is pruned; "" where it runs."""
        pair = (candidate.problem.key, candidate.route_id)
        took = self.times.get(pair)
        fastest, by = best.get((pair[0], rounding), (math.inf, ""))
        if took is None or fastest == math.inf or \
                _rounding(pair[1], candidate.problem, self.params[pair]) != rounding:
            return ""  # not measured in this class there
        if took > self.ratio * fastest:
            return (f"pruned: {took / fastest:.2f}x {by}'s step cost in {self.source} "
                    f"(over {self.ratio:g}x; numeric class {rounding})")
        if first:
            return ""
        return f"pruned: another of the route's sets won in {self.source}"

    def _winners(self, candidates: list[Candidate]) -> set[str]:
        """The ids of the sets that won in the table: per (problem, route), the set it ran,
        else (a table of a GPU with another SM count: another split) the first set of its
        recipe (every parameter but the sized ones, ``Route.sized_params``)."""
        groups: dict[tuple[str, str], list[Candidate]] = {}
        for c in candidates:
            groups.setdefault((c.problem.key, c.route_id), []).append(c)
        found = set()
        for pair, group in groups.items():
            won = self.params.get(pair)
            if won is None:
                continue
            sized = _sized(pair[1])
            for skip in ((), sized):
                same = [c for c in group if all(won.get(k) == v for k, v in c.params.items()
                                                if k not in skip)]
                if same:
                    found.add(same[0].id)
                    break
        return found
