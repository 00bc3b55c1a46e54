"""The user table's one merge (``mlatune.table.user.merge``), which tuning at load and
first-sight timing both write through: a new row replaces only the row of its device,
problem and route."""

from __future__ import annotations

import os

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


def test_rows_of_an_older_environment_give_way_to_the_new_ones(tmp_path):
    """After an upgrade (torch here) the device's rows measured before are replaced by the
    first merge after it (a table holds one environment a device, and they no longer time
    this one), not refused forever; another device's rows stay as they were."""
    from dataclasses import replace

    from tests.table_helpers import H200, MI355, PROVENANCE

    path = tmp_path / "user.parquet"
    before = replace(PROVENANCE, torch_version="2.12.0")
    user.merge(path, make_table([result_row(PROBLEM, "padded/triton", 5.0),
                                 result_row(PROBLEM, "gluon/triton", 6.0),
                                 result_row(PROBLEM, "padded/triton", 9.0, device=MI355)],
                                before), routes.FACTS)
    other = PROBLEM.with_(batch=8)
    user.merge(path, make_table([result_row(other, "padded/triton", 7.0)]), routes.FACTS)
    rows = table.read(path, facts=routes.FACTS)
    on_h200 = rows[rows["device_name"] == H200.name]
    assert list(zip(table.key_strings(on_h200), on_h200["time_us"], strict=True)) == [
        (other.key, 7.0)]
    assert set(on_h200["torch_version"]) == {PROVENANCE.torch_version}
    on_mi355 = rows[rows["device_name"] == MI355.name]
    assert list(on_mi355["time_us"]) == [9.0] and set(on_mi355["torch_version"]) == {"2.12.0"}


def test_a_user_table_reached_through_a_link_is_merged_into_where_it_lives(tmp_path):
    """Two spellings of one table (a link and its target) take one lock and write the one
    file: the link stays a link and every row lands in the shared file."""
    shared = tmp_path / "shared" / "user.parquet"
    link = tmp_path / "link.parquet"
    user.merge(shared, make_table([result_row(PROBLEM, "padded/triton", 5.0)]), routes.FACTS)
    link.symlink_to(shared)
    user.merge(link, make_table([result_row(PROBLEM.with_(batch=8), "padded/triton", 7.0)]),
               routes.FACTS)
    assert link.is_symlink()
    assert sorted(table.read(shared)["batch"]) == [4, 8]


def test_tuning_names_the_user_table_where_the_variable_is_set_empty(tmp_path, monkeypatch):
    """MLATUNE_USER_TABLE="" overlays nothing: tuning sets it to the table it tunes into, so
    the next load overlays what was tuned."""
    from mlatune.sweep import at_load

    monkeypatch.setenv(user.USER_TABLE_ENV, "")
    monkeypatch.setattr(at_load, "tune", lambda *args, **kwargs: None)
    at_load.tune_at_load(None, lambda p: True, user_table=tmp_path / "mine.parquet")
    assert os.environ[user.USER_TABLE_ENV] == str(tmp_path / "mine.parquet")
