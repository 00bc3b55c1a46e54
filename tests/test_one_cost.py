"""One cost decides which route wins: the table's ranking and the dispatcher agree."""

import json

import pytest

from mlatune import routes, table
from mlatune.check.policy import policy_named
from mlatune.dispatch import Dispatcher, device_for_arch
from mlatune.dispatch.admission import admitted_table
from mlatune.dispatch.dispatcher import bundled_tables_dir, registered_routes
from mlatune.problem import MLAProblem
from mlatune.table.cost import DEFAULT_CALLER, Caller, step_cost

CALLERS = [DEFAULT_CALLER, Caller(capturable=True), Caller(plan_calls=1)]


@pytest.fixture(scope="module")
def shipped():
    path = bundled_tables_dir() / "sm_90-h200.parquet"
    return path, table.read(path, facts=routes.FACTS)


@pytest.mark.parametrize("accuracy", ["fast", "strict"])
@pytest.mark.parametrize("caller", CALLERS, ids=["eager", "capturable", "per-call"])
def test_the_tables_first_row_is_what_select_serves_for_every_measured_problem(shipped, caller,
                                                                              accuracy):
    """The first row per problem among the rows an accuracy policy serves (every ok row:
    ``fast``; the stored ranks are its) is what select serves under that policy."""
    path, frame = shipped
    device = device_for_arch("sm_90", "NVIDIA H200", 132)
    dispatcher = Dispatcher.load(path, device=device, allow_arch="sm_90",
                                 capturable=caller.capturable, plan_calls=caller.plan_calls,
                                 accuracy=accuracy)
    served = admitted_table(frame, policy_named(accuracy), registered_routes())
    firsts = table.winners(served, caller, routes.plan_sharing())
    assert len(firsts) > 2000
    served = [dispatcher.select(MLAProblem.from_key(key)) for key in table.key_strings(firsts)]
    pairs = zip(served, firsts["route"], firsts["route_params"], strict=True)
    differ = [(c.route_id, dict(c.params), route, params) for c, route, params in pairs
              if (c.route_id, dict(c.params)) != (route, json.loads(params))]
    assert differ == []
    assert {c.source for c in served} == {"table"}


def test_a_host_plan_costs_an_eager_caller_unless_shared():
    assert step_cost(10.0, "host", 0.0, 61.0, capturable=False) == 71.0
    assert step_cost(10.0, "host", 0.0, 61.0, capturable=False, shares_host_plan=True) == 11.0
    assert step_cost(10.0, "host", 0.0, 61.0, capturable=True) == 10.0
    assert step_cost(10.0, "device", 122.0, 5.0, capturable=False) == 12.0
    assert step_cost(10.0, "device", 122.0, 5.0, capturable=False, plan_calls=1) == 132.0


def test_the_stored_rank_is_the_default_callers(shipped):
    _, frame = shipped
    again = table.assign_ranks(frame, DEFAULT_CALLER, routes.plan_sharing())
    assert (again["rank"].to_numpy() == frame["rank"].to_numpy()).all()


def test_show_lookup_and_select_name_the_same_route_for_every_measured_problem(shipped):
    """`mlatune show`'s winner at every measured problem of the shipped table is what select
    serves (the default caller), and `mlatune lookup` says so too (a sample)."""
    from typer.testing import CliRunner

    from mlatune.cli import app

    path, _ = shipped
    runner = CliRunner()
    shown = runner.invoke(app, ["show", str(path), "--json"])
    assert shown.exit_code == 0, shown.output
    problems = json.loads(shown.stdout)["problems"]
    assert len(problems) > 2000
    device = device_for_arch("sm_90", "NVIDIA H200", 132)
    dispatcher = Dispatcher.load(path, device=device, allow_arch="sm_90")
    differ = []
    for row in problems:
        choice = dispatcher.select(MLAProblem.from_key_dict(row["problem"]))
        if (choice.route_id, dict(choice.params)) != (row["winner"], row["winner_params"]):
            differ.append((row["problem"], row["winner"], choice.route_id))
    assert differ == []
    for row in problems[::600]:
        p = row["problem"]
        asked = runner.invoke(app, [
            "lookup", str(path), "--heads", str(p["num_heads"]), "--batch", str(p["batch"]),
            "--kv-len", str(p["kv_len"]), "--qlen", str(p["qlen"]), "--q-dtype", p["q_dtype"],
            "--kv-dtype", p["kv_dtype"], "--dcp", str(p["dcp_size"]), "--page-size",
            str(p["page_size"]), "--phase", p["phase"],
            "--causal" if p["causal"] else "--no-causal", "--arch", "sm_90", "--json"])
        assert asked.exit_code == 0, asked.output
        answer = json.loads(asked.stdout)
        assert (answer["route"], answer["params"]) == (row["winner"], row["winner_params"])
