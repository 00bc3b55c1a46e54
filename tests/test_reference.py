"""Properties of the reference, in fp64 on random inputs."""

import pytest
import torch
import torch.nn.functional as F

from mlatune.check import reference
from mlatune.check.inputs import DecodeInputs, KVShard, make_decode_inputs, make_prefill_inputs
from mlatune.lse import combine
from mlatune.problem import MLAProblem
from tests.helpers import dense_kv, paged, unsharded

F64 = torch.float64


def close(a, b, tol=1e-10):
    assert a.shape == b.shape
    finite = torch.isfinite(b)
    assert torch.equal(finite, torch.isfinite(a))
    assert torch.allclose(a[finite], b[finite], atol=tol, rtol=tol)


def sdpa_rows(q, k, v, mask, scale):
    """Independent check: torch SDPA on (H, T, D) with an explicit boolean mask."""
    return F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1),
                                          v.transpose(0, 1), attn_mask=mask,
                                          scale=scale).transpose(0, 1)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("qlen", [1, 3])
def test_decode_matches_sdpa_on_dense_kv(causal, qlen):
    p = MLAProblem(num_heads=4, qlen=qlen, batch=3, kv_len=37, page_size=8, causal=causal)
    inputs = make_decode_inputs(p, seed=1, ragged=True)
    out, lse = reference.decode(inputs, F64)
    for b, kv in enumerate(dense_kv(inputs)):
        L = kv.shape[0]
        q = inputs.q[b * qlen:(b + 1) * qlen].to(F64)
        k = kv.to(F64)[:, None, :].expand(-1, p.num_heads, -1)
        mask = torch.ones(qlen, L, dtype=torch.bool)
        if causal:
            mask = torch.arange(L)[None, :] <= (L - qlen + torch.arange(qlen))[:, None]
        want = sdpa_rows(q, k, k[..., :512], mask, p.softmax_scale)
        close(out[b * qlen:(b + 1) * qlen], want)
        scores = torch.einsum("thd,nhd->thn", q, k) * p.softmax_scale
        close(lse[b * qlen:(b + 1) * qlen],
              torch.logsumexp(scores.masked_fill(~mask[:, None], -torch.inf), -1))


def test_causal_verify_block_equals_separate_truncated_decodes():
    qlen = 4
    p = MLAProblem(num_heads=3, qlen=qlen, batch=3, kv_len=29, page_size=4)
    inputs = make_decode_inputs(p, seed=2, ragged=True)
    out, lse = reference.decode(inputs, F64)
    shard = inputs.shards[0]
    one = p.with_(qlen=1)
    for t in range(qlen):
        rows = torch.arange(p.batch) * qlen + t
        truncated = inputs.seq_lens - qlen + t + 1
        single = DecodeInputs(one, inputs.q[rows], None, None, truncated,
                              (KVShard(0, shard.kv_cache, shard.block_table, truncated),))
        o, s = reference.decode(single, F64)
        close(out[rows], o)
        close(lse[rows], s)


def test_non_causal_block_sees_every_key():
    p = MLAProblem(num_heads=2, qlen=3, batch=2, kv_len=20, page_size=4, causal=False)
    inputs = make_decode_inputs(p, seed=3, ragged=True)
    out, _ = reference.decode(inputs, F64)
    shard = inputs.shards[0]
    one = p.with_(qlen=1)
    for t in range(3):
        rows = torch.arange(p.batch) * 3 + t
        single = DecodeInputs(one, inputs.q[rows], None, None, inputs.seq_lens, (shard,))
        close(out[rows], reference.decode(single, F64)[0])


