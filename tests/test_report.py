"""`mlatune report`: the numbers on small tables whose answers are worked out by hand here,
the files it writes, and its errors.

Synthetic tables use fake routes with ids that sort first, so the rule order (the
registered routes by id, reference/torch last) starts with them by construction.
"""

import contextlib
import fnmatch
import gzip
import html
import json
import math
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest
from typer.testing import CliRunner

from mlatune import report, routes, table
from mlatune.cli import app
from mlatune.dispatch import dispatcher as dispatch_module
from mlatune.problem import MLAProblem
from mlatune.sweep.spec import load as load_spec
from mlatune.sweep.spec import tomllib  # tomli before Python 3.11
from tests.table_helpers import H200, MI355, FakeRoute, make_table, result_row
from tests.test_cli_tables import assert_one_line_error

REPO = Path(__file__).resolve().parents[1]
SMOKE = REPO / "tests" / "data" / "smoke-h200"  # two smoke sweeps on the H200, 2026-11-29
wide = CliRunner(env={"COLUMNS": "250"})

FAST, SLOW, RULE = "x-fast/fake", "y-slow/fake", "aa-rule/fake"  # RULE sorts first
A, B = "one/fake", "two/fake"
BASE = MLAProblem(num_heads=16, qlen=1, kv_len=1024)
PREFILL = MLAProblem(phase="prefill", num_heads=16, qlen=4096, kv_len=4096, batch=1,
                     page_size=1)


@contextlib.contextmanager
def fake_routes() -> Iterator[list[FakeRoute]]:
    """Fake routes; unmeasured shapes answered by ``nearest``, which the hand-computed
    regrets follow (``predict``, the default, has its own tests in tests/test_predict.py)."""
    made = [FakeRoute(r) for r in (RULE, A, B)]
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(dispatch_module, "DEFAULT_UNMEASURED", "nearest")
        for route in made:
            routes.register(route)
        try:
            yield made
        finally:
            for route in made:
                routes.unregister(route.id)


@pytest.fixture
def fakes():
    with fake_routes() as made:
        yield made


def rows_for(problem: MLAProblem, times: dict[str, float | None], device=H200) -> list[dict]:
    """One row per route: ok with its time, crashed where None."""
    return [result_row(problem, route, t, device=device) for route, t in times.items()]


# The main synthetic table. Picks: P1 fast 10, P2 slow 5, P3 fast 10, P4 fast 8 (the only
# ok route), P6 slow 50; P5 has no ok row.
P = {n: BASE.with_(batch=b) for n, b in (("P1", 1), ("P2", 4), ("P3", 16), ("P4", 64),
                                          ("P5", 256))}
P["P6"] = PREFILL
TIMES = {
    "P1": {FAST: 10.0, SLOW: 20.0, RULE: 40.0},
    "P2": {FAST: 10.0, SLOW: 5.0, RULE: 10.0},
    "P3": {FAST: 10.0, SLOW: None, RULE: 30.0},
    "P4": {FAST: 8.0, SLOW: None, RULE: None},
    "P5": {FAST: None, SLOW: None, RULE: None},
    "P6": {FAST: 150.0, SLOW: 50.0, RULE: 250.0},
}


def main_rows(device=H200) -> list[dict]:
    return [row for name, times in TIMES.items() for row in rows_for(P[name], times, device)]


@pytest.fixture
def main_table(tmp_path):
    return table.write(make_table(main_rows()), tmp_path / "main.parquet")


