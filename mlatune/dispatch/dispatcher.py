"""The runtime dispatcher: which route serves this problem, answered from a table.

``Dispatcher.load(path)`` runs once at model load: it validates the table,
refuses one measured on another arch (``allow_arch`` plans for another arch
on purpose), and builds everything ``select`` needs (the predictor too).
``select(problem)`` answers in four ways, in order:

- ``table``: the problem was measured; the fastest ok route whose
  ``supports()`` accepts it (normally the winner, the runner-up if the winner's
  route now refuses or is not installed here);
- ``predicted`` (``unmeasured="predict"``, the default): same bucket (every key
  field but batch and kv_len), the recipe ``mlatune.dispatch.predict`` predicts
  fastest from the bucket's measured points, its KV splits sized for the problem;
- ``nearest`` (with ``unmeasured="nearest"``, or where nothing is predicted): the nearest
  measured point (``point_distance``: total KV tokens first, then batch) whose
  winner supports the problem, with the parameters a route derives from sizes
  (KV splits) redone for the problem (``routes.params_at``);
- ``law`` (a bucket never measured, or one whose points answer nothing): the route whose
  cost law in device terms (``mlatune.dispatch.laws``, fitted over every bucket of the
  table) predicts it fastest there, with a correction borrowed from its nearest measured
  rows; every viable route with a law competes, vendor routes included;
- ``rule``: where no viable route has a law, the first route of the arch's rule order
  that supports the problem; ``reference/torch`` is last and supports everything.

DCP rows timed across processes (``dcp_timing`` "measured") and on one GPU ("simulated")
never compete with each other (``mlatune.table.schema.competing``): at a problem with
measured rows only those answer it, and in a bucket with measured points only those
answer its unmeasured shapes (nearest and predicted).

A route whose row at the exact problem is not ok (rejected_accuracy, crashed,
timeout, unsupported) failed there: nearest and rule skip it for that problem,
and when every other route failed or refuses, ``reference/torch`` answers as
the last resort even if it failed there too.

Each problem key is resolved once and remembered, so a repeated ``select`` is
one dict probe on the problem's cached key: no I/O, no GPU work, no
allocation. The first ``select`` of a key pays for the ``supports()`` checks
(a few microseconds; measured keys have their memo slot from load, unmeasured
ones are remembered up to MEMO_LIMIT and resolved afresh beyond it) and, for a
predicted or nearest answer, for the prediction and redoing its route's
size-derived parameters (``benchmarks/bench.py --routine select-cost`` times both).

Routes the table names but this process has not registered (a backend that
does not import here, a route from a newer mlatune) are skipped, never
refused: the dispatcher falls through to the key's next ok route, the nearest
point, or the rule. ``skipped_routes`` counts them so tools can warn.

A table measured under another GPU, driver or library versions than this process
runs is used all the same, with one warning (``environment_differences``,
``mlatune.dispatch.environment``).
"""

from __future__ import annotations

import itertools
import json
import logging
import math
import operator
import os
import weakref
from collections.abc import Collection, Iterator, Mapping, Sequence
from types import MappingProxyType
from typing import Any

from mlatune import capability
from mlatune.arch import DeviceInfo
from mlatune.check.policy import Policy, policy_named
from mlatune.dispatch import loading, sources
from mlatune.dispatch.admission import class_of
from mlatune.dispatch.bundled import bundled_tables_dir, find_table  # noqa: F401  (public)
from mlatune.dispatch.choice import Choice, held_notes, law_notes, measured_note, nearest_notes
from mlatune.dispatch.laws import Laws
from mlatune.dispatch.loading import (  # noqa: F401  (the dispatcher's public names)
    DEFAULT_UNMEASURED,
    FIRST_SIGHT_ENV,
    TABLE_ENV,
    UNMEASURED,
    USER_TABLE_ENV,
    check_options,
    device_for_arch,
    registered_routes,
)
from mlatune.dispatch.nearest import Bucket, learnable, point_distance  # noqa: F401
from mlatune.dispatch.predict import Predictor
from mlatune.dispatch.sources import EMPTY_PARAMS
from mlatune.errors import TableError
from mlatune.hardware import Hardware
from mlatune.hardware import described as table_hardware
from mlatune.problem import BUCKET_FIELDS, MLAProblem
from mlatune.routes import Route, params_at, rounding, step_kind_of
from mlatune.routes.torch_ref import REFERENCE_ID as REFERENCE_ROUTE
from mlatune.table.cost import DEFAULT_PLAN_CALLS

