"""How a ``Dispatcher`` is made: from a table file (``load``), from the table mlatune ships
for the device (``from_bundled``, with the environment's overrides) or from the rules alone
(``rules_only``); the dispatcher's classmethods of those names are these functions."""

from __future__ import annotations

import gc
import logging
import os
from collections.abc import Callable, Mapping
from importlib import resources
from pathlib import Path
from typing import Any, TypeVar

from mlatune import hardware
from mlatune.arch import DeviceInfo, current_device, vendor_of
from mlatune.check.policy import Policy, policy_named
from mlatune.dispatch import bundled, environment, ranks, sources
from mlatune.errors import RankMismatchError, SettingError, TableError
from mlatune.routes import Route, all_routes
from mlatune.routes.torch_ref import REFERENCE_ID as REFERENCE_ROUTE
from mlatune.routes.torch_ref import TorchReferenceRoute
from mlatune.table.cost import DEFAULT_PLAN_CALLS
from mlatune.table.user import USER_TABLE_ENV

# The class these functions make (mlatune.dispatch.dispatcher.Dispatcher, whose classmethods
# they are): a type variable, as this module sits below the one that imports it.
Dispatcher = TypeVar("Dispatcher")

log = logging.getLogger("mlatune")

TABLE_ENV = "MLATUNE_TABLE"
# A table of the user's own measurements that overlays the bundled one problem by problem
# (its rows replace the bundled rows of the problems it holds and add the problems the
# bundled table lacks): USER_TABLE_ENV, owned by mlatune.table.user.
# What a table measured on another GPU model is to this one: "use" (the default: served as
# measured, with one warning naming both models), "transfer" (its times carried to this GPU
# by the cost laws, mlatune.dispatch.laws, from both models' figures, mlatune.hardware; one
# log line says so) or "refuse" (a TableError naming both models; the bundled table then
# gives way to the rules). "use" is the default as measured: between the H100 and the H200,
# the laws' carried picks were no closer to the best than the other model's picks as they
# are (benchmarks/RESULTS.md).
OTHER_GPU_ENV = "MLATUNE_OTHER_GPU"
OTHER_GPU = ("use", "transfer", "refuse")
# Where on-first-sight timings are written (mlatune.dispatch.first_sight); unset: off.
FIRST_SIGHT_ENV = "MLATUNE_FIRST_SIGHT"


# How an unmeasured shape of a measured bucket is answered: "predict" (each recipe's time
# predicted from the bucket's points, mlatune.dispatch.predict) or "nearest" (the nearest
# point's winner); benchmarks/RESULTS.md has how the two compare on held-out problems.
UNMEASURED = ("predict", "nearest")
DEFAULT_UNMEASURED = "predict"


def check_options(plan_calls: int, unmeasured: str | None) -> None:
    """A dispatcher's options, refused by name (ValueError) before any table is read."""
    if not isinstance(plan_calls, int) or isinstance(plan_calls, bool) or plan_calls < 1:
        raise ValueError(f"plan_calls must be an int >= 1 (the calls sharing one plan: the "
                         f"model's layers, or 1), got {plan_calls!r}")
    if unmeasured is not None and unmeasured not in UNMEASURED:
        raise ValueError(f"unmeasured must be one of {UNMEASURED}, got {unmeasured!r}")


def device_for_arch(arch: str, name: str = "", cu_count: int = 0) -> DeviceInfo:
    """A stand-in device for planning on an arch this machine does not have."""
    vendor = vendor_of(arch)
    return DeviceInfo(arch, name or arch, vendor, cu_count, 0, -1 if vendor == "cpu" else 0)




def registered_routes(routes: Mapping[str, Route] | None = None) -> dict[str, Route]:
    """A snapshot of the registry (or of ``routes``), with the last resort always present."""
    routes = dict(routes) if routes is not None else {r.id: r for r in all_routes()}
    if REFERENCE_ROUTE not in routes:
    
        routes[REFERENCE_ROUTE] = TorchReferenceRoute()
    return routes


def rules_only(cls, device: DeviceInfo | None = None, capturable: bool = False,
               accuracy: Policy | str | None = None,
               first_sight: str | os.PathLike | None = None,
               plan_calls: int = DEFAULT_PLAN_CALLS) -> Dispatcher:
    """A dispatcher without a table: every answer comes from the rule order (and, with
    ``first_sight``, is timed on first sight, as every rule answer is unsure)."""
    return cls(device or current_device(), capturable=capturable, accuracy=accuracy,
               first_sight=first_sight, plan_calls=plan_calls)