def test_fixed_route_and_rule_speedups_match_the_hand_computed_ones(fakes, main_table):
    summary, _ = report.summarize(main_table, table.read(main_table))
    assert (summary.problems, summary.decode, summary.prefill, summary.without_ok) == (5, 4, 1, 1)
    assert (summary.routes_ok, summary.routes_tried) == (3, 3)
    by_policy = {s.policy: s for s in summary.fixed}
    fast, slow, rule_route = by_policy[FAST], by_policy[SLOW], by_policy[RULE]
    # fast: P1 1, P2 10/5, P3 1, P4 1, P6 150/50.
    assert (fast.served, fast.wins) == (5, 3)
    assert fast.geomean == pytest.approx(6 ** (1 / 5))
    assert fast.largest == pytest.approx(3.0) and fast.largest_key == P["P6"].key
    # slow: P1 20/10, P2 1, P6 1 (crashed at P3, P4).
    assert (slow.served, slow.wins) == (3, 2)
    assert slow.geomean == pytest.approx(2 ** (1 / 3))
    assert slow.largest == pytest.approx(2.0) and slow.largest_key == P["P1"].key
    # As a fixed route, RULE: 40/10, 10/5, 30/10, 250/50; never a winner.
    assert (rule_route.served, rule_route.wins) == (4, 0)
    assert rule_route.largest == pytest.approx(5.0)
    assert summary.best_fixed.policy == FAST  # most wins
    # The rule fallback answers RULE everywhere (first in id order, accepts all); it
    # crashed at P4, so 4 of the 5 problems count.
    assert summary.rule.policy == report.RULE_POLICY
    assert (summary.rule.served, summary.rule.total, summary.rule_unmeasured) == (4, 5, 1)
    assert summary.rule.geomean == pytest.approx(120 ** (1 / 4))
    assert summary.rule.largest == pytest.approx(5.0)
    assert any("rule's route has no ok row" in n for n in summary.notes)
    assert summary.regret is None


def test_roofline_fraction_is_the_larger_of_memory_and_compute(fakes, main_table):
    summary, _ = report.summarize(main_table, table.read(main_table))
    roof = summary.roofline.set_index("key")
    ceilings = report.CEILINGS["sm_90"]
    for name, t in (("P1", 10.0), ("P6", 50.0)):
        p = P[name]
        memory = p.min_bytes() / t / 1e6 / ceilings.memory_tb_per_s
        compute = p.flops() / t / 1e6 / ceilings.compute_tflops
        assert roof.at[p.key, "fraction"] == pytest.approx(max(memory, compute))
        assert roof.at[p.key, "bound"] == ("memory" if memory >= compute else "compute")
    assert roof.at[P["P1"].key, "bound"] == "memory"  # decode at batch 1: few FLOPs per byte
    assert roof.at[P["P6"].key, "bound"] == "compute"  # prefill, 4096 tokens
    assert len(roof) == 5  # every pick, none for P5


def test_winner_map_cells(fakes, main_table):
    _, data = report.summarize(main_table, table.read(main_table))
    cells = report.winner_cells(data["problems"]).set_index("band")
    assert set(cells.index) == {"batch 1-4", "batch 5-64"}  # P5 (256) has no ok row
    # batch 1-4: P1 won by fast (runner-up slow, 2x), P2 by slow (runner-up at 10: 2x);
    # one win each, so the route id decides.
    low = cells.loc["batch 1-4"]
    assert (low["route"], low["won"], low["n"]) == (FAST, 1, 2)
    assert low["label"] == "2.00x\nwins 1/2"
    # batch 5-64: P3 fast (runner-up rule at 30: 3x), P4 fast alone (no runner-up).
    mid = cells.loc["batch 5-64"]
    assert (mid["route"], mid["won"], mid["n"], mid["label"]) == (FAST, 2, 2, "3.00x")
    only = make_table(rows_for(BASE, {FAST: 3.0, SLOW: None}))
    cell = report.winner_cells(report.measured_problems(only)).iloc[0]
    assert cell["label"] == "1 route"


def test_batch_bands_cover_every_batch():
    assert [report.batch_band(b) for b in (1, 2, 4, 5, 8, 64, 65, 128, 10**6)] == [
        "batch 1-4", "batch 1-4", "batch 1-4", "batch 5-64", "batch 5-64", "batch 5-64",
        "batch >= 65", "batch >= 65", "batch >= 65"]