__all__ = ["Choice", "Dispatcher", "TableError", "device_for_arch", "find_table"]

log = logging.getLogger("mlatune")

# Memo entries for problems the table never measured (nearest and rule answers);
# measured keys are always remembered. Bounds memory when kv_len varies freely.
MEMO_LIMIT = 1 << 16
PREDICTIONS_SHOWN = 3  # by explain (`mlatune lookup`): the fastest predicted recipes
PARAM_SETS_PER_ROUTE = 8  # estimates: recipes asked of the predictor per route
NO_ROUTES: frozenset[str] = frozenset()
# ``problem.bucket`` in one C call (the property builds it field by field): a first select
# of an unmeasured shape looks its bucket up twice.
_bucket_of = operator.attrgetter(*BUCKET_FIELDS)


_HANDLES = itertools.count(1)
_BY_HANDLE: weakref.WeakValueDictionary[int, Dispatcher] = weakref.WeakValueDictionary()


def by_handle(handle: int) -> Dispatcher | None:
    """The live dispatcher with this ``Dispatcher.handle`` (None: gone, or 0)."""
    return _BY_HANDLE.get(handle)


class Dispatcher:
    """Answers ``select(problem)`` for one device from one table's rows for its arch.

    ``capturable``: the dispatcher serves a caller that captures its steps in CUDA
    graphs: it knows only steps that replay from a graph, ranked by launch plus device
    plan; otherwise every step, ranked by what an eager call costs (``step_cost``).
    """

    def __init__(self, device: DeviceInfo, entries: Sequence[sources.Entry] = (), *,
                 routes: Mapping[str, Route] | None = None, source: str = "",
                 table_device: tuple[str, str, int] | None = None,
                 provenance: Sequence[Mapping[str, Any]] = (),
                 skipped_routes: Mapping[str, int] | None = None,
                 failed: Mapping[str, sources.Failures] | None = None,
                 capturable: bool = False,
                 environment_differences: Sequence[str] = (), planning: bool = False,
                 plan_calls: int = DEFAULT_PLAN_CALLS, unmeasured: str | None = None,
                 first_sight: str | os.PathLike | None = None,
                 measured_keys: Collection[str] = (), group: Any = None,
                 accuracy: Policy | str | None = None,
                 held_back: Mapping[str, tuple[sources.Held, ...]] | None = None,
                 hardware: Hardware | None = None):
        """Built by ``load``: ``entries`` name only routes in ``routes`` (the registry
        snapshot they were filtered with), each key's rows those that compete there
        (``schema.competing``); ``skipped_routes`` counts the rows dropped;
        ``failed`` holds, per measured key, the routes whose row there is not ok;
        ``environment_differences`` what differs between where the table was measured and
        here (``mlatune.dispatch.environment``); ``measured_keys`` the keys whose rows were
        timed across processes (DCP): a bucket that has some answers unmeasured shapes
        from those alone; ``accuracy`` the policy ``entries`` were filtered by and what any
        other answer must meet (``check.policy``), ``held_back`` the rows it filtered out;
        ``hardware`` the figures of the GPU the rows were measured on (default: the
        datasheet of ``table_device``'s model), which the cost laws are fitted in."""
        self.device = device
        self.capturable = capturable
        # Answering for another machine (allow_arch): support is the capability rules', as
        # `mlatune plan` says it; this machine's libraries (FlashMLA, AITER) do not count.
        self.planning = planning
        self.plan_calls = plan_calls  # calls sharing one device plan (``step_cost``)
        self.unmeasured = unmeasured or DEFAULT_UNMEASURED  # see UNMEASURED
        self.accuracy = policy_named(accuracy)
        self._held_back = dict(held_back or {})
        # The user table unsure answers are timed into (None: off), agreed across group's ranks.
        self.first_sight, self.group = first_sight, group
        check_options(plan_calls, self.unmeasured)
        # A number that names this dispatcher where only numbers pass (the custom op).
        self.handle = next(_HANDLES)
        _BY_HANDLE[self.handle] = self
        self.source = source  # where the table came from ("" without one)
        self.table_device = table_device  # (arch, device_name, cu_count) of the rows used
        self.provenance = [dict(p) for p in provenance]
        self.routes = registered_routes(routes)
        self.skipped_routes = dict(skipped_routes or {})  # rows naming routes not here
        # One phrase per difference ("torch: table 2.11.0, running 2.13.0"); [] when the
        # table was measured here, or nothing could be compared (no GPU, planning).
        self.environment_differences = list(environment_differences)
        self.hardware = hardware if hardware is not None or table_device is None else \
            table_hardware(table_device[1], table_device[0], table_device[2])
        self._build(entries, measured_keys, failed or {})

    def _build(self, entries: Sequence[sources.Entry], measured_keys: Collection[str],
               failed: Mapping[str, sources.Failures]) -> None:
        """What ``select`` answers from: winners, buckets, rule order, memo, predictor."""
        self._nearest: dict[str, Choice] = {}  # a winner answering for a neighbour
        self._predictor: Predictor | None = None  # fitted at the end of __init__
        self._laws: Laws | None = None  # fitted at the first unmeasured bucket asked
        self._rows: list | None = None  # _measured_rows, once made
        points, wins = self._index(entries)
        points = learnable(points, measured_keys)
        self._buckets = {b: Bucket(p) for b, p in points.items()}
        self._points = points  # per bucket (batch, kv_len, winner): the predictor's points
        self._rule_order = self._make_rule_order(wins)
        self._rule_choices = {r.id: Choice(r.id, EMPTY_PARAMS, "rule") for r in self._rule_order}
        # Read only when a key has no usable ok route (nearest and rule skip these).
        self._failed: Mapping[str, sources.Failures] = failed
        # Measured keys get their slot now, so remembering them later allocates nothing.
        self._memo: dict[str, Choice | None] = dict.fromkeys(self._winner)
        self._memo.update(dict.fromkeys(self._failed))
        self._memo_limit = len(self._memo) + MEMO_LIMIT
        # Fitted now, at model load, not in the first unmeasured select: loading the H200
        # table took 0.18 s with it and 0.07-0.09 s without (warm, 2-core CPU, 2026-11-30).
        if self.unmeasured == "predict" and self._winner:
            self._ensure_predictor()

    def _index(self, entries: Sequence[sources.Entry]
               ) -> tuple[dict[tuple, list[tuple[int, int, Choice]]], dict[str, int]]:
        """Each measured key's winner Choice, built now (the other ok routes stay in the
        columns until a winner refuses: rare, and load time matters); per bucket its points
        (batch, kv_len, winner), and how many keys each route wins."""
        self._winner: dict[str, Choice] = {}
        self._others: dict[str, tuple[sources.Columns, int, int]] = {}
        points: dict[tuple, list[tuple[int, int, Choice]]] = {}
        wins: dict[str, int] = {}
        for key, bucket, batch, kv_len, (route_id, params, time_us), columns, start, end \
                in entries:
            winner = self._winner[key] = Choice(route_id, params, "table", key, time_us)
            if end - start > 1:
                self._others[key] = (columns, start + 1, end)
            points.setdefault(bucket, []).append((batch, kv_len, winner))
            wins[route_id] = wins.get(route_id, 0) + 1
        return points, wins

    def _make_rule_order(self, wins: Mapping[str, int]) -> tuple[Route, ...]:
        """Routes by how many problems they win in this table, then the other registered
        routes by id, then reference/torch: the table is the best evidence of what is
        fast on this arch, and the last resort serves everything."""
        ids = sorted(wins, key=lambda r: (-wins[r], r))
        ids += [r for r in sorted(self.routes) if r not in wins]
        if self.capturable:  # a rule answer runs the route's defaults: their step kind
            ids = [r for r in ids if step_kind_of(self.routes[r], {}).capturable]
        ids = [r for r in ids if r != REFERENCE_ROUTE] + [REFERENCE_ROUTE]
        return tuple(self.routes[r] for r in ids)

    # Answering -------------------------------------------------------------
    def select(self, problem: MLAProblem) -> Choice:
        """The route for ``problem``; never raises for a valid problem (TypeError for
        anything not an ``MLAProblem``)."""
        try:
            key = problem.key
        except AttributeError:
            raise TypeError(f"select takes an MLAProblem, got {type(problem).__name__}") \
                from None
        choice = self._memo.get(key)
        if choice is None:
            if not isinstance(problem, MLAProblem):  # a look-alike with a key
                raise TypeError(f"select takes an MLAProblem, got {type(problem).__name__}")
            choice = self._resolve(problem, None)
            if len(self._memo) < self._memo_limit or key in self._memo:
                self._memo[key] = choice
        return choice

    def explain(self, problem: MLAProblem, predictions: int | None = PREDICTIONS_SHOWN
                ) -> tuple[Choice, list[str]]:
        """What ``select`` answers and why, one sentence per step (for `mlatune lookup`);
        for a predicted answer the ``predictions`` fastest recipes' predictions (None:
        all of them)."""
        notes: list[str] = []
        choice = self._resolve(problem, notes, predictions)
        return choice, notes + held_notes(self.accuracy.name, self._held_back.get(problem.key),
                                          choice)

    def route(self, route_id: str) -> Route:
        return self.routes[route_id]

    def alternatives(self, problem: MLAProblem, first: Choice | None = None
                     ) -> Iterator[Choice]:
        """The routes that support ``problem``, each once, most preferred first:
        ``first`` (when given), ``select``'s answer, the key's other measured routes
        fastest first, then the rule order (ending at reference/torch). For a caller
        whose need ``select`` does not see (an LSE from ``attention.decode``)."""
        seen: set[str] = set()
        ordered = (first, self.select(problem), *self._ranked(problem.key),
                   *(self._rule_choices[r.id] for r in self._rule_order))
        for choice in ordered:
            if choice is None or choice.route_id in seen:
                continue
            seen.add(choice.route_id)
            if (choice.source != "rule" or self._admits(self.routes[choice.route_id], problem,
                                                        None)) \
                    and self._supports(choice.route_id, problem, None):
                yield choice

    def _as_nearest(self, winner: Choice, problem: MLAProblem) -> Choice:
        """A measured winner answering for an unmeasured neighbour, its size-derived
        parameters (KV splits) redone for ``problem`` (routes.params_at); one object per
        point where nothing changes."""
        route, params = self.routes[winner.route_id], dict(winner.params)
        if route.sized_params:  # else nothing to redo: skip the key parse
            try:
                params = params_at(route, params, MLAProblem.from_key(winner.key), problem,
                                   self.device)
            except Exception:  # a broken param_space: the neighbour's own parameters
                params = dict(winner.params)
        if params != dict(winner.params):
            return Choice(winner.route_id, MappingProxyType(params), "nearest", winner.key,
                          winner.time_us)
        choice = self._nearest.get(winner.key)
        if choice is None:
            choice = self._nearest.setdefault(
                winner.key, Choice(winner.route_id, winner.params, "nearest", winner.key,
                                   winner.time_us))
        return choice

    def _predicted(self, problem: MLAProblem, failed: frozenset[str],
                   notes: list[str] | None, shown_count: int | None = PREDICTIONS_SHOWN,
                   bucket_key: tuple | None = None) -> Choice | None:
        """The recipe predicted fastest at an unmeasured shape of a measured bucket, its
        sized parameters redone for it (``mlatune.dispatch.predict``); None when no
        usable route was measured in the bucket."""
        predictor = self._ensure_predictor()

        def usable(route_id: str) -> bool:
            return route_id not in failed and self._supports(route_id, problem, None)

        if notes is not None:
            shown = predictor.predict(problem, usable)[:shown_count]
            for p in shown:
                recipe = json.dumps(dict(p.recipe), sort_keys=True)
                # A split the law chose among the route's list (predict._ListedSplits)
                chose = p.sizing is not None and p.sizing[0].chooses and p.sizing[1] is not None
                split = f" at {p.sizing[0].sized}={p.sizing[1]}" if chose else ""
                notes.append(f"predicted: {p.route_id} {recipe}{split} {p.time_us:.4g} us "
                             f"(+-{100 * p.uncertainty:.0f}%; its nearest measured point: "
                             f"batch={p.nearest.batch} kv_len={p.nearest.kv_len})")
        found = predictor.choose(problem, usable, bucket_key)
        if found is None:
            return None
        prediction, params = found
        return Choice(prediction.route_id, MappingProxyType(params), "predicted",
                      prediction.nearest.key, prediction.time_us, prediction.uncertainty)

    def _ensure_predictor(self) -> Predictor:
        if self._predictor is None:
            self._predictor = Predictor(self._measured_rows(), self.routes, self.device,
                                        complete=False, failed=self._failed_rows())
        return self._predictor

    def _ensure_laws(self) -> Laws | None:
        if self._laws is None and self._winner and self.hardware is not None:
            self._laws = Laws.fit(self._measured_rows(), self.routes, self.hardware,
                                  self._failed_rows())
        return self._laws

    def _law_choice(self, problem: MLAProblem, failed: frozenset[str],
                    notes: list[str] | None, shown_count: int | None = PREDICTIONS_SHOWN
                    ) -> Choice | None:
        """The route whose cost law predicts ``problem`` fastest among those that support
        it, did not fail here and the accuracy policy admits (``mlatune.dispatch.laws``);
        None where no such route has a law (the rule order answers)."""
        laws = self._ensure_laws()
        if laws is None:
            return None

        def usable(route_id: str, params: Mapping[str, Any]) -> bool:
            route = self.routes.get(route_id)
            if route is None or route_id in failed:
                return False
            cls = class_of(route, problem, params)
            return cls is not None and self.accuracy.admits_class(problem.q_dtype, cls) \
                and (not self.capturable or step_kind_of(route, dict(params)).capturable) \
                and self._supports(route_id, problem, None)

        found = [p for p in laws.choose(problem) if usable(p.route_id, p.params)]
        if notes is not None:
            notes += law_notes(found[:shown_count])
        if not found:
            return None
        best = found[0]
        return Choice(best.route_id, best.params, "law", best.nearest.key, best.time_us,
                      best.uncertainty)

    def predicted_choices(self, problem: MLAProblem, k: int) -> list[Choice]:
        """The ``k`` recipes predicted fastest at ``problem`` among the routes that
        support it, their sized parameters redone for it ([] outside measured buckets)."""
        predictor = self._ensure_predictor()
        found = predictor.predict(problem, lambda r: self._supports(r, problem, None))
        return [Choice(p.route_id, MappingProxyType(predictor.sized(p, problem)), "predicted",
                       p.nearest.key, p.time_us, p.uncertainty) for p in found[:k]]

    def estimates(self, problem: MLAProblem) -> list[Choice]:
        """Each route's cheapest predicted recipe at ``problem`` among the routes that
        support it, fastest first: the predictor's where the bucket is measured, else the
        cost laws' ([] where neither has one). What a tuner prunes by."""
        found = self.predicted_choices(problem, k=len(self.routes) * PARAM_SETS_PER_ROUTE)
        if not found and (laws := self._ensure_laws()) is not None:
            found = [Choice(p.route_id, p.params, "law", p.nearest.key, p.time_us,
                            p.uncertainty) for p in laws.choose(problem)
                     if self._supports(p.route_id, problem, None)]
        best: dict[str, Choice] = {}
        for choice in found:
            best.setdefault(choice.route_id, choice)
        return list(best.values())

    def remember(self, problem: MLAProblem, choice: Choice) -> None:
        """Answer ``problem`` with ``choice`` from now on (a run-time measurement)."""
        self._memo[problem.key] = choice

    def _measured_rows(self) -> list[tuple[MLAProblem, str, Mapping[str, Any], float]]:
        """Every usable ok route of every measured key with its step cost: the predictor's
        and the cost laws' data (the table's best parameter set per route and problem),
        made once for both."""
        if self._rows is None:
            self._rows = list(self._each_measured_row())
        return self._rows

    def _each_measured_row(self) -> Iterator[tuple[MLAProblem, str, Mapping[str, Any], float]]:
        for points in self._points.values():
            first = MLAProblem.from_key(points[0][2].key)  # parsed once per bucket
            for batch, kv_len, winner in points:
                problem = first if (batch, kv_len) == (first.batch, first.kv_len) else \
                    first.with_(batch=batch, kv_len=kv_len)
                # Its key is the table's (as exact hits find it): kept, so that a predicted
                # answer naming this point does not format it again (a cached property).
                problem.__dict__.setdefault("key", winner.key)
                for choice in self._ranked(winner.key):
                    yield problem, choice.route_id, choice.params, choice.time_us

    def _failed_rows(self) -> Iterator[tuple[MLAProblem, str]]:
        """Where a route failed (accuracy, crash, timeout; a refusal is no failure): the
        predictor does not choose a route next to its failures."""
        for key, failures in self._failed.items():
            routes = [r for r, status in failures if status != "unsupported"]
            if routes:
                problem = MLAProblem.from_key(key)
                yield from ((problem, r) for r in routes)

    def _ranked(self, key: str) -> tuple[Choice, ...]:
        """Every usable ok route of a measured key, fastest first ((): not measured)."""
        winner = self._winner.get(key)
        if winner is None:
            return ()
        columns, start, end = self._others.get(key, (None, 0, 0))
        others = (columns.option(i) for i in range(start, end)) if columns else ()
        return (winner, *(Choice(r, p, "table", key, t) for r, p, t in others))

    def _admits(self, route: Route, problem: MLAProblem, notes: list[str] | None) -> bool:
        """Whether the accuracy policy admits ``route`` run with its defaults (a rule answer;
        a measured answer's rows were admitted at load)."""
        try:
            cls = rounding(route, problem)
        except Exception:  # a broken hook: as a broken supports(), a refusal
            return False
        ok = self.accuracy.admits_class(problem.q_dtype, cls)
        if not ok and notes is not None:
            notes.append(f"{route.id} rounds beyond the problem's dtypes ({cls}): accuracy "
                         f"policy {self.accuracy.name} holds it back")
        return ok

    def _supports(self, route_id: str, problem: MLAProblem, notes: list[str] | None) -> bool:
        try:
            if self.planning and capability.known(route_id):
                ruling = capability.check(route_id, problem, self.device.arch)
                if ruling.ok or notes is None:  # the reason is written only into notes
                    return ruling.ok
                ok, reason = False, f"rule {ruling.rule}: {ruling.reason}"
            else:
                route = self.routes[route_id]
                verdict = route.supports(problem, self.device)
                ok, reason = bool(verdict.ok), verdict.reason
                if ok and self.capturable and not route.serves_empty(problem, {}):
                    ok, reason = False, "it does not serve empty requests (graph buckets pad " \
                        "with them)"
        except Exception as exc:  # a broken route is a refusal: select must not raise
            ok, reason = False, f"supports() raised {type(exc).__name__}: {exc}"
        if not ok and notes is not None:
            notes.append(f"{route_id} refuses this problem: {reason}")
        return ok

    def _resolve(self, problem: MLAProblem, notes: list[str] | None,
                 shown_count: int | None = PREDICTIONS_SHOWN) -> Choice:
        """The answer of ``select`` (the module docstring's order), with ``notes`` of why."""
        winner = self._winner.get(problem.key)
        if winner is not None:
            measured = self._measured_choice(problem, winner, notes)
            if measured is not None:
                return measured
        # No usable ok route here. Routes that failed at this exact problem are not
        # taken from a neighbour or the rule either.
        failed = self._failed_here(problem, winner is None, notes)
        bucket_key = _bucket_of(problem)
        bucket = self._buckets.get(bucket_key)
        if bucket is not None:
            predicted = self._predicted(problem, failed, notes, shown_count, bucket_key) \
                if self.unmeasured == "predict" else None
            if predicted is not None:
                return predicted
            nearest = self._nearest_choice(bucket, problem, failed, notes)
            if nearest is not None:
                return nearest
        elif notes is not None:
            notes.append("nothing was measured in this bucket (every key field but batch "
                         "and kv_len)")
        lawful = self._law_choice(problem, failed, notes, shown_count)
        if lawful is not None:
            return lawful
        return self._rule_choice(problem, failed, notes)

    def _measured_choice(self, problem: MLAProblem, winner: Choice, notes: list[str] | None
                         ) -> Choice | None:
        """The problem's cheapest measured route that supports it here; None: none does."""
        if notes is None and self._supports(winner.route_id, problem, None):
            return winner  # the common case: build no runner-up Choices
        ranked = self._ranked(problem.key)
        for choice in ranked:
            if self._supports(choice.route_id, problem, notes):
                if notes is not None:
                    notes.append(measured_note(choice, ranked))
                return choice
        return None

    def _failed_here(self, problem: MLAProblem, unmeasured: bool, notes: list[str] | None
                     ) -> frozenset[str]:
        """The routes whose row at this exact problem is not ok (nearest and rule skip them)."""
        failures = self._failed.get(problem.key, ())
        if notes is not None:
            if failures:
                notes.append("measured here: " + ", ".join(f"{r} {s}" for r, s in
                                                           sorted(failures))
                             + "; nearest and rule skip these routes")
            elif unmeasured:
                notes.append("this exact problem was not measured (or only by routes not "
                             "installed here)")
        return frozenset(r for r, _ in failures) if failures else NO_ROUTES

    def _nearest_choice(self, bucket: Bucket, problem: MLAProblem, failed: frozenset[str],
                        notes: list[str] | None) -> Choice | None:
        """The nearest measured point's winner that supports the problem and did not fail
        here, its sized parameters redone; None: no point's winner does."""
        x, y = math.log2(problem.batch), math.log2(problem.kv_len)
        # The nearest point first (cheap); only if its winner refuses, all by distance.
        closest = bucket.closest(x, y)
        if notes is None and closest.key != problem.key and closest.route_id not in failed \
                and self._supports(closest.route_id, problem, None):
            return self._as_nearest(closest, problem)
        for winner in bucket.by_distance(x, y):
            if winner.key != problem.key and winner.route_id not in failed \
                    and self._supports(winner.route_id, problem, notes):
                choice = self._as_nearest(winner, problem)
                if notes is not None:
                    notes += nearest_notes(winner, choice)
                return choice
        if notes is not None:
            notes.append("no measured point in this bucket has a winner that supports "
                         "this problem" + (" and did not fail here" if failed else ""))
        return None

    def _rule_choice(self, problem: MLAProblem, failed: frozenset[str],
                     notes: list[str] | None) -> Choice:
        """The first route of the rule order that supports the problem and did not fail
        here; ``reference/torch`` as the last resort, so select never raises."""
        for route in self._rule_order:
            if route.id not in failed and self._admits(route, problem, notes) \
                    and self._supports(route.id, problem, notes):
                if notes is not None:
                    order = ", ".join(r.id for r in self._rule_order)
                    notes.append(f"rule: first route that supports it"
                                 f"{' and did not fail here' if failed else ''}, in the "
                                 f"order {order}")
                return self._rule_choices[route.id]
        # Every route failed here or refuses (reachable only when reference/torch failed
        # here too).
        if notes is not None:
            notes.append(f"rule: every route failed here or refuses it; {REFERENCE_ROUTE} "
                         f"answers as the last resort")
        return self._rule_choices[REFERENCE_ROUTE]

    # Loading (mlatune.dispatch.loading) -------------------------------------
    rules_only = classmethod(loading.rules_only)
    load = classmethod(loading.load)
    from_bundled = classmethod(loading.from_bundled)
