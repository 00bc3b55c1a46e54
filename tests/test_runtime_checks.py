"""decode's argument checks: each bad input an engine team met gets a DecodeArgumentError
that names the argument. Small CPU tensors; nothing is computed, so any dtype will do."""

from __future__ import annotations

import math

import pytest
import torch

from mlatune import errors
from mlatune.check.inputs import make_decode_inputs, shard_lengths
from mlatune.problem import MLAProblem
from mlatune.runtime_checks import (
    DecodeArgumentError,
    check_decode_args,
    check_length_values,
    checking_enabled,
    values_free_to_check,
)

LORA, ROPE = 32, 16  # a narrow latent keeps the tensors small
D_QK = LORA + ROPE
META = torch.device("meta")  # "another device" without a GPU
ALIASED = "its elements overlap each other"


def args(q_dtype: str = "bf16", kv_dtype: str = "bf16", *, dcp: int = 1, rank: int = 0,
         qlen: int = 1, batch: int = 3) -> dict:
    """Valid arguments of check_decode_args for one rank, from make_decode_inputs."""
    p = MLAProblem(num_heads=2, qlen=qlen, batch=batch, kv_len=40, page_size=8, dcp_size=dcp,
                   q_dtype=q_dtype, kv_dtype=kv_dtype, kv_lora_rank=LORA, rope_dim=ROPE)
    inputs = make_decode_inputs(p, 0, "cpu", ragged=True)
    shard = inputs.shards[rank]
    return dict(q=inputs.q, kv_cache=shard.kv_cache, block_table=shard.block_table,
                seq_lens=inputs.seq_lens, num_heads=2, qlen=qlen, dcp_rank=rank, dcp_size=dcp,
                kv_lora_rank=LORA, kv_scale=inputs.kv_scale, q_scale=inputs.q_scale)


def refused(arg: str, kwargs: dict, match: str = "") -> None:
    with pytest.raises(DecodeArgumentError, match=rf"^{arg}: {match}"):
        check_decode_args(**kwargs)


def test_the_error_is_a_value_error_kept_with_the_others():
    assert issubclass(DecodeArgumentError, ValueError)
    assert DecodeArgumentError is errors.DecodeArgumentError


# Valid calls ----------------------------------------------------------------------------

@pytest.mark.parametrize(("q_dtype", "kv_dtype"), [
    ("bf16", "bf16"), ("fp16", "fp16"), ("bf16", "fp8_e4m3fn"), ("fp8_e4m3fn", "fp8_e4m3fn"),
    ("fp16", "fp8_e4m3fnuz"), ("fp8_e4m3fnuz", "fp8_e4m3fnuz")])
@pytest.mark.parametrize(("dcp", "rank", "qlen"), [(1, 0, 1), (2, 1, 3), (4, 3, 2)])
def test_valid_arguments_pass(q_dtype, kv_dtype, dcp, rank, qlen):
    a = args(q_dtype, kv_dtype, dcp=dcp, rank=rank, qlen=qlen)
    check_decode_args(**a)
    rows, heads = a["q"].shape[:2]
    out_dtype = torch.bfloat16 if q_dtype.startswith("fp8") else a["q"].dtype
    check_decode_args(**a, softmax_scale=0.1, out=torch.empty(rows, heads, LORA, dtype=out_dtype),
                      lse_out=torch.empty(rows, heads))
    check_length_values(a["seq_lens"], a["block_table"], num_pages=a["kv_cache"].shape[0],
                        page_size=8, qlen=qlen, dcp_rank=rank, dcp_size=dcp)


def test_a_four_dim_cache_with_one_head_passes():
    a = args()
    cache = a["kv_cache"]
    check_decode_args(**a | dict(kv_cache=cache.view(cache.shape[0], 8, 1, D_QK)))


# fp8 scales -----------------------------------------------------------------------------

@pytest.mark.parametrize("kv_dtype", ["fp8_e4m3fn", "fp8_e4m3fnuz"])
def test_fp8_cache_without_its_scale(kv_dtype):
    refused("kv_scale", args("bf16", kv_dtype) | dict(kv_scale=None),
            rf"an fp8 kv_cache \({kv_dtype.replace('fp8', 'float8')}\) needs its per-tensor "
            r"scale, got None")


def test_fp8_q_without_its_scale():
    refused("q_scale", args("fp8_e4m3fn", "fp8_e4m3fn") | dict(q_scale=None), "an fp8 q")


