"""vLLM's MLA backend classes over ``mlatune.integrations.core``: vLLM runs its own MLA
layer (projections, cache writes, prefill, the DCP combine) and hands mlatune the decode.

- ``MLATuneBackend`` declares what vLLM may select it for; its ``supports_combination``
  asks ``core.refusal`` about the model vLLM is configuring, so what mlatune cannot serve
  is refused with mlatune's reason when vLLM validates the configuration.
- ``MLATuneMetadataBuilder`` loads one ``MLADecoder`` per KV-cache group (its layers share
  it: one log line at model load) and, at every step's metadata, gives it the step's block
  table and global lengths (``begin_step``): the first layer's decode plans, the others
  reuse that plan. Uniform-batch CUDA graphs, speculative verify included.
- ``MLATuneImpl.forward_mqa`` is one layer's decode: q into the group's own buffers (the
  steps mlatune holds are keyed by tensor addresses, so they stay the same from step to
  step), then ``MLADecoder.forward`` with the layer's fp8 scales; it returns the LSE, which
  vLLM's DCP combine reads.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import ClassVar

import torch
from vllm.config import VllmConfig, get_current_vllm_config_or_none
from vllm.config.cache import CacheDType
from vllm.model_executor.layers.attention.mla_attention import (
    MLACommonBackend,
    MLACommonDecodeMetadata,
    MLACommonImpl,
    MLACommonMetadata,
    MLACommonMetadataBuilder,
    QueryLenSupport,
    get_mla_dims,
)
from vllm.platforms import current_platform
from vllm.platforms.interface import DeviceCapability
from vllm.v1.attention.backend import (
    AttentionCGSupport,
    AttentionLayer,
    AttentionType,
    CommonAttentionMetadata,
    MultipleOf,
    max_decode_query_len,
)

from mlatune.integrations.core import (
    MLADecoder,
    ServedModel,
    rank_group,
    refusal,
    uniform_qlen,
)

LOG = logging.getLogger("vllm.mlatune")  # under vLLM's logger, so vLLM's log shows it
PAGE_SIZE = 64  # the shipped tables' page: vLLM's kernel block is this, its blocks a multiple
_16_BIT = {"float16": torch.float16, "bfloat16": torch.bfloat16}
_FP8 = ("fp8", "fp8_e4m3")


def cache_dtype(name: str, model_dtype: torch.dtype) -> torch.dtype | None:
    """The KV cache's element type for vLLM's ``--kv-cache-dtype`` name (None: not one
    mlatune reads)."""
    if name == "auto":
        return model_dtype
    if name in _FP8:
        return current_platform.fp8_dtype()
    return _16_BIT.get(name)


def served_model(vllm_config: VllmConfig | None, *, head_size: int, dtype: torch.dtype,
                 kv_cache_dtype: torch.dtype, page_size: int) -> ServedModel:
    """The model vLLM is configuring, as ``core.refusal`` reads it. The scale stands in
    (the layers give theirs at model load); without a model config (vLLM configures with
    one), a DeepSeek-V3 rank's 16 heads and no speculation."""
    rope_dim = 64
    num_heads, num_layers, dcp_size, max_qlen = 16, 1, 1, 1
    if vllm_config is not None and vllm_config.model_config is not None:
        model, parallel = vllm_config.model_config, vllm_config.parallel_config
        rope_dim = get_mla_dims(model).qk_rope_head_dim
        num_heads = model.get_num_attention_heads(parallel)
        num_layers = max(1, model.get_num_layers(parallel))
        dcp_size = parallel.decode_context_parallel_size
        max_qlen = 1 if dcp_size > 1 else max_decode_query_len(vllm_config)
    return ServedModel(num_heads=num_heads, softmax_scale=head_size ** -0.5, q_dtype=dtype,
                       kv_cache_dtype=kv_cache_dtype, page_size=page_size,
                       num_layers=num_layers, kv_lora_rank=head_size - rope_dim,
                       rope_dim=rope_dim, dcp_size=dcp_size, max_qlen=max_qlen)


def configuration_refusal(head_size: int, dtype: torch.dtype, kv_cache_dtype: str | None
                          ) -> str | None:
    """Why mlatune cannot serve the MLA decode vLLM is configuring now (None: it can), on
    mlatune's page (vLLM's own check holds its block size to a multiple of it)."""
    config = get_current_vllm_config_or_none()
    cache = cache_dtype(kv_cache_dtype or "auto", dtype)
    if cache is None:
        return f"mlatune: kv cache dtype {kv_cache_dtype} is not one it reads"
    if config is not None and config.parallel_config.decode_context_parallel_size > 1 \
            and config.parallel_config.cp_kv_cache_interleave_size != 1:
        return ("mlatune: DCP shards the cache token by token "
                "(cp_kv_cache_interleave_size 1) only")
    model = served_model(config, head_size=head_size, dtype=dtype, kv_cache_dtype=cache,
                         page_size=PAGE_SIZE)
    reason = refusal(model)
    return None if reason is None else f"mlatune: {reason}"


