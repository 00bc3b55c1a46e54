"""What the installed AITER offers: which entry points import, which kernel tables ship.

Asked once per process and arch (AITER does not change under a running
process). The capability rules say what an arch can do in principle; this
says what this build has. Nothing here launches work: it imports modules,
reads function signatures and reads files that ship with AITER.
"""

from __future__ import annotations

import csv
import functools
import importlib
import inspect
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class Entry:
    """An AITER callable: the first (module, name) that imports, and keywords it must accept."""

    candidates: tuple[tuple[str, str], ...]
    keywords: tuple[str, ...] = ()

    @property
    def label(self) -> str:
        return " or ".join(f"{m}.{n}" for m, n in self.candidates)


ENTRIES: dict[str, Entry] = {
    "decode": Entry((("aiter.mla", "mla_decode_fwd"),),
                    ("sm_scale", "return_lse", "causal", "q_scale", "kv_scale", "work_meta_data")),
    "decode.cprr": Entry((("aiter.mla", "mla_decode_fwd"),),
                         ("g_kv_indptr", "cp_world_size", "cp_rank", "num_kv_splits",
                          "intra_batch_mode")),
    "metadata.info": Entry((("aiter", "get_mla_metadata_info_v1"),), ("is_sparse", "fast_mode")),
    "metadata.info.cprr": Entry((("aiter", "get_mla_metadata_info_v1"),),
                                ("max_split_per_batch",)),
    "metadata": Entry((("aiter", "get_mla_metadata_v1"),),
                      ("page_size", "kv_granularity", "max_seqlen_qo", "uni_seqlen_qo",
                       "fast_mode", "dtype_q", "dtype_kv")),
    "metadata.cprr": Entry((("aiter", "get_mla_metadata_v1"),),
                           ("max_split_per_batch", "intra_batch_mode", "is_cp_round_robin")),
    # The seed tries the unified Gluon module first, then the older name.
    "gluon": Entry((("aiter.ops.triton.gluon.mla_gluon", "mla_gluon"),
                    ("aiter.ops.triton.gluon.mla_decode_gluon", "mla_decode_gluon")),
                   ("use_2d_view", "kv_pe_offset", "min_kv_seq_len")),
    "segmented": Entry((("aiter.ops.triton.attention.mla", "mla_decode_fwd"),),
                       ("causal", "q_descale", "kv_descale", "skip_reduce")),
    "prefill": Entry((("aiter", "mla_prefill_ps_asm_fwd"),)),
    "reduce": Entry((("aiter", "mla_reduce_v1"),)),
    "ps_metadata.info": Entry((("aiter", "get_ps_metadata_info_v1"),),
                              ("batch_size", "num_head_k", "max_qlen", "qlen_granularity")),
    "ps_metadata": Entry((("aiter", "get_ps_metadata_v1"),),
                         ("qhead_granularity", "qlen_granularity", "kvlen_granularity",
                          "block_size", "is_causal")),
    "chip_info": Entry((("aiter.jit.utils.chip_info", "get_gfx"),)),
}

FAMILY_ENTRIES: dict[str, tuple[str, ...]] = {
    "gluon": ("gluon", "chip_info"),
    "padded": ("decode", "metadata.info", "metadata", "chip_info"),
    "cprr": ("decode", "decode.cprr", "metadata.info", "metadata.info.cprr", "metadata",
             "metadata.cprr", "chip_info"),
    "segmented": ("segmented", "chip_info"),
    "fp8-ps": ("prefill", "reduce", "ps_metadata.info", "ps_metadata", "chip_info"),
}


def _row_flag(row: dict[str, str], column: str) -> bool:
    return row.get(column, "").strip() == "1"


# Which rows of the arch's ASM manifest (hsa/<arch>/mla/mla_asm.csv) a family needs.
# Coarse on purpose: AITER folds and remaps head counts before its lookup, so a
# per-shape match here would re-implement its dispatcher; the sweep measures the rest.
MANIFEST_NEEDS: dict[str, tuple[str, Callable[[dict[str, str]], bool]]] = {
    "padded": ("ASM decode", lambda r: not _row_flag(r, "prefill") and not _row_flag(r, "cprr")),
    "cprr": ("round-robin (cprr) decode with LSE",
             lambda r: _row_flag(r, "cprr") and _row_flag(r, "lse")),
    "fp8-ps": ("fp8 persistent prefill",
               lambda r: _row_flag(r, "prefill") and _row_flag(r, "ps")
               and r.get("qType", "").strip() == "fp8"),
}