# Nearest: the main table measures A and B at batch 1 and 64 (kv 1024) of BASE's bucket
# (A wins at 1, B at 64) and A alone at batch 1 of the qlen-2 bucket. A wins twice, so
# with the table loaded A leads the rule order.
VERIFY = BASE.with_(qlen=2)
NEAREST_MAIN = [
    *rows_for(BASE.with_(batch=1), {A: 10.0, B: 20.0}),
    *rows_for(BASE.with_(batch=64), {A: 90.0, B: 50.0}),
    *rows_for(VERIFY.with_(batch=1), {A: 12.0, B: None}),
]
# Held-out problem -> (times there, the route select() should answer, its source).
HELDOUT = {
    "H1": (BASE.with_(batch=2), {A: 10.0, B: 12.0}, A, "nearest"),  # batch 1 is nearer
    "H2": (BASE.with_(batch=32), {A: 10.0, B: 15.0}, B, "nearest"),  # 64 is nearer: +50%
    "H3": (BASE.with_(batch=48), {A: 20.0, B: None}, B, "nearest"),  # B not ok: a miss
    "H4": (BASE.with_(batch=4), {A: 11.0, B: 10.0}, A, "nearest"),  # +10%
    "H5": (BASE.with_(num_heads=128, batch=2), {A: 30.0, B: 24.0}, A, "rule"),  # +25%
    "H6": (BASE.with_(batch=8), {A: None, B: None}, None, None),  # no ok row: not judged
    "H7": (BASE.with_(batch=1), {A: 5.0, B: 6.0}, A, "table"),  # measured in main
}


def write_nearest_tables(folder: Path) -> tuple[Path, Path]:
    main = table.write(make_table(NEAREST_MAIN), folder / "main.parquet")
    rows = [r for p, times, _, _ in HELDOUT.values() for r in rows_for(p, times)]
    heldout = table.write(make_table(rows), folder / "heldout.parquet")
    return main, heldout


@pytest.fixture
def nearest_tables(tmp_path):
    return write_nearest_tables(tmp_path)


@pytest.fixture(scope="module")
def nearest_report(tmp_path_factory):
    """The nearest tables' summary, data and figures (with the route colours they share),
    and the report built from them: made once (drawing is most of a report's time) for the
    tests below that only read them."""
    folder = tmp_path_factory.mktemp("nearest")
    main, heldout = write_nearest_tables(folder)
    with fake_routes():
        summary, data = report.summarize(main, table.read(main), heldout, table.read(heldout))
        figures, colours = figures_of(summary, data)
        made = report.build_report(main, folder / "out", heldout)
    return SimpleNamespace(summary=summary, data=data, figures=figures, colours=colours,
                           made=made)


def test_nearest_regret_matches_the_hand_computed_one(fakes, nearest_tables):
    main, heldout = nearest_tables
    summary, data = report.summarize(main, table.read(main), heldout, table.read(heldout))
    per_problem = data["regret"].set_index("key")
    for p, _, route, source in HELDOUT.values():
        if route is not None:
            assert per_problem.at[p.key, "chosen"] == route, p
            assert per_problem.at[p.key, "source"] == source, p
    regret = summary.regret
    assert (regret.judged, regret.no_ok_row, regret.misses) == (6, 1, 1)
    assert regret.picked_winner == 2  # H1 and H7
    assert regret.sources == {"nearest": 4, "rule": 1, "table": 1}
    judged = [0.0, 0.5, 0.1, 0.25, 0.0]  # H1, H2, H4, H5, H7
    assert regret.geomean == pytest.approx(math.prod(1 + r for r in judged) ** (1 / 5) - 1)
    assert regret.median == pytest.approx(0.1)
    assert regret.max == pytest.approx(0.5)
    assert math.isnan(per_problem.at[HELDOUT["H3"][0].key, "regret"])
    assert any("misses" in n for n in summary.notes)


