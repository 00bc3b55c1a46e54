"""FlashInfer's MLA decode (``BatchMLAPagedAttentionWrapper``) as ``fa3/flashinfer`` and
``fa2/flashinfer``.

An optional backend found at run time (``flashinfer-python`` with ``apache-tvm-ffi``);
mlatune imports without it and the routes refuse, naming what to install, when it
is missing. FlashInfer compiles each variant (backend x dtypes) with nvcc on first
use and caches it on disk, so a sweep's compile-ahead pass pays that before timing.

The step: ``plan`` is FlashInfer's, on the host (it copies the lengths to the CPU
and partitions the work there), so the route is host-planned: prepared again from
the lengths every step and never chosen where a capturable step is asked for; the
layers of one engine step share that plan (``plan_from``: the planning layer's wrapper
serves the others, as engines use FlashInfer). The launch writes into the caller's
buffers (``writes_into``). FlashInfer's LSE is base
2 unless asked; the route asks for natural log, as the table and merge use. Over an
fp8 (e4m3fn) cache it takes a bf16 q and the cache's per-tensor scale as a host
float, read once at prepare.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Mapping
from functools import cache
from typing import Any

import torch

from mlatune import capability, graph_pools
from mlatune.arch import DeviceInfo
from mlatune.check.inputs import DecodeInputs, PrefillInputs
from mlatune.problem import DTYPES, FP8_DTYPES, MLAProblem
from mlatune.routes.base import (
    HOST_PLANNED,
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
from mlatune.routes.geometry import RequestRounds
from mlatune.routes.paged import paged_view, uniform_indptr

INSTALL = ("pip install flashinfer-python apache-tvm-ffi (it compiles its MLA kernels with "
           "nvcc on first use)")
WORKSPACE_BYTES = 128 << 20  # FlashInfer's recommended float workspace for MLA
_workspaces: dict[torch.device, torch.Tensor] = {}


@cache
def library() -> tuple[object | None, str]:
    """(the flashinfer module, "") or (None, why it cannot be used here)."""
    if torch.cuda.is_available() and "FLASHINFER_CUDA_ARCH_LIST" not in os.environ:
        # JIT for this GPU only ("9.0a": Hopper's wgmma kernels need the arch-specific target).
        major, minor = torch.cuda.get_device_capability()
        os.environ["FLASHINFER_CUDA_ARCH_LIST"] = f"{major}.{minor}{'a' if major >= 9 else ''}"
    try:
        mod = importlib.import_module("flashinfer")
        _ = mod.mla.BatchMLAPagedAttentionWrapper  # the class the routes call
    except Exception as exc:  # any import failure means the backend is unusable here
        if isinstance(exc, ModuleNotFoundError) and exc.name == "flashinfer":
            return None, f"FlashInfer is not installed: {INSTALL}"
        first = str(exc).splitlines()[0] if str(exc) else ""
        return None, f"FlashInfer is not usable ({type(exc).__name__}: {first}): {INSTALL}"
    return mod, ""


def _workspace(device: torch.device) -> torch.Tensor:
    """One float workspace per device, shared by the wrappers (their steps run in turn); a
    step's own inside a graph pool that must not keep it (``graph_pools``)."""
    if device in _workspaces:
        return _workspaces[device]
    workspace = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
    if not graph_pools.in_graph_tree(device):
        _workspaces[device] = workspace
    return workspace


def _planned_on_the_host() -> None:
    """A shared FlashInfer plan has no device part: the planning layer's prepare made it."""


