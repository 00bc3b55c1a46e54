"""The examples run as documented (tiny sizes on the CPU; the GPU runs them at full size)."""

import importlib.util
import sys
from pathlib import Path

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_the_engine_loop_serves_checked_steps_on_the_cpu():
    engine_loop = _load("engine_loop")
    assert engine_loop.run(engine_loop.CPU) == 2  # steps 0 and 3 checked, both right