def test_regret_with_the_chosen_parameters_reads_the_heldout_journal(fakes, nearest_tables,
                                                                     tmp_path):
    """Each choice is timed with the parameters the dispatcher passes, from every candidate
    of the held-out sweep's journal (gzipped here); a choice never timed is left out."""
    main, heldout = nearest_tables

    def result(key, route, params, time_us):
        return {"kind": "result", "key": HELDOUT[key][0].key_dict(), "route": route,
                "route_params": json.dumps(params), "status": "ok", "time_us": time_us}

    records = [{"kind": "header"},
               result("H1", A, {}, 11.0),  # A chosen: +10% against the table's 10.0
               result("H2", B, {"extra": 1}, 99.0),  # other parameters: not the choice
               result("H2", B, {}, 20.0),  # B chosen: +100% (the table's best B was 15)
               result("H4", B, {}, 10.0)]  # not chosen (A is): H4 not timed, left out
    path = tmp_path / "heldout.journal.jsonl.gz"
    with gzip.open(path, "wt") as f:
        f.write("\n".join(json.dumps(r) for r in records) + "\n")
    made = report.build_report(main, tmp_path / "out", heldout, [path])
    regret = made.summary.regret
    assert regret.params_timed == 2
    assert regret.params_geomean == pytest.approx((1.1 * 2.0) ** 0.5 - 1)
    assert regret.params_max == pytest.approx(1.0)
    assert regret.geomean < regret.params_geomean  # the route-level number is unchanged
    assert "its parameters" in (tmp_path / "out" / "report.html").read_text()
    # A later sweep's journal: its runs of a problem's route replace the first one's.
    later = tmp_path / "later.journal.jsonl"
    later.write_text("\n".join(json.dumps(r) for r in
                               [{"kind": "header"}, result("H2", B, {}, 15.0)]) + "\n")
    again = report.build_report(main, tmp_path / "again", heldout, [path, later]).summary.regret
    assert again.params_timed == 2
    assert again.params_geomean == pytest.approx((1.1 * 1.5) ** 0.5 - 1)  # H2: 15 against 10
    assert again.params_max == pytest.approx(0.5)


def test_report_files_are_written_and_the_page_stands_alone(fakes, nearest_tables, tmp_path):
    main, heldout = nearest_tables
    out = tmp_path / "out"
    result = wide.invoke(app, ["report", str(main), "--heldout", str(heldout), "--out", str(out)])
    assert result.exit_code == 0, result.output
    for name in ("winner-map.png", "speedup.png", "roofline.png", "regret.png", "report.html"):
        assert (out / name).stat().st_size > 1000, name
        if name.endswith(".png"):
            assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    page = (out / "report.html").read_text()
    assert_standalone(page, images=4)
    # The best fixed route, A (2 wins): 10/10, 90/50, 12/12 -> geomean 1.8 ** (1/3), worst
    # 1.8; B: 20/10, 50/50 -> sqrt(2), worst 2. Nearest: max regret +50%, 2 of 6 winners.
    for text in (f"{1.8 ** (1 / 3):.2f}x", "1.80x", f"{math.sqrt(2):.2f}x", "2.00x", "+50.0%",
                 "2 of 6", "misses 1"):
        assert text in page, text
        assert text in result.output, text


def assert_standalone(page: str, images: int) -> None:
    """Nothing outside the file: every image a data URI, no links, scripts or URLs."""
    assert page.count('src="data:image/png;base64,') == images
    assert len(re.findall(r'src="', page)) == images
    for outside in ("http://", "https://", "<link", "<script", "url(", "@import"):
        assert outside not in page, outside


def test_unknown_arch_skips_the_roofline_with_a_note(fakes, tmp_path):
    path = table.write(make_table(main_rows(MI355)), tmp_path / "gfx950.parquet")
    result = wide.invoke(app, ["report", str(path), "--out", str(tmp_path / "out")])
    assert result.exit_code == 0, result.output
    assert "no measured ceilings for arch gfx950" in result.output
    assert not (tmp_path / "out" / "roofline.png").exists()
    page = (tmp_path / "out" / "report.html").read_text()
    assert "no roofline plot" in page.lower() and "no held-out table given" in page.lower()
    assert_standalone(page, images=2)


def test_report_on_the_committed_smoke_tables(tmp_path):
    made = report.build_report(SMOKE / "run1.parquet", tmp_path, SMOKE / "run2.parquet")
    summary = made.summary
    assert (summary.problems, summary.decode, summary.prefill) == (31, 28, 3)
    # Their record (benchmarks/results/README.md, in git history): 30 of 31 problems picked the
    # same winner in both runs.
    assert (summary.regret.picked_winner, summary.regret.judged) == (30, 31)
    assert summary.regret.sources == {"table": 31}
    assert sorted(made.images) == ["regret", "roofline", "speedup", "winner_map"]
    page = made.html.read_text()
    assert_standalone(page, images=4)
    for label, value in report.headline_rows(summary):
        assert value in page, label
    # The roofline fractions are fractions of measured ceilings: none reaches 100%.
    assert 0 < summary.roofline["fraction"].max() < 1


