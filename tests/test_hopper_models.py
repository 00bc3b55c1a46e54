"""Every Hopper model: a GPU's figures (``mlatune.hardware``), the bundled table each model
loads (``bundled.table_choice``), a table carried to another model (``other_gpu``), and a
sweep pruned by another GPU's table (``--prune-from``)."""

from __future__ import annotations

import logging
from dataclasses import replace

import pytest

from mlatune import hardware, table
from mlatune.arch import DeviceInfo, cpu_device
from mlatune.dispatch import Dispatcher, bundled, environment
from mlatune.dispatch.loading import OTHER_GPU_ENV, TABLE_ENV
from mlatune.problem import MLAProblem
from mlatune.sweep.candidates import Candidate, Prior
from tests.table_helpers import H200, PROVENANCE, make_table, result_row

H100 = DeviceInfo("sm_90", "NVIDIA H100 80GB HBM3", "nvidia", 132, 80 * 2**30, 0)
H100_PCIE = DeviceInfo("sm_90", "NVIDIA H100 PCIe", "nvidia", 114, 80 * 2**30, 0)
PROBLEM = MLAProblem(num_heads=8, batch=4, kv_len=1024)


@pytest.mark.parametrize("name, sms, bandwidth", [
    ("NVIDIA H100 80GB HBM3", 132, 3350.0), ("NVIDIA H100 PCIe", 114, 2000.0),
    ("NVIDIA H200", 132, 4800.0), ("NVIDIA H20", 78, 4000.0), ("NVIDIA H800", 132, 3350.0),
    ("NVIDIA GH200 480GB", 132, 4000.0)])
def test_datasheets_tell_the_hopper_models_apart(name, sms, bandwidth):
    sheet = hardware.datasheet(name)
    assert (sheet.sm_count, sheet.bandwidth_gbs) == (sms, bandwidth)
    assert hardware.datasheet("AMD Instinct MI300X") is None


def test_figures_round_trip_and_a_table_record_wins_over_the_datasheet():
    described = hardware.described("NVIDIA H200", "sm_90", 132)
    assert described.bandwidth_gbs == 4800.0 and described.source["bandwidth_gbs"] == "datasheet"
    assert hardware.Hardware.from_json(described.as_json()) == described
    assert hardware.Hardware.from_json("{not json") is None
    measured = replace(described, measured_bandwidth_gbs=4300.0)
    assert hardware.recorded([{"hardware": ""}, {"hardware": measured.as_json()}],
                             "NVIDIA H200", "sm_90", 132) == measured
    assert hardware.recorded([{"hardware": ""}], "NVIDIA H200", "sm_90", 132) == described
    # Nothing is read of a GPU this process does not hold, nor of the CPU.
    assert hardware.of_device(cpu_device()).bandwidth_gbs is None
    assert hardware.measure_bandwidth(cpu_device()) is None


def test_each_model_loads_its_own_table_else_the_nearest(tmp_path):
    for name in ("sm_90-h100.parquet", "sm_90-h100.json.gz", "sm_90-h200.parquet",
                 "gfx950.parquet"):
        (tmp_path / name).write_bytes(b"x")
    choice = bundled.table_choice(tmp_path, "sm_90", "NVIDIA H200")
    assert (choice.path.name, choice.match) == ("sm_90-h200.parquet", "model")
    choice = bundled.table_choice(tmp_path, "sm_90", "NVIDIA H100 80GB HBM3")
    assert (choice.path.name, choice.match) == ("sm_90-h100.parquet", "model")
    # The PCIe card is named "H100" but is not the model the table measured.
    choice = bundled.table_choice(tmp_path, "sm_90", "NVIDIA H100 PCIe")
    assert (choice.model, choice.match) == ("h100", "nearest") and "H100 PCIe" in choice.why
    assert bundled.table_choice(tmp_path, "sm_90", "NVIDIA H200 NVL").model == "h200"
    # A model no datasheet knows: the arch's first table, said so.
    choice = bundled.table_choice(tmp_path, "sm_90", "Some Future GPU")
    assert choice.match == "arch" and choice.path.name == "sm_90-h100.parquet"
    assert bundled.find_table(tmp_path, "gfx950", "AMD Instinct MI355X").name == "gfx950.parquet"
    assert bundled.find_table(tmp_path, "sm_100", "NVIDIA B200") is None


