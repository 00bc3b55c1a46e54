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

An fp8 cache tile is upcast to q's 16-bit type (fp16 for an fp8 q) as it is
loaded; the dots run in 16 bits with fp32 accumulation.
"""

from __future__ import annotations

import triton
import triton.language as tl

from mlatune import lse

LOG2E = lse.LOG2E
# A constexpr so that jit functions may read it as a global.
LN2 = tl.constexpr(lse.LN2)


@triton.jit
def load_q_rows(q_ptr, tok_base, offs_m, rows, row_heads, head_rep, q_heads,
                stride_q_tok, stride_q_head,
                D_NOPE: tl.constexpr, D_ROPE: tl.constexpr, Q_FP8: tl.constexpr):
    """The latent (D_NOPE) and rope (D_ROPE) parts of a block of query rows."""
    row_ok = offs_m < rows
    tok = offs_m // row_heads
    src_head = ((offs_m % row_heads) // head_rep) % q_heads
    base = (tok_base + tok).to(tl.int64) * stride_q_tok + src_head * stride_q_head
    d_nope = tl.arange(0, D_NOPE)
    d_rope = tl.arange(0, D_ROPE)
    q_nope = tl.load(q_ptr + base[:, None] + d_nope[None, :], mask=row_ok[:, None], other=0.0)
    q_rope = tl.load(q_ptr + base[:, None] + D_NOPE + d_rope[None, :], mask=row_ok[:, None],
                     other=0.0)
    if Q_FP8:
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
def attend_rows(q_nope, q_rope, qk_scale, last_pos, kv_ptr, bt_row_ptr, start, end, rank,
                world, stride_kv_page, stride_kv_tok, D_NOPE: tl.constexpr,
                D_ROPE: tl.constexpr, PAGE_SIZE: tl.constexpr, BLOCK_M: tl.constexpr,
                BLOCK_N: tl.constexpr, KV_TWICE: tl.constexpr):
    """A block of rows over local keys [start, end) from an empty state: (acc, m, l)."""
    acc = tl.zeros([BLOCK_M, D_NOPE], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    return attend_keys(acc, m_i, l_i, q_nope, q_rope, last_pos, kv_ptr, bt_row_ptr, start, end,
                       rank, world, qk_scale, stride_kv_page, stride_kv_tok, D_NOPE, D_ROPE,
                       PAGE_SIZE, BLOCK_N, KV_TWICE)


@triton.jit
def attend_keys(acc, m_i, l_i, q_nope, q_rope, last_pos, kv_ptr, bt_row_ptr, start, end,
                rank, world, qk_scale, stride_kv_page, stride_kv_tok,
                D_NOPE: tl.constexpr, D_ROPE: tl.constexpr, PAGE_SIZE: tl.constexpr,
                BLOCK_N: tl.constexpr, KV_TWICE: tl.constexpr):
    """Online softmax (base 2) over local keys [start, end) of one request's pages.

    ``start`` is a multiple of BLOCK_N, so when a page holds at least BLOCK_N
    keys every tile lies in one page and needs one block-table entry;
    otherwise each key of the tile looks its page up. ``KV_TWICE`` loads the
    tile twice, transposed for the scores and upright for the values, so that
    each load feeds one dot directly (the upcast of an fp8 tile can then stay
    next to its dot); otherwise one load serves both.
    """
    d_nope = tl.arange(0, D_NOPE)
    d_rope = tl.arange(0, D_ROPE)
    for n0 in range(start, end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        key_ok = offs_n < end
        if PAGE_SIZE >= BLOCK_N:
            page = tl.load(bt_row_ptr + n0 // PAGE_SIZE).to(tl.int64)
            key_off = page * stride_kv_page + (offs_n % PAGE_SIZE) * stride_kv_tok
        else:
            page = tl.load(bt_row_ptr + offs_n // PAGE_SIZE, mask=key_ok, other=0).to(tl.int64)
            key_off = page * stride_kv_page + (offs_n % PAGE_SIZE) * stride_kv_tok
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
