"""A stored parameter set its route cannot run (a split count past any device, a tile of a
string) refuses the table on load, Parquet and winners map alike, and `mlatune validate`
names it."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from mlatune import routes, table
from mlatune.cli import app
from mlatune.dispatch import Dispatcher
from mlatune.errors import TableError
from mlatune.problem import MLAProblem
from tests.table_helpers import H200, make_table, result_row

PROBLEM = MLAProblem(num_heads=16, batch=8, kv_len=4096)
GOOD = {"block_m": 16, "block_n": 64, "num_splits": 8, "num_stages": 2, "num_warps": 4}


def test_a_route_checks_its_declared_limits():
    padded = routes.get("padded/triton")
    assert padded.check_params(GOOD) is None
    assert padded.check_params({**GOOD, "num_splits": 1_000_000}) == \
        "num_splits 1000000 is not an integer in [1, 256]"
    assert "num_warps True" in padded.check_params({**GOOD, "num_warps": True})
    assert "block_n '64'" in padded.check_params({**GOOD, "block_n": "64"})
    # Triton's aranges and warps take powers of two alone: refused on load, not at serve
    # time ("arange's range must be a power of 2").
    assert padded.check_params({**GOOD, "block_n": 48}) == "block_n 48 is not a power of two"
    assert padded.check_params({**GOOD, "block_m": 3}) == "block_m 3 is not a power of two"
    assert padded.check_params({**GOOD, "num_warps": 6}) == "num_warps 6 is not a power of two"
    assert padded.check_params({**GOOD, "num_stages": 3}) is None  # any depth
    assert "num_segments 0" in routes.get("segmented/triton").check_params({"num_segments": 0})
    assert routes.get("transposed/gluon").check_params({"num_splits": 300, "form": "mma16"})
    assert routes.get("transposed-mma8/gluon").check_params({"num_splits": 300, "form": "mma8"})
    assert routes.get("transposed-mma8/gluon").check_params({"num_splits": 256}) is None
    assert routes.get("dense/flashmla").check_params({"num_splits": 10**9}) is None  # none


@pytest.mark.parametrize("fmt", ["parquet", "json"])
def test_a_table_naming_a_set_its_route_cannot_run_is_refused(tmp_path, fmt):
    rows = [result_row(PROBLEM, "padded/triton", 5.0, params={**GOOD, "num_splits": 10**6}),
            result_row(PROBLEM, "reference/torch", 50.0)]
    frame = make_table(rows)
    path = table.write(frame, tmp_path / "t.parquet") if fmt == "parquet" else \
        table.write_json(table.winners_json(frame), tmp_path / "t.json")
    with pytest.raises(TableError, match="num_splits 1000000 is not an integer in"):
        Dispatcher.load(path, device=H200, allow_arch="sm_90")
    result = CliRunner().invoke(app, ["validate", str(path)])
    assert result.exit_code == 1
    assert "num_splits 1000000" in result.output


@pytest.mark.parametrize("name", ["sm_90-h200", "sm_90-h100"])
def test_the_shipped_tables_sets_are_all_runnable(name):
    frame = table.read(f"tables/{name}.parquet", facts=routes.FACTS)
    assert table.checks.param_problems(frame, routes.FACTS) == []
