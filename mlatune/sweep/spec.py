"""Sweep specs: a TOML file naming the problems to measure and how.

    name = "smoke"
    seed = 0                       # inputs of each problem derive from it
    routes = []                    # route ids to consider; empty = every viable one
    max_params_per_route = 0       # keep each route's first N parameter sets (0 = all)
    [max_params]                   # optional: that cut per route id, over the one above
    "segmented/triton" = 2
    max_problems = 200000          # refuse grids with more combinations (see below)
    dcp_top_k = 3                  # DCP problems measured across GPUs (--gpus N): each
                                   # problem's K fastest routes in the one-GPU pass (0: none)

    [budget]                       # per candidate (see timers.Budget)
    warmup = 1                     # counts: whole numbers up to 1,000,000
    min_reps = 10
    max_reps = 200                 # >= 1 and >= min_reps
    max_seconds = 2.0              # finite, 0 to 3600
    settle = 0.005                 # finite, 0 <= settle < 1
    race_reps = 5                  # a candidate this many times slower than the
    race_ratio = 1.25              # problem's best after race_reps stops (0: never)

    [cpu]                          # optional: without a GPU, over the settings above
    max_params_per_route = 1       # (the Triton kernels run in the interpreter there)
    [cpu.budget]
    min_reps = 2

    [tolerance]                    # optional: rel_l2 bounds replacing accuracy.py's
    bf16 = 1e-2                    # keys: fp16, bf16, fp8

    [[grid]]                       # each grid is the product of its axes
    phase = ["decode"]
    num_heads = [16, 128]
    qlen = [1, 2]
    ...
    [grid.cpu]                     # axes that replace this grid's without a GPU
    batch = [1, 2]                 # (tiny sizes: the interpreter is slow)

Every axis of ``MLAProblem`` may appear in a grid (a scalar means one value);
omitted axes take the problem's defaults. Combinations that are not valid
problems (a 16-bit q over another 16-bit cache, qlen > kv_len, ...) are skipped
and counted. Unknown keys and bad values are errors naming the key and the file.

Size limit: the grids' combinations are counted before any is built, and a spec
with more than ``max_problems`` of them (default ``MAX_PROBLEMS``, 200,000; the
environment variable ``MLATUNE_MAX_PROBLEMS`` overrides the spec and the default)
is refused, naming the grid and its size: a typo such as a list of a thousand KV
lengths would otherwise fill memory before the first candidate runs. The largest
bundled spec has about 2,500. The file itself must be a regular file of at most
``MAX_SPEC_BYTES`` (4 MiB): a device or a pipe is refused before it is read.
"""

from __future__ import annotations

import hashlib
import itertools
import math
import os
import re
import stat
import sys
from dataclasses import dataclass, field, fields
from importlib import resources
from pathlib import Path

from mlatune.errors import SpecError
from mlatune.measure.timers import Budget
from mlatune.problem import SIZE_LIMIT, MLAProblem, problem_field_names

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

DEFAULT_SPEC = "smoke.toml"
_TOP_KEYS = {"name", "description", "seed", "routes", "max_params_per_route", "max_params",
             "max_problems", "budget", "grid", "tolerance", "dcp_top_k", "cpu"}
_CPU_KEYS = {"max_params_per_route", "budget"}
_AXES = set(problem_field_names())
DEFAULT_DCP_TOP_K = 3  # routes per DCP problem measured across GPUs: the one-GPU pass's fastest
MAX_PROBLEMS = 200_000  # combinations a spec may have unless it or the environment says more
MAX_PROBLEMS_ENV = "MLATUNE_MAX_PROBLEMS"
MAX_SPEC_BYTES = 4 << 20  # the bundled specs are under 2 KB; beyond this a path is a mistake
# Bounds of the budget: beyond them a value is a typo, and a NaN or inf time limit or a
# count of 10**18 warm-ups would never end a candidate.
_MAX_COUNT = 1_000_000
_MAX_SECONDS = 3600.0

__all__ = ["MAX_PROBLEMS", "MAX_PROBLEMS_ENV", "SpecError", "SweepSpec", "bundled_spec_path",
           "load", "parse"]


