"""Commands that read tables: show, lookup, validate, diff.

``show --json``: ``table``, ``devices``, ``rows`` (the table's), ``problems``: every problem
(``--limit`` shapes the printed table only) as {"device", "problem", "winner",
"winner_params", "winner_us", "runner_up", "runner_up_us", "margin", "routes",
"ok_routes"}; margin = runner-up time / winner time - 1; no ok row: winner null.

``lookup --json``: ``table`` (null: rules only), ``table_device``, ``problem``, ``key``,
``route``, ``params``, ``source`` (table, predicted, nearest or rule), ``measured_key``
(null for a rule), ``time_us``, ``why`` (lines), ``skipped_routes`` ({route: rows}).

``validate --json``: ``table``, ``ok``; when ok, ``format`` ("table" or "winners map"),
``schema_version``, ``converted_from`` (the older schemas of its rows), ``rows``
(null for a winners map), ``problems``, ``devices``, ``unregistered_routes``; when not,
``error`` (also on stderr; exit 1).

``diff --json``: ``a``, ``b``, ``devices``: {"a", "b", "common"}, ``comparable`` (a device in
common), ``counts``: {"same", "changed", "only_a", "only_b"}, ``changed``: every changed
winner as {"device", "problem", "a", "b", "change"}, with "a" and "b" {"route", "params",
"time_us"} and change = B's time / A's - 1.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.table import Table

from mlatune.cli import frames
from mlatune.cli.app import (
    JsonFlag,
    app,
    console,
    device_json,
    emit_json,
    error_text,
    fail,
    note,
    num,
    one_line_errors,
)
from mlatune.cli.inputs import (
    AccuracyOption,
    ArchOption,
    Dtype,
    LimitOption,
    Phase,
    load_dispatcher,
    table_argument,
    value,
)

if TYPE_CHECKING:
    import pandas as pd

    from mlatune.dispatch import Choice, Dispatcher
    from mlatune.problem import MLAProblem


@app.command()
def show(
    table_path: Annotated[Path, table_argument("Parquet or CSV table.")],
    limit: LimitOption = 50,
    accuracy: AccuracyOption = None,
    json_out: JsonFlag = False,
) -> None:
    """Per problem: the winning route, the runner-up and the margin between them, among the
    rows the accuracy policy serves (as `lookup` and the dispatcher answer)."""
    from mlatune import routes, table
    from mlatune.check.policy import policy_named

    with one_line_errors(str(table_path)):
        frame = frames.read_table(table_path)
        policy = policy_named(value(accuracy))
        served = frames.for_policy(frame, policy.name)
        rows = table.summary(served, sharing=routes.plan_sharing())
    held = len(frame) - len(served)
    if json_out:
        emit_json("show", {"table": str(table_path), "accuracy": policy.name, "held_back": held,
                           "devices": [device_json(*d) for d in frames.devices(frame)],
                           "rows": len(frame),
                           "problems": [_show_entry(r) for _, r in rows.iterrows()]})
        frames.warn_unregistered(frame)
        return
    devices, several = frames.devices_title(frame)
    out = Table(title=f"{table_path}: {devices}, {len(rows)} problems, {len(frame)} rows; "
                      f"accuracy {policy.name} held back {held}")
    frames.columns(out, ("problem", "batch", "kv_len", "winner", "us", "runner-up", "us",
                         "margin"), ("batch", "kv_len", "us", "margin"))
    shown = rows if limit <= 0 else rows.head(limit)
    for label, row, starts in frames.grouped(shown, several):
        if starts and out.row_count:
            out.add_section()
        margin = "-" if row["margin"] != row["margin"] else f"+{row['margin'] * 100:.1f}%"
        winner = row["winner"] or f"[red]none ok[/] ({row['routes']} tried)"
        out.add_row(label, str(row["batch"]), str(row["kv_len"]), winner,
                    frames.us(row["winner_us"]), row["runner_up"] or "-",
                    frames.us(row["runner_up_us"]), margin)
    console().print(out)
    if len(shown) < len(rows):
        console().print(f"... {len(rows) - len(shown)} more (--limit 0 shows all)")
    frames.warn_unregistered(frame)


def _show_entry(row: pd.Series) -> dict[str, Any]:
    """One problem of `show --json`: margin is the runner-up's time / the winner's - 1."""
    return {"device": device_json(row["arch"], row["device_name"], row["cu_count"]),
            "problem": frames.row_problem(row),
            "winner": row["winner"] or None,
            "winner_params": json.loads(row["winner_params"]) if row["winner"] else None,
            "winner_us": num(row["winner_us"]),
            "runner_up": row["runner_up"] or None,
            "runner_up_us": num(row["runner_up_us"]),
            "margin": num(row["margin"]),
            "routes": int(row["routes"]), "ok_routes": int(row["ok_routes"])}


@app.command()
def lookup(
    heads: Annotated[int, typer.Option(help="Query heads per rank.")],
    batch: Annotated[int, typer.Option(help="Requests in the batch.")],
    kv_len: Annotated[int, typer.Option(help="KV tokens per request.")],
    table_path: Annotated[Path | None, table_argument(
        "Parquet, CSV or JSON winners table.", optional=True)] = None,
    qlen: Annotated[int, typer.Option(help="Query tokens per request (1: decode).")] = 1,
    kv_dtype: Annotated[Dtype, typer.Option(help="KV cache dtype.")] = Dtype.bf16,
    q_dtype: Annotated[Dtype | None, typer.Option(
        help="Query dtype (default: bf16 for an fp8 cache, else the cache's).")] = None,
    dcp: Annotated[int, typer.Option(help="Decode-context-parallel size.")] = 1,
    page_size: Annotated[int, typer.Option(help="KV cache page size.")] = 64,
    causal: Annotated[bool, typer.Option("--causal/--no-causal")] = True,
    phase: Annotated[Phase, typer.Option(help="The attention phase.")] = Phase.decode,
    arch: ArchOption = None,
    accuracy: AccuracyOption = None,
    explain: Annotated[bool, typer.Option(
        "--explain", help="List every route's prediction behind a predicted answer (by "
                          "default the three fastest).")] = False,
    json_out: JsonFlag = False,
) -> None:
    """Which route the dispatcher picks for one problem, and why."""
    from mlatune.problem import FP8_DTYPES, MLAProblem

    kv = kv_dtype.value
    q = value(q_dtype) or ("bf16" if kv in FP8_DTYPES else kv)
    with one_line_errors(str(table_path or "the default table")):
        problem = MLAProblem(phase=phase.value, num_heads=heads, qlen=qlen, q_dtype=q,
                             kv_dtype=kv, batch=batch, kv_len=kv_len, dcp_size=dcp,
                             page_size=page_size, causal=causal)
        dispatcher = load_dispatcher(table_path, value(arch), value(accuracy))
        choice, notes = dispatcher.explain(problem, predictions=None if explain else 3)
    if dispatcher.skipped_routes:
        note("skipped rows of routes not registered here: " + ", ".join(
            f"{r} ({n})" for r, n in sorted(dispatcher.skipped_routes.items())))
    if json_out:
        emit_json("lookup", _lookup_json(dispatcher, problem, choice, notes))
        return
    out = Table(show_header=False, title=f"lookup in {dispatcher.source}" if dispatcher.source
                else "lookup: no table here, answered by rule")
    out.add_column("", no_wrap=True)
    out.add_column("", overflow="fold")
    out.add_row("problem", problem.key)
    if dispatcher.table_device:
        from mlatune.arch import units_text

        arch_name, device_name, cu_count = dispatcher.table_device
        out.add_row("table device", f"{arch_name} {device_name} "
                                    f"({units_text(arch_name, cu_count)})")
    out.add_row("route", f"[bold]{choice.route_id}[/]")
    out.add_row("params", json.dumps(dict(choice.params), sort_keys=True))
    out.add_row("source", choice.source)
    out.add_row("accuracy", dispatcher.accuracy.name)
    out.add_row("why", "\n".join(notes))
    console().print(out)


def _lookup_json(dispatcher: Dispatcher, problem: MLAProblem, choice: Choice,
                 notes: list[str]) -> dict[str, Any]:
    return {"table": dispatcher.source or None,
            "table_device": device_json(*dispatcher.table_device) if dispatcher.table_device
            else None,
            "problem": problem.key_dict(), "key": problem.key,
            "route": choice.route_id, "params": dict(choice.params), "source": choice.source,
            "accuracy": dispatcher.accuracy.name,
            "measured_key": choice.key or None, "time_us": num(choice.time_us),
            "why": list(notes), "skipped_routes": dict(dispatcher.skipped_routes)}


@app.command()
def validate(
    table_path: Annotated[Path, table_argument("Parquet, CSV or JSON winners table.")],
    json_out: JsonFlag = False,
) -> None:
    """Check a table against the current schema (an older table as upgraded on reading);
    every problem is reported at once."""
    try:
        facts = _validated(table_path)
    except Exception as exc:
        message = error_text(str(table_path), exc)
        if json_out:
            emit_json("validate", {"table": str(table_path), "ok": False, "error": message})
        fail(message)
    if json_out:
        emit_json("validate", {"table": str(table_path), "ok": True, **facts})
        return
    converted = facts["converted_from"]
    what = "winners map" if facts["format"] == "winners map" else \
        f"schema v{facts['schema_version']}" + (
            f" (rows measured as {', '.join(converted)}, converted)" if converted else "")
    count = (f"{facts['problems']} winners" if facts["rows"] is None
             else f"{facts['rows']} rows, {facts['problems']} problems")
    devices = sorted({f"{d['arch']} {d['device_name']}" for d in facts["devices"]})
    console().print(f"[green]ok[/]: {table_path}: {what}, {count}, devices: "
                    f"{', '.join(devices)}", soft_wrap=True)
    if facts["unregistered_routes"]:
        note(f"routes not registered here (the dispatcher skips their rows): "
             f"{', '.join(facts['unregistered_routes'])}")


def _validated(table_path: Path) -> dict[str, Any]:
    """What a valid table holds; an invalid one raises (TableError: every problem)."""
    from mlatune.table import winners_map

    if winners_map.is_winners_map(table_path):
        from mlatune.routes import FACTS, all_routes

        document = winners_map.read(table_path, FACTS).document
        named = {o["route"] for d in document["devices"] for w in d["winners"].values()
                 for o in (w, *w.get("alternatives", ()))}
        return {"format": "winners map", "schema_version": document.get("schema_version"),
                "converted_from": [], "rows": None,
                "problems": sum(len(d["winners"]) for d in document["devices"]),
                "devices": [device_json(d["arch"], d["device_name"], d["cu_count"])
                            for d in document["devices"]],
                "unregistered_routes": sorted(named - {r.id for r in all_routes()})}
    frame = frames.read_table(table_path)
    return {"format": "table", "schema_version": int(frame["schema_version"].max()),
            "converted_from": sorted(set(frame.get("converted_from", [])) - {""}),
            "rows": len(frame), "problems": frames.problem_count(frame),
            "devices": [device_json(*d) for d in frames.devices(frame)],
            "unregistered_routes": frames.unregistered(frame)}


@app.command()
def diff(
    a_path: Annotated[Path, typer.Argument(metavar="A", exists=True, help="The old table.")],
    b_path: Annotated[Path, typer.Argument(metavar="B", exists=True, help="The new table.")],
    limit: LimitOption = 50,
    json_out: JsonFlag = False,
) -> None:
    """Winners that changed between two tables, and by how much (per device: a problem is
    compared only with the same problem on the same device).

    Exit status: 0 the tables were compared, whether or not winners changed; 1 they share no
    device, so nothing could be compared, or a table cannot be read; 2 a usage error.
    """
    from mlatune import table

    with one_line_errors(str(a_path)):
        a = frames.read_table(a_path)
    with one_line_errors(str(b_path)):
        b = frames.read_table(b_path)
    changed, counts = table.diff(a, b)
    devices_a, devices_b = frames.devices(a), frames.devices(b)
    common = sorted(set(devices_a) & set(devices_b))
    if json_out:
        emit_json("diff", {
            "a": str(a_path), "b": str(b_path),
            "devices": {"a": [device_json(*d) for d in devices_a],
                        "b": [device_json(*d) for d in devices_b],
                        "common": [device_json(*d) for d in common]},
            "comparable": bool(common), "counts": counts,
            "changed": [_diff_entry(row) for _, row in changed.iterrows()]})
    else:
        console().print(f"{counts['same']} winners unchanged, {counts['changed']} changed, "
                        f"{counts['only_a']} problems only in A, {counts['only_b']} only in B",
                        soft_wrap=True)
    _say_device_mismatch(devices_a, devices_b, common)
    if not json_out and not changed.empty:
        _print_changed(a, b, changed, limit)


def _print_changed(a: pd.DataFrame, b: pd.DataFrame, changed: pd.DataFrame,
                   limit: int) -> None:
    import pandas as pd

    devices, several = frames.devices_title(pd.concat([a, b]))
    out = Table(title=f"changed winners, {devices} (change: B's winner time vs A's)")
    frames.columns(out, ("problem", "batch", "kv_len", "A winner", "A us", "B winner", "B us",
                         "change"), ("batch", "kv_len", "A us", "B us", "change"))
    shown = changed if limit <= 0 else changed.head(limit)
    for label, row, starts in frames.grouped(shown, several):
        if starts and out.row_count:
            out.add_section()
        change = row["change"] * 100
        color = "green" if change < 0 else "red" if change > 0 else "white"
        a_winner = row["route_a"] + ("" if row["route_a"] != row["route_b"] else " (params)")
        out.add_row(label, str(row["batch"]), str(row["kv_len"]), a_winner,
                    frames.us(row["time_us_a"]), row["route_b"], frames.us(row["time_us_b"]),
                    f"[{color}]{change:+.1f}%[/]")
    console().print(out)
    if len(shown) < len(changed):
        console().print(f"... {len(changed) - len(shown)} more (--limit 0 shows all)")


def _say_device_mismatch(devices_a: list[frames.Device], devices_b: list[frames.Device],
                         common: list[frames.Device]) -> None:
    """No device in common: nothing was compared, an error (exit 1). Some: a note naming
    the devices whose problems count as only in A or only in B."""
    if not common:
        fail(f"A and B share no device (A: {'; '.join(map(frames.device_text, devices_a))}; "
             f"B: {'; '.join(map(frames.device_text, devices_b))}): winners are compared per "
             f"device, so nothing was compared")
    only = [(side, sorted(set(mine) - set(common))) for side, mine in
            (("A", devices_a), ("B", devices_b))]
    for side, devices in only:
        if devices:
            note(f"only {side} holds {'; '.join(map(frames.device_text, devices))}: its "
                 f"problems count as only in {side}")


def _diff_entry(row: pd.Series) -> dict[str, Any]:
    """One changed winner of `diff --json`: change is B's winner time / A's - 1."""
    def side(s: str) -> dict[str, Any]:
        return {"route": row[f"route_{s}"], "params": json.loads(row[f"route_params_{s}"]),
                "time_us": num(row[f"time_us_{s}"])}

    return {"device": device_json(row["arch"], row["device_name"], row["cu_count"]),
            "problem": frames.row_problem(row), "a": side("a"), "b": side("b"),
            "change": num(row["change"])}