@pytest.mark.parametrize("arg", ["kv_scale", "q_scale"])
def test_a_scale_for_a_16_bit_tensor_would_be_ignored(arg):
    refused(arg, args() | {arg: torch.ones(1)}, "a 16-bit")


@pytest.mark.parametrize(("scale", "match"), [
    (torch.ones(1, dtype=torch.float16), "must be float32"),
    (torch.ones(2), "must hold one"),
    (0.5, "must be a torch.Tensor or None")])
def test_a_malformed_scale(scale, match):
    refused("kv_scale", args("bf16", "fp8_e4m3fn") | dict(kv_scale=scale), match)


def test_a_one_element_scale_of_any_shape_passes():
    check_decode_args(**args("bf16", "fp8_e4m3fn") | dict(kv_scale=torch.ones(())))


# Index tensors and batch ----------------------------------------------------------------

def test_seq_lens_of_a_wrong_dtype():
    a = args()
    refused("seq_lens", a | dict(seq_lens=a["seq_lens"].long()), "must be int32")


def test_block_table_of_a_wrong_dtype():
    a = args()
    refused("block_table", a | dict(block_table=a["block_table"].long()), "must be int32")


def test_batch_zero():
    a = args()
    empty = dict(q=a["q"][:0], block_table=a["block_table"][:0], seq_lens=a["seq_lens"][:0])
    refused("block_table", a | empty, "batch 0")


@pytest.mark.parametrize(("arg", "make", "match"), [
    ("block_table", lambda a: a["block_table"][0], "must be 2-D"),
    ("seq_lens", lambda a: a["seq_lens"][:2], r"must be \(3,\)"),
    ("seq_lens", lambda a: a["seq_lens"][:, None], r"must be \(3,\)"),
    ("q", lambda a: a["q"][:2], r"must be \(batch \* qlen"),
    ("q", lambda a: a["q"][:, :1], r"must be .* = \(3, 2, 48\)"),
    ("q", lambda a: a["q"][..., :LORA], "must be"),
    ("q", lambda a: a["q"][0], "must be"),
    ("kv_cache", lambda a: a["kv_cache"][0], r"must be \(pages, page_size, d_qk\)"),
    ("kv_cache", lambda a: a["kv_cache"][:, :, None].expand(-1, -1, 2, -1), "must be"),
    ("kv_cache", lambda a: a["kv_cache"][:, :6].contiguous(), "page_size .* power of two"),
    ("kv_cache", lambda a: a["kv_cache"][..., :LORA].contiguous(), "d_qk .* must exceed"),
])
def test_wrong_shapes(arg, make, match):
    a = args()
    refused(arg, a | {arg: make(a)}, match)


def test_q_heads_count_every_dcp_rank():
    a = args(dcp=2)
    refused("q", a | dict(dcp_size=1, dcp_rank=0, q=a["q"]), r"must be .* = \(3, 2, 48\)")


# dtypes of q and the cache ----------------------------------------------------------------

@pytest.mark.parametrize(("arg", "q_dtype", "kv_dtype", "match"), [
    ("q", torch.float32, torch.bfloat16, "dtype float32 is not one of"),
    ("kv_cache", torch.bfloat16, torch.float32, "dtype float32 is not one of"),
    ("q", torch.bfloat16, torch.float16, "q_dtype must equal kv_dtype"),
    ("q", torch.float8_e4m3fn, torch.bfloat16, "q_dtype must equal kv_dtype"),
    ("q", torch.float8_e4m3fnuz, torch.float8_e4m3fn, "q_dtype .* mix fp8 formats"),
])
def test_dtypes_of_q_and_the_cache(arg, q_dtype, kv_dtype, match):
    a = args()
    scales = {"q_scale": torch.ones(1) if q_dtype.itemsize == 1 else None,
              "kv_scale": torch.ones(1) if kv_dtype.itemsize == 1 else None}
    refused(arg, a | scales | dict(q=a["q"].to(q_dtype), kv_cache=a["kv_cache"].to(kv_dtype)),
            match)


# Types, integers, devices ---------------------------------------------------------------

@pytest.mark.parametrize("arg", ["q", "kv_cache", "block_table", "seq_lens"])
def test_tensors_must_be_tensors(arg):
    a = args()
    refused(arg, a | {arg: a[arg].tolist()}, "must be a torch.Tensor, got list")


