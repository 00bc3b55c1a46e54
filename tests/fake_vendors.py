"""Recording fakes of FlashMLA and FlashInfer's MLA API, for CPU tests of the vendor routes.

Each fake has the library's signature (parameter names, order, defaults, as the
installed versions declare them: sgl-flash-mla 1.0.0, upstream FlashMLA before
2026-09-30, flashinfer-python 0.6.18.post1), records its calls, asserts the
layouts and dtypes the real kernels require, and computes exact attention
(``mlatune.check.reference.attend``) from what it is handed. The schedules hold
the lengths they were planned from and the kernels attend over *those*, as a
real split schedule would: a route that forgets to plan again after the lengths
change gets a wrong answer. This proves plumbing, not the vendors' kernels.
"""

from __future__ import annotations

import math
import sys
import types
from dataclasses import dataclass, field

import torch

from mlatune.check.reference import attend

I32 = torch.int32
FP8 = torch.float8_e4m3fn


def _attend_paged(q, pages_of, lens, cache, scale, causal, q_scale=1.0, kv_scale=1.0):
    """q (b, s, h, d); pages_of(i) -> page ids of request i; cache (pages, page, d) or
    (pages, page, 1, d). Returns out (b, s, h, dv) fp32 and natural-log lse (b, s, h)."""
    cache = cache.reshape(cache.shape[0], cache.shape[1], -1)
    page, b, s = cache.shape[1], q.shape[0], q.shape[1]
    outs, lses = [], []
    for i in range(b):
        n = int(lens[i])
        ids = torch.as_tensor(pages_of(i), dtype=torch.long)
        assert ids.numel() * page >= n, "the page list does not cover the length"
        kv = cache[ids].reshape(-1, cache.shape[-1])[:n].float() * kv_scale
        k = kv[:, None, :]
        pos = torch.arange(n)
        last = (n - s + torch.arange(s)) if causal else torch.full((s,), n - 1)
        o, lse = attend(q[i].float() * q_scale, k, k[..., :512], pos, last, scale)
        outs.append(o)
        lses.append(lse)
    return torch.stack(outs), torch.stack(lses)


