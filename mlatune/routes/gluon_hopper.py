"""mlatune's Hopper Gluon MLA decodes as routes: ``wgmma/gluon`` (the first kernel,
``mlatune/kernels/gluon_hopper.py``: two warpgroups split each tile's S by key columns),
``seesaw/gluon`` (the warp-specialized kernel, ``mlatune/kernels/gluon_seesaw.py``: a
loader partition and two compute warpgroups alternating whole tiles; 0.78-0.94x the
first kernel's time at every point timed on the H200, 2026-12-01) and ``transposed/gluon``
(``mlatune/kernels/gluon_transposed.py``: keys as the MMA's M and 16 or 32 query rows as
its N, for few heads; it also reads fp8 caches). The kernels take the same tensors (the
transposed one also an fp8 cache's scale) and share the host helpers and the split rule
(each over its own programs per request); a stored route id keeps its kernel, so a faster
one comes in under a new id.

Which problems they serve is the capability model's (``capability.rules``, the
``wgmma.*`` rules: sm_90, decode, 576/512 dims, page 64, bf16 or fp16 q and
cache, no causal verify over a DCP shard; ``transposed.dtypes`` lets the transposed
kernel take an fp8 e4m3 cache too); ``supports`` adds what only the
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
import itertools
from collections.abc import Callable, Mapping
from functools import cache
from importlib import metadata
from types import MappingProxyType
from typing import Any

import torch

from mlatune import capability
from mlatune.arch import DeviceInfo, device_of
from mlatune.check.inputs import DecodeInputs, PrefillInputs
from mlatune.kernels import gluon_hopper_plan as plan
from mlatune.problem import FP8_DTYPES, MLAProblem
from mlatune.routes.base import (
    LAUNCH_ONLY,
    Params,
    Prepared,
    Route,
    StepKind,
    Verdict,
    no,
    with_defaults,
)
from mlatune.routes.geometry import ListedSplits


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
    reads_fp8 = False  # whether decode_launcher takes an fp8 cache (and its kv_scale)
    # Kernel options a param set may carry (decode_launcher keywords), each with the value a
    # param set without it means: what rows stored before the option existed ran.
    kernel_options: Mapping[str, object] = MappingProxyType({})
    sized_params = ("num_splits",)  # derived from batch and KV length (base.params_at)
    writes_into = True  # prepare takes the caller's out= and lse= buffers

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

    def split_sets(self, problem: MLAProblem, device: DeviceInfo,
                   per_program: float = 0.0) -> list[Params]:
        """``{"num_splits": s}`` for ``pick_splits``'s pick (with the kernel's
        ``per_program``), half and twice it, where the keys allow."""
        sms = _sms(device)
        length = problem.shard_len
        pick = plan.pick_splits(problem.batch, self.row_blocks(problem), length, sms,
                                per_program)
        top = min(plan.MAX_SPLITS, max(1, -(-length // plan.BLOCK_N)))
        splits = dict.fromkeys(s for s in (pick, pick // 2, pick * 2) if 1 <= s <= top)
        return [{"num_splits": s} for s in splits]

    def block_rows(self, problem: MLAProblem) -> int:
        """Query rows (heads x qlen folded) per program."""
        return plan.BLOCK_M

    def row_blocks(self, problem: MLAProblem) -> int:
        """Programs per request and split."""
        return -(-problem.kernel_heads * problem.qlen // self.block_rows(problem))

    def step_kind(self, params: Params) -> StepKind:
        return LAUNCH_ONLY

    def launch_geometry(self, problem: MLAProblem, recipe: Mapping[str, Any], cus: int
                        ) -> ListedSplits | None:
        """batch x row blocks x splits programs; the law chooses among the listed splits."""
        if len(self.sized_params) != 1 or problem.phase != "decode":
            return None
        sized = self.sized_params[0]
        tile = {"block_m": self.block_rows(problem), "block_n": plan.BLOCK_N}
        return ListedSplits(self, lambda p, d: [s[sized] for s in self.param_space(p, d)], tile,
                            sized, float(self.row_blocks(problem)))

    def launcher(self, problem: MLAProblem, chosen: Params) -> tuple[Callable, dict]:
        """The ``decode_launcher`` that runs a param set, with the options it passes: the
        route's kernel's, with all of ``kernel_options``."""
        return (_kernel(self.kernel).decode_launcher,
                {name: chosen[name] for name in self.kernel_options})

    def prepare(self, problem: MLAProblem, inputs: DecodeInputs | PrefillInputs, *,
                rank: int = 0, params: Params | None = None, want_lse: bool = True,
                out: torch.Tensor | None = None, lse: torch.Tensor | None = None) -> Prepared:
        if not isinstance(inputs, DecodeInputs):
            raise TypeError(f"{self.id} serves decode inputs, got {type(inputs).__name__}")
        if problem.dcp_size > 1 and problem.causal and problem.qlen > 1:
            raise ValueError(f"{self.id}: causal verify over a DCP shard is not served (the "
                             f"kernel masks on the shard's local positions)")
        chosen = with_defaults(self, params, self.param_space(problem, device_of(inputs.q)))
        shard = inputs.shards[rank]
        decode_launcher, extra = self.launcher(problem, chosen)
        if self.reads_fp8:
            extra["kv_scale"] = inputs.kv_scale
        launch, out, lse = decode_launcher(
            inputs.q, shard.kv_cache, shard.block_table, shard.seq_lens, qlen=problem.qlen,
            sm_scale=inputs.softmax_scale, causal=problem.causal, out=out, lse=lse,
            num_splits=chosen["num_splits"], max_seq_len=problem.shard_len, **extra)
        return Prepared(launch, out, lse if want_lse else None, graph_safe=True, params=chosen)


class SeesawGluonRoute(WgmmaGluonRoute):
    """The warp-specialized Hopper Gluon decode: each warpgroup computes S of a whole tile,
    the two alternating (Q read once a tile); same rules, tensors and splits. Its param sets
    run the kernel's chunked form (tiles copied in 64-column chunks that S starts on; 0-3.5%
    faster at every point timed on the H200, 2026-12-01) with the split reduce as a
    programmatic dependent launch (``pdl``: 0-3% faster, session 13), the softmax in
    fewer instructions (``slim``, session 14) and each mbarrier its own allocation
    (``lone_bars``: 0.96-1.01x the slim form's time, sessions 15 and 16) and Q addressed
    afresh each pair (``afresh_q``: 0.97-1.00x the lone form's time at issue 19's seesaw
    points, H200, 2026-12-02, session 17) and Q's rope part in registers (``rope_regs``:
    0.98-1.00x at 128 heads, session 22); past one wave of programs the first set also
    walking two requests a program (``two_requests``, ``param_space``). A stored param set
    without an option ran the form without it and still does."""

    id = "seesaw/gluon"
    kernel = "gluon_seesaw"
    kernel_options = MappingProxyType({"chunked": False, "pdl": False, "slim": False,
                                       "lone_bars": False, "afresh_q": False,
                                       "two_requests": False, "rope_regs": False})
    FORM = MappingProxyType({"chunked": True, "pdl": True, "slim": True, "lone_bars": True,
                             "afresh_q": True, "two_requests": False, "rope_regs": True})

    def param_space(self, problem: MLAProblem, device: DeviceInfo) -> list[Params]:
        """The split sets in FORM, and the first with ``two_requests`` where its programs
        are more than one wave (a program per SM): then half as many walk two requests each
        (0.988x at (128, 128, 4096, 1); where one wave holds them all, it only lengthens
        each: 1.45-1.89x; H200, 2026-12-02, session 22 call 3)."""
        sets = [{**params, **self.FORM} for params in super().param_space(problem, device)]
        sms = _sms(device)
        programs = self.row_blocks(problem) * sets[0]["num_splits"] * problem.batch
        if programs > sms:
            sets.append({**sets[0], "two_requests": True})
        return sets


FP8_MMA_MAX_ROWS = 16  # query rows a program up to which transposed/gluon offers fp8 MMAs
# transposed/gluon's kernels (modules of mlatune.kernels), each with the kernel options its
# decode_launcher takes (``ws`` and ``fp8_mma`` choose the kernel).
TRANSPOSED_KERNELS: Mapping[str, tuple[str, ...]] = MappingProxyType({
    "gluon_transposed": ("pdl", ), "gluon_transposed_ws": ("pdl", ),
    "gluon_transposed_fp8": ("pdl", "defer_sums", "stacked", "wide_vt", "warp_max", "slim")})


class TransposedGluonRoute(WgmmaGluonRoute):
    """The transposed Hopper Gluon decode: S^T = K Q^T with the tile's 64 keys as the MMA's
    M and 16 or 32 query rows as its N (no padding of few rows to 64), one warpgroup; bf16
    or fp16 q over a cache of q's dtype or fp8 (e4m3, widened to q's dtype in shared
    memory, its scale read on the device). Its param sets launch the split reduce as a
    programmatic dependent (``pdl``) and read an fp8 cache widened in a partition of its own
    (``ws``) or, at up to 16 query rows a program, with fp8 MMAs, q as two e4m3 terms
    (``fp8_mma``, with ``defer_sums``, ``stacked``, ``wide_vt``, ``warp_max`` and ``slim``); a
    stored param set without them ran the earlier forms and still does."""

    id = "transposed/gluon"
    kernel = "gluon_transposed"
    reads_fp8 = True
    # ws: an fp8 cache widened by a partition of its own (0.77x the time at (128, 16, 8192,
    # 1)); pdl: the split reduce launched as a programmatic dependent (0.5 us less at batch
    # 1-8). H200, 2026-12-01 (benchmarks/results/README.md, session 10).
    # fp8_mma: an fp8 cache read with fp8 MMAs (gluon_transposed_fp8); defer_sums: its row
    # sums reduced once after the last tile (0.92x the time at (128, 16, 8192, 1) and
    # (64, 16, 4096, 1) fp8, same at batch 1; H200, 2026-12-01, session 13); stacked: q's two
    # e4m3 terms in one wgmma operand (0.92x the time at (128, 16, 8192, 1) fp8, 0.95x at
    # (64, 16, 4096, 1); H200, 2026-12-02, session 19); wide_vt: V^T moved without shared-
    # memory bank conflicts (0.77x at (128, 16, 8192, 1) fp8, 0.81x at (64, 16, 4096, 1));
    # warp_max: a tile's max over keys across the warps in one barrier (0.955x after
    # wide_vt; H200, 2026-12-02, session 20); slim: its softmax masked only on a tile that
    # reaches a bound, the scales in the exponent's FMA (benchmarks/results/README.md,
    # session 21).
    kernel_options = MappingProxyType({"ws": False, "pdl": False, "fp8_mma": False,
                                       "defer_sums": False, "stacked": False,
                                       "wide_vt": False, "warp_max": False, "slim": False})

    def param_space(self, problem: MLAProblem, device: DeviceInfo) -> list[Params]:
        """The split counts with PDL. Over an fp8 cache, widened; at up to 16 query rows a
        program also with fp8 MMAs, the two forms alternating split by split from each
        kernel's own pick (the fp8-MMA kernel's with its ``FP8_MMA_PROGRAM_COST``), fp8
        MMAs first (a sweep keeping three times both at the picks).
        Past 16 rows the fp8-MMA kernel (q's two terms) took 1.13-1.22x the widening's time
        in geomean at the same split on the H200 (2026-12-01, session 11 call 6): not
        offered."""
        sets = [{**params, "pdl": True} for params in super().param_space(problem, device)]
        if problem.kv_dtype not in FP8_DTYPES:
            return sets
        widen = [{**params, "ws": True} for params in sets]
        if not self.offers_fp8_mma(problem):
            return widen
        fp8_mma = {"pdl": True, "ws": True, "fp8_mma": True, "defer_sums": True,
                   "stacked": True, "wide_vt": True, "warp_max": True, "slim": True}
        fp8 = [{**params, **fp8_mma} for params in
               self.split_sets(problem, device, plan.FP8_MMA_PROGRAM_COST)]
        pairs = itertools.zip_longest(fp8, widen)
        return [form for pair in pairs for form in pair if form is not None]

    def launcher(self, problem: MLAProblem, chosen: Params) -> tuple[Callable, dict]:
        """The kernel a param set names, with the options it takes (``TRANSPOSED_KERNELS``):
        fp8 MMAs over an fp8 cache (``fp8_mma``; a 16-bit cache runs the transposed kernel
        as without it), the warp-specialized widening (``ws``: it reads fp8 caches only and
        refuses a 16-bit one), else the transposed kernel (its own widening over fp8)."""
        if chosen["fp8_mma"] and problem.kv_dtype in FP8_DTYPES:
            name = "gluon_transposed_fp8"
        elif chosen["ws"]:
            name = "gluon_transposed_ws"
        else:
            name = self.kernel
        return (_kernel(name).decode_launcher,
                {option: chosen[option] for option in TRANSPOSED_KERNELS[name]})

    def offers_fp8_mma(self, problem: MLAProblem) -> bool:
        """Whether the param sets include fp8-MMA ones (then first): an fp8 cache, at up to
        ``FP8_MMA_MAX_ROWS`` query rows a program."""
        return problem.kv_dtype in FP8_DTYPES and self.block_rows(problem) <= FP8_MMA_MAX_ROWS

    def rounds_p(self, problem: MLAProblem, params: Params) -> bool:
        """Whether P is rounded to fp8 (q kept near 16 bits by its two e4m3 terms; the
        ``P_ROUNDED`` tolerance applies): the fp8-MMA sets, and no params at all where the
        route's first set is one."""
        if problem.kv_dtype not in FP8_DTYPES:
            return False
        return bool(params.get("fp8_mma")) if params else self.offers_fp8_mma(problem)

    def block_rows(self, problem: MLAProblem) -> int:
        return plan.transposed_rows(problem.kernel_heads * problem.qlen)
