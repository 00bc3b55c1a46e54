"""benchmarks/sweep_cost.py's per-device busy time."""

import importlib.util
from pathlib import Path

_path = Path(__file__).parent.parent / "benchmarks" / "sweep_cost.py"
_spec = importlib.util.spec_from_file_location("sweep_cost", _path)
sweep_cost = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(sweep_cost)


def test_busy_counts_work_over_time_in_use_without_pauses():
    def rec(device, start, elapsed):
        return {"device": device, "finished_at": start + elapsed, "elapsed_s": elapsed}

    records = [rec("cuda:0", 0, 2), rec("cuda:0", 3, 1),  # 3 s of work in 4 s
               rec("cuda:0", 500, 2),  # after a pause (a resumed call): 2 s more in use
               rec("cuda:1", 0, 5), {"status": "ok"}]  # a record from before the fields
    busy = sweep_cost.busy(records)
    assert busy["cuda:0"] == (3, 5.0, 6.0)
    assert busy["cuda:1"] == (1, 5.0, 5.0)