def test_missing_inputs_and_bad_tables_are_one_red_line(fakes, main_table, tmp_path):
    out = str(tmp_path / "out")
    absent = str(tmp_path / "absent.parquet")
    for args in (["report", absent, "--out", out],
                 ["report", str(main_table), "--heldout", absent, "--out", out]):
        missing = wide.invoke(app, args)  # a usage error: exit 2, naming the file
        assert missing.exit_code == 2 and absent in " ".join(missing.output.split())
        assert "Traceback" not in missing.output
    damaged = tmp_path / "damaged.parquet"
    damaged.write_bytes(main_table.read_bytes()[:300])
    assert_one_line_error(wide.invoke(app, ["report", str(damaged), "--out", out]),
                          "not a readable Parquet table")
    other_arch = table.write(make_table(main_rows(MI355)), tmp_path / "gfx950.parquet")
    assert_one_line_error(wide.invoke(app, ["report", str(main_table), "--heldout",
                                            str(other_arch), "--out", out]), "gfx950", "sm_90")
    alone = wide.invoke(app, ["report", str(main_table), "--heldout-journal", str(damaged),
                              "--out", out])  # a usage error, as flags that need another
    assert alone.exit_code == 2 and "'--heldout'" in alone.output
    assert "Traceback" not in alone.output
    missing = wide.invoke(app, ["report", str(main_table), "--heldout", str(main_table),
                                "--heldout-journal", absent, "--out", out])
    assert missing.exit_code == 2 and absent in " ".join(missing.output.split())
    for text in ("garbage\n", ""):  # a torn line alone, nothing: no candidate in either
        garbage = tmp_path / "garbage.jsonl"
        garbage.write_text(text)
        assert_one_line_error(wide.invoke(app, ["report", str(main_table), "--heldout",
                                                str(main_table), "--heldout-journal",
                                                str(garbage), "--out", out]),
                              "no ok candidate in it")
    both = table.write(make_table(main_rows() + main_rows(MI355)), tmp_path / "both.parquet")
    assert_one_line_error(wide.invoke(app, ["report", str(both), "--out", out]),
                          "one device", "holds 2")
    nothing_ok = table.write(make_table(rows_for(BASE, {FAST: None})), tmp_path / "none.csv")
    assert_one_line_error(wide.invoke(app, ["report", str(nothing_ok), "--out", out]),
                          "no ok row")
    assert not Path(out).exists()


def test_missing_matplotlib_is_one_red_line(main_table, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)  # import now fails
    result = wide.invoke(app, ["report", str(main_table), "--out", str(tmp_path / "out")])
    assert_one_line_error(result, "needs matplotlib", "mlatune[report]")


def test_mlatune_imports_without_matplotlib():
    code = ("import sys; sys.modules['matplotlib'] = None\n"
            "import mlatune.cli, mlatune.dispatch, mlatune.report, mlatune.table.frame\n"
            "print('ok')")
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr


def test_heldout_spec_lies_between_the_h200_grid_points():
    grid = load_spec(REPO / "sweeps" / "h200.toml")
    heldout = load_spec(REPO / "sweeps" / "h200-heldout.toml")
    assert 100 <= len(heldout.problems) <= 500
    assert heldout.max_params_per_route == grid.max_params_per_route
    buckets = {p.bucket for p in grid.problems}
    for p in heldout.problems:
        assert p.bucket in buckets, p  # nearest searches the same bucket
        # Between the points measured in the same bucket (pages 1 and 16 have a grid
        # of their own).
        same = [g for g in grid.problems if g.bucket == p.bucket]
        batches = sorted({g.batch for g in same})
        kv_lens = sorted({g.kv_len for g in same})
        assert p.batch not in batches and batches[0] < p.batch < batches[-1], p
        assert p.kv_len not in kv_lens and kv_lens[0] < p.kv_len < kv_lens[-1], p
    assert not {p.key for p in heldout.problems} & {p.key for p in grid.problems}


