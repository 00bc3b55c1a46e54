"""The sweep's first stage: what to run. A candidate is one route with one parameter
set on one problem (``Candidate``, the task a worker gets); ``plan`` lists a spec's
candidates from the routes' rules and parameter spaces; ``Shard`` takes one share of a
spec's problems for a sweep spread over machines; ``problem_seed`` gives each problem
its inputs' seed. Seeds and shards derive from the problem's key (``MLAProblem.key``).
"""

from __future__ import annotations

import hashlib
import json
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


def plan(spec: SweepSpec, device: DeviceInfo, only: Iterable[str] | None = None
         ) -> tuple[list[Candidate], list[Record]]:
    """Candidates to run, and ``unsupported`` records for the routes that refuse a problem.

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
    return candidates, refused


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
