import pytest
import torch

from mlatune.check.inputs import make_decode_inputs, make_prefill_inputs, poison_, shard_lengths
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
