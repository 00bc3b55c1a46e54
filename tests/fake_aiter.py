"""A recording fake of the AITER API the aiter routes call, for CPU tests.

Every function has AITER's signature (parameter names, order and defaults, as
the seed calls them and AITER's source declares them), so a wrong keyword is a
TypeError. Each records its bound arguments, asserts the shapes, dtypes and
flags the seed's calls use, and then computes what the kernel should: exact
attention (mlatune.check.reference.attend) from the indices, lengths, scales and
masks it is handed. An adapter that passes a wrong index, scale, flag or head
layout therefore gets a wrong answer and fails the accuracy check. This proves
plumbing, not kernels: nothing here says AITER's kernels are right or fast.
"""

from __future__ import annotations

import inspect
import math
import sys
import types
from pathlib import Path
from typing import Any

import torch

from mlatune.check.reference import attend

FP8 = (torch.float8_e4m3fn, torch.float8_e4m3fnuz)
I32 = torch.int32
_MANIFEST_HEADER = "qType,kvType,Gqa,ps,qSeqLen,prefill,causal,lse,cprr,knl_name,co_name"
MANIFEST_ROWS = (  # one row per family the routes look for
    "bf16,bf16,16,1,4,0,0,1,0,k_decode,k_decode.co",
    "bf16,bf16,32,1,4,0,0,1,1,k_cprr,k_cprr.co",
    "fp8,fp8,1,1,0,1,1,0,0,k_prefill,k_prefill.co",
)


def _scale_of(t: torch.Tensor, scale: torch.Tensor | None, what: str) -> float:
    if t.dtype in FP8:
        assert isinstance(scale, torch.Tensor) and scale.numel() == 1, f"{what} needs a scale"
        assert scale.dtype == torch.float32, f"{what} scale must be fp32"
        return float(scale)
    assert scale is None or float(scale) == 1.0, f"{what} is not fp8 but has scale {scale}"
    return 1.0


def _int32(name: str, t: torch.Tensor, shape: tuple[int, ...] | None = None) -> None:
    assert t.dtype == I32, f"{name} must be int32, got {t.dtype}"
    if shape is not None:
        assert tuple(t.shape) == shape, f"{name} shape {tuple(t.shape)} != {shape}"