class FlashInferRoute(Route):
    """One FlashInfer MLA backend (``fa3``: Hopper; ``fa2``: portable)."""

    writes_into = True  # prepare takes the caller's out= and lse= buffers
    shares_plan = True  # prepare takes plan_from= (another layer's planned wrapper)

    def __init__(self, backend: str):
        self.backend = backend
        self.id = f"{backend}/flashinfer"

    def supports(self, problem: MLAProblem, device: DeviceInfo) -> Verdict:
        ruling = capability.check(self.id, problem, device.arch)
        if not ruling:
            return no(f"rule {ruling.rule}: {ruling.reason}")
        mod, missing = library()
        if missing:
            return no(missing)
        return Verdict(True, f"FlashInfer {getattr(mod, '__version__', '?')} {self.backend}")

    def unusable(self, device: DeviceInfo) -> str | None:
        return library()[1] or None

    def param_space(self, problem: MLAProblem, device: DeviceInfo) -> list[Params]:
        return [{}]

    def step_kind(self, params: Params) -> StepKind:
        return HOST_PLANNED

    def launch_geometry(self, problem: MLAProblem, recipe: Mapping[str, Any], cus: int
                        ) -> RequestRounds | None:
        """Requests' tiles handed out in rounds over clusters, as its host plan does."""
        return RequestRounds(problem, cus) if problem.phase == "decode" else None

    def prepare(self, problem: MLAProblem, inputs: DecodeInputs | PrefillInputs, *,
                rank: int = 0, params: Params | None = None, want_lse: bool = True,
                out: torch.Tensor | None = None, lse: torch.Tensor | None = None,
                plan_from: Prepared | None = None) -> Prepared:
        if not isinstance(inputs, DecodeInputs):
            raise TypeError(f"{self.id} serves decode inputs, got {type(inputs).__name__}")
        mod, missing = library()
        if missing:
            raise RuntimeError(missing)
        shard = inputs.shards[rank]
        q, cache_ = inputs.q, shard.kv_cache
        dev, d_v = q.device, problem.d_v
        # The plan fixes the softmax scale too: a layer with another scale plans its own.
        key = plan_key(self.id, problem, {"sm_scale": inputs.softmax_scale}, rank,
                       shard.seq_lens, shard.block_table)
        shared = shared_buffers(plan_from, key)
        wrapper = shared.buffers if shared is not None else \
            self._planned(mod, problem, inputs, rank)
        scales = {}
        if problem.kv_dtype in FP8_DTYPES:
            kv_scale = float(inputs.kv_scale)  # one host read here, none per launch
            scales = {"ckv_scale": kv_scale, "kpe_scale": kv_scale}
        if out is None:
            out = torch.empty(q.shape[0], problem.kernel_heads, d_v,
                              dtype=DTYPES[problem.out_dtype], device=dev)
        if lse is None and want_lse:
            lse = torch.empty(q.shape[0], problem.kernel_heads, dtype=torch.float32, device=dev)
        q_nope, q_pe = q[..., :d_v], q[..., d_v:]
        ckv, kpe = cache_[..., :d_v], cache_[..., d_v:]
        # Its tests hold rows of length 0 to 0 and -inf, but not a causal verify token before
        # its request's first key (they skip qlen > length): those rows are rewritten.
        verify = problem.causal and problem.qlen > 1
        if verify:
            from mlatune.kernels.empty_rows import clear_empty_rows  # triton: when asked

        def run() -> None:
            wrapper.run(q_nope, q_pe, ckv, kpe, out=out, lse=lse, return_lse=lse is not None,
                        return_lse_base_on_e=True, **scales)
            if verify:
                clear_empty_rows(shard.seq_lens, out, lse, qlen=problem.qlen, causal=True)

        return Prepared(run, out, lse, graph_safe=True, params={"backend": self.backend},
                        plan_reads_lengths=True,
                        plan_state=SharedPlan(key, wrapper, _planned_on_the_host))

    def _planned(self, mod, problem: MLAProblem, inputs: DecodeInputs, rank: int):
        """A wrapper planned for the shard's lengths now: the CSR page lists (read on the
        host) and FlashInfer's own partition of the work."""
        shard = inputs.shards[rank]
        q, cache_ = inputs.q, shard.kv_cache
        dev, d_v, page = q.device, problem.d_v, cache_.shape[1]
        view = paged_view(shard, page)
        wrapper = mod.mla.BatchMLAPagedAttentionWrapper(_workspace(dev), backend=self.backend)
        wrapper.plan(uniform_indptr(problem.batch, problem.qlen, dev), view.indptr,
                     view.indices, shard.seq_lens, problem.kernel_heads, d_v,
                     cache_.shape[-1] - d_v, page, problem.causal and problem.qlen > 1,
                     inputs.softmax_scale, q.dtype, cache_.dtype)
        return wrapper


FLASHINFER_ROUTES = (FlashInferRoute("fa3"), FlashInferRoute("fa2"))