@pytest.mark.parametrize(("arg", "value", "match"), [
    ("qlen", 0, "must be >= 1"), ("num_heads", 0, "must be >= 1"),
    ("kv_lora_rank", 0, "must be >= 1"), ("dcp_size", 0, "must be >= 1"),
    ("dcp_rank", 1, r"must be in \[0, dcp_size\)"), ("dcp_rank", -1, "must be in"),
    ("num_heads", True, "must be an int"), ("qlen", 1.0, "must be an int")])
def test_integer_arguments(arg, value, match):
    refused(arg, args() | {arg: value}, match)


@pytest.mark.parametrize("arg", ["kv_cache", "block_table", "seq_lens", "kv_scale", "out",
                                 "lse_out"])
def test_every_tensor_on_q_device(arg):
    a = args("bf16", "fp8_e4m3fn")
    a |= dict(out=torch.empty(3, 2, LORA, dtype=torch.bfloat16), lse_out=torch.empty(3, 2))
    refused(arg, a | {arg: a[arg].to(META)}, "must be on q's device cpu, got meta")


# softmax_scale, out, lse_out ------------------------------------------------------------

@pytest.mark.parametrize("value", [0.0, -0.1, math.nan, math.inf, "0.1", torch.tensor(0.1),
                                   True])
def test_softmax_scale_must_be_a_finite_positive_float(value):
    refused("softmax_scale", args() | dict(softmax_scale=value))


@pytest.mark.parametrize(("q_dtype", "kv_dtype", "out_dtype", "match"), [
    ("bf16", "bf16", torch.float16, "must be bfloat16 for a bf16 q"),
    ("fp16", "fp16", torch.float32, "must be float16"),
    ("fp8_e4m3fn", "fp8_e4m3fn", torch.float8_e4m3fn, "must be bfloat16 for a fp8_e4m3fn q"),
    ("fp8_e4m3fn", "fp8_e4m3fn", torch.float16, "must be bfloat16")])
def test_out_dtype(q_dtype, kv_dtype, out_dtype, match):
    refused("out", args(q_dtype, kv_dtype) | dict(out=torch.empty(3, 2, LORA, dtype=out_dtype)),
            match)


@pytest.mark.parametrize(("out", "match"), [
    (torch.empty(3, 2, D_QK, dtype=torch.bfloat16), r"must be .* = \(3, 2, 32\)"),
    (torch.empty(3, 4, LORA, dtype=torch.bfloat16), "must be"),
    (torch.empty(LORA, 2, 3, dtype=torch.bfloat16).permute(2, 1, 0), "needs a contiguous last"),
    (torch.empty(1, 2, LORA, dtype=torch.bfloat16).expand(3, 2, LORA), ALIASED),
    (torch.empty(3, 1, LORA, dtype=torch.bfloat16).expand(3, 2, LORA), ALIASED),
    (torch.empty(4 * LORA, dtype=torch.bfloat16).as_strided((3, 2, LORA), (LORA, 8, 1)), ALIASED),
    (torch.empty(3, 2, LORA, dtype=torch.bfloat16).numpy, "must be a torch.Tensor or None")])
def test_out_shape_and_layout(out, match):
    refused("out", args() | dict(out=out), match)


@pytest.mark.parametrize(("lse_out", "match"), [
    (torch.empty(3, 2, dtype=torch.bfloat16), "must be float32"),
    (torch.empty(3, 4), r"must be \(batch \* qlen, num_heads \* dcp_size\) = \(3, 2\)"),
    (torch.empty(3, 2, 1), "must be"),
    (torch.empty(2, 3).t(), "needs a contiguous last"),
    (torch.empty(1, 2).expand(3, 2), ALIASED)])
def test_lse_out(lse_out, match):
    refused("lse_out", args() | dict(lse_out=lse_out), match)


# Layouts the kernels need ---------------------------------------------------------------

def test_outputs_that_are_views_into_a_wider_buffer_are_served():
    """A head-major out and views into a wider buffer place every element apart."""
    a = args()
    wide = torch.empty(3, 2, LORA + 8, dtype=torch.bfloat16)[..., :LORA]
    head_major = torch.empty(2, 3, LORA, dtype=torch.bfloat16).transpose(0, 1)
    lse_wide = torch.empty(3, 4)[:, :2]
    for out, lse_out in ((wide, lse_wide), (head_major, torch.empty(2, 3).t().contiguous())):
        check_decode_args(**a, out=out, lse_out=lse_out)


