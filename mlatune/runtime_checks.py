"""Argument checks for ``mlatune.attention.decode``: a clear error instead of wrong numbers.

Every error here is a ``DecodeArgumentError`` (``mlatune.errors``, a ValueError) whose
message starts with the argument's name. The checks come in two tiers, split by what they
cost (docs/faults.md has the table of costs, defaults and what each bad call gives):

- ``check_decode_args`` reads only what the host already knows about the tensors (type,
  dtype, shape, strides, device, address range) and the integer and float arguments,
  never a tensor's values: a few microseconds of Python and no device work. ``decode``
  runs it whenever it makes a step (once per tensor set), not per call.
- ``check_length_values`` reads the contents of ``seq_lens`` and ``block_table`` (every
  length is >= 0 and fits the table, every page id a request uses is in the cache). On
  a GPU that read is a device sync: the host waits for the queue to drain, a stall on
  every decode step, and illegal while a CUDA graph is being captured. So ``decode``
  runs it on every call only where the values are free to read
  (``values_free_to_check``: CPU tensors); on a GPU once when a step is made, where
  reading is legal (``values_readable``: not capturing), and on every call only with
  ``MLATUNE_CHECK`` on (``checking_enabled``), e.g. while bringing up an engine::

      check_decode_args(q, kv_cache, block_table, seq_lens, num_heads=..., qlen=...,
                        dcp_rank=..., dcp_size=..., kv_lora_rank=..., kv_scale=...)
      if values_readable(seq_lens, block_table):  # when a step is made
          check_length_values(seq_lens, block_table, num_pages=kv_cache.shape[0],
                              page_size=kv_cache.shape[1], qlen=qlen, dcp_rank=dcp_rank,
                              dcp_size=dcp_size)

Value checks not made at all: the contents of q, the cache and the scales (a NaN there
is the caller's data, and the reference propagates it).
"""

from __future__ import annotations

import math
import numbers
import os
from typing import NoReturn

import torch

from mlatune.check.inputs import shard_lengths
from mlatune.errors import DecodeArgumentError, SettingError
from mlatune.problem import DTYPE_NAMES, DTYPES, FP8_DTYPES, MLAProblem, is_power_of_two

__all__ = [
    "CHECK_ENV",
    "DecodeArgumentError",
    "check_decode_args",
    "check_length_values",
    "check_max_kv_len",
    "checking_enabled",
    "values_free_to_check",
    "values_readable",
]

CHECK_ENV = "MLATUNE_CHECK"
_ON = frozenset({"1", "true", "yes", "on"})
_OFF = frozenset({"", "0", "false", "no", "off"})
# The MLAProblem field a validation message starts with -> the decode argument it came from.
_FIELD_ARGS = {"q_dtype": "q", "kv_dtype": "kv_cache", "page_size": "kv_cache",
               "rope_dim": "kv_cache", "batch": "block_table", "num_heads": "num_heads",
               "qlen": "qlen", "dcp_size": "dcp_size", "kv_lora_rank": "kv_lora_rank"}


MAX_KV_LEN = 2**30
# The largest softmax scale served: far past any model's (1/sqrt(192) with YaRN's mscale is
# about 0.1); the kernels' fp32 scores (q.k times it) overflow to inf, then NaN, not far above.
MAX_SOFTMAX_SCALE = 1e6


def _fail(arg: str, message: str) -> NoReturn:
    raise DecodeArgumentError(f"{arg}: {message}")


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def checking_enabled() -> bool:
    """True when ``MLATUNE_CHECK`` is on (1, true, yes, on; off: unset, empty, 0, false,
    no, off; any case): run the value checks on every call, even where they cost a device
    sync. Any other value is a ``SettingError`` naming the variable, never silently off.
    Read on every call (one dict lookup), so tests and users can flip it live."""
    text = os.environ.get(CHECK_ENV, "").strip().lower()
    if text in _ON:
        return True
    if text in _OFF:
        return False
    raise SettingError(f"{CHECK_ENV}: {_shown(os.environ[CHECK_ENV])} is neither on (1, true, "
                       f"yes, on) nor off (0, false, no, off, or unset)")


