"""mlatune's SGLang backend against the installed SGLang, on the CPU (marker ``sglang``).

SGLang's own objects throughout: its plugin loader and registries, its command line,
its attention unit-test kit's model runner (``MockMLAModelRunner``: SGLang's request
and MLA token pools), its ``ForwardBatch`` and its padding of a batch for a CUDA-graph
bucket; the reference is SGLang's Triton MLA decode kernel (its triton backend's), run
in the Triton interpreter on the same pool. fp16, tiny sizes. The command and the
environment are in docs/engines/sglang.md.
"""

from __future__ import annotations

import argparse
import logging
from importlib.metadata import entry_points

import pytest
import torch

pytest.importorskip("sglang")

from sglang.kernels.ops.attention.decode_attention import decode_attention_fwd
from sglang.srt.arg_groups.choices import ATTENTION_BACKEND_CHOICES
from sglang.srt.layers.attention.attention_registry import ATTENTION_BACKENDS
from sglang.srt.layers.radix_attention import RadixAttention
from sglang.srt.model_executor.forward_batch_info import ForwardMode
from sglang.srt.plugins import GENERAL_PLUGINS_GROUP
from sglang.srt.server_args import ServerArgs
from sglang.test.kits.attention_unittest.attention_methods import (
    mla_attention as kit,
)
from sglang.test.kits.attention_unittest.attention_methods.dense_attention import (
    make_loc_fn,
)

from mlatune.integrations.sglang import BACKEND_NAME, create_backend, register
from mlatune.integrations.sglang.backend import FALLBACK_ENV, MLATuneBackend

pytestmark = pytest.mark.sglang

HEADS, PAGE, ROW, LATENT, ROPE = 16, 16, 64, 512, 64  # ROW: tokens a request row holds
SCALE = 0.0873  # not 576 ** -0.5: the model's own scale must reach the kernels


def _case(mode: ForwardMode, prefix_lens: tuple[int, ...], draft: int = 0,
          page: int = PAGE) -> kit.MLAAttentionCase:
    return kit.MLAAttentionCase(name="mlatune", backend=BACKEND_NAME, forward_mode=mode,
                                num_heads=HEADS, page_size=page, prefix_lens=prefix_lens,
                                extend_lens=(draft,) * len(prefix_lens) if draft else ())


def _runner(case: kit.MLAAttentionCase, *, fp8: bool = False, latent: int = LATENT,
            prefill: str = "triton"):
    """SGLang's kit runner for an MLA model served with prefill on ``prefill`` and decode
    on mlatune (request pool of 8 rows of ROW tokens)."""
    config = kit.TinyMLAModelConfig(num_heads=HEADS, kv_lora_rank=latent, qk_rope_head_dim=ROPE,
                                    hidden_size=64, context_len=ROW)
    config.scaling = SCALE
    runner = kit.MockMLAModelRunner(case=case, model_config=config, dtype=torch.float16,
                                    device="cpu", max_context_len=ROW, kv_lora_rank=latent,
                                    qk_rope_head_dim=ROPE, runner_batch_size=8,
                                    fp8_kv_cache=fp8)
    runner.prefill_attention_backend_str = prefill
    runner.decode_attention_backend_str = BACKEND_NAME
    return runner


def _batch(case: kit.MLAAttentionCase, runner):
    """SGLang's ForwardBatch for ``case``: pages shuffled within each request, the new
    (decode) or draft (verify) tokens' slots in ``out_cache_loc``; a verify batch's
    lengths leave its draft tokens out, as SGLang's do."""
    loc_fn = make_loc_fn("shuffled_pages", batch_size=case.batch_size, seq_lens=case.seq_lens,
                         prefix_lens=case.prefix_lens, page_size=case.page_size,
                         max_context_len=ROW, seed=len(case.prefix_lens))
    batch = kit._make_forward_batch(case, runner, max_context_len=ROW, device="cpu",
                                    loc_fn=loc_fn)
    if case.forward_mode.is_target_verify():
        batch.seq_lens = torch.tensor(case.prefix_lens, dtype=torch.int32)
        batch.seq_lens_cpu = batch.seq_lens.clone()
        batch.seq_lens_sum = sum(case.prefix_lens)
    return batch


