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
