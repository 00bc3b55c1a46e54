"""`mlatune report`'s accuracy-policy section: each policy's picks, their speedups over always
FlashMLA and over strict's picks, and their recorded errors, on a small table whose answers
are worked out by hand here; the headline, the page, the console and summary.json.
"""

import json
import math
import statistics

import pytest
from typer.testing import CliRunner

from mlatune import report, table
from mlatune.cli import app
from mlatune.dispatch.dispatcher import registered_routes
from mlatune.problem import MLAProblem
from mlatune.report import accuracy
from mlatune.report.terms import geomean
from tests.table_helpers import make_table, result_row

wide = CliRunner(env={"COLUMNS": "250"})
FM, TG, PT = "dense/flashmla", "transposed-mma8/gluon", "padded/triton"
MMA8 = {"form": "mma8"}  # TG's sets: P rounded to fp8, fp8-mma's class
FP8_CACHE = MLAProblem(num_heads=128, qlen=1, kv_len=4096, kv_dtype="fp8_e4m3fn")
P = {
    "A": FP8_CACHE.with_(batch=64),
    "B": FP8_CACHE.with_(batch=1, kv_len=1024),
    "C": MLAProblem(num_heads=128, qlen=1, kv_len=4096, batch=8),  # a bf16 cache
    "D": FP8_CACHE.with_(batch=8),
}
# (route, time_us, rel_err, lse_err, params) per problem. FlashMLA quantizes the bf16 q over
# an fp8 cache (q-fp8, bound 8e-2); D's FlashMLA row is past that bound, so no policy
# serves it. Picks: strict A PT, B PT, C FM, D PT; fp8-mma A TG, B TG; fast A FM, B TG.
ROWS = {
    "A": [(FM, 5.0, 7e-2, 0.4, {}), (TG, 8.0, 1.2e-2, 0.05, MMA8), (PT, 10.0, 1.7e-3, 0.01, {})],
    "B": [(FM, 6.0, 7.4e-2, 0.5, {}), (TG, 4.0, 1.5e-2, 0.06, MMA8), (PT, 5.0, 2e-3, 0.02, {})],
    "C": [(FM, 3.0, 3e-3, 0.03, {}), (PT, 4.0, 2e-3, 0.02, {})],
    "D": [(FM, 2.0, 9e-2, 0.7, {}), (PT, 6.0, 2e-3, 0.02, {})],
}
PREFILL = MLAProblem(phase="prefill", num_heads=16, qlen=4096, kv_len=4096, batch=1,
                     page_size=1)


def rows() -> list[dict]:
    out = [{**result_row(P[name], route, t, params=params), "rel_err": rel, "lse_err": lse}
           for name, measured in ROWS.items() for route, t, rel, lse, params in measured]
    return [*out, result_row(PREFILL, "reference/torch", 100.0)]  # not a decode problem


@pytest.fixture
def accuracy_table(tmp_path):
    return table.write(make_table(rows()), tmp_path / "accuracy.parquet")


def numbers_of(section) -> dict:
    return {(n.policy, n.scope): n for n in section.numbers}


DECODE, FP8 = (scope for scope, _ in accuracy.SCOPES)


def test_each_policy_picks_the_fastest_row_it_admits(accuracy_table):
    frame = table.read(accuracy_table)
    decode = frame[frame["phase"] == "decode"]
    picks = {name: accuracy.policy_picks(decode, name, registered_routes())["route"].to_dict()
             for name in ("strict", "fp8-mma", "fast")}
    key = {name: p.key for name, p in P.items()}
    assert picks["strict"] == {key["A"]: PT, key["B"]: PT, key["C"]: FM, key["D"]: PT}
    assert picks["fp8-mma"] == {key["A"]: TG, key["B"]: TG, key["C"]: FM, key["D"]: PT}
    assert picks["fast"] == {key["A"]: FM, key["B"]: TG, key["C"]: FM, key["D"]: PT}


def test_speedups_and_errors_match_the_hand_computed_numbers(accuracy_table):
    summary, _ = report.summarize(accuracy_table, table.read(accuracy_table))
    got = numbers_of(summary.accuracy)
    # Over always FlashMLA: FlashMLA's time over the pick's, A B C D.
    expect_flashmla = {"strict": [5 / 10, 6 / 5, 3 / 3, 2 / 6],
                       "fp8-mma": [5 / 8, 6 / 4, 3 / 3, 2 / 6],
                       "fast": [5 / 5, 6 / 4, 3 / 3, 2 / 6]}
    expect_strict = {"strict": [1, 1, 1, 1], "fp8-mma": [10 / 8, 5 / 4, 1, 1],
                     "fast": [10 / 5, 5 / 4, 1, 1]}
    rel_errs = {"strict": [1.7e-3, 2e-3, 3e-3, 2e-3], "fp8-mma": [1.2e-2, 1.5e-2, 3e-3, 2e-3],
                "fast": [7e-2, 1.5e-2, 3e-3, 2e-3]}
    lse_errs = {"strict": [0.01, 0.02, 0.03, 0.02], "fp8-mma": [0.05, 0.06, 0.03, 0.02],
                "fast": [0.4, 0.06, 0.03, 0.02]}
    for policy, differs in (("strict", 0), ("fp8-mma", 2), ("fast", 2)):
        for scope, at in ((DECODE, [0, 1, 2, 3]), (FP8, [0, 1, 3])):  # C has a bf16 cache
            n = got[(policy, scope)]
            assert (n.problems, n.served, n.flashmla_served, n.strict_served) == (len(at),) * 4
            assert n.over_flashmla == pytest.approx(
                geomean([expect_flashmla[policy][i] for i in at]))
            assert n.over_strict == pytest.approx(geomean([expect_strict[policy][i] for i in at]))
            assert n.differs == differs
            rel = [rel_errs[policy][i] for i in at]
            lse = [lse_errs[policy][i] for i in at]
            assert n.rel_err.median == pytest.approx(statistics.median(rel))
            assert (n.rel_err.recorded, n.rel_err.max) == (len(at), max(rel))
            assert n.lse_err.median == pytest.approx(statistics.median(lse))
            assert (n.lse_err.recorded, n.lse_err.max) == (len(at), max(lse))
    assert summary.accuracy.device == "NVIDIA H200 (sm_90)"
    assert summary.accuracy.measured == "2026-01-01"  # the helpers' provenance


