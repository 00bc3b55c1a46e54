"""Stored rows in a deleted kernel form's spelling: upgraded as a table is read, or stale."""

import json

from mlatune import routes, table
from mlatune.dispatch import Dispatcher
from mlatune.problem import MLAProblem
from tests.table_helpers import H200, make_table, result_row

P = MLAProblem(num_heads=16, batch=4, kv_len=4096)
Q = P.with_(batch=8)
LIVE = {"afresh_q": True, "chunked": True, "lone_bars": True, "num_splits": 2, "pdl": True,
        "rope_regs": True, "slim": True, "two_requests": True}  # the two-requests form
DEAD = {"chunked": True, "num_splits": 2}  # chunked alone: a form since deleted


def shipped_like(tmp_path, suffix):
    rows = [result_row(P, "seesaw/gluon", 10.0, params=LIVE),
            result_row(P, "padded/triton", 20.0, params={"block_m": 64}),
            result_row(Q, "seesaw/gluon", 10.0, params=DEAD),
            result_row(Q, "padded/triton", 30.0, params={"block_m": 64})]
    return table.write(make_table(rows), tmp_path / f"sm_90.{suffix}")


def test_a_live_form_reads_in_its_current_spelling_and_a_deleted_one_as_stale(tmp_path):
    frame = table.read(shipped_like(tmp_path, "parquet"), facts=routes.FACTS)
    seesaw = frame[frame["route"] == "seesaw/gluon"].set_index("batch")
    assert json.loads(seesaw.loc[4, "route_params"]) == {"form": "two-requests",
                                                          "num_splits": 2}
    assert seesaw.loc[8, "status"] == "stale" and seesaw.loc[8, "rank"] == 0
    padded_q = frame[(frame["route"] == "padded/triton") & (frame["batch"] == 8)]
    assert padded_q["rank"].tolist() == [1]  # ranked again without the stale row
    assert table.read(shipped_like(tmp_path, "csv"))["status"].eq("ok").all()  # as stored


def test_the_dispatcher_never_serves_a_stale_row_nor_counts_it_failed(tmp_path):
    path = shipped_like(tmp_path, "parquet")
    json_path = table.write_json(table.winners_json(table.read(path)), tmp_path / "sm_90.json")
    for source in (path, json_path):
        dispatcher = Dispatcher.load(source, device=H200, allow_arch="sm_90")
        live = dispatcher.select(P)
        assert (live.route_id, dict(live.params)) == ("seesaw/gluon",
                                                      {"form": "two-requests", "num_splits": 2})
        choice, notes = dispatcher.explain(Q)
        assert choice.route_id == "padded/triton", source
        assert not any("seesaw/gluon" in note and "measured here" in note for note in notes)