def values_free_to_check(*tensors: torch.Tensor | None) -> bool:
    """True when every tensor given (None skipped) is on the CPU: reading its values then
    waits for no device, so the value checks should always run."""
    return all(t.device.type == "cpu" for t in tensors if t is not None)


def values_readable(*tensors: torch.Tensor | None) -> bool:
    """True where the host may read the tensors' values now: CPU tensors always, CUDA
    tensors unless the current stream captures a graph (a host read there fails the
    capture); tensors without values (meta) never."""
    devices = {t.device.type for t in tensors if t is not None}
    if devices <= {"cpu"}:
        return True
    return devices <= {"cpu", "cuda"} and not torch.cuda.is_current_stream_capturing()


def _shown(text: str) -> str:
    return repr(text) if len(text) <= 40 else repr(text[:37] + "...")


# Checks that need no values ------------------------------------------------------------

def check_decode_args(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    num_heads: int,
    qlen: int,
    dcp_rank: int,
    dcp_size: int,
    kv_lora_rank: int,
    kv_scale: torch.Tensor | None = None,
    q_scale: torch.Tensor | None = None,
    softmax_scale: float | None = None,
    out: torch.Tensor | None = None,
    lse_out: torch.Tensor | None = None,
    causal: bool = True,
) -> None:
    """Raise ``DecodeArgumentError`` for any argument decode cannot serve, reading no
    tensor values (no device sync). Layouts as ``mlatune.attention.decode`` documents."""
    check_options(num_heads=num_heads, qlen=qlen, dcp_rank=dcp_rank, dcp_size=dcp_size,
                  kv_lora_rank=kv_lora_rank, causal=causal, softmax_scale=softmax_scale)
    _check_types(dict(q=q, kv_cache=kv_cache, block_table=block_table, seq_lens=seq_lens),
                 dict(kv_scale=kv_scale, q_scale=q_scale, out=out, lse_out=lse_out))
    _check_devices(q, dict(kv_cache=kv_cache, block_table=block_table, seq_lens=seq_lens,
                           kv_scale=kv_scale, q_scale=q_scale, out=out, lse_out=lse_out))
    batch = _check_index_tensors(block_table, seq_lens)
    page_size, d_qk = _check_kv_cache(kv_cache, kv_lora_rank)
    rows, heads = batch * qlen, num_heads * dcp_size
    _check_q(q, (rows, heads, d_qk))
    problem = _problem(q, kv_cache, batch=batch, num_heads=num_heads, qlen=qlen,
                       dcp_size=dcp_size, page_size=page_size, kv_lora_rank=kv_lora_rank,
                       d_qk=d_qk)
    _check_scale("kv_scale", kv_scale, "kv_cache", problem.kv_dtype)
    _check_scale("q_scale", q_scale, "q", problem.q_dtype)
    _check_out(out, (rows, heads, kv_lora_rank), DTYPES[problem.out_dtype], problem.q_dtype)
    _check_lse_out(lse_out, (rows, heads))
    _check_apart(dict(out=out, lse_out=lse_out),
                 dict(q=q, kv_cache=kv_cache, block_table=block_table, seq_lens=seq_lens,
                      kv_scale=kv_scale, q_scale=q_scale))


def check_max_kv_len(max_kv_len: int, none_ok: bool = False) -> None:
    """``max_kv_len`` is an int >= 0 (0: every request of the batch is empty); ``none_ok``:
    the caller also takes None (``decode``: the longest length, read then)."""
    if not isinstance(max_kv_len, int) or isinstance(max_kv_len, bool):
        _fail("max_kv_len", f"must be an int{' or None' if none_ok else ''}, got "
                            f"{max_kv_len!r}")
    if max_kv_len < 0:
        _fail("max_kv_len", f"must be >= 0 (the longest request's length), got {max_kv_len}")
    if max_kv_len > MAX_KV_LEN:  # a step serves up to the next power of two, an int32
        _fail("max_kv_len", f"must be at most 2**30 = {MAX_KV_LEN} keys, got {max_kv_len}")


