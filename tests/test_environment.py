"""Loading a table measured in another environment warns once and says what differs."""

import json
import logging
from dataclasses import replace

import pytest
import torch

from mlatune import table
from mlatune.arch import cpu_device
from mlatune.dispatch import Dispatcher, bundled, dispatcher, environment
from mlatune.dispatch.environment import Environment, differences
from mlatune.problem import MLAProblem
from tests.table_helpers import H200, MI355, PROVENANCE, make_table, result_row

DEVICE = ("sm_90", "NVIDIA H200", 132)
RECORD = {**PROVENANCE.as_dict(),
          "backend_versions": json.dumps({"aiter": None, "mlatune": "0.1.0", "python": "3.12.3",
                                          "torch": "2.13.0", "triton": "3.4.0"})}
# Where the table helpers' PROVENANCE was measured.
SAME = Environment("NVIDIA H200", 132, "sm_90", "cuda-driver-12.8",
                   {"mlatune": "0.1.0", "python": "3.12.3", "torch": "2.13.0",
                    "triton": "3.4.0", "aiter": None})


def test_the_same_environment_differs_in_nothing():
    assert differences([RECORD], DEVICE, SAME) == []
    # mlatune's and Python's own versions are not compared; nor is a library one side lacks.
    newer = replace(SAME, versions={**SAME.versions, "mlatune": "0.2.0", "python": "3.13.1",
                                    "flashinfer": "0.3.0"})
    assert differences([RECORD], DEVICE, newer) == []


def test_each_difference_is_named_with_both_values():
    running = Environment("NVIDIA H100 80GB HBM3", 132, "sm_90", "none",
                          {**SAME.versions, "torch": "2.14.0", "triton": None, "aiter": "0.1.5"})
    assert differences([RECORD], DEVICE, running) == [
        "device: table NVIDIA H200 (132 SMs), running NVIDIA H100 80GB HBM3 (132 SMs)",
        "driver: table cuda-driver-12.8, running none",
        "torch: table 2.13.0, running 2.14.0",
        "triton: table 3.4.0, running none",
        "aiter: table none, running 0.1.5",
    ]


def test_what_a_table_does_not_record_is_not_a_difference():
    assert differences([], DEVICE, SAME) == []  # no provenance: only the device is compared
    assert differences([], DEVICE, replace(SAME, cu_count=66)) == [
        "device: table NVIDIA H200 (132 SMs), running NVIDIA H200 (66 SMs)"]
    unreadable = {**RECORD, "backend_versions": "{not json"}
    assert differences([unreadable], DEVICE, replace(SAME, versions={
        **SAME.versions, "aiter": "0.1.5"})) == []


def test_several_records_differ_unless_all_match():
    older = {**RECORD, "torch_version": "2.12.0"}
    assert differences([RECORD, older], DEVICE, SAME) == [
        "torch: table 2.12.0, 2.13.0, running 2.13.0"]


def test_nothing_is_compared_without_a_gpu(monkeypatch):
    assert environment.here(cpu_device()) is None
    # Without a GPU an H200 DeviceInfo only stands in for one, as in most of these tests.
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert environment.here(H200) is None


@pytest.fixture
def running(monkeypatch):
    """Make this process look like it runs on a GPU in ``SAME`` (the caller may replace)."""
    monkeypatch.setattr(environment, "_WARNED", set())
    state = {"env": SAME}
    monkeypatch.setattr(environment, "here", lambda device: state["env"])
    return state


@pytest.fixture
def table_file(tmp_path):
    frame = make_table([result_row(MLAProblem(), "reference/torch", 50.0)])
    return table.write(frame, tmp_path / "sm_90.parquet")


def warnings_of(caplog):
    return [r for r in caplog.records if r.name == "mlatune" and r.levelno == logging.WARNING]


def test_a_table_measured_here_loads_without_a_warning(running, table_file, caplog):
    with caplog.at_level(logging.WARNING, logger="mlatune"):
        loaded = Dispatcher.load(table_file, device=H200)
    assert loaded.environment_differences == []
    assert warnings_of(caplog) == []


@pytest.mark.parametrize("fmt", ["parquet", "json"])
def test_another_torch_warns_once_per_table_and_process(running, table_file, caplog, fmt):
    path = table_file
    if fmt == "json":
        path = table.write_json(table.winners_json(table.read(table_file)),
                                table_file.with_suffix(".json"))
    running["env"] = replace(SAME, versions={**SAME.versions, "torch": "2.14.0"})
    with caplog.at_level(logging.WARNING, logger="mlatune"):
        first = Dispatcher.load(path, device=H200)
        second = Dispatcher.load(path, device=H200)
    assert first.environment_differences == second.environment_differences == [
        "torch: table 2.13.0, running 2.14.0"]
    [record] = warnings_of(caplog)
    assert str(path) in record.getMessage()
    assert "torch: table 2.13.0, running 2.14.0" in record.getMessage()
    # Another difference is news: it warns again.
    running["env"] = replace(running["env"], driver="cuda-driver-13.0")
    with caplog.at_level(logging.WARNING, logger="mlatune"):
        Dispatcher.load(path, device=H200)
    assert len(warnings_of(caplog)) == 2


def test_a_repeated_from_bundled_warns_once(running, table_file, monkeypatch, caplog):
    monkeypatch.delenv(dispatcher.TABLE_ENV, raising=False)
    monkeypatch.setattr(bundled, "bundled_tables_dir", lambda: table_file.parent)
    running["env"] = replace(SAME, device_name="NVIDIA H200 NVL", cu_count=132)
    with caplog.at_level(logging.WARNING, logger="mlatune"):
        loaded = [Dispatcher.from_bundled(H200) for _ in range(3)]
    assert all(d.source == str(table_file) for d in loaded)
    assert all(d.environment_differences == [
        "device: table NVIDIA H200 (132 SMs), running NVIDIA H200 NVL (132 SMs)"]
        for d in loaded)
    assert len(warnings_of(caplog)) == 1


def test_planning_for_another_arch_compares_nothing(running, table_file, caplog):
    running["env"] = replace(SAME, versions={**SAME.versions, "torch": "2.14.0"})
    with caplog.at_level(logging.WARNING, logger="mlatune"):
        planned = Dispatcher.load(table_file, device=MI355, allow_arch="sm_90")
    assert planned.environment_differences == []
    assert warnings_of(caplog) == []


def test_rules_only_has_no_differences():
    assert Dispatcher.rules_only(H200).environment_differences == []
