"""Where the dispatcher's rows come from: a Parquet/CSV table (``FrameSource``, with a
user table overlaid problem by problem) or a JSON winners map (``JsonSource``), each giving,
per device, every measured problem's usable routes cheapest first (``table.cost``), the
routes that failed there, and the table's provenance (which bundled table serves a device:
``bundled``).
"""

from __future__ import annotations

import itertools
import json
import logging
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any

from mlatune.arch import DeviceInfo
from mlatune.check.policy import FAST, Policy
from mlatune.dispatch import admission, bundled
from mlatune.errors import TableError
from mlatune.problem import BUCKET_FIELDS
from mlatune.routes import FACTS, Route
from mlatune.table import winners_map
from mlatune.table.cost import DEFAULT_PLAN_CALLS, step_cost
from mlatune.table.schema import (
    DCP_MEASURED,
    DEVICE_COLUMNS,
    Status,
    competing,
    is_measured,
    reference_fallbacks,
    unmeasured,
)

log = logging.getLogger("mlatune")
_PROBLEM_COLUMNS = [*BUCKET_FIELDS, "batch", "kv_len"]  # a problem's columns, on one device
EMPTY_PARAMS: Mapping[str, Any] = MappingProxyType({})


Device = tuple[str, str, int]  # a table's (arch, device_name, cu_count)
# What reading a Parquet or CSV table takes, which the runtime install lacks.
_FRAMES_EXTRA = "pandas and pyarrow, which this install lacks: pip install 'mlatune[cli]'"
Option = tuple[str, Mapping[str, Any], float]  # (route_id, params, step cost in us)
# An ok row the accuracy policy holds back at its key: (route_id, its numeric class, its
# recorded output error, its step cost in us), cheapest first; ``explain`` names them.
Held = tuple[str, str, float, float]
# The routes that failed at one measured problem, as (route_id, status) pairs: one
# shared tuple per distinct pattern (most keys that fail repeat a few patterns).
Failures = tuple[tuple[str, str], ...]


@dataclass(frozen=True)
class Columns:
    """A table's usable ok rows as parallel columns, each key's rows together in rank
    order. Rows stay here, not as Python objects, until a winner refuses (rare)."""

    route_codes: Sequence[int]
    routes: Sequence[str]
    params_codes: Sequence[int]
    params: Sequence[Mapping[str, Any]]
    times: Sequence[float]

    def option(self, i: int) -> Option:
        return (self.routes[self.route_codes[i]], self.params[self.params_codes[i]],
                float(self.times[i]))


# One measured problem: key, bucket, batch, kv_len, its winner, and where its ok
# rows lie in the columns (rows start..end-1, the winner first). Plain tuples:
# a table holds tens of thousands and load time matters.
Entry = tuple[str, tuple, int, int, Option, Columns, int, int]


def open_source(path: Path, overlay: Path | None, device: DeviceInfo, allow_arch: str | None
                ) -> tuple[Path, FrameSource | JsonSource, tuple[str, str, int]]:
    """The table file (a directory's for the arch), its source and the device of it that
    answers for ``device``; TableError for a table of another arch unless ``allow_arch``
    names it, or a JSON map asked to take an overlay (laid on later: ``FrameSource.overlay``)."""
    arch = allow_arch or device.arch
    if path.is_dir():
        found = bundled.find_table(path, arch, device.name)
        if found is None:
            raise TableError(f"{path}: no table for arch {arch} in this directory"
                             + ("" if bundled.reads_frames() else f" that this install reads "
                                f"(Parquet and CSV tables need {_FRAMES_EXTRA})"))
        path = found
    if overlay is not None and winners_map.is_winners_map(path):
        how = "load the Parquet or CSV table to overlay it" if bundled.reads_frames() else \
            f"and a user table needs {_FRAMES_EXTRA}"
        raise TableError(f"{path}: a JSON winners map takes no overlay of {overlay} ({how})")
    source = JsonSource(path) if winners_map.is_winners_map(path) else FrameSource(path)
    arches = sorted({d[0] for d in source.devices})
    if arch not in arches:
        what = allow_arch or f"{device.arch} ({device.name})"
        hint = "" if allow_arch else \
            f"; pass allow_arch={arches[0]!r} (CLI: --arch {arches[0]}) to plan for it"
        raise TableError(f"{path}: table is for arch {', '.join(arches)}, but "
                         f"{'allow_arch is' if allow_arch else 'this device is'} "
                         f"{what}{hint}")
    return path, source, pick_device([d for d in source.devices if d[0] == arch], device)


