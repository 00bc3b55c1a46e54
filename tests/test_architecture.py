"""The layers point one way: the import contracts in .importlinter hold (import-linter)."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_the_import_contracts_hold():
    """Runtime and report never import the tuner; the tuner never imports the dispatcher; the
    table knows no routes; every layer imports only those below it."""
    linter = Path(sys.executable).with_name("lint-imports")
    done = subprocess.run([str(linter), "--no-cache", "--config", ".importlinter"], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert "0 broken" in done.stdout
