"""The table's pick against the fixed policies an engine would use without a table.

Three policies, each a route per problem (or none: the policy does not serve it):

- always FlashMLA: ``dense/flashmla`` wherever it has an ok row;
- always FlashInfer fa3: ``fa3/flashinfer`` (FlashInfer's ``BatchMLAPagedAttentionWrapper``,
  backend "fa3") wherever it has an ok row;
- vLLM's Hopper order, as far as it can run here: vLLM's MLA decode backends in the
  order its CUDA platform tries them on compute capability 9.x, each skipped where
  vLLM's own constraints refuse the problem, where no mlatune route *is* that backend
  (``VLLM_HOPPER``, with why), or where that route has no ok row; the first left
  answers. It is what vLLM would run on this GPU with only the backends measured here
  installed.

Each comparison is ``policy time / pick time`` per problem the policy serves
(``compare``): its geomean, its worst (smallest) value and where, the problems where the
pick is more than ``LOSS_TOLERANCE`` slower than the policy (a defect: both vendor
routes are candidates of the sweep), the largest gains, and which shape groups carry
the gain (``gain_groups``). Times are ``time_us``, each route at its fastest measured
parameter set, as everywhere in the report.

On the table's own problems the pick is the fastest ok row, so no policy whose route
has an ok row can beat it there; the comparison is repeated on a held-out table
(``--heldout``) with the dispatcher's choice as the pick, where it can lose.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import pandas as pd

from mlatune.report.terms import batch_band, geomean, problem_label

FLASHMLA = "dense/flashmla"
FLASHINFER_FA3 = "fa3/flashinfer"
ALWAYS_FLASHMLA = "always FlashMLA"
ALWAYS_FA3 = "always FlashInfer fa3"
VLLM_POLICY = "vLLM Hopper order"
LOSS_TOLERANCE = 0.02  # the pick may be at most this much slower than a vendor policy
GOAL_OVER_FLASHMLA = 1.10  # the project's goal: geomean speedup over always-FlashMLA
TOP_GAINS = 5

# Shape groups the gain is split over: (problem column, how a value is written).
GROUP_FIELDS: tuple[tuple[str, Callable[[Any], str]], ...] = (
    ("page_size", lambda v: f"page {v}"),
    ("kv_dtype", lambda v: f"kv {v}"),
    ("num_heads", lambda v: f"{v} heads"),
    ("band", str),
    ("qlen", lambda v: f"qlen {v}"),
    ("dcp_size", lambda v: f"DCP {v}"),
)


# vLLM's Hopper order ------------------------------------------------------------------

# Read from vllm-project/vllm (files as stored in the search index, each at its commit):
#   vllm/platforms/cuda.py @ 002db4951e0c: _get_backend_priorities(use_mla=True, major 9)
#     = FLASH_ATTN_MLA, FLASHMLA, FLASHINFER_MLA, TRITON_MLA, FLASHMLA_SPARSE; the
#     selector takes the first whose validate_configuration passes. check_and_update_config
#     sets the KV block size to 64 on Hopper when FlashMLA's dense kernels are present and
#     no backend is forced.
#   vllm/v1/attention/backends/mla/flashattn_mla.py @ 00b9b7ad3a37: FLASH_ATTN_MLA, compute
#     capability 9 only, kv cache auto/float16/bfloat16 (no fp8), block size a multiple of
#     16, needs vllm.vllm_flash_attn (vLLM's FA3 build) with MLA support.
#   vllm/v1/attention/backends/mla/flashmla.py @ 01b1d3408753: FLASHMLA, capability 9 or
#     10, kv cache auto/fp8/fp8_e4m3, block size 64.
#   vllm/v1/attention/backends/mla/flashinfer_mla.py @ 002d68ef00d4: FLASHINFER_MLA,
#     capability 10 only; it calls flashinfer.decode.trtllm_batch_decode_with_kv_cache_mla
#     (TRT-LLM-gen / CuTe-DSL kernels), not BatchMLAPagedAttentionWrapper.
#   vllm/v1/attention/backends/mla/triton_mla.py @ 0155494b1dca: TRITON_MLA, any
#     capability, vLLM's own Triton decode (vllm/v1/attention/ops/triton_decode_attention.py).
VLLM_SOURCE = ("vllm-project/vllm vllm/platforms/cuda.py _get_backend_priorities "
               "(commit 002db4951e0c) and each backend's vllm/v1/attention/backends/mla/*.py")

ProblemRow = Mapping[str, Any]


@dataclass(frozen=True)
class VllmBackend:
    """One of vLLM's MLA backends in its Hopper order."""

    name: str  # vLLM's AttentionBackendEnum name
    route: str | None  # the mlatune route that is this backend; None: none here
    not_here: str  # why it cannot run here ("" where ``route`` is set)
    short: str  # the same in a few words, for the summary line
    refuses: Callable[[ProblemRow], str | None]  # vLLM's own constraint: why it skips it

    @property
    def runs_here(self) -> bool:
        return self.route is not None


