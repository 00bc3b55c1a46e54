"""The engine-agnostic adapter: what an engine's MLA decode backend calls.

An engine describes its model once (``ServedModel``), asks ``refusal`` when it validates
its configuration (None: mlatune serves it; else a reason, and the engine falls back to
its own backend), loads one ``MLADecoder`` at model load and then, every step:

    decoder.begin_step(block_table, seq_lens, qlen=qlen, max_kv_len=capacity)
    for layer in layers:
        out, lse = decoder.forward(q, kv_cache, kv_scale=..., out=..., lse_out=...)

The first ``forward`` of a step plans it (``attention.decode``); the other layers read
that plan (``reuse_plan``) and pay their launch alone. The LSE always comes back: with
DCP the outputs are this rank's partials, which the engine merges by it. On a GPU only
routes whose whole step replays from a CUDA graph are served, in eager calls too, so an
eager warm-up makes the very step a capture then records; ``forward`` never synchronises
(the engine gives ``max_kv_len``: the bucket's capacity, or the step's longest length).

``routes_served`` counts ``forward`` calls per route, eager or captured; a graph's replays
call no Python and are not counted. ``captured`` names the route each (batch, qlen) bucket
captured last, and ``summary()`` says both in one line.
"""

from __future__ import annotations

import collections
import itertools
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from mlatune import attention, routes
from mlatune.arch import DeviceInfo, current_device, device_info
from mlatune.capability import tables as capability_tables
from mlatune.check.policy import Policy, policy_named
from mlatune.dispatch import Dispatcher
from mlatune.dispatch.dispatcher import TABLE_ENV, USER_TABLE_ENV
from mlatune.errors import DecodeArgumentError
from mlatune.problem import DTYPE_NAMES, DTYPES, MLAProblem
from mlatune.routes.torch_ref import REFERENCE_ID
from mlatune.runtime_checks import softmax_scale_fault

_LOG = logging.getLogger("mlatune")
_MOST_REASONS = 3  # a refusal names this many distinct route refusals, the commonest first


@dataclass(frozen=True)
class ServedModel:
    """What one model asks of its attention decode, on one rank."""

    num_heads: int  # query heads per rank (after TP), before the DCP all-gather
    softmax_scale: float  # the model's own (YaRN mscale included)
    q_dtype: torch.dtype  # bfloat16 / float16 (an fp8 q only where a route serves it)
    kv_cache_dtype: torch.dtype  # bfloat16 / float16, or float8_e4m3fn
    page_size: int
    num_layers: int
    kv_lora_rank: int = 512
    rope_dim: int = 64
    dcp_size: int = 1
    dcp_rank: int = 0
    max_qlen: int = 1  # > 1 for speculative verify (one qlen for every request of a step)


def refusal(model: ServedModel) -> str | None:
    """Why mlatune cannot serve ``model`` on this machine's device (None: it can), in a
    plain sentence: its fields, then, for every qlen up to ``max_qlen``, whether a route
    (the torch reference aside) supports it here, takes empty requests, is capturable on
    a GPU and rounds only as the accuracy policy (``MLATUNE_ACCURACY``) admits."""
    reason = _field_refusal(model)
    if reason is not None:
        return reason
    try:
        policy = policy_named(None)
    except ValueError as exc:  # a bad MLATUNE_ACCURACY, named
        return str(exc)
    device = current_device()
    for qlen in range(1, model.max_qlen + 1):
        try:
            problem = _problem(model, qlen)
        except ValueError as exc:
            return str(exc).removeprefix("invalid MLAProblem: ")
        reason = _unserved(problem, device, policy)
        if reason is not None:
            return reason
    return None


