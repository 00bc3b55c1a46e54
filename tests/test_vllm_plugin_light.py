"""The vLLM plugin as the default suite sees it, without vLLM: declared, never imported by
mlatune, and saying what to install. tests/engines/test_vllm_contract.py runs it against
vLLM itself."""

import ast
import json
import subprocess
import sys
from importlib.metadata import entry_points
from pathlib import Path

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[1]
ENTRY = "mlatune.integrations.vllm:register"


def _run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          cwd=ROOT)


def test_mlatune_and_its_engine_adapter_never_import_vllm():
    done = _run("import json, sys\nimport mlatune, mlatune.attention, mlatune.integrations, "
                "mlatune.integrations.core\nprint(json.dumps(sorted(sys.modules)))")
    assert done.returncode == 0, done.stderr
    loaded = json.loads(done.stdout.splitlines()[-1])
    assert "mlatune.integrations.core" in loaded
    assert not [m for m in loaded if m == "vllm" or m.startswith("vllm.")]


def test_without_vllm_the_plugin_says_in_one_line_what_to_install():
    done = _run("import sys; sys.modules['vllm'] = None\nimport mlatune.integrations.vllm")
    assert done.returncode == 1
    last = done.stderr.strip().splitlines()[-1]
    assert last == ("ImportError: mlatune.integrations.vllm needs vLLM: "
                    "pip install 'mlatune[vllm]'")


def test_the_entry_point_and_extra_are_declared_and_their_target_exists():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["entry-points"]["vllm.general_plugins"] == {"mlatune": ENTRY}
    assert any(need.startswith("vllm") for need in project["optional-dependencies"]["vllm"])
    installed = {ep.name: ep.value for ep in entry_points(group="vllm.general_plugins")}
    assert installed.get("mlatune") == ENTRY  # the editable install's metadata says it too
    package = ROOT / "mlatune" / "integrations" / "vllm"
    plugin = ast.parse((package / "__init__.py").read_text())
    assert "register" in {node.name for node in plugin.body if isinstance(node, ast.FunctionDef)}
    path = next(node.value.value for node in plugin.body if isinstance(node, ast.Assign)
                and node.targets[0].id == "BACKEND")
    module, name = path.rsplit(".", 1)
    backend = ast.parse((ROOT / (module.replace(".", "/") + ".py")).read_text())
    assert name in {node.name for node in backend.body if isinstance(node, ast.ClassDef)}
