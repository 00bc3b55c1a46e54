"""AITER routes (ROCm): Gluon, padded ASM, cprr, segmented (+ merge) and FP8 PS prefill.

Each adapter calls AITER as vLLM's ROCm MLA backend does
(seeds/vllm-rocm-aiter-mla-backend.txt): the same entry points, argument
order, schedule planning and head padding. **None of this has run on AMD
hardware yet.** tests/fake_aiter.py checks every call's argument names, shapes
and dtypes and computes exact attention from what it is handed: that proves
the plumbing (indices, padding, scales, unpadding), not the kernels.

``supports`` = the capability rules for the device's arch AND the probe of the
installed AITER (aiter_probe); the reason names which failed. AITER is
imported on an AMD device only, and lazily, so mlatune imports without it.
Set MLATUNE_AITER_GLUON=force to offer Gluon single-token decode for head
counts that do not divide 16 (the seed's VLLM_ROCM_AITER_MLA_ASM_PADDING=gluon).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import torch

from mlatune import capability
from mlatune.arch import DeviceInfo
from mlatune.capability import HeadPlan, tables
from mlatune.check.inputs import DecodeInputs, PrefillInputs, shard_lengths
from mlatune.lse import LN2, combine
from mlatune.problem import DTYPES, FP8_DTYPES, MLAProblem
from mlatune.routes.aiter_probe import load, probe
from mlatune.routes.base import HOST_PLANNED, Params, Prepared, Route, StepKind, Verdict, no
from mlatune.routes.paged import PagedView, paged_view, uniform_indptr


def gluon_forced() -> bool:
    return os.environ.get("MLATUNE_AITER_GLUON", "").lower() == "force"


def _device_facts() -> tuple[str, int]:
    """The arch and CU count as AITER sees them: its kernel choice keys on the same values."""
    from aiter.jit.utils.chip_info import get_cu_num, get_gfx

    return get_gfx(), get_cu_num()


class _AiterRoute(Route):
    id: str
    family: str

    def supports(self, problem: MLAProblem, device: DeviceInfo) -> Verdict:
        build = probe(device.arch) if device.arch in capability.AMD_ARCHS else None
        ruling = capability.check(self.id, problem, device.arch,
                                  native_h24=bool(build and build.native_h24),
                                  force_gluon=gluon_forced())
        if not ruling:
            return no(f"rule {ruling.rule}: {ruling.reason}")
        refusal = build.refusal(self.family) if build else "not an AMD arch"
        if refusal:
            return no(f"installed AITER: {refusal}")
        return Verdict(True, ruling.reason)

    def unusable(self, device: DeviceInfo) -> str | None:
        if device.arch not in capability.AMD_ARCHS:
            return None  # its rules refuse the arch, alike on every rank
        refusal = probe(device.arch).refusal(self.family)
        return f"installed AITER: {refusal}" if refusal else None

    def param_space(self, problem: MLAProblem, device: DeviceInfo) -> list[Params]:
        return [{}]

    def step_kind(self, params: Params) -> StepKind:
        # CSR page indices and AITER's schedule are built from the lengths on the host.
        return HOST_PLANNED


def _persistent_schedule(problem: MLAProblem, kernel_heads: int, view: PagedView,
                         qo_indptr: torch.Tensor, q_dtype: torch.dtype, kv_dtype: torch.dtype,
                         is_causal: bool, split_cap: int | None) -> dict[str, torch.Tensor]:
    """Size and fill the persistent schedule (get_mla_metadata_info_v1 / get_mla_metadata_v1)."""
    info, plan = load("metadata.info"), load("metadata")
    cap = {} if split_cap is None else {"max_split_per_batch": split_cap}
    sizes = info(problem.batch, problem.qlen, kernel_heads, q_dtype, kv_dtype,
                 is_sparse=False, fast_mode=True, **cap)
    meta, work_indptr, work_info_set, reduce_indptr, final_map, partial_map = (
        torch.empty(size, dtype=dtype, device=qo_indptr.device) for size, dtype in sizes)
    cprr = {} if split_cap is None else {**cap, "intra_batch_mode": False,
                                         "is_cp_round_robin": True}
    # Positional order differs from the info tuple: work_info_set comes before work_indptr.
    plan(qo_indptr, view.indptr, view.last_page_lens, kernel_heads, 1, is_causal,
         meta, work_info_set, work_indptr, reduce_indptr, final_map, partial_map,
         page_size=1, kv_granularity=16, max_seqlen_qo=problem.qlen,
         uni_seqlen_qo=problem.qlen, fast_mode=True, dtype_q=q_dtype, dtype_kv=kv_dtype, **cprr)
    return {"work_meta_data": meta, "work_indptr": work_indptr, "work_info_set": work_info_set,
            "reduce_indptr": reduce_indptr, "reduce_final_map": final_map,
            "reduce_partial_map": partial_map}


@dataclass(frozen=True)
class _RoundRobin:
    g_kv_indptr: torch.Tensor  # global per-request KV lengths, as CSR
    world: int
    rank: int
    splits: int  # KV splits per request; the schedule and the kernel must agree


def _asm_decode(problem: MLAProblem, inputs: DecodeInputs, rank: int, heads: HeadPlan, mode: str,
                want_lse: bool, rr: _RoundRobin | None = None) -> Prepared:
    """mla_decode_fwd over one rank's shard: persistent, non-persistent or gfx1250 stage 1."""
    decode = load("decode")
    from mlatune.kernels.empty_rows import clear_empty_rows  # triton: when a step is made

    q = inputs.q
    device = q.device
    view = paged_view(inputs.shards[rank],
                       tables.GFX1250_STAGE1_PAGE if mode == "stage1" else 1)
    qo_indptr = uniform_indptr(problem.batch, problem.qlen, device)
    q_kernel = q if heads.method == "none" else q.new_empty(q.shape[0], heads.kernel, q.shape[2])
    o = torch.empty(q.shape[0], heads.kernel, problem.d_v, dtype=DTYPES[problem.out_dtype],
                    device=device)
    # Stage 1 on gfx1250 has no LSE kernels (the capability rules keep it off DCP).
    lse = (torch.empty(q.shape[0], heads.real, dtype=torch.float32, device=device)
           if want_lse and mode != "stage1" else None)
    causal = problem.causal or problem.qlen == 1  # one token has no order to mask
    kwargs = {"sm_scale": inputs.softmax_scale, "return_lse": lse is not None, "causal": causal,
              "q_scale": inputs.q_scale, "kv_scale": inputs.kv_scale}
    if mode == "stage1":
        kwargs["page_size"] = view.page
    if mode == "persistent":
        # cprr plans its schedule non-causal: the kernel applies the window on global positions.
        kwargs.update(_persistent_schedule(
            problem, heads.kernel, view, qo_indptr, q.dtype, view.kv.dtype,
            is_causal=causal if rr is None else False,
            split_cap=None if rr is None else rr.splits))
    if rr is not None:
        kwargs.update(g_kv_indptr=rr.g_kv_indptr, cp_world_size=rr.world, cp_rank=rr.rank,
                      num_kv_splits=rr.splits, intra_batch_mode=False)
    zero_first = mode != "persistent" and problem.qlen > 1  # seed: unscheduled verify lanes
    # Rows without keys as the reference has them (0, -inf), whatever the kernel leaves:
    # cprr's window is on global positions, the others' on the shard's own.
    lens, first_key = (inputs.seq_lens, rank) if rr is not None \
        else (inputs.shards[rank].seq_lens, 0)

    def run() -> None:
        if q_kernel is not q:
            heads.pad_into(q_kernel, q)
        if zero_first:
            o.zero_()
        _, kernel_lse = decode(q_kernel, view.kv, o, qo_indptr, view.indptr, view.indices,
                               view.last_page_lens, problem.qlen, **kwargs)
        if lse is not None:
            lse.copy_(heads.real_heads(kernel_lse))
        clear_empty_rows(lens, heads.real_heads(o), lse, qlen=problem.qlen,
                         causal=problem.causal, rank=first_key)

    params = {"kernel_heads": heads.kernel, "padding": heads.method, "mode": mode}
    if rr is not None:
        params["max_split_per_batch"] = rr.splits
    # The CSR page indices (and the persistent schedule) come from the lengths.
    return Prepared(run, heads.real_heads(o), lse, graph_safe=True, params=params,
                    plan_reads_lengths=True)