def _decode_only(p: ProblemRow) -> str | None:
    return None if p["phase"] == "decode" else "prefill runs through the MLA prefill path of vLLM"


def _flash_attn_mla(p: ProblemRow) -> str | None:
    if p["kv_dtype"] not in ("bf16", "fp16"):
        return f"no fp8 cache ({p['kv_dtype']})"
    if p["page_size"] % 16:
        return f"block size {p['page_size']} is not a multiple of 16"
    return _decode_only(p)


def _flashmla(p: ProblemRow) -> str | None:
    if p["kv_dtype"] not in ("bf16", "fp16", "fp8_e4m3fn"):
        return f"kv cache {p['kv_dtype']}"
    if p["page_size"] != 64:
        return f"block size {p['page_size']}: FlashMLA takes 64"
    return _decode_only(p)


def _triton_mla(p: ProblemRow) -> str | None:
    if p["kv_dtype"] not in ("bf16", "fp16", "fp8_e4m3fn"):
        return f"kv cache {p['kv_dtype']}"
    return _decode_only(p)


VLLM_HOPPER: tuple[VllmBackend, ...] = (
    VllmBackend("FLASH_ATTN_MLA", None,
                "the FlashAttention 3 build of vLLM (vllm.vllm_flash_attn, with MLA) ships only "
                "inside the vLLM wheels and is not installable here; no mlatune route is it",
                "vllm-flash-attn is not installable here", _flash_attn_mla),
    VllmBackend("FLASHMLA", FLASHMLA, "", "", _flashmla),
    VllmBackend("FLASHINFER_MLA", None,
                "vLLM declares it for compute capability 10.x (Blackwell) only, so on Hopper "
                "vLLM skips it; it calls the TRT-LLM-gen decode of FlashInfer, not the "
                "BatchMLAPagedAttentionWrapper that fa3/flashinfer measures (compared above "
                "as its own policy)",
                "Blackwell (10.x) only in vLLM, and not the kernel fa3/flashinfer runs",
                lambda p: "compute capability 10.x only"),
    VllmBackend("TRITON_MLA", None,
                "the Triton decode kernel of vLLM (vllm/v1/attention/ops/"
                "triton_decode_attention.py, 4 KV splits); padded/triton of mlatune is a "
                "different kernel with tuned splits and does not stand in for it; not "
                "measured here",
                "its Triton kernel is not measured here (padded/triton is another kernel)",
                _triton_mla),
    VllmBackend("FLASHMLA_SPARSE", None,
                "sparse attention only (the top-k indexer of DeepSeek V3.2); the problems of "
                "the table are dense",
                "sparse attention only", lambda p: "sparse attention only"),
)
VLLM_ARCH = "sm_90"  # the order is vLLM's for compute capability 9.x


def vllm_routes(problems: pd.DataFrame, times: pd.DataFrame
                ) -> tuple[pd.Series, pd.Series]:
    """Per problem key: the route vLLM's Hopper order answers here (None: unserved), and
    the backend real vLLM would try first there, measurable here or not ("" if none)."""
    chosen, first = {}, {}
    for row in problems.to_dict("records"):
        key, route, wanted = row["key"], None, ""
        for backend in VLLM_HOPPER:
            if backend.refuses(row) is not None:
                continue
            wanted = wanted or backend.name
            if backend.runs_here and backend.route in times.columns \
                    and key in times.index and not math.isnan(times.at[key, backend.route]):
                route = backend.route
                break
        chosen[key], first[key] = route, wanted
    return (pd.Series(chosen, dtype="object").reindex(problems["key"]),
            pd.Series(first, dtype="object").reindex(problems["key"]))


