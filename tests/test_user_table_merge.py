"""The user table's one merge (``mlatune.table.user.merge``), which tuning at load and
first-sight timing both write through: a new row replaces only the row of its device,
problem and route."""

from __future__ import annotations

from mlatune import routes, table
from mlatune.problem import MLAProblem
from mlatune.table import user
from tests.table_helpers import make_table, result_row

PROBLEM = MLAProblem(num_heads=8, batch=4, kv_len=1024)


def test_a_merge_keeps_the_rows_it_does_not_replace(tmp_path):
    path = tmp_path / "user.parquet"
    user.merge(path, make_table([result_row(PROBLEM, "padded/triton", 5.0),
                                 result_row(PROBLEM, "gluon/triton", None, status="crashed")]),
               routes.FACTS)
    # A first-sight timing of one route at the same problem, then of another problem.
    user.merge(path, make_table([result_row(PROBLEM, "padded/triton", 4.0)]), routes.FACTS)
    other = PROBLEM.with_(batch=8)
    user.merge(path, make_table([result_row(other, "padded/triton", 7.0)]), routes.FACTS)
    rows = table.read(path, facts=routes.FACTS)
    found = {(k, r): (s, t) for k, r, s, t in zip(table.key_strings(rows), rows["route"],
                                                  rows["status"], rows["time_us"], strict=True)}
    assert found[PROBLEM.key, "padded/triton"] == ("ok", 4.0)
    assert found[PROBLEM.key, "gluon/triton"][0] == "crashed"  # kept, not lost
    assert found[other.key, "padded/triton"] == ("ok", 7.0)