# Native 24-head decode: the reducer and the v1_2 metadata planner must both
# carry a 24-head case (the seed's probe reads AITER's sources the same way).
_H24_MARKERS = (
    ("kernels/mla/reduce.cu", "MLA_REDUCE_CASE_EF(NUM_HEAD,24,HEAD_DIM,512,"),
    ("kernels/mla/metadata/v1_2_device.cuh", "num_heads==24"),
)


@dataclass(frozen=True)
class AiterBuild:
    arch: str
    import_error: str | None  # why `import aiter` fails; None when it imports
    version: str = ""
    unusable: dict[str, str] = field(default_factory=dict)  # entry key -> why not usable
    manifest: tuple[dict[str, str], ...] | None = None  # None: no manifest found for the arch
    native_h24: bool = False

    def refusal(self, family: str) -> str | None:
        """Why this build cannot run the route family, or None."""
        if self.import_error:
            return f"aiter does not import ({self.import_error})"
        for key in FAMILY_ENTRIES[family]:
            if key in self.unusable:
                return self.unusable[key]
        need = MANIFEST_NEEDS.get(family)
        if need and self.manifest is not None and not any(need[1](r) for r in self.manifest):
            return f"the {self.arch} kernel manifest (mla_asm.csv) lists no {need[0]} kernels"
        return None


def load(key: str) -> Callable[..., Any]:
    """The AITER callable behind an entry key (imports it; raises ImportError if absent)."""
    entry = ENTRIES[key]
    errors = []
    for module_name, name in entry.candidates:
        try:
            return getattr(importlib.import_module(module_name), name)
        except (ImportError, AttributeError) as exc:
            errors.append(f"{module_name}.{name}: {type(exc).__name__}")
    raise ImportError(f"{entry.label} not found ({'; '.join(errors)})")


def _unusable_reason(key: str) -> str | None:
    entry = ENTRIES[key]
    try:
        fn = load(key)
    except ImportError as exc:
        return str(exc)
    except Exception as exc:  # an AITER module that fails while importing (JIT, HIP)
        return f"{entry.label} fails to import: {type(exc).__name__}: {exc}".splitlines()[0]
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):  # a compiled op without a readable signature
        return None
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return None
    missing = [k for k in entry.keywords if k not in params]
    if missing:
        return f"{entry.label} takes no {', '.join(missing)} (an older AITER)"
    return None


def _manifest(arch: str) -> tuple[dict[str, str], ...] | None:
    try:
        from aiter.jit.core import AITER_ASM_DIR
    except Exception:  # layout differs: leave the tables unchecked
        return None
    path = Path(AITER_ASM_DIR) / arch / "mla" / "mla_asm.csv"
    try:
        with path.open(newline="") as f:
            return tuple(csv.DictReader(f))
    except OSError:
        return None


def _native_h24() -> bool:
    try:
        from aiter.jit.core import AITER_CSRC_DIR
        texts = ["".join((Path(AITER_CSRC_DIR) / rel).read_text(encoding="utf-8").split())
                 for rel, _ in _H24_MARKERS]
    except Exception:  # sources not shipped: assume padding, as the seed does
        return False
    return all(marker in text for (_, marker), text in zip(_H24_MARKERS, texts, strict=True))


@functools.cache
def probe(arch: str) -> AiterBuild:
    """The installed AITER as seen from a device of ``arch`` (cached per process)."""
    try:
        aiter = importlib.import_module("aiter")
    except Exception as exc:
        return AiterBuild(arch, f"{type(exc).__name__}: {exc}".splitlines()[0])
    unusable = {}
    for key in ENTRIES:
        reason = _unusable_reason(key)
        if reason:
            unusable[key] = reason
    return AiterBuild(arch, None, str(getattr(aiter, "__version__", "unknown")), unusable,
                      _manifest(arch), _native_h24())
