import pytest
import torch

from mlatune.check.inputs import (
    make_decode_inputs,
    make_inputs,
    make_model_like_inputs,
    make_prefill_inputs,
    poison_,
    shard_lengths,
)
from mlatune.check.reference import _gather_pages, dequantize
from mlatune.problem import MLAProblem


@pytest.mark.parametrize("kv_dtype", ["bf16", "fp16", "fp8_e4m3fn", "fp8_e4m3fnuz"])
def test_decode_inputs_are_random_and_shaped(kv_dtype):
    q_dtype = "fp16" if kv_dtype == "fp16" else "bf16"
    p = MLAProblem(num_heads=3, qlen=2, batch=4, kv_len=50, dcp_size=2, page_size=8,
                   q_dtype=q_dtype, kv_dtype=kv_dtype)
    x = make_decode_inputs(p, seed=0, ragged=True)
    assert x.q.shape == (8, 6, 576)
    for t in [x.q] + [s.kv_cache for s in x.shards]:
        values = t.float()
        assert (values == 0).float().mean() < 0.01  # never zeros
        assert values.std() > 0.1
    assert ((x.seq_lens >= 2) & (x.seq_lens <= 50)).all() and int(x.seq_lens.max()) == 50
    if kv_dtype.startswith("fp8"):
        assert x.kv_scale is not None and x.q_scale is None
        assert 0.5 < float((x.shards[0].kv_cache.float() * x.kv_scale).std()) < 2.5


