"""A table measured on another GPU model: served with a warning (the default) or refused by
name (``other_gpu="refuse"`` / ``MLATUNE_OTHER_GPU=refuse``); the bundled table gives way to
the rules rather than failing a model load."""

from __future__ import annotations

import pytest

from mlatune import table
from mlatune.arch import DeviceInfo
from mlatune.dispatch import Dispatcher, bundled
from mlatune.dispatch.loading import OTHER_GPU_ENV, TABLE_ENV
from mlatune.errors import SettingError, TableError
from mlatune.problem import MLAProblem
from tests.table_helpers import H200, make_table, result_row

H100 = DeviceInfo("sm_90", "NVIDIA H100 80GB HBM3", "nvidia", 132, 80 * 2**30, 0)
PROBLEM = MLAProblem(num_heads=16, batch=4, kv_len=1024)


@pytest.fixture
def h200_table(tmp_path, monkeypatch):
    monkeypatch.delenv(OTHER_GPU_ENV, raising=False)
    monkeypatch.delenv(TABLE_ENV, raising=False)
    return table.write(make_table([result_row(PROBLEM, "padded/triton", 5.0, device=H200)]),
                       tmp_path / "sm_90-h200.parquet")


def test_another_model_is_used_by_default_and_refused_when_asked(h200_table, monkeypatch):
    assert Dispatcher.load(h200_table, device=H100).table_device[1] == "NVIDIA H200"
    assert Dispatcher.load(h200_table, device=H200, other_gpu="refuse").source
    with pytest.raises(TableError, match=r"measured on NVIDIA H200, this GPU is NVIDIA H100 "
                                         r"80GB HBM3 \(MLATUNE_OTHER_GPU=refuse\)"):
        Dispatcher.load(h200_table, device=H100, other_gpu="refuse")
    monkeypatch.setenv(OTHER_GPU_ENV, "REFUSE")
    with pytest.raises(TableError, match="this GPU is NVIDIA H100"):
        Dispatcher.load(h200_table, device=H100)
    # Planning for an arch this machine lacks compares no GPU model.
    assert Dispatcher.load(h200_table, device=DeviceInfo("cpu", "x86_64", "cpu", 2, 0, -1),
                           allow_arch="sm_90").source


def test_the_bundled_table_gives_way_to_the_rules(h200_table, monkeypatch):
    monkeypatch.setattr(bundled, "bundled_tables_dir", lambda: h200_table.parent)
    monkeypatch.setenv(OTHER_GPU_ENV, "refuse")
    d = Dispatcher.from_bundled(H100)
    assert d.source == "" and d.select(PROBLEM).source == "rule"


def test_a_bad_value_names_where_it_came_from(h200_table, monkeypatch):
    with pytest.raises(ValueError, match=r"^other_gpu: 'guess' is not one of use, transfer, "
                                         r"refuse"):
        Dispatcher.load(h200_table, device=H100, other_gpu="guess")
    monkeypatch.setenv(OTHER_GPU_ENV, "maybe")
    with pytest.raises(SettingError, match=rf"^{OTHER_GPU_ENV}: 'maybe' is not one of"):
        Dispatcher.load(h200_table, device=H100)


def test_a_bad_setting_is_raised_by_from_bundled_too(h200_table, monkeypatch):
    monkeypatch.setattr(bundled, "bundled_tables_dir", lambda: h200_table.parent)
    monkeypatch.setenv(OTHER_GPU_ENV, "maybe")
    with pytest.raises(SettingError):
        Dispatcher.from_bundled(H100)