# Comparing ----------------------------------------------------------------------------

@dataclass(frozen=True)
class GroupGain:
    """The gain over one policy within one shape group (e.g. page 64)."""

    field: str
    value: str
    served: int
    geomean: float
    share: float  # of the summed log gain over every served problem (NaN: no gain)


@dataclass(frozen=True)
class PolicyStats:
    """The pick against one vendor policy, over the problems the policy serves."""

    policy: str  # ALWAYS_FLASHMLA, ALWAYS_FA3 or VLLM_POLICY
    routes: str  # what the policy runs, in words
    pick: str  # "table" (the table's pick) or "nearest" (held-out: the dispatcher's choice)
    served: int
    total: int
    geomean: float  # NaN when nothing is served
    worst: float  # the smallest ratio: where the pick gains least, or loses
    worst_key: str
    losses: tuple[tuple[str, float, str, str], ...]  # (key, ratio, pick route, policy route)
    gains: tuple[tuple[str, float, str], ...]  # the largest: (key, ratio, pick route)
    groups: tuple[GroupGain, ...] = ()
    note: str = ""  # why nothing is served, or what stood in (vLLM)

    @property
    def measured(self) -> bool:
        return self.served > 0


def _band(batch: int) -> str:
    return batch_band(int(batch))


def gain_groups(ratios: pd.Series, problems: pd.DataFrame) -> tuple[GroupGain, ...]:
    """Per GROUP_FIELDS value: problems, geomean ratio and its share of the summed log
    gain over ``ratios`` (served problems only, indexed by key)."""
    served = ratios.dropna()
    if served.empty:
        return ()
    rows = problems.set_index("key").loc[served.index]
    logs = np.log(served.to_numpy(dtype="float64"))
    total = logs.sum()
    out = []
    for column, name in GROUP_FIELDS:
        values = ([_band(b) for b in rows["batch"]] if column == "band"
                  else rows[column].tolist())
        frame = pd.DataFrame({"value": values, "log": logs})
        for value, part in frame.groupby("value", sort=True):
            out.append(GroupGain(column, name(value), len(part), float(np.exp(part["log"].mean())),
                                 float(part["log"].sum() / total) if total > 0 else math.nan))
    return tuple(out)


def compare(policy: str, routes: str, policy_times: pd.Series, pick_times: pd.Series,
            pick_routes: pd.Series, policy_routes: pd.Series | str, problems: pd.DataFrame,
            pick: str = "table", note: str = "") -> PolicyStats:
    """policy time / pick time over the problems where both have a time (keys of
    ``pick_times``); ``policy_routes``: the policy's route per key, or one route."""
    ratios = (policy_times.reindex(pick_times.index) / pick_times).dropna()
    total = int(pick_times.notna().sum())
    if ratios.empty:
        return PolicyStats(policy, routes, pick, 0, total, math.nan, math.nan, "", (), (),
                           note=note)
    if isinstance(policy_routes, str):
        policy_routes = pd.Series(policy_routes, index=ratios.index)
    slower = ratios[ratios < 1.0 / (1.0 + LOSS_TOLERANCE)].sort_values()
    losses = tuple((str(k), float(r), str(pick_routes[k]), str(policy_routes[k]))
                   for k, r in slower.items())
    top = ratios.sort_values(ascending=False, kind="stable").head(TOP_GAINS)
    gains = tuple((str(k), float(r), str(pick_routes[k])) for k, r in top.items() if r > 1.0)
    return PolicyStats(policy, routes, pick, len(ratios), total, geomean(ratios),
                       float(ratios.min()), str(ratios.idxmin()), losses, gains,
                       gain_groups(ratios, problems), note)


def _fixed(policy: str, route: str, times: pd.DataFrame, pick_times: pd.Series,
           pick_routes: pd.Series, problems: pd.DataFrame, pick: str) -> PolicyStats:
    if route in times.columns:
        return compare(policy, route, times[route], pick_times, pick_routes, route, problems,
                       pick)
    return compare(policy, route, pd.Series(dtype="float64"), pick_times, pick_routes, route,
                   problems, pick, note=f"not measured: no ok {route} row in the table")