@dataclass(frozen=True)
class SweepSpec:
    name: str
    path: str
    sha256: str
    seed: int
    routes: tuple[str, ...]  # empty: every viable route
    max_params_per_route: int  # 0: all
    budget: Budget
    tolerances: dict[str, float]  # rel_l2 overrides by dtype class
    problems: tuple[MLAProblem, ...]
    skipped: tuple[str, ...]  # why each skipped combination is not a valid problem
    max_params: dict[str, int] = field(default_factory=dict)  # per route id, over the above
    dcp_top_k: int = DEFAULT_DCP_TOP_K  # routes per DCP problem measured across GPUs

    def params_kept(self, route_id: str) -> int:
        """How many of the route's parameter sets a sweep keeps (0: all)."""
        return self.max_params.get(route_id, self.max_params_per_route)


def bundled_spec_path(name: str = DEFAULT_SPEC) -> Path:
    """A spec shipped with mlatune (the repository's sweeps/ folder)."""
    return Path(str(resources.files("mlatune").joinpath("sweeps", name)))


def load(path: str | Path, gpu: bool = True) -> SweepSpec:
    path = Path(path)
    raw = _read_spec_bytes(path)
    try:
        data = tomllib.loads(raw.decode("utf-8"))
    except (ValueError, RecursionError) as exc:  # bad TOML or UTF-8; a 5,000-digit number
        raise SpecError(f"{path}: not valid TOML: {str(exc).splitlines()[0][:200]}") from None
    return parse(data, str(path), hashlib.sha256(raw).hexdigest(), gpu)


def _read_spec_bytes(path: Path) -> bytes:
    """The file's bytes, refused unless it is a regular file of at most ``MAX_SPEC_BYTES``:
    a device (/dev/zero) or a pipe would be read until memory runs out, or forever."""
    try:
        info = path.stat()
        if not stat.S_ISREG(info.st_mode):
            raise SpecError(f"{path}: not a regular file ({_file_kind(info.st_mode)}); a spec "
                            f"is a TOML file")
        with path.open("rb") as f:
            raw = f.read(MAX_SPEC_BYTES + 1)  # bounded: a file may grow, or /proc lie
    except OSError as exc:
        raise SpecError(f"{path}: cannot read spec ({exc.strerror or exc})") from None
    if len(raw) > MAX_SPEC_BYTES:
        raise SpecError(f"{path}: larger than a spec's limit of {MAX_SPEC_BYTES:,} bytes "
                        f"(a spec is a few KB of TOML: grids are products of their axes)")
    return raw


def _file_kind(mode: int) -> str:
    kinds = ((stat.S_ISDIR, "a directory"), (stat.S_ISCHR, "a character device"),
             (stat.S_ISBLK, "a block device"), (stat.S_ISFIFO, "a pipe"),
             (stat.S_ISSOCK, "a socket"))
    return next((name for test, name in kinds if test(mode)), "not a plain file")


def parse(data: dict, where: str, sha256: str = "", gpu: bool = True) -> SweepSpec:
    def fail(key: str, message: str) -> SpecError:
        return SpecError(f"{where}: key '{key}': {message}")

    unknown = set(data) - _TOP_KEYS
    if unknown:
        raise fail(sorted(unknown)[0], f"unknown key (allowed: {', '.join(sorted(_TOP_KEYS))})")
    on_cpu = _without_gpu(data, fail)  # its [cpu] table checked on any machine
    data = data if gpu else on_cpu
    name = _name(data, where, fail)
    seed = data.get("seed", 0)
    if not isinstance(seed, int) or isinstance(seed, bool):
        raise fail("seed", f"must be an integer, got {seed!r}")
    routes = data.get("routes", [])
    if not isinstance(routes, list) or not all(isinstance(r, str) for r in routes):
        raise fail("routes", "must be a list of route ids")
    max_params = data.get("max_params_per_route", 0)
    if not isinstance(max_params, int) or isinstance(max_params, bool) or max_params < 0:
        raise fail("max_params_per_route", f"must be an integer >= 0, got {max_params!r}")
    per_route = data.get("max_params", {})
    if not isinstance(per_route, dict):
        raise fail("max_params", "must be a table of route id = integer >= 0")
    for route_id, kept in per_route.items():
        if not isinstance(kept, int) or isinstance(kept, bool) or kept < 0:
            raise fail(f"max_params.{route_id}", f"must be an integer >= 0, got {kept!r}")
    dcp_top_k = data.get("dcp_top_k", DEFAULT_DCP_TOP_K)
    if not isinstance(dcp_top_k, int) or isinstance(dcp_top_k, bool) or dcp_top_k < 0:
        raise fail("dcp_top_k", f"must be an integer >= 0, got {_shown(dcp_top_k)}")
    budget = _budget(data.get("budget", {}), fail)
    tolerances = data.get("tolerance", {})
    if not isinstance(tolerances, dict):
        raise fail("tolerance", "must be a table")
    for key, value in tolerances.items():
        if key not in ("fp16", "bf16", "fp8"):
            raise fail(f"tolerance.{key}", "unknown (allowed: fp16, bf16, fp8)")
        if not isinstance(value, (int, float)) or isinstance(value, bool) or not 0 < value < 1:
            raise fail(f"tolerance.{key}", f"must be a number in (0, 1), got {value!r}")
    grids = data.get("grid")
    if not isinstance(grids, list) or not grids:
        raise fail("grid", "needs at least one [[grid]] table of axes")
    all_axes = [_grid_axes(grid, i, gpu, fail) for i, grid in enumerate(grids)]
    _check_size(all_axes, _max_problems(data, fail), fail)
    problems: dict[str, MLAProblem] = {}
    skipped: list[str] = []
    for axes in all_axes:
        names = list(axes)
        values = [v if isinstance(v, list) else [v] for v in axes.values()]
        for combo in itertools.product(*values):
            try:
                problem = MLAProblem(**dict(zip(names, combo, strict=True)))
            except (ValueError, TypeError) as exc:
                skipped.append(str(exc))
                continue
            problems.setdefault(problem.key, problem)
    if not problems:
        raise fail("grid", "no valid problem in any grid" + (f" ({skipped[0]})" if skipped else ""))
    return SweepSpec(str(name), where, sha256, seed, tuple(routes), max_params, budget,
                     dict(tolerances), tuple(problems.values()), tuple(skipped),
                     dict(per_route), dcp_top_k)


