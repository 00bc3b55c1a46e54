"""An engine that only dispatches imports neither the CLI's libraries nor Triton."""

import json
import subprocess
import sys

from mlatune import routes, table
from mlatune.problem import MLAProblem
from tests.table_helpers import make_table, result_row

HEAVY = ("triton", "pandas", "pyarrow", "typer", "rich", "matplotlib")


def _modules_after(code: str) -> set[str]:
    script = f"{code}\nimport json, sys\nprint(json.dumps(sorted(sys.modules)))"
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          check=True)
    return set(json.loads(done.stdout.splitlines()[-1]))


def test_the_engine_entry_points_import_light():
    loaded = _modules_after("import mlatune.attention, mlatune.dispatch")
    assert not [m for m in HEAVY if m in loaded]


def test_a_json_winners_map_loads_without_pandas(tmp_path):
    problem = MLAProblem()
    frame = make_table([result_row(problem, "padded/triton", 5.0),
                        result_row(problem, "reference/torch", 50.0)])
    path = table.write_json(table.winners_json(frame), tmp_path / "sm_90.json")
    loaded = _modules_after(
        "from mlatune.dispatch import Dispatcher, device_for_arch\n"
        f"d = Dispatcher.load({str(path)!r}, device=device_for_arch('sm_90', 'NVIDIA H200', 132))\n"
        "from mlatune.problem import MLAProblem\n"
        "assert d.select(MLAProblem()).route_id == 'padded/triton'")
    assert not [m for m in HEAVY if m in loaded]


def test_the_command_without_its_extra_says_what_to_install():
    done = subprocess.run(
        [sys.executable, "-c",
         "import sys; sys.modules['typer'] = None; sys.modules['pandas'] = None\n"
         "from mlatune.entry import main; main()"], capture_output=True, text=True)
    assert done.returncode == 1
    assert done.stderr.strip() == ("mlatune: the command line needs typer, pandas: "
                                   "pip install 'mlatune[cli]'")


def test_the_command_line_starts_light():
    """`mlatune --help` imports the CLI's modules and typer/rich only: each command imports
    torch, pandas and the rest when it runs."""
    loaded = _modules_after("from mlatune.entry import main\nimport mlatune.cli")
    assert not [m for m in ("torch", "triton", "numpy", "pandas", "pyarrow", "matplotlib")
                if m in loaded]
    assert not [m for m in loaded if m.startswith(("mlatune.sweep", "mlatune.dispatch",
                                                   "mlatune.table", "mlatune.routes"))]


def test_the_light_install_serves_the_shipped_table_from_its_winners_map():
    """Without pandas and pyarrow (the runtime install), the bundled table is read from
    its winners map: measured answers, not rules, and no heavy module imported."""
    loaded = _modules_after(
        "import sys\n"
        "for m in ('pandas', 'pyarrow'): sys.modules[m] = None\n"
        "from mlatune.dispatch import Dispatcher, device_for_arch\n"
        "d = Dispatcher.from_bundled(device_for_arch('sm_90', 'NVIDIA H200', 132))\n"
        "assert d.source.endswith('sm_90-h200.json.gz'), d.source\n"
        "from mlatune.problem import MLAProblem\n"
        "assert d.select(MLAProblem(num_heads=16, batch=64, kv_len=4096)).source == 'table'\n"
        "for m in ('pandas', 'pyarrow'): del sys.modules[m]  # blocked: never imported")
    assert not [m for m in HEAVY if m in loaded]


def test_the_shipped_winners_map_is_the_shipped_tables_export():
    """tables/<arch>-<gpu>.json.gz is `mlatune export --format json` of the Parquet table
    beside it (rebuilt with it), and both answer alike."""
    import gzip
    from pathlib import Path

    from mlatune.dispatch import Dispatcher, device_for_arch

    tables = Path(__file__).resolve().parents[1] / "tables"
    for parquet in sorted(tables.glob("*.parquet")):
        shipped = json.loads(gzip.decompress(parquet.with_suffix(".json.gz").read_bytes()))
        exported = table.winners_json(table.read(parquet, facts=routes.FACTS))
        assert shipped == json.loads(json.dumps(exported)), \
            f"{parquet.name}: run mlatune export {parquet} --format json --out " \
            f"{parquet.with_suffix('.json.gz')}"
    device = device_for_arch("sm_90", "NVIDIA H200", 132)
    frame, mapped = (Dispatcher.load(tables / f"sm_90-h200{s}", device=device,
                                     allow_arch="sm_90") for s in (".parquet", ".json.gz"))
    problems = [MLAProblem(num_heads=h, batch=b, kv_len=k, kv_dtype=d)
                for h in (16, 128) for b in (3, 64, 200) for k in (700, 4096, 30000)
                for d in ("bf16", "fp8_e4m3fn")]
    assert [frame.select(p) for p in problems] == [mapped.select(p) for p in problems]