def _problem(model: ServedModel, qlen: int, batch: int = 1, kv_len: int = 4096
               ) -> MLAProblem:
    """The decode problem ``model`` poses at ``qlen`` (a ValueError where it is none)."""
    return MLAProblem(phase="decode", num_heads=model.num_heads, qlen=qlen,
                      q_dtype=DTYPE_NAMES[model.q_dtype],
                      kv_dtype=DTYPE_NAMES[model.kv_cache_dtype], batch=batch,
                      kv_len=max(kv_len, qlen), dcp_size=model.dcp_size,
                      page_size=model.page_size, kv_lora_rank=model.kv_lora_rank,
                      rope_dim=model.rope_dim)


def _field_refusal(model: ServedModel) -> str | None:
    """What no route is asked about: the dtypes mlatune has names for, MLA's head layout,
    the counts, the DCP rank, the scale."""
    served = ", ".join(str(d).removeprefix("torch.") for d in DTYPES.values())
    for what, dtype in (("q dtype", model.q_dtype), ("kv cache dtype", model.kv_cache_dtype)):
        if dtype not in DTYPE_NAMES:
            return f"{what} {dtype}: mlatune serves {served}"
    d_qk, d_v = model.kv_lora_rank + model.rope_dim, model.kv_lora_rank
    if (d_qk, d_v) != capability_tables.MLA_DECODE_DIMS:
        want_qk, want_v = capability_tables.MLA_DECODE_DIMS
        return (f"head dim {d_qk} = {d_v} latent + {model.rope_dim} rope: mlatune serves MLA "
                f"decode at {want_qk} = {want_v} + {want_qk - want_v} only")
    for name in ("num_heads", "page_size", "num_layers", "max_qlen", "dcp_size"):
        value = getattr(model, name)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            return f"{name} must be a positive integer, got {value!r}"
    if not 0 <= model.dcp_rank < model.dcp_size:
        return f"dcp rank {model.dcp_rank} is not one of 0..{model.dcp_size - 1}"
    fault = softmax_scale_fault(model.softmax_scale)  # what decode takes, no more or less
    return None if fault is None else f"softmax scale {fault}"


def _unserved(problem: MLAProblem, device: DeviceInfo, policy: Policy) -> str | None:
    """None where a route serves ``problem`` on ``device`` as ``MLADecoder`` calls it; else
    the reasons of this device's decode routes (those that serve a plain 16-head decode
    here; every route's where none does), grouped, the commonest first."""
    candidates = [r for r in routes.all_routes() if r.id != REFERENCE_ID]  # never an engine's
    refused: dict[str, str] = {}
    for route in candidates:
        why = _why_not(route, problem, device, policy)
        if why is None:
            return None
        refused[route.id] = why
    plain = [MLAProblem(q_dtype=d, kv_dtype=d) for d in ("bf16", "fp16")]
    here = {r.id for r in candidates
            if any(_why_not(r, p, device, policy) is None for p in plain)} or set(refused)
    reasons: dict[str, list[str]] = {}
    for route_id, why in refused.items():
        if route_id in here:
            reasons.setdefault(why, []).append(route_id)
    ranked = sorted(reasons.items(), key=lambda item: -len(item[1]))
    said = "; ".join(f"{', '.join(ids)}: {why}" for why, ids in ranked[:_MOST_REASONS])
    more = len(ranked) - _MOST_REASONS
    return (f"no mlatune route serves {problem.bucket_label} on {device.name}: {said}"
            + (f" (and {more} other reasons)" if more > 0 else ""))


def _why_not(route: routes.Route, problem: MLAProblem, device: DeviceInfo, policy: Policy
             ) -> str | None:
    """Why ``route`` cannot serve ``problem`` for an engine (None: it can), as the
    dispatcher's rule answer runs it: its default parameters."""
    try:
        verdict = route.supports(problem, device)
        if not verdict:
            return verdict.reason
        if device.is_gpu and not routes.step_kind_of(route, {}).capturable:
            return "its step is planned on the host, so no CUDA graph replays it"
        if not route.serves_empty(problem, {}):
            return "it does not serve empty requests (graph buckets pad with them)"
        rounds = routes.rounding(route, problem)
    except Exception as exc:  # a broken route refuses, as the dispatcher takes it
        return f"it raised {type(exc).__name__}: {exc}"
    if not policy.admits_class(problem.q_dtype, rounds):
        return f"it rounds beyond the dtypes ({rounds}), which accuracy {policy.name} holds back"
    return None