# --- FlashMLA ---------------------------------------------------------------------------
@dataclass
class FakeFlashMLA:
    """A fake ``flash_mla``: ``legacy`` (sgl-flash-mla 1.0.0) or ``classic`` interface."""

    flavour: str = "legacy"
    calls: list[tuple[str, dict]] = field(default_factory=list)
    plans: int = 0

    def _plan(self, seqlens_k, rows, h_k):
        assert seqlens_k.dtype == I32 and seqlens_k.dim() == 1, "seqlens_k: (batch,) int32"
        assert h_k == 1, "MLA has one latent KV head"
        self.plans += 1
        # The schedule holds the lengths it was planned from (as split counts would).
        return torch.zeros(4, 8, dtype=I32), seqlens_k.clone()

    def _decode(self, q, k_cache, block_table, cache_seqlens, head_dim_v, meta, splits,
                softmax_scale, causal, descale_q, descale_k):
        b, s, _, d = q.shape
        assert d == 576 and head_dim_v == 512, "FlashMLA: head_size_k 576, head_size_v 512"
        assert k_cache.dim() == 4 and k_cache.shape[1] == 64 and k_cache.shape[2] == 1, \
            "k_cache: (blocks, 64, 1, 576)"
        assert block_table.dtype == I32 and cache_seqlens.dtype == I32
        assert tuple(cache_seqlens.shape) == (b,)
        assert q.stride(-1) == 1 and k_cache.stride(-1) == 1
        fp8 = k_cache.dtype == FP8
        if fp8:
            assert q.dtype == FP8, "the fp8 path reads an fp8 q"
            for t in (descale_q, descale_k):
                assert t is not None and t.dtype == torch.float32 and tuple(t.shape) == (1,)
        else:
            assert q.dtype == torch.bfloat16 and k_cache.dtype == torch.bfloat16
            assert descale_q is None and descale_k is None
        planned = splits  # what the schedule was planned from
        out, lse = _attend_paged(q, lambda i: block_table[i].tolist(), planned, k_cache,
                                 softmax_scale, causal and s > 1,
                                 float(descale_q) if fp8 else 1.0,
                                 float(descale_k) if fp8 else 1.0)
        # Rows with no keys: the kernel leaves NaN and +inf there (as seen on the H200).
        empty = planned == 0
        out[empty], lse[empty] = float("nan"), float("inf")
        return out.to(torch.bfloat16), lse.permute(0, 2, 1).contiguous()

    # legacy interface ------------------------------------------------------------
    def get_mla_metadata(self, *args, **kwargs):
        return types.SimpleNamespace(tile_scheduler_metadata=None, num_splits=None), None

    def get_mla_decoding_metadata(self, seqlens_k, num_q_tokens_per_head_k, h_k, h_q=None,
                                  is_fp8_kvcache=False, topk=None, use_legacy=False):
        self.calls.append(("metadata", dict(rows=num_q_tokens_per_head_k, h_q=h_q,
                                            fp8=is_fp8_kvcache, topk=topk, legacy=use_legacy)))
        assert use_legacy and topk is None, "dense decode: the legacy scheduler, no topk"
        assert num_q_tokens_per_head_k % h_q == 0
        return self._plan(seqlens_k, num_q_tokens_per_head_k, h_k)

    def flash_mla_with_kvcache(self, q, k_cache, block_table, cache_seqlens, head_dim_v,
                               tile_scheduler_metadata, num_splits=None, softmax_scale=None,
                               causal=False, is_fp8_kvcache=None, indices=None, attn_sink=None,
                               extra_k_cache=None, extra_indices_in_kvcache=None,
                               topk_length=None, extra_topk_length=None,
                               enable_batch_invariant=False, use_legacy=False, kv_format=None,
                               descale_q=None, descale_k=None):
        sched = tile_scheduler_metadata
        self.calls.append(("decode", dict(causal=causal, fp8=is_fp8_kvcache, legacy=use_legacy,
                                          scale=softmax_scale)))
        assert use_legacy and indices is None and num_splits is None
        assert sched.tile_scheduler_metadata is not None, "plan before the decode"
        assert bool(is_fp8_kvcache) == (k_cache.dtype == FP8)
        return self._decode(q, k_cache, block_table, cache_seqlens, head_dim_v,
                            sched.tile_scheduler_metadata, sched.num_splits, softmax_scale,
                            causal, descale_q, descale_k)

    def has_legacy(self) -> bool:
        return True

    # classic interface -----------------------------------------------------------
    def classic_get_mla_metadata(self, cache_seqlens, num_q_tokens_per_head_k, num_heads_k):
        self.calls.append(("metadata", dict(rows=num_q_tokens_per_head_k)))
        return self._plan(cache_seqlens, num_q_tokens_per_head_k, num_heads_k)

    def classic_flash_mla_with_kvcache(self, q, k_cache, block_table, cache_seqlens, head_dim_v,
                                       tile_scheduler_metadata, num_splits, softmax_scale=None,
                                       causal=False, descale_q=None, descale_k=None):
        self.calls.append(("decode", dict(causal=causal, scale=softmax_scale)))
        return self._decode(q, k_cache, block_table, cache_seqlens, head_dim_v,
                            tile_scheduler_metadata, num_splits, softmax_scale, causal,
                            descale_q, descale_k)

    def install(self, monkeypatch) -> FakeFlashMLA:
        mod = types.ModuleType("flash_mla")
        mod.__version__ = f"0.0.fake-{self.flavour}"
        if self.flavour == "legacy":
            for name in ("get_mla_metadata", "get_mla_decoding_metadata",
                         "flash_mla_with_kvcache", "has_legacy"):
                setattr(mod, name, getattr(self, name))
        else:
            mod.get_mla_metadata = self.classic_get_mla_metadata
            mod.flash_mla_with_kvcache = self.classic_flash_mla_with_kvcache
        monkeypatch.setitem(sys.modules, "flash_mla", mod)
        return self


