"""mlatune's MLA decode backend for SGLang (``--decode-attention-backend mlatune``).

SGLang builds it from the loaded model (``create_backend``). Every step the engine calls
``init_forward_metadata`` (eager) or, for its CUDA graphs, ``init_cuda_graph_state`` once
and then ``init_forward_metadata_in_graph`` inside each capture, which the graph replays;
the backend writes the step's block table and lengths into persistent buffers there and
hands them to ``MLADecoder.begin_step``. Each layer's ``forward_decode`` (and
``forward_extend`` for a speculative verify, one draft length for every request) writes
the new tokens' latent KV into SGLang's pool and calls ``MLADecoder.forward``: the first
layer of a step plans, the others reuse its plan.

q, the output and the LSE live in persistent buffers too, so every layer and every step
of a batch size finds the step mlatune prepared for it, eagerly and in a graph. Padded
graph slots are served as empty requests (``get_cuda_graph_seq_len_fill_value`` is 0).
A verify step's requests must share their draft length (EAGLE's chain, topk 1).
"""

from __future__ import annotations

import logging
import math
import os
from dataclasses import dataclass

import torch

from mlatune.integrations.sglang import BACKEND_NAME, INSTALL_HINT
from mlatune.integrations.sglang.metadata import (
    fill_block_table,
    fill_seq_lens,
    pages_per_row,
)

try:
    from sglang.srt.layers.attention.attention_registry import ATTENTION_BACKENDS
    from sglang.srt.layers.attention.base_attn_backend import AttentionBackend
    from sglang.srt.mem_cache.memory_pool import KVWriteLoc
    from sglang.srt.runtime_context import get_parallel, get_spec
except ImportError as exc:
    raise ImportError(INSTALL_HINT) from exc

from mlatune.integrations.core import MLADecoder, ServedModel, rank_group, refusal

FALLBACK_ENV = "MLATUNE_SGLANG_FALLBACK"  # SGLang backend serving what mlatune cannot, or none
# SGLang's MLA models send an unlisted backend's decode down triton's path, q whole.
DEFAULT_FALLBACK = "triton"
_LOG = logging.getLogger(__name__)


def create_backend(runner) -> AttentionBackend:
    """mlatune's backend for the model ``runner`` loaded; where mlatune cannot serve it,
    one warning names the reason and SGLang's ``MLATUNE_SGLANG_FALLBACK`` backend (triton
    by default) serves the decode instead, or, with ``none``, a ValueError refuses it."""
    reason, model = served_model(runner)
    if reason is None:
        reason = refusal(model)
    if reason is not None:
        return _fallback(runner, reason)
    decoder = MLADecoder.load(model, device=runner.device, engine="SGLang", log=_LOG,
                              group=_tp_group())
    return MLATuneBackend(runner, model, decoder)


def _tp_group():
    """SGLang's tensor-parallel ranks' CPU group (``rank_group``); None for one rank, whose
    groups SGLang may not have built."""
    from sglang.srt.distributed.parallel_state import get_tp_group

    if get_parallel().tp_size <= 1:
        return None
    return rank_group(get_tp_group())


def served_model(runner) -> tuple[str | None, ServedModel | None]:
    """What the model ``runner`` loaded asks of its decode, or why this SGLang setup is
    one mlatune's backend cannot take (whatever ``refusal`` would say aside)."""
    parallel, spec = get_parallel(), get_spec()
    reason = _setup_refusal(runner, parallel, spec)
    if reason is not None:
        return reason, None
    scales = _softmax_scales(runner)
    if len(scales) != 1:
        return f"its attention layers differ in softmax scale ({sorted(scales)})", None
    config = runner.model_config
    return None, ServedModel(
        num_heads=config.num_attention_heads // parallel.attn_tp_size,
        softmax_scale=scales.pop(), q_dtype=runner.dtype,
        kv_cache_dtype=runner.kv_cache_dtype, page_size=runner.page_size,
        num_layers=runner.token_to_kv_pool.layer_num, kv_lora_rank=config.kv_lora_rank,
        rope_dim=config.qk_rope_head_dim, max_qlen=max(1, spec.speculative_num_draft_tokens or 1))