def _vllm(times: pd.DataFrame, pick_times: pd.Series, pick_routes: pd.Series,
          problems: pd.DataFrame, pick: str, arch: str) -> PolicyStats:
    names = ", ".join(b.name for b in VLLM_HOPPER)
    if arch != VLLM_ARCH:
        return compare(VLLM_POLICY, names, pd.Series(dtype="float64"), pick_times, pick_routes,
                       "", problems, pick, note=f"not applicable: the vLLM Hopper order is for "
                       f"{VLLM_ARCH}, the table is for {arch}")
    chosen, first = vllm_routes(problems, times)
    chosen = chosen.dropna()
    policy_times = pd.Series([times.at[k, r] for k, r in chosen.items()], index=chosen.index,
                             dtype="float64")
    stats = compare(VLLM_POLICY, names, policy_times, pick_times, pick_routes, chosen,
                    problems, pick)
    served = [k for k in chosen.index if k in pick_times.index and pd.notna(pick_times[k])]
    stand_in = {b: int(sum(first[k] == b and chosen[k] != _route_of(b) for k in served))
                for b in {str(first[k]) for k in served}}
    parts = [f"where it serves, it runs {', '.join(sorted(set(chosen[served]))) or '-'}"]
    parts += [f"on {n} of them real vLLM would run {b} first, which cannot run here"
              for b, n in sorted(stand_in.items()) if n]
    if not stats.measured:
        parts = ["not measured: no problem where a backend of the vLLM order that runs here "
                 "has an ok row"]
    return replace(stats, note="; ".join(parts))


def _route_of(backend_name: str) -> str | None:
    return next(b.route for b in VLLM_HOPPER if b.name == backend_name)


def vendor_policies(problems: pd.DataFrame, times: pd.DataFrame, pick_times: pd.Series,
                    pick_routes: pd.Series, arch: str, pick: str = "table"
                    ) -> list[PolicyStats]:
    """Always FlashMLA, always FlashInfer fa3, vLLM's Hopper order: each against the pick
    (``pick_times``/``pick_routes`` per problem key; NaN time: no pick there)."""
    return [_fixed(ALWAYS_FLASHMLA, FLASHMLA, times, pick_times, pick_routes, problems, pick),
            _fixed(ALWAYS_FA3, FLASHINFER_FA3, times, pick_times, pick_routes, problems, pick),
            _vllm(times, pick_times, pick_routes, problems, pick, arch)]


# Text ---------------------------------------------------------------------------------

def _x(value: float) -> str:
    return "-" if math.isnan(value) else f"{value:.2f}x"


def carrying_groups(stats: PolicyStats, limit: int = 3) -> list[GroupGain]:
    """The groups that carry most of the gain: per field with two values or more, the
    value with the largest share where no other value of the field has as much; the
    largest ``limit`` of those."""
    by_field: dict[str, list[GroupGain]] = {}
    for group in stats.groups:
        by_field.setdefault(group.field, []).append(group)
    best = []
    for groups in by_field.values():
        if len(groups) < 2 or any(math.isnan(g.share) for g in groups):
            continue
        first, second = sorted(groups, key=lambda g: -g.share)[:2]
        if first.share > second.share:
            best.append(first)
    return sorted(best, key=lambda g: -g.share)[:limit]


def comparison_text(stats: PolicyStats) -> str:
    """One line: geomean and worst over the problems served, and the losses."""
    if not stats.measured:
        return stats.note or "not measured"
    losses = len(stats.losses)
    text = (f"geomean {_x(stats.geomean)}, worst {_x(stats.worst)} "
            f"({problem_label(stats.worst_key)}), over the {stats.served} of {stats.total} "
            f"problems it serves; pick more than {LOSS_TOLERANCE:.0%} slower on {losses}")
    return text + (" (a defect: see the list)" if losses else "")


