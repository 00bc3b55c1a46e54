"""Capability model: which route can serve which problem on which arch, and why not.

Rules are data where they can be (``tables``: head counts, qlen bounds, dtypes,
page sizes per arch, each with its source) and small functions where they
must be (``rules``). ``check(route_id, problem, arch)`` needs no GPU and no
kernel library; routes call it from ``supports`` and `mlatune plan` calls it
for an arch that is not on this machine.
"""

from mlatune.capability import rules, tables
from mlatune.capability.archs import AMD_ARCHS, ARCHS, ArchSpec, arch_spec, device_for_arch
from mlatune.capability.heads import HeadPlan, asm_decode_heads, cprr_heads, fp8_prefill_heads
from mlatune.capability.portable import PORTABLE_RULES
from mlatune.capability.rules import (
    AsmPlan,
    Rule,
    Ruling,
    check,
    gfx1250_ps1_serves,
    known,
    kv_cache_bytes,
    padded_asm_plan,
    rules_for,
)
from mlatune.capability.tables import Source
from mlatune.capability.vendors import VENDOR_RULES, VENDOR_SOURCES

# The portable and vendor routes' rules live beside the AITER ones and answer through the
# same check().
tables.SOURCES.update(VENDOR_SOURCES)
rules.ROUTE_RULES.update(PORTABLE_RULES)
rules.ROUTE_RULES.update(VENDOR_RULES)

__all__ = [
    "AMD_ARCHS",
    "ARCHS",
    "ArchSpec",
    "AsmPlan",
    "HeadPlan",
    "Rule",
    "Ruling",
    "Source",
    "arch_spec",
    "asm_decode_heads",
    "check",
    "cprr_heads",
    "device_for_arch",
    "fp8_prefill_heads",
    "gfx1250_ps1_serves",
    "known",
    "kv_cache_bytes",
    "padded_asm_plan",
    "rules_for",
    "tables",
]