def _setup_refusal(runner, parallel, spec) -> str | None:
    """Why SGLang's setup routes to this backend what it does not serve (None: it does not)."""
    if not runner.use_mla_backend:
        return "the model does not use MLA"
    if runner.prefill_attention_backend_str == BACKEND_NAME:
        return (f"{BACKEND_NAME} serves decode only: select it with --decode-attention-backend "
                f"{BACKEND_NAME} and keep a prefill backend")
    if parallel.attn_dcp_size > 1:
        return ("with --dcp-size > 1 SGLang's MLA models send decode only to the backends they "
                "list, with a cyclic KV layout mlatune's SGLang backend does not read yet")
    if (spec.speculative_eagle_topk or 1) > 1:
        return ("a speculative token tree (--speculative-eagle-topk > 1) needs a custom mask; "
                "mlatune verifies one draft chain per request")
    if getattr(runner.kv_index_translator, "reads_are_translated", False):
        return "the unified KV pool translates page ids, which mlatune does not"
    return None


def _softmax_scales(runner) -> set[float]:
    """The softmax scales of the model's MLA attention layers (the model config's where
    the runner holds no model)."""
    from sglang.srt.layers.radix_attention import RadixAttention

    config = runner.model_config
    latent = config.kv_lora_rank + config.qk_rope_head_dim
    model = getattr(runner, "model", None)
    scales = {float(m.scaling) for m in (model.modules() if model is not None else ())
              if isinstance(m, RadixAttention) and m.qk_head_dim == latent}
    return scales or {float(config.scaling)}


def _fallback(runner, reason: str) -> AttentionBackend:
    """SGLang's fallback backend for what mlatune cannot serve, or the refusal."""
    name = os.environ.get(FALLBACK_ENV, DEFAULT_FALLBACK)
    if name == "none" or name == BACKEND_NAME:
        raise ValueError(f"{BACKEND_NAME} cannot serve this model's decode: {reason}")
    if name not in ATTENTION_BACKENDS:
        raise ValueError(f"{FALLBACK_ENV}={name!r} is not an SGLang attention backend "
                         f"(mlatune cannot serve this model's decode: {reason})")
    _LOG.warning("%s cannot serve this model's decode: %s; SGLang's %s backend serves it "
                 "(%s=none refuses instead)", BACKEND_NAME, reason, name, FALLBACK_ENV)
    return ATTENTION_BACKENDS[name](runner)


@dataclass
class StepBuffers:
    """One set of persistent step tensors: the block table and lengths a step is planned
    from, and q, the output and the LSE every layer's call reads and writes."""

    block_table: torch.Tensor  # (requests, pages of a req_to_token row) int32
    seq_lens: torch.Tensor  # (requests,) int32
    q: torch.Tensor  # (tokens, heads, kv_lora_rank + rope_dim)
    out: torch.Tensor  # (tokens, heads, kv_lora_rank)
    lse: torch.Tensor  # (tokens, heads) float32

    @classmethod
    def allocate(cls, model: ServedModel, requests: int, tokens: int, pages: int,
                 device: torch.device | str) -> StepBuffers:
        heads, latent = model.num_heads, model.kv_lora_rank
        return cls(
            block_table=torch.zeros(requests, pages, dtype=torch.int32, device=device),
            seq_lens=torch.zeros(requests, dtype=torch.int32, device=device),
            q=torch.zeros(tokens, heads, latent + model.rope_dim, dtype=model.q_dtype,
                          device=device),
            out=torch.zeros(tokens, heads, latent, dtype=model.q_dtype, device=device),
            lse=torch.zeros(tokens, heads, dtype=torch.float32, device=device))

    def holds(self, requests: int, tokens: int) -> bool:
        return self.seq_lens.shape[0] >= requests and self.q.shape[0] >= tokens


@dataclass
class StepMetadata:
    """The step the next layer calls serve: ``requests`` rows of ``buffers``, ``qlen``
    tokens each."""

    buffers: StepBuffers
    requests: int
    qlen: int


