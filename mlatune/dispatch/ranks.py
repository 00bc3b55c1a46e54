"""One answer on every rank: the ranks of a torch.distributed process group that run an
attention layer together (tensor or context parallel) serve the same route and parameters
for each problem. Ranks that did not would round differently, plan different steps, and
deadlock where a route holds a collective.

``Dispatcher.load(..., group=)`` (and ``from_bundled``) calls ``agree_at_load`` before it
reads the table: every rank must have the same table and user-table bytes, GPU model,
registered routes (and which of them can run here), library versions and load arguments,
or every rank raises ``RankMismatchError`` naming each rank's value. Checked before
parsing, so that a table that one rank cannot read refuses the group rather than leaving
the others waiting.
First sight (``mlatune.dispatch.first_sight``) times its candidates on every rank and
calls ``agree_on_timings``, which makes the ranks' timings one.

The rest of ``select`` needs no collective: its answer is a function of what the load
checked. A measured answer is the table's ranking; a rule answer follows the rule order
(sorted from the table's wins and the registered routes); a nearest answer is the
closest point by a fixed distance with fixed tie-breaks; a prediction is the same numpy
arithmetic over the same rows in the same order, and remembered answers change only by
first sight, which agrees first. Left to the caller: ranks must meet the same problems in
the same order (TP and DCP ranks do; data-parallel ranks are not one group), and ranks
on hosts whose CPUs run different numpy kernels might round a predicted near-tie apart.

``group`` is a torch.distributed process group (``torch.distributed.group.WORLD`` for
all ranks); None, the default, is this process alone and calls nothing collective. With
NCCL, each rank's current CUDA device must be its own (``torch.cuda.set_device``), as
``all_gather_object`` requires.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import torch.distributed as dist

from mlatune.arch import DeviceInfo, library_versions, units_text
from mlatune.dispatch.bundled import find_table
from mlatune.errors import RankMismatchError
from mlatune.routes import all_routes

if TYPE_CHECKING:
    from mlatune.dispatch.choice import Choice
    from mlatune.problem import MLAProblem
    from mlatune.table.schema import Provenance

Made = TypeVar("Made")  # a Dispatcher (its module imports this one)

# (time_us, choice, parameters it ran with) per candidate that ran: first sight's timings
Timed = list[tuple[float, "Choice", Any]]

# What each field of a load's fingerprint must share, said when ranks differ.
_ASK = {
    "settings": "every rank's load settings (accuracy, MLATUNE_ACCURACY, MLATUNE_OTHER_GPU, "
                "plan_calls) must be ones that load",
    "tables": "load the same table file on every rank",
    "user tables": "every rank's user table (MLATUNE_USER_TABLE, first sight's) must hold "
                   "the same bytes",
    "GPU models": "a group's ranks must run one GPU model, which one table answers for",
    "routes": "every rank must register the same routes, each usable alike (installed "
              "backends, MLATUNE_PLUGINS)",
    "library versions": "every rank must run the same library versions",
    "load arguments": "load with the same arguments on every rank",
    "route settings": "set these environment variables alike on every rank",
}
_SETTINGS_OK = "loaded"  # a rank's settings field where they loaded
# Environment variables that change which routes a process can run or how: ranks that
# differ in one would pick differently from one table.
ROUTE_SETTINGS = ("TRITON_INTERPRET", "MLATUNE_AITER_GLUON", "MLATUNE_PLUGINS")


def agree_at_load(group: dist.ProcessGroup | None, table: str | os.PathLike | None,
                  overlay: str | os.PathLike | None, device: DeviceInfo,
                  allow_arch: str | None, capturable: bool, plan_calls: int,
                  unmeasured: str | None, first_sight: str | os.PathLike | None,
                  **more: Any) -> None:
    """Return when every rank of ``group`` would load the same table the same way (table
    and user table bytes, GPU model, routes, libraries, arguments, and ``more`` arguments
    that decide answers, ``ROUTE_SETTINGS``); else raise RankMismatchError on every rank.
    Nothing to do without a group."""
    if group is None:
        return
    arch = allow_arch or device.arch
    table_digest = _digest(table, arch, device.name)
    overlay_digest = _digest(overlay, arch, device.name)
    versions = {k: v for k, v in library_versions().items() if k != "python"}
    arguments = dict(allow_arch=allow_arch, capturable=capturable, plan_calls=plan_calls,
                     unmeasured=unmeasured, first_sight=first_sight is not None, **more)
    mine = {  # per field: (what is compared, what the message shows)
        "settings": (_SETTINGS_OK,) * 2,  # first: a rank whose settings failed sends it alone
        "tables": (table_digest, _where(table_digest, table)),
        "user tables": (overlay_digest, _where(overlay_digest, overlay)),
        "GPU models": (f"{device.arch} {device.name}, "
                       f"{units_text(device.arch, device.cu_count)}",) * 2,
        "routes": _routes_here(device),
        "library versions": (json.dumps(versions, sort_keys=True),) * 2,
        "load arguments": (json.dumps(arguments, sort_keys=True, default=str),) * 2,
        "route settings": (json.dumps({k: os.environ.get(k) for k in ROUTE_SETTINGS},
                                      sort_keys=True),) * 2,
    }
    everyone = _gather(group, mine)
    for field in mine:
        _refuse_differences(group, field, [rank[field] for rank in everyone], _ASK[field])


def fail_together(group: dist.ProcessGroup | None, error: Exception) -> None:
    """Where this rank's load settings failed (``error``, raised by the caller next): join
    the ranks' agreement anyway, so that the others raise RankMismatchError naming it
    rather than wait in the collective for this rank; RankMismatchError here too where
    another rank's settings loaded. Nothing to do without a group."""
    if group is None:
        return
    said = f"{type(error).__name__}: {error}"
    everyone = _gather(group, {"settings": (said, said)})
    _refuse_differences(group, "settings", [rank["settings"] for rank in everyone],
                        _ASK["settings"])


