"""Rules of the NVIDIA vendor routes: FlashMLA's dense decode and FlashInfer's MLA wrapper.

Like the AITER rules these read the problem and the arch alone; the routes add
whether their library imports (``routes.flashmla``, ``routes.flashinfer``).
Sources are the libraries' own interfaces as installed here (named per rule).
"""

from __future__ import annotations

from mlatune.capability.rules import Context, Rule, _arch_in, _decode  # shared with AITER's
from mlatune.capability.tables import Source
from mlatune.problem import FP8_DTYPES

FLASHMLA_ARCHS = ("sm_90",)
FLASHMLA_PAGE = 64
FLASHINFER_FA3_ARCHS = ("sm_90",)
FLASHINFER_FA2_ARCHS = ("sm_90", "sm_100")
VENDOR_DIMS = (576, 512)  # (d_qk, d_v): both libraries build MLA for 512 latent + 64 rope

_FLASHMLA = "sgl-flash-mla 1.0.0 flash_mla/flash_mla_interface.py"
_FLASHMLA_FP8 = "vllm-project/FlashMLA csrc/extension/sm90/dense_fp8 (fwd_kvcache_mla_fp8)"
_FLASHINFER = "flashinfer-python 0.6.18.post1 flashinfer/mla/_core.py BatchMLAPagedAttentionWrapper"

VENDOR_SOURCES: dict[str, Source] = {
    "flashmla.arch": Source(_FLASHMLA, "dense MLA decode lives on the legacy side only, built "
                                       "for SM90 (upstream's 2026-09-30 release kept sparse "
                                       "SM100 kernels)"),
    "flashmla.page": Source(_FLASHMLA_FP8, "page_block_size must be 64 (the bf16 kernel's "
                                           "tiles are the same 64-token blocks)"),
    "flashmla.dtypes": Source(_FLASHMLA + " + " + _FLASHMLA_FP8,
                              "dense decode reads a bf16 q over a bf16 cache, or an fp8 q over "
                              "an fp8 (e4m3fn) cache with per-tensor descales; the route "
                              "quantizes a bf16 q for an fp8 cache"),
    "vendor.dims": Source(_FLASHMLA_FP8 + " + " + _FLASHINFER,
                          "head_size_k 576 and head_size_v 512; FlashInfer's fp8 path needs "
                          "head_dim_ckv 512 and head_dim_kpe 64"),
    "vendor.dcp": Source(_FLASHMLA + " + " + _FLASHINFER,
                         "causal masks are applied on the lengths the kernel is given (local "
                         "to a DCP shard), wrong for a causal block over a round-robin shard"),
    "flashinfer.fa3": Source(_FLASHINFER, "backend 'fa3' is the SM90a kernel ('auto' picks it "
                                          "on SM90a)"),
    "flashinfer.fa2": Source(_FLASHINFER, "backend 'fa2' is the portable kernel (SM80 and up)"),
    "flashinfer.dtypes": Source(_FLASHINFER, "plan: kv bf16/fp16 with the same q dtype, or an "
                                             "e4m3fn cache with a bf16 q on SM90 (fa2/fa3)"),
}


def _dims(c: Context) -> str | None:
    if (c.p.d_qk, c.p.d_v) != VENDOR_DIMS:
        return f"built for d_qk/d_v {VENDOR_DIMS}; this problem has {c.p.d_qk}/{c.p.d_v}"
    return None


def _dcp_causal(c: Context) -> str | None:
    if c.p.dcp_size > 1 and c.block_has_order:
        return ("causal verify over a DCP shard: the kernel masks on the shard's local "
                "positions (cprr or segmented serve it)")
    return None


def _flashmla_page(c: Context) -> str | None:
    if c.p.page_size != FLASHMLA_PAGE:
        return f"page_size {c.p.page_size}: FlashMLA reads 64-token pages only"
    return None


def _flashmla_dtypes(c: Context) -> str | None:
    q, kv = c.p.q_dtype, c.p.kv_dtype
    if (q, kv) == ("bf16", "bf16") or (kv == "fp8_e4m3fn" and q in ("bf16", "fp8_e4m3fn")):
        return None
    return (f"{q} q over a {kv} cache: FlashMLA's dense decode reads bf16/bf16, or an "
            f"fp8_e4m3fn cache with a bf16 or fp8_e4m3fn q")


def _flashinfer_dtypes(c: Context) -> str | None:
    q, kv = c.p.q_dtype, c.p.kv_dtype
    if q == kv and q in ("bf16", "fp16"):
        return None
    if kv in FP8_DTYPES:
        if kv == "fp8_e4m3fn" and q == "bf16" and c.arch.arch == "sm_90":
            return None
        return (f"{q} q over a {kv} cache: FlashInfer's fp8 MLA reads an fp8_e4m3fn cache "
                f"with a bf16 q, on sm_90 only")
    return f"{q} q over a {kv} cache: FlashInfer's MLA takes the same 16-bit dtype for both"


def _r(rule_id: str, refuse, source_key: str | None = None) -> Rule:
    return Rule(rule_id, refuse, source_key or rule_id)


_FLASHINFER_COMMON = (
    _r("vendor.decode", _decode, "vendor.dims"),
    _r("vendor.dims", _dims),
    _r("flashinfer.dtypes", _flashinfer_dtypes),
    _r("vendor.dcp", _dcp_causal),
)

VENDOR_RULES: dict[str, tuple[Rule, ...]] = {
    "dense/flashmla": (
        _r("flashmla.arch", _arch_in(FLASHMLA_ARCHS, "FlashMLA's dense decode")),
        _r("vendor.decode", _decode, "vendor.dims"),
        _r("vendor.dims", _dims),
        _r("flashmla.page", _flashmla_page),
        _r("flashmla.dtypes", _flashmla_dtypes),
        _r("vendor.dcp", _dcp_causal),
    ),
    "fa3/flashinfer": (
        _r("flashinfer.fa3", _arch_in(FLASHINFER_FA3_ARCHS, "FlashInfer's fa3 MLA")),
        *_FLASHINFER_COMMON,
    ),
    "fa2/flashinfer": (
        _r("flashinfer.fa2", _arch_in(FLASHINFER_FA2_ARCHS, "FlashInfer's fa2 MLA")),
        *_FLASHINFER_COMMON,
    ),
}