class MLATuneBackend(AttentionBackend):
    """SGLang's attention backend interface over one ``MLADecoder`` (all layers)."""

    def __init__(self, runner, model: ServedModel, decoder: MLADecoder):
        self.model, self.decoder = model, decoder
        self.device = runner.device
        self.token_to_kv_pool = runner.token_to_kv_pool
        self.req_to_token = runner.req_to_token_pool.req_to_token
        self.kv_index_translator = getattr(runner, "kv_index_translator", None)
        self.data_type = self.kv_cache_dtype = runner.kv_cache_dtype
        self.page_size = model.page_size
        self.pages = pages_per_row(self.req_to_token.shape[1], self.page_size)
        self.capacity = self.req_to_token.shape[1]  # the longest request a row holds
        self.is_fp8_cache = model.kv_cache_dtype.itemsize == 1
        spec = get_spec()
        self.draft_tokens = spec.speculative_num_draft_tokens or 0
        # With verify on the prefill backend SGLang's decode graphs pad for that backend,
        # which, as every SGLang backend does, takes 1; this backend's padded slots are 0.
        verify_elsewhere = spec.speculative_algorithm is not None \
            and spec.speculative_attention_mode != "decode"
        self.seq_len_fill_value = 1 if verify_elsewhere else 0
        self.graph_buffers: StepBuffers | None = None
        self.eager_buffers: StepBuffers | None = None
        self.forward_metadata: StepMetadata | None = None
        self._kv_scales: dict[int, torch.Tensor] = {}
        self._routes_logged: set[str] = set()

    # -- per-step metadata ------------------------------------------------------------------

    def init_forward_metadata(self, forward_batch) -> None:
        """An eager step: its block table and lengths into the eager buffers (grown when a
        batch outgrows them), planned for its longest request where SGLang mirrors the
        lengths on the host (the row capacity where it does not)."""
        requests, qlen, new_tokens = self._shape(forward_batch)
        if requests == 0:
            return
        buffers = self.eager_buffers
        if buffers is None or not buffers.holds(requests, requests * qlen):
            buffers = self.eager_buffers = StepBuffers.allocate(
                self.model, requests, requests * qlen, self.pages, self.device)
        lens_cpu = forward_batch.seq_lens_cpu
        max_kv_len = (int(lens_cpu[:requests].max()) + new_tokens if lens_cpu is not None
                      else self.capacity)
        self._fill(buffers, forward_batch, requests, new_tokens)
        self._begin(buffers, requests, qlen, max_kv_len)

    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int) -> None:
        """The graph buffers, once, for every batch bucket SGLang captures."""
        self.graph_buffers = StepBuffers.allocate(self.model, max_bs, max_num_tokens,
                                                  self.pages, self.device)

    def init_forward_metadata_out_graph(self, forward_batch, in_capture: bool = False) -> None:
        """Nothing: a graph step's metadata is written inside the graph (the in-graph hook)."""

    def init_forward_metadata_in_graph(self, forward_batch) -> None:
        """Inside each warm-up and capture of a batch bucket (a replay repeats the device
        part): the step's block table and lengths into the graph buffers, written in place,
        and a new step whose first layer plans, planned for the row capacity."""
        requests, qlen, new_tokens = self._shape(forward_batch)
        if requests == 0:
            return
        self._fill(self.graph_buffers, forward_batch, requests, new_tokens)
        self._begin(self.graph_buffers, requests, qlen, self.capacity)

    def get_cuda_graph_seq_len_fill_value(self) -> int:
        return self.seq_len_fill_value

    def _shape(self, forward_batch) -> tuple[int, int, int]:
        """(requests, query tokens per request, tokens the lengths leave out) of a step."""
        if forward_batch.forward_mode.is_target_verify():
            return forward_batch.batch_size, self.draft_tokens, self.draft_tokens
        if forward_batch.forward_mode.is_decode_or_idle():
            return forward_batch.batch_size, 1, 0
        raise NotImplementedError(
            f"{BACKEND_NAME} serves decode and speculative verify, not "
            f"{forward_batch.forward_mode.name}: SGLang's prefill backend serves it")

    def _fill(self, buffers: StepBuffers, forward_batch, requests: int, new_tokens: int
              ) -> None:
        fill_block_table(self.req_to_token, forward_batch.req_pool_indices[:requests],
                         self.page_size, buffers.block_table)
        fill_seq_lens(forward_batch.seq_lens[:requests], new_tokens, buffers.seq_lens)

    def _begin(self, buffers: StepBuffers, requests: int, qlen: int, max_kv_len: int) -> None:
        self.forward_metadata = StepMetadata(buffers, requests, qlen)
        self.decoder.begin_step(buffers.block_table[:requests], buffers.seq_lens[:requests],
                                qlen=qlen, max_kv_len=max_kv_len)

    # -- per-layer calls --------------------------------------------------------------------

    def forward_decode(self, q, k, v, layer, forward_batch, save_kv_cache: bool = True,
                       **kwargs):
        return self._attend(q, k, v, layer, forward_batch, save_kv_cache, **kwargs)

    def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache: bool = True,
                       **kwargs):
        """A speculative verify (the only extend SGLang routes to a decode backend)."""
        self._shape(forward_batch)  # refuses anything else by name
        return self._attend(q, k, v, layer, forward_batch, save_kv_cache, **kwargs)

    def _attend(self, q, k, v, layer, forward_batch, save_kv_cache, q_rope=None, k_rope=None,
                return_lse: bool = False, **_):
        """One layer: the new tokens' KV into the pool, then mlatune's decode over it.
        Takes q whole (heads x 576) or, from a model that passes them apart, the latent
        part with ``q_rope`` (and ``k_rope``)."""
        if save_kv_cache and k is not None:
            self._save_kv(layer, forward_batch, k, v, k_rope)
        if not math.isclose(layer.scaling, self.model.softmax_scale, rel_tol=1e-6):
            raise ValueError(f"layer {layer.layer_id}: softmax scale {layer.scaling} is not "
                             f"the model's {self.model.softmax_scale} that mlatune serves")
        step, heads = self.forward_metadata, self.model.num_heads
        tokens = step.requests * step.qlen
        q_step = step.buffers.q[:tokens]
        if q_rope is None:
            q_step.copy_(q.reshape(tokens, heads, -1))
        else:
            q_step[..., : self.model.kv_lora_rank].copy_(q.reshape(tokens, heads, -1))
            q_step[..., self.model.kv_lora_rank:].copy_(q_rope.reshape(tokens, heads, -1))
        out, lse = self.decoder.forward(
            q_step, self._kv_cache(layer), out=step.buffers.out[:tokens],
            lse_out=step.buffers.lse[:tokens], kv_scale=self._kv_scale(layer))
        self._log_new_routes()
        out = out.view(tokens, heads * self.model.kv_lora_rank)
        return (out, lse) if return_lse else out

    def _save_kv(self, layer, forward_batch, k, v, k_rope) -> None:
        """The new tokens' latent KV into SGLang's pool at the batch's slots: divided by
        the layer's k_scale into an fp8 pool, whose reads multiply by it."""
        scale = layer.k_scale if self.is_fp8_cache else None
        loc = KVWriteLoc.for_batch(forward_batch)
        if k_rope is None:
            k = k if scale is None else k / scale
            self.token_to_kv_pool.set_kv_buffer(layer, loc, k, v)
        else:
            if scale is not None:
                k, k_rope = k / scale, k_rope / scale
            self.token_to_kv_pool.set_mla_kv_buffer(layer, loc, k, k_rope)

    def _kv_cache(self, layer) -> torch.Tensor:
        """The layer's pool as mlatune's paged cache: (pages, page_size, 1, 576), a view."""
        slots = self.token_to_kv_pool.get_key_buffer(layer.layer_id)
        pages = slots.shape[0] // self.page_size
        return slots[: pages * self.page_size].view(pages, self.page_size, *slots.shape[1:])

    def _kv_scale(self, layer) -> torch.Tensor | None:
        """An fp8 pool's per-tensor scale for the layer (1 without one), one tensor per
        layer for the backend's life, so the layer's step finds it again."""
        if not self.is_fp8_cache:
            return None
        scale = self._kv_scales.get(layer.layer_id)
        if scale is None:
            given = layer.k_scale
            scale = (torch.ones(1, dtype=torch.float32, device=self.device) if given is None
                     else given.detach().to(torch.float32).reshape(1))
            self._kv_scales[layer.layer_id] = scale
        return scale

    def _log_new_routes(self) -> None:
        """One log line the first time each route serves a call (counts: ``decoder``)."""
        served = self.decoder.routes_served
        if len(served) > len(self._routes_logged):
            for route in served.keys() - self._routes_logged:
                _LOG.info("%s: SGLang decode served by route %s; %s", BACKEND_NAME, route,
                          self.decoder.summary())
            self._routes_logged = set(served)
