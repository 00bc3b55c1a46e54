import pytest

from mlatune.sweep import spec
from mlatune.sweep.spec import SpecError


def write(tmp_path, text):
    path = tmp_path / "s.toml"
    path.write_text(text)
    return path


def test_bundled_specs_load():
    for name in ("smoke.toml", "deepseek-v3-tp8.toml", "h200.toml", "gfx950.toml"):
        for gpu in (True, False):
            s = spec.load(spec.bundled_spec_path(name), gpu=gpu)
            assert s.problems and len(s.sha256) == 64


def test_grid_product_cpu_override_and_skips(tmp_path):
    path = write(tmp_path, """
name = "t"
[[grid]]
num_heads = [8, 16]
qlen = [1, 2]
kv_len = 1024
q_dtype = ["bf16", "fp16"]
kv_dtype = "bf16"
[grid.cpu]
kv_len = 64
""")
    on_gpu = spec.load(path, gpu=True)
    assert len(on_gpu.problems) == 4 and len(on_gpu.skipped) == 4  # fp16 q over bf16 kv
    assert {p.kv_len for p in on_gpu.problems} == {1024}
    assert {p.kv_len for p in spec.load(path, gpu=False).problems} == {64}
    assert on_gpu.sha256 != spec.parse({"grid": [{"kv_len": 8}]}, "x").sha256


@pytest.mark.parametrize(
    ("text", "key"),
    [
        ("[[grid]]\nnum_head = [1]\n", "grid[0].num_head"),
        ("colour = 1\n[[grid]]\nkv_len = 8\n", "colour"),
        ("name = 'x'\n", "grid"),
        ("[budget]\nmax_reps = -1\n[[grid]]\nkv_len = 8\n", "budget.max_reps"),
        ("[budget]\nreps = 3\n[[grid]]\nkv_len = 8\n", "budget.reps"),
        ("[budget]\nwarmup = 2.5\n[[grid]]\nkv_len = 8\n", "budget.warmup"),
        ("[budget]\nrace_ratio = 0.5\n[[grid]]\nkv_len = 8\n", "budget.race_ratio"),
        ("[budget]\nrace_reps = 0\n[[grid]]\nkv_len = 8\n", "budget.race_reps"),
        ("[[grid]]\nkv_len = [[1]]\n", "grid[0].kv_len"),
        ("[[grid]]\nkv_len = []\n", "grid[0].kv_len"),
        ("[[grid]]\nqlen = 9\nkv_len = 8\n", "grid"),
        ("seed = 'a'\n[[grid]]\nkv_len = 8\n", "seed"),
        ("routes = 'padded/triton'\n[[grid]]\nkv_len = 8\n", "routes"),
        ("[tolerance]\nbf16 = 2\n[[grid]]\nkv_len = 8\n", "tolerance.bf16"),
        ("[[grid]]\nkv_len = 8\n[grid.cpu]\nbogus = 1\n", "grid[0].cpu.bogus"),
        ("[[grid]\n", "TOML"),
        ("[[grid]]\nkv_len = [128, 99999999999999999999]\n", "grid[0].kv_len"),
        ("[[grid]]\nbatch = 2147483648\n", "grid[0].batch"),
        ("name = '../../escaped'\n[[grid]]\nkv_len = 8\n", "name"),
        ("name = '/tmp/abs'\n[[grid]]\nkv_len = 8\n", "name"),
        ("name = 5\n[[grid]]\nkv_len = 8\n", "name"),
    ],
)
def test_bad_specs_name_the_key_and_the_file(tmp_path, text, key):
    path = write(tmp_path, text)
    with pytest.raises(SpecError) as err:
        spec.load(path)
    assert str(path) in str(err.value) and key in str(err.value)


def test_missing_file(tmp_path):
    with pytest.raises(SpecError, match="cannot read"):
        spec.load(tmp_path / "nope.toml")


@pytest.mark.parametrize("bad", [{"max_params": 3}, {"max_params": {"padded/triton": -1}},
                                 {"max_params": {"padded/triton": True}}])
def test_a_bad_max_params_table_is_refused(bad):
    with pytest.raises(spec.SpecError, match="max_params"):
        spec.parse({**bad, "grid": [{"batch": 1, "kv_len": 8}]}, "t.toml")


def test_the_cpu_table_replaces_settings_only_without_a_gpu():
    data = {"max_params_per_route": 4, "budget": {"min_reps": 10, "max_reps": 100},
            "cpu": {"max_params_per_route": 1, "budget": {"min_reps": 2, "max_reps": 2}},
            "grid": [{"num_heads": 16}]}
    gpu, cpu = spec.parse(dict(data), "t.toml", gpu=True), spec.parse(dict(data), "t.toml",
                                                                       gpu=False)
    assert (gpu.max_params_per_route, gpu.budget.min_reps, gpu.budget.max_reps) == (4, 10, 100)
    assert (cpu.max_params_per_route, cpu.budget.min_reps, cpu.budget.max_reps) == (1, 2, 2)
    for gpu in (False, True):  # a bad [cpu] table is the spec's error on any machine
        with pytest.raises(spec.SpecError, match=r"cpu\.grid"):
            spec.parse({**data, "cpu": {"grid": []}}, "t.toml", gpu=gpu)
        with pytest.raises(spec.SpecError, match=r"cpu\.budget"):
            spec.parse({**data, "cpu": {"budget": 3}}, "t.toml", gpu=gpu)
        # A bad value in [cpu.budget] is named there, also where the GPU side is loaded.
        with pytest.raises(spec.SpecError, match=r"key 'cpu\.budget\.max_reps'"):
            spec.parse({**data, "cpu": {"budget": {"min_reps": 5, "max_reps": 2}}}, "t.toml",
                       gpu=gpu)
