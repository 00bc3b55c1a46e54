"""The portable routes' rules: mlatune's Triton decodes and prefills, torch's SDPA, and the
Hopper Gluon decodes (merged into ``rules.ROUTE_RULES`` by the package, as the vendors' are).
"""

from __future__ import annotations

from mlatune.capability import tables
from mlatune.capability.archs import ArchSpec, sm_number
from mlatune.capability.rules import (
    Context,
    Refusal,
    Rule,
    _arch_in,
    _decode,
    _rule,
)
from mlatune.kernels import gluon_hopper_plan as wgmma
from mlatune.kernels.prefill_plan import split_head_dim
from mlatune.problem import FP8_DTYPES, is_power_of_two


# --- portable routes --------------------------------------------------------------------
def _triton_arch(c: Context) -> str | None:
    if "triton" not in c.arch.backends:
        return f"no Triton build for {c.arch.arch}"
    return None


def _triton_dots(c: Context) -> str | None:
    sm = sm_number(c.arch.arch)
    if sm is not None and sm < tables.TRITON_MIN_SM:
        return f"the kernels' 16-bit dots need sm_80 or newer; this device is {c.arch.arch}"
    return None


def _triton_fp8_refusal(dtype: str, arch: ArchSpec) -> str | None:
    if arch.vendor == "cpu":
        return None  # the interpreter takes both formats
    if arch.vendor == "nvidia":
        if dtype != "fp8_e4m3fn":
            return f"{dtype} is AMD's fp8 format (MI300); NVIDIA GPUs use fp8_e4m3fn"
        if (sm_number(arch.arch) or 0) < tables.TRITON_FP8_MIN_SM:
            return f"fp8 tensor-core dots need sm_89 or newer; this device is {arch.arch}"
        return None
    wanted = tables.TRITON_AMD_FP8.get(arch.arch)
    if wanted is None:
        return (f"no fp8 matrix support known for {arch.arch} (gfx942: e4m3fnuz, "
                f"gfx950: e4m3fn)")
    if dtype != wanted:
        return f"{arch.arch} computes fp8 as {wanted}, not {dtype}"
    return None


def _triton_fp8(c: Context) -> str | None:
    for dtype in sorted({c.p.q_dtype, c.p.kv_dtype} & FP8_DTYPES):
        reason = _triton_fp8_refusal(dtype, c.arch)
        if reason:
            return reason
    return None


def _triton_interpreter(c: Context) -> str | None:
    if c.arch.vendor == "cpu" and "bf16" in (c.p.q_dtype, c.p.kv_dtype):
        return "the Triton interpreter computes bf16 dots wrongly; bf16 runs on GPUs"
    return None


def _triton_decode(c: Context) -> str | None:
    if c.p.phase != "decode":
        return f"decode routes serve phase 'decode', not {c.p.phase!r}"
    return None


def _triton_decode_dims(c: Context) -> str | None:
    for name in ("kv_lora_rank", "rope_dim"):
        value = getattr(c.p, name)
        if not is_power_of_two(value) or value < tables.TRITON_MIN_DIM:
            return f"{name} must be a power of two >= 16 for the kernel's tiles, got {value}"
    return None


def _triton_padded_heads(c: Context) -> str | None:
    heads = c.p.kernel_heads
    if heads > tables.TRITON_MAX_PADDED_HEADS and heads % tables.TRITON_PAD_MULTIPLE:
        return f"{heads} kernel heads: padding serves up to 128 heads or multiples of 16"
    return None


def _triton_gluon(c: Context) -> str | None:
    p = c.p
    if p.kernel_heads > tables.TRITON_GLUON_MAX_HEADS:
        return f"{p.kernel_heads} kernel heads: the small-head family serves < 16"
    if p.dcp_size != 1:
        return ("no DCP: a folded verify block cannot express per-rank windows "
                "(cprr and segmented serve DCP)")
    if p.qlen > tables.TRITON_GLUON_MAX_QLEN:
        return (f"qlen {p.qlen} > {tables.TRITON_GLUON_MAX_QLEN}: the small-head family serves "
                f"decode and verify up to {tables.TRITON_GLUON_MAX_QLEN} tokens")
    if p.qlen > 1 and not p.causal:
        return "non-causal verify: the small-head family always masks the block causally"
    return None