def goal_text(flashmla: PolicyStats) -> str:
    """Where the pick stands against the project's goal over always-FlashMLA."""
    if not flashmla.measured:
        return f"unknown: always FlashMLA is not measured ({flashmla.note})"
    if flashmla.geomean >= GOAL_OVER_FLASHMLA:
        standing = f"met: {_x(flashmla.geomean)}"
    else:
        needed = GOAL_OVER_FLASHMLA / flashmla.geomean - 1.0
        standing = f"not met: {_x(flashmla.geomean)}, {needed * 100:.1f}% short"
    carriers = carrying_groups(flashmla)
    if carriers:
        standing += "; the gain is carried by " + ", ".join(
            f"{g.value} ({_x(g.geomean)} over {g.served}, {g.share * 100:.0f}% of it)"
            for g in carriers)
    return standing


def defect_text(stats: Sequence[PolicyStats]) -> str:
    """Whether the pick is ever more than LOSS_TOLERANCE slower than a vendor policy."""
    fixed = [s for s in stats if s.policy in (ALWAYS_FLASHMLA, ALWAYS_FA3)]
    measured = [s for s in fixed if s.measured]
    if not measured:
        return "not checked: neither vendor route is measured"
    losses = sum(len(s.losses) for s in measured)
    over = ", ".join(f"{s.policy} {len(s.losses)} of {s.served}" for s in measured)
    if losses:
        return f"NO: {losses} problem(s) where the pick is slower ({over})"
    return f"yes ({over})"


def headline_rows(stats: Sequence[PolicyStats], heldout: Sequence[PolicyStats] = ()
                  ) -> list[tuple[str, str]]:
    """The summary lines: each policy, the goal, the defect check; held-out too."""
    rows = []
    for group, who in ((stats, "pick"), (heldout, "dispatcher, held-out")):
        if not group:
            continue
        by = {s.policy: s for s in group}
        for s in group:
            routes = s.routes if s.policy != VLLM_POLICY else "first that runs here"
            line = comparison_text(s)
            if s.policy == VLLM_POLICY and s.measured and s.note:
                line += f"; {s.note}"
            rows.append((f"{who} vs {s.policy} ({routes})", line))
        rows.append((f"{who} never more than {LOSS_TOLERANCE:.0%} slower than a vendor "
                     f"policy", defect_text(group)))
        rows.append((f"goal ({who}): {GOAL_OVER_FLASHMLA:.2f}x geomean over always "
                     f"FlashMLA", goal_text(by[ALWAYS_FLASHMLA])))
    rows.append(("vLLM backends not run here",
                 "; ".join(f"{b.name}: {b.short}" for b in VLLM_HOPPER if not b.runs_here)
                 + " (the page says more)"))
    return rows


POLICY_TABLE_COLUMNS = ("policy", "runs", "pick", "served", "geomean speedup",
                        "worst speedup", "worst on problem", "pick >2% slower")


def table_rows(stats: Sequence[PolicyStats]) -> list[tuple[str, ...]]:
    """One line per policy, for the page."""
    return [(s.policy, s.routes, s.pick, f"{s.served}/{s.total}", _x(s.geomean), _x(s.worst),
             problem_label(s.worst_key) if s.measured else (s.note or "not measured"),
             str(len(s.losses)) if s.measured else "-")
            for s in stats]


def as_json(stats: PolicyStats) -> dict[str, Any]:
    """A policy's numbers for summary.json (NaN as null)."""
    def num(value: float) -> float | None:
        return None if math.isnan(value) else value

    return {
        "policy": stats.policy, "routes": stats.routes, "pick": stats.pick,
        "served": stats.served, "total": stats.total, "geomean": num(stats.geomean),
        "worst": num(stats.worst), "worst_problem": stats.worst_key or None,
        "loss_tolerance": LOSS_TOLERANCE,
        "losses": [{"problem": k, "ratio": r, "pick_route": p, "policy_route": q}
                   for k, r, p, q in stats.losses],
        "largest_gains": [{"problem": k, "ratio": r, "pick_route": p}
                          for k, r, p in stats.gains],
        "groups": [{"field": g.field, "value": g.value, "served": g.served,
                    "geomean": num(g.geomean), "share_of_gain": num(g.share)}
                   for g in stats.groups],
        "note": stats.note,
    }


def vllm_order_json() -> list[dict[str, Any]]:
    return [{"backend": b.name, "route": b.route, "runs_here": b.runs_here,
             "why_not": b.not_here} for b in VLLM_HOPPER]
