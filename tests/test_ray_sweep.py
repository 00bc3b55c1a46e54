"""`mlatune sweep --ray` on a local Ray cluster with fake GPUs (marked ``ray``: `pytest -m ray`
with mlatune[ray] installed): the local pool's table row for row, GPU models routed to their
own tables, a worker killed mid-sweep (its candidate marked crashed, or given to another
worker when its node died), a driver killed and resumed. One cluster for them all: a head
without GPUs, a node of two fake "H100" GPUs and one of a fake "H200" (Ray's
``accelerator_type:<model>`` resources). Without Ray: the one line, and no import of it."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from mlatune import table
from mlatune.cli import app
from mlatune.measure.records import Status
from mlatune.sweep import ray_pool, runner, spec
from mlatune.sweep.journal import Journal, read
from tests.test_killed_worker import plugins  # noqa: F401  (fault routes, in workers too)
from tests.test_runner import header

ROOT = Path(__file__).resolve().parent.parent
# A small CPU sweep: Triton decode routes in the interpreter and torch's SDPA prefill.
SMALL = """name = "ray-small"
routes = ["padded/triton", "gluon/triton", "sdpa/torch"]
max_params_per_route = 1
[budget]
warmup = 0
min_reps = 2
max_reps = 2
[[grid]]
phase = "decode"
num_heads = 8
qlen = [1, 2]
q_dtype = "fp16"
kv_dtype = "fp16"
batch = 2
kv_len = 96
page_size = 64
[[grid]]
phase = "prefill"
num_heads = 16
q_dtype = "fp16"
kv_dtype = "fp16"
qlen = 32
kv_len = 32
batch = 1
page_size = 1
"""
# Columns of timings, of what follows from them (a route's rank at its problem) and of when
# the table was written: the rest must match row for row.
TIMINGS = {"time_us", "time_us_p20", "time_us_p80", "tb_per_s", "tflops", "plan_us",
           "plan_host_us", "launch_host_us", "reps", "raced", "rank", "created_utc"}


@pytest.fixture(scope="module")
def cluster():
    ray = pytest.importorskip("ray")
    from ray.cluster_utils import Cluster

    with pytest.MonkeyPatch.context() as env:
        env.setenv("PYTHONPATH", str(ROOT))  # the workers import tests.fault_routes
        env.setenv("TRITON_INTERPRET", "1")
        env.delenv("RAY_ADDRESS", raising=False)
        small = {"num_cpus": 1, "object_store_memory": 10**8}  # results are small
        nodes = Cluster(initialize_head=True, connect=True,
                        head_node_args={**small, "include_dashboard": False})
        nodes.add_node(**small, num_gpus=2, resources={"accelerator_type:H100": 1})
        nodes.add_node(**small, num_gpus=1, resources={"accelerator_type:H200": 1})
        nodes.wait_for_nodes()
        yield nodes
        ray.shutdown()
        nodes.shutdown()


def sweep(*args) -> str:
    result = CliRunner().invoke(app, ["sweep", *map(str, args)])
    assert result.exit_code == 0, result.output
    return result.stdout


def rows(path: Path):
    frame = table.read(path)
    keep = sorted(c for c in frame.columns if c not in TIMINGS)
    return frame[keep].sort_values(["route", *sorted(c for c in keep if c != "route")]) \
        .reset_index(drop=True)


@pytest.mark.ray
def test_each_gpu_model_gets_the_local_pools_table(cluster, tmp_path):
    spec_file = tmp_path / "small.toml"
    spec_file.write_text(SMALL)
    sweep(spec_file, "--out", tmp_path / "local.parquet")
    document = json.loads(sweep(spec_file, "--gpu-model", "H100,H200", "--out",
                                tmp_path / "ray.parquet", "--json"))
    assert [Path(s["table"]).name for s in document["sweeps"]] == ["ray-h100.parquet",
                                                                   "ray-h200.parquet"]
    local = rows(tmp_path / "local.parquet")
    assert set(local.status) == {"ok", "unsupported"} and sum(local.status == "ok") >= 4
    nodes = {model: n["NodeID"][:8] for n in ray_pool.ray.nodes() for model in ("H100", "H200")
             if f"accelerator_type:{model}" in n["Resources"]}
    for model in ("h100", "h200"):
        assert rows(tmp_path / f"ray-{model}.parquet").equals(local), model
        ran_on = {r["device"].split()[0].split("/")[1]
                  for r in read(tmp_path / f"ray-{model}.journal.jsonl")[1] if "device" in r}
        assert ran_on == {nodes[model.upper()]}


@pytest.mark.ray
def test_a_cluster_of_several_models_needs_them_named_and_their_arch_checked(cluster, tmp_path):
    result = CliRunner().invoke(app, ["sweep", "smoke", "--ray", "--out", tmp_path / "t.parquet"])
    assert result.exit_code == 1
    assert "several models (H100 x2, H200 x1): name them with --gpu-model" in result.output
    result = CliRunner().invoke(app, ["sweep", "smoke", "--gpu-model", "A100"])
    assert result.exit_code == 1 and "no GPU of model A100" in result.output
    result = CliRunner().invoke(app, ["sweep", "smoke", "--gpu-model", "H100", "--arch", "sm_90"])
    assert result.exit_code == 1
    assert "--arch sm_90 but the Ray workers' GPUs are cpu" in result.output


def _hanging(tmp_path: Path, model: str, kill, batches=(1, 2)
             ) -> tuple[runner.SweepResult, list]:
    """Problems of the hanging route (one a batch size) on the workers of ``model``, 3 s
    timeout; once every worker hangs, ``kill(worker)`` of the one holding a candidate queued
    ahead, else of the one furthest from its timeout."""
    (target,) = ray_pool.targets([model])
    pools: list[ray_pool.RayPool] = []

    def pool(*args, **kwargs):
        pools.append(ray_pool.RayPool(target, *args, **kwargs))
        return pools[-1]

    def kill_once_all_hang():
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            slots = pools[-1]._slots if pools else []
            if (len(slots) == target.gpus
                    and all(s.awaiting == "result" and s.candidate for s in slots)):
                time.sleep(0.3)
                kill(max(slots, key=lambda s: (s.process._ahead is not None, s.deadline))
                     .process)
                return
            time.sleep(0.05)

    small = spec.parse({"routes": ["fault-hang/test"], "grid": [
        {"num_heads": 2, "batch": list(batches), "kv_len": 24, "page_size": 8,
         "q_dtype": "fp16", "kv_dtype": "fp16"}]}, "hang.toml")
    killer = threading.Thread(target=kill_once_all_hang, daemon=True)
    journal = Journal(tmp_path / "j.jsonl", header(), resume=False)
    token = runner.POOL.set(pool)
    try:
        killer.start()
        result = runner.run(small, target.device, journal, timeout_s=3)
    finally:
        runner.POOL.reset(token)
        journal.close()
    return result, pools


def _sigkill(worker: ray_pool.RayWorkerProcess) -> None:
    assert worker.pid > 0  # os.kill(0) would signal this whole process group
    os.kill(worker.pid, signal.SIGKILL)


@pytest.mark.ray
@pytest.mark.usefixtures("plugins")
def test_a_worker_killed_mid_sweep_marks_its_candidate_crashed(cluster, tmp_path):
    result, _ = _hanging(tmp_path, "H100", _sigkill)
    by_status = sorted((r.status.value, r.reason.split(":")[0]) for r in result.records)
    assert by_status == [("crashed", "Ray worker died"),
                         ("timeout", "no result within the 3s timeout")]


@pytest.mark.ray
@pytest.mark.usefixtures("plugins")
def test_the_candidate_a_killed_worker_held_ahead_goes_to_the_next_worker(cluster, tmp_path):
    held = []

    def kill(worker):
        held.append(worker._ahead[0].problem.batch if worker._ahead else None)
        _sigkill(worker)

    # One GPU: the second problem waits on the actor behind the first, never started.
    result, _ = _hanging(tmp_path, "H200", kill)
    assert held == [2]
    assert [(r.key["batch"], r.status) for r in result.records] == [
        (1, Status.CRASHED), (2, Status.TIMEOUT)]


@pytest.mark.ray
@pytest.mark.usefixtures("plugins")
def test_a_candidate_whose_node_died_goes_to_another_worker_once(cluster, tmp_path):
    nodes = [cluster.add_node(num_cpus=1, num_gpus=1, object_store_memory=10**8,
                              resources={"accelerator_type:A10": 1}) for _ in range(2)]
    cluster.wait_for_nodes()
    held = []

    def kill(worker):
        held.append(worker._ahead is not None)
        node = next(n for n in nodes if n.node_id == worker.node_id)
        cluster.remove_node(node)  # its raylet stops: Ray declares the node dead at once
        nodes.remove(node)

    try:
        result, pools = _hanging(tmp_path, "A10", kill, batches=(1, 2, 3))
    finally:
        for node in nodes:
            cluster.remove_node(node)
    # All ran to their timeout on the node left, the one the dead node's worker held queued
    # ahead too; that worker was not replaced.
    assert held == [True]
    assert [r.status for r in result.records] == [Status.TIMEOUT] * 3
    assert len({r.id for r in result.records}) == 3 and len(pools[-1]._slots) == 1


@pytest.mark.ray
def test_a_killed_driver_resumes_losing_no_row_and_duplicating_none(cluster, tmp_path):
    spec_file = tmp_path / "slow.toml"
    spec_file.write_text('routes = ["fault-slow/test", "reference/torch"]\n[budget]\n'
                         'warmup = 0\nmin_reps = 1\nmax_reps = 1\n[[grid]]\nnum_heads = 2\n'
                         'batch = [1, 2, 3]\nkv_len = [16, 32]\npage_size = 8\n'
                         'q_dtype = "fp16"\nkv_dtype = "fp16"\n')
    out = tmp_path / "t.parquet"
    journal = tmp_path / "t.journal.jsonl"
    command = [sys.executable, "-m", "mlatune", "sweep", str(spec_file), "--out", str(out),
               "--ray-address", cluster.address, "--gpu-model", "H100"]
    env = {**os.environ, "MLATUNE_PLUGINS": "tests.fault_routes", "PYTHONPATH": str(ROOT)}
    log = tmp_path / "killed.log"
    driver = subprocess.Popen(command, env=env, cwd=ROOT, stdout=log.open("w"),
                              stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and driver.poll() is None:
        if journal.exists() and len(read(journal)[1]) >= 3:
            break
        time.sleep(0.05)
    driver.send_signal(signal.SIGKILL)
    driver.wait()
    before = [r["id"] for r in read(journal)[1]]
    assert 3 <= len(before) < 12, log.read_text()
    resumed = subprocess.run([*command, "--resume"], env=env, cwd=ROOT, capture_output=True,
                             text=True)
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    after = [r["id"] for r in read(journal)[1]]
    assert len(after) == len(set(after)) == 12 and set(before) <= set(after)
    assert all(r["status"] == "ok" for r in read(journal)[1])


def test_without_ray_one_line_says_what_to_install(tmp_path):
    code = ("import sys; sys.modules['ray'] = None; from mlatune.entry import main; "
            f"sys.argv = ['mlatune', 'sweep', 'smoke', '--ray', '--out', "
            f"{str(tmp_path / 't.parquet')!r}]; main()")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                          text=True, env={**os.environ, "COLUMNS": "200"})
    assert done.returncode == 1
    assert done.stderr.strip().splitlines() == [
        "error: --ray needs Ray on this machine and every node: pip install 'mlatune[ray]'"]
    assert not (tmp_path / "t.journal.jsonl").exists()


def test_importing_mlatune_and_its_cli_imports_no_ray():
    code = ("import sys, mlatune, mlatune.sweep, mlatune.sweep.runner, mlatune.cli.sweep; "
            "print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] == 'ray')))")
    done = subprocess.run([sys.executable, "-c", "import json; " + code], cwd=ROOT,
                          capture_output=True, text=True, check=True)
    assert json.loads(done.stdout) == []
