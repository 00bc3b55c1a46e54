"""Measured DCP rows win over simulated ones everywhere a table or journal is read
(``schema.competing``): the dispatcher's exact, nearest and predicted answers, the JSON
winners map, the predictor's data, and the report's times and runner-ups."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mlatune import routes, table
from mlatune.dispatch import Dispatcher
from mlatune.dispatch.observations import rows_from_journal, rows_from_table
from mlatune.problem import MLAProblem
from mlatune.report.metrics import candidate_times, ok_times
from mlatune.table.schema import competing
from tests.table_helpers import H200, FakeRoute, make_table, result_row

SIM, MEAS_A, MEAS_B = "sim-fast/fake", "meas-a/fake", "meas-b/fake"
DCP2 = MLAProblem(num_heads=16, qlen=1, batch=8, kv_len=4096, dcp_size=2)
# The same bucket, measured on one GPU only (no row timed across processes).
SIMULATED_ONLY = DCP2.with_(kv_len=16384)


def measured_row(problem: MLAProblem, route: str, time_us: float, scheme: str = "ag_rs"
                 ) -> dict:
    return result_row(problem, route, time_us) | {
        "dcp_timing": "measured", "dcp_scheme": scheme, "comm_us": time_us / 3,
        "simulated_us": time_us / 2}


@pytest.fixture(autouse=True)
def fakes():
    made = [FakeRoute(r) for r in (SIM, MEAS_A, MEAS_B)]
    for route in made:
        routes.register(route)
    yield
    for route in made:
        routes.unregister(route.id)


def mixed_table():
    """At DCP2 the simulated row is the cheapest, yet two routes were measured across
    processes; at SIMULATED_ONLY nothing was."""
    return make_table([
        result_row(DCP2, SIM, 10.0),
        measured_row(DCP2, MEAS_A, 50.0),
        measured_row(DCP2, MEAS_B, 40.0, scheme="a2a"),
        result_row(SIMULATED_ONLY, SIM, 20.0),
        result_row(SIMULATED_ONLY, MEAS_A, 70.0),
    ])


def test_the_rule_keeps_measured_rows_where_a_group_has_them():
    assert competing(["p", "p", "q"], [False, True, False]) == [False, True, True]
    assert competing(["p", "q"], [False, False]) == [True, True]


@pytest.mark.parametrize("fmt", ["parquet", "json"])
def test_a_dearer_measured_row_beats_a_cheaper_simulated_one(tmp_path, fmt):
    frame = mixed_table()
    if fmt == "json":
        path = table.write_json(table.winners_json(frame), tmp_path / "t.json")
    else:
        path = table.write(frame, tmp_path / "t.parquet")
    dispatcher = Dispatcher.load(path, device=H200)
    choice = dispatcher.select(DCP2)
    assert (choice.source, choice.route_id, choice.time_us) == ("table", MEAS_B, 40.0)
    # The simulated route is no alternative there; it still answers its own problem.
    from_table = [c.route_id for c in dispatcher.alternatives(DCP2) if c.source == "table"]
    assert from_table == [MEAS_B, MEAS_A]
    assert dispatcher.select(SIMULATED_ONLY).route_id == SIM


def test_the_winners_map_lists_only_the_measured_options_of_a_measured_problem():
    document = table.winners_json(mixed_table())
    entry = document["devices"][0]["winners"][DCP2.key]
    options = [entry, *entry["alternatives"]]
    assert [(o["route"], o.get("dcp_timing")) for o in options] == [
        (MEAS_B, "measured"), (MEAS_A, "measured")]
    plain = document["devices"][0]["winners"][SIMULATED_ONLY.key]
    assert "dcp_timing" not in plain


def test_nearest_answers_for_an_unmeasured_dcp_shape_from_measured_points(tmp_path):
    path = table.write(mixed_table(), tmp_path / "t.parquet")
    dispatcher = Dispatcher.load(path, device=H200, unmeasured="nearest")
    # Nearer to the simulated-only point, but its bucket has a measured one.
    asked = DCP2.with_(kv_len=12288)
    choice = dispatcher.select(asked)
    assert (choice.source, choice.key, choice.route_id) == ("nearest", DCP2.key, MEAS_B)


def test_predicted_answers_for_an_unmeasured_dcp_shape_learn_from_measured_rows(tmp_path):
    path = table.write(mixed_table(), tmp_path / "t.parquet")
    dispatcher = Dispatcher.load(path, device=H200, unmeasured="predict")
    choice = dispatcher.select(DCP2.with_(kv_len=12288))
    assert choice.source == "predicted" and choice.route_id in (MEAS_A, MEAS_B)
    assert choice.key == DCP2.key


def write_journal(path: Path, rows: list[dict]) -> Path:
    lines = [{"kind": "header"}]
    for i, row in enumerate(rows):
        problem = MLAProblem.from_key_dict(row)
        lines.append({"kind": "result", "id": str(i), "key": problem.key_dict(),
                      "route": row["route"], "route_params": row["route_params"],
                      "status": "ok", "time_us": row["time_us"],
                      **{k: row[k] for k in ("dcp_timing", "dcp_scheme") if row[k]}})
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


def journal_rows() -> list[dict]:
    """A sweep's journal: every route simulated, two of them measured after."""
    return [result_row(DCP2, SIM, 10.0) | {"dcp_timing": "simulated", "dcp_scheme": ""},
            result_row(DCP2, MEAS_A, 30.0) | {"dcp_timing": "simulated", "dcp_scheme": ""},
            measured_row(DCP2, MEAS_A, 50.0), measured_row(DCP2, MEAS_A, 45.0, "a2a"),
            result_row(SIMULATED_ONLY, SIM, 20.0) | {"dcp_timing": "simulated",
                                                     "dcp_scheme": ""}]