@pytest.fixture
def h200_table(tmp_path, monkeypatch):
    monkeypatch.delenv(OTHER_GPU_ENV, raising=False)
    monkeypatch.delenv(TABLE_ENV, raising=False)
    recorded = replace(PROVENANCE, hardware=hardware.described("NVIDIA H200", "sm_90",
                                                               132).as_json())
    rows = [result_row(PROBLEM, "padded/triton", 5.0, device=H200),
            result_row(PROBLEM, "gluon/triton", 6.0, device=H200)]
    return table.write(make_table(rows, recorded), tmp_path / "sm_90-h200.parquet")


@pytest.fixture
def on_a_gpu(monkeypatch):
    """This process as one that holds the device a test names (no GPU here)."""
    monkeypatch.setattr(environment, "here", lambda device: environment.Environment(
        device.name, device.cu_count, device.arch, "cuda-driver-12.8", {}))


def test_another_model_is_carried_over_by_the_laws(h200_table, on_a_gpu, monkeypatch, caplog):
    from mlatune.dispatch import laws

    seen = []

    def slower_triton(rows, routes, source, target):  # the laws' part, stood in for
        seen.append((source.name, target.name, target.sm_count))
        return rows["time_us"].to_numpy() * [3.0 if r == "padded/triton" else 1.0
                                             for r in rows["route"]]

    monkeypatch.setattr(laws, "transfer_times", slower_triton)
    with caplog.at_level(logging.INFO, logger="mlatune"):
        carried = Dispatcher.load(h200_table, device=H100_PCIE, other_gpu="transfer")
    assert seen == [("NVIDIA H200", "NVIDIA H100 PCIe", 114)]
    assert carried.select(PROBLEM).route_id == "gluon/triton"
    assert "carried over by the cost laws (SMs 132 -> 114, bandwidth 4800 -> 2000 GB/s" \
        in caplog.text
    assert Dispatcher.load(h200_table, device=H100_PCIE).select(PROBLEM).route_id == \
        "padded/triton"  # "use", the default
    monkeypatch.setenv(OTHER_GPU_ENV, "transfer")
    assert Dispatcher.load(h200_table, device=H200).select(PROBLEM).route_id == "padded/triton"
    assert len(seen) == 1  # neither "use" nor the table's own model carries anything


def test_a_law_that_cannot_carry_serves_the_table_as_measured(h200_table, on_a_gpu, monkeypatch,
                                                              caplog):
    from mlatune.dispatch import laws

    def no_law(rows, routes, source, target):
        raise ValueError("no law for these routes")

    monkeypatch.setattr(laws, "transfer_times", no_law)
    with caplog.at_level(logging.WARNING, logger="mlatune"):
        d = Dispatcher.load(h200_table, device=H100, other_gpu="transfer")
    assert d.select(PROBLEM).route_id == "padded/triton"
    assert "could not be carried to NVIDIA H100 80GB HBM3 (no law for these routes)" \
        in caplog.text


def _prior(tmp_path, rows) -> Prior:
    return Prior.read(str(table.write(make_table(rows), tmp_path / "prior.parquet")), 1.5)


