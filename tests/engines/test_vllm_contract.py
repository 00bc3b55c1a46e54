"""mlatune's vLLM backend against the installed vLLM, on the CPU (docs/engines/vllm.md has
the environment and the command): the plugin entry point, vLLM's configuration check,
vLLM's own MLA layers and metadata, and vLLM's Triton MLA decode (under the Triton
interpreter, fp16: the interpreter's bf16 dot is wrong) as the reference."""

import dataclasses
import json
import logging
import os
import socket
from importlib.metadata import entry_points
from importlib.util import find_spec

import pytest
import torch

if find_spec("vllm") is not None and not torch.cuda.is_available():
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")  # vLLM's CPU platform
    # With no visible device vLLM keeps Triton (as in a distributed start), which then runs
    # its kernels in the interpreter (tests/conftest.py sets TRITON_INTERPRET).
    os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")

pytest.importorskip("vllm")
pytestmark = pytest.mark.vllm

from vllm.config import (  # noqa: E402
    CacheConfig,
    ModelConfig,
    ParallelConfig,
    SpeculativeConfig,
    VllmConfig,
    set_current_vllm_config,
)
from vllm.model_executor.layers.attention.mla_attention import MLAAttention  # noqa: E402
from vllm.model_executor.layers.linear import ColumnParallelLinear  # noqa: E402
from vllm.platforms.interface import DeviceCapability  # noqa: E402
from vllm.v1.attention.backend import AttentionCGSupport, CommonAttentionMetadata  # noqa: E402
from vllm.v1.attention.backends.mla.triton_mla import (  # noqa: E402
    TritonMLAImpl,
    TritonMLAMetadataBuilder,
)
from vllm.v1.attention.backends.registry import AttentionBackendEnum  # noqa: E402
from vllm.v1.attention.selector import AttentionSelectorConfig  # noqa: E402

from mlatune import attention  # noqa: E402
from mlatune.integrations.vllm import BACKEND  # noqa: E402
from mlatune.integrations.vllm.backend import (  # noqa: E402
    MLATuneBackend,
    MLATuneMetadataBuilder,
)

HEADS, SCALE, PAGE, PAGES = 4, 0.0721, 64, 24
HOPPER = DeviceCapability(9, 0)
TINY_DEEPSEEK = {  # DeepSeek-V3's attention shapes (latent 512, rope 64), 4 heads, 2 layers
    "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3",
    "hidden_size": 256, "intermediate_size": 512, "moe_intermediate_size": 128,
    "num_hidden_layers": 2, "num_attention_heads": HEADS, "num_key_value_heads": HEADS,
    "q_lora_rank": None, "kv_lora_rank": 512, "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64, "v_head_dim": 128, "n_routed_experts": 4, "n_shared_experts": 1,
    "num_experts_per_tok": 2, "first_k_dense_replace": 2, "vocab_size": 1024,
    "max_position_embeddings": 4096, "rope_theta": 10000, "torch_dtype": "float16"}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-deepseek")
    (path / "config.json").write_text(json.dumps(TINY_DEEPSEEK))
    return str(path)


def _config(model_dir: str, *, dtype: str = "float16", cache_dtype: str = "auto",
            speculative_tokens: int = 0, parallel: ParallelConfig | None = None) -> VllmConfig:
    model = ModelConfig(model=model_dir, dtype=dtype, skip_tokenizer_init=True,
                        max_model_len=1024)
    speculative = None if not speculative_tokens else SpeculativeConfig(
        method="ngram", num_speculative_tokens=speculative_tokens, prompt_lookup_max=2,
        target_model_config=model, target_parallel_config=ParallelConfig())
    return VllmConfig(model_config=model, cache_config=CacheConfig(cache_dtype=cache_dtype),
                      speculative_config=speculative, parallel_config=parallel or ParallelConfig())


@pytest.fixture(scope="module")
def distributed():
    """vLLM's process groups, one CPU process (its linear layers need them)."""
    from vllm.distributed import ensure_model_parallel_initialized, init_distributed_environment

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    with set_current_vllm_config(VllmConfig()):
        init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                     distributed_init_method=f"tcp://127.0.0.1:{port}")
        ensure_model_parallel_initialized(1, 1)