class PaddedAsmRoute(_AiterRoute):
    """The seed's padded ASM decode: heads padded to a multiple of 16, persistent schedule."""

    id = "padded/aiter"
    family = "padded"

    def prepare(self, problem: MLAProblem, inputs: DecodeInputs | PrefillInputs, *,
                rank: int = 0, params: Params | None = None, want_lse: bool = True) -> Prepared:
        arch, _ = _device_facts()
        plan = capability.padded_asm_plan(problem, arch, probe(arch).native_h24)
        if plan is None or not isinstance(inputs, DecodeInputs):
            raise ValueError(f"{self.id} cannot serve {problem.key} on {arch}")
        return _asm_decode(problem, inputs, rank, plan.heads, plan.mode, want_lse)


class CprrRoute(_AiterRoute):
    """Round-robin DCP verify on the ASM decode: the causal window on global positions."""

    id = "cprr/aiter"
    family = "cprr"

    def prepare(self, problem: MLAProblem, inputs: DecodeInputs | PrefillInputs, *,
                rank: int = 0, params: Params | None = None, want_lse: bool = True) -> Prepared:
        kernel = capability.cprr_heads(problem.kernel_heads)
        if kernel is None or not isinstance(inputs, DecodeInputs):
            raise ValueError(f"{self.id} cannot serve {problem.key}")
        _, cus = _device_facts()  # the seed caps splits per request at the CU count
        g_kv_indptr = torch.zeros(problem.batch + 1, dtype=torch.int32, device=inputs.q.device)
        g_kv_indptr[1:] = inputs.seq_lens.cumsum(0)
        rr = _RoundRobin(g_kv_indptr, problem.dcp_size, rank, cus)
        return _asm_decode(problem, inputs, rank, HeadPlan(problem.kernel_heads, kernel),
                           "persistent", want_lse, rr)