def test_layouts_the_kernels_need():
    a = args()
    q = torch.empty(D_QK, 2, 3, dtype=torch.bfloat16).permute(2, 1, 0)  # unit stride on rows
    refused("q", a | dict(q=q), "needs a contiguous last dimension")
    pages = a["kv_cache"].shape[0]
    wide = torch.empty(pages, 8, 2 * D_QK, dtype=torch.bfloat16)[..., :D_QK]
    refused("kv_cache", a | dict(kv_cache=wide), "must be contiguous")
    table = a["block_table"]
    refused("block_table", a | dict(block_table=table.t().contiguous().t()),
            "needs a contiguous last dimension")
    lens = torch.stack([a["seq_lens"], a["seq_lens"]], dim=1)[:, 0]
    refused("seq_lens", a | dict(seq_lens=lens), "must be contiguous")
    check_decode_args(**a | dict(q=q.contiguous(), seq_lens=lens.contiguous()))


# Value checks ---------------------------------------------------------------------------

def values(seq_lens, table, *, pages=16, page_size=2, qlen=1, rank=0, world=1) -> None:
    check_length_values(torch.tensor(seq_lens, dtype=torch.int32),
                        torch.tensor(table, dtype=torch.int32), num_pages=pages,
                        page_size=page_size, qlen=qlen, dcp_rank=rank, dcp_size=world)


# Requests of 1, 9 and 6 tokens in pages of 2: with 4 ranks request 0 has no token on
# ranks 1-3 (its first entry is unused there), request 1 uses 2 pages on rank 0 only;
# with 1 rank they use 1, 5 and 3 of their 5 entries.
LENS = [1, 9, 6]
TABLE = [[0, 1, 2, 3, 4], [5, 6, 7, 8, 9], [10, 11, 12, 13, 14]]


