"""mlatune's Hopper Gluon MLA decodes as routes: ``wgmma/gluon`` (the first kernel,
``mlatune/kernels/gluon_hopper.py``: two warpgroups split each tile's S by key columns),
``seesaw/gluon`` (the warp-specialized kernel, ``mlatune/kernels/gluon_seesaw.py``: a
loader partition and two compute warpgroups alternating whole tiles), ``transposed/gluon``
(``mlatune/kernels/gluon_transposed.py``: keys as the MMA's M and 16 or 32 query rows as
its N, for few heads; it also reads fp8 caches) and ``transposed-mma8/gluon`` (the same over
an fp8 cache with fp8 MMAs: one numeric class per route). The kernels take the same tensors (the
transposed one also an fp8 cache's scale) and share the host helpers and the split rule
(each over its own programs per request); a stored route id keeps its kernel, so a faster
one comes in under a new id. A kernel's forms are named in a param set's ``form`` (the
route's ``forms``); a stored set in an older spelling is read through ``upgrade_params``,
one of a form that became a route of its own through ``route_of``.

Which problems they serve is the capability model's (``capability.rules``, the
``wgmma.*`` rules: sm_90, decode, 576/512 dims, the pages ``plan.page_refusal`` allows,
bf16 or fp16 q and cache, no causal verify over a DCP shard; ``seesaw.dtypes`` and
``transposed.dtypes`` let the seesaw and transposed kernels take an fp8 e4m3 cache too,
``plan.dtype_refusal``); ``supports`` adds what only the
machine can say: the installed triton must be the 3.6 release whose Gluon API
the kernel is written for (refused like a missing library, naming the version).

The step is the kernel's launch (plus the split reduce when it splits the keys):
it reads the lengths and the block table when it runs, so it is captured in a
CUDA graph and replayed with new lengths written in place (``LAUNCH_ONLY``). The
split count is fixed in ``prepare`` from the problem's sizes (the busiest rank's
length bound, no host read of the lengths): the kernel's own pick first, then
half and twice it. A DCP rank runs over its shard's local lengths; the kernel's
causal mask uses them, which is right for single-token decode and non-causal
blocks (the only DCP problems the rules let through), and the LSE it writes lets
the ranks merge.
"""

from __future__ import annotations

import importlib
import importlib.util
from collections.abc import Callable, Mapping
from functools import cache
from importlib import metadata
from types import MappingProxyType
from typing import Any

import torch

from mlatune import capability
from mlatune.arch import DeviceInfo, device_of
from mlatune.check.accuracy import Rounding
from mlatune.check.inputs import DecodeInputs, PrefillInputs
from mlatune.kernels import gluon_hopper_plan as plan
from mlatune.problem import FP8_DTYPES, MLAProblem
from mlatune.routes.base import (
    DEVICE_PLANNED,
    LAUNCH_ONLY,
    SPLIT_LIMIT,
    Params,
    Prepared,
    Route,
    SharedPlan,
    StepKind,
    Verdict,
    no,
    plan_key,
    shared_buffers,
    with_defaults,
)
from mlatune.routes.geometry import ListedSplits, SplitKV


def _kernel(name: str):
    """A module of ``mlatune.kernels`` (imported when a route first prepares: triton's)."""
    return importlib.import_module(f"mlatune.kernels.{name}")


@cache
def triton_version() -> str | None:
    """The installed triton's version (from its metadata: no import), None without one."""
    if importlib.util.find_spec("triton") is None:
        return None
    try:
        return metadata.version("triton")
    except metadata.PackageNotFoundError:  # a build under another name: ask the module
        import triton

        return str(getattr(triton, "__version__", "unknown"))


def _sms(device: DeviceInfo) -> int:
    """The device's SM count (the H200's where the device is not a GPU that reports one)."""
    return device.cu_count if device.is_gpu and device.cu_count else plan.H200_SMS