def _triton_cprr(c: Context) -> str | None:
    if c.p.dcp_size == 1:
        return "cprr serves DCP (dcp_size > 1) round-robin shards only"
    top = tables.TRITON_CPRR_HEADS[-1]
    if c.p.kernel_heads > top:
        return (f"{c.p.kernel_heads} kernel heads > {top}: cprr pads to one of "
                f"{tables.TRITON_CPRR_HEADS}")
    return None


def _triton_segmented(c: Context) -> str | None:
    if c.p.dcp_size == 1:
        return "segmented serves DCP verify: dcp_size must be > 1"
    if c.p.qlen == 1:
        return "segmented serves verify (qlen > 1); decode has no per-token windows"
    if not c.p.causal:
        return "segmented encodes causal windows in row lengths: causal only"
    return None


def _serves_prefill(route_id: str) -> Refusal:
    def refuse(c: Context) -> str | None:
        if c.p.phase != "prefill":
            return f"{route_id} serves prefill only, not {c.p.phase}"
        return None
    return refuse


def _prefill_dtypes(route_id: str, q_dtypes: frozenset[str], fp8_kv: bool) -> Refusal:
    """q in ``q_dtypes`` over k/v in q's dtype (or in fp8 where ``fp8_kv``)."""
    def refuse(c: Context) -> str | None:
        q, kv = c.p.q_dtype, c.p.kv_dtype
        if q not in q_dtypes or not (kv == q or (fp8_kv and kv in FP8_DTYPES)):
            also = " or an fp8 kv" if fp8_kv else ""
            return (f"{route_id} needs q and kv both in {sorted(q_dtypes)}{also}, got "
                    f"q {q} with kv {kv}")
        return None
    return refuse


def _prefill_dims(c: Context) -> str | None:
    if split_head_dim(c.p.d_qk) is None:
        return (f"d_qk {c.p.d_qk} is not a sum of two powers of two >= 16 "
                f"(the kernel splits the q.k dot, e.g. 192 = 128 + 64)")
    d_v = c.p.d_v
    if d_v < tables.TRITON_MIN_DIM or not is_power_of_two(d_v):
        return f"d_v {d_v} is not a power of two >= 16"
    return None


def _sdpa_dtypes(c: Context) -> str | None:
    q, kv = c.p.q_dtype, c.p.kv_dtype
    if q not in ("bf16", "fp16") or kv not in (q, *FP8_DTYPES):
        return (f"sdpa/torch needs q bf16 or fp16 and kv in q's dtype or fp8, got "
                f"q {q} with kv {kv}")
    return None


# --- wgmma/gluon, seesaw/gluon, transposed/gluon: mlatune's Hopper Gluon decodes --------
def _wgmma_dims(c: Context) -> str | None:
    if (c.p.kv_lora_rank, c.p.rope_dim) != (wgmma.D_NOPE, wgmma.D_ROPE):
        return (f"the Gluon kernel is built for kv_lora_rank {wgmma.D_NOPE} + rope_dim "
                f"{wgmma.D_ROPE} (d_qk/d_v {wgmma.D_NOPE + wgmma.D_ROPE}/{wgmma.D_NOPE}); this "
                f"problem has {c.p.d_qk}/{c.p.d_v}")
    return None


def _wgmma_page(c: Context) -> str | None:
    return wgmma.page_refusal(c.p.page_size)


def _seesaw_page(c: Context) -> str | None:
    return wgmma.page_refusal(c.p.page_size, gathers=c.p.kv_dtype not in FP8_DTYPES)


def _fp8_mma_page(c: Context) -> str | None:
    return wgmma.page_refusal(c.p.page_size, gathers=False)


def _gluon_dtypes(kernel: str) -> Refusal:
    """The q and cache dtypes ``kernel`` reads (``gluon_hopper_plan.dtype_refusal``)."""
    def refuse(c: Context) -> str | None:
        return wgmma.dtype_refusal(kernel, c.p.q_dtype, c.p.kv_dtype)
    return refuse


def _transposed_fp8_mma(c: Context) -> str | None:
    rows = wgmma.transposed_rows(c.p.kernel_heads * c.p.qlen)
    if c.p.kv_dtype == wgmma.FP8_CACHE and rows <= tables.TRANSPOSED_FP8_MMA_MAX_ROWS:
        return None
    return (f"{c.p.kv_dtype} cache at {rows} query rows a program: the fp8-MMA kernel reads "
            f"a {wgmma.FP8_CACHE} cache at up to {tables.TRANSPOSED_FP8_MMA_MAX_ROWS} rows "
            f"(transposed/gluon serves the rest)")