def _routes_here(device: DeviceInfo) -> tuple[str, str]:
    """The registered routes and those that can run nothing here (a vendor library missing
    or broken on this rank: its routes would refuse every problem the others serve), as
    compared and as shown."""
    found = sorted(all_routes(), key=lambda r: r.id)
    unusable = {r.id: why for r in found if (why := r.unusable(device)) is not None}
    ids = ",".join(r.id for r in found)
    return (f"{ids}; unusable {','.join(unusable)}",
            ids + "".join(f"; {r} unusable: {why}" for r, why in unusable.items()))


def joined(dispatcher: Made, group: dist.ProcessGroup | None) -> Made:
    """A dispatcher made without a table (rules only), agreed across ``group`` as a load
    agrees, so that a rank without a table refuses the group rather than hanging it."""
    agree_at_load(group, None, None, dispatcher.device, None, dispatcher.capturable,
                  dispatcher.plan_calls, dispatcher.unmeasured, dispatcher.first_sight,
                  accuracy=dispatcher.accuracy.name)
    dispatcher.group = group
    return dispatcher


def agree_on_timings(group: dist.ProcessGroup | None, problem: MLAProblem,
                     candidates: Sequence[Choice], timed: Timed, provenance: Provenance
                     ) -> tuple[Timed, Provenance]:
    """First sight's ``timed`` (the candidates that ran here and agreed with the answer)
    made one on every rank of ``group``: each candidate at its time on the slowest rank,
    dropped where any rank could not run it or found it disagreeing; the parameters it
    ran with and the provenance to record are the group's first rank's, so that every
    rank writes the same rows. Unchanged without a group.

    The slowest rank decides because a parallel step ends when its slowest rank's
    attention does: the candidate whose slowest rank is fastest makes the fastest step.
    RankMismatchError when the ranks timed different candidates or problems."""
    if group is None:
        return timed, provenance
    here = {id(choice): (time_us, dict(ran or {})) for time_us, choice, ran in timed}
    mine = [here.get(id(c), (math.inf, {})) for c in candidates]  # inf: not run here
    times, ran = [t for t, _ in mine], [p for _, p in mine]
    subject = f"{problem.key}: " + ", ".join(
        f"{c.route_id} {json.dumps(dict(c.params), sort_keys=True, default=str)}"
        for c in candidates)
    everyone = _gather(group, (subject, times, ran, provenance))
    _refuse_differences(group, "first-sight candidates", [(s,) * 2 for s, *_ in everyone],
                        "ranks must meet the same problems in the same order")
    slowest = [max(column) for column in zip(*(rank_times for _, rank_times, *_ in everyone),
                                             strict=True)]
    first_ran, first_provenance = everyone[0][2], everyone[0][3]
    return [(t, c, p) for t, c, p in zip(slowest, candidates, first_ran, strict=True)
            if math.isfinite(t)], first_provenance


def _digest(path: str | os.PathLike | None, arch: str, device_name: str) -> str:
    """The sha256 of a table file's bytes (a directory's table for ``arch``), shortened;
    what stood in the way where it cannot be read. Never raises: every rank must reach
    the collective that compares it."""
    if path is None:
        return "no table"
    try:
        file = Path(path)
        if file.is_dir():
            found = find_table(file, arch, device_name)
            if found is None:
                return f"no table for {arch} in the directory"
            file = Path(found)
        with open(file, "rb") as handle:
            return "sha256 " + hashlib.file_digest(handle, "sha256").hexdigest()[:16]
    except OSError as exc:
        return f"unreadable ({type(exc).__name__})"


def _where(digest: str, path: str | os.PathLike | None) -> str:
    return digest if path is None else f"{digest} ({path})"


def _gather(group: dist.ProcessGroup, mine: Any) -> list[Any]:
    """Every rank's ``mine``, in the group's rank order."""
    everyone: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, mine, group=group)
    return everyone


def _refuse_differences(group: dist.ProcessGroup, what: str,
                        values: Sequence[tuple[str, str]], ask: str) -> None:
    """Raise RankMismatchError naming the ranks of each value (compared by its first
    part, shown by the second, the first rank's of those that have it) when they differ."""
    if len({compared for compared, _ in values}) <= 1:
        return
    sides: dict[str, tuple[str, list[int]]] = {}
    for rank, (compared, shown) in zip(dist.get_process_group_ranks(group), values, strict=True):
        sides.setdefault(compared, (shown, []))[1].append(rank)
    said = "; ".join(f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}: "
                     f"{shown}" for shown, ranks in sides.values())
    raise RankMismatchError(f"the ranks of the process group differ in their {what} "
                            f"({said}): {ask}")