def test_the_predictor_learns_only_measured_steps_in_a_bucket_that_has_them(tmp_path):
    path = write_journal(tmp_path / "sweep.journal.jsonl", journal_rows())
    learned = {(p.kv_len, route, cost) for p, route, _, cost in rows_from_journal(path)}
    assert learned == {(4096, MEAS_A, 50.0), (4096, MEAS_A, 45.0)}
    from_table = {(p.kv_len, route, cost) for p, route, _, cost in
                  rows_from_table(mixed_table())}
    assert from_table == {(4096, MEAS_B, 40.0), (4096, MEAS_A, 50.0)}


def test_the_report_times_a_measured_problem_by_its_measured_steps(tmp_path):
    path = write_journal(tmp_path / "sweep.journal.jsonl", journal_rows())
    timed = candidate_times(path)
    assert timed[(DCP2.key, MEAS_A)] == [({}, 50.0), ({}, 45.0)]
    assert (DCP2.key, SIM) not in timed
    assert timed[(SIMULATED_ONLY.key, SIM)] == [({}, 20.0)]
    times = ok_times(mixed_table())
    assert times.loc[DCP2.key].dropna().to_dict() == {MEAS_A: 50.0, MEAS_B: 40.0}
    assert times.loc[SIMULATED_ONLY.key].dropna().to_dict() == {SIM: 20.0, MEAS_A: 70.0}


def test_a_measured_winner_has_no_simulated_runner_up():
    lone = make_table([result_row(DCP2, SIM, 10.0), measured_row(DCP2, MEAS_A, 50.0)])
    row = table.summary(lone).iloc[0]
    assert (row["winner"], row["runner_up"]) == (MEAS_A, "")


def test_measured_runs_that_all_failed_leave_the_simulated_rows_competing(tmp_path):
    """A problem whose cross-process runs all crashed is answered by its simulated rows,
    in the summary and the JSON map as by the dispatcher (only an ok measured row counts)."""
    frame = make_table([
        result_row(DCP2, SIM, 10.0),
        measured_row(DCP2, MEAS_A, 50.0) | {"status": "crashed", "time_us": float("nan"),
                                            "reason": "rank 1 died"},
    ])
    assert table.competing_rows(frame).tolist() == [True, True]
    (winner,) = table.summary(frame)["winner"].tolist()
    assert winner == SIM
    entry = table.winners_json(frame)["devices"][0]["winners"][DCP2.key]
    assert entry["route"] == SIM
    dispatcher = Dispatcher.load(table.write(frame, tmp_path / "t.parquet"), device=H200)
    assert dispatcher.select(DCP2).route_id == SIM
