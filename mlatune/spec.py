"""Sweep specs: a TOML file naming the problems to measure and how.

    name = "smoke"
    seed = 0                       # inputs of each problem derive from it
    routes = []                    # route ids to consider; empty = every viable one
    max_params_per_route = 0       # keep each route's first N parameter sets (0 = all)

    [budget]                       # per candidate (see bench.Budget)
    warmup = 1
    min_reps = 10
    max_reps = 200
    max_seconds = 2.0
    race_reps = 5                  # a candidate this many times slower than the
    race_ratio = 1.25              # problem's best after race_reps stops (0: never)

    [tolerance]                    # optional: rel_l2 bounds replacing accuracy.py's
    bf16 = 1e-2                    # keys: fp16, bf16, fp8

    [[grid]]                       # each grid is the product of its axes
    phase = ["decode"]
    num_heads = [16, 128]
    qlen = [1, 2]
    ...
    [grid.cpu]                     # axes that replace this grid's without a GPU
    batch = [1, 2]                 # (only the eager reference runs there)

Every axis of ``MLAProblem`` may appear in a grid (a scalar means one value);
omitted axes take the problem's defaults. Combinations that are not valid
problems (a 16-bit q over another 16-bit cache, qlen > kv_len, ...) are skipped
and counted. Unknown keys and bad values are errors naming the key and the file.
"""

from __future__ import annotations

import hashlib
import itertools
import sys
from dataclasses import dataclass, fields
from importlib import resources
from pathlib import Path

from mlatune.bench import Budget
from mlatune.problem import MLAProblem, problem_field_names

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

DEFAULT_SPEC = "smoke.toml"
_TOP_KEYS = {"name", "description", "seed", "routes", "max_params_per_route", "budget", "grid",
             "tolerance"}
_AXES = set(problem_field_names())


class SpecError(ValueError):
    """A spec that cannot be used; the message names the file and the key."""


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


def bundled_spec_path(name: str = DEFAULT_SPEC) -> Path:
    """A spec shipped with mlatune (the repository's sweeps/ folder)."""
    return Path(str(resources.files("mlatune").joinpath("sweeps", name)))


def load(path: str | Path, gpu: bool = True) -> SweepSpec:
    path = Path(path)
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise SpecError(f"{path}: cannot read spec ({exc.strerror or exc})") from None
    try:
        data = tomllib.loads(raw.decode("utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise SpecError(f"{path}: not valid TOML: {exc}") from None
    return parse(data, str(path), hashlib.sha256(raw).hexdigest(), gpu)


def parse(data: dict, where: str, sha256: str = "", gpu: bool = True) -> SweepSpec:
    def fail(key: str, message: str) -> SpecError:
        return SpecError(f"{where}: key '{key}': {message}")

    unknown = set(data) - _TOP_KEYS
    if unknown:
        raise fail(sorted(unknown)[0], f"unknown key (allowed: {', '.join(sorted(_TOP_KEYS))})")
    name = data.get("name", Path(where).stem)
    seed = data.get("seed", 0)
    if not isinstance(seed, int) or isinstance(seed, bool):
        raise fail("seed", f"must be an integer, got {seed!r}")
    routes = data.get("routes", [])
    if not isinstance(routes, list) or not all(isinstance(r, str) for r in routes):
        raise fail("routes", "must be a list of route ids")
    max_params = data.get("max_params_per_route", 0)
    if not isinstance(max_params, int) or isinstance(max_params, bool) or max_params < 0:
        raise fail("max_params_per_route", f"must be an integer >= 0, got {max_params!r}")
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
    problems: dict[str, MLAProblem] = {}
    skipped: list[str] = []
    for i, grid in enumerate(grids):
        if not isinstance(grid, dict):
            raise fail(f"grid[{i}]", "must be a table of axes")
        grid = dict(grid)
        cpu = grid.pop("cpu", {})
        _check_axes(grid, f"grid[{i}]", fail)
        _check_axes(cpu, f"grid[{i}].cpu", fail)
        axes = {**grid, **(cpu if not gpu else {})}
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
                     dict(tolerances), tuple(problems.values()), tuple(skipped))


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
                raise fail(f"{table}.{key}", f"values must be numbers, strings or booleans, "
                                             f"got {item!r}")


def _budget(table, fail) -> Budget:
    if not isinstance(table, dict):
        raise fail("budget", "must be a table")
    defaults = {f.name: f.default for f in fields(Budget)}
    values = {}
    for key, value in table.items():
        if key not in defaults:
            raise fail(f"budget.{key}", f"unknown (allowed: {', '.join(defaults)})")
        kinds = (int,) if isinstance(defaults[key], int) else (int, float)  # counts are whole
        if not isinstance(value, kinds) or isinstance(value, bool) or value < 0:
            what = "a whole number" if kinds == (int,) else "a number"
            raise fail(f"budget.{key}", f"must be {what} >= 0, got {value!r}")
        values[key] = value
    budget = Budget(**values)
    if budget.min_reps > budget.max_reps or budget.max_reps < 1:
        raise fail("budget.max_reps", "must be >= 1 and >= min_reps")
    if budget.race_reps < 1:
        raise fail("budget.race_reps", f"must be >= 1, got {budget.race_reps!r}")
    if 0 < budget.race_ratio < 1:
        raise fail("budget.race_ratio", f"must be 0 (no racing) or >= 1, got {budget.race_ratio!r}")
    return budget
