"""`mlatune plan`: which routes a sweep would run on an arch, and why the others would not.

Planning needs no GPU: every built-in route's rules live in ``mlatune.capability``,
and a plan is those rules' answer for the arch. A route's ``supports`` is the same
rules plus its probe of the machine it runs on (the installed AITER, FlashMLA,
FlashInfer or Triton; the CPU interpreter), which only means something there: the
plan says it was not applied. Routes the capability model does not know (plugins)
answer through their own ``supports``.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from mlatune import capability, routes
from mlatune.arch import DeviceInfo
from mlatune.problem import BUCKET_FIELDS, KEY_FIELDS, MLAProblem
from mlatune.routes.aiter import gluon_forced
from mlatune.sweep.spec import SweepSpec
from mlatune.table import outputs

PROGRESS_STEP = 500  # problems between progress reports (about 0.1 s of planning)


@dataclass(frozen=True)
class PlanRow:
    problem: MLAProblem
    route: str
    viable: bool
    reason: str


def verdict(route: routes.Route, problem: MLAProblem, device: DeviceInfo,
            force_gluon: bool | None = None) -> tuple[bool, str]:
    """The capability rules' answer, worded as ``route.supports`` words a refusal; a route the
    rules do not know answers itself. ``force_gluon``: MLATUNE_AITER_GLUON's word, read now
    when None."""
    if capability.known(route.id):
        forced = gluon_forced() if force_gluon is None else force_gluon
        ruling = capability.check(route.id, problem, device.arch, force_gluon=forced)
        if not ruling.ok:
            return False, f"rule {ruling.rule}: {ruling.reason}"
        return True, ruling.reason
    answer = route.supports(problem, device)
    return answer.ok, answer.reason


def plan_rows(spec: SweepSpec, device: DeviceInfo,
              progress: Callable[[int], None] | None = None) -> list[PlanRow]:
    """One row per (problem, route) of the spec; raises KeyError for an unknown route id.
    ``progress`` is told how many problems are planned, every ``PROGRESS_STEP`` and at the
    end."""
    selected = [routes.get(r) for r in spec.routes] if spec.routes else routes.all_routes()
    forced = gluon_forced()  # once: a lookup per verdict costs a quarter of a plan's time
    rows: list[PlanRow] = []
    for i, p in enumerate(spec.problems, 1):
        rows.extend(PlanRow(p, r.id, *verdict(r, p, device, forced)) for r in selected)
        if progress is not None and (i % PROGRESS_STEP == 0 or i == len(spec.problems)):
            progress(i)
    return rows


@dataclass
class PlanGroup:
    """Problems that differ only in batch and kv_len and get the same verdicts."""

    problem: MLAProblem  # the first one; batch and kv_len vary across the group
    batches: set[int]
    kv_lens: set[int]
    rows: list[PlanRow]  # the first problem's rows, in route order


def grouped(rows: list[PlanRow]) -> list[PlanGroup]:
    by_problem: dict[str, list[PlanRow]] = {}
    for row in rows:
        by_problem.setdefault(row.problem.key, []).append(row)
    groups: dict[tuple, PlanGroup] = {}
    for problem_rows in by_problem.values():
        p = problem_rows[0].problem
        key = (p.bucket, tuple((r.route, r.viable, r.reason) for r in problem_rows))
        group = groups.setdefault(key, PlanGroup(p, set(), set(), problem_rows))
        group.batches.add(p.batch)
        group.kv_lens.add(p.kv_len)
    return list(groups.values())


def describe(problem: MLAProblem) -> str:
    """The bucket fields in a short line: phase, heads, qlen, dtypes, mask, DCP, page."""
    p = problem
    dtypes = p.q_dtype if p.q_dtype == p.kv_dtype else f"q {p.q_dtype} / kv {p.kv_dtype}"
    dcp = f" dcp {p.dcp_size}" if p.dcp_size > 1 else ""
    mask = "causal" if p.causal else "non-causal"
    return f"{p.phase} h{p.num_heads} q{p.qlen} {dtypes} {mask}{dcp} page {p.page_size}"


def refusals_text(rows: list[PlanRow]) -> str:
    """Each refusal reason once, after the routes it refuses."""
    by_reason: dict[str, list[str]] = {}
    for row in rows:
        if not row.viable:
            by_reason.setdefault(row.reason, []).append(row.route)
    return "\n".join(f"{', '.join(ids)}: {reason}" for reason, ids in by_reason.items())


@dataclass(frozen=True)
class RouteSummary:
    route: str
    viable: int  # problems it would run
    refused: int  # problems a rule (or its supports) refuses
    top_reason: str  # its most frequent refusal ("" when it refuses none)
    top_count: int

    @property
    def top_text(self) -> str:
        return f"{self.top_reason} ({self.top_count}x)" if self.top_count else ""


def route_summary(rows: list[PlanRow]) -> list[RouteSummary]:
    """Per route, in route order: viable and refused counts, and its most frequent refusal."""
    by_route: dict[str, list[PlanRow]] = {}
    for row in rows:
        by_route.setdefault(row.route, []).append(row)
    summary = []
    for route, mine in by_route.items():
        refusals = Counter(r.reason for r in mine if not r.viable)
        reason, count = refusals.most_common(1)[0] if refusals else ("", 0)
        viable = sum(r.viable for r in mine)
        summary.append(RouteSummary(route, viable, len(mine) - viable, reason, count))
    return summary


def as_json(rows: list[PlanRow], device: DeviceInfo, spec: SweepSpec) -> dict:
    """`mlatune plan --json` less its envelope: per route and per group of problems
    (problems differing only in batch and kv_len with the same verdicts)."""
    return {
        "spec": spec.path,
        "device": {"arch": device.arch, "device_name": device.name,
                   "cu_count": device.cu_count or None},
        "problems": len(spec.problems),
        "skipped_combinations": len(spec.skipped),
        "probe_applied": False,  # capability rules only: the module docstring
        "routes": [{"route": s.route, "viable": s.viable, "refused": s.refused,
                    "top_refusal": ({"reason": s.top_reason, "count": s.top_count}
                                    if s.top_count else None)}
                   for s in route_summary(rows)],
        "groups": [{"problem": _bucket(g.problem), "batches": sorted(g.batches),
                    "kv_lens": sorted(g.kv_lens),
                    "viable": [r.route for r in g.rows if r.viable],
                    "refused": {r.route: r.reason for r in g.rows if not r.viable}}
                   for g in grouped(rows)],
    }


def _bucket(problem: MLAProblem) -> dict:
    key = problem.key_dict()
    return {name: key[name] for name in BUCKET_FIELDS}


CSV_COLUMNS = ("arch", "device_name", "cu_count", *KEY_FIELDS, "route", "status", "reason")


def write_csv(rows: list[PlanRow], device: DeviceInfo, path: Path) -> None:
    """The plan as a table, written atomically (``outputs.write_csv``: a fresh temporary
    file renamed into place, text cells safe to open in a spreadsheet). Raises
    OutputError (one line naming ``path``) when it cannot be written."""
    outputs.write_csv(path, CSV_COLUMNS, (
        [device.arch, device.name, device.cu_count or "",
         *(int(v) if isinstance(v, bool) else v for v in row.problem.key_dict().values()),
         row.route, "viable" if row.viable else "unsupported", row.reason]
        for row in rows))