def test_summary_counts_problems_not_rows():
    frame = make_table(main_rows())
    assert len(report.measured_problems(frame)) == 5
    assert report.ok_times(frame).shape == (5, 3)


def test_timing_spread_is_over_ok_rows():
    frame = make_table(main_rows())  # every ok row: p20 0.97 t, p80 1.04 t
    assert report.timing_spread(frame) == pytest.approx((0.07, 0.07))
    ok = frame.index[frame["status"] == "ok"]
    frame.loc[ok[0], "time_us_p80"] = frame.loc[ok[0], "time_us"] * 1.5  # one noisy row
    median, p99 = report.timing_spread(frame)
    assert median == pytest.approx(0.07) and p99 > 0.3
    crashed_only = frame[frame["status"] != "ok"]
    assert all(math.isnan(x) for x in report.timing_spread(crashed_only))


# What the page and the plots say (issue 17) ---------------------------------------------

ROUTE_LEGENDS = ("route that wins most", "winning route", "route the dispatcher chose")


def figures_of(summary, data) -> tuple[dict, dict]:
    """Every figure of a report, and the route colours they share."""
    from mlatune.report import plots

    colours = plots.route_colours(sorted(data["times"].columns))
    figures = {
        "winner_map": plots.winner_map(data["problems"], colours),
        "speedup": plots.speedups(summary, data["problems"], data["times"], colours),
        "roofline": plots.roofline(summary.roofline, summary.ceilings, colours),
        "regret": plots.regret(data["regret"], colours),
    }
    return figures, colours


def legend_entries(figure) -> list[tuple[str, str, tuple]]:
    """(legend title, label, rgb) of every legend entry of a figure and of its axes."""
    from matplotlib.colors import to_rgb

    legends = [*figure.legends, *(ax.get_legend() for ax in figure.axes if ax.get_legend())]
    entries = []
    for legend in legends:
        for handle, text in zip(legend.legend_handles, legend.get_texts(), strict=True):
            colour = (handle.get_facecolor() if hasattr(handle, "get_facecolor")
                      else handle.get_color())
            entries.append((legend.get_title().get_text(), text.get_text(), to_rgb(colour)))
    return entries


def is_grey(rgb: tuple) -> bool:
    return max(rgb) - min(rgb) < 1e-6


def test_one_colour_per_route_across_plots_and_other_categories_grey(nearest_report):
    figures, colours = nearest_report.figures, nearest_report.colours
    from matplotlib.colors import to_rgb

    route_rgbs = {to_rgb(c) for c in colours.values()}
    assert len(route_rgbs) == len(colours)  # no two routes share a colour
    assert not any(is_grey(c) for c in route_rgbs)  # grey is kept for what is not a route
    seen: dict[str, set] = {}
    for name, figure in figures.items():
        for title, label, rgb in legend_entries(figure):
            if title.startswith(ROUTE_LEGENDS) or label in colours:
                assert rgb == to_rgb(colours[label]), (name, label)
                seen.setdefault(label, set()).add(name)
            else:  # a bound, a source, a statistic: never a route's colour
                assert is_grey(rgb), (name, title, label, rgb)
    assert seen[A] >= {"roofline", "regret"}  # A appears in several plots, one colour
    many = plots_colours_for(20)
    assert len(set(many.values())) == 18 and not any(is_grey(to_rgb(c)) for c in many.values())


def plots_colours_for(n: int) -> dict:
    from mlatune.report import plots

    return plots.route_colours([f"r{i:02d}" for i in range(n)])


def test_scales_fit_the_data(nearest_report):
    figures, summary, data = nearest_report.figures, nearest_report.summary, nearest_report.data
    bars = figures["speedup"].axes[0]
    largest = max(s.largest for s in [*summary.fixed, summary.rule] if s.served)
    low, high = bars.get_xlim()
    assert low == pytest.approx(1.0) and largest < high <= 1 + (largest - 1) * 1.25
    assert bars.get_xscale() == "linear"
    roof = figures["roofline"].axes[0]
    intensity = summary.roofline["intensity"]
    low, high = roof.get_xlim()
    assert intensity.min() / 2 <= low < intensity.min()
    assert intensity.max() < high <= intensity.max() * 2
    tflops = summary.roofline["tflops"]
    low, high = roof.get_ylim()
    assert tflops.min() / 2 <= low < tflops.min()
    ceilings = summary.ceilings
    assert high <= 2 * max(tflops.max(), min(ceilings.compute_tflops,
                                             ceilings.memory_tb_per_s * intensity.max() * 1.5))
    regret_ax = figures["regret"].axes[0]
    worst = data["regret"]["regret"].max() * 100  # +50%
    assert worst < regret_ax.get_ylim()[1] <= worst * 1.25