@pytest.mark.parametrize("dcp", [1, 2, 4, 8])
@pytest.mark.parametrize("qlen", [1, 3])
def test_dcp_shard_and_merge_equals_unsharded(dcp, qlen):
    # Uneven lengths, some shorter than dcp, so some ranks hold nothing of a request.
    p = MLAProblem(num_heads=2, qlen=qlen, batch=5, kv_len=23, dcp_size=dcp, page_size=2)
    inputs = make_decode_inputs(p, seed=4 + dcp, ragged=True)
    inputs = DecodeInputs(p, inputs.q, None, None, inputs.seq_lens, inputs.shards)
    merged = reference.decode(inputs, F64)
    flat = unsharded(inputs)
    want = reference.decode(flat, F64)
    close(merged[0], want[0])
    close(merged[1], want[1])
    # Each rank's partial is attention over exactly the keys at positions = rank (mod dcp).
    dense = dense_kv(inputs)
    for shard in inputs.shards:
        out_r, lse_r = reference.decode_shard(inputs, shard, F64)
        for b, kv in enumerate(dense):
            L = kv.shape[0]
            pos = torch.arange(L)[shard.rank::dcp]
            last = L - qlen + torch.arange(qlen) if p.causal else torch.full((qlen,), L - 1)
            k = kv[pos].to(F64)[:, None, :]
            o, s = reference.attend(inputs.q[b * qlen:(b + 1) * qlen].to(F64), k, k[..., :512],
                                    pos, last, p.softmax_scale)
            close(out_r[b * qlen:(b + 1) * qlen], o)
            close(lse_r[b * qlen:(b + 1) * qlen], s)


def test_dcp_rank_with_no_tokens_gives_zero_and_neg_inf():
    p = MLAProblem(num_heads=1, qlen=1, batch=1, kv_len=1, dcp_size=4, page_size=1)
    inputs = make_decode_inputs(p, seed=5)
    out, lse = reference.decode_shard(inputs, inputs.shards[3], F64)
    assert torch.all(out == 0) and torch.all(torch.isneginf(lse))
    merged, merged_lse = reference.decode(inputs, F64)
    assert torch.isfinite(merged).all() and torch.isfinite(merged_lse).all()


@pytest.mark.parametrize("page_size", [1, 16, 64])
def test_page_size_and_permutation_do_not_change_the_answer(page_size):
    p = MLAProblem(num_heads=4, qlen=2, batch=3, kv_len=70, page_size=8)
    inputs = make_decode_inputs(p, seed=6, ragged=True)
    want = reference.decode(inputs, F64)
    for seed in (1, 2):
        shard = paged(dense_kv(inputs), page_size, seed)
        again = DecodeInputs(p.with_(page_size=page_size), inputs.q, None, None,
                             inputs.seq_lens, (shard,))
        got = reference.decode(again, F64)
        close(got[0], want[0])
        close(got[1], want[1])


@pytest.mark.parametrize("q_dtype", ["bf16", "fp8_e4m3fn"])
def test_fp8_equals_computation_on_dequantized_values(q_dtype):
    p = MLAProblem(num_heads=2, qlen=2, batch=2, kv_len=40, page_size=16, q_dtype=q_dtype,
                   kv_dtype="fp8_e4m3fn", dcp_size=2)
    inputs = make_decode_inputs(p, seed=7, ragged=True)
    assert inputs.kv_scale is not None and float(inputs.kv_scale) != 1.0
    got = reference.decode(inputs, F64)
    q = inputs.q.to(F64) * (inputs.q_scale.to(F64) if inputs.q_scale is not None else 1.0)
    shards = tuple(KVShard(s.rank, s.kv_cache.to(F64) * inputs.kv_scale.to(F64), s.block_table,
                           s.seq_lens) for s in inputs.shards)
    want = reference.decode(DecodeInputs(p, q, None, None, inputs.seq_lens, shards), F64)
    close(got[0], want[0])
    close(got[1], want[1])
    # The scale matters: dropping it changes the answer.
    unscaled = DecodeInputs(p, inputs.q, inputs.q_scale, None, inputs.seq_lens, inputs.shards)
    assert not torch.allclose(reference.decode(unscaled, F64)[0], got[0], atol=1e-3)