def check_options(*, num_heads: int, qlen: int, dcp_rank: int, dcp_size: int,
                  kv_lora_rank: int, causal: bool, softmax_scale: float | None,
                  **flags: bool | None) -> float | None:
    """The scalar arguments' types and ranges (``flags``: options that are a bool, or None
    where named so: ``capturable``), checked on every call before a held step is looked up
    (a step held for ``num_heads=4`` would serve ``4.0`` too, as the two compare equal);
    ``softmax_scale`` as the kernels take it: a Python float (a numpy float32's value)."""
    if not isinstance(causal, bool):
        _fail("causal", f"must be a bool, got {causal!r} of {type(causal)}")
    for arg, value in flags.items():
        if not isinstance(value, bool) and not (value is None and arg == "capturable"):
            _fail(arg, f"must be a bool{' or None' if arg == 'capturable' else ''}, "
                       f"got {value!r}")
    _check_ints(num_heads=num_heads, qlen=qlen, dcp_rank=dcp_rank, dcp_size=dcp_size,
                kv_lora_rank=kv_lora_rank)
    _check_softmax_scale(softmax_scale)
    return plain_float(softmax_scale)


def plain_float(scale: object) -> object:
    """A real number of another type (a numpy float32) as a Python float, which kernels take
    as a constant; anything else (None, a float, a traced SymFloat) as given."""
    real = isinstance(scale, numbers.Real) and not isinstance(scale, bool | float)
    return float(scale) if real else scale


def _check_ints(**values: int) -> None:
    for arg, value in values.items():
        if not isinstance(value, int) or isinstance(value, bool):
            _fail(arg, f"must be an int, got {value!r}")
    for arg in ("num_heads", "qlen", "dcp_size", "kv_lora_rank"):
        if values[arg] < 1:
            _fail(arg, f"must be >= 1, got {values[arg]}")
    if not 0 <= values["dcp_rank"] < values["dcp_size"]:
        _fail("dcp_rank", f"must be in [0, dcp_size) = [0, {values['dcp_size']}), "
                          f"got {values['dcp_rank']}")


def _check_types(required: dict[str, object], optional: dict[str, object]) -> None:
    for arg, value in required.items():
        if not isinstance(value, torch.Tensor):
            _fail(arg, f"must be a torch.Tensor, got {type(value).__name__}")
    for arg, value in optional.items():
        if value is not None and not isinstance(value, torch.Tensor):
            _fail(arg, f"must be a torch.Tensor or None, got {type(value).__name__}")


def _check_devices(q: torch.Tensor, others: dict[str, torch.Tensor | None]) -> None:
    # Kernels take raw pointers: a tensor on another device is read as this one's memory.
    for arg, t in others.items():
        if t is not None and t.device != q.device:
            _fail(arg, f"must be on q's device {q.device}, got {t.device}")


def _check_index_tensors(block_table: torch.Tensor, seq_lens: torch.Tensor) -> int:
    """block_table (batch, max_pages) and seq_lens (batch,), both int32; returns batch."""
    if block_table.dtype != torch.int32:
        _fail("block_table", f"must be int32 page ids, got {_name(block_table.dtype)}")
    if block_table.dim() != 2:
        _fail("block_table", f"must be 2-D (batch, max_pages), got shape "
                             f"{tuple(block_table.shape)}")
    batch = block_table.shape[0]
    if batch < 1:
        _fail("block_table", f"batch 0 (shape {tuple(block_table.shape)}): decode needs at "
                             f"least one request; skip the call for an empty batch")
    if block_table.stride(-1) != 1:  # kernels step along a row by the element size
        _fail("block_table", f"needs a contiguous last dimension, got strides "
                             f"{block_table.stride()}")
    if seq_lens.dtype != torch.int32:
        _fail("seq_lens", f"must be int32 lengths, got {_name(seq_lens.dtype)}")
    if tuple(seq_lens.shape) != (batch,):
        _fail("seq_lens", f"must be ({batch},), one length per block_table row, got shape "
                          f"{tuple(seq_lens.shape)}")
    if batch > 1 and seq_lens.stride(0) != 1:  # kernels load seq_lens[b] at base + b
        _fail("seq_lens", f"must be contiguous, got stride {seq_lens.stride(0)}")
    return batch