def load(cls, path: str | os.PathLike, device: DeviceInfo | None = None,
         allow_arch: str | None = None, capturable: bool = False,
         plan_calls: int = DEFAULT_PLAN_CALLS, unmeasured: str | None = None,
         overlay: str | os.PathLike | None = None,
         first_sight: str | os.PathLike | None = None, group: Any = None,
         accuracy: Policy | str | None = None, other_gpu: str | None = None) -> Dispatcher:
    """Load a table (.parquet, .csv, .json winners map, or a directory holding one).

    Refuses (TableError) a damaged or invalid table, and one whose arch is
    not the device's unless ``allow_arch`` names the table's arch (planning
    for another machine: ``supports()`` then sees a stand-in device).
    ``capturable``: for a caller that replays CUDA graphs (the class docstring).
    ``plan_calls``: how many calls share one device plan (``DEFAULT_PLAN_CALLS``: an
    engine that plans once per step for DeepSeek-V3's 61 layers; one that plans every
    call passes 1): routes are ranked by the launch plus that share of the plan
    (``step_cost``). ``unmeasured``: how shapes the table did not measure are
    answered (``UNMEASURED``; None: ``DEFAULT_UNMEASURED``). ``overlay``: a Parquet or
    CSV table whose rows replace the table's for the problems it holds (per device),
    and add the others (``USER_TABLE_ENV``). ``first_sight``: a user table that
    ``attention.decode`` times unsure answers into at run time
    (``mlatune.dispatch.first_sight``; ``FIRST_SIGHT_ENV``). ``group``: a torch.distributed
    process group whose ranks serve one answer per problem (``mlatune.dispatch.ranks``).
    ``accuracy``: which rounding beyond the problem's dtypes may be served (a
    ``check.policy`` name; None: ``MLATUNE_ACCURACY``'s, else "strict"); a bad name is a
    ValueError. Whatever else a damaged file makes loading raise (OverflowError,
    RecursionError, Arrow errors, ...) is a TableError naming the file, one line.

    A table measured on another GPU model (``OTHER_GPU``; None: ``MLATUNE_OTHER_GPU``'s,
    else "use") is served as measured ("use"), has its times carried to this GPU by the
    cost laws ("transfer", one log line) or is refused ("refuse"); served, it and one
    measured under another driver or library version are loaded with one warning on the
    ``mlatune`` logger per table file and set of differences in a process; the differences
    are in ``environment_differences`` (``mlatune.dispatch.environment``).
    """
    device = device or current_device()
    policy, other = _settings(group, plan_calls, unmeasured, accuracy, other_gpu)
    ranks.agree_at_load(group, path, overlay, device, allow_arch, capturable, plan_calls,
                        unmeasured, first_sight,
                        accuracy=policy.name, other_gpu=other)  # before parsing: see there
    # Loading creates ~10^5 small acyclic objects; cyclic GC passes over them
    # would double the load time and find nothing to free.
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        dispatcher = _load(cls, Path(path), device, allow_arch, capturable, plan_calls,
                               unmeasured, None if overlay is None else Path(overlay),
                               policy, other)
        dispatcher.first_sight, dispatcher.group = first_sight, group
        return dispatcher
    except TableError:
        raise
    except Exception as exc:  # a damage no check foresaw: still the table's fault
        text = str(exc).strip().splitlines()
        raise TableError(f"{path}: unusable table ({type(exc).__name__}"
                         f"{': ' + text[0] if text else ''})") from exc
    finally:
        if was_enabled:
            gc.enable()

def _settings(group: Any, plan_calls: int, unmeasured: str | None,
              accuracy: Policy | str | None, other_gpu: str | None) -> tuple[Policy, str]:
    """The load's accuracy policy and other-GPU policy, its options checked; a ValueError
    (SettingError) for a bad one, raised on every rank of ``group`` (``ranks.fail_together``:
    the others would otherwise wait for this rank in the collective)."""
    try:
        check_options(plan_calls, unmeasured)
        return policy_named(accuracy), other_gpu_setting(other_gpu)
    except ValueError as exc:
        ranks.fail_together(group, exc)
        raise