class GluonRoute(_AiterRoute):
    """Small-head (< 16) decode and causal verify on the Gluon kernel, without padding."""

    id = "gluon/aiter"
    family = "gluon"

    def prepare(self, problem: MLAProblem, inputs: DecodeInputs | PrefillInputs, *,
                rank: int = 0, params: Params | None = None, want_lse: bool = True) -> Prepared:
        if not isinstance(inputs, DecodeInputs):
            raise ValueError(f"{self.id} serves decode problems only")
        gluon = load("gluon")
        shard = inputs.shards[rank]
        view = paged_view(shard, 1)
        q_nope, q_pe = inputs.q.split([problem.kv_lora_rank, problem.rope_dim], dim=-1)
        out = torch.empty(inputs.q.shape[0], problem.kernel_heads, problem.d_v,
                          dtype=DTYPES[problem.out_dtype], device=inputs.q.device)
        o = out
        if problem.qlen > 1:  # the 4-D MTP entry: (requests, qlen, heads, dim), free views
            shape = (problem.batch, problem.qlen)
            q_nope, q_pe, o = q_nope.unflatten(0, shape), q_pe.unflatten(0, shape), o.unflatten(
                0, shape)
        # A lower bound on any request's KV length, from which Gluon picks its split count.
        min_kv = max(1, int(shard.seq_lens.min()))
        kv_c = shard.kv_cache.view(-1, shard.kv_cache.shape[-1])

        from mlatune.kernels.empty_rows import clear_empty_rows  # triton: when a step is made

        def run() -> None:
            gluon(q_nope=q_nope, q_pe=q_pe, kv_c=kv_c, o=o, page_table=view.indices,
                  seq_info=view.indptr, sm_scale=inputs.softmax_scale, k_pe=None,
                  kv_pe_offset=problem.kv_lora_rank, use_2d_view=False, kv_scale=1.0,
                  min_kv_seq_len=min_kv)
            clear_empty_rows(shard.seq_lens, out, None, qlen=problem.qlen,
                             causal=problem.causal)  # rows without keys: 0

        # Gluon returns no LSE: the capability rules keep it off DCP, the only caller of one.
        return Prepared(run, out, None, graph_safe=True, params={"min_kv_seq_len": min_kv},
                        plan_reads_lengths=True)