def _check_kv_cache(kv_cache: torch.Tensor, kv_lora_rank: int) -> tuple[int, int]:
    """(pages, page_size, d_qk) or (pages, page_size, 1, d_qk); returns (page_size, d_qk)."""
    if kv_cache.dtype not in DTYPE_NAMES:
        _fail("kv_cache", f"dtype {_name(kv_cache.dtype)} is not one of "
                          f"{[_name(d) for d in DTYPES.values()]}")
    shape = tuple(kv_cache.shape)
    if not (kv_cache.dim() == 3 or (kv_cache.dim() == 4 and shape[2] == 1)):
        _fail("kv_cache", f"must be (pages, page_size, d_qk) or (pages, page_size, 1, d_qk), "
                          f"got shape {shape}")
    page_size, d_qk = shape[1], shape[-1]
    if not is_power_of_two(page_size):
        _fail("kv_cache", f"page_size (dim 1) must be a power of two, got {page_size}")
    if d_qk <= kv_lora_rank:
        _fail("kv_cache", f"d_qk (last dim) {d_qk} must exceed kv_lora_rank {kv_lora_rank}: "
                          f"the rope dims follow the latent")
    if not kv_cache.is_contiguous():  # kernels address a page and a token by fixed strides
        _fail("kv_cache", f"must be contiguous, got strides {kv_cache.stride()} for shape "
                          f"{shape}")
    return page_size, d_qk


def _check_q(q: torch.Tensor, want: tuple[int, int, int]) -> None:
    if q.dtype not in DTYPE_NAMES:
        _fail("q", f"dtype {_name(q.dtype)} is not one of {[_name(d) for d in DTYPES.values()]}")
    if tuple(q.shape) != want:
        _fail("q", f"must be (batch * qlen, num_heads * dcp_size, d_qk) = {want}, got shape "
                   f"{tuple(q.shape)}")
    if q.stride(-1) != 1:  # kernels read a head's dims at unit stride
        _fail("q", f"needs a contiguous last dimension, got strides {q.stride()}")


def _problem(q: torch.Tensor, kv_cache: torch.Tensor, *, batch: int, num_heads: int,
             qlen: int, dcp_size: int, page_size: int, kv_lora_rank: int,
             d_qk: int) -> MLAProblem:
    """The problem the tensors describe, so MLAProblem's own rules (which q/kv dtypes go
    together) judge them; kv_len is a stand-in, since the lengths are values."""
    try:
        return MLAProblem(phase="decode", num_heads=num_heads, qlen=qlen,
                          q_dtype=DTYPE_NAMES[q.dtype], kv_dtype=DTYPE_NAMES[kv_cache.dtype],
                          batch=batch, kv_len=qlen, dcp_size=dcp_size, page_size=page_size,
                          kv_lora_rank=kv_lora_rank, rope_dim=d_qk - kv_lora_rank)
    except ValueError as error:
        message = str(error).removeprefix("invalid MLAProblem: ")
        _fail(_FIELD_ARGS.get(message.split(" ", 1)[0], "q"),
              f"{message} (q is {_name(q.dtype)}, kv_cache {_name(kv_cache.dtype)})")


