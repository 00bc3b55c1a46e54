"""One numeric class per route: transposed/gluon's fp8-MMA form is the route
``transposed-mma8/gluon``. A stored row, journal record or winners-map option of
transposed/gluon that names that form (as a form id or in the boolean spelling) is read as
the new route's; everything else of transposed/gluon stays where it is."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from mlatune import routes, table
from mlatune.arch import DeviceInfo
from mlatune.measure.records import Record, at_home, table_rows
from mlatune.problem import MLAProblem
from mlatune.table import winners_map
from mlatune.table.schema import Status
from tests.table_helpers import PROVENANCE, make_table, result_row
from tests.test_table import write_raw

TG, MMA8 = "transposed/gluon", "transposed-mma8/gluon"
FP8_16 = MLAProblem(num_heads=16, batch=64, kv_len=4096, q_dtype="bf16",
                    kv_dtype="fp8_e4m3fn")  # 16 rows a program: both routes serve it
LEGACY_MMA8 = {"num_splits": 4, "pdl": True, "ws": True, "fp8_mma": True, "defer_sums": True,
               "stacked": True, "wide_vt": True, "warp_max": True, "slim": True}
V4_SAMPLE = Path(__file__).resolve().parent / "data" / "sm_90-h200-v4.parquet"


def test_route_of_names_where_a_stored_set_belongs():
    tg = routes.get(TG)
    assert tg.route_of({"num_splits": 4, "form": "mma8"}) == MMA8
    assert tg.route_of(LEGACY_MMA8) == MMA8
    assert tg.route_of({"num_splits": 4, "form": "mma16"}) == TG
    assert tg.route_of({"num_splits": 4, "pdl": True}) == TG  # mma16, boolean spelling
    assert tg.route_of({}) == TG and tg.route_of({"form": ["mma8"]}) == TG
    assert routes.get(MMA8).route_of({"form": "mma8"}) == MMA8
    assert routes.FACTS.route_of(TG, LEGACY_MMA8) == MMA8
    assert routes.FACTS.route_of("no/such", {"form": "mma8"}) == "no/such"


def _stored_rows() -> list[dict]:
    """transposed/gluon rows as an older mlatune stored them: at one key the mma8 form (its
    id), at another the boolean spelling, at a third mma16; padded/triton beside each."""
    padded = {"block_m": 64, "block_n": 64, "num_stages": 1, "num_warps": 8}
    keys = [FP8_16, FP8_16.with_(batch=32), FP8_16.with_(batch=16)]
    sets = [{"num_splits": 4, "form": "mma8"}, LEGACY_MMA8, {"num_splits": 8, "form": "mma16"}]
    return [r for p, params in zip(keys, sets, strict=True)
            for r in (result_row(p, TG, 50.0, params=params),
                      result_row(p, "padded/triton", 174.0, params=padded))]


@pytest.mark.parametrize("version", [5, 6])
def test_a_stored_mma8_row_reads_as_the_fp8_mma_route(tmp_path, version):
    frame = make_table(_stored_rows())  # table.build keeps the routes as given
    path = tmp_path / "t.parquet"
    if version == 6:
        table.write(frame, path)
    else:
        old = frame.drop(columns=["hardware"]).assign(schema_version=5)
        provenance = {k: v for k, v in PROVENANCE.as_dict().items() if k != "hardware"}
        write_raw(old, path, metadata={"schema_version": 5,
                                       "provenance": [{**provenance, "schema_version": 5}]})
    read, stored = table.read_versioned(path, facts=routes.FACTS)
    assert stored == version
    by_route = read.groupby("route")["route_params"].apply(sorted).to_dict()
    assert by_route[MMA8] == [json.dumps({"form": "mma8", "num_splits": 4})] * 2
    assert by_route[TG] == [json.dumps({"form": "mma16", "num_splits": 8})]
    assert set(read["status"]) == {"ok"} and len(read) == 6
    assert (read.groupby(["batch", "route"]).size() == 1).all()
    assert table.read(path)["route"].tolist() == frame["route"].tolist()  # no facts: as stored


def test_the_v4_sample_reads_its_mma8_row_under_the_new_route():
    raw = table.read(V4_SAMPLE)
    read = table.read(V4_SAMPLE, facts=routes.FACTS)
    mma8 = raw["route_params"].str.contains('"mma8"') & (raw["route"] == TG)
    assert int(mma8.sum()) == 1
    assert read.loc[mma8, "route"].tolist() == [MMA8]
    assert (read.loc[~mma8, "route"] == raw.loc[~mma8, "route"]).all()


def _record(problem: MLAProblem, route: str, params: dict, time_us: float) -> Record:
    return Record(status=Status.OK, id=f"{route}{params}", key=problem.key_dict(), route=route,
                  route_params=json.dumps(params, sort_keys=True), time_us=time_us,
                  rel_err=1e-3, plan_on="none", capturable=True)


def test_a_journal_with_both_forms_folds_into_a_row_each():
    """Records of both forms at one problem (as transposed/gluon ran them) make two rows:
    each route's fastest set."""
    records = [_record(FP8_16, TG, {"num_splits": 4, "form": "mma8"}, 60.0),
               _record(FP8_16, TG, {"num_splits": 2, "form": "mma8"}, 59.0),
               _record(FP8_16, TG, {**LEGACY_MMA8, "num_splits": 8}, 65.0),
               _record(FP8_16, TG, {"num_splits": 8, "form": "mma16"}, 80.0),
               _record(FP8_16, TG, {"num_splits": 4, "form": "mma16"}, 75.0)]
    rows = table_rows(records, DeviceInfo("sm_90", "NVIDIA H200", "nvidia", 132))
    best = {r["route"]: (json.loads(r["route_params"]), r["time_us"]) for r in rows}
    assert best == {MMA8: ({"num_splits": 2, "form": "mma8"}, 59.0),
                    TG: ({"num_splits": 4, "form": "mma16"}, 75.0)}
    assert at_home(records[3]) is records[3]
    assert at_home(replace(records[0], route_params="not json")).route == TG


def test_a_winners_map_option_moves_with_its_set(tmp_path):
    path = table.write_json(table.winners_json(make_table(_stored_rows())),
                            tmp_path / "t.json")
    document = winners_map.read(path, routes.FACTS).document
    options = [(o["route"], o["params"]) for entry in document["devices"][0]["winners"].values()
               for o in (entry, *entry.get("alternatives", ()))]
    assert sorted((r, p.get("form")) for r, p in options if r != "padded/triton") == \
        [(MMA8, "mma8"), (MMA8, "mma8"), (TG, "mma16")]