@dataclass
class _Step:
    """One engine step's lengths, and the route its first layer planned (None: not yet)."""

    block_table: torch.Tensor
    seq_lens: torch.Tensor
    qlen: int
    max_kv_len: int
    route: str | None = None


def uniform_qlen(query_starts: Any, requests: int, tokens: int) -> int:
    """The one query length of a step's ``requests`` leading decode requests (``tokens``
    rows, request-major, as the engine's own decode kernels read them), checked against the
    engine's host copy of the query offsets (``requests + 1`` leading entries): each
    request's length is it, or 0 for an empty slot (a CUDA graph's padding, whose rows are
    still counted in ``tokens``). ValueError otherwise."""
    qlen, rest = divmod(tokens, requests) if requests > 0 else (0, 1)
    starts = [int(s) for s in query_starts[:requests + 1]]
    lens = [b - a for a, b in itertools.pairwise(starts)]
    if rest or len(lens) != requests or not set(lens) <= {0, qlen}:
        shown = lens if len(lens) <= 8 else [*lens[:8], "..."]
        raise ValueError(f"mlatune: {requests} decode requests of {tokens} rows are not one "
                         f"query length each (lengths {shown}; 0: an empty slot); a step's "
                         f"decodes serve one qlen")
    return qlen


def rank_group(coordinator: Any) -> Any:
    """The CPU process group of an engine's tensor-parallel ranks (vLLM's and SGLang's
    ``GroupCoordinator``: ``cpu_group``, ``world_size``), which run each attention layer
    together (DCP ranks among them) and so must serve one route; None for one rank."""
    return coordinator.cpu_group if coordinator.world_size > 1 else None