def _load(cls, path: Path, device: DeviceInfo, allow_arch: str | None,
          capturable: bool, plan_calls: int, unmeasured: str | None,
          overlay: Path | None = None, policy: Policy | None = None,
          other_gpu: str = OTHER_GPU[0]) -> Dispatcher:
    policy = policy_named(policy)
    path, source, chosen = sources.open_source(path, overlay, device, allow_arch)
    planning = allow_arch is not None and device.arch != allow_arch
    if other_gpu == "refuse" and not planning and device.is_gpu and chosen[1] != device.name:
        raise TableError(f"{path}: measured on {chosen[1]}, this GPU is {device.name} "
                         f"({OTHER_GPU_ENV}=refuse)")
    provenance = source.provenance(chosen)
    if planning:
        device = device_for_arch(*chosen)
        running = None  # planning for another machine: this one's versions do not matter
    else:
        running = environment.here(device)
    if other_gpu == "transfer" and running is not None and device.is_gpu \
            and chosen[1] != device.name:
        _transfer(source, chosen, provenance, device, path)
    differences = [] if running is None else \
        environment.differences(provenance, chosen, running)
    if overlay is not None:  # after the transfer: the user's rows were timed where they say
        differences += _overlaid(source, overlay, chosen, device, running)
    routes = registered_routes()
    sharing = {r for r, route in routes.items() if route.shares_plan}
    entries, skipped, failed, held = source.entries(chosen, routes, capturable, plan_calls,
                                                    sharing, policy)
    where = str(path) if overlay is None else f"{path} + {overlay}"
    dispatcher = cls(device, entries, routes=routes, source=where, table_device=chosen,
                     planning=allow_arch is not None, plan_calls=plan_calls,
                     unmeasured=unmeasured,
                     measured_keys=source.measured_keys(chosen, routes, capturable, policy),
                     provenance=provenance, skipped_routes=skipped, failed=failed,
                     capturable=capturable, environment_differences=differences,
                     accuracy=policy, held_back=held,
                     hardware=hardware.recorded(provenance, chosen[1], chosen[0], chosen[2]))
    environment.warn_once(str(path), differences)
    return dispatcher

def _overlaid(source: Any, overlay: Path, chosen: tuple[str, str, int], device: DeviceInfo,
              running: environment.Environment | None) -> list[str]:
    """The user table laid over the table's device (``FrameSource.overlay``), a warning for
    its rows of other GPUs left out; what differs where its rows were measured."""
    laid = source.overlay(overlay, chosen, device)
    if laid.left_out:
        names = ", ".join(f"{name} ({cu})" for _, name, cu in laid.left_out)
        (log.info if laid.device else log.warning)(
            "mlatune: user table %s: its rows of %s are not overlaid (measured on another "
            "GPU than this %s)", overlay, names, device.name)
    if laid.device is None or running is None:
        return []
    return [f"user table {d}" for d in environment.differences(laid.provenance, laid.device,
                                                                running)]


def _transfer(source: Any, chosen: tuple[str, str, int], provenance: list[dict[str, Any]],
              device: DeviceInfo, path: Path) -> None:
    """The table's times carried from the GPU it was measured on to ``device`` by the cost
    laws, with one log line; where no law can carry them, served as measured (a warning)."""
    measured = hardware.recorded(provenance, chosen[1], chosen[0], chosen[2])
    here = hardware.of_device(device)
    unknown = [h.name for h in (measured, here)
               if h.bandwidth_gbs is None or h.tensor_tflops is None]
    if unknown:
        log.warning("mlatune: table %s measured on %s is served as measured on %s: no "
                    "bandwidth or tensor figures for %s", path, chosen[1], device.name,
                    " or ".join(unknown))
        return
    routes = registered_routes()
    try:
        from mlatune.dispatch import laws

        source.carry(chosen, lambda rows: laws.transfer_times(rows, routes, measured, here))
    except Exception as exc:  # no law for these rows: the measured times as they are
        log.warning("mlatune: table %s measured on %s could not be carried to %s (%s); "
                    "served as measured", path, chosen[1], device.name, exc)
        return
    log.info("mlatune: table %s measured on %s; this GPU is %s: its times carried over by "
             "the cost laws (%s) (%s=use serves them as measured, refuse refuses the table)",
             path, chosen[1], device.name, _figures(measured, here), OTHER_GPU_ENV)