@pytest.mark.parametrize("causal", [True, False])
def test_prefill_matches_sdpa(causal):
    p = MLAProblem(phase="prefill", num_heads=3, qlen=9, kv_len=13, batch=3, page_size=1,
                   causal=causal)
    inputs = make_prefill_inputs(p, seed=8, ragged=True)
    out, lse = reference.prefill(inputs, F64)
    assert out.shape == (inputs.q.shape[0], 3, 128)
    cu_q, cu_k = inputs.cu_seqlens_q.tolist(), inputs.cu_seqlens_k.tolist()
    for b in range(p.batch):
        q = inputs.q[cu_q[b]:cu_q[b + 1]].to(F64)
        k = inputs.k[cu_k[b]:cu_k[b + 1]].to(F64)
        v = inputs.v[cu_k[b]:cu_k[b + 1]].to(F64)
        tq, tk = q.shape[0], k.shape[0]
        mask = torch.ones(tq, tk, dtype=torch.bool)
        if causal:  # bottom-right aligned: the queries are the last tq of tk tokens
            mask = torch.arange(tk)[None, :] <= (tk - tq + torch.arange(tq))[:, None]
        close(out[cu_q[b]:cu_q[b + 1]], sdpa_rows(q, k, v, mask, p.softmax_scale))
        scores = torch.einsum("thd,nhd->thn", q, k) * p.softmax_scale
        close(lse[cu_q[b]:cu_q[b + 1]],
              torch.logsumexp(scores.masked_fill(~mask[:, None], -torch.inf), -1))


def test_prefill_fp8_uses_all_three_scales():
    p = MLAProblem(phase="prefill", num_heads=2, qlen=8, kv_len=8, batch=2, page_size=1,
                   q_dtype="fp8_e4m3fn", kv_dtype="fp8_e4m3fn")
    inputs = make_prefill_inputs(p, seed=9)
    got = reference.prefill(inputs, F64)[0]
    scales = [float(s) for s in (inputs.q_scale, inputs.k_scale, inputs.v_scale)]
    assert len(set(scales)) == 3  # distinct, so a swapped scale is caught
    deq = [t.to(F64) * s for t, s in zip((inputs.q, inputs.k, inputs.v), scales, strict=True)]
    plain = type(inputs)(p, *deq, None, None, None, inputs.cu_seqlens_q, inputs.cu_seqlens_k)
    close(got, reference.prefill(plain, F64)[0])


def test_merge_partials_of_a_split_equals_the_whole():
    gen = torch.Generator().manual_seed(10)
    q = torch.randn(2, 3, 8, generator=gen, dtype=F64)
    k = torch.randn(11, 1, 8, generator=gen, dtype=F64)
    pos = torch.arange(11)
    last = torch.tensor([9, 10])
    whole = reference.attend(q, k, k, pos, last, 0.3)
    idx = torch.randperm(11, generator=gen)
    parts = [reference.attend(q, k[i], k[i], pos[i], last, 0.3) for i in (idx[:4], idx[4:])]
    merged = combine([o for o, _ in parts], [s for _, s in parts])
    close(merged[0], whole[0])
    close(merged[1], whole[1])


@pytest.mark.parametrize(("ragged", "causal", "dcp", "kv_len"),
                         [(False, True, 2, 40), (True, True, 2, 40), (True, False, 2, 40),
                          (True, True, 4, 6)])
def test_requests_attended_together_or_in_small_calls_agree(monkeypatch, ragged, causal, dcp,
                                                            kv_len):
    """Requests go through attend together, padded to the longest of a call and cut
    into calls of bounded size; the padding and the cut change nothing (here down to
    one request per call). kv_len 6 over 4 ranks leaves some requests no key on a rank."""
    p = MLAProblem(num_heads=4, qlen=2, batch=6, kv_len=kv_len, dcp_size=dcp, page_size=2,
                   causal=causal)
    inputs = make_decode_inputs(p, seed=11, ragged=ragged)
    together = reference.decode(inputs, F64)
    monkeypatch.setattr(reference, "_ELEMENTS_PER_CALL", 1)
    one_by_one = reference.decode(inputs, F64)
    close(together[0], one_by_one[0])
    close(together[1], one_by_one[1])


