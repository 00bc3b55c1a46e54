"""A sweep worker killed from outside (the OOM killer, an operator's kill -9) says nothing
of its route: the candidate is journaled crashed, and a resumed sweep runs it once more."""

from __future__ import annotations

import pytest

from mlatune.arch import cpu_device
from mlatune.measure.records import KILLED_FROM_OUTSIDE, Status
from mlatune.sweep import runner
from mlatune.sweep.journal import Journal
from tests.test_runner import header, tiny_spec

KILLED = "fault-killed/test"
# tests.fault_routes.KILL_ONCE_ENV, spelled out: importing that module registers its routes.
KILL_ONCE_ENV = "MLATUNE_TEST_KILL_ONCE"


@pytest.fixture
def plugins(monkeypatch):
    from tests import fault_routes

    assert fault_routes.KILL_ONCE_ENV == KILL_ONCE_ENV
    monkeypatch.setenv("MLATUNE_PLUGINS", "tests.fault_routes")
    fault_routes.register_all()
    yield monkeypatch
    fault_routes.unregister_all()


def _sweep(path, resume: bool):
    journal = Journal(path, header(), resume=resume)
    try:
        result = runner.run(tiny_spec([KILLED], batch=[1]), cpu_device(), journal, timeout_s=60)
    finally:
        journal.close()
    return result


def test_a_kill_from_outside_is_run_again_once_on_resume(tmp_path, plugins):
    plugins.setenv(KILL_ONCE_ENV, str(tmp_path / "killed-once"))
    first = _sweep(tmp_path / "j.jsonl", resume=False)
    assert [(r.status, r.reason) for r in first.records] == \
        [(Status.CRASHED, f"{KILLED_FROM_OUTSIDE} (SIGKILL)")]
    again = _sweep(tmp_path / "j.jsonl", resume=True)
    assert again.resumed == 0 and [r.status for r in again.records] == \
        [Status.CRASHED, Status.OK]


def test_a_candidate_killed_twice_is_not_run_a_third_time(tmp_path, plugins):
    path = tmp_path / "j.jsonl"
    _sweep(path, resume=False)
    second = _sweep(path, resume=True)
    assert [r.status for r in second.records] == [Status.CRASHED, Status.CRASHED]
    third = _sweep(path, resume=True)
    assert third.resumed == 1 and len(third.records) == 2


def test_a_crash_of_the_route_itself_is_not_run_again(tmp_path, plugins):
    journal = Journal(tmp_path / "j.jsonl", header(), resume=False)
    runner.run(tiny_spec(["fault-abort/test"], batch=[1]), cpu_device(), journal, timeout_s=60)
    journal.close()
    journal = Journal(tmp_path / "j.jsonl", header(), resume=True)
    assert journal.records[0].reason.endswith("SIGABRT")
    assert journal.done_ids == {journal.records[0].id}
    journal.close()