class WgmmaGluonRoute(Route):
    """The Hopper Gluon decode: heads x qlen folded into 64-row wgmma tiles, split-KV."""

    id = "wgmma/gluon"
    kernel = "gluon_hopper"  # the module under mlatune.kernels whose decode_launcher runs
    # Kernel options a param set may carry (decode_launcher keywords), each with the value a
    # param set without it means.
    kernel_options: Mapping[str, object] = MappingProxyType({})
    forms: tuple[str, ...] = ()  # the kernel's forms a param set names in "form": one, unnamed
    sized_params = ("num_splits",)  # derived from batch and KV length (base.params_at)
    param_limits = MappingProxyType({"num_splits": SPLIT_LIMIT})
    writes_into = True  # prepare takes the caller's out= and lse= buffers
    program_cost = 0.0  # the split pick's fixed cost a program, in tiles (``plan.split_cost``)

    @property
    def reads_fp8(self) -> bool:
        """Whether decode_launcher takes an fp8 cache (and its kv_scale):
        ``plan.FP8_CACHE_KERNELS``."""
        return self.kernel in plan.FP8_CACHE_KERNELS

    def supports(self, problem: MLAProblem, device: DeviceInfo) -> Verdict:
        ruling = capability.check(self.id, problem, device.arch)
        if not ruling:
            return no(f"rule {ruling.rule}: {ruling.reason}")
        version = triton_version()
        refusal = plan.triton_refusal(version)
        if refusal:
            return no(refusal)
        return Verdict(True, f"Gluon decode on triton {version}")

    def param_space(self, problem: MLAProblem, device: DeviceInfo) -> list[Params]:
        """The kernel's split pick for the busiest rank's length bound, then half and twice it
        (where the keys allow)."""
        return self.split_sets(problem, device)

    def split_sets(self, problem: MLAProblem, device: DeviceInfo) -> list[Params]:
        """``{"num_splits": s}`` for ``pick_splits``'s pick (with the kernel's
        ``program_cost``, ``tile_step`` and ``by_reduce``), half and twice it, where the keys
        allow."""
        sms = _sms(device)
        length = problem.shard_len
        pick = plan.pick_splits(problem.batch, self.row_blocks(problem), length, sms,
                                self.program_cost, self.tile_step(problem), self.by_reduce)
        top = min(plan.MAX_SPLITS, max(1, -(-length // plan.BLOCK_N)))
        splits = dict.fromkeys(s for s in (pick, pick // 2, pick * 2) if 1 <= s <= top)
        return [{"num_splits": s} for s in splits]

    def block_rows(self, problem: MLAProblem) -> int:
        """Query rows (heads x qlen folded) per program."""
        return plan.BLOCK_M

    def tile_step(self, problem: MLAProblem) -> int:
        """The key tiles a program's walk takes at once (``plan.split_cost``): one."""
        return 1

    @property
    def by_reduce(self) -> bool:
        """Whether the reduce kernel merges the kernel's split partials
        (``plan.REDUCE_MERGED_KERNELS``; the split pick charges it a program)."""
        return self.kernel in plan.REDUCE_MERGED_KERNELS

    def row_blocks(self, problem: MLAProblem) -> int:
        """Programs per request and split."""
        return -(-problem.kernel_heads * problem.qlen // self.block_rows(problem))

    def step_kind(self, params: Params) -> StepKind:
        return LAUNCH_ONLY

    def upgrade_params(self, params: Params) -> Params | None:
        """A stored param set in the current spelling: as stored (one kernel form)."""
        return dict(params)

    def launch_geometry(self, problem: MLAProblem, recipe: Mapping[str, Any], cus: int
                        ) -> ListedSplits | None:
        """batch x row blocks x splits programs; the law chooses among the listed splits."""
        if len(self.sized_params) != 1 or problem.phase != "decode":
            return None
        sized = self.sized_params[0]
        tile = {"block_m": self.block_rows(problem), "block_n": plan.BLOCK_N}
        return ListedSplits(self, lambda p, d: [s[sized] for s in self.param_space(p, d)
                                                if sized in s], tile,
                            sized, float(self.row_blocks(problem)))

    def launcher(self, problem: MLAProblem, chosen: Params) -> tuple[Callable, dict]:
        """The ``decode_launcher`` that runs a param set, with the options it passes: the
        route's kernel's, with all of ``kernel_options``."""
        return (_kernel(self.kernel).decode_launcher,
                {name: chosen[name] for name in self.kernel_options})

    def prepare(self, problem: MLAProblem, inputs: DecodeInputs | PrefillInputs, *,
                rank: int = 0, params: Params | None = None, want_lse: bool = True,
                out: torch.Tensor | None = None, lse: torch.Tensor | None = None) -> Prepared:
        chosen = self.chosen(problem, inputs, params)
        return self.launch_step(problem, inputs, rank, chosen, out, lse, want_lse)

    def chosen(self, problem: MLAProblem, inputs: DecodeInputs | PrefillInputs,
               params: Params | None) -> Params:
        """``params`` as the route runs them, once ``inputs`` are ones it serves (else
        TypeError or ValueError)."""
        if not isinstance(inputs, DecodeInputs):
            raise TypeError(f"{self.id} serves decode inputs, got {type(inputs).__name__}")
        if problem.dcp_size > 1 and problem.causal and problem.qlen > 1:
            raise ValueError(f"{self.id}: causal verify over a DCP shard is not served (the "
                             f"kernel masks on the shard's local positions)")
        return with_defaults(self, params, self.param_space(problem, device_of(inputs.q)))

    def launch_step(self, problem: MLAProblem, inputs: DecodeInputs, rank: int,
                    chosen: Params, out: torch.Tensor | None, lse: torch.Tensor | None,
                    want_lse: bool, **launch_options: Any) -> Prepared:
        """The step of ``chosen`` (``launcher``'s, with ``launch_options`` too)."""
        shard = inputs.shards[rank]
        decode_launcher, extra = self.launcher(problem, chosen)
        extra.update(launch_options)
        if self.reads_fp8:
            extra["kv_scale"] = inputs.kv_scale
        launch, out, lse = decode_launcher(
            inputs.q, shard.kv_cache, shard.block_table, shard.seq_lens, qlen=problem.qlen,
            sm_scale=inputs.softmax_scale, causal=problem.causal, out=out, lse=lse,
            num_splits=chosen["num_splits"], max_seq_len=problem.shard_len, **extra)
        return Prepared(launch, out, lse if want_lse else None, graph_safe=True, params=chosen)


class SeesawGluonRoute(WgmmaGluonRoute):
    """The warp-specialized Hopper Gluon decode: each warpgroup computes S of a whole tile,
    the two alternating (Q read once a tile); the same rules, tensors and split pick (its
    tiles taken in pairs over a 16-bit cache: ``tile_step``), and fp8 caches too (the
    ``seesaw.dtypes`` rule: each tile widened to fp16 by the loader, a bf16 q to fp16 row by
    row, exactly; fp16 MMAs). Its forms (``plan.SEESAW_FORMS``): "pairs";
    "two-requests" (a program walks two requests), offered past one wave of programs where
    the form reads the cache (``plan.seesaw_form_refusal``); "balanced" (the request's key
    tiles spread evenly over a program an SM by a device plan, planned once a step and
    shareable by the step's layers: ``DEVICE_PLANNED``), offered from 64 query rows where
    the split pick's waves are ragged (``plan.wave_idle``)."""

    id = "seesaw/gluon"
    kernel = "gluon_seesaw"
    forms = plan.SEESAW_FORMS
    kernel_options = MappingProxyType({"form": forms[0]})  # a set without a form: pairs
    shares_plan = True  # prepare takes plan_from= (another layer's plan: balanced sets)
    # The options a stored set named its form with before form ids (absent: off).
    LEGACY_OPTIONS = ("chunked", "pdl", "slim", "lone_bars", "afresh_q", "two_requests",
                      "rope_regs")
    PLANNED = "balanced"  # the form that reads a device plan (no split count)

    def param_space(self, problem: MLAProblem, device: DeviceInfo) -> list[Params]:
        """The split sets in the pairs form; the first in the two-requests form where its
        programs are more than one wave (a program per SM): then half as many walk two
        requests each; where one wave holds them all, it only lengthens each. The balanced
        form (no split) where a request has 64 query rows or more and the first set's waves
        leave SM slots idle (``plan.BALANCED_MIN_IDLE``), third: at 64-128 heads it came
        within 10% of the best set where the sets after the first two trailed by 10-50%
        (docs/kernels/gluon_seesaw.md), so a sweep keeping three sets times it."""
        sets = [{**params, "form": "pairs"} for params in super().param_space(problem, device)]
        sms = _sms(device)
        programs = self.row_blocks(problem) * sets[0]["num_splits"] * problem.batch
        fp8 = problem.kv_dtype in FP8_DTYPES
        refused = plan.seesaw_form_refusal("two-requests", fp8, problem.page_size)
        if programs > sms and refused is None:
            sets.append({**sets[0], "form": "two-requests"})
        if problem.kernel_heads * problem.qlen >= plan.BALANCED_MIN_ROWS \
                and plan.wave_idle(programs, sms) > plan.BALANCED_MIN_IDLE \
                and plan.seesaw_form_refusal(self.PLANNED, fp8, problem.page_size) is None:
            sets.insert(2, {"form": self.PLANNED})
        return sets

    def tile_step(self, problem: MLAProblem) -> int:
        """Tiles in pairs over a 16-bit cache (``plan.seesaw_tile_step``)."""
        return plan.seesaw_tile_step(problem.kv_dtype in FP8_DTYPES)

    def step_kind(self, params: Params) -> StepKind:
        return DEVICE_PLANNED if params.get("form") == self.PLANNED else LAUNCH_ONLY

    def launch_geometry(self, problem: MLAProblem, recipe: Mapping[str, Any], cus: int
                        ) -> SplitKV | ListedSplits | None:
        """The split sets' listed splits; the balanced form: the same work spread evenly."""
        if recipe.get("form") != self.PLANNED or problem.phase != "decode":
            return super().launch_geometry(problem, recipe, cus)
        tile = {"block_m": self.block_rows(problem), "block_n": plan.BLOCK_N}
        return SplitKV(self, lambda p, d: 1, tile, self.sized_params[0], True,
                       float(self.row_blocks(problem)))

    def prepare(self, problem: MLAProblem, inputs: DecodeInputs | PrefillInputs, *,
                rank: int = 0, params: Params | None = None, want_lse: bool = True,
                out: torch.Tensor | None = None, lse: torch.Tensor | None = None,
                plan_from: Prepared | None = None) -> Prepared:
        """As the other Gluon routes; a balanced set also plans (from the shard's lengths, on
        the device: ``Prepared.plan``, run here once) or reads ``plan_from``'s plan."""
        chosen = self.chosen(problem, inputs, params)
        if chosen["form"] != self.PLANNED:
            return self.launch_step(problem, inputs, rank, chosen, out, lse, want_lse)
        shard = inputs.shards[rank]
        key = plan_key(self.id, problem, chosen, rank, shard.seq_lens, shard.block_table)
        shared = shared_buffers(plan_from, key)
        if shared is None:
            planner, buffers = _kernel(self.kernel).balanced_plan(
                shard.seq_lens, heads=problem.kernel_heads, qlen=problem.qlen,
                sms=_sms(device_of(inputs.q)))
            planner()  # planned for the lengths at hand: ``run`` is valid at once
        else:
            planner, buffers = shared.plan, shared.buffers
        prepared = self.launch_step(problem, inputs, rank, chosen, out, lse, want_lse,
                                    plan=buffers)
        prepared.plan_reads_lengths = True
        prepared.plan = planner
        prepared.plan_state = SharedPlan(key, buffers, planner)
        return prepared

    def upgrade_params(self, params: Params) -> Params | None:
        """A stored param set with a form id as stored (None: a form not in ``forms``); in
        the boolean spelling (``LEGACY_OPTIONS``), chunked, pdl, slim, lone_bars, afresh_q and
        rope_regs all on is "pairs" (with two_requests: "two-requests"), any other combination
        a deleted form: None. ``{}`` (the route's first set) stays ``{}``."""
        def form(on: Mapping[str, bool]) -> str | None:
            if not all(on[k] for k in self.LEGACY_OPTIONS if k != "two_requests"):
                return None
            return "two-requests" if on["two_requests"] else "pairs"

        return _upgraded(params, self.forms, self.LEGACY_OPTIONS, form)


def _upgraded(params: Params, forms: tuple[str, ...], legacy: tuple[str, ...],
              form: Callable[[Mapping[str, bool]], str | None]) -> Params | None:
    """``params`` with a form id: as given where ``forms`` holds it, else None. In the boolean
    spelling: its options (``legacy``; absent: off) replaced by ``form(options)``'s id, None
    where that names none of ``forms``. An empty set (the route's first) stays empty."""
    if "form" in params:
        return dict(params) if params["form"] in forms else None
    if not params:
        return {}
    named = form({k: bool(params.get(k, False)) for k in legacy})
    if named not in forms:
        return None
    return {**{k: v for k, v in params.items() if k not in legacy}, "form": named}


class TransposedGluonRoute(WgmmaGluonRoute):
    """The transposed Hopper Gluon decode: S^T = K Q^T with the tile's 64 keys as the MMA's
    M and 16 or 32 query rows as its N (no padding of few rows to 64), bf16 or fp16 q over a
    cache of q's dtype or fp8 (e4m3, its scale read on the device). Its one form, "mma16":
    MMAs in q's dtype (``gluon_transposed``; over an fp8 cache ``gluon_transposed_ws``, which
    widens it in a partition of its own), exact past the problem's dtypes. Its fp8-MMA form
    ("mma8", another numeric class) is a route of its own: ``transposed-mma8/gluon``."""

    id = "transposed/gluon"
    kernel = "gluon_transposed"
    forms: tuple[str, ...] = ("mma16",)
    kernel_options = MappingProxyType({"form": "mma16"})  # a set without a form: mma16
    moved_forms = MappingProxyType({"mma8": "transposed-mma8/gluon"})
    # The options a stored set named its form with before form ids (absent: off).
    LEGACY_OPTIONS = ("ws", "pdl", "fp8_mma", "defer_sums", "stacked", "wide_vt", "warp_max",
                      "slim")
    MMA8_OPTIONS = ("defer_sums", "stacked", "wide_vt", "warp_max", "slim")  # all on in mma8

    def param_space(self, problem: MLAProblem, device: DeviceInfo) -> list[Params]:
        """The split counts, each in the route's form."""
        return [{**params, "form": self.forms[0]}
                for params in self.split_sets(problem, device)]

    def upgrade_params(self, params: Params) -> Params | None:
        """A stored param set with one of the route's form ids as stored (None: another
        form); in the boolean spelling, the form ``_legacy_form`` names."""
        return _upgraded(params, self.forms, self.LEGACY_OPTIONS, self._legacy_form)

    def route_of(self, params: Params) -> str:
        """Where a stored set belongs, its legacy spelling read first: an mma8 set (either
        spelling) is ``transposed-mma8/gluon``'s."""
        spelled = _upgraded(params, plan.TRANSPOSED_FORMS, self.LEGACY_OPTIONS,
                            self._legacy_form)
        return super().route_of(params if spelled is None else spelled)

    def _legacy_form(self, on: Mapping[str, bool]) -> str | None:
        """The form a set in the boolean spelling (``LEGACY_OPTIONS``) ran: pdl with fp8_mma
        and all of ``MMA8_OPTIONS`` "mma8", pdl without fp8_mma "mma16" (ws or not: over a
        16-bit cache the same kernel, over fp8 the widening the sets ran since pdl), any other
        combination a deleted form (None)."""
        if not on["pdl"]:
            return None
        if not on["fp8_mma"]:
            return "mma16"
        return "mma8" if all(on[k] for k in self.MMA8_OPTIONS) else None

    def launcher(self, problem: MLAProblem, chosen: Params) -> tuple[Callable, dict]:
        """The kernel a param set's form names: mma8, the fp8-MMA kernel (an fp8 cache only);
        mma16, the transposed kernel, or over an fp8 cache the warp-specialized widening."""
        form = chosen["form"]
        if form not in self.forms:
            raise ValueError(f"{self.id}: form {form!r} is not one of {self.forms}")
        if form == "mma8":
            name = "gluon_transposed_fp8"
        elif problem.kv_dtype in FP8_DTYPES:
            name = "gluon_transposed_ws"
        else:
            name = self.kernel
        return _kernel(name).decode_launcher, {}

    def block_rows(self, problem: MLAProblem) -> int:
        return plan.transposed_rows(problem.kernel_heads * problem.qlen)


class TransposedMma8GluonRoute(TransposedGluonRoute):
    """The transposed Hopper Gluon decode with fp8 MMAs (form "mma8",
    ``gluon_transposed_fp8``): over an fp8 e4m3 cache at up to 16 query rows a program
    (the ``transposed.fp8_mma`` rule), q as two e4m3 terms and P rounded to e4m3. The same
    launch, splits and step as ``transposed/gluon``; its numeric class is P_FP8."""

    id = "transposed-mma8/gluon"
    forms = ("mma8",)
    kernel_options = MappingProxyType({"form": "mma8"})
    moved_forms = MappingProxyType({})
    program_cost = plan.FP8_MMA_PROGRAM_COST  # the split pick's fixed cost a program

    def rounding(self, problem: MLAProblem, params: Params) -> Rounding:
        """P rounded to fp8, q kept near 16 bits by its two e4m3 terms: every set."""
        return Rounding.P_FP8