def test_a_prior_table_prunes_routes_far_behind_and_losing_sets(tmp_path):
    other = MLAProblem(num_heads=8, batch=8, kv_len=1024)
    prior = _prior(tmp_path, [
        result_row(PROBLEM, "padded/triton", 10.0, params={"num_splits": 4}),
        result_row(PROBLEM, "gluon/triton", 8.0),
        result_row(PROBLEM, "cprr/triton", 20.0, status="crashed")])
    candidates = [Candidate(PROBLEM, "padded/triton", {"num_splits": 8}),  # first set
                  Candidate(PROBLEM, "padded/triton", {"num_splits": 2}),
                  Candidate(PROBLEM, "padded/triton", {"num_splits": 4}),  # won there
                  Candidate(PROBLEM, "gluon/triton", {}),
                  Candidate(PROBLEM, "segmented/triton", {}),  # not in the prior
                  Candidate(other, "padded/triton", {"num_splits": 2})]  # problem not in it
    kept, pruned = prior.split(candidates)
    assert [c.params for c in kept if c.route_id == "padded/triton"
            and c.problem == PROBLEM] == [{"num_splits": 8}, {"num_splits": 4}]
    assert [(r.route, r.status) for r in pruned] == [("padded/triton", "pruned")]
    assert "another of the route's sets won" in pruned[0].reason
    assert {c.route_id for c in kept} >= {"gluon/triton", "segmented/triton"}
    # Past the ratio, every set of the route is pruned, naming the time and the winner.
    far = _prior(tmp_path, [result_row(PROBLEM, "padded/triton", 10.0),
                            result_row(PROBLEM, "gluon/triton", 4.0)])
    kept, pruned = far.split(candidates[:4])
    assert [c.route_id for c in kept] == ["gluon/triton"] and len(pruned) == 3
    assert all("2.50x gluon/triton's step cost" in r.reason for r in pruned)


def test_routes_compete_within_their_numeric_class(tmp_path, monkeypatch):
    from mlatune.sweep import candidates as module

    # gluon/triton stands in for a route that rounds q: it does not prune exact routes.
    monkeypatch.setattr(module, "_rounding", lambda route, problem, params:
                        "q-fp8" if route == "gluon/triton" else "none")
    prior = _prior(tmp_path, [result_row(PROBLEM, "padded/triton", 10.0),
                              result_row(PROBLEM, "gluon/triton", 2.0)])
    kept, pruned = prior.split([Candidate(PROBLEM, "padded/triton", {})])
    assert [c.route_id for c in kept] == ["padded/triton"] and not pruned


def test_pruned_rows_neither_answer_nor_fail(tmp_path):
    rows = [result_row(PROBLEM, "padded/triton", 5.0),
            result_row(PROBLEM, "gluon/triton", None, status="pruned", reason="pruned: far")]
    path = table.write(make_table(rows), tmp_path / "sm_90.parquet")
    d = Dispatcher.load(path, device=H200)
    assert d.select(PROBLEM).route_id == "padded/triton"
    assert PROBLEM.key not in d._failed  # the failures nearest and rule skip
    (device,) = table.winners_json(table.read(path))["devices"]
    assert not device["all_failed"] and all("failed" not in w for w in device["winners"].values())


def test_the_reference_fallback_answers_no_problem_where_routes_went_unmeasured(tmp_path):
    """Out of memory in the sweep (its checking inputs beside the route) is no failure of the
    route; the reference the sweep then ran is its fallback, not a measured competitor: the
    problem is answered from its neighbour, and the JSON map says the same."""
    big = PROBLEM.with_(batch=256)
    oom = "raised OutOfMemoryError: CUDA out of memory. Tried to allocate 9.00 GiB."
    rows = [result_row(PROBLEM, "padded/triton", 5.0), result_row(PROBLEM, "gluon/triton", 9.0),
            result_row(big, "padded/triton", None, reason=oom),
            result_row(big, "gluon/triton", None, reason="raised RuntimeError: bad launch"),
            result_row(big, "reference/torch", 90_000.0)]
    path = table.write(make_table(rows), tmp_path / "sm_90.parquet")
    d = Dispatcher.load(path, device=H200)
    choice = d.select(big)
    assert choice.route_id == "padded/triton" and choice.source in ("nearest", "predicted")
    assert d._failed[big.key] == (("gluon/triton", "crashed"),)  # a real crash still fails
    (device,) = table.winners_json(table.read(path))["devices"]
    assert big.key not in device["winners"]
    assert device["all_failed"][big.key] == {"crashed": ["gluon/triton"]}
    # Where every other route failed for itself, the reference answers as measured.
    failed = [result_row(big, "padded/triton", None, reason="raised RuntimeError: bad"),
              *rows[3:]]
    path = table.write(make_table([*rows[:2], *failed]), tmp_path / "sm_90-b.parquet")
    assert Dispatcher.load(path, device=H200).select(big).route_id == "reference/torch"


