"""``fp8-ps/triton`` and ``bf16-ps/triton``: persistent varlen prefill in Triton.

Both run ``mlatune.kernels.prefill``: 256-row query tiles planned on the host,
one program per SM, split tiles merged by LSE. ``fp8-ps`` is the portable
counterpart of AITER's FP8 persistent prefill (mla_prefill_ps_asm_fwd +
mla_reduce_v1) that vLLM's ROCm backend uses: fp8 q/k/v with per-tensor scales,
bf16 output. ``bf16-ps`` is the same kernel with a 16-bit q, over a k/v in q's
type or in fp8 (whose tiles the kernel converts to q's type as it loads them).
On sm_90 with triton 3.6, ``fp8-ps``'s first two param sets (the first its default there)
run the same plan through a Gluon kernel instead
(``mlatune.kernels.gluon_prefill_fp8``: warp-specialized, fp8 wgmmas; 1.42x cuDNN's bf16
SDPA at 128 heads x 4096 causal tokens on the H200, 2026-12-01).

Like that backend, both pad the heads to a multiple of 16 by replication
(12 -> 16, 24 -> 32; padded head j copies real head j mod H) and slice the
real heads back, so the measured cost includes the padding. The Triton kernel
itself has no such constraint; the padding is kept so that what is measured is
the route the seed takes.
"""

from __future__ import annotations

from typing import Any

import torch

from mlatune.arch import DeviceInfo, device_of
from mlatune.check.inputs import DecodeInputs, PrefillInputs
from mlatune.problem import DTYPES, FP8_DTYPES, MLAProblem
from mlatune.routes.base import (
    HOST_PLANNED,
    TILE_LIMITS,
    Params,
    Prepared,
    Route,
    StepKind,
    Verdict,
)
from mlatune.routes.triton_support import triton_verdict

TILE_Q = 256  # query rows per work tile, as in AITER's FP8 prefill
HEAD_ALIGN = 16  # heads are padded to a multiple of this, as the seed does

# Shared memory (LDS on AMD) per block, bytes, for pruning block configs by rule.
_SHARED_MEMORY = {"sm_80": 163 << 10, "sm_86": 99 << 10, "sm_89": 99 << 10,
                  "sm_90": 227 << 10, "sm_100": 227 << 10, "gfx942": 64 << 10,
                  "gfx950": 160 << 10}
_DEFAULT_SHARED_MEMORY = 99 << 10

# (block_m, block_n, num_warps, num_stages[, v_transposed, grouped]), the default
# first. Compiled for sm_90 by Triton 3.9 (tests/prefill_aot.py, no GPU needed) all
# use wgmma; the 16-bit ones sit at the register limit (q, 128 x 192, stays in
# registers), so wide key blocks and deep pipelines spill: (128, 64, 8, 2) spills 40
# bytes, (128, 128, 8, 2) over 300 and is left out. fp8 halves q and P and does not
# spill. fp8's P.V needs v transposed (Hopper's fp8 wgmma reads its B operand only
# K-major; otherwise each v tile is loaded through registers, not pipelined).
_GPU_CONFIGS_16BIT = ((128, 64, 8, 2), (128, 32, 8, 3), (128, 32, 8, 2))
# fp8: v transposed over 128-key blocks, P.V in flight into the next block (Triton 3.6
# SASS, tests/prefill_aot.py, ~550 instructions a warp per block off the diagonal). On
# the H200 deeper pipelines paid (docs/kernels/prefill.md); 4 and 5 stages fit in shared
# memory (184 and 224 KB) and spill only outside the key loop.
# The last flag plans head-grouped (prefill_plan._grouped_plan): at 128 heads x 4096
# the contiguous plan streams ~132 heads' keys at once (~170 MB, past the 50 MB L2),
# about 2.7 GB from HBM in all; grouped, a few heads at a time share them in L2.
_GPU_CONFIGS_FP8 = ((128, 128, 8, 3, True, True), (128, 128, 8, 4, True, True),
                    (128, 128, 8, 5, True, True))
_SMALLEST_CONFIG = (64, 32, 4, 1)  # fits every device's shared memory
# The interpreter runs block ops in numpy: fewer, larger blocks run faster. fp8 reads
# v transposed there too, as on GPUs.
_CPU_CONFIG = (32, 32, 4, 1)
_CPU_CONFIG_FP8 = (32, 32, 4, 1, True, True)
# fp8 on sm_90 with triton 3.6's Gluon: kernels/gluon_prefill_fp8 (warp-specialized, both
# products fp8 wgmmas, P kept in registers; DeepSeek's 192/128 dims, e4m3fn), its one form
# named in "form", head-grouped, at ring depth 3 (168 KB of shared memory with the two query
# blocks) or 4 (209 KB). Both lead the route's space where it runs (the first its default),
# so a sweep keeping 3 sets a route runs both and one Triton set.
GLUON_FORM = "pingpong"
GLUON_PARAMS: Params = {"kernel": "gluon", "form": GLUON_FORM, "num_stages": 3, "grouped": True}
GLUON_PARAM_SETS: tuple[Params, ...] = (GLUON_PARAMS, {**GLUON_PARAMS, "num_stages": 4})
# A stored Gluon set named its form with these booleans before "form" (absent: off), and ran
# these values where it left them out.
GLUON_LEGACY_FORMS = ("pingpong", "permuted_v", "paired")
GLUON_LEGACY_DEFAULTS: Params = {"num_stages": 3, "grouped": False}


