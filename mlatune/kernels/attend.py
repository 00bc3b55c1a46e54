"""Jit building blocks shared by the decode kernels.

Rows: a program holds ``BLOCK_M`` query rows of one row group (a request, or
one token of it). Row ``r`` of a group is token ``r // row_heads`` and layout
head ``r % row_heads``; layout heads may be padded copies of the real query
heads: layout head ``h`` reads query head ``(h // head_rep) % q_heads`` and,
on output, is kept only when ``h % head_rep == 0`` and ``h // head_rep <
q_heads`` (its real head is ``h // head_rep``). ``head_rep`` > 1 is the seed's
repeat_interleave padding, ``head_rep`` 1 with ``row_heads`` > ``q_heads`` its
tile-and-slice padding, and ``row_heads == q_heads`` no padding at all.

Keys: local key ``j`` of a paged shard is global position ``rank + j * world``.
A row attends the keys whose global position is at most its ``last_pos``.
Scores are kept in base 2: ``qk_scale`` already holds ``log2(e)``.

fp8 dots (``DOT_FP8``, an fp8 cache): the cache tile feeds the tensor cores as
stored, for both products. A 16-bit q is quantized per row (one fp32 scale per
(token, head) row, folded into that row's score multiplier, so an outlier head
costs no other row precision); P is scaled by ``P_SCALE`` before its cast to
fp8 so that small probabilities stay normal numbers, and the scale is divided
out with the row sum. Otherwise the tile is upcast to q's 16-bit type.
"""

from __future__ import annotations

import triton
import triton.language as tl

LOG2E = 1.4426950408889634
# A constexpr so that jit functions may read it as a global.
LN2 = tl.constexpr(0.6931471805599453)
# P (at most 1) times 128 stays below both e4m3 maxima (448 fn, 240 fnuz), and a power of
# two scales exactly; probabilities down to 2^-13 (fnuz 2^-14) keep 3 significand bits.
P_SCALE = tl.constexpr(128.0)
# A 16-bit q's remainder after its fp8 rounding is at most half an ulp (1/16 of the
# value); times 16 it is a second fp8 part within range (at most 256 under 448, 128 under 240).
LO_SCALE = tl.constexpr(16.0)
# The largest finite e4m3 value, by format: what a row's absolute maximum maps to.
E4M3_MAX = {"fp8_e4m3fn": 448.0, "fp8_e4m3fnuz": 240.0}