def test_block_tables_are_shuffled_permutations():
    p = MLAProblem(num_heads=1, batch=6, kv_len=100, page_size=4, dcp_size=2)
    x = make_decode_inputs(p, seed=1, ragged=True)
    for shard in x.shards:
        assert torch.equal(shard.seq_lens, shard_lengths(x.seq_lens, shard.rank, 2))
        used = []
        for b in range(p.batch):
            n = -(-int(shard.seq_lens[b]) // 4)
            row = shard.block_table[b]
            assert (row[n:] == -1).all()
            used += row[:n].tolist()
        assert sorted(used) == list(range(shard.kv_cache.shape[0]))
        assert used != sorted(used)


def test_shard_lengths_round_robin():
    lens = torch.tensor([0, 1, 5, 8])
    per_rank = [shard_lengths(lens, r, 4).tolist() for r in range(4)]
    assert per_rank == [[0, 1, 2, 2], [0, 0, 1, 2], [0, 0, 1, 2], [0, 0, 1, 2]]


def test_seeds_are_deterministic_and_distinct():
    p = MLAProblem(num_heads=2, batch=2, kv_len=20, page_size=4)
    a, b, c = (make_decode_inputs(p, seed=s) for s in (5, 5, 6))
    assert torch.equal(a.q, b.q) and torch.equal(a.shards[0].kv_cache, b.shards[0].kv_cache)
    assert not torch.equal(a.q, c.q)


def test_prefill_inputs_varlen():
    p = MLAProblem(phase="prefill", num_heads=2, qlen=10, kv_len=14, batch=3, page_size=1)
    x = make_prefill_inputs(p, seed=0, ragged=True)
    q_lens = x.cu_seqlens_q.diff()
    assert torch.equal(x.cu_seqlens_k.diff() - q_lens, torch.full((3,), 4, dtype=torch.int32))
    assert int(q_lens.max()) == 10 and x.q.shape == (int(q_lens.sum()), 2, 192)
    assert x.v.shape[-1] == 128


def test_wrong_phase_is_refused():
    with pytest.raises(ValueError, match="phase"):
        make_decode_inputs(MLAProblem(phase="prefill", kv_len=8, qlen=8))
    with pytest.raises(ValueError, match="phase"):
        make_prefill_inputs(MLAProblem())


def test_poison_fills_nan():
    t = torch.zeros(3, 4)
    poison_(t, None)
    assert torch.isnan(t).all()


# The model-like family ------------------------------------------------------------------

MODEL_DECODE = MLAProblem(num_heads=8, qlen=2, batch=3, kv_len=1500, page_size=16,
                          q_dtype="bf16", kv_dtype="fp8_e4m3fn", dcp_size=2)


def kurtosis(x: torch.Tensor) -> float:
    x = x.double().flatten()
    x = x - x.mean()
    return float((x ** 4).mean() / (x ** 2).mean() ** 2)


def dense(x) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """A decode problem's dequantized q (batch, qlen, heads, d) and each request's keys in
    order, gathered from every rank's pages."""
    p = x.problem
    q = dequantize(x.q, x.q_scale, torch.float32).view(p.batch, p.qlen, p.kernel_heads, -1)
    keys = []
    for b, length in enumerate(x.seq_lens.tolist()):
        rows = torch.empty(length, p.d_qk)
        for shard in x.shards:
            local = int(shard.seq_lens[b])
            pages = _gather_pages(shard.kv_cache, shard.block_table[b:b + 1], local)[0]
            rows[shard.rank::p.dcp_size] = dequantize(pages, x.kv_scale, torch.float32)
        keys.append(rows)
    return q, keys


@pytest.mark.parametrize("problem", [MODEL_DECODE, MODEL_DECODE.with_(
    phase="prefill", qlen=24, kv_len=40, dcp_size=1, page_size=1, q_dtype="fp16",
    kv_dtype="fp16")], ids=["decode-fp8", "prefill-fp16"])
def test_model_like_inputs_have_outlier_channels_and_heavy_tailed_rope_dims(problem):
    model, normal = make_model_like_inputs(problem, seed=1), make_inputs(problem, seed=1)
    d_v = problem.d_v
    for x in (model, normal):
        values = [x.q] + ([s.kv_cache for s in x.shards] if problem.phase == "decode"
                          else [x.k, x.v])
        for t in values:
            assert (t.float() == 0).float().mean() < 0.01  # never zeros
    q = dequantize(model.q, model.q_scale, torch.float32).flatten(0, -2)
    cache = (dequantize(model.shards[0].kv_cache, model.kv_scale, torch.float32)
             if problem.phase == "decode" else model.k).float().flatten(0, -2)
    for values in (q, cache):
        widths = values[:, :d_v].std(0)
        wide = widths / widths.median()
        assert 1 <= int((wide > 5).sum()) <= 8 and float(wide.max()) > 9  # a handful, 10-30x
        assert kurtosis(values[:, d_v:]) > 8  # normal: 3
    normal_q = dequantize(normal.q, normal.q_scale, torch.float32).flatten(0, -2)
    assert kurtosis(normal_q[:, d_v:]) < 3.5
    assert float(normal_q[:, :d_v].std(0).max() / normal_q[:, :d_v].std(0).median()) < 1.5
    if problem.kv_dtype.startswith("fp8"):  # the per-tensor scale covers the widest channel
        assert model.kv_scale is not None and float(model.kv_scale) != 1.0
        saturated = model.shards[0].kv_cache.float().abs() == torch.finfo(torch.float8_e4m3fn).max
        assert saturated.float().mean() < 1e-3


def request_keys_mass(x) -> tuple[torch.Tensor, torch.Tensor]:
    """Per query row (token, head): the softmax mass on its request's three most attended
    keys (over all its rows), and on the request's first key."""
    q, keys = dense(x)
    shared, first = [], []
    for b, k in enumerate(keys):
        probs = (q[b] @ k.T * x.problem.softmax_scale).softmax(-1)  # (qlen, heads, keys)
        top = probs.mean((0, 1)).topk(min(3, len(k))).indices
        shared.append(probs[..., top].sum(-1).flatten())
        first.append(probs[..., 0].flatten())
    return torch.cat(shared), torch.cat(first)


def test_model_like_attention_is_held_by_a_few_keys_of_each_request_the_first_among_them():
    x = make_model_like_inputs(MODEL_DECODE, seed=2)
    lens = sorted(x.seq_lens.tolist())  # long, but for one of the shortest
    assert lens[0] == MODEL_DECODE.qlen and lens[-1] == MODEL_DECODE.kv_len
    assert lens[1] >= MODEL_DECODE.kv_len // 2
    shared, first = request_keys_mass(x)
    assert float(shared.median()) > 0.5 and float(first.median()) > 0.05
    # Standard normal data peaks too (its scores spread widely), but on other keys per row.
    shared, first = request_keys_mass(make_inputs(MODEL_DECODE, seed=2, ragged=True))
    assert float(shared.median()) < 0.1 and float(first.median()) < 0.01


@pytest.mark.parametrize("problem", [MODEL_DECODE, MODEL_DECODE.with_(
    phase="prefill", qlen=24, kv_len=40, dcp_size=1, page_size=1, q_dtype="fp8_e4m3fn")],
    ids=["decode", "prefill"])
def test_model_like_inputs_are_deterministic_per_seed(problem):
    a, b, c = (make_model_like_inputs(problem, seed=s) for s in (5, 5, 6))
    for x, y in ((a, b), (a, c)):
        same = [torch.equal(x.q.view(torch.uint8), y.q.view(torch.uint8))]
        if problem.phase == "decode":
            same += [torch.equal(s.kv_cache.view(torch.uint8), t.kv_cache.view(torch.uint8))
                     and torch.equal(s.block_table, t.block_table)
                     for s, t in zip(x.shards, y.shards, strict=True)]
        else:
            same += [torch.equal(x.k.view(torch.uint8), y.k.view(torch.uint8)),
                     torch.equal(x.cu_seqlens_k, y.cu_seqlens_k)]
        assert all(same) == (x is a and y is b)