def _without_gpu(data: dict, fail) -> dict:
    """The spec's settings with its ``[cpu]`` table over them (the budget key by key)."""
    cpu = data.get("cpu", {})
    if not isinstance(cpu, dict):
        raise fail("cpu", "must be a table")
    unknown = set(cpu) - _CPU_KEYS
    if unknown:
        raise fail(f"cpu.{sorted(unknown)[0]}",
                   f"unknown key (allowed: {', '.join(sorted(_CPU_KEYS))})")
    budget = cpu.get("budget", {})
    if not isinstance(budget, dict):
        raise fail("cpu.budget", "must be a table")
    merged = {**data, **{k: v for k, v in cpu.items() if k != "budget"}}
    if budget:  # checked on any machine, its keys named as the spec spells them
        _budget(data.get("budget", {}), fail)
        merged["budget"] = {**data.get("budget", {}), **budget}
        _budget(merged["budget"], lambda key, message: fail(f"cpu.{key}", message))
    return merged


def _grid_axes(grid, i: int, gpu: bool, fail) -> dict:
    """Grid ``i``'s axes, checked, with its ``cpu`` table applied when there is no GPU."""
    if not isinstance(grid, dict):
        raise fail(f"grid[{i}]", "must be a table of axes")
    grid = dict(grid)
    cpu = grid.pop("cpu", {})
    _check_axes(grid, f"grid[{i}]", fail)
    _check_axes(cpu, f"grid[{i}].cpu", fail)
    return {**grid, **(cpu if not gpu else {})}


def _max_problems(data: dict, fail) -> int:
    """The size limit: MLATUNE_MAX_PROBLEMS (the operator's word) over the spec's key
    over the default."""
    env = os.environ.get(MAX_PROBLEMS_ENV, "").strip()
    if env:
        if not re.fullmatch(r"[0-9]{1,18}", env) or int(env) < 1:
            raise fail(MAX_PROBLEMS_ENV, f"environment variable must be a whole number >= 1, "
                                         f"got {_shown(env)}")
        return int(env)
    limit = data.get("max_problems", MAX_PROBLEMS)
    if not isinstance(limit, int) or isinstance(limit, bool) or limit < 1:
        raise fail("max_problems", f"must be a whole number >= 1, got {_shown(limit)}")
    return limit


def _shown(value) -> str:
    """A value for a one-line message: its repr, cut short (a spec may hold anything)."""
    text = repr(value) if not isinstance(value, int) or abs(value) < 10 ** 30 else \
        f"a {len(str(abs(value)))}-digit number"
    return text if len(text) <= 60 else text[:57] + "..."


