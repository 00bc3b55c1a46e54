import pytest
from hypothesis import given
from hypothesis import strategies as st

from mlatune.problem import BUCKET_FIELDS, DTYPES, KEY_FIELDS, MLAProblem


def test_defaults_and_derived_dims():
    p = MLAProblem()
    assert (p.d_qk, p.d_v) == (576, 512)
    assert p.softmax_scale == pytest.approx(192 ** -0.5)
    pre = MLAProblem(phase="prefill", qlen=128, kv_len=128)
    assert (pre.d_qk, pre.d_v) == (192, 128)
    assert MLAProblem(num_heads=16, dcp_size=4, kv_len=4096).kernel_heads == 64
    assert MLAProblem(q_dtype="fp8_e4m3fn", kv_dtype="fp8_e4m3fn").out_dtype == "bf16"


def test_key_is_canonical_and_stable():
    p = MLAProblem(num_heads=16, qlen=2, batch=4, kv_len=1024, kv_dtype="fp8_e4m3fn",
                   dcp_size=2, page_size=1)
    assert p.key == ("phase=decode|num_heads=16|qlen=2|q_dtype=bf16|kv_dtype=fp8_e4m3fn|causal=1|"
                     "dcp_size=2|page_size=1|batch=4|kv_len=1024|d_qk=576|d_v=512")
    assert tuple(p.key_dict()) == KEY_FIELDS
    assert len(p.bucket) == len(BUCKET_FIELDS)
    assert p.bucket == p.with_(batch=64, kv_len=8192).bucket
    assert p.bucket != p.with_(qlen=3).bucket


problems = st.builds(
    MLAProblem,
    phase=st.just("decode"),
    num_heads=st.integers(1, 128),
    qlen=st.integers(1, 8),
    q_dtype=st.just("bf16"),
    kv_dtype=st.sampled_from(["bf16", "fp8_e4m3fn", "fp8_e4m3fnuz"]),
    batch=st.integers(1, 512),
    kv_len=st.integers(8, 1 << 17),
    dcp_size=st.integers(1, 8),
    causal=st.booleans(),
    page_size=st.sampled_from([1, 16, 64, 256]),
)


@given(problems)
def test_key_round_trips(p):
    assert MLAProblem.from_key_dict(p.key_dict()) == p
    # A table stores strings and numpy scalars; the rebuild must take them too.
    as_text = {k: str(v) if k != "causal" else str(int(v)) for k, v in p.key_dict().items()}
    assert MLAProblem.from_key_dict(as_text) == p


def test_prefill_key_round_trips():
    p = MLAProblem(phase="prefill", num_heads=128, qlen=2048, kv_len=2048, page_size=1,
                   q_dtype="fp8_e4m3fn", kv_dtype="fp8_e4m3fn")
    assert MLAProblem.from_key_dict(p.key_dict()) == p


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        ({"num_heads": 0}, "num_heads"),
        ({"num_heads": -4}, "num_heads"),
        ({"qlen": 0}, "qlen"),
        ({"qlen": 9, "kv_len": 8}, "qlen"),
        ({"batch": 0}, "batch"),
        ({"kv_len": 0}, "kv_len"),
        ({"page_size": 48}, "page_size"),
        ({"page_size": 0}, "page_size"),
        ({"dcp_size": 0}, "dcp_size"),
        ({"q_dtype": "fp32"}, "q_dtype"),
        ({"kv_dtype": "int8"}, "kv_dtype"),
        ({"q_dtype": "fp16", "kv_dtype": "bf16"}, "q_dtype"),
        ({"q_dtype": "fp8_e4m3fn", "kv_dtype": "fp8_e4m3fnuz"}, "q_dtype"),
        ({"phase": "encode"}, "phase"),
        ({"phase": "prefill", "dcp_size": 2}, "dcp_size"),
        ({"causal": "yes"}, "causal"),
        ({"num_heads": 1.5}, "num_heads"),
        ({"batch": True}, "batch"),
        ({"kv_len": 2**31}, "kv_len"),  # lengths are int32 on the device
        ({"batch": 10**20}, "batch"),  # past int64: the table could not hold it
        ({"dcp_size": 2**40}, "dcp_size"),
    ],
)
def test_invalid_problem_names_the_field(changes, field):
    with pytest.raises(ValueError, match=field):
        MLAProblem(**changes)


def test_valid_dtype_pairs():
    for kv in DTYPES:
        MLAProblem(q_dtype="bf16" if kv != "fp16" else "fp16", kv_dtype=kv)
    MLAProblem(q_dtype="fp8_e4m3fnuz", kv_dtype="fp8_e4m3fnuz")
    MLAProblem(q_dtype="fp16", kv_dtype="fp8_e4m3fn")


def test_work_counts():
    p = MLAProblem(num_heads=16, batch=2, kv_len=4096)
    assert p.flops() == 2 * 2 * 1 * 4096 * 16 * (576 + 512)
    assert p.min_bytes() == 2 * 4096 * 576 * 2 + 2 * 16 * 576 * 2 + 2 * 16 * 512 * 2
    # DCP: the busiest rank holds ceil(kv_len / dcp) tokens for all gathered heads.
    d = p.with_(kv_len=4097, dcp_size=4)
    assert d.shard_len == 1025
    assert d.flops() == 2 * 2 * 1025 * 64 * (576 + 512)
    # Causal prefill counts the lower triangle (with a prefix of kv_len - qlen).
    pre = MLAProblem(phase="prefill", num_heads=1, qlen=4, kv_len=6, batch=1)
    assert pre.flops() == 2 * (3 + 4 + 5 + 6) * (192 + 128)


def test_schema_key_types_cover_the_key():
    from mlatune.table.schema import COLUMNS, KEY_COLUMNS, KEY_TYPES, ROW_KEY

    assert tuple(KEY_TYPES) == KEY_COLUMNS
    assert set(ROW_KEY) <= set(COLUMNS) and len(set(COLUMNS)) == len(COLUMNS)


def test_a_key_is_the_problem_and_reads_back():
    p = MLAProblem(num_heads=8, qlen=2, kv_dtype="fp8_e4m3fn", batch=64, kv_len=4096,
                   causal=False, page_size=16)
    assert MLAProblem.from_key(p.key) == p
    assert p.label == "decode h8 q2 bf16/fp8_e4m3fn non-causal dcp1 p16 b64 kv4096"
    assert p.label.startswith(p.bucket_label)
    for text in ("", "phase=decode", p.key.replace("qlen", "q_len"), p.key + "|extra=1"):
        with pytest.raises(ValueError, match="not a problem key"):
            MLAProblem.from_key(text)
