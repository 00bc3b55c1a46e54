"""How many query heads an AITER kernel runs with, and how tensors get there and back.

MLA heads are independent over the one shared latent KV head, so a kernel
built for more heads than a rank has can be fed copies and the copies dropped:
- a count dividing the target is padded by repeating each head in place
  (repeat_interleave): real head i sits at kernel head i * stride;
- any other count is tiled (the head list again and again, cut to the target):
  real head i sits at kernel head i.
Padding and unpadding both come from one ``HeadPlan``, so they cannot disagree.
(The seed's cprr and FP8-prefill paths pad divisors by repeat_interleave but
unpad by keeping the first heads, which for 1/2/4/8 heads keeps copies of the
first few heads; see get_mla_padded_q against ``o[:, :decode_num_heads]`` and
``out_3d[:, :_real_nhead]`` in seeds/vllm-rocm-aiter-mla-backend.txt.)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mlatune.capability import tables


@dataclass(frozen=True)
class HeadPlan:
    real: int  # heads the problem has (per rank, DCP-gathered)
    kernel: int  # heads the kernel runs with

    def __post_init__(self) -> None:
        if not 1 <= self.real <= self.kernel:
            raise ValueError(f"a head plan needs 1 <= real <= kernel, got {self.real}, "
                             f"{self.kernel}")

    @property
    def method(self) -> str:
        if self.kernel == self.real:
            return "none"
        return "repeat" if self.kernel % self.real == 0 else "tile"

    @property
    def stride(self) -> int:
        """Distance between real heads in the kernel's head axis."""
        return self.kernel // self.real if self.method == "repeat" else 1

    def pad_into(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """Write ``src`` (tokens, real, ...) padded into ``dst`` (tokens, kernel, ...)."""
        if self.method == "repeat":
            shape = (src.shape[0], self.real, self.stride, *src.shape[2:])
            dst.view(shape).copy_(src.unsqueeze(2).expand(shape))
            return
        for start in range(0, self.kernel, self.real):  # "none" is one whole copy
            n = min(self.real, self.kernel - start)
            dst[:, start:start + n].copy_(src[:, :n])

    def padded(self, src: torch.Tensor) -> torch.Tensor:
        if self.method == "none":
            return src
        dst = src.new_empty(src.shape[0], self.kernel, *src.shape[2:])
        self.pad_into(dst, src)
        return dst

    def real_heads(self, t: torch.Tensor) -> torch.Tensor:
        """The real heads of a kernel-shaped (tokens, kernel, ...) tensor, as a view."""
        if self.method == "repeat":
            return t[:, ::self.stride]
        return t[:, :self.real]


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def valid_num_heads(heads: int) -> bool:
    """The seed's AiterMLAHelper.is_valid_num_heads: positive, and at most 128 or aligned."""
    return heads > 0 and (heads <= tables.ASM_MAX_PADDED_HEADS
                          or heads % tables.ASM_HEAD_MULTIPLE == 0)


def asm_decode_heads(heads: int, native_h24: bool = False) -> int | None:
    """Heads the padded ASM decode runs ``heads`` at; None when it has no kernel for them."""
    if heads == 24 and native_h24:
        return 24
    return _round_up(heads, tables.ASM_HEAD_MULTIPLE) if valid_num_heads(heads) else None


def cprr_heads(heads: int) -> int | None:
    """Heads the cprr decode runs at: the smallest native count that holds them."""
    return next((n for n in tables.CPRR_KERNEL_HEADS if n >= heads), None)


def fp8_prefill_heads(heads: int) -> int | None:
    """Heads the FP8 PS prefill runs at: the next multiple of 16 (never a native 24)."""
    return _round_up(heads, tables.ASM_HEAD_MULTIPLE) if valid_num_heads(heads) else None