def _name(data: dict, where: str, fail) -> str:
    """The spec's name: a plain file name (the sweep's default output is
    runs/NAME-ARCH.parquet); the file's stem, which holds no path, without one."""
    name = data.get("name", Path(where).stem)
    if "name" in data and (not isinstance(name, str)
                           or not re.fullmatch(r"[A-Za-z0-9_][A-Za-z0-9_.+-]*", name)):
        raise fail("name", f"must be a plain file name (letters, digits and _ . + -), "
                           f"got {name!r}")
    return name


def _check_size(all_axes: list[dict], limit: int, fail) -> None:
    """Refuse grids whose product exceeds ``limit``, counted without building it."""
    sizes = []
    for i, axes in enumerate(all_axes):
        lengths = {k: len(v) if isinstance(v, list) else 1 for k, v in axes.items()}
        size = math.prod(lengths.values())
        sizes.append(size)
        if size > limit:
            shape = " x ".join(f"{k} {n}" for k, n in lengths.items() if n > 1)
            raise fail(f"grid[{i}]", f"{size:,} combinations ({shape}), more than the limit of "
                                     f"{limit:,} problems (raise it with max_problems or "
                                     f"{MAX_PROBLEMS_ENV})")
    if sum(sizes) > limit:
        raise fail("grid", f"{sum(sizes):,} combinations in {len(sizes)} grids together "
                           f"({' + '.join(f'{n:,}' for n in sizes)}), more than the limit of "
                           f"{limit:,} problems (raise it with max_problems or "
                           f"{MAX_PROBLEMS_ENV})")


def _check_axes(axes, table: str, fail) -> None:
    if not isinstance(axes, dict):
        raise fail(table, "must be a table of axes")
    for key, value in axes.items():
        if key not in _AXES:
            raise fail(f"{table}.{key}", f"unknown axis (axes: {', '.join(sorted(_AXES))})")
        items = value if isinstance(value, list) else [value]
        if not items:
            raise fail(f"{table}.{key}", "empty list")
        for item in items:
            if not isinstance(item, (int, str, bool)):
                raise fail(f"{table}.{key}", f"values must be integers, strings or booleans, "
                                             f"got {item!r}")
            if isinstance(item, int) and not -SIZE_LIMIT <= item <= SIZE_LIMIT:
                raise fail(f"{table}.{key}", f"{item} is out of range: sizes are at most "
                                             f"{SIZE_LIMIT} (2**31 - 1)")


def _budget(table, fail) -> Budget:
    if not isinstance(table, dict):
        raise fail("budget", "must be a table")
    defaults = {f.name: f.default for f in fields(Budget)}
    values = {}
    for key, value in table.items():
        if key not in defaults:
            raise fail(f"budget.{key}", f"unknown (allowed: {', '.join(defaults)})")
        values[key] = _budget_value(key, value, isinstance(defaults[key], int), fail)
    budget = Budget(**values)
    if budget.min_reps > budget.max_reps or budget.max_reps < 1:
        raise fail("budget.max_reps", "must be >= 1 and >= min_reps")
    if budget.race_reps < 1:
        raise fail("budget.race_reps", f"must be >= 1, got {budget.race_reps!r}")
    if 0 < budget.race_ratio < 1:
        raise fail("budget.race_ratio", f"must be 0 (no racing) or >= 1, got {budget.race_ratio!r}")
    return budget


def _budget_value(key: str, value, whole: bool, fail) -> int | float:
    """One budget value, refused unless a number in its range: counts are whole, times
    and ratios finite (NaN compares false with every bound, and inf never ends)."""
    where = f"budget.{key}"
    if whole:
        if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= _MAX_COUNT:
            raise fail(where, f"must be a whole number from 0 to {_MAX_COUNT:,}, "
                              f"got {_shown(value)}")
        return value
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not _finite(value):
        raise fail(where, f"must be a finite number, got {_shown(value)}")
    if key == "max_seconds" and not 0 <= value <= _MAX_SECONDS:
        raise fail(where, f"must be from 0 to {_MAX_SECONDS:g} seconds, got {value!r}")
    if key == "settle" and not 0 <= value < 1:
        raise fail(where, f"must be a fraction, 0 <= settle < 1, got {value!r}")
    if value < 0:
        raise fail(where, f"must be >= 0, got {value!r}")
    return value


def _finite(value: int | float) -> bool:
    try:
        return math.isfinite(value)
    except OverflowError:  # an int too large for a float
        return False
