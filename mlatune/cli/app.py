"""The Typer app every command registers on: its help format, consoles, errors and JSON.

Output: rich tables on a terminal; piped or in CI, the same lines unwrapped and uncut, so
a log or a grep sees whole paths, route ids and numbers.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import sys
from contextlib import contextmanager
from contextvars import ContextVar
from pathlib import Path
from typing import Annotated, Any, NoReturn

import typer
from rich.console import Console

import mlatune

JSON_VERSION = 1  # raised only when a field changes meaning or goes away
UNWRAPPED_WIDTH = 100_000  # piped or in CI: wider than any line we print
USAGE_EXIT, FAILURE_EXIT = 2, 1


# Help a person reads ------------------------------------------------------------------

class _Argument(typer.core.TyperArgument):
    """An argument shown as its metavar alone (TABLE, [SPEC], TABLE...), as a person
    writes it: no Python type beside it, no braces in the usage line."""

    def display_type_rich(self, ctx: Any) -> str | None:
        return None

    def get_usage_pieces(self, ctx: Any) -> list[str]:
        name = self.metavar or self.name.upper()
        return [name if self.required else f"[{name}]"]


def _value_word(param: Any) -> str | None:
    """What an option's value is, in a word (PATH, INTEGER, NUMBER, TEXT); None where
    typer already says it well (a fixed set lists its values; older typer: click's words)."""
    described = getattr(param, "type_descriptor", None)
    if described is None or described.is_choice or described.annotation is bool:
        return None
    if described.is_path:
        return "PATH"
    return {int: "INTEGER", float: "NUMBER"}.get(described.annotation, "TEXT")


class _Command(typer.core.TyperCommand):
    """A command whose --help names values as a person reads them."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        for param in self.params:
            if isinstance(param, typer.core.TyperArgument):
                # typer builds its parameters itself and takes no class for them
                param.__class__ = _Argument
            elif param.metavar is None and not getattr(param, "is_flag", False):
                param.metavar = _value_word(param)

    def invoke(self, ctx: Any) -> Any:
        """The command, its --json remembered (``fail`` answers in JSON under it), under
        ``_Group``'s net while that is known."""
        token = _json_state.set({"asked": bool(ctx.params.get("json_out")), "written": False,
                                 "command": ctx.info_name or "error"})
        try:
            return super().invoke(ctx)
        except _one_line_errors() as exc:
            fail(str(exc))
        finally:
            _json_state.reset(token)


def _one_line_errors() -> tuple[type[Exception], ...]:
    """The errors of mlatune.errors a command may leave to the CLI's net: one line each."""
    from mlatune.errors import JournalError, OutputError, SettingError, SpecError, TableError

    return SpecError, JournalError, TableError, OutputError, SettingError


# click's UsageError as the installed typer raises it (newer typers carry their own click).
_UsageError: type[Exception] = next(c for c in typer.BadParameter.__mro__
                                    if c.__name__ == "UsageError")


class _Group(typer.core.TyperGroup):
    """The last net under every command: an error of mlatune.errors (a bad spec, a
    damaged journal or table, an output that cannot be written) that a command did not
    turn into its own line still ends as one line on stderr and exit 1, never a
    traceback. Commands catch what they can say more about (and a hint) first. A usage
    error (exit 2) on a command line asking --json also answers in JSON on stdout."""

    def invoke(self, ctx: Any) -> Any:
        asked_json = "--json" in ctx.args  # the command's own arguments, not parsed yet
        try:
            return super().invoke(ctx)
        except _one_line_errors() as exc:
            fail(str(exc))
        except _UsageError as exc:
            if asked_json:
                command = exc.ctx.info_name if exc.ctx is not None else "error"
                emit_json(command, {"ok": False, "error": " ".join(exc.format_message()
                                                                   .split()), "usage": True})
            raise


class _App(typer.Typer):
    """typer.Typer whose commands show readable help (``_Command``) unless told otherwise."""

    def command(self, *args: Any, cls: Any = None, **kwargs: Any) -> Any:
        return super().command(*args, cls=cls or _Command, **kwargs)


app = _App(
    cls=_Group,
    help="Autotune MLA attention routes per shape and ship the winners as a dispatch table. "
         "Exit status: 0 ok; 1 a check failed or an error (one line on stderr); 2 a usage "
         "error.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    # Plain help: a flag shows no type tag (rich mode tags even --help "<bool>"), fixed
    # value sets show as <a|b|c>, and a CI log gets no box drawing.
    rich_markup_mode=None,
)


# Consoles -------------------------------------------------------------------------------

def _make_console(stderr: bool = False) -> Console:
    """Rich as usual on a terminal; otherwise lines as long as their content. Decided by
    the stream itself: FORCE_COLOR makes rich call a CI log a terminal, 80 columns wide."""
    stream = sys.stderr if stderr else sys.stdout
    try:
        tty = stream.isatty()
    except (AttributeError, ValueError):  # a closed or odd stream: not a terminal
        tty = False
    if tty:
        return Console(stderr=stderr)
    return Console(stderr=stderr, width=UNWRAPPED_WIDTH, soft_wrap=True)


_consoles = {"out": _make_console(), "err": _make_console(stderr=True)}


def console() -> Console:
    """Where a command's output goes (stdout)."""
    return _consoles["out"]


def err_console() -> Console:
    """Where notes and errors go (stderr)."""
    return _consoles["err"]


def _use_consoles() -> None:
    """Fit both consoles to where output goes now (tests run many invocations, each with
    its own captured streams)."""
    _consoles.update(out=_make_console(), err=_make_console(stderr=True))


def say(text: str, stderr: bool = False) -> None:
    """One plain line (no highlighting of numbers and paths)."""
    (err_console() if stderr else console()).print(text, highlight=False)


def note(text: str) -> None:
    err_console().print(f"[yellow]note:[/] {text}", soft_wrap=True, highlight=False)


# JSON -----------------------------------------------------------------------------------

# The running command's --json: asked, and whether its one object is written yet.
_json_state: ContextVar[dict[str, Any] | None] = ContextVar("mlatune_json", default=None)

JsonFlag = Annotated[bool, typer.Option(
    "--json", help='Print one JSON object on stdout instead: {"schema": '
                   '"mlatune.<command>", "version": 1, ...} (fields: the command\'s module '
                   'in mlatune/cli/).')]


def emit_json(command: str, body: dict[str, Any]) -> None:
    document = {"schema": f"mlatune.{command}", "version": JSON_VERSION, "ok": True, **body}
    sys.stdout.write(json.dumps(document, indent=2, allow_nan=False) + "\n")
    state = _json_state.get()
    if state is not None:
        state["written"] = True


def _json_failure(message: str) -> None:
    """Under --json, a failure is one JSON object on stdout too ({"ok": false, "error"}),
    unless the command already wrote its own: a script reads JSON either way."""
    state = _json_state.get()
    if state is not None and state["asked"] and not state["written"]:
        emit_json(state["command"], {"ok": False, "error": message})


def num(value: Any) -> float | None:
    """A number for JSON: NaN (not measured) and an infinity (a ratio over a time that
    rounds to 0) become null, which JSON can hold."""
    value = plain(value)
    return None if value is None or (isinstance(value, float) and not math.isfinite(value)) \
        else float(value)


def plain(value: Any) -> Any:
    """numpy and pandas scalars as the Python values JSON knows."""
    return value.item() if hasattr(value, "item") else value


def device_json(arch: str, device_name: str, cu_count: int) -> dict[str, Any]:
    return {"arch": str(arch), "device_name": str(device_name), "cu_count": int(cu_count)}


# Errors ---------------------------------------------------------------------------------

# The dispatcher's refusal of a table for another arch suggests its Python argument too;
# on the command line only the option means anything.
_PYTHON_ARCH_HINT = re.compile(r"pass allow_arch=(['\"])([^'\"]+)\1 \(CLI: --arch [^)]*\)")


def fail(message: str) -> NoReturn:
    """A runtime failure: one red line on stderr, exit 1."""
    from rich.markup import escape

    message = _PYTHON_ARCH_HINT.sub(r"pass --arch \2", " ".join(message.split()))
    message = message.replace("but allow_arch is ", "but --arch is ")  # the CLI's spelling
    err_console().print(f"[bold red]error:[/] {escape(message)}", soft_wrap=True,
                        highlight=False)
    _json_failure(message)
    raise typer.Exit(FAILURE_EXIT)


def counted(n: int, noun: str) -> str:
    """``n`` and the noun, plural unless one: "1 problem", "3 problems"."""
    return f"{n:,} {noun}{'' if n == 1 else 's'}"


def usage_error(message: str, param: str) -> NoReturn:
    """The command line is wrong (a value of the wrong form, flags that exclude each
    other, an input that does not exist): typer's usage message, exit 2."""
    raise typer.BadParameter(message, param_hint=f"'{param}'")


def error_text(what: str, exc: Exception) -> str:
    """An exception as one line: a ValueError (TableError, an invalid problem) says it
    all; an OSError names its file; anything else (a file damaged in a way no check
    foresaw) its type."""
    if isinstance(exc, ValueError):
        return str(exc)
    if isinstance(exc, OSError):
        return f"{what}: {exc.strerror or exc}" + (f" ({exc.filename})" if exc.filename else "")
    return f"{what}: {type(exc).__name__}: {exc}"


@contextmanager
def one_line_errors(what: str):
    """Turn any failure into one line; the CLI boundary is where that belongs."""
    try:
        yield
    except typer.Exit:
        raise
    except Exception as exc:
        fail(error_text(what, exc))


def check_outputs(*paths: Path, make_parents: bool = True) -> None:
    """Refuse, before any work, an output that could not be written at the end: one line
    (OutputError's) and exit 1. ``make_parents``: the writer makes missing folders (a
    sweep, export, upgrade); otherwise the folder must exist (plan --out)."""
    from mlatune.errors import OutputError
    from mlatune.table.outputs import check_writable_output

    for path in paths:
        try:
            if not make_parents and not path.parent.is_dir():
                why = "not a directory" if path.parent.exists() else "no such directory"
                raise OutputError(f"cannot write {path}: {path.parent}: {why}")
            check_writable_output(path)
        except OutputError as exc:
            fail(str(exc))


def refuse_writing_over(out: Path, source: Path, option: str = "--out") -> None:
    """A usage error where ``out`` is ``source`` itself (or a link to it): the command would
    replace what it read, and a cut of it (--winners-only, --accuracy) loses rows."""
    same = out.resolve() == source.resolve()
    with contextlib.suppress(OSError):
        same = same or os.path.samefile(out, source)
    if same:
        usage_error(f"{out} is the table read: name another path to write", option)


def check_output_dir(folder: Path, inside: str) -> None:
    """``check_outputs`` for a folder of outputs (made when missing): ``folder`` is or
    can become a directory this process writes ``inside`` (one of its files) in."""
    if folder.exists() and not folder.is_dir():
        fail(f"{folder}: not a directory; name a directory to write {inside} and the rest in")
    check_outputs(folder / inside)


# The top level ----------------------------------------------------------------------------

def _version(value: bool) -> None:
    if value:
        console().print(f"mlatune {mlatune.__version__}")
        raise typer.Exit()


@app.callback()
def main(
    version: Annotated[bool, typer.Option("--version", callback=_version, is_eager=True,
                                          help="Print the version and exit.")] = False,
) -> None:
    """mlatune: measure every MLA route per shape; ship the winners as a table."""
    _use_consoles()
