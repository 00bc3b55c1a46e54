"""mlatune.dispatch.laws on synthetic tables whose times follow known device laws."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pandas as pd
import pytest

from mlatune import routes, table
from mlatune.dispatch import Dispatcher
from mlatune.dispatch.laws import TRUST, Laws, transfer_time, transfer_times
from mlatune.hardware import described as table_hardware
from mlatune.problem import KEY_FIELDS, MLAProblem
from tests.table_helpers import H200, FakeRoute, make_table, result_row

HW = table_hardware("NVIDIA H200", "sm_90", 132)  # 4.8 TB/s, 989 TFLOP/s
SLOW_MEMORY = dataclasses.replace(HW, name="slow memory", bandwidth_gbs=HW.bandwidth_gbs / 2)
ROUTES = {"stream/fake": FakeRoute("stream/fake"), "math/fake": FakeRoute("math/fake")}
HEADS = (8, 16, 32, 64, 128)
BATCHES = (1, 4, 16, 64, 256)
KV_LENS = (1024, 4096, 16384, 65536)


def streaming(p: MLAProblem, hw=HW) -> float:
    """At the DRAM floor: the bytes over the peak bandwidth."""
    return p.min_bytes() / (hw.bandwidth_gbs * 1e3)


def computing(p: MLAProblem, hw=HW) -> float:
    """Bound by its padded FLOPs at a fortieth of the tensor throughput, plus a fixed cost
    (slower than the DRAM floor at half the bandwidth, at every head count)."""
    rows = -(-p.qlen * p.kernel_heads // 16) * 16
    return 8.0 + 40 * p.batch * p.kv_len * rows * 2 * (p.d_qk + p.d_v) / (hw.tensor_tflops * 1e6)


def problems(heads=HEADS, qlens=(1, 4)):
    return [MLAProblem(num_heads=h, qlen=q, batch=b, kv_len=k)
            for h in heads for q in qlens for b in BATCHES for k in KV_LENS]


def fitted(laws_of: dict, heads=HEADS) -> Laws:
    rows = [(p, r, {}, law(p)) for p in problems(heads) for r, law in laws_of.items()]
    return Laws.fit(rows, ROUTES, HW)


def converting(p: MLAProblem) -> float:
    """Bound by the cache elements each SM walks in turn, whatever their width (a kernel
    that widens an fp8 cache before its MMAs), far from the DRAM floor."""
    return 5.0 + p.batch * p.kv_len / HW.sm_count * p.d_qk / 2e3


def test_a_streaming_route_transfers_exactly_with_the_bandwidth():
    laws = fitted({"stream/fake": streaming})
    for p in problems()[::7]:
        ratio = laws.transfer_ratio(p, "stream/fake", {}, HW, SLOW_MEMORY)
        assert ratio == pytest.approx(2.0, rel=1e-3)
        moved = transfer_time(laws, p, "stream/fake", {}, streaming(p), SLOW_MEMORY, trust=1.0)
        assert moved == pytest.approx(streaming(p, SLOW_MEMORY), rel=1e-3)
        # by default a transfer applies TRUST of the law's movement (in log)
        moved = transfer_time(laws, p, "stream/fake", {}, streaming(p), SLOW_MEMORY)
        assert moved == pytest.approx(streaming(p) * 2.0 ** TRUST, rel=1e-3)
        assert streaming(p) < moved < streaming(p, SLOW_MEMORY)


def test_a_compute_bound_route_does_not_move_with_the_bandwidth():
    laws = fitted({"math/fake": computing})
    for p in problems()[::7]:
        assert laws.transfer_ratio(p, "math/fake", {}, HW, SLOW_MEMORY) == \
            pytest.approx(1.0, abs=1e-3)
    # nor on a device the figures of which are unknown
    unknown = dataclasses.replace(HW, bandwidth_gbs=None)
    assert laws.transfer_ratio(problems()[0], "math/fake", {}, HW, unknown) == 1.0


def test_transfer_times_rescales_a_table_frame_and_keeps_rows_not_ok():
    rows = [result_row(p, r, law(p)) for p in problems((8, 64))
            for r, law in (("stream/fake", streaming), ("math/fake", computing))]
    rows.append(result_row(MLAProblem(num_heads=8, batch=2, kv_len=999), "math/fake", None))
    frame = pd.DataFrame(rows)
    streams = (frame["route"] == "stream/fake").to_numpy()
    for trust in (1.0, TRUST):
        times = transfer_times(frame, ROUTES, HW, SLOW_MEMORY, trust)
        ratio = times / frame["time_us"].to_numpy()
        assert np.allclose(ratio[streams], 2.0 ** trust, rtol=1e-3)
        assert np.allclose(ratio[~streams & np.isfinite(ratio)], 1.0, atol=1e-3)
        assert np.isnan(times[-1])


def test_a_kernel_that_widens_an_fp8_cache_costs_per_element():
    """Fitted over both cache dtypes at other head counts, the bare law (no correction from
    neighbours) gives either dtype's time at a head count of neither: the walk's bytes
    alone would make the fp8 cache twice as fast as it is."""
    route = {"widen/fake": FakeRoute("widen/fake")}
    rows = [(p.with_(kv_dtype=dtype), "widen/fake", {}, converting(p))
            for p in problems(heads=(8, 32, 128)) for dtype in ("bf16", "fp8_e4m3fn")]
    laws = Laws.fit(rows, route, HW)
    for dtype in ("bf16", "fp8_e4m3fn"):
        for batch, kv_len in ((4, 4096), (64, 16384), (200, 6000)):
            asked = MLAProblem(num_heads=16, kv_dtype=dtype, batch=batch, kv_len=kv_len)
            assert laws.law(asked, "widen/fake", {}) == pytest.approx(converting(asked),
                                                                        rel=0.02)


@pytest.mark.parametrize("batch,kv_len", [(4, 4096), (64, 16384), (200, 6000)])
def test_an_unmeasured_head_count_is_predicted_between_its_neighbours(batch, kv_len):
    laws = fitted({"math/fake": computing}, heads=(8, 16, 32, 64, 128))
    asked = MLAProblem(num_heads=24, batch=batch, kv_len=kv_len)
    low, high = (computing(asked.with_(num_heads=h)) for h in (16, 32))
    predicted = laws.predict(asked, "math/fake")
    assert predicted is not None and low < predicted.time_us < high
    assert predicted.time_us == pytest.approx(computing(asked), rel=0.05)


def test_choose_ranks_every_route_with_a_law_and_skips_the_unusable():
    laws = fitted({"stream/fake": streaming, "math/fake": computing})
    asked = MLAProblem(num_heads=24, qlen=2, batch=64, kv_len=16384)
    ranked = laws.choose(asked)
    expected = sorted(ROUTES, key=lambda r: (streaming if r == "stream/fake" else computing)(asked))
    assert [p.route_id for p in ranked] == expected
    assert laws.choose(asked, lambda r: r != expected[0])[0].route_id == expected[1]
    assert laws.choose(asked, lambda r: False) == []


def test_a_route_is_not_predicted_next_to_its_failures():
    rows = [(p, "math/fake", {}, computing(p)) for p in problems()]
    failed = [(p.with_(kv_dtype="fp8_e4m3fn"), "math/fake") for p in problems()]
    laws = Laws.fit(rows, ROUTES, HW, failed)
    asked = MLAProblem(num_heads=24, kv_dtype="fp8_e4m3fn", batch=16, kv_len=4096)
    assert laws.predict(asked, "math/fake") is None
    assert laws.predict(asked.with_(kv_dtype="bf16"), "math/fake") is not None


@pytest.fixture
def registered():
    for route in ROUTES.values():
        routes.register(route)
    yield
    for route_id in ROUTES:
        routes.unregister(route_id)


@pytest.fixture
def law_dispatcher(tmp_path, registered) -> Dispatcher:
    """A table of both fake routes at 16 and 128 heads, qlen 1, loaded on the H200."""
    rows = [result_row(p, r, law(p)) for p in problems((16, 128), (1,))
            for r, law in (("stream/fake", streaming), ("math/fake", computing))]
    path = tmp_path / "t.parquet"
    table.write(make_table(rows), path)
    return Dispatcher.load(path, device=H200)


def test_the_dispatcher_answers_an_unmeasured_bucket_by_law(law_dispatcher):
    dispatcher = law_dispatcher
    for heads, batch in ((8, 4), (48, 256), (48, 2)):
        asked = MLAProblem(num_heads=heads, batch=batch, kv_len=30000)
        choice = dispatcher.select(asked)
        best = min(ROUTES, key=lambda r: (streaming if r == "stream/fake" else computing)(asked))
        assert choice.source == "law" and choice.route_id == best
        assert MLAProblem.from_key(choice.key).bucket != asked.bucket
        notes = dispatcher.explain(asked)[1]
        assert any(n.startswith(f"law: {best}") for n in notes)


def test_estimates_rank_every_route_by_law_or_prediction(law_dispatcher):
    dispatcher = law_dispatcher
    for asked, source in ((MLAProblem(num_heads=48, batch=2, kv_len=30000), "law"),
                          (MLAProblem(num_heads=16, batch=3, kv_len=3000), "predicted")):
        estimates = dispatcher.estimates(asked)
        assert {e.route_id for e in estimates} == set(ROUTES)
        assert {e.source for e in estimates} == {source}
        assert [e.time_us for e in estimates] == sorted(e.time_us for e in estimates)
        assert estimates[0].route_id == dispatcher.select(asked).route_id


def test_problems_from_a_frame_match_their_keys():
    frame = pd.DataFrame([result_row(p, "math/fake", 1.0) for p in problems((8,))[:3]])
    from mlatune.dispatch.laws import _problems

    assert [p.key for p in _problems(frame)] == \
        [MLAProblem.from_key_dict(r).key for r in frame[list(KEY_FIELDS)].to_dict("records")]
    assert json.loads(frame["route_params"][0]) == {}
