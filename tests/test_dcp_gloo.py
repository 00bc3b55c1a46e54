"""The DCP step across processes (``mlatune.dcp``), on the CPU with gloo: 2, 4 and 8 ranks,
both combining schemes, each rank's heads checked against the unsharded reference."""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path

import pytest

from mlatune.problem import MLAProblem
from tests import processes


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank(rank: int, world: int, port: int, route_id: str, problem_kw: dict, scheme: str,
          out_dir: str) -> None:
    import torch
    import torch.distributed as dist

    from mlatune import routes
    from mlatune.check import reference
    from mlatune.check.accuracy import check
    from mlatune.check.inputs import make_decode_inputs
    from mlatune.dcp import prepare_dcp_step

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        problem = MLAProblem(**problem_kw)
        inputs = make_decode_inputs(problem, seed=5, ragged=True)  # the same on every rank
        h = problem.num_heads
        q_local = inputs.q[:, rank * h:(rank + 1) * h].contiguous()
        step = prepare_dcp_step(routes.get(route_id), problem, q_local, inputs.shards[rank],
                                inputs.seq_lens, scheme=scheme, q_scale=inputs.q_scale,
                                kv_scale=inputs.kv_scale)
        out, lse = step()
        want_out, want_lse = reference.run(inputs, torch.float64)
        mine = slice(rank * h, (rank + 1) * h)
        accuracy = check(problem, out, want_out[:, mine], lse, want_lse[:, mine])
        q_local.copy_((q_local.float() * 0.5).to(q_local.dtype))  # the next step's queries
        out2, _ = step()
        scaled = reference.run(_halved(inputs), torch.float64)[0]
        again = check(problem, out2, scaled[:, mine])
        result = {"ok": accuracy.ok, "reason": accuracy.reason, "again": again.ok}
    except Exception as exc:  # reported to the test, which fails with it
        result = {"ok": False, "reason": f"{type(exc).__name__}: {exc}", "again": False}
    finally:
        dist.destroy_process_group()
    Path(out_dir, f"rank-{rank}.json").write_text(json.dumps(result))


def _halved(inputs):
    from dataclasses import replace

    return replace(inputs, q=(inputs.q.float() * 0.5).to(inputs.q.dtype))


@pytest.mark.parametrize(("world", "scheme", "route_id", "problem_kw"), [
    (2, "ag_rs", "reference/torch", dict(num_heads=2, qlen=1, batch=3, kv_len=40,
                                         page_size=8, q_dtype="fp16", kv_dtype="fp16")),
    (2, "a2a", "padded/triton", dict(num_heads=4, qlen=1, batch=2, kv_len=33, page_size=4,
                                     q_dtype="fp16", kv_dtype="fp16")),
    (4, "a2a", "reference/torch", dict(num_heads=2, qlen=2, batch=2, kv_len=37,
                                       page_size=4, kv_dtype="fp8_e4m3fn",
                                       q_dtype="fp8_e4m3fn", causal=False)),
    (4, "ag_rs", "reference/torch", dict(num_heads=1, qlen=1, batch=3, kv_len=9,
                                         page_size=1, q_dtype="fp16", kv_dtype="fp16")),
    (8, "a2a", "reference/torch", dict(num_heads=2, qlen=1, batch=2, kv_len=21,
                                       page_size=4, q_dtype="fp16", kv_dtype="fp16")),
], ids=["2-ag_rs", "2-a2a-triton", "4-a2a-fp8-verify", "4-ag_rs-page1", "8-a2a"])
def test_every_rank_gets_its_heads_over_the_whole_kv(tmp_path, world, scheme, route_id,
                                                     problem_kw):
    problem_kw = {**problem_kw, "dcp_size": world}
    processes.spawn("tests.test_dcp_gloo:_rank",
                    (world, _free_port(), route_id, problem_kw, scheme, str(tmp_path)), world)
    for rank in range(world):
        result = json.loads((tmp_path / f"rank-{rank}.json").read_text())
        assert result["ok"] and result["again"], f"rank {rank}: {result['reason']}"


def test_an_unknown_scheme_is_refused_before_any_collective():

    from mlatune import routes
    from mlatune.check.inputs import make_decode_inputs
    from mlatune.dcp import prepare_dcp_step

    problem = MLAProblem(num_heads=2, batch=1, kv_len=8, page_size=4, dcp_size=2)
    inputs = make_decode_inputs(problem, seed=1)
    with pytest.raises(ValueError, match="scheme must be one of"):
        prepare_dcp_step(routes.get("reference/torch"), problem, inputs.q[:, :2],
                         inputs.shards[0], inputs.seq_lens, scheme="ring")