def _check_scale(arg: str, scale: torch.Tensor | None, tensor_arg: str, dtype: str) -> None:
    """An fp8 tensor needs its per-tensor scale (without it the numbers are off by the
    scale, silently); a 16-bit one takes none (a scale would be silently ignored)."""
    torch_name = _name(DTYPES[dtype])
    if dtype in FP8_DTYPES and scale is None:
        _fail(arg, f"an fp8 {tensor_arg} ({torch_name}) needs its per-tensor scale, got None")
    if dtype not in FP8_DTYPES and scale is not None:
        _fail(arg, f"a 16-bit {tensor_arg} ({torch_name}) takes no scale (it would be "
                   f"ignored); pass None")
    if scale is None:
        return
    if scale.dtype != torch.float32:
        _fail(arg, f"must be float32, got {_name(scale.dtype)}")
    if scale.numel() != 1:
        _fail(arg, f"must hold one per-tensor scale, got shape {tuple(scale.shape)}")


def softmax_scale_fault(scale: object) -> str | None:
    """Why ``scale`` is no softmax scale the kernels serve (None: it is): a real number
    (not a bool), finite, > 0 and at most ``MAX_SOFTMAX_SCALE``."""
    if not isinstance(scale, numbers.Real) or isinstance(scale, bool):
        return f"must be a float, got {type(scale).__name__}"
    if not math.isfinite(scale) or not 0 < scale <= MAX_SOFTMAX_SCALE:
        return f"must be finite, > 0 and <= {MAX_SOFTMAX_SCALE:g}, got {scale}"
    return None


def _check_softmax_scale(softmax_scale: float | None) -> None:
    fault = None if softmax_scale is None else softmax_scale_fault(softmax_scale)
    if fault is not None:
        _fail("softmax_scale", fault.replace("must be a float", "must be a float or None"))


def _check_out(out: torch.Tensor | None, want: tuple[int, int, int], dtype: torch.dtype,
               q_dtype: str) -> None:
    if out is None:
        return
    if tuple(out.shape) != want:
        _fail("out", f"must be (batch * qlen, num_heads * dcp_size, kv_lora_rank) = {want}, "
                     f"got shape {tuple(out.shape)}")
    if out.dtype != dtype:
        _fail("out", f"must be {_name(dtype)} for a {q_dtype} q, got {_name(out.dtype)}")
    if out.stride(-1) != 1:  # kernels write a head's dims at unit stride
        _fail("out", f"needs a contiguous last dimension, got strides {out.stride()}")
    _check_distinct_elements("out", out)


def _check_lse_out(lse_out: torch.Tensor | None, want: tuple[int, int]) -> None:
    if lse_out is None:
        return
    if tuple(lse_out.shape) != want:
        _fail("lse_out", f"must be (batch * qlen, num_heads * dcp_size) = {want}, got shape "
                         f"{tuple(lse_out.shape)}")
    if lse_out.dtype != torch.float32:
        _fail("lse_out", f"must be float32, got {_name(lse_out.dtype)}")
    if lse_out.stride(-1) != 1:  # kernels write a row's heads at base + token stride + head
        _fail("lse_out", f"needs a contiguous last dimension, got strides {lse_out.stride()}")
    _check_distinct_elements("lse_out", lse_out)


def _check_distinct_elements(arg: str, t: torch.Tensor) -> None:
    """An output whose elements share memory (an expanded or stride-0 view) has two rows
    written to one place: each dimension's stride must step past the smaller ones' span
    (sufficient, and what any view into a buffer of its own satisfies)."""
    span = 1
    for size, stride in sorted((d for d in zip(t.shape, t.stride(), strict=True) if d[0] > 1),
                               key=lambda d: d[1]):
        if stride < span:
            _fail(arg, f"its elements overlap each other (shape {tuple(t.shape)}, strides "
                       f"{t.stride()}: an expanded view?); pass a buffer with a place for "
                       f"every element")
        span = stride * size


def _check_apart(outputs: dict[str, torch.Tensor | None],
                 inputs: dict[str, torch.Tensor | None]) -> None:
    """An output whose bytes overlap an input's (or the other output's) would be written
    while the kernels read it: wrong numbers, silently. Compares address ranges only (the
    tensors' metadata, no device work), so an output interleaved with an input inside
    one buffer is refused too."""
    given = {arg: t for arg, t in {**outputs, **inputs}.items() if t is not None}
    for arg, t in outputs.items():
        for other, u in given.items():
            if t is not None and other != arg and _overlap(t, u):
                _fail(arg, f"shares memory with {other} (their byte ranges overlap), so the "
                           f"kernels would overwrite what they read; pass a buffer of its own")


