"""``sdpa/torch``: prefill through torch's scaled_dot_product_attention.

The baseline a serving engine gets for free. SDPA takes dense (batch, heads,
tokens, dim) tensors, so the varlen batch is cut into runs of consecutive
requests with equal (query, key) lengths; each run is one call on a strided
view of the packed tensors (no copies in), so a uniform batch is one call and a
ragged one is about one call per request. A request with a prefix needs
bottom-right causal alignment, which SDPA takes as a ``causal_lower_right``
bias; without a prefix plain ``is_causal`` is the same mask.

Which of SDPA's backends can serve q/k of 192 and v of 128 depends on the
device and the torch build (flash wants equal q and v widths; cuDNN and the
memory-efficient kernel may not), so prepare tries them in order of expected
speed, keeps the first that runs, and records it as ``sdpa_backend``. Params
may name one backend to force it. SDPA's public API returns no LSE: this route
gives none.

Over an fp8 K/V (with a bf16 or fp16 q) each call first dequantizes K and V
into q's dtype, as an engine without an fp8 prefill kernel would; that pass is
part of the timed call (recorded as ``kv_dequant``).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from mlatune.arch import DeviceInfo
from mlatune.check.inputs import DecodeInputs, PrefillInputs
from mlatune.problem import MLAProblem
from mlatune.routes.base import HOST_PLANNED, Params, Prepared, Route, StepKind, Verdict
from mlatune.routes.triton_support import ruled

# Fastest first where several serve (cuDNN and flash are Hopper-tuned); math is the fallback.
BACKENDS: dict[str, SDPBackend] = {
    "cudnn": SDPBackend.CUDNN_ATTENTION,
    "flash": SDPBackend.FLASH_ATTENTION,
    "efficient": SDPBackend.EFFICIENT_ATTENTION,
    "math": SDPBackend.MATH,
}


def _runs(q_lens: list[int], k_lens: list[int]) -> list[tuple[int, int, int, int, int]]:
    """Runs of consecutive requests with equal lengths: (q_row0, k_row0, count, q_len, k_len)."""
    runs: list[list[int]] = []
    q_row = k_row = 0
    for q_len, k_len in zip(q_lens, k_lens, strict=True):
        if runs and runs[-1][3:] == [q_len, k_len]:
            runs[-1][2] += 1
        else:
            runs.append([q_row, k_row, 1, q_len, k_len])
        q_row += q_len
        k_row += k_len
    return [tuple(r) for r in runs]  # type: ignore[misc]


def _batched(x: torch.Tensor, row0: int, count: int, length: int) -> torch.Tensor:
    """Rows [row0, row0 + count * length) of a packed (rows, heads, d) tensor as
    a (count, heads, length, d) view."""
    rows = x[row0:row0 + count * length]
    return rows.view(count, length, *x.shape[1:]).transpose(1, 2)


def _first_serving_backend(calls: list[Callable[[], None]], wanted: str | None) -> str:
    """Run the calls under each backend in turn (or only ``wanted``); the first that runs."""
    if wanted is not None and wanted not in BACKENDS:
        raise ValueError(f"sdpa_backend must be one of {sorted(BACKENDS)}, got {wanted!r}")
    errors = []
    for name in [wanted] if wanted else BACKENDS:
        try:
            with sdpa_kernel(BACKENDS[name]), warnings.catch_warnings():
                warnings.simplefilter("ignore")  # each refusing backend warns why
                for call in calls:
                    call()
        except RuntimeError as exc:  # this backend cannot serve the shape here
            errors.append(f"{name}: {str(exc).splitlines()[0]}")
            continue
        return name
    raise RuntimeError("no SDPA backend serves this problem: " + "; ".join(errors))


class SdpaPrefillRoute(Route):
    id = "sdpa/torch"

    def supports(self, problem: MLAProblem, device: DeviceInfo) -> Verdict:
        """The capability rules (capability.rules, ``sdpa/torch``): torch is always here."""
        return ruled(self.id, problem, device)

    def param_space(self, problem: MLAProblem, device: DeviceInfo) -> list[Params]:
        return [{}]  # the backend is found by trying, in prepare

    def step_kind(self, params: Params) -> StepKind:
        return HOST_PLANNED  # runs of equal lengths are cut on the host

    def prepare(self, problem: MLAProblem, inputs: DecodeInputs | PrefillInputs, *,
                rank: int = 0, params: Params | None = None,
                want_lse: bool = True) -> Prepared:
        if not isinstance(inputs, PrefillInputs):
            raise TypeError(f"{self.id} takes PrefillInputs, got {type(inputs).__name__}")
        out = torch.empty(inputs.q.shape[0], problem.num_heads, problem.d_v,
                          dtype=inputs.q.dtype, device=inputs.q.device)
        k, v, dequantize = inputs.k, inputs.v, None
        if inputs.k.dtype != inputs.q.dtype:  # fp8 K/V: into q's dtype, every call
            k = torch.empty_like(inputs.k, dtype=inputs.q.dtype)
            v = torch.empty_like(inputs.v, dtype=inputs.q.dtype)

            def dequantize() -> None:
                for dst, src, scale in ((k, inputs.k, inputs.k_scale),
                                        (v, inputs.v, inputs.v_scale)):
                    dst.copy_(src)
                    if scale is not None:
                        dst.mul_(scale)

            dequantize()
        calls = self._calls(problem, inputs.q, k, v, inputs, out)
        name = _first_serving_backend(calls, (params or {}).get("sdpa_backend"))
        backend = BACKENDS[name]

        def run() -> None:
            if dequantize is not None:
                dequantize()
            with sdpa_kernel(backend):
                for call in calls:
                    call()

        ran_with = {"sdpa_backend": name, "sdpa_calls": len(calls)}
        if dequantize is not None:
            ran_with["kv_dequant"] = problem.q_dtype
        return Prepared(run, out, None, graph_safe=True, params=ran_with,
                        plan_reads_lengths=True)  # runs of equal lengths, cut on the host

    @staticmethod
    def _calls(problem: MLAProblem, q_all: torch.Tensor, k_all: torch.Tensor,
               v_all: torch.Tensor, inputs: PrefillInputs,
               out: torch.Tensor) -> list[Callable[[], None]]:
        """One closure per run of equal-length requests; each writes its rows of ``out``."""
        q_lens = inputs.cu_seqlens_q.diff().tolist()
        k_lens = inputs.cu_seqlens_k.diff().tolist()
        calls = []
        for q_row0, k_row0, count, q_len, k_len in _runs(q_lens, k_lens):
            q = _batched(q_all, q_row0, count, q_len)
            k = _batched(k_all, k_row0, count, k_len)
            v = _batched(v_all, k_row0, count, k_len)
            dst = _batched(out, q_row0, count, q_len)
            mask = None
            is_causal = problem.causal and q_len == k_len
            if problem.causal and q_len != k_len:
                # Imported here: the module pulls in torch._dynamo (and triton), a second
                # of import time a dispatcher-only process would pay for nothing.
                from torch.nn.attention.bias import causal_lower_right

                mask = causal_lower_right(q_len, k_len)

            def call(q=q, k=k, v=v, dst=dst, mask=mask, is_causal=is_causal) -> None:
                dst.copy_(F.scaled_dot_product_attention(
                    q, k, v, attn_mask=mask, is_causal=is_causal, scale=inputs.softmax_scale))

            calls.append(call)
        return calls