# --- FlashInfer -------------------------------------------------------------------------
class FakeFlashInfer:
    """A fake ``flashinfer`` with ``mla.BatchMLAPagedAttentionWrapper``."""

    def __init__(self):
        self.calls: list[tuple[str, dict]] = []

    def install(self, monkeypatch) -> FakeFlashInfer:
        calls = self.calls

        class BatchMLAPagedAttentionWrapper:
            def __init__(self, float_workspace_buffer, use_cuda_graph=False, qo_indptr=None,
                         kv_indptr=None, kv_indices=None, kv_len_arr=None, backend="auto"):
                assert backend in ("fa2", "fa3")
                self.backend = backend
                calls.append(("init", dict(backend=backend)))

            def plan(self, qo_indptr, kv_indptr, kv_indices, kv_len_arr, num_heads,
                     head_dim_ckv, head_dim_kpe, page_size, causal, sm_scale, q_data_type,
                     kv_data_type, use_profiler=False):
                for t in (qo_indptr, kv_indptr, kv_indices, kv_len_arr):
                    assert t.dtype == I32
                assert (head_dim_ckv, head_dim_kpe) == (512, 64)
                if kv_data_type == FP8:
                    assert q_data_type == torch.bfloat16, "fp8 MLA takes a bf16 q"
                calls.append(("plan", dict(causal=causal, page=page_size, heads=num_heads,
                                           scale=sm_scale)))
                # As the real plan: the lists go to the host, the work is partitioned there.
                # (copies, also of CPU tensors: a later write into the lists is not seen)
                self.qo = qo_indptr.cpu().clone()
                self.indptr, self.indices = kv_indptr.cpu().clone(), kv_indices.cpu().clone()
                self.lens = kv_len_arr.cpu().clone()
                self.causal, self.scale, self.heads = causal, sm_scale, num_heads
                self.dtypes = (q_data_type, kv_data_type)

            def run(self, q_nope, q_pe, ckv_cache, kpe_cache, out=None, lse=None,
                    return_lse=False, profiler_buffer=None, kv_len=None, page_table=None,
                    return_lse_base_on_e=False, o_scale=None, *, ckv_scale=None,
                    ckv_scale_arr=None, kpe_scale=None):
                assert (q_nope.dtype, ckv_cache.dtype) == self.dtypes
                assert q_nope.shape[-1] == 512 and q_pe.shape[-1] == 64
                assert ckv_cache.shape[:2] == kpe_cache.shape[:2]
                fp8 = ckv_cache.dtype == FP8
                assert fp8 == (ckv_scale is not None) == (kpe_scale is not None)
                calls.append(("run", dict(lse_e=return_lse_base_on_e, want_lse=return_lse)))
                b = len(self.lens)
                s = int(self.qo[1] - self.qo[0])
                q = torch.cat([q_nope, q_pe], -1).view(b, s, self.heads, 576)
                cache = torch.cat([ckv_cache, kpe_cache], -1)
                o, lse_e = _attend_paged(
                    q, lambda i: self.indices[self.indptr[i]:self.indptr[i + 1]].tolist(),
                    self.lens, cache, self.scale, self.causal,
                    kv_scale=ckv_scale if fp8 else 1.0)
                o = o.reshape(b * s, self.heads, 512).to(q_nope.dtype)
                lse_v = lse_e.reshape(b * s, self.heads)
                if not return_lse_base_on_e:
                    lse_v = lse_v / math.log(2.0)
                out = o if out is None else out.copy_(o)
                if not return_lse:
                    return out
                lse = lse_v if lse is None else lse.copy_(lse_v)
                return out, lse

        mla = types.ModuleType("flashinfer.mla")
        mla.BatchMLAPagedAttentionWrapper = BatchMLAPagedAttentionWrapper
        mod = types.ModuleType("flashinfer")
        mod.__version__ = "0.0.fake"
        mod.mla = mla
        monkeypatch.setitem(sys.modules, "flashinfer", mod)
        monkeypatch.setitem(sys.modules, "flashinfer.mla", mla)
        return self