def pick_device(candidates: list[tuple[str, str, int]], device: DeviceInfo):
    """The table device to use among those of the right arch: same name and CU count,
    else same name, else the nearest CU count (then by name, for a stable answer)."""
    for match in (lambda d: d[1] == device.name and d[2] == device.cu_count,
                  lambda d: d[1] == device.name):
        exact = [d for d in candidates if match(d)]
        if exact:
            return exact[0]
    return min(candidates, key=lambda d: (abs(d[2] - device.cu_count), d[1], d[2]))


def overlay_device(candidates: list[Device], chosen: Device, device: DeviceInfo
                   ) -> Device | None:
    """The user table's device whose rows overlay the table's ``chosen`` device: this GPU
    (same name and count, else same name), else the chosen device itself (a user table
    measured where the table was); None where the user measured neither."""
    mine = [d for d in candidates if d[0] == chosen[0]]
    for match in (lambda d: d[1:] == (device.name, device.cu_count),
                  lambda d: d[1] == device.name, lambda d: d == chosen,
                  lambda d: d[1] == chosen[1]):
        found = [d for d in mine if match(d)]
        if found:
            return found[0]
    return None


def overlaid(table, frame, user):
    """``frame`` with the problems ``user`` holds (per device) replaced by its rows."""
    import pandas as pd

    device = list(DEVICE_COLUMNS)

    def keys(f):
        return pd.Series(table.key_strings(f), index=f.index) + "|" + \
            f[device].astype(str).agg("|".join, axis=1)

    mine = set(keys(user))
    kept = frame[~keys(frame).isin(mine)]
    return pd.concat([kept, user[kept.columns]], ignore_index=True)


@dataclass(frozen=True)
class Overlay:
    """What a user table laid over a table's device: the user's device whose rows replaced
    the table's problem by problem (None: none of its devices), their provenance, and the
    user's devices left out (another GPU's measurements do not time this one)."""

    device: Device | None
    provenance: list[dict[str, Any]]
    left_out: list[Device]


# Reading tables into entries ---------------------------------------------------


def _devices(frame) -> list[Device]:
    """A table's distinct (arch, device_name, cu_count), in row order."""
    distinct = frame[list(DEVICE_COLUMNS)].drop_duplicates()
    return list(distinct.itertuples(index=False, name=None))


def _frozen_params(text: str) -> Mapping[str, Any]:
    parsed = json.loads(text)
    return EMPTY_PARAMS if not parsed else MappingProxyType(parsed)