@dataclasses.dataclass
class Stack:
    """vLLM's MLA layers on mlatune's backend, its builder, and vLLM's Triton MLA over the
    same layers (the reference)."""

    config: VllmConfig
    layers: list
    builder: MLATuneMetadataBuilder
    reference_builder: TritonMLAMetadataBuilder
    reference: TritonMLAImpl


def _stack(config: VllmConfig, scales: tuple[float, ...] = (SCALE, SCALE)) -> Stack:
    torch.set_default_dtype(config.model_config.dtype)
    try:
        with set_current_vllm_config(config):
            layers = [MLAAttention(
                num_heads=HEADS, scale=scale, qk_nope_head_dim=128, qk_rope_head_dim=64,
                v_head_dim=128, q_lora_rank=None, kv_lora_rank=512,
                kv_b_proj=ColumnParallelLinear(512, HEADS * 256, bias=False),
                cache_config=config.cache_config, prefix=f"model.layers.{i}.self_attn.attn",
                attn_backend=MLATuneBackend) for i, scale in enumerate(scales)]
            # vLLM's CPU platform sets 16-token blocks; the GPU's kernel block is mlatune's 64.
            spec = dataclasses.replace(layers[0].get_kv_cache_spec(config), block_size=PAGE)
            names = [layer.layer_name for layer in layers]
            builder = MLATuneMetadataBuilder(spec, names, config, torch.device("cpu"))
            reference_builder = TritonMLAMetadataBuilder(spec, names, config, torch.device("cpu"))
            reference = TritonMLAImpl(
                num_heads=HEADS, head_size=576, scale=scales[0], num_kv_heads=1,
                alibi_slopes=None, sliding_window=None, kv_cache_dtype=layers[0].kv_cache_dtype,
                logits_soft_cap=None, attn_type="decoder", kv_sharing_target_layer_name=None,
                q_lora_rank=None, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
                qk_head_dim=192, v_head_dim=128, kv_b_proj=layers[0].kv_b_proj)
    finally:
        torch.set_default_dtype(torch.float32)
    return Stack(config, layers, builder, reference_builder, reference)


def _common(seq_lens: list[int], query_lens: list[int], block_table: torch.Tensor,
            seq_buffer: torch.Tensor | None = None, max_seq_len: int | None = None
            ) -> CommonAttentionMetadata:
    """vLLM's per-step metadata: requests' lengths (0: a padded slot), their query lengths
    (decodes first), the block table rows; ``seq_buffer``: the persistent lengths buffer
    the step's lengths are written into (a graph's)."""
    starts = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    if seq_buffer is not None:
        seq_buffer[:len(seq_lens)].copy_(lens)
        lens = seq_buffer[:len(seq_lens)]
    tokens = int(starts[-1])
    return CommonAttentionMetadata(
        query_start_loc=starts, query_start_loc_cpu=starts.clone(), seq_lens=lens,
        num_reqs=len(seq_lens), num_actual_tokens=tokens, max_query_len=max(query_lens),
        max_seq_len=max_seq_len or max(seq_lens), block_table_tensor=block_table,
        slot_mapping=torch.zeros(tokens, dtype=torch.int64),
        seq_lens_cpu_upper_bound=lens.clone())


def _block_table(requests: int, generator: torch.Generator) -> torch.Tensor:
    return torch.randperm(PAGES, generator=generator, dtype=torch.int32)[:requests * 4] \
        .view(requests, 4)