@pytest.mark.parametrize("world", [1, 2, 4])
@pytest.mark.parametrize("bad", [-1, 16, 2**31 - 1])
def test_a_page_outside_the_cache_is_caught_only_where_the_request_uses_it(world, bad):
    for rank in range(world):
        used = -(-shard_lengths(torch.tensor(LENS), rank, world) // 2)
        for b in range(len(LENS)):
            for j in range(len(TABLE[0])):
                table = [row[:] for row in TABLE]
                table[b][j] = bad
                if j < int(used[b]):
                    with pytest.raises(DecodeArgumentError, match=rf"^block_table: request {b} "
                                       rf"uses page id {bad} at position {j}, outside the "
                                       r"cache's 16 pages$"):
                        values(LENS, table, rank=rank, world=world)
                else:
                    values(LENS, table, rank=rank, world=world)


def test_the_message_names_the_first_offending_request():
    # Request 0's -5 is padding past its one page; requests 1 and 2 both use a bad id.
    table = [[0, -5, 2], [3, 4, 2**31 - 1], [-1, 7, 8]]
    with pytest.raises(DecodeArgumentError, match="request 1 uses page id 2147483647 at "
                                                  "position 2"):
        values([2, 6, 1], table)


def test_padding_past_the_used_pages_may_hold_anything():
    values([2, 3], [[5, -1, 2**31 - 1], [6, 7, 0]])


@pytest.mark.parametrize(("world", "rank", "length", "caught"), [
    (1, 0, 6, False), (1, 0, 7, True), (1, 0, 2**31 - 1, True),
    # 13 tokens over 2 ranks: 7 on rank 0 (past the table's 6), 6 on rank 1 (they fit);
    # 27 over 4: rank 3 holds positions 3, 7, ..., 23 (6 tokens), 28 adds position 27.
    (2, 0, 13, True), (2, 1, 13, False), (2, 1, 14, True),
    (4, 3, 27, False), (4, 3, 28, True), (4, 0, 25, True)])
def test_a_length_beyond_the_block_table(world, rank, length, caught):
    call = dict(seq_lens=[2, length], table=[[0, 1, 2], [3, 4, 5]], rank=rank, world=world)
    if caught:
        with pytest.raises(DecodeArgumentError, match=rf"^seq_lens: request 1 has length "
                           rf"{length}.*block_table's 3 columns of 2-token pages cover "
                           r"\(6 tokens\)"):
            values(**call)
    else:
        values(**call)


@pytest.mark.parametrize(("qlen", "length"), [(1, 0), (3, 0), (3, 2), (8, 7)])
def test_empty_and_short_requests_pass(qlen, length):
    """Length 0 (a graph bucket's padding) and lengths below qlen are served (0 and -inf
    where a token sees no key)."""
    values([8, length], [[0, 1, 2, 3], [4, 5, 6, 7]], qlen=qlen)
    values([0, 0], [[0, 1, 2, 3], [-1, -1, -1, -1]], qlen=qlen)


@pytest.mark.parametrize("length", [-1, -3, -(2**31)])
def test_a_negative_length(length):
    with pytest.raises(DecodeArgumentError, match=rf"^seq_lens: request 1 has length {length}; "
                                                  r"lengths are >= 0"):
        values([8, length], [[0, 1, 2, 3], [4, 5, 6, 7]])


def test_made_inputs_pass_the_value_checks_on_every_rank():
    for world in (1, 2, 4):
        for rank in range(world):
            a = args(dcp=world, rank=rank, qlen=2, batch=5)
            check_length_values(a["seq_lens"], a["block_table"],
                                num_pages=a["kv_cache"].shape[0], page_size=8, qlen=2,
                                dcp_rank=rank, dcp_size=world)


# When value checks run ------------------------------------------------------------------

def test_checking_enabled_reads_the_environment_each_call(monkeypatch):
    monkeypatch.delenv("MLATUNE_CHECK", raising=False)
    assert not checking_enabled()
    monkeypatch.setenv("MLATUNE_CHECK", "1")
    assert checking_enabled()
    monkeypatch.setenv("MLATUNE_CHECK", "0")
    assert not checking_enabled()


@pytest.mark.parametrize(("value", "on"), [
    ("1", True), ("true", True), ("TRUE", True), ("yes", True), ("On", True), (" on ", True),
    ("0", False), ("false", False), ("no", False), ("OFF", False), ("", False)])
def test_checking_enabled_reads_the_usual_words(monkeypatch, value, on):
    monkeypatch.setenv("MLATUNE_CHECK", value)
    assert checking_enabled() is on


@pytest.mark.parametrize("value", ["2", "enabled", "y", "ture", "1 0", "x" * 100])
def test_any_other_mlatune_check_is_an_error_naming_it(monkeypatch, value):
    monkeypatch.setenv("MLATUNE_CHECK", value)
    with pytest.raises(errors.SettingError, match=r"^MLATUNE_CHECK: '.{1,40}' is neither on"):
        checking_enabled()


def test_values_are_free_to_check_on_the_cpu_only():
    cpu = torch.zeros(2, dtype=torch.int32)
    assert values_free_to_check(cpu, cpu, None)
    assert not values_free_to_check(cpu, cpu.to(META))


def test_values_are_readable_on_the_cpu_and_never_without_values():
    from mlatune.runtime_checks import values_readable

    cpu = torch.zeros(2, dtype=torch.int32)
    assert values_readable(cpu, None, cpu)
    assert not values_readable(cpu, cpu.to(META))  # (no CUDA asked on a CPU-only torch)


# Outputs apart from inputs ------------------------------------------------------------

def test_outputs_over_inputs_are_refused_by_name():
    a = args()
    rows, heads = a["q"].shape[:2]
    n_out = rows * heads * LORA
    out_over_q = a["q"].view(-1)[:n_out].view(rows, heads, LORA)
    refused("out", a | dict(out=out_over_q), "shares memory with q ")
    cache_bytes = a["kv_cache"].view(-1).view(torch.uint8)
    lse_over_cache = cache_bytes[8:8 + rows * heads * 4].view(torch.float32).view(rows, heads)
    refused("lse_out", a | dict(lse_out=lse_over_cache), "shares memory with kv_cache ")


def test_outputs_beside_inputs_in_one_buffer_pass_and_one_shared_element_does_not():
    a = args()
    rows, heads, d_qk = a["q"].shape
    n_q, n_out = rows * heads * d_qk, rows * heads * LORA
    pool = torch.randn(n_q + n_out).to(a["q"].dtype)
    q = pool[:n_q].view(rows, heads, d_qk)
    check_decode_args(**a | dict(q=q, out=pool[n_q:].view(rows, heads, LORA)))
    last = pool[n_q - 1:n_q - 1 + n_out].view(rows, heads, LORA)  # q's last element
    refused("out", a | dict(q=q, out=last), "shares memory with q ")
