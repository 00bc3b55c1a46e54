from typer.testing import CliRunner

import mlatune
from mlatune.cli import app

runner = CliRunner()


def test_version():
    result = runner.invoke(app, ["--version"])
    assert result.exit_code == 0 and mlatune.__version__ in result.output


def test_doctor_on_this_machine():
    result = runner.invoke(app, ["doctor"])
    assert result.exit_code == 0, result.output
    assert "torch" in result.output and "reference/torch" in result.output
    import torch

    if not torch.cuda.is_available():
        assert "no GPU" in result.output
        assert "dispatch table here: none" in result.output  # no table ships for the CPU


def test_doctor_names_the_table_the_dispatcher_loads(tmp_path, monkeypatch):
    from mlatune import table
    from mlatune.arch import current_device, units_text
    from mlatune.problem import MLAProblem
    from tests.table_helpers import make_table, result_row

    device = current_device()
    path = table.write(make_table([result_row(MLAProblem(), "reference/torch", 5.0,
                                              device=device)]), tmp_path / "t.parquet")
    monkeypatch.setenv("MLATUNE_TABLE", str(path))
    monkeypatch.delenv("MLATUNE_ACCURACY", raising=False)
    result = CliRunner(env={"COLUMNS": "400"}).invoke(app, ["doctor"])
    assert result.exit_code == 0 and f"dispatch table here: {path}" in result.output
    assert f"measured on {device.arch} {device.name} ({units_text(device.arch, device.cu_count)})" \
        in result.output
    assert "accuracy policy strict" in result.output
    monkeypatch.setenv("MLATUNE_ACCURACY", "fast")
    result = CliRunner(env={"COLUMNS": "400"}).invoke(app, ["doctor", "--json"])
    import json

    here = json.loads(result.stdout)["dispatch_table"]
    assert (here["accuracy"], here["measured_on"]["device_name"]) == ("fast", device.name)


def test_doctor_reports_an_unusable_table_without_a_traceback(tmp_path, monkeypatch):
    monkeypatch.setenv("MLATUNE_TABLE", str(tmp_path / "absent.parquet"))
    result = CliRunner(env={"COLUMNS": "400"}).invoke(app, ["doctor"])
    assert result.exit_code == 0 and result.exception is None
    assert "dispatch table here: unusable" in result.output and "absent.parquet" in result.output