def test_axis_labels_are_words_with_units(nearest_report):
    figures = nearest_report.figures
    labels = [label for figure in figures.values() for ax in figure.axes
              for label in (ax.get_xlabel(), ax.get_ylabel()) if label]
    for label in labels:
        assert not re.search(r"\w\.\w+\(|\(\)|\w_\w", label), label  # no code: calls, names
    roof = figures["roofline"].axes[0]
    assert "FLOP per byte" in roof.get_xlabel() and "TFLOP/s" in roof.get_ylabel()
    assert "%" in figures["regret"].axes[0].get_ylabel()


def test_winner_map_labels_are_explained(nearest_report):
    key = nearest_report.figures["winner_map"].legends[0].get_title().get_text()
    assert "runner-up time / winner time" in key and "wins k/n" in key and "1 route" in key
    page = nearest_report.made.html.read_text()
    caption = page[page.index('alt="decode winner map"'):]
    caption = caption[:caption.index("</figcaption>")]
    for words in ("runner-up", "wins 22/24", "1 route", "Colour"):
        assert words in caption, words


def test_largest_speedup_is_named_for_what_it_is(fakes, main_table):
    """Over fixed routes the pick's smallest speedup is 1.00x by construction: the number
    shown is the largest, never called worst. (The vendor policies' worst is their
    smallest ratio: tests/test_report_policies.py.)"""
    summary, _ = report.summarize(main_table, table.read(main_table))
    fixed = [row for row in report.headline_rows(summary)
             if row[0].startswith(("best single", "pick vs best", "pick vs rule"))]
    assert len(fixed) == 3
    text = " ".join([*report.POLICY_COLUMNS, *(v for row in fixed for v in row)])
    assert "largest" in text and "worst" not in text


def definitions_section(page: str) -> str:
    return page[page.index('<h2 id="definitions">'):page.index("</body>")]


def test_definitions_are_prose_for_readers(nearest_report):
    section = definitions_section(nearest_report.made.html.read_text())
    for markup in ("``", ":func:", ":class:", "<pre>", "-----", "*problem*", "t_pick", "t(R"):
        assert markup not in section, markup
    assert section.count("<dt>") >= 20 and section.count("<h3>") == 9
    # Facts come from the code, not retyped: the bands and the archs with ceilings.
    for band in (label for _, _, label in report.BATCH_BANDS):
        assert html.escape(band) in section, band
    assert ", ".join(sorted(report.CEILINGS)) in section


def test_the_template_ships_as_package_data():
    from importlib import resources

    template = resources.files("mlatune.report") / "templates" / "report.html.j2"
    assert template.is_file()
    setuptools = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    package_data = setuptools["package-data"]["mlatune"]
    assert any(fnmatch.fnmatch("report/templates/report.html.j2", p) for p in package_data)


def test_the_numbers_import_without_matplotlib():
    code = ("import sys\n"
            "import mlatune.report, mlatune.report.metrics\n"
            "from mlatune.report import geomean, nearest_regret, one_device\n"
            "assert 'matplotlib' not in sys.modules, 'matplotlib imported'\n"
            "print('ok')")
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr


def test_a_table_one_route_wins_everywhere_still_has_a_speedup_axis(fakes, tmp_path):
    from mlatune.report import plots

    path = table.write(make_table(rows_for(BASE, {A: 3.0, B: None})), tmp_path / "one.parquet")
    summary, data = report.summarize(path, table.read(path))
    figure = plots.speedups(summary, data["problems"], data["times"],
                            plots.route_colours([A, B]))
    low, high = figure.axes[0].get_xlim()
    assert low == pytest.approx(1.0) and 1.0 < high < 1.1
