"""The numbers behind the capability rules, each with where it comes from.

Two seeds (in the shared seeds folder) are the sources: VLLM is vLLM's ROCm
AITER MLA backend (`rocm_aiter_mla.py`), which states what each AITER route
needs and where it aborts; GFX1250 is AITER PR 6563 and the commits it links,
which state the gfx1250 decode rules. A few facts come from AITER's own
source, named by path. Where a rule is stricter than the seed it names the
source that says so; otherwise the seed's answer stands. Everything here is as
those sources stood; a newer AITER may do more, which a sweep on the hardware
will show.

The portable routes (``*/triton``, ``sdpa/torch``, ``reference/torch``) run
mlatune's own kernels or torch: their rules come from those kernels (named by
path) and from what Triton's dots take on each arch; the Triton decode
families serve the problems the seed's route of the same name serves.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Source:
    where: str  # the document and the passage in it
    says: str  # what the passage establishes, in our words

    def __str__(self) -> str:
        return f"{self.where}: {self.says}"


VLLM = "seeds/vllm-rocm-aiter-mla-backend.txt"
GFX1250 = "seeds/aiter-pr-6563-gfx1250-mla-decode.txt"

# --- shapes every AITER MLA kernel is built for -----------------------------------------
MLA_DECODE_DIMS = (576, 512)  # (d_qk, d_v): 512 latent + 64 rope; values are the latent
FP8_PREFILL_DIMS = (192, 128)  # per-head q/k and v after kv_b_proj
MAX_DECODE_QLEN = 8  # the widest verify block any seed names (the qseqlen-8 ASM entry)

# --- Gluon small-head decode ------------------------------------------------------------
GLUON_ARCHS = ("gfx950",)
GLUON_MAX_HEADS = 15  # 16 and up take the ASM kernels
GLUON_KV_DTYPES = ("bf16", "fp16")  # 16-bit caches: only the fp8 regime is ruled out
GLUON_DIVISOR_OF = 16  # single-token decode keeps Gluon for divisors of 16 unless forced
GLUON_MAX_KV_CACHE_BYTES = 1 << 31  # past 2 GiB its unmasked loads read outside the cache

# --- padded ASM decode (mla_decode_fwd) -------------------------------------------------
ASM_DECODE_ARCHS = ("gfx942", "gfx950", "gfx1250")
ASM_HEAD_MULTIPLE = 16  # the ASM decode runs a multiple of 16 heads...
ASM_MAX_PADDED_HEADS = 128  # ...padding counts up to 128; above, only aligned counts
NATIVE_H24_ARCHS = ("gfx942", "gfx950")  # where a build's native 24-head kernels apply
ASM_PADDED_MAX_PERSISTENT_QLEN = 4  # bf16/fp16, fewer than 16 real heads: persistent up to here
ASM_NON_CAUSAL_ARCHS = ("gfx950",)
FP8_NON_CAUSAL_QLEN2_HEADS = (32, 64, 96, 128)

# --- CPRR: round-robin DCP decode with the causal window on global positions ------------
CPRR_ARCHS = ("gfx950",)
CPRR_KERNEL_HEADS = (16, 32, 64, 128)
CPRR_MIN_QLEN = 3

# --- segmented DCP verify (Triton) ------------------------------------------------------
SEGMENTED_MAX_TILE = 128
SEGMENTED_MIN_TILE = 16

# --- the portable Triton routes ---------------------------------------------------------
TRITON_PAD_MULTIPLE = 16  # padded/triton pads heads the seed's way: to a multiple of 16...
TRITON_MAX_PADDED_HEADS = 128  # ...up to 128; above, aligned counts only
TRITON_GLUON_MAX_HEADS = 15  # the small-head family: fewer than 16 kernel heads
TRITON_GLUON_MAX_QLEN = 8  # decode and verify blocks up to 8 tokens
TRITON_CPRR_HEADS = (16, 32, 64, 128)  # cprr/triton pads to the seed's native cprr counts
TRITON_MIN_SM = 80  # bf16/fp16 tensor-core dots (mma m16n8k16)
TRITON_FP8_MIN_SM = 89  # fp8 (e4m3fn) tensor-core dots
TRITON_AMD_FP8 = {"gfx940": "fp8_e4m3fnuz", "gfx941": "fp8_e4m3fnuz", "gfx942": "fp8_e4m3fnuz",
                  "gfx950": "fp8_e4m3fn"}  # the fp8 format each AMD arch's matrix cores take
TRITON_MIN_DIM = 16  # a tl.dot operand side

# --- wgmma/gluon, seesaw/gluon, transposed/gluon: mlatune's Hopper Gluon decodes --------
# The sizes are the kernel's own (mlatune/kernels/gluon_hopper_plan.py, read by the rules).
WGMMA_GLUON = "mlatune/kernels/gluon_hopper.py"
WGMMA_GLUON_ARCHS = ("sm_90",)
TRANSPOSED_FP8_MMA_MAX_ROWS = 16  # query rows a program up to which fp8 MMAs pay

# --- FP8 persistent-scheduling prefill --------------------------------------------------
FP8_PREFILL_ARCHS = ("gfx950",)
FP8_PREFILL_TILE_Q = 256
FP8_PREFILL_KV_GRANULARITY = 128


# --- gfx1250 decode: FlyDSL PS1 table, else stage-1 ASM ---------------------------------
@dataclass(frozen=True)
class PS1Kernel:
    kernel_heads: int
    dtypes: tuple[str, ...]  # "bf16" (FlyDSL JIT kernel) and/or "fp8" (ASM code objects)
    max_qlen: int
    max_rows: int | None = None  # bound on kernel_heads * qlen

    def serves(self, kernel_heads: int, dtype: str, qlen: int) -> bool:
        return (kernel_heads == self.kernel_heads and dtype in self.dtypes
                and qlen <= self.max_qlen
                and (self.max_rows is None or kernel_heads * qlen <= self.max_rows))


GFX1250_PS1 = (
    PS1Kernel(16, ("bf16", "fp8"), 4),
    PS1Kernel(32, ("bf16", "fp8"), 4, 128),
    PS1Kernel(64, ("bf16", "fp8"), 4, 128),
    PS1Kernel(96, ("fp8",), MAX_DECODE_QLEN),
    PS1Kernel(128, ("fp8",), 1),
)
GFX1250_STAGE1_PAGE = 64


SOURCES: dict[str, Source] = {
    "aiter.amd": Source(VLLM, "the whole backend is ROCm-only; AITER ships AMD kernels"),
    "aiter.fp8": Source("AITER aiter/utility/dtypes.py, defaultDtypes",
                        "gfx942 kernels read e4m3fnuz, gfx950 and gfx1250 OCP e4m3fn"),
    "decode.dims": Source(VLLM, "forward_mqa splits q into kv_lora_rank (512) + rope (64) and "
                                "the reducer probe looks for head dim 512"),
    "decode.qlen": Source(VLLM, "AiterMLAHelper: the widest padded ASM entry is qseqlen 8"),
    "gluon.arch": Source(VLLM, "_gluon_mla_decode_supported: Gluon has a gfx950 build only; its "
                               "tiling needs ~160 KiB LDS, more than CDNA3's 64 KiB"),
    "gluon.heads": Source(VLLM, "use_gluon_decode / use_gluon_verify: 16 heads and up never take "
                                "Gluon"),
    "gluon.kv": Source(VLLM, "use_gluon_decode / use_gluon_verify: Gluon's only fp8-KV regime "
                             "(bh16bn128) asserts batch 1, so it cannot serve a batch; a 16-bit "
                             "cache (the model dtype, bf16 or fp16: AiterMLABackend."
                             "supported_dtypes) is not ruled out"),
    "gluon.divisor": Source(VLLM, "use_gluon_decode: in auto mode a single-token decode keeps "
                                  "Gluon only for head counts dividing 16; mode 'gluon' forces it"),
    "gluon.verify": Source(VLLM, "use_gluon_verify: Gluon masks the block causally with no off "
                                 "switch, and DCP verify is left to the segmented route"),
    "gluon.lse": Source(VLLM, "forward_mqa: both Gluon calls return (o, None), no LSE, which a "
                              "DCP shard's partial result needs for the cross-rank merge"),
    "gluon.cache": Source(VLLM, "_GLUON_MAX_KV_CACHE_BYTES: past 2 GiB per layer Gluon drops its "
                                "bounds mask and reads outside the cache"),
    "asm.heads": Source(VLLM, "AiterMLAHelper.is_valid_num_heads / get_actual_mla_num_heads: pad "
                              "to a multiple of 16 up to 128, aligned counts above (on every "
                              "arch: the helper has no arch condition); native 24 where the "
                              "build has it"),
    "aiter.heads": Source(VLLM, "AiterMLAImpl.__init__: check_num_heads_validity(num_heads) and "
                                "check_num_heads_validity(_decode_num_heads): the heads per rank "
                                "and the DCP-gathered count must both be positive and at most "
                                "128 or a multiple of 16, whichever decode route runs"),
    "asm.dtypes": Source(VLLM, "_build_decode / __init__: over an fp8 cache the query is "
                               "quantized to fp8 and the schedule planned with fp8 q"),
    "asm.dcp": Source(VLLM, "DCP decode routing: the plain kernel applies causality on local "
                            "indices, wrong over a round-robin shard, so it never serves a causal "
                            "multi-token block with DCP"),
    "asm.non_causal": Source(VLLM, "supports_non_causal / _aiter_mla_non_causal_asm_kernels: only "
                                   "gfx950 ships non-causal decode kernels"),
    "asm.non_causal_fp16": Source(VLLM, "validate_configuration: non-causal fp16 decode aborts"),
    "asm.fp8_qlen2": Source(VLLM, "has_fp8_non_causal_qlen2_kernel: fp8 non-causal 2-token blocks "
                                  "fold onto a kernel only at 32/64/96/128 heads; others abort"),
    "asm.persistent": Source(VLLM, "_ASM_PADDED_MAX_PS_QLEN: padded heads have bf16 persistent "
                                   "kernels up to qlen 4; above, the non-persistent qseqlen-8 "
                                   "entry; fp8 and non-causal keep the schedule"),
    "gfx1250.ps1": Source(GFX1250, "FlyDSL PS1 serves 32/64 heads at qlen <= 4 with heads x qlen "
                                   "<= 128 (bf16 FlyDSL, fp8 ASM) and 16 heads at qlen <= 4; 96 "
                                   "heads and the qh128 fp8 code objects take the PS1 fp8 ASM"),
    "gfx1250.stage1": Source(GFX1250, "gfx1250 stage-1 ASM needs page_size 64 and has no "
                                      "persistent, LSE or cprr kernels"),
    "cprr.arch": Source(VLLM + " + " + GFX1250,
                        "_asm_dcp_verify_configured: gfx950 is the only arch with cprr kernels; "
                        "gfx1250 stage 1 rejects round-robin CP"),
    "cprr.route": Source(VLLM, "_select_dcp_decode_route: cprr serves DCP (interleave 1) causal "
                               "verify at qlen >= 3; qlen 1 and non-causal blocks are plain"),
    "cprr.heads": Source(VLLM, "_asm_dcp_verify_heads: kernels exist at 16/32/64/128 gathered "
                               "heads; others pad up, above 128 none"),
    "cprr.dtypes": Source("AITER hsa/gfx950/mla/mla_asm.csv",
                          "the rows with cprr=1 (mla_*_cprr_ps, lse and not) are qType/kvType "
                          "bf16/bf16 and fp8/fp8 only: no fp16 cprr kernel, so an fp16 model "
                          "has no round-robin decode (stricter than the seed, which does not "
                          "check the dtype)"),
    "segmented.route": Source(VLLM, "_segmented_dcp_verify_supported / _select_dcp_decode_route: "
                                    "DCP > 1 with interleave 1, causal qlen > 1"),
    "segmented.dtypes": Source(VLLM, "forward_mqa / _forward_segmented_dcp_verify: a 16-bit cache "
                                     "in the model dtype (bf16 or fp16) or an fp8 one, whose "
                                     "non-bf16 query is converted to bf16 first"),
    "segmented.tile": Source(VLLM + " + AITER aiter/ops/triton/_triton_kernels/attention/mla.py"
                             " + Triton third_party/amd/backend/compiler.py min_dot_size",
                             "_segmented_mla_page_size: the tile is the page (at most 128); it is "
                             "the N side of the score tl.dot, which Triton on gfx9 wants >= 16 "
                             "for bf16/fp8 operands (older Triton fell back to FMA)"),
    "fp8ps.arch": Source(VLLM, "_fp8_mla_prefill_supported: gfx950 plus both kernels"),
    "fp8ps.dtypes": Source(VLLM, "__init__ / _mla_fp8_prefill_attn: fp8 KV, bf16 output; the "
                                 "kernel reads fp8 q/k/v (a bf16 q is cast unscaled)"),
    "fp8ps.heads": Source(VLLM, "get_fp8_prefill_num_heads: heads padded to the next multiple of "
                                "16 (no native 24), bounded by is_valid_num_heads"),
    "fp8ps.shape": Source(VLLM + " + AITER hsa/gfx950/mla/mla_asm.csv",
                          "_build_fp8_prefill_ps_metadata: causal, kv_indptr = qo_indptr (no "
                          "chunked context); kernel mla_pfl_qh192_vh128"),
    # --- portable routes ---------------------------------------------------------------
    "triton.arch": Source("mlatune/kernels/__init__.py",
                          "the */triton routes run plain Triton kernels, which build for every "
                          "NVIDIA and AMD GPU arch here (and run in the CPU interpreter)"),
    "triton.dots": Source("Triton third_party/nvidia (MMAv2 / mma.sync m16n8k16)",
                          "bf16 and fp16 tensor-core dots need sm_80 (Ampere) or newer"),
    "triton.fp8": Source("Triton tl.dot fp8 operands + AITER aiter/utility/dtypes.py",
                         "NVIDIA fp8 dots are e4m3fn from sm_89; AMD's matrix cores take "
                         "e4m3fnuz on gfx940-gfx942 (CDNA3) and OCP e4m3fn on gfx950 (CDNA4); "
                         "no other AMD arch's fp8 is known to these kernels"),
    "triton.interpreter": Source("mlatune/routes/triton_support.py (measured, Triton 3.6 and 3.9)",
                                 "the Triton interpreter computes bf16 tl.dot wrongly (errors to "
                                 "1e10), so bf16 runs on GPUs only"),
    "triton.decode": Source("mlatune/routes/triton_decode.py",
                            "the Triton decode families are decode kernels (the absorbed form)"),
    "triton.decode.dims": Source("mlatune/kernels/attend.py",
                                 "q rows and KV tiles are loaded with tl.arange over kv_lora_rank "
                                 "and rope_dim, so each is a power of two, and a dot operand "
                                 "side is at least 16"),
    "triton.padded.heads": Source(VLLM, "AiterMLAHelper.is_valid_num_heads: the padded family "
                                        "pads the gathered heads as the seed does, to a multiple "
                                        "of 16 up to 128 and aligned counts above"),
    "triton.gluon": Source(VLLM, "use_gluon_decode / use_gluon_verify: the small-head family "
                                 "serves fewer than 16 heads, decode and causal verify (Gluon "
                                 "masks the block causally), no DCP (its MTP entry cannot "
                                 "express per-rank windows); verify blocks up to the widest "
                                 "decode entry, qseqlen 8"),
    "triton.cprr": Source(VLLM, "_asm_dcp_verify_heads / DCP decode routing: cprr serves DCP "
                                "round-robin shards with the gathered heads padded to "
                                "16/32/64/128, none above"),
    "triton.segmented": Source(VLLM, "_segmented_dcp_verify_supported / _select_dcp_decode_route:"
                                     " segmented serves DCP causal verify (qlen > 1) with one "
                                     "single-query row per token"),
    "triton.prefill": Source("mlatune/routes/prefill_triton.py",
                             "fp8-ps/triton and bf16-ps/triton run the persistent varlen prefill "
                             "kernel (the non-absorbed form)"),
    "triton.prefill.dtypes": Source("mlatune/kernels/prefill.py + " + VLLM,
                                    "fp8-ps reads fp8 q/k/v with per-tensor scales (the seed's "
                                    "_mla_fp8_prefill_attn); bf16-ps reads a 16-bit q over k/v "
                                    "in q's type or in fp8, converted to q's type as it loads"),
    "triton.prefill.dims": Source("mlatune/kernels/prefill.py + prefill_plan.split_head_dim",
                                  "the q.k dot is split in two power-of-two parts >= 16 "
                                  "(192 = 128 + 64); d_v is one power of two >= 16"),
    # --- wgmma/gluon, seesaw/gluon, transposed/gluon: mlatune's Hopper Gluon decodes ----
    "wgmma.arch": Source(WGMMA_GLUON + " (its GPU tests: tests/test_gluon_gpu.py)",
                         "warpgroup MMAs (wgmma), TMA copies and mbarriers: sm_90 (Hopper) only"),
    "wgmma.shape": Source(WGMMA_GLUON, "decode (the absorbed form): q rows of 512 latent + 64 "
                                       "rope dims, V the 512 latent dims; a 64-key KV tile is "
                                       "found through the block table and copied by TMA or "
                                       "gathered by cp.async (gluon_hopper_plan.page_refusal "
                                       "names the pages, seesaw_gathers the gathered ones)"),
    "wgmma.dtypes": Source(WGMMA_GLUON, "bf16 or fp16 q over a cache of the same dtype "
                                        "(check_supported); fp8 caches are not written yet"),
    "seesaw.dtypes": Source("mlatune/kernels/gluon_seesaw.py + gluon_hopper_plan.dtype_refusal",
                            "bf16 or fp16 q over a cache of q's dtype or fp8 e4m3fn: an fp8 "
                            "tile is widened to fp16 in shared memory by the loader (exact), a "
                            "bf16 q row scaled by a power of two to fp16 (exact), fp16 MMAs"),
    "transposed.dtypes": Source("mlatune/kernels/gluon_transposed_ws.py",
                                "bf16 or fp16 q over a cache of q's dtype or fp8 e4m3fn "
                                "(check_supported): an fp8 tile is widened to q's dtype in "
                                "shared memory, exactly, before the 16-bit MMAs"),
    "transposed.fp8_mma": Source("mlatune/kernels/gluon_transposed_fp8.py + "
                                 "docs/kernels/gluon_transposed.md",
                                 "fp8 MMAs (q as two e4m3 terms, P rounded to e4m3) over an "
                                 "fp8 e4m3fn cache, 16 query rows a program; past 16 rows q's "
                                 "two terms make it slower than the widening"),
    "wgmma.dcp": Source(WGMMA_GLUON, "the causal mask is applied on the lengths the kernel is "
                                     "given (local to a DCP shard): right for single-token "
                                     "decode and non-causal blocks, wrong for a causal block "
                                     "over a round-robin shard; the LSE it writes lets DCP "
                                     "ranks merge"),
    "sdpa.route": Source("torch.nn.functional.scaled_dot_product_attention",
                         "a prefill (dense q/k/v) attention; takes bf16 or fp16 q with k/v in "
                         "q's dtype, so the route dequantizes an fp8 k/v into q's dtype"),
}
