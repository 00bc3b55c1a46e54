"""Portable Triton decode routes: ``padded``, ``gluon``, ``cprr`` and ``segmented`` families.

Each family follows the seed's route of the same name (vLLM's ROCm AITER MLA
backend) in what it computes and how it lays the work out, on kernels of our
own (``mlatune.kernels``) that run wherever Triton does:

- ``padded/triton``: query heads padded to a multiple of 16 the seed's way
  (repeat_interleave for divisors of 16, tile-and-slice otherwise), the
  padded rows computed and sliced off out and LSE; split-KV plus a reduce with
  ``num_splits`` tuned, or ``persistent: true``: a host-planned work list over
  the SMs. Any DCP size: causality is applied on global positions.
- ``gluon/triton``: fewer than 16 kernel heads, decode and causal verify
  (qlen <= 8), no DCP: heads x qlen folded into the rows, no padding.
- ``cprr/triton``: DCP decode and verify over the round-robin shard, heads
  padded to 16/32/64/128, causal window applied in the kernel from the global
  lengths, cp_rank and cp_world_size.
- ``segmented/triton``: DCP causal verify: one single-query row group per
  verify token with its local window length computed on the device; KV walked in
  segments of page-dividing tiles; (out, LSE) partials merged by a second
  kernel. ``fold: true`` puts a request's verify tokens in one row group instead
  (qlen x heads rows sharing each KV tile, each row masked to its own window), as
  the other families always do.

Over an fp8 cache the kernels upcast each tile to q's 16-bit type (fp16 for an
fp8 q, exactly) and quantize nothing, so every set's ``rounding`` is NONE
(docs/kernels/triton_decode.md has the fp8-MMA form that lost to this path).

The padding is applied as an index map when q rows are loaded and when results
are stored (``kernels.attend``) instead of through copies: the kernels compute
exactly the seed's padded rows, without the copy kernels around them.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

import torch

from mlatune.arch import DeviceInfo, device_of
from mlatune.capability import tables
from mlatune.check.inputs import DecodeInputs, PrefillInputs
from mlatune.problem import DTYPES, MLAProblem, next_power_of_two
from mlatune.routes.base import (
    DEVICE_PLANNED,
    LAUNCH_ONLY,
    SPLIT_LIMIT,
    TILE_LIMITS,
    Params,
    Prepared,
    Route,
    SharedPlan,
    StepKind,
    Verdict,
    plan_key,
    shared_buffers,
)
from mlatune.routes.geometry import SplitKV
from mlatune.routes.triton_support import triton_verdict

# Which problems each family serves is the capability model's (capability.rules, the
# ``*/triton`` entries); these are the numbers the kernels are laid out with.
PAD_MULTIPLE = tables.TRITON_PAD_MULTIPLE  # the padded family's head granularity
CPRR_HEADS = tables.TRITON_CPRR_HEADS  # the head counts cprr pads to
SPLIT_CHOICES = (1, 2, 4, 8, 16, 32, 64, 128)
MAX_BLOCK_M = 64  # a 64 x 512 fp32 accumulator already fills two warpgroups' registers

# Tile configurations the interpreter runs fast enough for CI.
_CPU_TILES = ({"block_m": 16, "block_n": 16, "num_warps": 4, "num_stages": 1},)


def row_padding(q_heads: int, target: int) -> tuple[int, int]:
    """(row_heads, head_rep) of the seed's padding of ``q_heads`` to ``target`` heads.

    Divisors of the target are repeat_interleaved (each head repeated
    ``target // q_heads`` times, the copies next to each other); other counts
    are tiled and sliced to ``target`` (head h of the padded block is
    ``h % q_heads``); a count already at the target is untouched.
    """
    if target == q_heads:
        return q_heads, 1
    if target % q_heads == 0:
        return target, target // q_heads
    return target, 1


class _TritonDecodeRoute(Route):
    """The shared shape of the split-KV families; subclasses say which heads and problems."""

    id = ""
    sized_params = ("num_splits",)  # derived from batch and KV length (base.params_at)
    param_limits = MappingProxyType({"num_splits": SPLIT_LIMIT, **TILE_LIMITS})

    # -- family rules: capability.rules ----------------------------------------------
    def _padded_heads(self, problem: MLAProblem) -> int:
        """Heads per token the kernel's rows hold (the padding target)."""
        raise NotImplementedError

    def supports(self, problem: MLAProblem, device: DeviceInfo) -> Verdict:
        return triton_verdict(self.id, problem, device)

    # -- parameters -----------------------------------------------------------------
    def _rows_per_group(self, problem: MLAProblem) -> int:
        return problem.qlen * self._padded_heads(problem)

    def _groups(self, problem: MLAProblem) -> int:
        return problem.batch

    def _tile_choices(self, problem: MLAProblem, device: DeviceInfo) -> list[Params]:
        if not device.is_gpu:
            return [dict(t) for t in _CPU_TILES]
        block_m = min(MAX_BLOCK_M, max(16, next_power_of_two(self._rows_per_group(problem))))
        if block_m == 64:  # two warpgroups share the 64 x 512 accumulator
            return [{"block_m": 64, "block_n": 64, "num_warps": 8, "num_stages": 1},
                    {"block_m": 64, "block_n": 32, "num_warps": 8, "num_stages": 2},
                    {"block_m": 64, "block_n": 32, "num_warps": 8, "num_stages": 3}]
        return [{"block_m": block_m, "block_n": 32, "num_warps": 4, "num_stages": 3},
                {"block_m": block_m, "block_n": 64, "num_warps": 4, "num_stages": 2},
                {"block_m": block_m, "block_n": 32, "num_warps": 4, "num_stages": 4}]

    def _split_choices(self, problem: MLAProblem, device: DeviceInfo, tiles: Params) -> list[int]:
        """Split counts around the smallest that fills the device, where the keys allow them;
        that one first."""
        groups, rows = self._groups(problem), self._rows_per_group(problem)
        if tiles.get("fold"):  # segmented: a request's tokens in one row group
            groups, rows = problem.batch, problem.qlen * problem.kernel_heads
        programs = groups * -(-rows // tiles["block_m"])
        max_splits = max(1, -(-problem.shard_len // tiles["block_n"]))
        usable = [s for s in SPLIT_CHOICES if s <= max_splits]
        fill = next((s for s in usable if programs * s >= device.cu_count), usable[-1])
        i = usable.index(fill)
        return [fill, *usable[max(0, i - 1):i], *usable[i + 1:i + 2]]

    def _variants(self, problem: MLAProblem, device: DeviceInfo, tiles: list[Params]
                  ) -> list[Params]:
        """Options beyond tiles and splits, most promising first (padded adds persistent)."""
        # The tile loaded twice (transposed for the scores, upright for the values).
        return [{**tiles[0], "kv_twice": True}] if device.is_gpu else []

    def param_space(self, problem: MLAProblem, device: DeviceInfo) -> list[Params]:
        """Most promising first, so a sweep that keeps the first N still tries each option:
        every tile at its device-filling split, the variants, then the other splits."""
        tiles = [{**t, "num_splits": self._split_choices(problem, device, t)[0]}
                 for t in self._tile_choices(problem, device)]
        variants = self._variants(problem, device, tiles)
        other_splits = [{**t, "num_splits": s} for t in tiles
                        for s in self._split_choices(problem, device, t)[1:]]
        return [*tiles[:2], *variants, *tiles[2:], *other_splits]

    def launch_geometry(self, problem: MLAProblem, recipe: Mapping[str, Any], cus: int
                        ) -> SplitKV | None:
        """batch x row blocks x splits programs, split by ``_split_choices``'s first pick."""
        if len(self.sized_params) != 1 or "block_m" not in recipe or "block_n" not in recipe:
            return None
        blocks = -(-int(self._rows_per_group(problem)) // int(recipe["block_m"]))
        per_batch = self._groups(problem) * blocks / problem.batch
        tile = {k: v for k, v in recipe.items() if k != "persistent"}
        return SplitKV(self, lambda p, d: self._split_choices(p, d, tile)[0], tile,
                       self.sized_params[0], bool(recipe.get("persistent")), per_batch)

    def _resolve(self, problem: MLAProblem, params: Params | None, device: DeviceInfo) -> Params:
        chosen = dict(self.param_space(problem, device)[0])
        chosen.update(params or {})
        return chosen

    # -- preparation ----------------------------------------------------------------
    writes_into = True  # prepare takes the caller's out= and lse= buffers
    shares_plan = True  # prepare takes plan_from= (another layer's device plan)

    def prepare(self, problem: MLAProblem, inputs: DecodeInputs | PrefillInputs, *,
                rank: int = 0, params: Params | None = None, want_lse: bool = True,
                out: torch.Tensor | None = None, lse: torch.Tensor | None = None,
                plan_from: Prepared | None = None) -> Prepared:
        if not isinstance(inputs, DecodeInputs):
            raise TypeError(f"{self.id} serves decode inputs, got {type(inputs).__name__}")
        device = device_of(inputs.q)
        chosen = self._resolve(problem, params, device)
        _check_layouts(inputs, rank)
        if out is None:
            out = torch.empty(inputs.q.shape[0], problem.kernel_heads, problem.d_v,
                              dtype=DTYPES[problem.out_dtype], device=inputs.q.device)
        if lse is None and want_lse:
            lse = torch.empty(inputs.q.shape[0], problem.kernel_heads, dtype=torch.float32,
                              device=inputs.q.device)
        key = plan_key(self.id, problem, chosen, rank, inputs.seq_lens,
                       inputs.shards[rank].block_table)
        shared = shared_buffers(plan_from, key) if self._plan_reads_lengths(chosen) else None
        step = self._plan(problem, inputs, rank, chosen, out, lse, device, shared)
        if step.plan is not None and shared is None:
            step.plan()  # planned for the lengths at hand: ``run`` is valid at once

        def run() -> None:
            for launch in step.launches:
                launch()

        state = None if step.plan is None else SharedPlan(key, step.buffers, step.plan)
        return Prepared(run, out, lse, graph_safe=True, params=chosen,
                        plan_reads_lengths=self._plan_reads_lengths(chosen), plan=step.plan,
                        plan_state=state)

    def _plan_reads_lengths(self, params: Params) -> bool:
        """Split-KV reads the lengths in the kernel; the persistent work list is planned
        from them, on the device, every step."""
        return bool(params.get("persistent"))

    def step_kind(self, params: Params) -> StepKind:
        return DEVICE_PLANNED if self._plan_reads_lengths(params) else LAUNCH_ONLY

    def _plan(self, problem: MLAProblem, inputs: DecodeInputs, rank: int, params: Params,
              out: torch.Tensor, lse: torch.Tensor | None, device: DeviceInfo,
              shared: SharedPlan | None = None) -> _Step:
        # triton: when a step is made
        from mlatune.kernels.reduce import reduce_launcher
        from mlatune.kernels.split_kv import RowLayout, split_kv_launcher

        row_heads, head_rep = row_padding(problem.kernel_heads, self._padded_heads(problem))
        layout = RowLayout(problem.qlen, problem.kernel_heads, row_heads, head_rep)
        tiles = _tile_config(params)
        shard = inputs.shards[rank]
        dev = inputs.q.device
        common = dict(layout=layout, rank=rank, world=problem.dcp_size, causal=problem.causal,
                      sm_scale=inputs.softmax_scale, tiles=tiles)
        tensors = (inputs.q, shard.kv_cache, shard.block_table, inputs.seq_lens,
                   inputs.q_scale, inputs.kv_scale)
        reduce_args = dict(tokens_per_group=problem.qlen, q_heads=problem.kernel_heads,
                           row_heads=row_heads, head_rep=head_rep)
        if params.get("persistent"):
            return _persistent_step(problem, inputs, rank, params, out, lse, device, tensors,
                                    common, reduce_args, shared)
        splits = params["num_splits"]
        if splits == 1:
            return _Step([split_kv_launcher(*tensors, **common, num_splits=1, out=out, lse=lse)])
        part_out, part_lse = _partials(problem.batch * splits, layout.rows, problem.d_v, dev)
        split_indptr = torch.arange(problem.batch + 1, dtype=torch.int32, device=dev) * splits
        return _Step([
            split_kv_launcher(*tensors, **common, num_splits=splits, part_out=part_out,
                              part_lse=part_lse),
            reduce_launcher(part_out, part_lse, split_indptr, out, lse, **reduce_args,
                            max_slots=splits, uniform=True),
        ])


def _tile_config(params: Params, block_n: int | None = None):
    from mlatune.kernels.split_kv import TileConfig  # triton: when a step is made

    return TileConfig(params["block_m"], block_n or params["block_n"], params["num_warps"],
                      params["num_stages"], bool(params.get("kv_twice")))


@dataclass
class _Step:
    """A prepared step: launches that read only device buffers, and the device plan that
    refills the buffers derived from the lengths (None: the launches read the lengths)."""

    launches: list[Callable[[], None]]
    plan: Callable[[], None] | None = None
    buffers: tuple = ()  # what ``plan`` fills, for other layers' launches (SharedPlan)


def _persistent_step(problem: MLAProblem, inputs: DecodeInputs, rank: int, params: Params,
                     out: torch.Tensor, lse: torch.Tensor | None, device: DeviceInfo,
                     tensors: tuple, common: dict, reduce_args: dict,
                     shared: SharedPlan | None) -> _Step:
    """The persistent schedule: a device-planned work list over ``num_workers`` programs,
    sized for any lengths up to the problem's (so a captured graph replays with new ones);
    ``shared``: another layer's, read instead of planning here."""
    from mlatune.kernels.plan import (  # triton: when a step is made
        allocate_plan_buffers,
        max_slots_bound,
        persistent_plan_launcher,
        work_capacity,
    )
    from mlatune.kernels.reduce import reduce_launcher  # triton: when a step is made
    from mlatune.kernels.split_kv import persistent_launcher  # triton: when a step is made

    layout, tiles = common["layout"], common["tiles"]
    row_blocks = -(-layout.rows // tiles.block_m)
    workers = params.get("num_workers") or max(1, device.cu_count // row_blocks)
    dev = inputs.q.device
    if shared is None:
        work, work_indptr, split_indptr = allocate_plan_buffers(problem.batch, workers, dev)
        plan = persistent_plan_launcher(inputs.seq_lens, rank=rank, world=problem.dcp_size,
                                        block_n=tiles.block_n, workers=workers, work=work,
                                        work_indptr=work_indptr, split_indptr=split_indptr)
    else:
        (work, work_indptr, split_indptr), plan = shared.buffers, shared.plan
    part_out, part_lse = _partials(work_capacity(problem.batch, workers), layout.rows,
                                   problem.d_v, dev)
    # The reduce merges any slot count; the hint sizes its slot block for the usual one:
    # a request's share of the workers, plus one for a cut at each end.
    max_slots = min(max_slots_bound(workers, problem.shard_len, tiles.block_n),
                    -(-workers // problem.batch) + 1)
    return _Step([
        persistent_launcher(*tensors, **common, work=work, work_indptr=work_indptr,
                            part_out=part_out, part_lse=part_lse),
        reduce_launcher(part_out, part_lse, split_indptr, out, lse, **reduce_args,
                        max_slots=max_slots),
    ], plan, (work, work_indptr, split_indptr))


def _int32(values: list[int], device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int32, device=device)


def _partials(slots: int, rows: int, d_v: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    return (torch.empty(slots, rows, d_v, dtype=torch.float32, device=device),
            torch.empty(slots, rows, dtype=torch.float32, device=device))


def _check_layouts(inputs: DecodeInputs, rank: int) -> None:
    """The kernels index rows by stride and assume unit strides inside a row."""
    shard = inputs.shards[rank]
    if inputs.q.stride(-1) != 1 or shard.kv_cache.stride(-1) != 1 \
            or shard.block_table.stride(-1) != 1:
        raise ValueError("q, kv_cache and block_table need a contiguous last dimension")
    if shard.kv_cache.stride(1) != shard.kv_cache.shape[-1] or not shard.kv_cache.is_contiguous():
        raise ValueError("kv_cache must be contiguous (pages, page_size, d_qk)")


class PaddedTritonRoute(_TritonDecodeRoute):
    """Heads padded to a multiple of 16; split-KV + reduce, or a persistent work list."""

    id = "padded/triton"

    def _padded_heads(self, problem: MLAProblem) -> int:
        return -(-problem.kernel_heads // PAD_MULTIPLE) * PAD_MULTIPLE

    def _variants(self, problem: MLAProblem, device: DeviceInfo, tiles: list[Params]
                  ) -> list[Params]:
        persistent = [{k: v for k, v in t.items() if k != "num_splits"} | {"persistent": True}
                      for t in tiles[:2]]
        return [persistent[0], *super()._variants(problem, device, tiles), *persistent[1:]]


class GluonTritonRoute(_TritonDecodeRoute):
    """Small-head (< 16) decode and causal verify: heads x qlen folded into rows, unpadded."""

    id = "gluon/triton"

    def _padded_heads(self, problem: MLAProblem) -> int:
        return problem.kernel_heads


class CprrTritonRoute(_TritonDecodeRoute):
    """DCP round-robin decode/verify, heads padded to 16/32/64/128, global causal window."""

    id = "cprr/triton"

    def _padded_heads(self, problem: MLAProblem) -> int:
        return next(h for h in CPRR_HEADS if h >= problem.kernel_heads)


class SegmentedTritonRoute(_TritonDecodeRoute):
    """DCP causal verify: one single-query row group per token, segment partials merged."""

    id = "segmented/triton"
    sized_params = ("num_segments",)
    param_limits = MappingProxyType({"num_segments": SPLIT_LIMIT, **TILE_LIMITS})

    def _padded_heads(self, problem: MLAProblem) -> int:
        return problem.kernel_heads

    def _rows_per_group(self, problem: MLAProblem) -> int:
        return problem.kernel_heads

    def _groups(self, problem: MLAProblem) -> int:
        return problem.batch * problem.qlen

    def _variants(self, problem: MLAProblem, device: DeviceInfo, tiles: list[Params]
                  ) -> list[Params]:
        """The verify tokens folded into the rows (``fold``): a request's tokens share one
        walk over its KV, each row masked to its own window, as padded and cprr do."""
        if not device.is_gpu:
            return []
        rows = problem.qlen * problem.kernel_heads
        block_m = min(MAX_BLOCK_M, max(16, next_power_of_two(rows)))
        folded = ([{"block_m": 64, "block_n": 64, "num_warps": 8, "num_stages": 1}]
                  if block_m == 64 else
                  [{"block_m": block_m, "block_n": 32, "num_warps": 4, "num_stages": 3}])
        folded = [{**t, "fold": True} for t in folded]
        folded = [{**t, "num_splits": self._split_choices(problem, device, t)[0]} for t in folded]
        return [*folded, *super()._variants(problem, device, tiles)]

    def param_space(self, problem: MLAProblem, device: DeviceInfo) -> list[Params]:
        space = []
        for p in super().param_space(problem, device):
            segments = p.pop("num_splits")
            space.append({**p, "num_segments": segments})
        return space

    def _plan_reads_lengths(self, params: Params) -> bool:
        return True  # row lengths (causal windows per rank) and the subpage table, per step

    def _plan(self, problem: MLAProblem, inputs: DecodeInputs, rank: int, params: Params,
              out: torch.Tensor, lse: torch.Tensor | None, device: DeviceInfo,
              shared: SharedPlan | None = None) -> _Step:
        from mlatune.kernels.reduce import reduce_launcher  # triton: when a step is made
        from mlatune.kernels.segmented import (  # triton: when a step is made
            segment_tile,
            segmented_launcher,
            segmented_plan_launcher,
        )

        shard = inputs.shards[rank]
        dev = inputs.q.device
        page = problem.page_size
        tile = segment_tile(page)
        # The tile is the subpage; the dot needs at least 16 keys, so tiles of
        # small pages span several subpages (looked up key by key).
        tiles = _tile_config(params, min(tile, params["block_n"]) if tile >= 16 else 16)
        kv = shard.kv_cache.view(-1, tile, shard.kv_cache.shape[-1])
        if shared is None:  # filled by ``plan`` from the lengths and block table, on the device
            table = torch.empty(shard.block_table.shape[0],
                                shard.block_table.shape[1] * page // tile,
                                dtype=shard.block_table.dtype, device=dev)
            lens = torch.empty(problem.batch * problem.qlen, dtype=torch.int32, device=dev)
            plan = segmented_plan_launcher(inputs.seq_lens, shard.block_table,
                                           qlen=problem.qlen, rank=rank, world=problem.dcp_size,
                                           page_size=page, tile=tile, row_lens=lens,
                                           subpage_table_out=table)
        else:
            (table, lens), plan = shared.buffers, shared.plan

        segments = params["num_segments"]
        fold = bool(params.get("fold"))
        heads = problem.kernel_heads
        # Row groups: the requests (qlen * heads rows each) when folded, else the tokens.
        groups, tokens = (problem.batch, problem.qlen) if fold else (lens.shape[0], 1)
        slots, rows = groups * segments, tokens * heads
        seg_out = torch.empty(slots, rows, problem.d_v, dtype=torch.float32, device=dev)
        seg_lse = torch.empty(slots, rows, dtype=torch.float32, device=dev)
        split_indptr = torch.arange(groups + 1, dtype=torch.int32, device=dev) * segments
        return _Step([
            segmented_launcher(inputs.q, kv, table, lens, inputs.q_scale, inputs.kv_scale,
                               qlen=problem.qlen, sm_scale=inputs.softmax_scale, tiles=tiles,
                               num_segments=segments, seg_out=seg_out, seg_lse=seg_lse,
                               fold=fold),
            reduce_launcher(seg_out, seg_lse, split_indptr, out, lse,
                            tokens_per_group=tokens, q_heads=heads, row_heads=heads, head_rep=1,
                            max_slots=segments, uniform=True),
        ], plan, (table, lens))


TRITON_DECODE_ROUTES = (PaddedTritonRoute, GluonTritonRoute, CprrTritonRoute,
                        SegmentedTritonRoute)