class MLATuneBackend(MLACommonBackend):
    """MLA decode chosen per step shape by mlatune's table; prefill stays vLLM's."""

    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.float16, torch.bfloat16]
    supported_kv_cache_dtypes: ClassVar[list[CacheDType]] = [
        "auto", "float16", "bfloat16", "fp8", "fp8_e4m3"]

    @staticmethod
    def get_name() -> str:
        return "CUSTOM"

    @staticmethod
    def get_impl_cls() -> type[MLATuneImpl]:
        return MLATuneImpl

    @staticmethod
    def get_builder_cls() -> type[MLATuneMetadataBuilder]:
        return MLATuneMetadataBuilder

    @staticmethod
    def get_supported_kernel_block_sizes(kv_cache_spec=None) -> list[int | MultipleOf]:
        return [PAGE_SIZE]

    @classmethod
    def get_supported_head_sizes(cls) -> list[int]:
        return [576]

    @classmethod
    def supports_device_cpu_query_lens_mismatch(cls) -> bool:
        return False  # a step's requests share one qlen, read from the host's split

    @classmethod
    def supports_combination(cls, head_size: int, dtype: torch.dtype,
                             kv_cache_dtype: CacheDType | None, block_size: int | None,
                             use_mla: bool, has_sink: bool, use_sparse: bool,
                             use_mm_prefix: bool, device_capability: DeviceCapability
                             ) -> str | None:
        if not use_mla or use_sparse or not cls.supports_head_size(head_size):
            return None  # vLLM's own checks name these
        return configuration_refusal(head_size, dtype, kv_cache_dtype)


@dataclass
class Served:
    """What a step's layers share: the decoder, and the q, out and LSE buffers each layer's
    decode reads and writes (rows: decode tokens)."""

    decoder: MLADecoder
    q: torch.Tensor  # (rows, heads, 576) in the model's dtype
    out: torch.Tensor  # (rows, heads, 512)
    lse: torch.Tensor  # (rows, heads) fp32
    retired: list[torch.Tensor] = field(default_factory=list)

    def fit(self, rows: int) -> None:
        """Room for ``rows``: buffers outgrown are kept, as graphs captured on them replay."""
        if rows <= self.q.shape[0]:
            return
        if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(f"mlatune: {rows} decode rows outgrow the buffers made for "
                               f"{self.q.shape[0]} during a CUDA graph capture")
        self.retired += [self.q, self.out, self.lse]
        self.q = self.q.new_empty((rows, *self.q.shape[1:]))
        self.out = self.out.new_empty((rows, *self.out.shape[1:]))
        self.lse = self.lse.new_empty((rows, *self.lse.shape[1:]))


@dataclass
class MLATuneMetadata(MLACommonMetadata[MLACommonDecodeMetadata]):
    served: Served | None = None  # set where the step has decodes


def _tp_group():
    """vLLM's tensor-parallel ranks' CPU group (``rank_group``); None before vLLM made one."""
    from vllm.distributed.parallel_state import get_tp_group

    try:
        return rank_group(get_tp_group())
    except AssertionError:  # "tensor model parallel group is not initialized": one process
        return None