class MLADecoder:
    """MLA decode for one model's attention layers (one per model and rank; all its layers
    share it): the dispatcher, this step's lengths, and what was served."""

    def __init__(self, model: ServedModel, dispatcher: Dispatcher, device: torch.device,
                 engine: str = "engine"):
        self.model, self.dispatcher, self.device, self.engine = model, dispatcher, device, engine
        self.routes_served: collections.Counter[str] = collections.Counter()
        self.captured: dict[tuple[int, int], str] = {}  # (batch, qlen) -> route captured
        self._step: _Step | None = None

    @classmethod
    def load(cls, model: ServedModel, *, device: torch.device | str,
             dispatcher: Dispatcher | None = None, engine: str = "engine",
             log: logging.Logger = _LOG, group: Any = None) -> MLADecoder:
        """The decoder for ``model`` on ``device``: the dispatcher given, else
        ``Dispatcher.from_bundled`` for this GPU with ``plan_calls`` = the model's layers
        (``MLATUNE_TABLE`` and ``MLATUNE_USER_TABLE`` honoured; on a GPU, ranking the
        capturable steps), agreed across ``group``'s ranks (``rank_group``: those that
        serve a layer together; every one of them loads at once); one INFO line on ``log``
        says the table, where it came from, the GPU model and the accuracy policy."""
        device = torch.device(device)
        info = device_info(device)
        given = dispatcher is not None
        if dispatcher is None:
            dispatcher = Dispatcher.from_bundled(info, capturable=info.is_gpu,
                                                 plan_calls=model.num_layers, group=group)
        log.info("mlatune: %s MLA decode: table %s (%s)%s; GPU %s (%s); accuracy %s; "
                 "%d layers plan once a step", engine, dispatcher.source or "none",
                 _table_source(dispatcher, given), _measured_on(dispatcher), info.name,
                 info.arch, dispatcher.accuracy.name, model.num_layers)
        return cls(model, dispatcher, device, engine)

    def begin_step(self, block_table: torch.Tensor, seq_lens: torch.Tensor, *, qlen: int,
                   max_kv_len: int) -> None:
        """This step's block table (this rank's pages) and int32 global lengths, the new
        tokens included (0: a padded empty slot), written in place by the engine; the
        next ``forward`` plans from them and the step's other layers reuse that plan."""
        if isinstance(qlen, bool) or not isinstance(qlen, int) \
                or not 1 <= qlen <= self.model.max_qlen:
            raise DecodeArgumentError(f"qlen: {qlen!r} is not one of 1..{self.model.max_qlen} "
                                      f"(ServedModel.max_qlen)")
        self._step = _Step(block_table, seq_lens, qlen, max_kv_len)

    def forward(self, q: torch.Tensor, kv_cache: torch.Tensor, *,
                out: torch.Tensor | None = None, lse_out: torch.Tensor | None = None,
                kv_scale: torch.Tensor | None = None, q_scale: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """One layer: q (batch * qlen, num_heads * dcp_size, 576) request-major over this
        rank's cache (pages, page_size, 576) or (pages, page_size, 1, 576); returns out
        (batch * qlen, heads, 512) and the fp32 natural-log LSE (batch * qlen, heads),
        written into ``out`` / ``lse_out`` when given (else the step's own buffers, which
        the layer's next call overwrites). fp8 tensors take their per-tensor scales."""
        step = self._step
        if step is None:
            raise RuntimeError("MLADecoder.forward before begin_step: give the step's "
                               "block table and lengths first")
        m = self.model
        out, lse = attention.decode(
            q, kv_cache, step.block_table, step.seq_lens, num_heads=m.num_heads,
            qlen=step.qlen, kv_scale=kv_scale, q_scale=q_scale, softmax_scale=m.softmax_scale,
            out=out, lse_out=lse_out, dcp_rank=m.dcp_rank, dcp_size=m.dcp_size,
            max_kv_len=step.max_kv_len, kv_lora_rank=m.kv_lora_rank, return_lse=True,
            capturable=q.is_cuda, reuse_plan=step.route is not None,
            dispatcher=self.dispatcher)
        if step.route is None:  # the other layers run the planning step's route
            ran = attention.last_step(self.dispatcher)
            step.route = ran.route.id if ran is not None else "unknown"
        self.routes_served[step.route] += 1
        if q.is_cuda and torch.cuda.is_current_stream_capturing():
            self.captured[(step.seq_lens.shape[0], step.qlen)] = step.route
        return out, lse

    def summary(self) -> str:
        """One line: forward calls per route so far, and the route each bucket captured."""
        served = ", ".join(f"{r} {n}" for r, n in self.routes_served.most_common())
        line = f"mlatune ({self.engine}): forward calls by route: {served or 'none yet'}"
        if self.captured:
            line += "; graphs captured: " + ", ".join(
                f"batch {b} qlen {q} {r}" for (b, q), r in sorted(self.captured.items()))
        return line + " (graph replays are not counted)"


def _table_source(dispatcher: Dispatcher, given: bool) -> str:
    """Where the dispatcher's table came from: given, MLATUNE_TABLE, bundled, user, none."""
    if given:
        return "the engine's dispatcher"
    if not dispatcher.source:
        return "no table for this GPU: routes chosen by rule"
    overlaid = f" + user table ({USER_TABLE_ENV})" if " + " in dispatcher.source else ""
    if os.environ.get(TABLE_ENV):
        return TABLE_ENV + overlaid
    user = os.environ.get(USER_TABLE_ENV)
    if user and Path(dispatcher.source).resolve() == Path(user).resolve():
        return f"user table ({USER_TABLE_ENV}), no bundled table for this GPU"
    return "bundled" + overlaid


def _measured_on(dispatcher: Dispatcher) -> str:
    device = dispatcher.table_device
    return "" if device is None else f", measured on {device[1]}"
