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


def test_functions_outside_the_kernels_read_at_once():
    """No function outside mlatune/kernels/ runs past 60 lines, its docstring included."""
    import ast

    long = []
    for path in sorted((ROOT / "mlatune").rglob("*.py")):
        if "kernels" in path.parts:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) \
                    and node.end_lineno - node.lineno + 1 > 60:
                long.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name}")
    assert long == []


def test_modules_outside_the_kernels_stay_under_600_lines():
    long = [f"{p.relative_to(ROOT)}: {n}" for p in sorted((ROOT / "mlatune").rglob("*.py"))
            if "kernels" not in p.parts and (n := len(p.read_text().splitlines())) > 600]
    assert long == []
