"""examples/engine_warmup.py on a GPU (``pytest -m gpu``), small: its buckets tuned at load
into a fresh user table, then captured and replayed with no compilation and no timing
after the warm-up; and the compilation counter it relies on counts a Triton compilation."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from tests.test_examples import _load

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def _needs_a_gpu():
    if not torch.cuda.is_available():  # fail, not skip: -m gpu without a GPU is no pass
        pytest.fail("GPU tests need a GPU: run them on the device machine")


def test_the_counter_counts_a_triton_compilation():
    import triton
    import triton.language as tl

    warmup = _load("engine_warmup")

    @triton.jit
    def add_one(x, N: tl.constexpr):
        offsets = tl.arange(0, N)
        tl.store(x + offsets, tl.load(x + offsets) + 1)

    counter = warmup.Counter()
    try:
        x = torch.zeros(16, device="cuda")
        add_one[(1,)](x, N=16)
        add_one[(1,)](x, N=16)  # compiled once
        torch.cuda.synchronize()
    finally:
        counter.close()
    assert counter.compilations == 1 and x.eq(2).all()


def test_buckets_tuned_at_load_then_replayed_without_compiling(tmp_path, monkeypatch):
    monkeypatch.setenv("MLATUNE_USER_TABLE", str(tmp_path / "user.parquet"))
    monkeypatch.delenv("MLATUNE_FIRST_SIGHT", raising=False)
    warmup = _load("engine_warmup")
    cfg = replace(warmup.WARMUP, buckets=(1, 4), steps=40, check_every=10)
    served = warmup.run(cfg, budget_s=60.0)
    # The cheapest problem (batch 1) is tuned first: within a minute it is measured, now or
    # by the bundled table already.
    assert served.choices[1][1] == "table", served
    assert served.checked == 4
    assert (served.compilations, served.timings) == (0, 0), served