class FrameSource:
    """A Parquet or CSV table, read and validated with mlatune.table (pandas)."""

    def __init__(self, path: Path):
        from mlatune import table  # pandas only when a Parquet/CSV table is loaded

        self._table = table
        self.frame = table.read(path, facts=FACTS)  # validates, or raises
        self.devices: list[Device] = _devices(self.frame)

    def overlay(self, path: Path, chosen: Device, device: DeviceInfo) -> Overlay:
        """The user table at ``path`` laid over ``chosen``'s rows problem by problem (MIOpen's
        user find-db over its system db): its rows of this GPU (``overlay_device``) replace
        the table's at the problems they hold and add the others, as rows of ``chosen``."""
        user = self._table.read(path, facts=FACTS)  # validates, or raises
        devices = _devices(user)
        mine = overlay_device(devices, chosen, device)
        if mine is None:
            return Overlay(None, [], devices)
        rows = user[(user[list(DEVICE_COLUMNS)] == list(mine)).all(axis=1)]
        relabelled = rows.assign(**dict(zip(DEVICE_COLUMNS, chosen, strict=True)))
        self.frame = overlaid(self._table, self.frame, relabelled)
        return Overlay(mine, self._table.provenances(rows), [d for d in devices if d != mine])

    def _rows(self, device: Device):
        frame = self.frame
        if len(self.devices) == 1:
            return frame
        return frame[(frame["arch"] == device[0]) & (frame["device_name"] == device[1])
                     & (frame["cu_count"] == device[2])]

    def provenance(self, device: Device) -> list[dict[str, Any]]:
        return self._table.provenances(self._rows(device))

    def carry(self, device: Device, times: Callable[[Any], Any]) -> None:
        """The device's ok rows' ``time_us`` replaced by ``times(rows)`` (a table carried to
        another GPU model: ``loading``'s transfer)."""
        frame = self.frame.copy()
        rows = frame.loc[frame.index.isin(self._rows(device).index)
                         & (frame["status"] == "ok").to_numpy()]
        if len(rows):
            frame.loc[rows.index, "time_us"] = times(rows)
        self.frame = frame

    def entries(self, device: Device, routes: Mapping[str, Route], capturable: bool = False,
                plan_calls: int = DEFAULT_PLAN_CALLS, sharing: set[str] = frozenset(),
                policy: Policy = FAST):
        """Per key, its usable ok routes cheapest step first (``step_cost``; with
        ``capturable`` only steps a graph replays; only rows ``policy`` admits);
        column-wise, as load time matters. Also the skipped row counts, per key the known
        routes that failed there, and per key the ok rows the policy held back."""
        import numpy as np
        import pandas as pd

        route_ids = set(routes)
        rows = self._rows(device)
        ok = (rows["status"] == "ok").to_numpy()
        known = rows["route"].isin(route_ids).to_numpy()
        skipped = {str(r): int(n) for r, n in
                   rows.loc[ok & ~known, "route"].value_counts().items()}
        not_measured = unmeasured(rows)
        failing = ~ok & known & ~not_measured
        failed = self._failures(rows.loc[failing, [*_PROBLEM_COLUMNS, "route", "status"]])
        usable = self._usable(rows, route_ids, capturable) & \
            ~reference_fallbacks(rows, not_measured, _PROBLEM_COLUMNS)
        rows = rows.loc[usable,
                        [*_PROBLEM_COLUMNS, "route", "route_params", "time_us", "rank",
                         "plan_on", "plan_us", "plan_host_us", "dcp_timing", "rel_err"]]
        fits, classes, class_ok = admission.admitted(rows, policy, routes)
        held = self._held(rows[~fits], classes[~fits], capturable, plan_calls, sharing)
        # Admitted by class, past the class's bound: that route failed there.
        over = rows.loc[~fits & class_ok, [*_PROBLEM_COLUMNS, "route"]]
        failed = _merged(failed, self._failures(over.assign(status=Status.REJECTED_ACCURACY.value)))
        rows = rows[fits]
        rows = rows[self._table.competing_rows(rows, by=_PROBLEM_COLUMNS)]
        if rows.empty:
            return [], skipped, failed, held
        key_id = rows.groupby(_PROBLEM_COLUMNS, sort=False).ngroup()
        cost = self._costs(rows, capturable, plan_calls, sharing)
        order = np.lexsort((rows["rank"].to_numpy(), cost, key_id.to_numpy()))
        sorted_ids = key_id.to_numpy()[order]
        starts = np.flatnonzero(np.r_[True, sorted_ids[1:] != sorted_ids[:-1]])
        route_codes, route_names = pd.factorize(rows["route"])
        params_codes, params_texts = pd.factorize(rows["route_params"])
        columns = Columns(route_codes[order], list(route_names),
                           params_codes[order], [_frozen_params(t) for t in params_texts],
                           cost[order])
        firsts = rows.iloc[order[starts]]  # each key's winner row
        keys = self._table.key_strings(firsts)
        buckets: dict[tuple, tuple] = {}  # one tuple object per bucket, shared
        bucket_of = [buckets.setdefault(b, b) for b in
                     zip(*(firsts[c].tolist() for c in BUCKET_FIELDS), strict=True)]
        winners = zip([columns.routes[c] for c in columns.route_codes[starts].tolist()],
                      [columns.params[c] for c in columns.params_codes[starts].tolist()],
                      columns.times[starts].tolist(), strict=True)
        ends = [*starts[1:].tolist(), len(order)]
        entries = list(zip(keys, bucket_of, firsts["batch"].tolist(), firsts["kv_len"].tolist(),
                           winners, [columns] * len(keys), starts.tolist(), ends, strict=True))
        return entries, skipped, failed, held

    @staticmethod
    def _costs(rows, capturable: bool, plan_calls: int, sharing: set[str]):
        return step_cost(rows["time_us"].to_numpy(), rows["plan_on"].to_numpy(dtype=object),
                         rows["plan_us"].to_numpy(), rows["plan_host_us"].to_numpy(),
                         capturable, plan_calls, rows["route"].isin(sharing).to_numpy())

    def _held(self, rows, classes, capturable: bool, plan_calls: int, sharing: set[str]
              ) -> dict[str, tuple[Held, ...]]:
        """Per key, the rows an accuracy policy held back, cheapest first."""
        if rows.empty:
            return {}
        costs = self._costs(rows, capturable, plan_calls, sharing)
        held: dict[str, list[Held]] = {}
        for key, route, cls, err, cost in zip(self._table.key_strings(rows), rows["route"],
                                              classes, rows["rel_err"], costs, strict=True):
            held.setdefault(key, []).append((str(route), str(cls), float(err), float(cost)))
        return {k: tuple(sorted(v, key=lambda h: h[3])) for k, v in held.items()}

    @staticmethod
    def _usable(rows, route_ids: set[str], capturable: bool):
        """The ok rows of known routes; with ``capturable`` only the steps a graph replays
        (the other ok steps are left out, not failed: they are eager callers')."""
        usable = (rows["status"] == "ok").to_numpy() & rows["route"].isin(route_ids).to_numpy()
        return usable & rows["capturable"].to_numpy(dtype=bool) if capturable else usable

    def measured_keys(self, device: Device, routes: Mapping[str, Route],
                      capturable: bool = False, policy: Policy = FAST) -> set[str]:
        """The keys with a usable row timed across processes (``schema.is_measured``)."""
        rows = self._rows(device)
        rows = rows[self._usable(rows, set(routes), capturable)
                    & (rows["dcp_timing"] == DCP_MEASURED).to_numpy()]
        rows = rows[admission.admitted(rows, policy, routes)[0]]
        return set(self._table.key_strings(rows)) if len(rows) else set()

    def _failures(self, rows) -> dict[str, Failures]:
        """Per key, its rows that are not ok as (route, status) pairs; keys that fail the
        same way share one tuple. Column-wise but for one short step per failing key."""
        import numpy as np
        import pandas as pd

        if rows.empty:
            return {}
        key_id = rows.groupby(_PROBLEM_COLUMNS, sort=False).ngroup()
        route_codes, route_names = pd.factorize(rows["route"])
        status_codes, status_names = pd.factorize(rows["status"])
        n = len(status_names)
        pair = route_codes * n + status_codes
        order = np.lexsort((pair, key_id.to_numpy()))
        sorted_ids = key_id.to_numpy()[order]
        starts = np.flatnonzero(np.r_[True, sorted_ids[1:] != sorted_ids[:-1]])
        keys = self._table.key_strings(rows.iloc[order[starts]])
        pairs = pair[order].tolist()
        ends = [*starts[1:].tolist(), len(order)]
        shared: dict[tuple[int, ...], Failures] = {}
        failed = {}
        for key, start, end in zip(keys, starts.tolist(), ends, strict=True):
            codes = tuple(pairs[start:end])
            failures = shared.get(codes)
            if failures is None:
                failures = shared[codes] = tuple((str(route_names[c // n]),
                                                  str(status_names[c % n])) for c in codes)
            failed[key] = failures
        return failed


class JsonSource:
    """A winners map (``mlatune export --format json``): no pandas needed. Its failures
    (``failed``, ``all_failed``) give the same skips as the table's rows that are not ok;
    a map written before they were recorded has none."""

    def __init__(self, path: Path):
        self.path = path
        loaded = winners_map.read(path, FACTS)  # validates; raises TableError
        self._by_device = {(d["arch"], d["device_name"], d["cu_count"]): (d, problems)
                           for d, problems in zip(loaded.document["devices"], loaded.problems,
                                                  strict=True)}
        self.devices: list[Device] = list(self._by_device)

    def provenance(self, device: Device) -> list[dict[str, Any]]:
        return self._by_device[device][0]["provenance"]

    def carry(self, device: Device, times: Callable[[Any], Any]) -> None:
        """Not for a winners map (its options are not rows): the caller serves it as is."""
        raise TableError(f"{self.path}: a winners map's times are not carried to another GPU")

    def entries(self, device: Device, routes: Mapping[str, Route], capturable: bool = False,
                plan_calls: int = DEFAULT_PLAN_CALLS, sharing: set[str] = frozenset(),
                policy: Policy = FAST):
        """As ``FrameSource.entries``, from each key's winner and alternatives."""
        route_ids = set(routes)
        codes: dict[str, int] = {}  # route id -> code
        params: dict[str, int] = {}  # canonical params JSON -> code
        route_codes: list[int] = []
        params_codes: list[int] = []
        times: list[float] = []
        spans, skipped, held, over = [], {}, {}, {}
        bare = 0  # winners-only keys whose one option the policy holds back
        entry, problems = self._by_device[device]
        for key, winner in entry["winners"].items():
            start = len(times)
            options = [winner, *winner.get("alternatives", ())]
            for option in options:
                if option["route"] not in route_ids:
                    skipped[option["route"]] = skipped.get(option["route"], 0) + 1
            options, held_here, over[key] = _admitted(options, problems[key], routes, policy)
            held[key] = _held_options(held_here, capturable, plan_calls, sharing)
            bare += bool(held_here) and not options and "alternatives" not in winner
            for cost, option in _by_step_cost(_competing(options, route_ids, capturable),
                                              capturable, plan_calls, sharing):
                text = json.dumps(option["params"], sort_keys=True) if option["params"] \
                    else "{}"
                route_codes.append(codes.setdefault(option["route"], len(codes)))
                params_codes.append(params.setdefault(text, len(params)))
                times.append(cost)
            if len(times) > start:
                spans.append((problems[key], start, len(times)))
        columns = Columns(route_codes, list(codes), params_codes,
                           [_frozen_params(text) for text in params], times)
        buckets: dict[tuple, tuple] = {}
        entries = [(p.key, buckets.setdefault(p.bucket, p.bucket), p.batch, p.kv_len,
                    columns.option(start), columns, start, end) for p, start, end in spans]
        if bare:
            log.warning("mlatune: %s keeps only each problem's winner: at %d measured problems "
                        "accuracy policy %s holds it back and nothing else measured is there "
                        "(export with --accuracy %s)", self.path, bare, policy.name, policy.name)
        failed = _merged(self._failures(entry, route_ids),
                         {k: tuple((r, Status.REJECTED_ACCURACY.value) for r in v)
                          for k, v in over.items() if v})
        return entries, skipped, failed, {k: v for k, v in held.items() if v}

    def measured_keys(self, device: Device, routes: Mapping[str, Route],
                      capturable: bool = False, policy: Policy = FAST) -> set[str]:
        """As ``FrameSource.measured_keys``, from the options' ``dcp_timing``."""
        entry, problems = self._by_device[device]
        return {key for key, winner in entry["winners"].items()
                if any(is_measured(o.get("dcp_timing")) for o in _competing(
                    _admitted([winner, *winner.get("alternatives", ())], problems[key],
                              routes, policy)[0], set(routes), capturable))}

    @staticmethod
    def _failures(entry: Mapping[str, Any], route_ids: set[str]) -> dict[str, Failures]:
        """Per key, its known routes that failed there, as ``FrameSource._failures``
        gives them (pairs sorted; one shared tuple per pattern)."""
        # Keys fail in a few patterns (the same backends unsupported everywhere): each
        # pattern is sorted and filtered once, its tuple shared.
        shared: dict[tuple, Failures] = {}
        failed: dict[str, Failures] = {}
        keyed = itertools.chain(((k, w.get("failed")) for k, w in entry["winners"].items()),
                                entry.get("all_failed", {}).items())
        for key, by_status in keyed:
            if not by_status:
                continue
            pattern = tuple((s, tuple(routes)) for s, routes in by_status.items())
            pairs = shared.get(pattern)
            if pairs is None:
                pairs = shared[pattern] = tuple(
                    p for p in winners_map.failures(by_status) if p[0] in route_ids)
            if pairs:
                failed[key] = pairs
        return failed


def _admitted(options: Sequence[Mapping[str, Any]], problem, routes: Mapping[str, Route],
              policy: Policy) -> tuple[list[Mapping[str, Any]], list[tuple[str, Mapping]],
                                       list[str]]:
    """A winners-map key's options ``policy`` admits; the known ones it holds back, with their
    classes; and the routes held back only for their recorded error (they failed there)."""
    kept, held, over = [], [], []
    for option in options:
        ok, class_ok, cls = admission.option_admitted(option, problem, routes, policy)
        if ok:
            kept.append(option)
        elif option["route"] in routes:
            held.append((str(cls), option))
            if class_ok:
                over.append(option["route"])
    return kept, held, over


def _held_options(held: list[tuple[str, Mapping]], capturable: bool, plan_calls: int,
                  sharing: set[str]) -> tuple[Held, ...]:
    """A key's held-back options as ``Held`` entries, cheapest first (those the caller can
    call: with ``capturable`` the steps a graph replays)."""
    entries = []
    for cls, option in held:
        for cost, _ in _by_step_cost([option], capturable, plan_calls, sharing):
            error = option.get("rel_err")
            entries.append((str(option["route"]), cls, math.nan if error is None else
                            float(error), cost))
    return tuple(sorted(entries, key=lambda h: h[3]))


def _merged(failed: dict[str, Failures], more: Mapping[str, Failures]) -> dict[str, Failures]:
    """Two per-key failure maps as one (each key's pairs sorted, without repeats)."""
    for key, pairs in more.items():
        failed[key] = tuple(sorted(set(failed.get(key, ())) | set(pairs)))
    return failed


def _competing(options: Sequence[Mapping[str, Any]], route_ids: set[str], capturable: bool
               ) -> list[Mapping[str, Any]]:
    """A winners-map key's usable options (known routes; with ``capturable`` steps a graph
    replays) that compete (``schema.competing``), as ``_FrameSource.entries`` keeps rows."""
    usable = [o for o in options if o["route"] in route_ids
              and (o.get("capturable", False) or not capturable)]
    measured = [is_measured(o.get("dcp_timing")) for o in usable]
    return [o for o, kept in zip(usable, competing([0] * len(usable), measured), strict=True)
            if kept]


def _by_step_cost(options, capturable: bool, plan_calls: int = DEFAULT_PLAN_CALLS,
                  sharing: set[str] = frozenset()) -> list[tuple[float, dict]]:
    """A winners map's options of one key as (step cost, option), cheapest first (stable:
    the map's order breaks ties); only capturable steps with ``capturable``."""
    costed = []
    for option in options:
        if capturable and not option.get("capturable", False):
            continue
        cost = step_cost(float(option["time_us"]), option.get("plan_on", "none"),
                         _number(option.get("plan_us")), _number(option.get("plan_host_us")),
                         capturable, plan_calls, option["route"] in sharing)
        costed.append((float(cost), option))
    return sorted(costed, key=lambda pair: pair[0])


def _number(value) -> float:
    """A winners map's cost: null where not measured (an upgraded v1 map)."""
    return math.nan if value is None else float(value)