def config_params(config: tuple) -> Params:
    """A config tuple as route params (fp8's variant flags only where the tuple has them)."""
    keys = ("block_m", "block_n", "num_warps", "num_stages", "v_transposed", "grouped")
    return dict(zip(keys, config, strict=False))


def _gluon_serves(problem: MLAProblem, device: DeviceInfo) -> bool:
    """Whether the Gluon fp8 kernel takes this problem here: sm_90, triton 3.6, e4m3fn q, k
    and v, 192 / 128 dims."""
    from mlatune.kernels.gluon_hopper_plan import triton_refusal  # triton: when asked
    from mlatune.routes.gluon_hopper import triton_version  # triton: when asked

    return (device.arch == "sm_90" and problem.q_dtype == problem.kv_dtype == "fp8_e4m3fn"
            and (problem.d_qk, problem.d_v) == (192, 128)
            and triton_refusal(triton_version()) is None)


def padded_heads(num_heads: int) -> int:
    return -(-num_heads // HEAD_ALIGN) * HEAD_ALIGN


def _shared_bytes(config: tuple, problem: MLAProblem) -> int:
    """Rough shared memory of a config: q tile plus num_stages k/v tiles."""
    block_m, block_n, _, stages = config[:4]
    item = DTYPES[problem.q_dtype].itemsize
    return item * (block_m * problem.d_qk + stages * block_n * (problem.d_qk + problem.d_v))


class _PersistentPrefillRoute(Route):
    """Which problems it serves (phase, dtypes, head dims, the arch's dots) is the
    capability model's: capability.rules, the ``fp8-ps/triton`` / ``bf16-ps/triton`` entries."""

    id: str
    param_limits = TILE_LIMITS

    def supports(self, problem: MLAProblem, device: DeviceInfo) -> Verdict:
        return triton_verdict(self.id, problem, device)

    def step_kind(self, params: Params) -> StepKind:
        return HOST_PLANNED  # the tile schedule is planned from cu_seqlens on the host

    def param_space(self, problem: MLAProblem, device: DeviceInfo) -> list[Params]:
        fp8 = problem.q_dtype in FP8_DTYPES
        if not device.is_gpu:
            configs = [_CPU_CONFIG_FP8 if fp8 else _CPU_CONFIG]
        else:
            limit = _SHARED_MEMORY.get(device.arch, _DEFAULT_SHARED_MEMORY)
            configs = [c for c in (_GPU_CONFIGS_FP8 if fp8 else _GPU_CONFIGS_16BIT)
                       if _shared_bytes(c, problem) <= limit] or [_SMALLEST_CONFIG]
        triton_sets = [config_params(c) for c in configs]
        if not _gluon_serves(problem, device):
            return triton_sets
        return [*(dict(p) for p in GLUON_PARAM_SETS), *triton_sets]

    def prepare(self, problem: MLAProblem, inputs: DecodeInputs | PrefillInputs, *,
                rank: int = 0, params: Params | None = None,
                want_lse: bool = True) -> Prepared:
        if not isinstance(inputs, PrefillInputs):
            raise TypeError(f"{self.id} takes PrefillInputs, got {type(inputs).__name__}")
        device = device_of(inputs.q)
        params = self.fill_defaults(params or {}, self.param_space(problem, device))
        heads, kernel_heads = problem.num_heads, padded_heads(problem.num_heads)
        q, k, v = inputs.q, inputs.k, inputs.v
        dev = q.device
        # Padded copies of q, k and v that run() refills before the kernel on every call.
        stage: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
        if kernel_heads != heads:
            head_index = torch.arange(kernel_heads, device=dev) % heads  # real heads first
            q, k, v = (self._padded(x, head_index, stage) for x in (q, k, v))
        total_q = q.shape[0]
        out_full = torch.empty(total_q, kernel_heads, problem.d_v,
                               dtype=DTYPES[problem.out_dtype], device=dev)
        lse_full = torch.empty(total_q, kernel_heads, dtype=torch.float32, device=dev)
        scales = None
        if problem.kv_dtype in FP8_DTYPES:
            one = torch.ones(1, dtype=torch.float32, device=dev)  # a 16-bit q has no scale
            scales = (inputs.q_scale if inputs.q_scale is not None else one,
                      inputs.k_scale, inputs.v_scale)
        lengths = (inputs.cu_seqlens_q.diff().tolist(), inputs.cu_seqlens_k.diff().tolist())
        chosen, launch = self.launcher(params, (q, k, v, out_full, lse_full), lengths,
                                        dict(causal=problem.causal, sm_scale=inputs.softmax_scale,
                                             scales=scales, num_programs=device.cu_count,
                                             tile_q=TILE_Q))

        def run() -> None:
            for src, index, dst in stage:
                torch.index_select(src, 1, index, out=dst)
            launch()

        used = {**chosen, "kernel_heads": kernel_heads,
                "programs": device.cu_count, "split_tiles": len(launch.plan.merges)}
        return Prepared(run, out_full[:, :heads], lse_full[:, :heads] if want_lse else None,
                        graph_safe=True, params=used, plan_reads_lengths=True)

    def launcher(self, params: Params, tensors: tuple[torch.Tensor, ...],
                 lengths: tuple[list[int], list[int]], common: dict[str, Any]
                 ) -> tuple[Params, Any]:
        """The set as it runs and its launcher over ``tensors`` (q, k, v, out, lse; the
        kernels' planned batch, called to launch): for a Gluon set ``GluonPrefill`` (the Gluon
        fp8 kernel's one form), else ``PersistentPrefill``; ``common``, their shared
        keywords."""
        # Imported here, not at module import: they need Triton, and tests must be able to
        # switch on TRITON_INTERPRET before the kernels are decorated.
        if params.get("kernel") == "gluon":
            from mlatune.kernels.gluon_prefill_fp8 import GluonPrefill  # triton: when asked

            if params["form"] != GLUON_FORM:
                raise ValueError(f"{self.id}: Gluon form {params['form']!r} is not "
                                 f"{GLUON_FORM!r}")
            return params, GluonPrefill(*tensors, *lengths, grouped=bool(params["grouped"]),
                                        stages=params["num_stages"], **common)
        from mlatune.kernels.prefill import KernelConfig, PersistentPrefill  # triton: when asked

        config = KernelConfig(params["block_m"], params["block_n"], params["num_warps"],
                              params["num_stages"], bool(params.get("v_transposed")),
                              bool(params.get("grouped")))
        return config.as_params(), PersistentPrefill(*tensors, *lengths, config=config, **common)

    @staticmethod
    def fill_defaults(params: Params, space: list[Params]) -> Params:
        """A set as this route runs it (``routes.with_defaults``), ``space`` being its sets at
        the problem: none given, the first; a Gluon set over the first Gluon set; a Triton set
        over the first Triton set (the Gluon sets' options mean nothing to that kernel)."""
        params = params or space[0]
        if params.get("kernel") == "gluon":
            return {**GLUON_PARAMS, **params}
        return {**next(p for p in space if p.get("kernel") != "gluon"), **params}

    def upgrade_params(self, params: Params) -> Params | None:
        """A stored set in the current spelling; None where it names a deleted kernel form. A
        Gluon set names ``GLUON_FORM`` in "form"; in the booleans before it
        (``GLUON_LEGACY_FORMS``, absent: off), pingpong and permuted_v on and paired off are
        that form, any other combination a deleted one. A Triton set reads without
        ``qk_ahead`` (off: the same kernel; on: a deleted form)."""
        if params.get("kernel") == "gluon":
            if "form" in params:
                return dict(params) if params["form"] == GLUON_FORM else None
            on = {k: bool(params.get(k)) for k in GLUON_LEGACY_FORMS}
            if not (on["pingpong"] and on["permuted_v"]) or on["paired"]:
                return None
            kept = {k: v for k, v in params.items() if k not in GLUON_LEGACY_FORMS}
            return {**GLUON_LEGACY_DEFAULTS, **kept, "form": GLUON_FORM}
        if params.get("qk_ahead"):
            return None
        return {k: v for k, v in params.items() if k != "qk_ahead"}

    @staticmethod
    def _padded(src: torch.Tensor, head_index: torch.Tensor,
                stage: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """A (tokens, padded heads, d) buffer that run() fills from ``src`` by head index.

        fp8 tensors are copied as bytes (uint8 views), which index_select supports everywhere.
        """
        dst = torch.empty(src.shape[0], head_index.numel(), src.shape[2], dtype=src.dtype,
                          device=src.device)
        if src.element_size() == 1:
            stage.append((src.view(torch.uint8), head_index, dst.view(torch.uint8)))
        else:
            stage.append((src, head_index, dst))
        return dst


class FP8PersistentPrefillRoute(_PersistentPrefillRoute):
    id = "fp8-ps/triton"


class BF16PersistentPrefillRoute(_PersistentPrefillRoute):
    id = "bf16-ps/triton"
