"""FlashMLA's dense decode (NVIDIA Hopper) as the route ``dense/flashmla``.

An optional backend found at run time: mlatune imports without it, and the route
refuses with what to install when it is missing. Two library interfaces are
adapted (``FlashMLALib``), whichever is installed first:

- ``legacy``: the ``sgl-flash-mla`` wheel's ``flash_mla`` (1.0.0; ``use_legacy=True``
  reaches the Hopper dense kernels upstream removed in its 2026-09-30 release). Run
  on the H200 here.
- ``classic``: upstream ``flash_mla`` from before that release, or vLLM's bundled
  copy (``vllm.attention.ops.flashmla``): ``get_mla_metadata(lens, rows, 1)`` and
  ``flash_mla_with_kvcache(..., tile_scheduler_metadata, num_splits, ...)``. Checked
  against a recording fake only; no such build has run here.

The step: the plan is FlashMLA's scheduler (a device kernel over this step's
lengths: tile metadata and split counts), the launch its decode, so the route is
captured whole in a CUDA graph. Over an fp8 cache the kernel reads an fp8 q: a
bf16 q is quantized per tensor (amax / 448) on the device in the launch, which
costs accuracy (its ``rounding`` is ``Q_FP8``). The library
allocates its outputs: ``run`` points ``Prepared.out``/``lse`` at them (so the
poisoned buffers of a check are not what it writes), and ``attention.decode``
copies into the caller's ``out=``. Rows that attend no key (empty requests) are rewritten
as 0 and -inf after the launch (``kernels.empty_rows``): FlashMLA leaves NaN or +inf there.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import cache
from typing import Any

import torch

from mlatune import capability
from mlatune.arch import DeviceInfo
from mlatune.check.accuracy import Rounding
from mlatune.check.inputs import DecodeInputs, KVShard, PrefillInputs
from mlatune.problem import FP8_DTYPES, MLAProblem
from mlatune.routes.base import (
    DEVICE_PLANNED,
    Params,
    Prepared,
    Route,
    SharedPlan,
    StepKind,
    Verdict,
    no,
    plan_key,
    shared_buffers,
)
from mlatune.routes.geometry import EvenBlocks

INSTALL = ("pip install sgl-flash-mla --no-deps (its metadata asks for a newer torch than "
           "its stable-ABI build needs)")
FP8_MAX = 448.0  # e4m3fn
_CLASSIC_MODULES = ("vllm.attention.ops.flashmla", "vllm.v1.attention.ops.flashmla")


@dataclass(frozen=True)
class FlashMLALib:
    """The installed FlashMLA, behind the two calls the route makes."""

    flavour: str  # "legacy", "classic" or "" when missing
    version: str
    missing: str  # why the route cannot run here; "" when it can
    # (seq_lens, q rows per KV head, q heads, fp8) -> scheduler state for ``decode``
    metadata: Callable[..., object] | None = None
    # (q4, kv4, block_table, seq_lens, d_v, scale, causal, state, descale_q, descale_k)
    #   -> (out (b, s, h, d_v), lse (b, h, s))
    decode: Callable[..., tuple[torch.Tensor, torch.Tensor]] | None = None


def _legacy(mod) -> FlashMLALib:
    def metadata(lens, rows, heads, fp8):
        return mod.get_mla_decoding_metadata(lens, rows, 1, heads, is_fp8_kvcache=fp8,
                                             topk=None, use_legacy=True)

    def decode(q, kv, table, lens, d_v, scale, causal, state, descale_q, descale_k):
        sched = mod.get_mla_metadata()[0]
        # The wrapper stores what the kernel returns back into ``sched``; a fresh one per
        # call keeps the planned state untouched for the next launch.
        sched.tile_scheduler_metadata, sched.num_splits = state
        fp8 = descale_k is not None
        return mod.flash_mla_with_kvcache(
            q, kv, table, lens, d_v, sched, softmax_scale=scale, causal=causal,
            is_fp8_kvcache=fp8, use_legacy=True,
            **({"descale_q": descale_q, "descale_k": descale_k} if fp8 else {}))

    return FlashMLALib("legacy", getattr(mod, "__version__", "?"), "", metadata, decode)


def _classic(mod) -> FlashMLALib:
    def metadata(lens, rows, heads, fp8):
        return mod.get_mla_metadata(lens, rows, 1)

    def decode(q, kv, table, lens, d_v, scale, causal, state, descale_q, descale_k):
        extra = {} if descale_k is None else {"descale_q": descale_q, "descale_k": descale_k}
        call = mod.flash_mla_with_kvcache
        if descale_k is not None and hasattr(mod, "flash_mla_with_kvcache_fp8"):
            call = mod.flash_mla_with_kvcache_fp8
        return call(q, kv, table, lens, d_v, *state, softmax_scale=scale,
                    causal=causal, **extra)

    return FlashMLALib("classic", getattr(mod, "__version__", "?"), "", metadata, decode)


@cache
def library() -> FlashMLALib:
    """The first FlashMLA that imports: ``flash_mla`` (legacy or classic API), then vLLM's."""
    errors = []
    for name in ("flash_mla", *_CLASSIC_MODULES):
        try:
            mod = importlib.import_module(name)
        except Exception as exc:  # any import failure: this copy is unusable here
            first = str(exc).splitlines()[0] if str(exc) else ""
            errors.append(f"{name}: {type(exc).__name__}: {first}")
            continue
        if hasattr(mod, "get_mla_decoding_metadata"):
            if hasattr(mod, "has_legacy") and not mod.has_legacy():
                errors.append(f"{name}: built without the legacy (Hopper dense) kernels")
                continue
            return _legacy(mod)
        if hasattr(mod, "get_mla_metadata") and hasattr(mod, "flash_mla_with_kvcache"):
            return _classic(mod)
        errors.append(f"{name}: no dense decode interface")
    broken = [e for e in errors if "ModuleNotFoundError" not in e]  # present but unusable
    why = f" ({'; '.join(broken)})" if broken else ""
    return FlashMLALib("", "", f"FlashMLA is not installed{why}: {INSTALL}")