class MLATuneMetadataBuilder(MLACommonMetadataBuilder[MLATuneMetadata]):
    _cudagraph_support: ClassVar[AttentionCGSupport] = AttentionCGSupport.UNIFORM_BATCH
    query_len_support: ClassVar[QueryLenSupport] = QueryLenSupport.UNIFORM

    def __init__(self, kv_cache_spec, layer_names: list[str], vllm_config: VllmConfig,
                 device: torch.device):
        super().__init__(kv_cache_spec, layer_names, vllm_config, device, MLATuneMetadata)
        model = self._served_model(layer_names)
        reason = refusal(model)
        if reason is not None:
            raise ValueError(f"mlatune (--attention-backend CUSTOM) cannot serve the MLA "
                             f"decode of {layer_names[0]} and its group: {reason}")
        decoder = MLADecoder.load(model, device=device, engine="vLLM", log=LOG,
                                  group=_tp_group())
        self._routes_logged = 0
        rows = max(vllm_config.scheduler_config.max_num_seqs * self.reorder_batch_threshold,
                   self.compilation_config.max_cudagraph_capture_size or 0)
        heads = model.num_heads * model.dcp_size
        d_v = model.kv_lora_rank
        self.served = Served(
            decoder,
            torch.empty((rows, heads, d_v + model.rope_dim), dtype=model.q_dtype, device=device),
            torch.empty((rows, heads, d_v), dtype=model.q_dtype, device=device),
            torch.empty((rows, heads), dtype=torch.float32, device=device))

    def _served_model(self, layer_names: list[str]) -> ServedModel:
        """This group's model: its layers' heads, scale and cache, this rank's DCP share."""
        layers = self.compilation_config.static_forward_context
        impls = [layers[name].impl for name in layer_names]
        scales = {impl.scale for impl in impls}
        if len(scales) != 1:
            raise ValueError(f"mlatune: the layers of one KV-cache group share one softmax "
                             f"scale; these have {sorted(scales)}")
        model_dtype = self.model_config.dtype
        cache = cache_dtype(impls[0].kv_cache_dtype, model_dtype)
        if cache is None:
            raise ValueError(f"mlatune: kv cache dtype {impls[0].kv_cache_dtype} is not one "
                             f"it reads")
        return ServedModel(
            num_heads=self.num_heads, softmax_scale=scales.pop(), q_dtype=model_dtype,
            kv_cache_dtype=cache, page_size=self.page_size, num_layers=len(layer_names),
            kv_lora_rank=self.mla_dims.kv_lora_rank, rope_dim=self.mla_dims.qk_rope_head_dim,
            dcp_size=self.dcp_world_size, dcp_rank=impls[0].dcp_rank,
            max_qlen=self.reorder_batch_threshold)

    def build(self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata,
              fast_build: bool = False) -> MLATuneMetadata:
        """vLLM's MLA metadata, and the step's lengths given to the decoder: the decode
        requests lead the batch, each with the same qlen (padded slots: length 0)."""
        metadata = super().build(common_prefix_len, common_attn_metadata, fast_build)
        self._log_new_routes()
        decode = metadata.decode
        if decode is None:
            return metadata
        starts = common_attn_metadata.query_start_loc_cpu[:metadata.num_decodes + 1]
        qlen = uniform_qlen(starts.tolist(), metadata.num_decodes, metadata.num_decode_tokens)
        global_lens = decode.seq_lens if decode.dcp_tot_seq_lens is None \
            else decode.dcp_tot_seq_lens
        self.served.decoder.begin_step(decode.block_table, global_lens, qlen=qlen,
                                       max_kv_len=common_attn_metadata.max_seq_len)
        self.served.fit(metadata.num_decode_tokens)
        metadata.served = self.served
        return metadata

    def _log_new_routes(self) -> None:
        """The decoder's summary, each time a route serves that had not before."""
        decoder = self.served.decoder
        if len(decoder.routes_served) > self._routes_logged:
            self._routes_logged = len(decoder.routes_served)
            LOG.info("%s", decoder.summary())


class MLATuneImpl(MLACommonImpl[MLATuneMetadata]):
    can_return_lse_for_decode: bool = True
    supports_dcp: bool = True
    supports_pcp: bool = False

    def __init__(self, num_heads: int, head_size: int, scale: float, num_kv_heads: int,
                 alibi_slopes: list[float] | None, sliding_window: int | None,
                 kv_cache_dtype: str, logits_soft_cap: float | None, attn_type: str,
                 kv_sharing_target_layer_name: str | None, **mla_args) -> None:
        super().__init__(num_heads, head_size, scale, num_kv_heads, alibi_slopes,
                         sliding_window, kv_cache_dtype, logits_soft_cap, attn_type,
                         kv_sharing_target_layer_name, **mla_args)
        if alibi_slopes or sliding_window or logits_soft_cap:
            raise NotImplementedError("mlatune: no ALiBi, sliding window or logit soft cap")
        if attn_type != AttentionType.DECODER:
            raise NotImplementedError(f"mlatune: decoder attention only, not {attn_type}")
        self.supports_quant_query_input = False  # q stays 16-bit; the policy says what rounds

    def forward_mqa(self, q: torch.Tensor | tuple[torch.Tensor, torch.Tensor],
                    kv_c_and_k_pe_cache: torch.Tensor, attn_metadata: MLATuneMetadata,
                    layer: AttentionLayer) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One layer's decode of the step's leading decode requests: (out, LSE)."""
        served = attn_metadata.served
        assert served is not None, "mlatune: forward_mqa on a step without decodes"
        parts = q if isinstance(q, tuple) else (q,)
        if any(part.dtype != served.q.dtype for part in parts):
            raise TypeError(f"mlatune: q in {parts[0].dtype}, the model's is {served.q.dtype}")
        rows = parts[0].shape[0]
        q_rows = served.q[:rows]
        if isinstance(q, tuple):
            torch.cat(q, dim=-1, out=q_rows)
        else:
            q_rows.copy_(q)
        fp8_cache = kv_c_and_k_pe_cache.element_size() == 1
        return served.decoder.forward(
            q_rows, kv_c_and_k_pe_cache, out=served.out[:rows], lse_out=served.lse[:rows],
            kv_scale=layer._k_scale if fp8_cache else None)