@triton.jit
def load_q_rows(q_ptr, tok_base, offs_m, rows, row_heads, head_rep, q_heads,
                stride_q_tok, stride_q_head,
                D_NOPE: tl.constexpr, D_ROPE: tl.constexpr, Q_FP8: tl.constexpr,
                DOT_FP8: tl.constexpr = False):
    """The latent (D_NOPE) and rope (D_ROPE) parts of a block of query rows (an fp8 q is
    upcast to fp16 unless the dots run in fp8)."""
    row_ok = offs_m < rows
    tok = offs_m // row_heads
    src_head = ((offs_m % row_heads) // head_rep) % q_heads
    base = (tok_base + tok).to(tl.int64) * stride_q_tok + src_head * stride_q_head
    d_nope = tl.arange(0, D_NOPE)
    d_rope = tl.arange(0, D_ROPE)
    q_nope = tl.load(q_ptr + base[:, None] + d_nope[None, :], mask=row_ok[:, None], other=0.0)
    q_rope = tl.load(q_ptr + base[:, None] + D_NOPE + d_rope[None, :], mask=row_ok[:, None],
                     other=0.0)
    if Q_FP8 and not DOT_FP8:
        # e4m3 values are exact in fp16; the dots then run in fp16 with fp32 accumulation.
        q_nope = q_nope.to(tl.float16)
        q_rope = q_rope.to(tl.float16)
    return q_nope, q_rope


@triton.jit
def qk_scale_and_v_scale(sm_scale_log2, q_scale_ptr, kv_scale_ptr,
                         HAS_Q_SCALE: tl.constexpr, HAS_KV_SCALE: tl.constexpr):
    """Score multiplier (softmax scale, log2(e) and fp8 descales) and the value descale."""
    qk_scale = sm_scale_log2
    v_scale = 1.0
    if HAS_Q_SCALE:
        qk_scale = qk_scale * tl.load(q_scale_ptr)
    if HAS_KV_SCALE:
        v_scale = tl.load(kv_scale_ptr)
        qk_scale = qk_scale * v_scale
    return qk_scale, v_scale


@triton.jit
def round_e4m3(x):
    """x rounded to 3 significand bits (e4m3's, subnormals below 2^-6 on e4m3fn's grid),
    in fp32, so that the cast to fp8 is exact. Done here, not by the cast, because the
    interpreter's cast loses the carry into the next binade (1.97 -> 1.0)."""
    a = tl.abs(x)
    e = tl.maximum(tl.floor(tl.log2(tl.maximum(a, 1e-30))), -6.0)
    ulp = tl.exp2(e - 3.0)
    r = tl.floor(a / ulp + 0.5) * ulp
    return tl.where(x < 0.0, -r, r)


@triton.jit
def split_fp8(x, inv_scale, fp8_dtype: tl.constexpr):
    """x * inv_scale (per row) as hi + lo / LO_SCALE, both fp8: ~7 significand bits."""
    x = x.to(tl.float32) * inv_scale[:, None]
    hi = round_e4m3(x)
    lo = round_e4m3((x - hi) * LO_SCALE)
    return hi.to(fp8_dtype), lo.to(fp8_dtype)


@triton.jit
def quantize_q_rows(q, row_scale, fp8_dtype: tl.constexpr, Q_FP8: tl.constexpr):
    """q^T for the fp8 walk as (hi, lo) fp8 parts: an fp8 q as it is (lo unused), a
    16-bit q divided by its row scale and split (``split_fp8``)."""
    if Q_FP8:
        return tl.trans(q), tl.trans(q)
    hi, lo = split_fp8(q, 1.0 / row_scale, fp8_dtype)
    return tl.trans(hi), tl.trans(lo)


@triton.jit
def row_scales(q_nope, q_rope, FP8_MAX: tl.constexpr):
    """Per row: the absolute maximum over the 576 dims over the largest e4m3 (1 for a zero
    row), so that the row's largest element maps to the format's largest."""
    a_nope = tl.max(tl.abs(q_nope.to(tl.float32)), 1)
    a_rope = tl.max(tl.abs(q_rope.to(tl.float32)), 1)
    amax = tl.maximum(a_nope, a_rope)
    return tl.where(amax > 0.0, amax / FP8_MAX, 1.0)


@triton.jit
def key_tile(bt_row_ptr, n0, end, stride_kv_page, stride_kv_tok, PAGE_SIZE: tl.constexpr,
             BLOCK_N: tl.constexpr):
    """Local keys [n0, n0 + BLOCK_N): indices, which are < end, and cache element offsets.

    ``n0`` is a multiple of BLOCK_N, so when a page holds at least BLOCK_N keys
    the tile lies in one page and needs one block-table entry; otherwise each
    key looks its page up.
    """
    offs_n = n0 + tl.arange(0, BLOCK_N)
    key_ok = offs_n < end
    if PAGE_SIZE >= BLOCK_N:
        page = tl.load(bt_row_ptr + n0 // PAGE_SIZE).to(tl.int64)
    else:
        page = tl.load(bt_row_ptr + offs_n // PAGE_SIZE, mask=key_ok, other=0).to(tl.int64)
    return offs_n, key_ok, page * stride_kv_page + (offs_n % PAGE_SIZE) * stride_kv_tok


@triton.jit
def attend_rows(q_nope, q_rope, qk_scale, v_scale, last_pos, kv_ptr, bt_row_ptr, start, end,
                rank, world, stride_kv_page, stride_kv_tok, D_NOPE: tl.constexpr,
                D_ROPE: tl.constexpr, PAGE_SIZE: tl.constexpr, BLOCK_M: tl.constexpr,
                BLOCK_N: tl.constexpr, KV_TWICE: tl.constexpr, Q_FP8: tl.constexpr,
                DOT_FP8: tl.constexpr, FP8_MAX: tl.constexpr):
    """A block of rows over local keys [start, end): (acc, m, l, output multiplier), by the
    16-bit walk (``attend_keys``) or, with ``DOT_FP8``, the fp8 one (``attend_keys_fp8``)."""
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    if DOT_FP8:
        fp8: tl.constexpr = kv_ptr.dtype.element_ty
        row_scale = tl.full([BLOCK_M], 1.0, dtype=tl.float32)
        if not Q_FP8:
            row_scale = row_scales(q_nope, q_rope, FP8_MAX)
        qn_hi, qn_lo = quantize_q_rows(q_nope, row_scale, fp8, Q_FP8)
        qr_hi, qr_lo = quantize_q_rows(q_rope, row_scale, fp8, Q_FP8)
        acc_t = tl.zeros([D_NOPE, BLOCK_M], dtype=tl.float32)
        acc_t, m_i, l_i = attend_keys_fp8(acc_t, m_i, l_i, qn_hi, qn_lo, qr_hi, qr_lo,
                                          qk_scale * row_scale, last_pos, kv_ptr, bt_row_ptr,
                                          start, end, rank, world, stride_kv_page,
                                          stride_kv_tok, D_NOPE, D_ROPE, PAGE_SIZE, BLOCK_M,
                                          BLOCK_N, not Q_FP8, KV_TWICE)
        acc = tl.trans(acc_t)
        v_scale = v_scale / P_SCALE
    else:
        acc = tl.zeros([BLOCK_M, D_NOPE], dtype=tl.float32)
        acc, m_i, l_i = attend_keys(acc, m_i, l_i, q_nope, q_rope, last_pos, kv_ptr,
                                    bt_row_ptr, start, end, rank, world, qk_scale,
                                    stride_kv_page, stride_kv_tok, D_NOPE, D_ROPE, PAGE_SIZE,
                                    BLOCK_N, KV_TWICE)
    return acc, m_i, l_i, v_scale


@triton.jit
def attend_keys_fp8(acc_t, m_i, l_i, qn_hi, qn_lo, qr_hi, qr_lo, qk_scale, last_pos, kv_ptr,
                    bt_row_ptr, start, end, rank, world, stride_kv_page, stride_kv_tok,
                    D_NOPE: tl.constexpr, D_ROPE: tl.constexpr, PAGE_SIZE: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HI_LO: tl.constexpr,
                    KV_TWICE: tl.constexpr):
    """``attend_keys`` over an fp8 cache with fp8 MMAs, transposed: keys are the MMA rows.

    Hopper's fp8 wgmma reads only K-major operands from shared memory and needs
    64 MMA rows. Scores as k @ q^T put the cache tile in A, K-major as stored,
    and the keys in the rows, however few query rows there are; values as
    v^T @ P^T put the tile (MN-major for this product) in A again, which may
    come from registers, and P^T in B. q^T comes as fp8 (hi, lo) parts
    (``HI_LO``: lo counts 1 / LO_SCALE), ``qk_scale`` is per row, acc_t is
    (D_NOPE, rows) and P is rounded to fp8 times P_SCALE.

    One load of the tile cannot be copied asynchronously into both layouts, so
    Triton loads it into registers, unpipelined. ``KV_TWICE`` loads it twice:
    as k for the scores (pipelined by cp.async into shared memory) and, first,
    as v^T into registers, whose latency the scores and the softmax then hide.
    """
    d_nope = tl.arange(0, D_NOPE)
    d_rope = tl.arange(0, D_ROPE)
    for n0 in range(start, end, BLOCK_N):
        offs_n, key_ok, key_off = key_tile(bt_row_ptr, n0, end, stride_kv_page, stride_kv_tok,
                                           PAGE_SIZE, BLOCK_N)
        # Masked so that stale slots past the end (NaN in a real cache) never reach P @ V.
        if KV_TWICE:
            v_t = tl.load(kv_ptr + key_off[None, :] + d_nope[:, None], mask=key_ok[None, :],
                          other=0.0)
        k_nope = tl.load(kv_ptr + key_off[:, None] + d_nope[None, :], mask=key_ok[:, None],
                         other=0.0)
        k_rope = tl.load(kv_ptr + key_off[:, None] + D_NOPE + d_rope[None, :],
                         mask=key_ok[:, None], other=0.0)
        if not KV_TWICE:
            v_t = tl.trans(k_nope)
        s = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
        if HI_LO:
            s = tl.dot(k_nope, qn_lo, s)
            s = tl.dot(k_rope, qr_lo, s) * (1.0 / LO_SCALE)
        s = tl.dot(k_nope, qn_hi, s)
        s = tl.dot(k_rope, qr_hi, s)
        s = s * qk_scale[None, :]
        key_pos = rank + offs_n * world
        allowed = (key_pos[:, None] <= last_pos[None, :]) & key_ok[:, None]
        s = tl.where(allowed, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 0))
        m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_shift)
        p = tl.exp2(s - m_shift[None, :])
        l_i = l_i * alpha + tl.sum(p, 0)
        acc_t = acc_t * alpha[None, :]
        acc_t = tl.dot(v_t, (p * P_SCALE).to(k_nope.dtype), acc_t)
        m_i = m_new
    return acc_t, m_i, l_i


@triton.jit
def attend_keys(acc, m_i, l_i, q_nope, q_rope, last_pos, kv_ptr, bt_row_ptr, start, end,
                rank, world, qk_scale, stride_kv_page, stride_kv_tok,
                D_NOPE: tl.constexpr, D_ROPE: tl.constexpr, PAGE_SIZE: tl.constexpr,
                BLOCK_N: tl.constexpr, KV_TWICE: tl.constexpr):
    """Online softmax (base 2) over local keys [start, end) of one request's pages.

    ``start`` is a multiple of BLOCK_N (see ``key_tile``). ``KV_TWICE`` loads the
    tile twice, transposed for the scores and upright for the values, so that
    each load feeds one dot directly (the upcast of an fp8 tile can then stay
    next to its dot); otherwise one load serves both.
    """
    d_nope = tl.arange(0, D_NOPE)
    d_rope = tl.arange(0, D_ROPE)
    for n0 in range(start, end, BLOCK_N):
        offs_n, key_ok, key_off = key_tile(bt_row_ptr, n0, end, stride_kv_page, stride_kv_tok,
                                           PAGE_SIZE, BLOCK_N)
        # Masked so that stale slots past the end (NaN in a real cache) never reach P @ V.
        if KV_TWICE:
            k_t = tl.load(kv_ptr + key_off[None, :] + d_nope[:, None], mask=key_ok[None, :],
                          other=0.0).to(q_nope.dtype)
            k_rope_t = tl.load(kv_ptr + key_off[None, :] + D_NOPE + d_rope[:, None],
                               mask=key_ok[None, :], other=0.0).to(q_nope.dtype)
            s = tl.dot(q_nope, k_t)
            s = tl.dot(q_rope, k_rope_t, s)
        else:
            k_nope = tl.load(kv_ptr + key_off[:, None] + d_nope[None, :], mask=key_ok[:, None],
                             other=0.0).to(q_nope.dtype)
            k_rope = tl.load(kv_ptr + key_off[:, None] + D_NOPE + d_rope[None, :],
                             mask=key_ok[:, None], other=0.0).to(q_nope.dtype)
            s = tl.dot(q_nope, tl.trans(k_nope))
            s = tl.dot(q_rope, tl.trans(k_rope), s)
        s = s * qk_scale
        key_pos = rank + offs_n * world
        allowed = (key_pos[None, :] <= last_pos[:, None]) & key_ok[None, :]
        s = tl.where(allowed, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        # A row with no key yet keeps m = -inf; shift by 0 there so exp2 gives 0, not NaN.
        m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_shift)
        p = tl.exp2(s - m_shift[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None]
        if KV_TWICE:
            v = tl.load(kv_ptr + key_off[:, None] + d_nope[None, :], mask=key_ok[:, None],
                        other=0.0).to(q_nope.dtype)
        else:
            v = k_nope
        acc = tl.dot(p.to(v.dtype), v, acc)
        m_i = m_new
    return acc, m_i, l_i


@triton.jit
def normalize(acc, m_i, l_i, v_scale):
    """Normalized output (times the value descale) and base-2 LSE; empty rows give 0, -inf."""
    has_keys = l_i > 0.0
    inv = tl.where(has_keys, v_scale / tl.where(has_keys, l_i, 1.0), 0.0)
    lse2 = tl.where(has_keys, m_i + tl.log2(tl.where(has_keys, l_i, 1.0)), float("-inf"))
    return acc * inv[:, None], lse2


@triton.jit
def store_final_rows(out_ptr, lse_ptr, o, lse2, tok_base, offs_m, rows, row_heads, head_rep,
                     q_heads, stride_o_tok, stride_o_head, stride_lse_tok,
                     D_V: tl.constexpr, WRITE_LSE: tl.constexpr):
    """Store the kept (real-head) rows into out (tokens, heads, D_V) and natural-log LSE."""
    head = offs_m % row_heads
    tok = (tok_base + offs_m // row_heads).to(tl.int64)
    keep = (offs_m < rows) & (head % head_rep == 0) & (head // head_rep < q_heads)
    dst = head // head_rep
    d = tl.arange(0, D_V)
    ptrs = out_ptr + (tok * stride_o_tok + dst * stride_o_head)[:, None] + d[None, :]
    tl.store(ptrs, o.to(out_ptr.dtype.element_ty), mask=keep[:, None])
    if WRITE_LSE:
        tl.store(lse_ptr + tok * stride_lse_tok + dst, lse2 * LN2, mask=keep)