def _pad(batch, runner, backend, requests: int):
    """The batch padded to a graph bucket of ``requests`` as SGLang pads one (its fill
    value for the lengths, row 0 and slot 0 for the rest)."""
    runner.attn_backend = backend
    qlen = batch.input_ids.shape[0] // batch.batch_size
    batch.batch_size = requests
    batch._pad_inputs_to_size(runner, requests * qlen, requests)
    return batch


def _layer(scale: float = SCALE) -> RadixAttention:
    return RadixAttention(num_heads=HEADS, head_dim=LATENT + ROPE, scaling=scale,
                          num_kv_heads=1, layer_id=0, v_head_dim=LATENT)


def _backend(runner) -> MLATuneBackend:
    register()
    backend = ATTENTION_BACKENDS[BACKEND_NAME](runner)
    assert isinstance(backend, MLATuneBackend)
    return backend


def _fill_pool(runner, seed: int) -> None:
    """Random latent KV in every slot of the pool (fp8 pools: values within e4m3)."""
    pool = runner.token_to_kv_pool.kv_buffer[0]
    gen = torch.Generator().manual_seed(seed)
    values = torch.randn(pool.shape, generator=gen)
    pool.copy_(values.to(runner.kv_cache_dtype).view(pool.dtype))


def _new_kv(tokens: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random q, and the new tokens' k (latent + rope) and v (latent)."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(tokens, HEADS, LATENT + ROPE, generator=gen).half()
    k = torch.randn(tokens, 1, LATENT + ROPE, generator=gen).half()
    return q, k, k[..., :LATENT]


def _sglang_decode(runner, q: torch.Tensor, slots: list[torch.Tensor], scale: float,
                   kv_scale: float = 1.0) -> torch.Tensor:
    """SGLang's Triton MLA decode of each q row over the pool slots ``slots`` names."""
    pool = runner.token_to_kv_pool
    indptr = torch.zeros(len(slots) + 1, dtype=torch.int32)
    indptr[1:] = torch.cumsum(torch.tensor([len(s) for s in slots]), 0)
    splits = 2
    out = torch.empty(q.shape[0], HEADS, LATENT, dtype=q.dtype)
    decode_attention_fwd(
        q, pool.get_key_buffer(0), pool.get_value_buffer(0), out, indptr,
        torch.cat(slots).long(), torch.empty(q.shape[0], HEADS, splits, LATENT),
        torch.empty(q.shape[0], HEADS, splits), torch.full((q.shape[0],), splits,
                                                           dtype=torch.int32),
        splits, scale, kv_scale, kv_scale, has_mla=True)
    return out


def _slots(runner, batch, lens: list[int]) -> list[torch.Tensor]:
    rows = runner.req_to_token_pool.req_to_token[batch.req_pool_indices.long()]
    return [rows[i, :n] for i, n in enumerate(lens)]


def _poison(buffers) -> None:
    buffers.out.fill_(float("nan"))
    buffers.lse.fill_(float("nan"))


def _eager_step(case: kit.MLAAttentionCase, seed: int, fp8: bool = False):
    """(runner, backend, batch) for an eager step of ``case`` over a random pool, the
    step's metadata made and its output buffers poisoned."""
    runner = _runner(case, fp8=fp8)
    _fill_pool(runner, seed=seed)
    backend, batch = _backend(runner), _batch(case, runner)
    backend.init_forward_metadata(batch)
    _poison(backend.eager_buffers)
    return runner, backend, batch


# -- registration ---------------------------------------------------------------------------

def test_mlatune_entry_point_is_in_sglangs_plugin_group():
    """SGLang loads general plugins from GENERAL_PLUGINS_GROUP; mlatune's must be there."""
    found = {ep.name: ep.value for ep in entry_points(group=GENERAL_PLUGINS_GROUP)}
    assert found.get(BACKEND_NAME) == "mlatune.integrations.sglang:register", (
        f"no {BACKEND_NAME!r} entry point in SGLang's group {GENERAL_PLUGINS_GROUP!r} "
        f"(pyproject.toml's [project.entry-points.<group>])")


def test_sglang_plugin_loader_registers_backend_and_flag(monkeypatch):
    import sglang.srt.plugins as plugins

    monkeypatch.setattr(plugins, "_plugins_loaded", False)
    monkeypatch.delitem(ATTENTION_BACKENDS, BACKEND_NAME, raising=False)
    plugins.load_plugins()
    assert ATTENTION_BACKENDS.get(BACKEND_NAME) is create_backend
    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    args = parser.parse_args(["--model-path", "m", "--decode-attention-backend", BACKEND_NAME])
    assert args.decode_attention_backend == BACKEND_NAME


def test_register_is_idempotent():
    register()
    register()
    assert ATTENTION_BACKENDS[BACKEND_NAME] is create_backend
    assert ATTENTION_BACKEND_CHOICES.count(BACKEND_NAME) == 1


# -- metadata -------------------------------------------------------------------------------

def _assert_table_addresses_tokens(runner, batch, block_table, lens) -> None:
    """Every token of every request is at slot table[page] * PAGE + offset."""
    rows = runner.req_to_token_pool.req_to_token[batch.req_pool_indices.long()]
    for i, n in enumerate(lens):
        pos = torch.arange(n)
        assert torch.equal(block_table[i, pos // PAGE].long() * PAGE + pos % PAGE,
                           rows[i, :n].long())


def test_decode_metadata_mixed_lengths():
    case = _case(ForwardMode.DECODE, (0, 5, 37, 16, 47))
    runner = _runner(case)
    backend, batch = _backend(runner), _batch(case, runner)
    backend.init_forward_metadata(batch)
    step = backend.decoder._step
    lens = [p + 1 for p in case.prefix_lens]
    assert step.seq_lens.tolist() == lens and step.seq_lens.dtype == torch.int32
    assert (step.qlen, step.max_kv_len) == (1, max(lens))
    assert step.block_table.shape == (5, ROW // PAGE)
    _assert_table_addresses_tokens(runner, batch, step.block_table, lens)


def test_verify_metadata_counts_draft_tokens_and_pads_empty():
    case = _case(ForwardMode.TARGET_VERIFY, (5, 20, 33), draft=3)
    runner = _runner(case)
    backend = _backend(runner)
    assert backend.model.max_qlen == 3
    backend.init_cuda_graph_state(max_bs=4, max_num_tokens=12)
    batch = _pad(_batch(case, runner), runner, backend, 4)
    backend.init_forward_metadata_in_graph(batch)
    step = backend.decoder._step
    assert step.qlen == 3 and step.seq_lens.tolist() == [8, 23, 36, 0]
    _assert_table_addresses_tokens(runner, batch, step.block_table, [8, 23, 36])


def test_graph_hooks_fill_and_reuse_the_same_buffers():
    """Capture then two replays of one bucket: the hooks write the same tensors in place,
    the padded slots (SGLang's fill value) as empty requests."""
    case = _case(ForwardMode.DECODE, (3, 40, 9))
    runner = _runner(case)
    backend = _backend(runner)
    assert backend.get_cuda_graph_seq_len_fill_value() == 0
    backend.init_cuda_graph_state(max_bs=8, max_num_tokens=8)
    buffers = backend.graph_buffers
    held = [t.data_ptr() for t in (buffers.block_table, buffers.seq_lens, buffers.q,
                                   buffers.out, buffers.lse)]
    for prefix_lens in ((3, 40, 9), (60, 0, 22, 31, 7), (12,)):
        case = _case(ForwardMode.DECODE, prefix_lens)
        batch = _pad(_batch(case, runner), runner, backend, 6)
        backend.init_forward_metadata_out_graph(batch, in_capture=True)
        backend.init_forward_metadata_in_graph(batch)
        step = backend.decoder._step
        lens = [p + 1 for p in prefix_lens]
        assert step.seq_lens.tolist() == lens + [0] * (6 - len(lens))
        assert step.seq_lens.data_ptr() == buffers.seq_lens.data_ptr()
        assert step.block_table.data_ptr() == buffers.block_table.data_ptr()
        assert step.max_kv_len == ROW
        _assert_table_addresses_tokens(runner, batch, step.block_table, lens)
    assert backend.graph_buffers is buffers
    assert held == [t.data_ptr() for t in (buffers.block_table, buffers.seq_lens, buffers.q,
                                           buffers.out, buffers.lse)]


# -- forward against SGLang's own MLA decode ------------------------------------------------

def test_forward_decode_matches_sglang_triton_mla():
    case = _case(ForwardMode.DECODE, (0, 5, 37, 16, 47))
    runner, backend, batch = _eager_step(case, seed=1)
    q, k, v = _new_kv(5, seed=2)
    out = backend.forward_decode(q, k, v, _layer(), batch)
    lens = [p + 1 for p in case.prefix_lens]
    slots = _slots(runner, batch, lens)
    pool_k = runner.token_to_kv_pool.get_key_buffer(0)
    assert torch.equal(pool_k[batch.out_cache_loc], k)  # the new tokens' KV saved first
    want = _sglang_decode(runner, q, slots, SCALE)
    torch.testing.assert_close(out.view(5, HEADS, LATENT), want, atol=2e-3, rtol=2e-3)
    assert backend.decoder.routes_served.total() == 1


def test_forward_decode_lse_and_padded_graph_slots():
    """A graph bucket padded by SGLang: real rows match SGLang's kernel, padded rows are
    empty requests (output 0, LSE -inf); the LSE (for DCP) is the scores' logsumexp."""
    case = _case(ForwardMode.DECODE, (30, 2, 17))
    runner = _runner(case)
    _fill_pool(runner, seed=3)
    backend = _backend(runner)
    backend.init_cuda_graph_state(max_bs=8, max_num_tokens=8)
    batch = _pad(_batch(case, runner), runner, backend, 5)
    backend.init_forward_metadata_in_graph(batch)
    _poison(backend.graph_buffers)
    q, k, v = _new_kv(5, seed=4)
    out, lse = backend.forward_decode(q, k, v, _layer(), batch, return_lse=True)
    lens = [31, 3, 18]
    slots = _slots(runner, batch, lens)
    want = _sglang_decode(runner, q[:3], slots, SCALE)
    out = out.view(5, HEADS, LATENT)
    torch.testing.assert_close(out[:3], want, atol=2e-3, rtol=2e-3)
    assert torch.equal(out[3:], torch.zeros_like(out[3:]))
    assert torch.isneginf(lse[3:]).all()
    pool_k = runner.token_to_kv_pool.get_key_buffer(0)
    for i, s in enumerate(slots):
        scores = q[i].float() @ pool_k[s, 0].float().T * SCALE
        torch.testing.assert_close(lse[i], torch.logsumexp(scores, -1), atol=2e-3, rtol=1e-3)


def test_forward_verify_uniform_draft_matches_sglang_triton_mla():
    """Speculative verify, 3 draft tokens a request: draft token t of a request sees its
    prefix and drafts 0..t (SGLang's kernel over that window, row by row)."""
    prefix_lens, draft = (5, 20, 33), 3
    case = _case(ForwardMode.TARGET_VERIFY, prefix_lens, draft=draft)
    runner, backend, batch = _eager_step(case, seed=5)
    q, k, v = _new_kv(9, seed=6)
    out = backend.forward_extend(q, k, v, _layer(), batch)
    windows = [p + t + 1 for p in prefix_lens for t in range(draft)]
    rows = _slots(runner, batch, [p + draft for p in prefix_lens])
    slots = [rows[i // draft][:n] for i, n in enumerate(windows)]
    want = _sglang_decode(runner, q, slots, SCALE)
    torch.testing.assert_close(out.view(9, HEADS, LATENT), want, atol=2e-3, rtol=2e-3)


def test_fp8_cache_honours_the_layer_k_scale():
    """An fp8 pool: the new token's k is stored divided by k_scale, as SGLang's triton
    backend stores it, and read multiplied by it. The reference is the exact attention
    over the pool's stored values; SGLang's Triton MLA kernel rounds q to fp8 (q cast to
    the cache dtype), so it is held to the q-fp8 error class only (relative L2 < 0.15,
    where a scale applied the other way is off by far more)."""
    runner, backend, batch = _eager_step(_case(ForwardMode.DECODE, (9, 26)), seed=7, fp8=True)
    layer = _layer()
    layer.k_scale = torch.tensor(0.5)
    q, k, v = _new_kv(2, seed=8)
    out = backend.forward_decode(q, k, v, layer, batch).view(2, HEADS, LATENT)
    pool_k = runner.token_to_kv_pool.get_key_buffer(0)
    assert torch.equal(pool_k[batch.out_cache_loc], (k / 0.5).to(torch.float8_e4m3fn))
    slots = _slots(runner, batch, [10, 27])
    for i, s in enumerate(slots):
        keys = pool_k[s, 0].float() * 0.5
        probs = torch.softmax(q[i].float() @ keys.T * SCALE, -1)
        torch.testing.assert_close(out[i].float(), probs @ keys[:, :LATENT], atol=2e-3,
                                   rtol=2e-3)
    sglang = _sglang_decode(runner, q, slots, SCALE, kv_scale=0.5).float()
    assert (out.float() - sglang).norm() / sglang.norm() < 0.15


def test_a_layer_with_another_softmax_scale_is_refused():
    _, backend, batch = _eager_step(_case(ForwardMode.DECODE, (4,)), seed=9)
    q, k, v = _new_kv(1, seed=9)
    with pytest.raises(ValueError, match="softmax scale"):
        backend.forward_decode(q, k, v, _layer(scale=SCALE * 2), batch)


# -- what mlatune does not serve ------------------------------------------------------------

@pytest.mark.parametrize(("runner_args", "reason"), [
    (dict(prefill=BACKEND_NAME), "decode only"),
    (dict(latent=32), "head dim"),
])
def test_unserved_setups_fall_back_or_refuse(monkeypatch, caplog, runner_args, reason):
    runner = _runner(_case(ForwardMode.DECODE, (4,)), **runner_args)
    register()
    with caplog.at_level(logging.WARNING):
        fallback = ATTENTION_BACKENDS[BACKEND_NAME](runner)
    assert type(fallback).__name__ == "TritonAttnBackend"
    assert reason in caplog.text and "triton" in caplog.text
    monkeypatch.setenv(FALLBACK_ENV, "none")
    with pytest.raises(ValueError, match=reason):
        ATTENTION_BACKENDS[BACKEND_NAME](runner)


def test_tensor_parallel_ranks_load_as_one_group(monkeypatch):
    """With TP ranks the decoder is loaded with SGLang's TP CPU group (its ranks must serve
    one route); one rank passes none (SGLang may not have built its groups)."""
    from types import SimpleNamespace

    from sglang.srt.runtime_context import get_parallel

    from mlatune.integrations import core

    seen = []
    load = core.MLADecoder.load.__func__

    def recording(cls, model, **kwargs):
        seen.append(kwargs.get("group"))
        return load(cls, model, **{**kwargs, "group": None})

    monkeypatch.setattr(core.MLADecoder, "load", classmethod(recording))
    runner = _runner(_case(ForwardMode.DECODE, (4,)))
    _backend(runner)
    coordinator = SimpleNamespace(cpu_group="tp-cpu-group", world_size=2)
    with get_parallel().override(tp_size=2, attn_tp_size=2, moe_tp_size=2,
                                 tp_group=coordinator):
        _backend(runner)
    assert seen == [None, "tp-cpu-group"]