class FakeAiter:
    """State and functions of one fake AITER install."""

    def __init__(self, root: Path, arch: str = "gfx950", cu_num: int = 8, segments: int = 4,
                 partial_tiles: int = 1, manifest: tuple[str, ...] | None = MANIFEST_ROWS,
                 native_h24: bool = False, legacy_gluon: bool = False,
                 omit: tuple[str, ...] = ()):
        self.root, self.arch, self.cu_num = root, arch, cu_num
        self.segments, self.partial_tiles = segments, partial_tiles
        self.legacy_gluon, self.omit = legacy_gluon, set(omit)
        self.calls: list[tuple[str, dict[str, Any]]] = []
        self.info_sizes: dict[str, list] = {}  # last *_info_v1 answer, by buffer name
        self.schedules: list[dict[str, Any]] = []  # every get_mla_metadata_v1 call
        self.ps_schedule: dict[str, Any] | None = None
        self.prefill: dict[str, Any] | None = None  # last mla_prefill_ps_asm_fwd call + its lse
        if manifest is not None:
            path = root / "hsa" / arch / "mla" / "mla_asm.csv"
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text("\n".join((_MANIFEST_HEADER, *manifest)) + "\n")
        if native_h24:
            for rel, text in (("kernels/mla/reduce.cu", "MLA_REDUCE_CASE_EF(NUM_HEAD, 24, "
                                                        "HEAD_DIM, 512, float)"),
                              ("kernels/mla/metadata/v1_2_device.cuh", "if (num_heads == 24)")):
                (root / "csrc" / rel).parent.mkdir(parents=True, exist_ok=True)
                (root / "csrc" / rel).write_text(text)

    # --- bookkeeping --------------------------------------------------------------------
    def record(self, name: str, fn, args: dict[str, Any]) -> None:
        """Keep the call's arguments by their declared names, defaults filled in."""
        bound = inspect.signature(fn).bind(**{k: v for k, v in args.items() if k != "self"})
        bound.apply_defaults()
        self.calls.append((name, dict(bound.arguments)))

    def names(self) -> list[str]:
        return [n for n, _ in self.calls]

    def last(self, name: str) -> dict[str, Any]:
        return next(a for n, a in reversed(self.calls) if n == name)

    def install(self, monkeypatch) -> FakeAiter:
        for name, module in self.modules().items():
            monkeypatch.setitem(sys.modules, name, module)
        return self

    def modules(self) -> dict[str, types.ModuleType]:
        def module(name: str, **attrs) -> types.ModuleType:
            m = types.ModuleType(name)
            m.__dict__.update(attrs)
            return m

        gluon_name = "mla_decode_gluon" if self.legacy_gluon else "mla_gluon"
        mods = {
            "aiter": module("aiter", __version__="0.0.fake",
                            get_mla_metadata_info_v1=self.get_mla_metadata_info_v1,
                            get_mla_metadata_v1=self.get_mla_metadata_v1,
                            get_ps_metadata_info_v1=self.get_ps_metadata_info_v1,
                            get_ps_metadata_v1=self.get_ps_metadata_v1,
                            mla_prefill_ps_asm_fwd=self.mla_prefill_ps_asm_fwd,
                            mla_reduce_v1=self.mla_reduce_v1),
            "aiter.mla": module("aiter.mla", mla_decode_fwd=self.mla_decode_fwd),
            "aiter.jit": module("aiter.jit"),
            "aiter.jit.core": module("aiter.jit.core", AITER_ASM_DIR=f"{self.root / 'hsa'}/",
                                     AITER_CSRC_DIR=str(self.root / "csrc")),
            "aiter.jit.utils": module("aiter.jit.utils"),
            "aiter.jit.utils.chip_info": module("aiter.jit.utils.chip_info",
                                                get_gfx=lambda: self.arch,
                                                get_cu_num=lambda: self.cu_num),
            "aiter.ops": module("aiter.ops"),
            "aiter.ops.triton": module("aiter.ops.triton"),
            "aiter.ops.triton.gluon": module("aiter.ops.triton.gluon"),
            f"aiter.ops.triton.gluon.{gluon_name}": module(
                f"aiter.ops.triton.gluon.{gluon_name}", **{gluon_name: self.mla_gluon}),
            "aiter.ops.triton.attention": module("aiter.ops.triton.attention"),
            "aiter.ops.triton.attention.mla": module("aiter.ops.triton.attention.mla",
                                                     mla_decode_fwd=self.segmented_decode_fwd),
        }
        for name in self.omit:
            if "." in name and name.rsplit(".", 1)[0] in mods and name not in mods:
                delattr(mods[name.rsplit(".", 1)[0]], name.rsplit(".", 1)[1])  # an attribute
            else:
                mods.pop(name)
        return mods

    # --- persistent decode schedule -----------------------------------------------------
    def get_mla_metadata_info_v1(self, batch_size, max_seqlen_qo, num_head_qo, q_dtype, kv_dtype,
                                 is_sparse, fast_mode=True, num_kv_splits=32,
                                 intra_batch_mode=False, max_split_per_batch=-1):
        self.record("get_mla_metadata_info_v1", self.get_mla_metadata_info_v1, dict(locals()))
        assert num_head_qo % 8 == 0, f"AITER asserts num_head_qo % 8 == 0, got {num_head_qo}"
        assert isinstance(q_dtype, torch.dtype) and isinstance(kv_dtype, torch.dtype)
        assert is_sparse is False and fast_mode is True
        tiles = batch_size * math.ceil(max_seqlen_qo * num_head_qo / 128)
        splits = self.cu_num if max_split_per_batch < 0 else max_split_per_batch
        sizes = [(2, torch.uint64), (self.cu_num + 1, I32), ((tiles * splits, 8), I32),
                 (tiles + 1, I32), ((tiles, 2), I32), (tiles * splits, I32)]
        names = ("work_metadata_ptrs", "work_indptr", "work_info_set", "reduce_indptr",
                 "reduce_final_map", "reduce_partial_map")
        self.info_sizes = dict(zip(names, sizes, strict=True))
        self.info_sizes["heads"] = num_head_qo
        return tuple(sizes)

    def get_mla_metadata_v1(self, seqlens_qo_indptr, seqlens_kv_indptr, kv_last_page_lens,
                            num_heads_per_head_k, num_heads_k, is_causal, work_metadata_ptrs,
                            work_info_set, work_indptr, reduce_indptr, reduce_final_map,
                            reduce_partial_map, page_size=1, kv_granularity=16, max_seqlen_qo=-1,
                            uni_seqlen_qo=-1, fast_mode=True, topk=-1, max_split_per_batch=-1,
                            intra_batch_mode=False, is_cp_round_robin=False, mla_version=0,
                            dtype_q_nope=None, dtype_q_rope=None, dtype_kv_nope=None,
                            dtype_kv_rope=None, dtype_q=None, dtype_kv=None):
        args = dict(locals())
        self.record("get_mla_metadata_v1", self.get_mla_metadata_v1, args)
        batch = seqlens_qo_indptr.numel() - 1
        _int32("seqlens_qo_indptr", seqlens_qo_indptr)
        _int32("seqlens_kv_indptr", seqlens_kv_indptr, (batch + 1,))
        _int32("kv_last_page_lens", kv_last_page_lens, (batch,))
        assert num_heads_per_head_k == self.info_sizes["heads"], "planned for other heads"
        assert num_heads_k == 1 and page_size == 1 and kv_granularity == 16 and fast_mode
        assert max_seqlen_qo >= 1 and uni_seqlen_qo == max_seqlen_qo
        assert isinstance(dtype_q, torch.dtype) and isinstance(dtype_kv, torch.dtype)
        for name in ("work_metadata_ptrs", "work_info_set", "work_indptr", "reduce_indptr",
                     "reduce_final_map", "reduce_partial_map"):
            size, dtype = self.info_sizes[name]
            t = args[name]
            assert t.dtype == dtype and t.shape == torch.Size(
                size if isinstance(size, tuple) else (size,)), f"{name} is not the sized buffer"
            t.fill_(7)  # a plan; its contents mean nothing to the fake kernel
        if is_cp_round_robin:
            assert is_causal is False, "cprr plans its schedule non-causal"
            assert max_split_per_batch > 0 and intra_batch_mode is False
        self.schedules.append(args)

    # --- ASM decode ---------------------------------------------------------------------
    def mla_decode_fwd(self, q, kv_buffer, o, qo_indptr, kv_indptr, kv_indices, kv_last_page_lens,
                       max_seqlen_q, page_size=1, nhead_kv=1, sm_scale=None, logit_cap=0.0,
                       num_kv_splits=None, num_kv_splits_indptr=None, work_meta_data=None,
                       work_indptr=None, work_info_set=None, reduce_indptr=None,
                       reduce_final_map=None, reduce_partial_map=None, q_scale=None,
                       kv_scale=None, intra_batch_mode=False, return_logits=False,
                       return_lse=False, g_kv_indptr=None, cp_world_size=1, cp_rank=0,
                       causal=True):
        args = dict(locals())
        self.record("mla_decode_fwd", self.mla_decode_fwd, args)
        tokens, heads, dim = q.shape
        batch = qo_indptr.numel() - 1
        assert q.is_contiguous(), "the ASM decode reads q as packed (tokens, heads, dim)"
        assert heads % 8 == 0, f"ASM decode heads must be padded, got {heads}"
        assert kv_buffer.dim() == 4 and kv_buffer.shape[1:3] == (page_size, 1)
        assert kv_buffer.shape[3] == dim and o.shape[:2] == (tokens, heads)
        assert o.dtype in (torch.bfloat16, torch.float16)
        for name, t, shape in (("qo_indptr", qo_indptr, (batch + 1,)),
                               ("kv_indptr", kv_indptr, (batch + 1,)),
                               ("kv_indices", kv_indices, None),
                               ("kv_last_page_lens", kv_last_page_lens, (batch,))):
            _int32(name, t, shape)
        assert int((qo_indptr[1:] - qo_indptr[:-1]).max()) == max_seqlen_q
        assert isinstance(sm_scale, float) and nhead_kv == 1
        assert (q.dtype in FP8) == (kv_buffer.dtype in FP8), "q and KV must both be fp8 or not"
        qs = _scale_of(q, q_scale, "q")
        kvs = _scale_of(kv_buffer, kv_scale, "kv")
        metadata = (work_meta_data, work_indptr, work_info_set, reduce_indptr, reduce_final_map,
                    reduce_partial_map)
        if work_meta_data is not None:
            s = next((s for s in self.schedules if s["work_metadata_ptrs"] is work_meta_data),
                     None)
            assert s is not None, "work_meta_data was not filled by get_mla_metadata_v1"
            planned = (s["work_metadata_ptrs"], s["work_indptr"], s["work_info_set"],
                       s["reduce_indptr"], s["reduce_final_map"], s["reduce_partial_map"])
            assert all(a is b for a, b in zip(metadata, planned, strict=True)), \
                "metadata buffers are not the ones get_mla_metadata_v1 filled (or swapped)"
            assert s["num_heads_per_head_k"] == heads and s["max_seqlen_qo"] == max_seqlen_q
            assert s["dtype_q"] == q.dtype and s["dtype_kv"] == kv_buffer.dtype
            assert s["seqlens_kv_indptr"] is kv_indptr and s["seqlens_qo_indptr"] is qo_indptr
            if cp_world_size > 1:
                assert s["is_cp_round_robin"] and s["max_split_per_batch"] == num_kv_splits
        else:
            assert all(m is None for m in metadata), "a partial schedule"
        if cp_world_size > 1:
            _int32("g_kv_indptr", g_kv_indptr, (batch + 1,))
            assert 0 <= cp_rank < cp_world_size and intra_batch_mode is False and causal
        if self.arch == "gfx1250" and work_meta_data is None:
            assert page_size == 64 and not return_lse, "gfx1250 stage 1: 64-pages, no LSE"
        lse = torch.full((tokens, heads), math.nan)
        v_dim = o.shape[2]
        for b in range(batch):
            q0, q1 = int(qo_indptr[b]), int(qo_indptr[b + 1])
            pages = kv_indices[int(kv_indptr[b]):int(kv_indptr[b + 1])].long()
            n = max(0, (pages.numel() - 1) * page_size + int(kv_last_page_lens[b])) \
                if pages.numel() else 0
            kv = kv_buffer[pages].reshape(-1, dim)[:n].float() * kvs
            local = torch.arange(n)
            steps = torch.arange(q1 - q0)
            if cp_world_size > 1:  # global position of local token j: j * W + rank
                key_pos = local * cp_world_size + cp_rank
                total = int(g_kv_indptr[b + 1] - g_kv_indptr[b])
            else:
                key_pos, total = local, n
            last = total - (q1 - q0) + steps if causal else torch.full_like(steps, 1 << 40)
            out, row_lse = attend(q[q0:q1].float() * qs, kv[:, None], kv[:, None, :v_dim],
                                  key_pos, last, sm_scale)
            o[q0:q1] = out.to(o.dtype)
            lse[q0:q1] = row_lse
        return o, (lse if return_lse else None)

    # --- Gluon --------------------------------------------------------------------------
    def mla_gluon(self, q_nope, q_pe, kv_c, o, page_table, seq_info, sm_scale, k_pe=None,
                  kv_pe_offset=512, use_2d_view=True, kv_scale=1.0, min_kv_seq_len=1,
                  return_lse=False, has_pe=True, attn_sink=None):
        self.record("mla_gluon", self.mla_gluon, dict(locals()))
        assert use_2d_view is False and k_pe is None and kv_scale == 1.0 and not return_lse
        assert kv_c.dim() == 2 and kv_c.dtype == torch.bfloat16, "Gluon: flat bf16 cache"
        assert kv_pe_offset == q_nope.shape[-1] and kv_c.shape[1] == kv_pe_offset + \
            q_pe.shape[-1]
        mtp = q_nope.dim() == 4
        batch = q_nope.shape[0]
        qlen = q_nope.shape[1] if mtp else 1
        heads = q_nope.shape[-2]
        assert heads < 16 and q_pe.shape[:-1] == q_nope.shape[:-1]
        assert o.shape == (*q_nope.shape[:-1], q_nope.shape[-1]) and o.dtype == torch.bfloat16
        _int32("page_table", page_table)
        _int32("seq_info", seq_info, (batch + 1,))
        lens = seq_info[1:] - seq_info[:-1]
        assert 1 <= min_kv_seq_len <= max(1, int(lens.min())), "min_kv_seq_len is no lower bound"
        q = torch.cat([q_nope, q_pe], dim=-1).reshape(batch, qlen, heads, -1)
        out = o.view(batch, qlen, heads, -1)
        for b in range(batch):
            idx = page_table[int(seq_info[b]):int(seq_info[b + 1])].long()
            kv = kv_c[idx].float()
            steps = torch.arange(qlen)
            res, _ = attend(q[b].float(), kv[:, None], kv[:, None, :kv_pe_offset],
                            torch.arange(idx.numel()), idx.numel() - qlen + steps, sm_scale)
            out[b] = res.to(out.dtype)

    # --- segmented decode (Triton) ------------------------------------------------------
    def segmented_decode_fwd(self, q, kv_buffer, out, cu_seqlens_q, seqused_k, max_seqlen_kv,
                             block_tables, softmax_scale, kv_lora_rank, qk_rope_head_dim, causal,
                             q_descale, kv_descale, q_scales=None, out_scale=None,
                             shuffled_kv_cache=False, skip_reduce=False):
        self.record("segmented_decode_fwd", self.segmented_decode_fwd, dict(locals()))
        rows, heads, dim = q.shape
        tile = kv_buffer.shape[1]
        assert causal is True and skip_reduce is True and out is None and q_descale is None
        assert q.dtype == torch.bfloat16 and dim == kv_lora_rank + qk_rope_head_dim
        assert kv_buffer.dim() == 4 and kv_buffer.shape[2:] == (1, dim)
        assert tile & (tile - 1) == 0 and 16 <= tile <= 128, f"tile {tile}"
        assert torch.equal(cu_seqlens_q, torch.arange(rows + 1, dtype=I32)), "one query per row"
        _int32("seqused_k", seqused_k, (rows,))
        _int32("block_tables", block_tables)
        assert block_tables.shape[0] == rows and block_tables.shape[1] * tile >= max_seqlen_kv
        assert max_seqlen_kv >= int(seqused_k.max())
        kvs = _scale_of(kv_buffer, kv_descale, "kv")
        segs = self.segments
        width = 1 << (kv_lora_rank - 1).bit_length()
        so = torch.full((rows, heads, segs, width), math.nan)
        sm = torch.full((rows, heads, segs), math.nan)
        se = torch.full((rows, heads, segs), math.nan)
        log2e = 1.0 / math.log(2.0)
        for r in range(rows):
            n = int(seqused_k[r])
            pages = block_tables[r, :-(-n // tile)].long()
            kv = kv_buffer[pages].reshape(-1, dim)[:n].float() * kvs
            scores = (q[r].float() @ kv.T) * softmax_scale * log2e  # (heads, n), base 2
            span = -(-n // (segs * tile)) * tile
            for s in range(segs):
                lo, hi = s * span, min((s + 1) * span, n)
                if lo >= n:
                    continue  # the kernel returns before writing this segment
                block = scores[:, lo:hi]
                top = block.amax(dim=1)
                p = torch.exp2(block - top[:, None])
                sm[r, :, s], se[r, :, s] = top, p.sum(1)
                so[r, :, s, :kv_lora_rank] = p @ kv[lo:hi, :kv_lora_rank]
        return so, sm, se

    # --- FP8 PS prefill -----------------------------------------------------------------
    def get_ps_metadata_info_v1(self, batch_size, num_head_k, max_qlen, qlen_granularity=256):
        self.record("get_ps_metadata_info_v1", self.get_ps_metadata_info_v1, dict(locals()))
        assert num_head_k % 16 == 0 and qlen_granularity == 256
        tiles = batch_size * math.ceil(max_qlen / qlen_granularity)
        sizes = [(2, torch.uint64), (self.cu_num + 1, I32), ((tiles * num_head_k, 8), I32),
                 (tiles + 1, I32), ((tiles, 2), I32), (tiles * 2, I32)]
        names = ("work_metadata_ptrs", "work_indptr", "work_info", "reduce_indptr",
                 "reduce_final_map", "reduce_partial_map")
        self.info_sizes = {**dict(zip(names, sizes, strict=True)), "heads": num_head_k}
        return tuple(sizes)

    def get_ps_metadata_v1(self, seqlens_qo_indptr, pages_kv_indptr, context_lens, gqa_ratio,
                           num_heads_k, work_metadata_ptrs, work_indptr, work_info,
                           reduce_indptr, reduce_final_map, reduce_partial_map,
                           qhead_granularity=1, qlen_granularity=256, kvlen_granularity=16,
                           block_size=16, is_causal=True):
        args = dict(locals())
        self.record("get_ps_metadata_v1", self.get_ps_metadata_v1, args)
        for name in ("seqlens_qo_indptr", "pages_kv_indptr", "context_lens"):
            assert args[name].device.type == "cpu", f"{name}: the planner runs on the host"
            _int32(name, args[name])
        assert torch.equal(seqlens_qo_indptr, pages_kv_indptr)
        assert torch.equal(context_lens, seqlens_qo_indptr[1:] - seqlens_qo_indptr[:-1])
        assert gqa_ratio == 1 and num_heads_k == self.info_sizes["heads"]
        assert (qhead_granularity, qlen_granularity, kvlen_granularity, block_size, is_causal) \
            == (1, 256, 128, 1, True)
        for name in ("work_metadata_ptrs", "work_indptr", "work_info", "reduce_indptr",
                     "reduce_final_map", "reduce_partial_map"):
            size, dtype = self.info_sizes[name]
            t = args[name]
            assert t.dtype == dtype and t.shape == torch.Size(
                size if isinstance(size, tuple) else (size,)), f"{name} is not the sized buffer"
            t.fill_(3)
        reduce_indptr[-1] = self.partial_tiles
        self.ps_schedule = args

    def mla_prefill_ps_asm_fwd(self, Q, K, V, qo_indptr, kv_indptr, kv_page_indices, work_indptr,
                               work_info_set, max_seqlen_q, softmax_scale, is_causal, splitData,
                               splitLse, output, q_scale=None, k_scale=None, v_scale=None):
        args = dict(locals())
        self.record("mla_prefill_ps_asm_fwd", self.mla_prefill_ps_asm_fwd, args)
        tokens, heads, d_qk = Q.shape
        assert Q.dtype in FP8 and K.dtype == Q.dtype and V.dtype == Q.dtype, "fp8 q/k/v"
        assert heads % 16 == 0 and K.shape == Q.shape and V.shape[:2] == (tokens, heads)
        assert Q.is_contiguous() and K.is_contiguous() and V.is_contiguous()
        _int32("qo_indptr", qo_indptr)
        assert torch.equal(qo_indptr, kv_indptr), "KV is the new tokens"
        assert torch.equal(kv_page_indices, torch.arange(tokens, dtype=I32))
        s = self.ps_schedule
        assert torch.equal(work_indptr, s["work_indptr"]) and torch.equal(work_info_set,
                                                                          s["work_info"])
        assert max_seqlen_q == int((qo_indptr[1:] - qo_indptr[:-1]).max()) and is_causal is True
        tiles = self.partial_tiles * 256
        assert splitData.shape == (tiles, heads, V.shape[2]) and splitData.dtype == torch.float32
        assert splitLse.shape == (tiles, heads) and splitLse.dtype == torch.float32
        assert output.shape == (tokens, heads, V.shape[2]) and output.dtype == torch.bfloat16
        qs, ks, vs = (_scale_of(t, sc, n) for t, sc, n in ((Q, q_scale, "q"), (K, k_scale, "k"),
                                                            (V, v_scale, "v")))
        lse = torch.empty(tokens, heads)
        for b in range(qo_indptr.numel() - 1):
            a, e = int(qo_indptr[b]), int(qo_indptr[b + 1])
            steps = torch.arange(e - a)
            out, row_lse = attend(Q[a:e].float() * qs, K[a:e].float() * ks, V[a:e].float() * vs,
                                  steps, steps, softmax_scale)
            output[a:e] = out.to(output.dtype)
            lse[a:e] = row_lse
        self.prefill = {**args, "lse": lse}

    def mla_reduce_v1(self, partial_output, partial_lse, reduce_indptr, reduce_final_map,
                      reduce_partial_map, max_seqlen_q, num_kv_splits, final_output, final_lse):
        self.record("mla_reduce_v1", self.mla_reduce_v1, dict(locals()))
        p = self.prefill
        assert p is not None and partial_output is p["splitData"] and partial_lse is p[
            "splitLse"] and final_output is p["output"], "reduce of other buffers than stage 1's"
        s = self.ps_schedule
        for name, t in (("reduce_indptr", reduce_indptr), ("reduce_final_map", reduce_final_map),
                        ("reduce_partial_map", reduce_partial_map)):
            assert torch.equal(t, s[name]), f"{name} is not the planned one"
        assert max_seqlen_q == 256 and num_kv_splits == 0
        assert final_lse.shape == final_output.shape[:2] and final_lse.dtype == torch.float32
        final_lse.copy_(p["lse"])