def quantize_q_(q: torch.Tensor, q8: torch.Tensor, descale: torch.Tensor) -> None:
    """Per-tensor fp8 quantization of ``q`` into ``q8``, on the device (no host sync)."""
    amax = q.abs().amax().float().clamp(min=1e-12)
    descale.copy_((amax / FP8_MAX).reshape(1))
    q8.copy_((q.float() / descale).clamp(-FP8_MAX, FP8_MAX))


class FlashMLARoute(Route):
    """FlashMLA's dense Hopper decode; bf16, or an fp8 cache through its fp8 path."""

    id = "dense/flashmla"
    shares_plan = True  # prepare takes plan_from= (another layer's scheduler output)

    def supports(self, problem: MLAProblem, device: DeviceInfo) -> Verdict:
        ruling = capability.check(self.id, problem, device.arch)
        if not ruling:
            return no(f"rule {ruling.rule}: {ruling.reason}")
        lib = library()
        if lib.missing:
            return no(lib.missing)
        return Verdict(True, f"FlashMLA {lib.version} ({lib.flavour} interface)")

    def unusable(self, device: DeviceInfo) -> str | None:
        return library().missing or None

    def param_space(self, problem: MLAProblem, device: DeviceInfo) -> list[Params]:
        return [{}]

    def step_kind(self, params: Params) -> StepKind:
        return DEVICE_PLANNED

    def launch_geometry(self, problem: MLAProblem, recipe: Mapping[str, Any], cus: int
                        ) -> EvenBlocks | None:
        """An even share of 64-key blocks per SM part, as its metadata gives."""
        return EvenBlocks(problem, cus) if problem.phase == "decode" else None

    def rounding(self, problem: MLAProblem, params: Params) -> Rounding:
        """Over an fp8 cache a 16-bit q is quantized to fp8 per tensor."""
        quantized = problem.kv_dtype in FP8_DTYPES and problem.q_dtype not in FP8_DTYPES
        return Rounding.Q_FP8 if quantized else Rounding.NONE

    def prepare(self, problem: MLAProblem, inputs: DecodeInputs | PrefillInputs, *,
                rank: int = 0, params: Params | None = None, want_lse: bool = True,
                plan_from: Prepared | None = None) -> Prepared:
        if not isinstance(inputs, DecodeInputs):
            raise TypeError(f"{self.id} serves decode inputs, got {type(inputs).__name__}")
        lib = library()
        if lib.missing:
            raise RuntimeError(lib.missing)
        from mlatune.kernels.empty_rows import clear_empty_rows  # triton: when a step is made

        shard = inputs.shards[rank]
        b, s, h = problem.batch, problem.qlen, problem.kernel_heads
        q4 = inputs.q.view(b, s, h, inputs.q.shape[-1])
        kv4 = shard.kv_cache.view(shard.kv_cache.shape[0], shard.kv_cache.shape[1], 1,
                                  shard.kv_cache.shape[-1])
        fp8 = problem.kv_dtype in FP8_DTYPES
        q8 = descale_q = None
        if self.rounding(problem, params or {}) == Rounding.Q_FP8:
            q8 = torch.empty(q4.shape, dtype=shard.kv_cache.dtype, device=q4.device)
            descale_q = torch.empty(1, dtype=torch.float32, device=q4.device)
        elif fp8:
            descale_q = inputs.q_scale
        causal = problem.causal and s > 1
        scale = inputs.softmax_scale
        key = plan_key(self.id, problem, {}, rank, shard.seq_lens, shard.block_table)
        shared = shared_buffers(plan_from, key)
        state: dict[str, Any] = {} if shared is None else shared.buffers
        if shared is None:
            state["lens"], state["table"], state["refresh"] = _kernel_inputs(shard, fp8)

        def schedule() -> None:  # FlashMLA's scheduler over this step's lengths, on the device
            if state["refresh"] is not None:
                state["refresh"]()
            state["meta"] = lib.metadata(state["lens"], s * h, h, fp8)

        def run() -> None:
            q_in = q4
            if q8 is not None:
                quantize_q_(q4, q8, descale_q)
                q_in = q8
            out, lse = lib.decode(q_in, kv4, state["table"], state["lens"], problem.d_v,
                                  scale, causal, state["meta"], descale_q,
                                  inputs.kv_scale if fp8 else None)
            out, lse = out.view(b * s, h, out.shape[-1]), lse.transpose(1, 2).reshape(b * s, h)
            # Rows without keys: FlashMLA leaves NaN or +inf there; 0 and -inf (_kernel_inputs)
            clear_empty_rows(shard.seq_lens, out, lse, qlen=s, causal=causal)
            prepared.out = out
            if prepared.lse is not None:
                prepared.lse = lse

        plan = schedule if shared is None else shared.plan  # another layer's fills ``state``
        if shared is None:
            plan()
        out = torch.empty(b * s, h, problem.d_v, dtype=torch.bfloat16, device=q4.device)
        lse = (torch.empty(b * s, h, dtype=torch.float32, device=q4.device)
               if want_lse else None)
        ran = {"interface": lib.flavour, **({"q": "fp8 per-tensor"} if q8 is not None else {})}
        prepared = Prepared(run, out, lse, graph_safe=True, params=ran, plan_reads_lengths=True,
                            plan=plan, plan_state=SharedPlan(key, state, plan))
        return prepared


def _kernel_inputs(shard: KVShard, fp8: bool
                   ) -> tuple[torch.Tensor, torch.Tensor, Callable[[], None] | None]:
    """The lengths and block table FlashMLA reads, and what refreshes them each step (None:
    the shard's own). Over an fp8 cache every request is given at least one key, an empty
    one's first page being page 0: FlashMLA's fp8 decode faults (illegal address) on a batch
    whose lengths are all 0 (sgl-flash-mla 1.0.0, H100, 2026-12-06). The rows without keys
    (a request of length 0, a DCP shard that holds none of it, a verify token before its
    request's first key), where FlashMLA leaves NaN or +inf (H200, 2026-11-30 sweep), are
    rewritten as 0 and -inf after every launch."""
    if not fp8:
        return shard.seq_lens, shard.block_table, None
    lens, table = torch.empty_like(shard.seq_lens), torch.empty_like(shard.block_table)

    def refresh() -> None:
        torch.clamp(shard.seq_lens, min=1, out=lens)
        table.copy_(shard.block_table)
        table[:, 0].masked_fill_(shard.seq_lens == 0, 0)

    return lens, table, refresh