def _wgmma_dcp(c: Context) -> str | None:
    if c.p.dcp_size > 1 and c.block_has_order:
        return ("causal verify over a DCP shard: the Gluon kernel masks on the shard's local "
                "positions (cprr or segmented serve it)")
    return None


_WGMMA_GLUON = (
    _rule("wgmma.arch", _arch_in(tables.WGMMA_GLUON_ARCHS, "the Hopper Gluon decode")),
    _rule("wgmma.decode", _decode, "wgmma.shape"),
    _rule("wgmma.dims", _wgmma_dims, "wgmma.shape"),
    _rule("wgmma.page", _wgmma_page, "wgmma.shape"),
    _rule("wgmma.dtypes", _gluon_dtypes("gluon_hopper")),
    _rule("wgmma.dcp", _wgmma_dcp),
)


def _replaced(rules: tuple[Rule, ...], by_id: dict[str, Rule]) -> tuple[Rule, ...]:
    """``rules`` with each rule whose id ``by_id`` names replaced by its entry."""
    return tuple(by_id.get(r.id, r) for r in rules)


_SEESAW_GLUON = _replaced(_WGMMA_GLUON, {
    "wgmma.dtypes": _rule("seesaw.dtypes", _gluon_dtypes("gluon_seesaw")),
    "wgmma.page": _rule("wgmma.page", _seesaw_page, "wgmma.shape")})
_TRANSPOSED_GLUON = _replaced(_WGMMA_GLUON, {
    "wgmma.dtypes": _rule("transposed.dtypes", _gluon_dtypes("gluon_transposed"))})
_TRANSPOSED_MMA8_GLUON = (
    *_replaced(_TRANSPOSED_GLUON, {"wgmma.page": _rule("wgmma.page", _fp8_mma_page,
                                                       "wgmma.shape")}),
    _rule("transposed.fp8_mma", _transposed_fp8_mma))


# --- portable routes: mlatune's Triton kernels and torch --------------------------------
_TRITON_DEVICE = (  # what the arch's dots take, after the route's own shape rules
    _rule("triton.dots", _triton_dots),
    _rule("triton.fp8", _triton_fp8),
    _rule("triton.interpreter", _triton_interpreter),
)
_TRITON_DECODE = (
    _rule("triton.arch", _triton_arch),
    _rule("triton.decode", _triton_decode),
    _rule("triton.decode.dims", _triton_decode_dims),
    *_TRITON_DEVICE,
)


def _triton_prefill(route_id: str, q_dtypes: frozenset[str], fp8_kv: bool) -> tuple[Rule, ...]:
    return (
        _rule("triton.arch", _triton_arch),
        _rule("triton.prefill", _serves_prefill(route_id)),
        _rule("triton.prefill.dtypes", _prefill_dtypes(route_id, q_dtypes, fp8_kv)),
        _rule("triton.prefill.dims", _prefill_dims),
        *_TRITON_DEVICE,
    )


PORTABLE_RULES: dict[str, tuple[Rule, ...]] = {
    "padded/triton": (*_TRITON_DECODE,
                      _rule("triton.padded.heads", _triton_padded_heads)),
    "gluon/triton": (*_TRITON_DECODE, _rule("triton.gluon", _triton_gluon)),
    "cprr/triton": (*_TRITON_DECODE, _rule("triton.cprr", _triton_cprr)),
    "segmented/triton": (*_TRITON_DECODE, _rule("triton.segmented", _triton_segmented)),
    "fp8-ps/triton": _triton_prefill("fp8-ps/triton", FP8_DTYPES, fp8_kv=False),
    "bf16-ps/triton": _triton_prefill("bf16-ps/triton", frozenset({"bf16", "fp16"}),
                                      fp8_kv=True),
    "sdpa/torch": (_rule("sdpa.prefill", _serves_prefill("sdpa/torch"), "sdpa.route"),
                   _rule("sdpa.dtypes", _sdpa_dtypes, "sdpa.route")),
    "reference/torch": (),  # eager fp32 torch: any problem on any device
    "wgmma/gluon": _WGMMA_GLUON,
    "seesaw/gluon": _SEESAW_GLUON,  # the same problems, and fp8 caches (widened to fp16)
    "transposed/gluon": _TRANSPOSED_GLUON,  # the same, and fp8 caches
    "transposed-mma8/gluon": _TRANSPOSED_MMA8_GLUON,  # its fp8-MMA form: fp8 caches, few rows
}