def _figures(measured: hardware.Hardware, here: hardware.Hardware) -> str:
    """What differs between two GPUs' figures, as a log line's part."""
    shown = [("SMs", measured.sm_count, here.sm_count, ""),
             ("bandwidth", measured.bandwidth_gbs, here.bandwidth_gbs, " GB/s"),
             ("tensor", measured.tensor_tflops, here.tensor_tflops, " TFLOP/s")]
    return ", ".join(f"{name} {a:g} -> {b:g}{unit}" for name, a, b, unit in shown
                     if a is not None and b is not None)


def from_bundled(cls, device: DeviceInfo | None = None, capturable: bool = False,
                 plan_calls: int = DEFAULT_PLAN_CALLS, group: Any = None,
                 accuracy: Policy | str | None = None) -> Dispatcher:
    """The table shipped with mlatune for this device's arch; ``MLATUNE_TABLE`` overrides.
    ``MLATUNE_USER_TABLE`` (a Parquet or CSV table of the user's own sweeps) overlays
    either, problem by problem (``load(overlay=)``). ``group``, ``accuracy``: as
    ``load``'s (a bad policy name raises, never falls back to the rules).

    An explicit ``MLATUNE_TABLE`` that cannot be used raises (the operator
    asked for that file); a bundled table that cannot be used (damaged, or refused as
    another GPU model's) is logged and the user table serves alone, else the rules, so a
    model load never fails on it; a user table that cannot be used is logged, naming it,
    and the table under it serves alone.
    """
    device = device or current_device()
    # A bad setting raises here (on every rank of group), never hidden in the rules.
    policy, other = _settings(group, plan_calls, None, accuracy, None)
    override = os.environ.get(TABLE_ENV)
    user = os.environ.get(USER_TABLE_ENV) or None
    sight = os.environ.get(FIRST_SIGHT_ENV) or None
    if user and not Path(user).is_file():
        log.warning("mlatune: %s=%s is not a file; no user table overlaid", USER_TABLE_ENV,
                    user)
        user = None
    given = dict(capturable=capturable, plan_calls=plan_calls, first_sight=sight,
                 group=group, accuracy=policy, other_gpu=other)
    def rules() -> Dispatcher:
        return ranks.joined(cls.rules_only(device, capturable, policy, first_sight=sight,
                                           plan_calls=plan_calls), group)

    if override:
        return with_user_table(cls, override, user, rules, device=device, **given)
    try:
        found = bundled.find_table(bundled.bundled_tables_dir(), device.arch, device.name)
        if found is None:
            return with_user_table(cls, None, user, rules, device=device, **given)
        with resources.as_file(found) as path:
            return with_user_table(cls, path, user, rules, device=device, **given)
    except Exception as exc:  # load raises TableError; an unreadable directory OSError
        if isinstance(exc, RankMismatchError):  # never hidden behind the rules
            raise
        if user is None:
            log.warning("mlatune: bundled table unusable, dispatching by rule: %s", exc)
            return rules()
        log.warning("mlatune: bundled table unusable, the user table serves alone: %s", exc)
        return with_user_table(cls, None, user, rules, device=device, **given)


def with_user_table(cls, path: str | os.PathLike | None, user: str | None,
                    rules: Callable[[], Dispatcher], **given: Any) -> Dispatcher:
    """``path`` with the user table overlaid (``load(overlay=)``; None: the user table
    alone, else ``rules()``). Where the user table is what fails (damaged, or a base that
    takes no overlay), what is under it serves, with a warning naming it; a failure of
    ``path`` raises."""
    try:
        if path is None:
            return cls.load(user, **given) if user else rules()
        return cls.load(path, overlay=user, **given)
    except TableError as exc:
        if user is None or (path is not None and str(user) not in str(exc)):
            raise
        log.warning("mlatune: %s=%s %s: %s", USER_TABLE_ENV, user,
                    "unusable, dispatching by rule" if path is None
                    else "not overlaid, the table under it serves alone", exc)
        return rules() if path is None else cls.load(path, **given)


def other_gpu_setting(value: str | None = None) -> str:
    """``load``'s ``other_gpu``, or ``MLATUNE_OTHER_GPU``'s (a bad value names its source)."""
    if value is not None:
        if value not in OTHER_GPU:
            raise ValueError(f"other_gpu: {value!r} is not one of {', '.join(OTHER_GPU)}")
        return value
    found = (os.environ.get(OTHER_GPU_ENV) or OTHER_GPU[0]).strip().lower()
    if found not in OTHER_GPU:
        raise SettingError(f"{OTHER_GPU_ENV}: {found!r} is not one of {', '.join(OTHER_GPU)}")
    return found