def _q(rows: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """q as vLLM's MLA layer hands it to forward_mqa: (latent, rope), the latent part a
    transposed view (the absorbed bmm writes it head-major)."""
    latent = torch.randn(HEADS, rows, 512, generator=generator).half().transpose(0, 1)
    rope = torch.randn(rows, HEADS, 192, generator=generator).half()[..., 128:]
    return latent, rope


def _decode(stack: Stack, common: CommonAttentionMetadata, kv_caches: list, q: tuple,
            capture: bool = False) -> tuple[list, list, object]:
    """Both layers' decode of one step on mlatune's backend and on vLLM's Triton MLA."""
    build = stack.builder.build_for_cudagraph_capture if capture else \
        (lambda m: stack.builder.build(0, m))
    metadata = build(common)
    reference_metadata = stack.reference_builder.build(0, common)
    ours, theirs = [], []
    for layer, cache in zip(stack.layers, kv_caches, strict=True):
        stack.builder.served.out.fill_(float("nan"))  # poisoned: every row must be written
        out, lse = layer.impl.forward_mqa(q, cache, metadata, layer)
        ours.append((out.clone(), lse.clone()))
        theirs.append(stack.reference.forward_mqa(q, cache, reference_metadata, layer))
    return ours, theirs, metadata


def _assert_matches(ours, theirs, rows_with_keys: list[bool]) -> None:
    """Rows with keys match vLLM's Triton MLA; rows without (padded slots, whose rows vLLM
    leaves as they fall) are output 0 and LSE -inf."""
    keyed = torch.tensor(rows_with_keys)
    for (out, lse), (ref_out, ref_lse) in zip(ours, theirs, strict=True):
        torch.testing.assert_close(out[keyed].float(), ref_out[keyed].float(),
                                   atol=2e-3, rtol=2e-2)
        torch.testing.assert_close(lse[keyed], ref_lse[keyed].float(), atol=5e-3, rtol=1e-3)
        assert out[~keyed].eq(0).all() and lse[~keyed].eq(float("-inf")).all()


def test_the_entry_point_points_vllms_custom_backend_at_mlatune(monkeypatch):
    import vllm.plugins

    declared = {ep.name: ep.value for ep in entry_points(group="vllm.general_plugins")}
    assert declared.get("mlatune") == "mlatune.integrations.vllm:register"
    AttentionBackendEnum.CUSTOM.clear_override()
    monkeypatch.delenv("VLLM_PLUGINS", raising=False)
    monkeypatch.setattr(vllm.plugins, "plugins_loaded", False)
    vllm.plugins.load_general_plugins()
    assert AttentionBackendEnum.CUSTOM.get_path() == BACKEND
    assert AttentionBackendEnum.CUSTOM.get_class() is MLATuneBackend
    assert MLATuneBackend.is_mla() and MLATuneBackend.get_name() == "CUSTOM"


def _reasons(config: VllmConfig, **asked) -> list[str]:
    """What vLLM's CUDA selector asks a selected backend (its AttentionSelectorConfig and
    the device capability), with ``config`` the one being configured."""
    fields = dict(head_size=576, dtype=torch.float16, kv_cache_dtype="auto", block_size=None,
                  use_mla=True) | asked
    with set_current_vllm_config(config):
        return MLATuneBackend.validate_configuration(
            device_capability=HOPPER, **AttentionSelectorConfig(**fields)._asdict())


@pytest.mark.parametrize("asked", [{}, {"block_size": 64}, {"block_size": 128},
                                   {"kv_cache_dtype": "fp8"}, {"kv_cache_dtype": "float16"}])
def test_vllms_configuration_check_accepts_what_mlatune_serves(model_dir, asked):
    assert _reasons(_config(model_dir, speculative_tokens=2), **asked) == []


@pytest.mark.parametrize(("asked", "reason"), [
    ({"block_size": 16}, "block_size not supported"),
    ({"kv_cache_dtype": "fp8_e5m2"}, "kv_cache_dtype not supported"),
    ({"kv_cache_dtype": "fp8_e5m2"}, "mlatune: kv cache dtype fp8_e5m2 is not one it reads"),
    ({"head_size": 320}, "head_size not supported"),
    ({"use_sparse": True}, "sparse not supported"),
    ({"use_pcp": True}, "PCP not supported"),
    ({"use_adaptive_verification": True}, "device-cpu query lens mismatch not supported"),
    # mlatune's own reason, from core.refusal: here, the CPU's interpreter routes
    ({"dtype": torch.bfloat16}, "mlatune: no mlatune route serves decode h4 q1 bf16/bf16"),
])
def test_vllms_configuration_check_refuses_the_rest_with_reasons(model_dir, asked, reason):
    reasons = _reasons(_config(model_dir), **asked)
    assert any(said.startswith(reason) for said in reasons), reasons


def test_dcp_with_an_interleaved_cache_is_refused_by_name(model_dir):
    parallel = ParallelConfig(tensor_parallel_size=2, decode_context_parallel_size=2,
                              cp_kv_cache_interleave_size=2)
    assert _reasons(_config(model_dir, parallel=parallel), use_dcp=True) == [
        "mlatune: DCP shards the cache token by token (cp_kv_cache_interleave_size 1) only"]
    plain = ParallelConfig(tensor_parallel_size=2, decode_context_parallel_size=2)
    assert _reasons(_config(model_dir, parallel=plain), use_dcp=True) == []


def test_the_builder_declares_uniform_batch_graphs_and_uniform_verify(model_dir, distributed):
    stack = _stack(_config(model_dir, speculative_tokens=1))
    kv_spec = stack.builder.kv_cache_spec
    assert MLATuneMetadataBuilder.get_cudagraph_support(stack.config, kv_spec) \
        is AttentionCGSupport.UNIFORM_BATCH
    assert stack.builder.reorder_batch_threshold == 2  # a verify step's qlen is a decode's
    model = stack.builder.served.decoder.model
    assert (model.softmax_scale, model.num_heads, model.page_size, model.max_qlen,
            model.num_layers) == (SCALE, HEADS, PAGE, 2, 2)
    assert stack.layers[0].impl.can_return_lse_for_decode


def test_a_group_whose_layers_differ_in_scale_is_refused(model_dir, distributed):
    with pytest.raises(ValueError, match="share one softmax scale"):
        _stack(_config(model_dir), scales=(SCALE, 0.5))


def test_mixed_lengths_with_padded_slots_match_vllms_triton_mla(model_dir, distributed):
    gen = torch.Generator().manual_seed(1)
    stack = _stack(_config(model_dir))
    lens = [70, 5, 130, 64, 0, 0]  # page-crossing, short, page-exact; two padded slots
    caches = [torch.randn(PAGES, PAGE, 576, generator=gen).half() for _ in stack.layers]
    common = _common(lens, [1, 1, 1, 1, 0, 0], _block_table(len(lens), gen))
    common.num_actual_tokens = len(lens)  # a padded batch counts its slots' tokens
    ours, theirs, metadata = _decode(stack, common, caches, _q(len(lens), gen))
    assert (metadata.num_decodes, metadata.num_prefills) == (len(lens), 0)
    _assert_matches(ours, theirs, [n > 0 for n in lens])


def test_a_mixed_step_gives_mlatune_its_leading_decodes_only(model_dir, distributed):
    gen = torch.Generator().manual_seed(2)
    stack = _stack(_config(model_dir))
    lens, query_lens = [90, 33, 200], [1, 1, 7]  # two decodes, then a prefill chunk
    caches = [torch.randn(PAGES, PAGE, 576, generator=gen).half() for _ in stack.layers]
    common = _common(lens, query_lens, _block_table(len(lens), gen))
    metadata = stack.builder.build(0, common)
    assert (metadata.num_decodes, metadata.num_decode_tokens, metadata.num_prefills) == (2, 2, 1)
    reference_metadata = stack.reference_builder.build(0, common)
    q = _q(2, gen)
    for layer, cache in zip(stack.layers, caches, strict=True):
        out, lse = layer.impl.forward_mqa(q, cache, metadata, layer)
        ref_out, ref_lse = stack.reference.forward_mqa(q, cache, reference_metadata, layer)
        torch.testing.assert_close(out.float(), ref_out.float(), atol=2e-3, rtol=2e-2)
        torch.testing.assert_close(lse, ref_lse.float(), atol=5e-3, rtol=1e-3)


def test_a_uniform_speculative_verify_batch_matches_vllms_triton_mla(model_dir, distributed):
    gen = torch.Generator().manual_seed(3)
    stack = _stack(_config(model_dir, speculative_tokens=1))
    lens = [66, 2, 140, 0]  # qlen 2 each (the draft and the token before it); a padded slot
    caches = [torch.randn(PAGES, PAGE, 576, generator=gen).half() for _ in stack.layers]
    common = _common(lens, [2, 2, 2, 0], _block_table(len(lens), gen))
    common.num_actual_tokens = 2 * len(lens)
    ours, theirs, metadata = _decode(stack, common, caches, _q(2 * len(lens), gen))
    assert (metadata.num_decodes, metadata.num_decode_tokens) == (4, 8)
    _assert_matches(ours, theirs, [n > 0 for n in lens for _ in range(2)])


def test_an_fp8_cache_is_read_with_the_layers_k_scale(model_dir, distributed):
    gen = torch.Generator().manual_seed(4)
    stack = _stack(_config(model_dir, cache_dtype="fp8"))
    assert stack.builder.served.decoder.model.kv_cache_dtype == torch.float8_e4m3fn
    lens = [100, 17, 0]
    scale = 0.37
    caches = [(torch.randn(PAGES, PAGE, 576, generator=gen) / scale).to(torch.float8_e4m3fn)
              for _ in stack.layers]
    for layer in stack.layers:
        layer._k_scale.fill_(scale)
    common = _common(lens, [1, 1, 0], _block_table(len(lens), gen))
    common.num_actual_tokens = len(lens)
    ours, theirs, _ = _decode(stack, common, caches, _q(len(lens), gen))
    _assert_matches(ours, theirs, [n > 0 for n in lens])


def test_graph_buffers_are_rewritten_in_place_and_the_held_steps_reused(model_dir, distributed):
    """vLLM captures a bucket with max_seq_len = max_model_len, then writes each step's
    lengths (0: a slot padded now) and block-table rows into the same buffers; mlatune's
    steps, keyed by those tensors and its own q/out buffers, are made at the capture's
    build and serve every step after with the lengths rewritten."""
    gen = torch.Generator().manual_seed(5)
    stack = _stack(_config(model_dir))
    caches = [torch.randn(PAGES, PAGE, 576, generator=gen).half() for _ in stack.layers]
    seq_buffer = torch.zeros(8, dtype=torch.int32)
    block_buffer = torch.zeros(8, 4, dtype=torch.int32)
    q = _q(4, gen)
    dispatcher = stack.builder.served.decoder.dispatcher
    outs = []
    for step, lens in enumerate(([40, 3, 0, 0], [41, 4, 250, 0], [0, 5, 251, 9])):
        block_buffer[:4].copy_(_block_table(4, gen))
        common = _common(lens, [1 if n else 0 for n in lens], block_buffer[:4], seq_buffer,
                         max_seq_len=1024)
        common.num_actual_tokens = 4
        ours, theirs, _ = _decode(stack, common, caches, q, capture=step == 0)
        _assert_matches(ours, theirs, [n > 0 for n in lens])
        outs.append(stack.builder.served.out.data_ptr())
        if step == 0:
            made = {key: id(held) for key, held in attention.plans_of(dispatcher).items()}
    now = {key: id(held) for key, held in attention.plans_of(dispatcher).items()}
    assert now == made and len(made) == len(stack.layers)  # one step a layer, made once
    assert len(set(outs)) == 1


def test_model_load_logs_one_line_and_routes_are_counted(model_dir, distributed, caplog):
    caplog.set_level(logging.INFO, logger="vllm.mlatune")
    gen = torch.Generator().manual_seed(6)
    stack = _stack(_config(model_dir))

    def said() -> list[str]:
        return [r.getMessage() for r in caplog.records if r.name == "vllm.mlatune"]

    assert len(said()) == 1 and said()[0].startswith("mlatune: vLLM MLA decode: table ")
    caches = [torch.randn(PAGES, PAGE, 576, generator=gen).half() for _ in stack.layers]
    common = _common([12, 80], [1, 1], _block_table(2, gen))
    _decode(stack, common, caches, _q(2, gen))
    stack.builder.build(0, common)  # the next step's metadata says what served
    decoder = stack.builder.served.decoder
    assert sum(decoder.routes_served.values()) == len(stack.layers)
    route = next(iter(decoder.routes_served))
    assert len(said()) == 2
    assert said()[1].startswith("mlatune (vLLM): forward calls by route: ") and route in said()[1]
