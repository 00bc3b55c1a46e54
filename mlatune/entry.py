"""The ``mlatune`` command's entry point: a clear word when the CLI's extra is missing.

The engine runtime (``mlatune.attention``, ``mlatune.dispatch``) installs without
typer, rich, pandas and pyarrow; the command line needs them (``mlatune[cli]``).
"""

from __future__ import annotations

import sys

CLI_MODULES = ("typer", "rich", "pandas", "pyarrow")


def main() -> None:
    missing = [m for m in CLI_MODULES if not _importable(m)]
    if missing:
        sys.exit(f"mlatune: the command line needs {', '.join(missing)}: "
                 f"pip install 'mlatune[cli]'")
    from mlatune.cli import app  # typer, rich: once a command runs

    app(prog_name="mlatune")


def _importable(module: str) -> bool:
    import importlib.util

    try:
        return importlib.util.find_spec(module) is not None
    except ValueError:  # in sys.modules as None: blocked
        return False