def test_a_policy_without_a_row_serves_fewer_problems():
    # Only FlashMLA's quantized-q row at E: strict and fp8-mma have no pick there.
    e = FP8_CACHE.with_(batch=2)
    frame = make_table([result_row(e, FM, 5.0) | {"rel_err": 7e-2},
                        result_row(P["C"], FM, 3.0), result_row(P["C"], PT, 4.0)])
    got = numbers_of(accuracy.section(frame, report.ok_times(frame), "NVIDIA H200"))
    strict, fast = got[("strict", FP8)], got[("fast", FP8)]
    assert (strict.problems, strict.served, strict.flashmla_served) == (1, 0, 0)
    assert math.isnan(strict.over_flashmla) and math.isnan(strict.rel_err.median)
    assert (fast.served, fast.over_flashmla, fast.differs) == (1, 1.0, 1)
    assert math.isnan(fast.over_strict) and fast.strict_served == 0
    assert "serves 0/1; - over always FlashMLA (over 0)" in accuracy.numbers_text(strict)


def test_a_table_without_lse_err_says_so(accuracy_table):
    frame = table.read(accuracy_table)
    without = accuracy.section(frame.drop(columns="lse_err"), report.ok_times(frame),
                               "NVIDIA H200")
    assert not without.has_lse and all(n.lse_err is None for n in without.numbers)
    assert "lse_err" not in " ".join(accuracy.columns(without))
    assert all(len(row) == len(accuracy.columns(without)) for row in
               accuracy.table_rows(without))
    assert accuracy.numbers_text(without.numbers[0]).endswith("lse_err not in the table")
    unrecorded = accuracy.section(frame.assign(lse_err=math.nan), report.ok_times(frame),
                                  "NVIDIA H200")
    assert unrecorded.has_lse and not unrecorded.lse_recorded
    assert accuracy.numbers_text(unrecorded.numbers[0]).endswith("lse_err not recorded")
    assert accuracy.as_json(unrecorded)["policies"][0]["lse_err"] == {
        "recorded": 0, "median": None, "max": None}


def test_a_table_without_decode_problems_has_no_section(tmp_path):
    path = table.write(make_table([result_row(PREFILL, "reference/torch", 100.0)]),
                       tmp_path / "prefill.parquet")
    summary, _ = report.summarize(path, table.read(path))
    assert summary.accuracy is None
    assert not any(label.startswith("accuracy") for label, _ in report.headline_rows(summary))
    assert report.summary_document(summary)["accuracy_policies"] is None


def test_headline_page_console_and_json_state_each_policy(accuracy_table, tmp_path):
    out = tmp_path / "out"
    result = wide.invoke(app, ["report", str(accuracy_table), "--out", str(out)])
    assert result.exit_code == 0, result.output
    page = (out / "report.html").read_text()
    summary, _ = report.summarize(accuracy_table, table.read(accuracy_table))
    headline = dict(report.headline_rows(summary))
    assert headline["accuracy policies, measured on"] == "NVIDIA H200 (sm_90), 2026-01-01"
    fast = headline[f"accuracy fast ({FP8})"]
    over_flashmla, over_strict = geomean([1, 1.5, 1 / 3]), geomean([2, 1.25, 1])
    assert fast == (f"serves 3/3; {over_flashmla:.2f}x over always FlashMLA (over 3), "
                    f"{over_strict:.2f}x over the strict picks, pick differs from strict on 2; "
                    f"rel_err median 0.015, max 0.07; lse_err median 0.06, max 0.4")
    for label, value in headline.items():
        if label.startswith("accuracy"):
            assert value in page and label in result.output, label
    assert 'id="accuracy-policies"' in page and "Measured on NVIDIA H200 (sm_90), 2026-01-01" \
        in page
    for row in accuracy.table_rows(summary.accuracy):
        assert "".join(f'<td class="num">{cell}</td>' for cell in row[2:]) in page
    document = json.loads((out / report.JSON_NAME).read_text())["accuracy_policies"]
    assert document["device"] == "NVIDIA H200 (sm_90)"
    fp8_mma = {(p["policy"], p["scope"]): p for p in document["policies"]}[("fp8-mma", FP8)]
    assert fp8_mma["over_strict"] == pytest.approx(geomean([1.25, 1.25, 1]))
    assert fp8_mma["differs_from_strict"] == 2 and fp8_mma["rel_err"]["max"] == 1.5e-2
