"""The DCP step captured in a CUDA graph under NCCL (``mlatune.sweep.dcp_graph``), one rank:
the replay checked against the unsharded reference in both schemes, again after new
queries are written in place, and the DCP stage's graph-timed measurement of a task.

Run on a GPU machine: ``python -m pytest -m gpu tests/test_dcp_graph_gpu.py``. The group
is this test process alone (world size 1, a FileStore), so one GPU is enough; NCCL runs
its collectives (all-gather, reduce-scatter, all-to-all) over the one rank.
"""

from __future__ import annotations

from dataclasses import asdict, replace

import pytest
import torch
import torch.distributed as dist

from mlatune import routes
from mlatune.arch import current_device
from mlatune.check import reference
from mlatune.check.accuracy import check
from mlatune.check.inputs import make_decode_inputs
from mlatune.dcp import SCHEMES, prepare_dcp_step
from mlatune.measure.records import Record
from mlatune.measure.timers import Budget
from mlatune.problem import MLAProblem
from mlatune.sweep import dcp_graph, dcp_group
from mlatune.sweep.dcp_stage import DcpTask, Settings
from mlatune.sweep.runner import Candidate

pytestmark = pytest.mark.gpu

ROUTE = "padded/triton"  # returns an LSE, and its launch is graph-safe
PROBLEM = MLAProblem(num_heads=16, qlen=1, batch=4, kv_len=1024, dcp_size=1, q_dtype="bf16",
                     kv_dtype="bf16", page_size=64)


@pytest.fixture(scope="module")
def nccl_group(tmp_path_factory):
    torch.cuda.set_device(0)
    store = dist.FileStore(str(tmp_path_factory.mktemp("nccl") / "store"), 1)
    dist.init_process_group("nccl", store=store, rank=0, world_size=1)
    yield torch.device("cuda", 0)
    dist.destroy_process_group()


@pytest.mark.parametrize("scheme", SCHEMES)
def test_the_replayed_step_matches_the_reference(nccl_group, scheme):
    assert dcp_graph.refusal(nccl_group) == ""
    inputs = make_decode_inputs(PROBLEM, seed=11, device=nccl_group, ragged=True)
    q_local = inputs.q.clone()
    step = prepare_dcp_step(routes.get(ROUTE), PROBLEM, q_local, inputs.shards[0],
                            inputs.seq_lens, scheme=scheme)
    step()  # eager first: the communicator and the route's compile, before capture
    assert dcp_graph.capturable(step)
    graph = dcp_graph.capture(lambda: step(plan=False))
    step.out.fill_(float("nan"))
    step.lse.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    want_out, want_lse = reference.run(inputs, torch.float64)
    accuracy = check(PROBLEM, step.out, want_out, step.lse, want_lse)
    assert accuracy.ok, accuracy.reason
    # The next step's queries, written in place: the same graph serves them.
    q_local.copy_((q_local.float() * 0.5).to(q_local.dtype))
    graph.replay()
    torch.cuda.synchronize()
    halved = replace(inputs, q=q_local.clone())
    again = check(PROBLEM, step.out, reference.run(halved, torch.float64)[0])
    assert again.ok, again.reason
    assert dcp_graph.time_replay(graph, nccl_group, reps=5, warmup=1) > 0


@pytest.mark.parametrize("scheme", SCHEMES)
def test_the_stage_times_a_task_from_its_graph(nccl_group, scheme):
    params = routes.get(ROUTE).param_space(PROBLEM, current_device())[0]
    task = DcpTask(Candidate(PROBLEM, ROUTE, params), scheme, {"simulated_us": 1.0})
    settings = Settings(seed=0, budget=asdict(Budget()), tolerances={}, graph=True)
    records: list[Record] = []
    dcp_group.run_tasks([task], settings, nccl_group, lambda event: None, records.append)
    (record,) = records
    assert record.status == "ok", record.reason
    assert record.timer == dcp_graph.GRAPH_TIMER
    assert record.time_us > 0 and record.comm_us >= 0
    assert record.dcp_timing == "measured" and record.dcp_scheme == scheme
    # Eager, the same task says so.
    eager: list[Record] = []
    dcp_group.run_tasks([task], Settings(seed=0, budget=asdict(Budget()), tolerances={}),
                        nccl_group, lambda event: None, eager.append)
    assert eager[0].status == "ok" and eager[0].timer == "cuda_event"
