"""The `mlatune` command line: one module per group of commands, all on ``app.app``.

Commands import what they run inside their bodies, so that `mlatune --help` and a usage
error start without torch, pandas or the tuner (tests/test_light_import.py holds this).

One convention across commands (tests/test_cli_conventions.py holds every command to it):

- A command that reads one table takes it as its first positional argument, TABLE.
  ``lookup`` and ``coverage`` may leave it out: then they answer from the table the
  dispatcher loads for this GPU, or for --arch (``inputs.default_table``).
- A command that writes a file names it with ``--out``.
- ``--json`` prints one JSON object on stdout and nothing else there (notes and errors go
  to stderr; the exit status is the same as without it): ``{"schema": "mlatune.<command>",
  "version": 1, "ok": true, ...}`` (``coverage``'s ``ok``: whether every problem met
  ``--require``); a runtime failure (exit 1) is ``{"schema", "version", "ok": false,
  "error": "<the line on stderr>"}`` there, a usage error (exit 2) the same with
  ``"usage": true``; the version
  raised only when a field changes meaning or goes away.
  A device is ``{"arch", "device_name", "cu_count"}``, a problem its key fields
  (``MLAProblem.key_dict``), a time in microseconds or null where not measured. Each
  command's fields are in its module's docstring.
- Exit status: 0 ok; 1 a check failed (coverage --require unmet, diff of tables that share
  no device) or a runtime failure (one red line on stderr: a damaged table or journal, an
  invalid spec, an output that cannot be written, a machine that cannot run what was
  asked); 2 a usage error (an unknown option or value, a value of the wrong form, flags
  that exclude each other, an input file that does not exist).

Every file a command writes (sweep: the table, its .csv and the journal; export, upgrade,
merge, plan --out; report --out's folder) is checked before any work: a directory in the
way, a parent that is not a writable directory or a read-only file system is refused at
once (exit 1), not after an hour of sweeping.

Start-up stays light: these modules import typer and rich; each command imports what it
needs (torch, pandas, the sweep) when it runs, so --help answers at once.
"""

import importlib

from mlatune.cli.app import app

# Each module registers its commands on app as it is imported: --help lists them in this
# order, the way a user meets them.
COMMAND_MODULES = ("sweep", "plan", "tables", "merge", "convert", "report", "doctor")
for _module in COMMAND_MODULES:
    importlib.import_module(f"mlatune.cli.{_module}")

__all__ = ["app"]