# --- segmented DCP verify ---------------------------------------------------------------
def merge_segments_into(out: torch.Tensor, lse: torch.Tensor | None, segm_out: torch.Tensor,
                        segm_max: torch.Tensor, segm_expsum: torch.Tensor,
                        row_lens: torch.Tensor, tile: int) -> None:
    """Combine the segmented kernel's partials per (row, head) into output and natural-log LSE.

    Segment s of a row covers ``tiles_per_segment`` tiles from ``s * tiles_per_segment``;
    segments past the row's length are never written, so they are masked, not read.
    ``segm_max`` is in base 2 (the kernel scales scores by log2(e)); ``segm_out`` is
    unnormalized.
    """
    n_segments = segm_max.shape[-1]
    lens = row_lens.long()[:, None]
    span = (lens + n_segments * tile - 1) // (n_segments * tile) * tile  # tokens per segment
    active = torch.where(span > 0, (lens + span - 1) // span.clamp(min=1), 0)
    written = (torch.arange(n_segments, device=lens.device) < active)[:, None, :]  # (R, 1, S)
    has_keys = written & (segm_expsum > 0)
    expsum = torch.where(has_keys, segm_expsum, 1.0)
    # Each segment normalized, with its natural-log LSE (-inf where it saw no key).
    seg_lse = torch.where(has_keys, segm_max * LN2 + torch.log(expsum), -math.inf)
    seg_out = segm_out[..., :out.shape[-1]] / expsum[..., None]
    merged, merged_lse = combine(list(seg_out.unbind(-2)), list(seg_lse.unbind(-1)))
    out.copy_(merged)
    if lse is not None:
        lse.copy_(merged_lse)


class SegmentedRoute(_AiterRoute):
    """DCP verify: each verify token a one-query row whose KV length is its causal window."""

    id = "segmented/aiter"
    family = "segmented"

    def prepare(self, problem: MLAProblem, inputs: DecodeInputs | PrefillInputs, *,
                rank: int = 0, params: Params | None = None, want_lse: bool = True) -> Prepared:
        if not isinstance(inputs, DecodeInputs):
            raise ValueError(f"{self.id} serves decode problems only")
        segmented = load("segmented")
        shard = inputs.shards[rank]
        device = inputs.q.device
        tile = min(tables.SEGMENTED_MAX_TILE, problem.page_size)  # a power-of-two subpage
        per = problem.page_size // tile
        # Row t of a request sees global positions [0, len - qlen + t]; its local length is
        # this rank's round-robin share of that prefix (taken globally, then sharded).
        steps = torch.arange(1, problem.qlen + 1, device=device)
        visible = (inputs.seq_lens[:, None] - problem.qlen + steps).clamp(min=0)
        row_lens = shard_lengths(visible.flatten(), rank, problem.dcp_size)
        max_row = max(1, int(row_lens.max()))
        pages = -(-max_row // tile)
        table = shard.block_table.long().clamp(min=0)
        sub = (table[:, :, None] * per + torch.arange(per, device=device)).flatten(1)[:, :pages]
        row_table = sub.repeat_interleave(problem.qlen, dim=0).to(torch.int32).contiguous()
        qo_indptr = torch.arange(row_lens.numel() + 1, dtype=torch.int32, device=device)
        kv = shard.kv_cache.view(-1, tile, 1, shard.kv_cache.shape[-1])
        q = inputs.q
        # fp8 queries go in as bf16 times their scale, as the seed does.
        q_rows = torch.empty(q.shape, dtype=torch.bfloat16, device=device) \
            if problem.q_dtype in FP8_DTYPES else q
        out = torch.empty(q.shape[0], problem.kernel_heads, problem.d_v,
                          dtype=DTYPES[problem.out_dtype], device=device)
        lse = torch.empty(q.shape[0], problem.kernel_heads, dtype=torch.float32,
                          device=device) if want_lse else None

        def run() -> None:
            if q_rows is not q:
                q_rows.copy_(q.to(torch.bfloat16) * inputs.q_scale)
            partials = segmented(q_rows, kv, None, qo_indptr, row_lens, max_row, row_table,
                                 inputs.softmax_scale, problem.kv_lora_rank, problem.rope_dim,
                                 causal=True, q_descale=None, kv_descale=inputs.kv_scale,
                                 skip_reduce=True)
            if not (isinstance(partials, tuple) and len(partials) == 3):
                raise RuntimeError("AITER's segmented decode returned no segment partials "
                                   "(skip_reduce=True must give (output, max, expsum))")
            merge_segments_into(out, lse, *partials, row_lens, tile)

        return Prepared(run, out, lse, graph_safe=True, params={"tile": tile},
                        plan_reads_lengths=True)


# --- FP8 persistent-scheduling prefill --------------------------------------------------
class Fp8PrefillRoute(_AiterRoute):
    """FP8 prefill: get_ps_metadata_v1 plans, mla_prefill_ps_asm_fwd runs, mla_reduce_v1 merges."""

    id = "fp8-ps/aiter"
    family = "fp8-ps"

    def prepare(self, problem: MLAProblem, inputs: DecodeInputs | PrefillInputs, *,
                rank: int = 0, params: Params | None = None, want_lse: bool = True) -> Prepared:
        kernel = capability.fp8_prefill_heads(problem.num_heads)
        if kernel is None or not isinstance(inputs, PrefillInputs):
            raise ValueError(f"{self.id} cannot serve {problem.key}")
        heads = HeadPlan(problem.num_heads, kernel)
        prefill, reduce = load("prefill"), load("reduce")
        device = inputs.q.device
        tokens = inputs.q.shape[0]
        cu = inputs.cu_seqlens_q  # KV is the new tokens: kv_indptr is the same CSR
        schedule, partial_tiles = _prefill_schedule(problem, cu, kernel)
        kv_indices = torch.arange(tokens, dtype=torch.int32, device=device)
        tile = tables.FP8_PREFILL_TILE_Q
        logits = torch.empty(partial_tiles * tile, kernel, problem.d_v, dtype=torch.float32,
                             device=device)
        attn_lse = torch.empty(partial_tiles * tile, kernel, dtype=torch.float32, device=device)
        final_lse = torch.empty(tokens, kernel, dtype=torch.float32, device=device)
        out = torch.empty(tokens, kernel, problem.d_v, dtype=torch.bfloat16, device=device)
        q, k, v = (heads.padded(t) for t in (inputs.q, inputs.k, inputs.v))  # padded buffers
        max_q = int((cu[1:] - cu[:-1]).max())

        def run() -> None:
            if heads.method != "none":
                for dst, src in ((q, inputs.q), (k, inputs.k), (v, inputs.v)):
                    heads.pad_into(dst, src)
            prefill(q, k, v, cu, cu, kv_indices, schedule["work_indptr"], schedule["work_info"],
                    max_q, inputs.softmax_scale, True, logits, attn_lse, out,
                    inputs.q_scale, inputs.k_scale, inputs.v_scale)
            # num_kv_splits 0: the kernel's default (one per CU), as the seed passes it.
            reduce(logits, attn_lse, schedule["reduce_indptr"], schedule["reduce_final_map"],
                   schedule["reduce_partial_map"], tile, 0, out, final_lse)

        return Prepared(run, heads.real_heads(out),
                        heads.real_heads(final_lse) if want_lse else None, graph_safe=True,
                        params={"kernel_heads": kernel, "padding": heads.method},
                        plan_reads_lengths=True)


def _prefill_schedule(problem: MLAProblem, cu: torch.Tensor, kernel_heads: int
                      ) -> tuple[dict[str, torch.Tensor], int]:
    """Plan the prefill on the host (get_ps_metadata_v1 takes CPU CSR) and move it over."""
    info, plan = load("ps_metadata.info"), load("ps_metadata")
    cu_host = cu.cpu().to(torch.int32)
    seq_lens = (cu_host[1:] - cu_host[:-1]).to(torch.int32)
    sizes = info(batch_size=problem.batch, num_head_k=kernel_heads,
                 max_qlen=int(seq_lens.max()), qlen_granularity=tables.FP8_PREFILL_TILE_Q)
    pin = cu.device.type == "cuda"
    work_metadata = torch.empty(sizes[0][0], dtype=sizes[0][1], device=cu.device)
    host = [torch.empty(size, dtype=dtype, pin_memory=pin) for size, dtype in sizes[1:]]
    plan(cu_host, cu_host.clone(), seq_lens, 1, kernel_heads, work_metadata, *host,
         qhead_granularity=1, qlen_granularity=tables.FP8_PREFILL_TILE_Q,
         kvlen_granularity=tables.FP8_PREFILL_KV_GRANULARITY, block_size=1, is_causal=True)
    names = ("work_indptr", "work_info", "reduce_indptr", "reduce_final_map",
             "reduce_partial_map")
    schedule = {name: t.to(cu.device) for name, t in zip(names, host, strict=True)}
    return schedule, int(host[2][-1])  # reduce_indptr's last entry: partial tiles used


AITER_ROUTES = (GluonRoute(), PaddedAsmRoute(), CprrRoute(), SegmentedRoute(), Fp8PrefillRoute())
