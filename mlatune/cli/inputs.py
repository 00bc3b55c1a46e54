"""What commands read: fixed value sets, shared options, specs by name, and the default
table (the one the dispatcher loads for this GPU, or for --arch)."""

from __future__ import annotations

import os
from collections.abc import Sequence
from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from mlatune.cli.app import fail, usage_error

if TYPE_CHECKING:
    from mlatune.arch import DeviceInfo
    from mlatune.dispatch import Dispatcher
    from mlatune.sweep.spec import SweepSpec


# Fixed value sets: --help lists them and typer refuses others (exit 2). Spelled out here
# because --help must stay fast and their owners import torch (1.4 s);
# tests/test_cli_usability.py pins each to its owner (capability.ARCHS and arch.CPU_ARCH,
# problem.DTYPES, problem.Phase, table.FORMATS).
def _choices(name: str, values: tuple[str, ...]) -> Any:
    return Enum(name, [(v, v) for v in values], type=str)


ARCH_NAMES = ("gfx942", "gfx950", "gfx1250", "sm_90", "sm_100")
Arch = _choices("Arch", ARCH_NAMES)
DeviceArch = _choices("DeviceArch", (*ARCH_NAMES, "cpu"))  # a sweep's, so a table's too
Dtype = _choices("Dtype", ("bf16", "fp16", "fp8_e4m3fn", "fp8_e4m3fnuz"))
Phase = _choices("Phase", ("decode", "prefill"))
SOURCES = ("table", "predicted", "nearest", "law", "rule")  # how the dispatcher answers, best first
Source = _choices("Source", SOURCES)
Format = _choices("Format", ("parquet", "csv", "json"))
Accuracy = _choices("Accuracy", ("strict", "fp8-mma", "fast"))  # check.policy.POLICIES


def value(choice: Enum | None) -> str | None:
    return None if choice is None else choice.value


LimitOption = Annotated[int, typer.Option(
    min=0, metavar="ROWS", help="Rows to print (0: all); --json holds every one.")]
ArchOption = Annotated[DeviceArch | None, typer.Option(
    help="Answer for this arch (the table's) instead of this machine's.")]
AccuracyOption = Annotated[Accuracy | None, typer.Option(
    help="Accuracy policy: what rounding beyond the problem's dtypes may be served (strict: "
         "none; fp8-mma: P in fp8; fast: also a q quantized to fp8). Default: "
         "MLATUNE_ACCURACY, else strict.")]
TABLE_DEFAULT_HELP = ("Default: the table the dispatcher loads for this GPU, or for --arch "
                      "(MLATUNE_TABLE, else the one mlatune ships for the arch).")


def table_argument(what: str, optional: bool = False) -> Any:
    """The TABLE argument of a command that reads one table: its first positional."""
    return typer.Argument(metavar="TABLE", exists=True, help=what + (
        " " + TABLE_DEFAULT_HELP if optional else ""))


# Specs: a file, or a bundled spec by name ---------------------------------------------

def bundled_specs() -> list[str]:
    from mlatune.sweep import spec as specs

    folder = specs.bundled_spec_path().parent
    return sorted(p.stem for p in folder.glob("*.toml"))


def spec_path(name: str | None) -> Path:
    """SPEC as given: a file; a bare name (no folder, no suffix but .toml) not found as a
    file (a folder of that name aside) is a bundled spec, `sweeps/<name>.toml` in the
    package. Neither: exit 2."""
    from mlatune.sweep import spec as specs

    if name is None:
        return specs.bundled_spec_path()
    path = Path(name)
    bundled = bundled_specs()
    bare = path.parent == Path(".") and path.suffix in ("", ".toml") and path.stem in bundled
    if path.is_file() or (path.exists() and not bare):  # a folder is never a spec
        return path
    if bare:
        return specs.bundled_spec_path(f"{path.stem}.toml")
    usage_error(f"{name}: no such spec file, nor a bundled spec of that name "
                f"(bundled: {', '.join(bundled)})", "SPEC")


def load_spec(path: Path, gpu: bool) -> SweepSpec:
    """The spec at ``path`` (``spec_path``'s answer); a bad one is one line, exit 1."""
    from mlatune.sweep import spec as specs

    try:
        return specs.load(path, gpu=gpu)
    except specs.SpecError as exc:
        fail(str(exc))


def check_route_ids(route_ids: Sequence[str] | None, named_in: Path | None = None) -> None:
    """Every route named exists, before anything is written: on the command line a
    usage error (exit 2); in the spec, the spec's (exit 1)."""
    from mlatune.routes import get

    for route_id in route_ids or ():
        try:
            get(route_id)
        except KeyError as exc:
            if named_in is None:
                usage_error(str(exc.args[0]), "--routes")
            fail(f"{exc.args[0]} (named in {named_in})")


# The default table --------------------------------------------------------------------

def default_table(arch: str | None) -> Path | None:
    """The table the dispatcher loads for ``arch`` (this machine's device when None):
    MLATUNE_TABLE, else the table mlatune ships for the arch (``find_table`` over the
    bundled tables, as ``Dispatcher.from_bundled`` chooses it); None where none ships."""
    from mlatune.arch import current_device
    from mlatune.dispatch import bundled
    from mlatune.dispatch.dispatcher import TABLE_ENV, device_for_arch

    override = os.environ.get(TABLE_ENV)
    if override:
        return Path(override)
    here = current_device()
    device = here if arch is None or arch == here.arch else device_for_arch(arch)
    found = bundled.find_table(bundled.bundled_tables_dir(), device.arch, device.name)
    return None if found is None else Path(str(found))


def interpret_triton_on(device: DeviceInfo) -> None:
    """On a machine without a GPU the Triton routes run in the interpreter, switched on
    before any kernel module is imported (sweep workers inherit it): what a sweep measured
    here is what the other commands serve here."""
    if not device.is_gpu:
        os.environ.setdefault("TRITON_INTERPRET", "1")


def load_dispatcher(table_path: Path | None, arch: str | None, accuracy: str | None = None
                    ) -> Dispatcher:
    """The dispatcher a command answers with: TABLE, else ``default_table`` (with the
    user's MLATUNE_USER_TABLE overlaid, as an engine loads it: where no table ships for
    the arch, the user table alone, else the rules; a damaged user table left out with a
    warning). ``arch``: plan for it (its GPU need not be here); ``accuracy``:
    the policy (None: MLATUNE_ACCURACY's, else strict)."""
    from mlatune.arch import current_device
    from mlatune.dispatch import Dispatcher, device_for_arch
    from mlatune.dispatch.dispatcher import USER_TABLE_ENV
    from mlatune.dispatch.loading import with_user_table

    interpret_triton_on(current_device())
    if table_path is not None:
        return Dispatcher.load(table_path, allow_arch=arch, accuracy=accuracy)
    user = os.environ.get(USER_TABLE_ENV) or None
    return with_user_table(
        Dispatcher, default_table(arch), user if user and Path(user).is_file() else None,
        lambda: Dispatcher.rules_only(device_for_arch(arch) if arch else None,
                                      accuracy=accuracy),
        allow_arch=arch, accuracy=accuracy)