def _overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    ranges = [_byte_range(a), _byte_range(b)]
    if None in ranges:
        return False
    (a0, a1), (b0, b1) = ranges
    return a0 < b1 and b0 < a1


def _byte_range(t: torch.Tensor) -> tuple[int, int] | None:
    """[first, last + 1) byte addresses of the elements; None for no elements or no
    memory (meta tensors report address 0). Strides are never negative in torch."""
    start = t.data_ptr()
    if t.numel() == 0 or start == 0:
        return None
    last = sum((n - 1) * stride for n, stride in zip(t.shape, t.stride(), strict=True))
    return start, start + (last + 1) * t.element_size()


# Checks that read values ---------------------------------------------------------------

def check_length_values(
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
    *,
    num_pages: int,
    page_size: int,
    qlen: int,
    dcp_rank: int,
    dcp_size: int,
) -> None:
    """Raise ``DecodeArgumentError`` unless every global length is >= 0, this rank's share of
    it fits the block table, and every page id it uses is one of the cache's ``num_pages``.
    Reads the values (a device sync on a GPU: module docstring), once on success. Table
    entries past a request's used pages are not looked at (engines pad them with -1 or 0).

    A length of 0 is an empty request (an engine's padding of a graph bucket): its rows get
    output 0 and LSE -inf. A length below ``qlen`` is served with the causal window over
    the keys that exist (token t sees keys ``[0, length - qlen + t]``; none: 0 and -inf),
    FlashMLA's and FlashInfer's convention."""
    if tuple(seq_lens.shape) != (block_table.shape[0],):
        _fail("seq_lens", f"must be ({block_table.shape[0]},), one length per block_table "
                          f"row, got shape {tuple(seq_lens.shape)}")
    lens = seq_lens.to(torch.int64)  # int64: L + world - 1 must not wrap for L near 2**31
    local = shard_lengths(lens, dcp_rank, dcp_size).to(torch.int64)
    capacity = block_table.shape[1] * page_size
    negative, over = lens < 0, local > capacity
    used = (local.clamp(max=capacity) + page_size - 1) // page_size
    columns = torch.arange(block_table.shape[1], device=block_table.device)
    outside = (block_table < 0) | (block_table >= num_pages)
    bad_page = outside & (columns[None, :] < used[:, None])
    # One host read on success, whatever the batch: three flags at once.
    flags = torch.stack([negative.any(), over.any(), bad_page.any()]).tolist()
    if flags[0]:
        b = _first(negative)[0]
        _fail("seq_lens", f"request {b} has length {int(lens[b])}; lengths are >= 0 (0: an "
                          f"empty request)")
    if flags[1]:
        _fail_capacity(_first(over)[0], lens, local, block_table.shape[1], page_size,
                       dcp_rank, dcp_size)
    if flags[2]:
        b, j = _first(bad_page)
        _fail("block_table", f"request {b} uses page id {int(block_table[b, j])} at position "
                             f"{j}, outside the cache's {num_pages} pages")


def _first(mask: torch.Tensor) -> tuple[int, ...]:
    """Index of the first True element, row-major (nonzero lists them in that order)."""
    return tuple(int(i) for i in mask.nonzero()[0])


def _fail_capacity(b: int, lens: torch.Tensor, local: torch.Tensor, columns: int,
                   page_size: int, rank: int, world: int) -> NoReturn:
    share = "" if world == 1 else f" ({int(local[b])} tokens on DCP rank {rank} of {world})"
    _fail("seq_lens", f"request {b} has length {int(lens[b])}{share}, more than block_table's "
                      f"{columns} columns of {page_size}-token pages cover "
                      f"({columns * page_size} tokens)")
