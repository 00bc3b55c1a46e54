"""Per-route capability rules: can this route serve this problem on this arch, and if not why.

Each route id maps to an ordered tuple of rules; a rule returns why it refuses
or None, and carries the source it comes from (tables.SOURCES). ``check``
runs them in order and reports the first refusal. Nothing here touches a GPU
or imports a kernel library: the same answers serve `mlatune plan` on a
laptop and a route's ``supports`` on the device (where the route adds its
probe of the machine: the installed library, Triton's interpreter on a CPU).

Every built-in route has its rules here (the AITER routes, the portable Triton
and torch routes, mlatune's Hopper Gluon decode; the vendor routes' in
``vendors``), so `mlatune plan` and ``route.supports`` cannot disagree but by
that probe (for the Gluon routes: the installed triton's version).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from mlatune.capability import tables
from mlatune.capability.archs import ARCHS, ArchSpec, spec_for
from mlatune.capability.heads import (
    HeadPlan,
    asm_decode_heads,
    cprr_heads,
    fp8_prefill_heads,
    valid_num_heads,
)
from mlatune.problem import FP8_DTYPES, MLAProblem, dtype_size


@dataclass(frozen=True)
class Ruling:
    ok: bool
    reason: str
    rule: str = ""  # the refusing rule's id; empty when ok

    def __bool__(self) -> bool:
        return self.ok


@dataclass(frozen=True)
class Context:
    problem: MLAProblem
    arch: ArchSpec
    native_h24: bool = False  # the build has native 24-head ASM decode (probed on the device)
    force_gluon: bool = False  # Gluon for single-token decode at any head count below 16

    @property
    def p(self) -> MLAProblem:
        return self.problem

    def dtype_class(self, name: str) -> str:
        return "fp8" if name in FP8_DTYPES else name

    @property
    def dtypes(self) -> tuple[str, str]:
        """(q, kv) dtype classes: "bf16", "fp16" or "fp8"."""
        return self.dtype_class(self.p.q_dtype), self.dtype_class(self.p.kv_dtype)

    @property
    def block_has_order(self) -> bool:
        """Whether the causal mask matters: a causal block of two or more tokens."""
        return self.p.causal and self.p.qlen > 1


Refusal = Callable[[Context], "str | None"]


@dataclass(frozen=True)
class Rule:
    id: str
    refuse: Refusal
    source_key: str

    @property
    def source(self) -> tables.Source:
        return tables.SOURCES[self.source_key]


def kv_cache_bytes(problem: MLAProblem) -> int:
    """Bytes of the paged KV cache one rank holds for the problem (whole pages, equal lengths)."""
    pages = -(-problem.shard_len // problem.page_size)
    return problem.batch * pages * problem.page_size * problem.d_qk * dtype_size(problem.kv_dtype)


# --- rules shared by several routes -----------------------------------------------------
def _amd(c: Context) -> str | None:
    if c.arch.vendor != "amd":
        return f"AITER builds for AMD Instinct GPUs only; {c.arch.arch} is {c.arch.vendor}"
    if "aiter" not in c.arch.backends:
        known = "/".join(a for a, s in ARCHS.items() if "aiter" in s.backends)
        return f"AITER's MLA kernels are built for {known}; this is {c.arch.arch}"
    return None


def _aiter_heads(c: Context) -> str | None:
    for what, heads in (("heads per rank", c.p.num_heads),
                        ("DCP-gathered heads", c.p.kernel_heads)):
        if not valid_num_heads(heads):
            return (f"{heads} {what}: the backend takes at most 128 heads, or a multiple of 16 "
                    f"(per rank and gathered alike)")
    return None


def _fp8_format(c: Context) -> str | None:
    for role, name in (("q", c.p.q_dtype), ("kv", c.p.kv_dtype)):
        if name in FP8_DTYPES and name != c.arch.fp8:
            return f"{c.arch.arch} kernels read {c.arch.fp8}; {role} is {name}"
    return None


def _decode(c: Context) -> str | None:
    return None if c.p.phase == "decode" else "a decode route; this is a prefill problem"


def _prefill(c: Context) -> str | None:
    return None if c.p.phase == "prefill" else "a prefill route; this is a decode problem"


def _decode_dims(c: Context) -> str | None:
    if (c.p.d_qk, c.p.d_v) != tables.MLA_DECODE_DIMS:
        return (f"AITER's MLA decode is built for d_qk/d_v {tables.MLA_DECODE_DIMS}; "
                f"this problem has {c.p.d_qk}/{c.p.d_v}")
    return None


def _decode_qlen(c: Context) -> str | None:
    if c.p.qlen > tables.MAX_DECODE_QLEN:
        return f"qlen {c.p.qlen}: no ASM decode entry wider than {tables.MAX_DECODE_QLEN} tokens"
    return None


def _arch_in(archs: tuple[str, ...], what: str) -> Refusal:
    def refuse(c: Context) -> str | None:
        if c.arch.arch not in archs:
            return f"{what} is built for {'/'.join(archs)} only; this is {c.arch.arch}"
        return None
    return refuse


def _dcp_needed(c: Context) -> str | None:
    if c.p.dcp_size == 1:
        return "serves decode context parallelism only (dcp_size > 1); this problem has dcp 1"
    return None


# --- Gluon small-head decode ------------------------------------------------------------
def _gluon_kv(c: Context) -> str | None:
    if c.p.kv_dtype not in tables.GLUON_KV_DTYPES:
        return (f"Gluon serves a 16-bit cache only (its fp8 regime cannot take a batch); "
                f"kv_dtype is {c.p.kv_dtype}")
    return None


def _gluon_heads(c: Context) -> str | None:
    if c.p.kernel_heads > tables.GLUON_MAX_HEADS:
        return f"{c.p.kernel_heads} kernel heads: Gluon serves fewer than 16 (ASM takes 16 and up)"
    return None


def _gluon_verify(c: Context) -> str | None:
    if c.p.qlen == 1:
        return None
    if not c.p.causal:
        return "Gluon masks a verify block causally with no way off; this block is non-causal"
    if c.p.dcp_size > 1:
        return "DCP verify is the segmented/cprr routes' job; Gluon's MTP entry cannot do it"
    return None


def _gluon_lse(c: Context) -> str | None:
    if c.p.dcp_size > 1:
        return "Gluon returns no LSE, which a DCP shard's partial output needs for the merge"
    return None


def _gluon_divisor(c: Context) -> str | None:
    h = c.p.kernel_heads
    if c.p.qlen == 1 and tables.GLUON_DIVISOR_OF % h != 0 and not c.force_gluon:
        return (f"{h} heads do not divide 16: single-token Gluon only when forced "
                f"(MLATUNE_AITER_GLUON=force); the padded ASM decode serves it")
    return None


def _gluon_cache(c: Context) -> str | None:
    size = kv_cache_bytes(c.p)
    if size > tables.GLUON_MAX_KV_CACHE_BYTES:
        return f"KV cache {size / 2**30:.1f} GiB > 2 GiB, past which Gluon reads unmasked"
    return None


# --- padded ASM decode ------------------------------------------------------------------
@dataclass(frozen=True)
class AsmPlan:
    heads: HeadPlan
    mode: str  # "persistent" (scheduled), "non-persistent" (split-KV), "stage1" (gfx1250, 64-page)


def _ps1_dtype(problem: MLAProblem) -> str:
    return "fp8" if problem.kv_dtype in FP8_DTYPES else problem.kv_dtype


def gfx1250_ps1_serves(problem: MLAProblem, kernel_heads: int) -> bool:
    return any(k.serves(kernel_heads, _ps1_dtype(problem), problem.qlen)
               for k in tables.GFX1250_PS1)


def padded_asm_plan(problem: MLAProblem, arch: str, native_h24: bool = False) -> AsmPlan | None:
    """Heads and scheduling the padded ASM decode uses; None when no head count fits."""
    native = native_h24 and arch in tables.NATIVE_H24_ARCHS
    kernel = asm_decode_heads(problem.kernel_heads, native)
    if kernel is None:
        return None
    heads = HeadPlan(problem.kernel_heads, kernel)
    if arch == "gfx1250":
        return AsmPlan(heads, "persistent" if gfx1250_ps1_serves(problem, kernel) else "stage1")
    padded_small = problem.kernel_heads < tables.ASM_HEAD_MULTIPLE
    if (problem.causal and padded_small and problem.kv_dtype not in FP8_DTYPES
            and problem.qlen > tables.ASM_PADDED_MAX_PERSISTENT_QLEN):
        return AsmPlan(heads, "non-persistent")
    return AsmPlan(heads, "persistent")


def _asm_dtypes(c: Context) -> str | None:
    q, kv = c.dtypes
    if q != kv:
        return (f"{c.p.q_dtype} q over a {c.p.kv_dtype} cache: the ASM decode reads an fp8 q over "
                f"an fp8 cache (measure it with q_dtype {c.p.kv_dtype})")
    return None



def _asm_dcp_causal(c: Context) -> str | None:
    if c.p.dcp_size > 1 and c.block_has_order:
        return ("causal verify over a DCP shard: the plain kernel masks on local positions "
                "(cprr or segmented serve it)")
    return None


def _asm_non_causal(c: Context) -> str | None:
    if not c.p.causal and c.p.qlen > 1 and c.arch.arch not in tables.ASM_NON_CAUSAL_ARCHS:
        return f"no non-causal multi-token decode kernels on {c.arch.arch} (gfx950 only)"
    return None


def _asm_non_causal_fp16(c: Context) -> str | None:
    if not c.p.causal and c.p.qlen > 1 and c.p.q_dtype == "fp16":
        return "non-causal fp16 decode aborts in AITER"
    return None


def _asm_fp8_qlen2(c: Context) -> str | None:
    plan = padded_asm_plan(c.p, c.arch.arch, c.native_h24)
    if (not c.p.causal and c.p.qlen == 2 and c.p.kv_dtype in FP8_DTYPES and plan is not None
            and plan.heads.kernel not in tables.FP8_NON_CAUSAL_QLEN2_HEADS):
        return (f"fp8 non-causal 2-token block at {plan.heads.kernel} kernel heads: only "
                f"{'/'.join(map(str, tables.FP8_NON_CAUSAL_QLEN2_HEADS))} have a kernel")
    return None


def _gfx1250_stage1_page(c: Context) -> str | None:
    plan = padded_asm_plan(c.p, c.arch.arch, c.native_h24)
    if plan and plan.mode == "stage1" and c.p.page_size % tables.GFX1250_STAGE1_PAGE:
        return (f"{plan.heads.kernel} heads x qlen {c.p.qlen} ({c.p.kv_dtype}) is outside the "
                f"FlyDSL PS1 set, and stage-1 ASM needs 64-token pages; page_size is "
                f"{c.p.page_size}")
    return None


def _gfx1250_stage1_lse(c: Context) -> str | None:
    plan = padded_asm_plan(c.p, c.arch.arch, c.native_h24)
    if plan and plan.mode == "stage1" and c.p.dcp_size > 1:
        return ("outside the FlyDSL PS1 set, and stage-1 ASM on gfx1250 has no LSE kernels, "
                "which a DCP shard needs")
    return None


# --- CPRR -------------------------------------------------------------------------------
def _cprr_arch(c: Context) -> str | None:
    if c.arch.arch == "gfx1250":
        return "gfx1250 has no cprr kernels, and its stage-1 ASM rejects round-robin CP"
    return _arch_in(tables.CPRR_ARCHS, "the round-robin (cprr) ASM decode")(c)


def _cprr_dtypes(c: Context) -> str | None:
    if c.dtypes not in (("bf16", "bf16"), ("fp8", "fp8")):
        return f"cprr kernels are bf16/bf16 or fp8/fp8; this is {c.p.q_dtype}/{c.p.kv_dtype}"
    return None


def _cprr_block(c: Context) -> str | None:
    if not c.p.causal:
        return "a non-causal block needs no global window: the plain decode serves it"
    if c.p.qlen < tables.CPRR_MIN_QLEN:
        return f"qlen {c.p.qlen}: cprr serves verify blocks of {tables.CPRR_MIN_QLEN}+ tokens"
    return None


def _cprr_heads(c: Context) -> str | None:
    if cprr_heads(c.p.kernel_heads) is None:
        return f"{c.p.kernel_heads} kernel heads: cprr kernels stop at 128"
    return None


# --- segmented DCP verify ---------------------------------------------------------------
def _segmented_dtypes(c: Context) -> str | None:
    q, kv = c.dtypes
    if q != kv and "fp8" not in (q, kv):
        return (f"segmented verify reads a 16-bit q in the 16-bit cache's dtype; this is "
                f"{c.p.q_dtype}/{c.p.kv_dtype}")
    return None


def _segmented_block(c: Context) -> str | None:
    if not c.block_has_order:
        return "serves causal verify blocks (qlen > 1); the plain decode serves the rest"
    return None


def _segmented_tile(c: Context) -> str | None:
    if min(c.p.page_size, tables.SEGMENTED_MAX_TILE) < tables.SEGMENTED_MIN_TILE:
        return (f"page_size {c.p.page_size}: the segmented kernel's tile is the page, and its "
                f"score dot needs at least {tables.SEGMENTED_MIN_TILE} tokens")
    return None


# --- FP8 persistent-scheduling prefill --------------------------------------------------
def _fp8ps_dims(c: Context) -> str | None:
    if (c.p.d_qk, c.p.d_v) != tables.FP8_PREFILL_DIMS:
        return (f"the FP8 prefill kernel is built for d_qk/d_v {tables.FP8_PREFILL_DIMS}; this "
                f"problem has {c.p.d_qk}/{c.p.d_v}")
    return None


def _fp8ps_dtypes(c: Context) -> str | None:
    if c.dtypes != ("fp8", "fp8"):
        return (f"the kernel reads fp8 q/k/v and writes bf16; {c.p.q_dtype}/{c.p.kv_dtype} is "
                f"not that (a 16-bit q would be quantized)")
    return None


def _fp8ps_heads(c: Context) -> str | None:
    if fp8_prefill_heads(c.p.num_heads) is None:
        return f"{c.p.num_heads} heads: above 128 the FP8 prefill needs a multiple of 16"
    return None


def _fp8ps_shape(c: Context) -> str | None:
    if not c.p.causal:
        return "the seed runs this kernel causal only"
    if c.p.kv_len != c.p.qlen:
        return (f"kv_len {c.p.kv_len} != qlen {c.p.qlen}: the kernel is planned with KV = the "
                f"new tokens (no prefix / chunked context)")
    return None


def _rule(rule_id: str, refuse: Refusal, source_key: str | None = None) -> Rule:
    return Rule(rule_id, refuse, source_key or rule_id)


_AITER_DECODE = (
    _rule("aiter.amd", _amd),
    _rule("decode.phase", _decode, "aiter.amd"),
    _rule("aiter.heads", _aiter_heads),
)

ROUTE_RULES: dict[str, tuple[Rule, ...]] = {
    "gluon/aiter": (
        *_AITER_DECODE,
        _rule("gluon.arch", _arch_in(tables.GLUON_ARCHS, "Gluon MLA decode")),
        _rule("decode.dims", _decode_dims),
        _rule("gluon.kv", _gluon_kv),
        _rule("gluon.heads", _gluon_heads),
        _rule("gluon.verify", _gluon_verify),
        _rule("gluon.lse", _gluon_lse),
        _rule("gluon.divisor", _gluon_divisor),
        _rule("gluon.cache", _gluon_cache),
    ),
    "padded/aiter": (
        *_AITER_DECODE,
        _rule("asm.arch", _arch_in(tables.ASM_DECODE_ARCHS, "the ASM decode"), "aiter.amd"),
        _rule("decode.dims", _decode_dims),
        _rule("aiter.fp8", _fp8_format),
        _rule("asm.dtypes", _asm_dtypes),
        _rule("decode.qlen", _decode_qlen),
        _rule("asm.dcp", _asm_dcp_causal),
        _rule("asm.non_causal", _asm_non_causal),
        _rule("asm.non_causal_fp16", _asm_non_causal_fp16),
        _rule("asm.fp8_qlen2", _asm_fp8_qlen2),
        _rule("gfx1250.stage1.page", _gfx1250_stage1_page, "gfx1250.stage1"),
        _rule("gfx1250.stage1.lse", _gfx1250_stage1_lse, "gfx1250.stage1"),
    ),
    "cprr/aiter": (
        *_AITER_DECODE,
        _rule("cprr.arch", _cprr_arch),
        _rule("decode.dims", _decode_dims),
        _rule("aiter.fp8", _fp8_format),
        _rule("cprr.dtypes", _cprr_dtypes),
        _rule("cprr.dcp", _dcp_needed, "cprr.route"),
        _rule("cprr.route", _cprr_block),
        _rule("decode.qlen", _decode_qlen),
        _rule("cprr.heads", _cprr_heads),
    ),
    "segmented/aiter": (
        *_AITER_DECODE,
        _rule("decode.dims", _decode_dims),
        _rule("aiter.fp8", _fp8_format),
        _rule("segmented.dtypes", _segmented_dtypes),
        _rule("segmented.dcp", _dcp_needed, "segmented.route"),
        _rule("segmented.route", _segmented_block),
        _rule("segmented.tile", _segmented_tile),
    ),
    "fp8-ps/aiter": (
        _rule("aiter.amd", _amd),
        _rule("prefill.phase", _prefill, "fp8ps.arch"),
        _rule("fp8ps.arch", _arch_in(tables.FP8_PREFILL_ARCHS, "the FP8 PS prefill")),
        _rule("fp8ps.dims", _fp8ps_dims, "fp8ps.shape"),
        _rule("aiter.fp8", _fp8_format),
        _rule("fp8ps.dtypes", _fp8ps_dtypes),
        _rule("fp8ps.heads", _fp8ps_heads),
        _rule("fp8ps.shape", _fp8ps_shape),
    ),
}

def known(route_id: str) -> bool:
    """Whether the capability model has rules for this route id."""
    return route_id in ROUTE_RULES


def rules_for(route_id: str) -> tuple[Rule, ...]:
    if route_id in ROUTE_RULES:
        return ROUTE_RULES[route_id]
    raise KeyError(f"no capability rules for route {route_id!r}; known: "
                   f"{', '.join(ROUTE_RULES)}")


def check(route_id: str, problem: MLAProblem, arch: str, *, native_h24: bool = False,
          force_gluon: bool = False) -> Ruling:
    """Whether ``route_id`` can serve ``problem`` on ``arch``; the first refusing rule says why.

    ``arch`` is a planning arch (``ARCHS``), ``cpu``, or another ``sm_NN`` / ``gfxNNN`` a
    route meets on the machine it runs on (``archs.spec_for``)."""
    rules = rules_for(route_id)
    spec = spec_for(arch)
    if spec is None:
        return Ruling(False, f"no capability entry for arch {arch!r} (known: {', '.join(ARCHS)}, "
                             f"cpu, and any sm_NN / gfxNNN)", "arch.unknown")
    context = Context(problem, spec, native_h24, force_gluon)
    for rule in rules:
        reason = rule.refuse(context)
        if reason:
            return Ruling(False, reason, rule.id)
    return Ruling(True, _supported_note(route_id, context))


def _supported_note(route_id: str, c: Context) -> str:
    if route_id == "padded/aiter":
        plan = padded_asm_plan(c.p, c.arch.arch, c.native_h24)
        return f"{plan.mode} ASM decode at {plan.heads.kernel} kernel heads ({plan.heads.method})"
    if route_id == "cprr/aiter":
        return f"cprr at {cprr_heads(c.p.kernel_heads)} kernel heads"
    if route_id == "fp8-ps/aiter":
        return f"FP8 PS prefill at {fp8_prefill_heads(c.p.num_heads)} heads"
    return "supported"
