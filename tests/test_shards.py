"""A sweep over several machines (issue 18 item 4): `sweep --shard I/N` runs a
deterministic share of a spec's problems, `mlatune merge` joins the shares' tables and
refuses tables of different environments or specs."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from mlatune import table
from mlatune.cli import app
from mlatune.problem import MLAProblem
from mlatune.sweep import spec as specs
from mlatune.sweep.runner import Shard
from mlatune.table.schema import KEY_COLUMNS
from tests.table_helpers import H200, MI355, PROVENANCE, make_table, result_row

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

ROOT = Path(__file__).resolve().parent.parent
runner = CliRunner()


def _h200() -> specs.SweepSpec:
    return specs.load(specs.bundled_spec_path("h200.toml"))


def _shares(spec: specs.SweepSpec, n: int) -> list[set[str]]:
    return [{p.key for p in Shard(i, n).of(spec).problems} for i in range(n)]


# Shares partition a spec ------------------------------------------------------------

@pytest.mark.parametrize("n", [1, 2, 3, 4, 7])
def test_shares_are_disjoint_and_cover_the_spec(n):
    spec = _h200()
    shares = _shares(spec, n)
    assert sum(len(s) for s in shares) == len(spec.problems)  # disjoint ...
    assert set().union(*shares) == {p.key for p in spec.problems}  # ... and cover it
    assert all(Shard(i, n).of(spec).sha256 == spec.sha256 for i in range(n))


def test_shares_are_balanced_over_the_h200_spec():
    spec = _h200()
    for n in (2, 4, 8):
        sizes = [len(s) for s in _shares(spec, n)]
        mean = len(spec.problems) / n
        assert max(abs(size - mean) for size in sizes) < 0.15 * mean, (n, sizes)


def test_shares_do_not_depend_on_the_order_of_grids_and_axes():
    path = specs.bundled_spec_path("h200.toml")
    data = tomllib.loads(path.read_text())
    reordered = {**data, "grid": [
        {axis: (values[::-1] if isinstance(values, list) else values)
         for axis, values in reversed(list(grid.items()))}
        for grid in reversed(data["grid"])]}
    again = specs.parse(reordered, "reordered.toml")
    original = _h200()
    assert [p.key for p in again.problems] != [p.key for p in original.problems]
    assert _shares(again, 4) == _shares(original, 4)


def test_shares_are_the_same_in_another_process():
    """No per-process hashing: another interpreter (another PYTHONHASHSEED) agrees."""
    spec = _h200()
    code = ("import json; from mlatune.sweep import spec as s; "
            "from mlatune.sweep.runner import Shard; "
            "sp = s.load(s.bundled_spec_path('h200.toml')); "
            "print(json.dumps(sorted(p.key for p in Shard(1, 4).of(sp).problems)))")
    env = {**os.environ, "PYTHONHASHSEED": "12345"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, cwd=ROOT, env=env).stdout
    assert json.loads(out) == sorted(_shares(spec, 4)[1])


def test_a_problem_s_share_is_its_key_hash_mod_n_and_seeds_did_not_change():
    """One hash (sha1 of the key) for shares and seeds; the seeds are those of before."""
    import hashlib

    from mlatune.sweep.candidates import problem_seed

    problem = MLAProblem(num_heads=16, batch=3, kv_len=4096)
    digest = hashlib.sha1(problem.key.encode()).digest()
    assert [i for i in range(5) if Shard(i, 5).holds(problem)] == [
        int.from_bytes(digest[:8], "little") % 5]
    before = hashlib.sha1(f"7#{problem.key}".encode()).digest()
    assert problem_seed(7, problem) == int.from_bytes(before[:4], "little")


@pytest.mark.parametrize("text", ["0/0", "3/2", "2/2", "abc", "-1/4", "1/", "/4", "1/4/2",
                                  "1.5/4", "", "\u0661/4"])
def test_malformed_shards_are_usage_errors(text, tmp_path):
    with pytest.raises(ValueError):
        Shard.parse(text)
    result = runner.invoke(app, ["sweep", "smoke", "--shard", text,
                                 "--out", str(tmp_path / "t.parquet")])
    assert result.exit_code == 2, result.output
    assert "--shard" in result.output and "Traceback" not in result.output
    errors = [line for line in result.output.splitlines() if "Error" in line]
    assert len(errors) == 1
    assert not (tmp_path / "t.journal.jsonl").exists()


@pytest.mark.parametrize("text", ["0/1", "0/4", "3/4", " 1 / 2 "])
def test_well_formed_shards_parse(text):
    share = Shard.parse(text)
    assert str(share) == re.sub(r"\s", "", text)
    assert share.tag == f"shard-{share.index}-of-{share.count}"


# A sharded CPU sweep, merged, equals the unsharded one ------------------------------

def tiny_spec(tmp_path: Path) -> Path:
    """Eight decode problems; only the reference runs (on the CPU, in one worker)."""
    path = tmp_path / "tiny.toml"
    path.write_text('routes = ["reference/torch"]\n'
                    "[budget]\nwarmup = 0\nmin_reps = 1\nmax_reps = 1\n"
                    "[[grid]]\nnum_heads = 2\nbatch = [1, 2, 3, 4]\nkv_len = [16, 24]\n"
                    'page_size = 8\nq_dtype = "fp16"\nkv_dtype = "fp16"\n')
    return path


def sweep(spec: Path, *flags: str):
    return runner.invoke(app, ["sweep", str(spec), "--compile-workers", "0", *flags])


def _rows(frame) -> set[tuple]:
    return {(*(row[c] for c in KEY_COLUMNS), row["route"], row["status"])
            for _, row in frame.iterrows()}


def test_two_shards_merged_give_the_unsharded_rows_and_another_shard_is_refused(tmp_path):
    spec = tiny_spec(tmp_path)
    whole = sweep(spec, "--out", str(tmp_path / "whole.parquet"))
    assert whole.exit_code == 0, whole.output
    parts = [tmp_path / f"tiny.shard{i}.parquet" for i in range(2)]
    for i, part in enumerate(parts):
        result = sweep(spec, "--shard", f"{i}/2", "--out", str(part))
        assert result.exit_code == 0, result.output
        assert f"shard {i}/2: 4 of the 8 problems" in result.output
        header = json.loads(part.with_suffix(".journal.jsonl").read_text().splitlines()[0])
        assert header["shard"] == f"{i}/2"
    shares = [table.read(p) for p in parts]
    assert not (_rows(shares[0]) & _rows(shares[1]))
    assert all(len(s) == 4 for s in shares)

    # Resuming a journal with another share (or the whole spec) is refused.
    other = sweep(spec, "--shard", "1/2", "--out", str(parts[0]))
    assert other.exit_code == 1
    assert "written for shard 0/2, this sweep runs shard 1/2" in " ".join(other.output.split())
    unsharded = sweep(spec, "--out", str(parts[0]))
    assert unsharded.exit_code == 1 and "the whole spec (no --shard)" in unsharded.output
    assert sweep(spec, "--shard", "0/2", "--out", str(parts[0])).exit_code == 0  # same share

    merged = tmp_path / "merged.csv"
    joined = runner.invoke(app, ["merge", *map(str, parts), "--out", str(merged)])
    assert joined.exit_code == 0, joined.output
    assert f"joined 2 tables into {merged}: 8 rows, 8 problems" in joined.output
    assert "shard 0/2" in joined.output and "shard 1/2" in joined.output
    assert "not given" not in joined.output
    assert _rows(table.read(merged)) == _rows(table.read(tmp_path / "whole.parquet"))

    # One share alone: joined, with a warning naming the missing one.
    alone = runner.invoke(app, ["merge", "--json", str(parts[1]), "--out",
                                str(tmp_path / "half.parquet")])
    assert alone.exit_code == 0, alone.output
    assert "shard 0/2 not given" in " ".join(alone.stderr.split())
    document = json.loads(alone.stdout)
    assert document["schema"] == "mlatune.merge" and document["version"] == 1
    assert document["rows"] == 4 and document["tables"][0]["shard"] == "1/2"
    assert document["missing_shards"] == [{"spec_sha256": document["spec_sha256"][0],
                                           "count": 2, "missing": [0]}]


def test_the_default_out_names_the_share_and_an_empty_share_is_refused(tmp_path,
                                                                        monkeypatch):
    monkeypatch.chdir(tmp_path)
    spec = tiny_spec(tmp_path)
    result = sweep(spec, "--shard", "1/3")
    assert result.exit_code == 0, result.output
    assert (tmp_path / "runs" / "tiny-cpu.shard-1-of-3.parquet").is_file()
    assert (tmp_path / "runs" / "tiny-cpu.shard-1-of-3.journal.jsonl").is_file()
    empty = sweep(spec, "--shard", "0/40")  # 8 problems in 40 shares: this one has none
    assert empty.exit_code == 1
    assert "shard 0/40 holds none of the spec's 8 problems" in empty.output
    assert not (tmp_path / "runs" / "tiny-cpu.shard-0-of-40.journal.jsonl").exists()


# merge refuses what does not belong together --------------------------------------

PROBLEMS = [MLAProblem(num_heads=16, batch=b, kv_len=kv) for b in (1, 8) for kv in (512, 4096)]


def _write(path: Path, problems, device=H200, shard: str | None = None, **provenance) -> Path:
    """A table of ``problems`` (one route) and, for a share, the journal header beside it."""
    from dataclasses import replace

    prov = replace(PROVENANCE, **provenance)
    rows = [result_row(p, "reference/torch", 10.0 + p.batch, device=device) for p in problems]
    table.write(make_table(rows, prov), path)
    if shard is not None:
        header = {"kind": "header", "spec_sha256": prov.spec_sha256, "shard": shard,
                  "arch": device.arch, "device_name": device.name}
        path.with_suffix(".journal.jsonl").write_text(json.dumps(header) + "\n")
    return path


def merge(out, *tables):
    return runner.invoke(app, ["merge", *map(str, tables), "--out", str(out)])


def test_merge_refuses_different_environments_on_one_device(tmp_path):
    a = _write(tmp_path / "a.parquet", PROBLEMS[:2])
    b = _write(tmp_path / "b.csv", PROBLEMS[2:], torch_version="2.12.0")
    result = merge(tmp_path / "out.parquet", a, b)
    assert result.exit_code == 1
    text = " ".join(result.output.split())
    assert "different environments" in text and "torch_version 2.13.0 and 2.12.0" in text
    assert len(result.output.strip().splitlines()) == 1
    assert not (tmp_path / "out.parquet").exists()
    # Other devices may have other environments: a table of several GPUs.
    c = _write(tmp_path / "c.parquet", PROBLEMS, device=MI355, torch_version="2.12.0")
    assert merge(tmp_path / "out.parquet", a, c).exit_code == 0


def test_merge_refuses_shares_of_one_sweep_from_different_devices(tmp_path):
    a = _write(tmp_path / "a.parquet", PROBLEMS[:2], shard="0/2")
    b = _write(tmp_path / "b.parquet", PROBLEMS[2:], device=MI355, shard="1/2")
    result = merge(tmp_path / "out.parquet", a, b)
    assert result.exit_code == 1
    assert "shares of one sweep measured in different environments" in \
        " ".join(result.output.split())


def test_merge_refuses_different_specs_unless_allowed(tmp_path):
    a = _write(tmp_path / "a.parquet", PROBLEMS[:2])
    b = _write(tmp_path / "b.parquet", PROBLEMS[2:], spec_sha256="cd" * 32)
    out = tmp_path / "out.parquet"
    result = merge(out, a, b)
    assert result.exit_code == 1
    assert "different specs" in result.output and "--allow-different-specs" in result.output
    assert not out.exists()
    allowed = merge(out, "--allow-different-specs", a, b)
    assert allowed.exit_code == 0, allowed.output
    assert len(table.read(out)) == len(PROBLEMS)


def test_merge_warns_about_missing_shares_and_keeps_the_best_row(tmp_path):
    a = _write(tmp_path / "a.parquet", PROBLEMS[:2], shard="0/3")
    b = _write(tmp_path / "b.parquet", PROBLEMS[2:], shard="2/3")
    result = merge(tmp_path / "out.parquet", a, b)
    assert result.exit_code == 0, result.output
    assert "shard 1/3 not given" in " ".join(result.output.split())
    assert len(table.read(tmp_path / "out.parquet")) == len(PROBLEMS)


def test_a_whole_run_beside_one_share_misses_no_share(tmp_path):
    whole = _write(tmp_path / "whole.parquet", PROBLEMS)
    share = _write(tmp_path / "s0.parquet", PROBLEMS[:2], shard="0/2")
    result = merge(tmp_path / "out.parquet", share, whole)
    assert result.exit_code == 0, result.output
    assert "not given" not in result.output


def test_merge_refuses_bad_outputs_and_inputs(tmp_path):
    a = _write(tmp_path / "a.parquet", PROBLEMS)
    assert merge(tmp_path / "out.json", a).exit_code == 2  # not a table's suffix
    (tmp_path / "dir.parquet").mkdir()
    assert merge(tmp_path / "dir.parquet", a).exit_code == 1
    missing = merge(tmp_path / "out.parquet", a, tmp_path / "nope.parquet")
    assert missing.exit_code == 2 and "nope.parquet" in missing.output
    assert merge(tmp_path / "out.parquet").exit_code == 2  # no table at all


# The Slurm example of docs/scaling.md parses ------------------------------------------

def test_the_readme_slurm_example_parses(tmp_path, monkeypatch):
    readme = (ROOT / "docs" / "scaling.md").read_text()
    srun = re.search(r"^srun (mlatune sweep .*)$", readme, re.MULTILINE)
    joined = re.search(r"^(mlatune merge .*)$", readme, re.MULTILINE)
    assert srun and joined
    assert "#SBATCH --array=0-3" in readme
    monkeypatch.chdir(tmp_path)
    argv = srun[1].replace("$SLURM_ARRAY_TASK_ID", "3").split()[1:]
    assert "--shard" in argv and argv[argv.index("--shard") + 1] == "3/4"
    # Parsed (a bad --shard is exit 2); refused only because this machine has no H200.
    result = runner.invoke(app, argv)
    assert result.exit_code == 1 and "--arch sm_90 but this machine" in result.output
    Path("runs").mkdir()
    for i in range(4):
        _write(Path(f"runs/h200.shard{i}.parquet"), PROBLEMS[i:i + 1], shard=f"{i}/4")
    argv = joined[1].split()[1:]  # merge PATTERN --out OUT, the shell expanding PATTERN
    pattern, out = argv[1], argv[argv.index("--out") + 1]
    result = runner.invoke(app, [argv[0], *sorted(map(str, Path().glob(pattern))),
                                 "--out", out])
    assert result.exit_code == 0, result.output
    assert len(table.read(out)) == len(PROBLEMS)
    listed = [line.strip() for line in result.output.splitlines() if line.startswith("  ")]
    assert [(line.split(":")[0], line.split(", ")[-1]) for line in listed] == [
        (f"runs/h200.shard{i}.parquet", f"shard {i}/4") for i in range(4)]
    assert "not given" not in result.output
