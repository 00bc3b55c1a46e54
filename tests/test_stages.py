"""The whole sweep without the CLI: stages.run_sweep writes the table, resumes, and turns
whatever stops it into one SweepError line."""

from pathlib import Path

import pytest

from mlatune import table
from mlatune.arch import cpu_device
from mlatune.measure.records import Status
from mlatune.sweep import runner, spec, stages
from mlatune.sweep.candidates import Shard

TINY = {"routes": ["reference/torch"],
        "budget": {"warmup": 0, "min_reps": 1, "max_reps": 2, "max_seconds": 0.1},
        "grid": [{"num_heads": 2, "batch": [1, 2], "kv_len": 24, "page_size": 8,
                  "q_dtype": "fp16", "kv_dtype": "fp16"}]}


def settings(tmp_path: Path, device=None, **choices) -> stages.SweepSettings:
    return stages.SweepSettings(spec.parse(TINY, "tiny.toml"), Path("tiny.toml"),
                                device or cpu_device(), tmp_path / "t.parquet", timeout_s=60,
                                **choices)


def test_run_sweep_writes_the_table_and_a_rerun_resumes(tmp_path):
    said = []
    first = stages.run_sweep(settings(tmp_path), say=said.append)
    assert said == [f"new journal {tmp_path / 't.journal.jsonl'}"]
    assert first.result.counts == {Status.OK: 2} and first.result.ran == 2
    assert len(table.read(first.table_path)) == 2 and first.table_path.with_suffix(".csv").exists()
    earlier = table.read(first.table_path).assign(created_utc="2020-01-01T00:00:00Z")
    table.write(earlier, first.table_path)  # as if the first run were long ago
    again = stages.run_sweep(settings(tmp_path), say=said.append)
    assert said[-1].startswith("resuming") and again.result.resumed == 2 and again.result.ran == 0
    assert set(table.read(again.table_path)["created_utc"]) == {"2020-01-01T00:00:00Z"}
    fresh = stages.run_sweep(settings(tmp_path, fresh=True), say=said.append)
    assert said[-1].startswith("starting over") and fresh.result.ran == 2


def test_results_of_a_route_not_registered_here_write_no_table(tmp_path):
    """A journal line naming a route this process does not know (damage, or a plugin not
    loaded) is named, not folded into a table row."""
    import json

    first = stages.run_sweep(settings(tmp_path))
    journal = tmp_path / "t.journal.jsonl"
    lines = journal.read_text().splitlines()
    stray = {**json.loads(lines[-1]), "id": "stray", "route": "nope/none"}
    journal.write_text("\n".join([*lines, json.dumps(stray)]) + "\n")
    first.table_path.unlink()
    with pytest.raises(stages.SweepError, match="holds results of 'nope/none', not a "
                                                "registered route here"):
        stages.run_sweep(settings(tmp_path))
    assert not first.table_path.exists()


def test_an_interrupted_sweep_is_one_line_that_says_how_to_go_on(tmp_path, monkeypatch):
    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(runner, "run", interrupted)
    with pytest.raises(stages.SweepError, match="interrupted; finished candidates are in"):
        stages.run_sweep(settings(tmp_path))
    assert not (tmp_path / "t.parquet").exists()


def test_a_journal_removed_during_the_sweep_writes_no_table(tmp_path, monkeypatch):
    """Its folder deleted mid-run: the sweep fails, naming the journal, and writes no table
    (one without its journal would refuse the rerun); the rerun measures again."""
    run = runner.run

    def removing(spec, device, journal, **kwargs):
        result = run(spec, device, journal, **kwargs)
        journal.path.unlink()
        return result

    monkeypatch.setattr(runner, "run", removing)
    with pytest.raises(stages.SweepError, match=r"the journal .* was removed during the sweep"):
        stages.run_sweep(settings(tmp_path))
    assert not (tmp_path / "t.parquet").exists()
    monkeypatch.setattr(runner, "run", run)
    assert stages.run_sweep(settings(tmp_path)).table_path.exists()  # the rerun measures


def test_a_share_without_problems_is_refused(tmp_path):
    many = Shard(0, 10_000)
    with pytest.raises(stages.SweepError, match="holds none of the spec's 2 problems"):
        stages.run_sweep(settings(tmp_path, shard=many))


def test_the_header_carries_given_figures_or_measures_a_gpu_here(tmp_path, monkeypatch):
    from mlatune import hardware
    from mlatune.arch import DeviceInfo

    h100 = DeviceInfo("sm_90", "NVIDIA H100 80GB HBM3", "nvidia", 132, 80 * 2**30, 0)
    given = hardware.described(h100.name, h100.arch, h100.cu_count)
    measured = []
    monkeypatch.setattr(hardware, "measure_bandwidth",
                        lambda device: measured.append(device) or 2981.0)
    header = settings(tmp_path, device=h100, figures=given).header()
    assert hardware.Hardware.from_json(header.hardware) == given and measured == []
    monkeypatch.setattr(hardware, "of_device", lambda device, gbs: given)
    assert settings(tmp_path, device=h100).header().hardware == given.as_json()
    assert measured == [h100]  # None: a GPU's figures measured here
    assert settings(tmp_path).header().hardware is None  # the CPU has none