def test_padding_keys_are_masked_by_length_not_only_by_position(monkeypatch):
    """A shard whose lengths stop short of its requests' windows (as a truncated
    verify block's does) attends only its own keys when padded to a longer request."""
    p = MLAProblem(num_heads=2, qlen=1, batch=4, kv_len=32, page_size=4, causal=False)
    inputs = make_decode_inputs(p, seed=5, ragged=False)
    shard = inputs.shards[0]
    short = torch.tensor([32, 9, 20, 3], dtype=torch.int32)
    cut = DecodeInputs(p, inputs.q, None, None, inputs.seq_lens,
                       (KVShard(0, shard.kv_cache, shard.block_table, short),))
    together = reference.decode(cut, F64)
    monkeypatch.setattr(reference, "_ELEMENTS_PER_CALL", 1)  # one request per call, unpadded
    alone = reference.decode(cut, F64)
    close(together[0], alone[0])
    close(together[1], alone[1])


@pytest.mark.parametrize("dcp", [1, 2])
def test_nan_in_q_reaches_its_output_row_and_lse(dcp):
    """A NaN was turned into a row of zeros (the guard for empty rows zeroed every
    non-finite row, and the DCP merge zeroed NaN weights): it must come out as NaN."""
    p = MLAProblem(num_heads=2, qlen=2, batch=2, kv_len=9, page_size=4, dcp_size=dcp)
    inputs = make_decode_inputs(p, seed=12)
    q = inputs.q.clone()
    q[3, 1, 5] = float("nan")  # request 1, token 1, kernel head 1
    out, lse = reference.decode(DecodeInputs(p, q, None, None, inputs.seq_lens, inputs.shards),
                                F64)
    hit = torch.zeros(lse.shape, dtype=torch.bool)
    hit[3, 1] = True
    assert torch.isnan(out[hit]).all() and torch.isnan(lse[hit]).all()
    assert torch.isfinite(out[~hit]).all() and torch.isfinite(lse[~hit]).all()


def test_nan_key_reaches_only_the_tokens_that_attend_it():
    """A NaN latent at key 5 of a causal verify block of 2 over 6 keys: token 1 attends
    it, token 0 does not (its weight 0 times NaN must not leak into its row)."""
    p = MLAProblem(num_heads=2, qlen=2, batch=1, kv_len=6, page_size=4)
    inputs = make_decode_inputs(p, seed=13)
    shard = inputs.shards[0]
    cache = shard.kv_cache.clone()
    cache[int(shard.block_table[0, 1]), 1, 0] = float("nan")  # global position 5
    poisoned = DecodeInputs(p, inputs.q, None, None, inputs.seq_lens,
                            (KVShard(0, cache, shard.block_table, shard.seq_lens),))
    out, lse = reference.decode(poisoned, F64)
    want_out, want_lse = reference.decode(inputs, F64)
    close(out[0], want_out[0])
    close(lse[0], want_lse[0])
    assert torch.isnan(out[1]).all() and torch.isnan(lse[1]).all()


def test_nan_in_q_of_a_rank_with_no_keys_keeps_zero_and_neg_inf():
    """The documented convention for a row that attends nothing holds whatever q holds."""
    p = MLAProblem(num_heads=1, qlen=1, batch=1, kv_len=1, dcp_size=4, page_size=1)
    inputs = make_decode_inputs(p, seed=5)
    q = torch.full_like(inputs.q, float("nan"))
    nan_q = DecodeInputs(p, q, None, None, inputs.seq_lens, inputs.shards)
    out, lse = reference.decode_shard(nan_q, nan_q.shards[3], F64)
    assert torch.all(out == 0) and torch.all(torch.isneginf(lse))
    merged, merged_lse = reference.decode(nan_q, F64)
    assert torch.isnan(merged).all() and torch.isnan(merged_lse).all()
