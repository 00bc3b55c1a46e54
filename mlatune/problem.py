"""The MLA problem: everything that decides which route is fastest, spelled out.

Decode (the absorbed form): each query head is ``kv_lora_rank + rope_dim`` wide
(512 + 64 = 576); the cache holds one shared latent head of that width and the
values are its first ``kv_lora_rank`` dims. Prefill (the non-absorbed form):
per-head q/k of ``qk_head_dim`` (192) and v of ``v_head_dim`` (128). Both use
the softmax scale ``qk_head_dim ** -0.5``, as DeepSeek's models do.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields, replace
from functools import cache, cached_property
from typing import Any, Literal

import torch

Phase = Literal["decode", "prefill"]

# Short, stable dtype names used in problems, specs and tables.
DTYPES: dict[str, torch.dtype] = {
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
    "fp8_e4m3fn": torch.float8_e4m3fn,
    "fp8_e4m3fnuz": torch.float8_e4m3fnuz,
}
DTYPE_NAMES: dict[torch.dtype, str] = {dtype: name for name, dtype in DTYPES.items()}
FP8_DTYPES = frozenset({"fp8_e4m3fn", "fp8_e4m3fnuz"})
# The largest size a problem's field takes: lengths are int32 on the device, and tables,
# maps and predictors hold sizes as int64 and products of them.
SIZE_LIMIT = 2**31 - 1

# Table key columns, in order: the whole problem (MIOpen find-db style).
KEY_FIELDS = (
    "phase",
    "num_heads",
    "qlen",
    "q_dtype",
    "kv_dtype",
    "causal",
    "dcp_size",
    "page_size",
    "batch",
    "kv_len",
    "d_qk",
    "d_v",
)
# The key less the two continuous axes: problems that differ only in batch and
# kv_len share a bucket, in which the dispatcher's nearest lookup searches.
BUCKET_FIELDS = tuple(f for f in KEY_FIELDS if f not in ("batch", "kv_len"))


def is_power_of_two(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def next_power_of_two(n: int) -> int:
    """The smallest power of two >= n (1 for n <= 1)."""
    return 1 << max(0, n - 1).bit_length()


@dataclass(frozen=True)
class MLAProblem:
    """One attention call as a serving engine issues it on one rank.

    ``num_heads`` are the query heads per rank before DCP gathering: with
    ``dcp_size`` > 1 the kernel sees ``num_heads * dcp_size`` heads
    (``kernel_heads``) over its round-robin shard of the KV cache.
    ``qlen`` is the query tokens per request (1 for decode, 2..8 for
    speculative verify; the prompt length for prefill) and ``kv_len`` the
    tokens each request attends, the new ones included.
    """

    phase: Phase = "decode"
    num_heads: int = 16
    qlen: int = 1
    q_dtype: str = "bf16"
    kv_dtype: str = "bf16"
    batch: int = 1
    kv_len: int = 4096
    dcp_size: int = 1
    causal: bool = True
    page_size: int = 64
    kv_lora_rank: int = 512
    rope_dim: int = 64
    qk_head_dim: int = 192
    v_head_dim: int = 128

    def __post_init__(self) -> None:
        problems = list(self._field_errors())
        if problems:
            raise ValueError("invalid MLAProblem: " + "; ".join(problems))

    def _field_errors(self):
        if self.phase not in ("decode", "prefill"):
            yield f"phase must be 'decode' or 'prefill', got {self.phase!r}"
        for name in ("num_heads", "qlen", "batch", "kv_len", "page_size", "kv_lora_rank",
                     "rope_dim", "qk_head_dim", "v_head_dim"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                yield f"{name} must be a positive integer, got {value!r}"
            elif value > SIZE_LIMIT:
                yield f"{name} must be at most {SIZE_LIMIT} (2**31 - 1), got {value}"
        if not isinstance(self.dcp_size, int) or isinstance(self.dcp_size, bool) \
                or not 1 <= self.dcp_size <= SIZE_LIMIT:
            yield f"dcp_size must be an integer from 1 to {SIZE_LIMIT}, got {self.dcp_size!r}"
        if not isinstance(self.causal, bool):
            yield f"causal must be a bool, got {self.causal!r}"
        for name in ("q_dtype", "kv_dtype"):
            if getattr(self, name) not in DTYPES:
                yield f"{name} must be one of {sorted(DTYPES)}, got {getattr(self, name)!r}"
        if isinstance(self.page_size, int) and self.page_size > 0 \
                and not is_power_of_two(self.page_size):
            yield f"page_size must be a power of two, got {self.page_size}"
        if isinstance(self.qlen, int) and isinstance(self.kv_len, int) and self.qlen > self.kv_len:
            yield f"qlen ({self.qlen}) must not exceed kv_len ({self.kv_len})"
        if self.q_dtype in DTYPES and self.kv_dtype in DTYPES:
            if self.kv_dtype in FP8_DTYPES:
                if self.q_dtype in FP8_DTYPES and self.q_dtype != self.kv_dtype:
                    yield f"q_dtype {self.q_dtype} and kv_dtype {self.kv_dtype} mix fp8 formats"
            elif self.q_dtype != self.kv_dtype:
                yield (f"q_dtype must equal kv_dtype for a 16-bit cache, got "
                       f"q_dtype {self.q_dtype} with kv_dtype {self.kv_dtype}")
        if self.phase == "prefill" and self.dcp_size != 1:
            yield f"dcp_size must be 1 for prefill (context parallelism is a decode concern), " \
                  f"got {self.dcp_size}"

    # Derived quantities -------------------------------------------------
    @property
    def d_qk(self) -> int:
        """Width of a query/key head as the kernel sees it."""
        return self.kv_lora_rank + self.rope_dim if self.phase == "decode" else self.qk_head_dim

    @property
    def d_v(self) -> int:
        """Width of a value/output head."""
        return self.kv_lora_rank if self.phase == "decode" else self.v_head_dim

    @property
    def softmax_scale(self) -> float:
        return self.qk_head_dim ** -0.5

    @property
    def kernel_heads(self) -> int:
        """Query heads one rank's kernel processes (DCP gathers heads across ranks)."""
        return self.num_heads * self.dcp_size

    @property
    def out_dtype(self) -> str:
        return output_dtype(self.q_dtype)

    @property
    def is_verify(self) -> bool:
        return self.phase == "decode" and self.qlen > 1

    @property
    def shard_len(self) -> int:
        """KV tokens of the busiest DCP rank (rank 0 holds ceil(kv_len / dcp_size))."""
        return -(-self.kv_len // self.dcp_size)

    def flops(self) -> float:
        """2 x (QK^T + PV) multiply-adds one rank does, counting each (query, key) pair once.

        Decode counts every pair, causal or not (DESIGN's convention, so numbers
        compare with FlashMLA's benchmark); causal prefill counts the lower
        triangle it really computes.
        """
        if self.phase == "decode":
            pairs = self.batch * self.qlen * self.shard_len * self.kernel_heads
        else:
            per_head = self.qlen * self.kv_len
            if self.causal:
                per_head -= self.qlen * (self.qlen - 1) // 2
            pairs = self.batch * per_head * self.num_heads
        return 2.0 * pairs * (self.d_qk + self.d_v)

    def min_bytes(self) -> float:
        """Fewest bytes one rank must move: its KV shard once, q and output once."""
        kv_item = dtype_size(self.kv_dtype)
        q_item = dtype_size(self.q_dtype)
        out_item = dtype_size(self.out_dtype)
        if self.phase == "decode":
            kv = self.batch * self.shard_len * self.d_qk * kv_item
            q = self.batch * self.qlen * self.kernel_heads * self.d_qk * q_item
            out = self.batch * self.qlen * self.kernel_heads * self.d_v * out_item
            return float(kv + q + out)
        kv = self.batch * self.kv_len * self.num_heads * (self.d_qk + self.d_v) * kv_item
        q = self.batch * self.qlen * self.num_heads * self.d_qk * q_item
        out = self.batch * self.qlen * self.num_heads * self.d_v * out_item
        return float(kv + q + out)

    # Keys -----------------------------------------------------------------
    def key_dict(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in KEY_FIELDS}

    # Cached (in the instance __dict__; fields, eq and hash are untouched) because
    # the dispatcher's exact-hit lookup is this key and one dict probe.
    @cached_property
    def key(self) -> str:
        """Canonical, stable text key: ``field=value`` pairs in KEY_FIELDS order."""
        return "|".join(f"{k}={_fmt(v)}" for k, v in self.key_dict().items())

    @classmethod
    def from_key(cls, key: str) -> MLAProblem:
        """The problem whose ``key`` this is; ValueError for text that is no problem key."""
        try:
            values = dict(part.split("=", 1) for part in key.split("|"))
        except ValueError:
            values = {}
        if tuple(values) != KEY_FIELDS:
            raise ValueError(f"not a problem key: {key[:80]!r}")
        return cls.from_key_dict(values)

    @property
    def label(self) -> str:
        """The problem in a few words: "decode h8 q2 bf16/fp8_e4m3fn dcp1 p64 b64 kv4096"."""
        return f"{self.bucket_label} b{self.batch} kv{self.kv_len}"

    @property
    def bucket_label(self) -> str:
        """Its bucket (the problem less batch and kv_len) in a few words."""
        causal = "" if self.causal else " non-causal"
        return (f"{self.phase} h{self.num_heads} q{self.qlen} {self.q_dtype}/{self.kv_dtype}"
                f"{causal} dcp{self.dcp_size} p{self.page_size}")

    @property
    def bucket(self) -> tuple:
        return tuple(getattr(self, name) for name in BUCKET_FIELDS)

    @classmethod
    def from_key_dict(cls, row: Mapping[str, Any]) -> MLAProblem:
        """The problem of a table row, a journal's key object or any mapping with KEY_FIELDS
        (values as numbers or as text)."""
        values = {name: row[name] for name in KEY_FIELDS}
        phase = values.pop("phase")
        d_qk, d_v = int(values.pop("d_qk")), int(values.pop("d_v"))
        dims: dict[str, int] = (
            {"kv_lora_rank": d_v, "rope_dim": d_qk - d_v} if phase == "decode"
            else {"qk_head_dim": d_qk, "v_head_dim": d_v}
        )
        ints = {k: int(v) for k, v in values.items() if k not in ("q_dtype", "kv_dtype", "causal")}
        return cls(phase=phase, q_dtype=str(values["q_dtype"]), kv_dtype=str(values["kv_dtype"]),
                   causal=_as_bool(values["causal"]), **ints, **dims)

    def with_(self, **changes: Any) -> MLAProblem:
        return replace(self, **changes)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def _fmt(value: Any) -> str:
    return str(int(value)) if isinstance(value, bool) else str(value)


def _as_bool(value: Any) -> bool:
    if isinstance(value, str):
        if value.lower() in ("1", "true"):
            return True
        if value.lower() in ("0", "false"):
            return False
        raise ValueError(f"causal must be a bool, got {value!r}")
    return bool(value)


def output_dtype(q_dtype: str) -> str:
    """fp8 queries produce bf16 output; 16-bit queries keep their dtype."""
    return "bf16" if q_dtype in FP8_DTYPES else q_dtype


@cache
def dtype_size(name: str) -> int:
    """Bytes an element of dtype ``name`` takes (asked of torch once a name)."""
    return DTYPES[name].itemsize


def problem_field_names() -> tuple[str, ...]:
    return tuple(f.name for f in fields(MLAProblem))