def test_a_prior_prunes_by_step_cost_as_the_table_ranks(tmp_path):
    # A short launch behind a long host plan (shared by 61 layers' calls) is no faster step.
    planned = {**result_row(PROBLEM, "padded/triton", 2.0), "plan_on": "host",
               "capturable": False, "plan_host_us": 1000.0}
    prior = _prior(tmp_path, [planned, result_row(PROBLEM, "gluon/triton", 6.0)])
    kept, pruned = prior.split([Candidate(PROBLEM, "gluon/triton", {}),
                                Candidate(PROBLEM, "padded/triton", {})])
    assert [c.route_id for c in kept] == ["gluon/triton"]
    assert "3.07x gluon/triton's step cost" in pruned[0].reason


def test_only_the_routes_a_sweep_runs_compete(tmp_path):
    # A route faster in the prior but not run now (not installed, not named) prunes nothing.
    prior = _prior(tmp_path, [result_row(PROBLEM, "padded/triton", 10.0),
                              result_row(PROBLEM, "gluon/triton", 2.0)])
    kept, pruned = prior.split([Candidate(PROBLEM, "padded/triton", {})])
    assert [c.route_id for c in kept] == ["padded/triton"] and not pruned


def test_a_failure_is_what_a_route_row_says_before_a_pruned_set(tmp_path):
    from mlatune.measure.records import table_rows

    crashed = Candidate(PROBLEM, "padded/triton", {"num_splits": 4}).record(
        status="crashed", reason="raised")
    was_pruned = Candidate(PROBLEM, "padded/triton", {"num_splits": 2}).record(
        status="pruned", reason="pruned: far")
    for records in ([was_pruned, crashed], [crashed, was_pruned]):
        (row,) = table_rows(records, H200)
        assert row["status"] == "crashed"
    merged = table.merge([make_table([result_row(PROBLEM, "padded/triton", None,
                                                 status="crashed")]),
                          make_table([result_row(PROBLEM, "padded/triton", None,
                                                 status="pruned")])])
    assert merged["status"].tolist() == ["crashed"]


def test_a_resumed_sweep_prunes_again(tmp_path):
    from mlatune.sweep.journal import Journal, JournalHeader

    path = tmp_path / "j.jsonl"
    journal = Journal(path, JournalHeader.of("ab", "spec", H200), resume=True)
    candidate = Candidate(PROBLEM, "padded/triton", {})
    journal.append(candidate.record(status="pruned", reason="pruned: far"))
    assert candidate.id not in journal.done_ids
    journal.close()


def test_a_winning_set_of_another_split_runs_as_its_recipe(tmp_path):
    # The table's GPU had other SMs: its winning split is not among this sweep's sets, so the
    # first set of the winning recipe runs in its place.
    prior = _prior(tmp_path, [result_row(PROBLEM, "padded/triton", 10.0,
                                         params={"block_m": 32, "num_splits": 6})])
    candidates = [Candidate(PROBLEM, "padded/triton", {"block_m": 16, "num_splits": 8}),
                  Candidate(PROBLEM, "padded/triton", {"block_m": 16, "num_splits": 4}),
                  Candidate(PROBLEM, "padded/triton", {"block_m": 32, "num_splits": 8}),
                  Candidate(PROBLEM, "padded/triton", {"block_m": 32, "num_splits": 4})]
    kept, _ = prior.split(candidates)
    assert [c.params for c in kept] == [{"block_m": 16, "num_splits": 8},
                                        {"block_m": 32, "num_splits": 8}]
