"""How a route's launch spreads its work over the SMs: the terms of the predictor's cost law.

``mlatune.dispatch.predict`` fits ``t = a + c W + d B + e C`` per recipe, where ``W`` is the
KV tokens one SM walks in turn and ``C`` the programs (work items) per SM. A route says how
its launch makes them by returning one of these from ``Route.launch_geometry``; a route
that returns None is taken as balanced (``W = B x KV / SMs``, ``C = B / SMs``).

- ``SplitKV``: batch x row blocks x KV splits programs in waves over the SMs, each wave as
  long as one program's share in whole ``block_n`` tiles, the split as the route's rule
  sizes it; persistent (no split key): the same work spread evenly.
- ``ListedSplits``: launched as ``SplitKV``, but the route's parameter list offers several
  splits, each swept, and the law chooses among them at an asked shape.
- ``RequestRounds``: whole requests (cut into capped chunks) handed out in rounds over
  clusters of SMs, as FlashInfer's MLA plan does.
- ``EvenBlocks``: an even share of the requests' 64-key blocks per SM part with a fixed
  overhead per request, as FlashMLA's metadata does.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Protocol

from mlatune.arch import DeviceInfo
from mlatune.problem import MLAProblem

MAX_SPLIT = 128  # the split-KV routes' largest split


class LaunchGeometry(Protocol):
    """What the predictor reads of a launch (attributes as on ``SplitKV``)."""

    key: str | None  # the parameter holding the split it ran with; None: nothing split
    sized: str | None  # the sized parameter the predictor redoes; None: none
    balanced: bool  # its law at a shape needs no launch evaluated there
    chooses: bool  # the law chooses the split among ``splits`` (else the rule's)
    per_batch: float  # programs per request
    c_fixed: float  # C's least constant (programs an SM runs whatever the batch)

    def bound_w(self, cus: int) -> float:
        """W's least per B x KV token, for the law's lower bound."""
        ...

    def split(self, problem: MLAProblem, device: DeviceInfo) -> int | None: ...

    def features(self, problem: MLAProblem, split: int | None, cus: int
                 ) -> tuple[float, float]: ...


class SplitKV:
    """A split-KV launch: programs per request and the route's split rule (``rule``: the
    split it gives a problem on a device for this tile)."""

    __slots__ = (
        "balanced",
        "block_n",
        "key",
        "own_rule",
        "owner",
        "per_batch",
        "rule",
        "sized",
        "tile",
    )
    chooses = False  # whether its law chooses the split among ``splits`` (else the rule's)
    c_fixed = 0.0

    def __init__(self, owner: object, rule: Callable[[MLAProblem, DeviceInfo], int],
                 tile: dict, sized: str, persistent: bool, per_batch: float):
        self.owner = owner  # whose rule: geometries of one owner and tile split alike
        self.rule, self.tile, self.sized, self.per_batch = rule, tile, sized, per_batch
        self.key = None if persistent else sized  # the split it runs with (None: none)
        self.balanced = persistent  # its law at a shape needs no launch evaluated there
        self.block_n = int(tile["block_n"])
        # Whether ``fill`` gives what the route's rule gives (checked at every point the
        # bucket measured); the route's own rule is asked where it does not.
        self.own_rule = True

    def bound_w(self, cus: int) -> float:
        return self.per_batch / cus

    def route_split(self, problem: MLAProblem, device: DeviceInfo) -> int:
        """The split the route's rule gives this tile at ``problem`` (the device-filling)."""
        return int(self.rule(problem, device))

    def fill(self, problem: MLAProblem, cus: int) -> int:
        """The split-KV family's rule, in a few operations: the least power of two up to
        MAX_SPLIT whose programs fill the SMs, no more than the KV has tiles."""
        programs = self.per_batch * problem.batch
        most = min(MAX_SPLIT, max(1, -(-problem.shard_len // self.block_n)))
        split = 1
        while programs * split < cus and split * 2 <= most:
            split *= 2
        return split

    def split(self, problem: MLAProblem, device: DeviceInfo) -> int:
        if self.own_rule:
            return self.fill(problem, device.cu_count)
        return self.route_split(problem, device)

    def splits(self, problem: MLAProblem, device: DeviceInfo) -> tuple[int, ...]:
        """The splits its law chooses among at ``problem``: the rule's alone."""
        return (self.split(problem, device),)

    def features(self, problem: MLAProblem, split: int | None, cus: int) -> tuple[float, float]:
        """(W, C): KV tokens an SM walks in turn, programs per SM (the module doc)."""
        programs = self.per_batch * problem.batch
        if split is None:  # persistent: the same work, spread evenly
            return programs * problem.shard_len / cus, programs / cus
        ctas = programs * split
        per_program = -(-problem.shard_len // (split * self.block_n)) * self.block_n
        return math.ceil(ctas / cus) * per_program, ctas / cus


class ListedSplits(SplitKV):
    """A split-KV route whose parameter list offers several splits (``wgmma/gluon``: its
    rule's pick, half and twice it, ``gluon_hopper_plan.pick_splits``), each swept: its law
    chooses among them at an asked shape (the waves and per-split cost each makes),
    rather than carrying a neighbour's winner over relative to the rule's pick, which
    lands on a poor split where the batch changes the wave count."""

    __slots__ = ("listed",)
    chooses = True

    def __init__(self, owner: object, listed: Callable[[MLAProblem, DeviceInfo], list[int]],
                 tile: dict, sized: str, per_batch: float):
        super().__init__(owner, lambda p, d: listed(p, d)[0], tile, sized, False, per_batch)
        self.listed = listed

    def fill(self, problem: MLAProblem, cus: int) -> int:
        return self.route_split(problem, _device_with(cus))

    def split(self, problem: MLAProblem, device: DeviceInfo) -> int:
        return self.route_split(problem, device)

    def splits(self, problem: MLAProblem, device: DeviceInfo) -> tuple[int, ...]:
        return tuple(int(s) for s in self.listed(problem, device))


def _device_with(cus: int) -> DeviceInfo:
    return DeviceInfo("sm_90", "", "nvidia", cus, 0, 0)


class RequestRounds:
    """How FlashInfer's MLA decode (``fa3/flashinfer``, ``fa2/flashinfer``) spreads the work:
    its host plan (``MLAPlan`` in FlashInfer's ``attention/scheduler.cuh``) packs each
    request's qlen x heads rows into 64-row tiles (128-row two-CTA clusters, half as many,
    past 64 rows), cuts each tile's KV into chunks of at most ``kv_len_limit`` (the mean
    KV per cluster, rounded up to 256) and hands the chunks out, in order, each to the
    least loaded cluster. A request whose KV fits under the cap stays whole: past one per
    cluster, a batch that leaves the last round nearly empty costs a whole round (batch
    160 on 132 SMs: two)."""

    __slots__ = ("clusters", "per_batch")
    key = sized = None  # nothing sized
    balanced = chooses = False
    c_fixed = 0.0

    def bound_w(self, cus: int) -> float:
        return self.per_batch / cus

    def __init__(self, problem: MLAProblem, cus: int):
        rows = problem.qlen * problem.kernel_heads
        cluster = 2 if rows > 64 else 1
        self.clusters = max(1, cus // cluster)
        self.per_batch = float(-(-rows // (64 * cluster)))  # tiles per request

    def split(self, problem: MLAProblem, device: DeviceInfo) -> None:
        return None

    def features(self, problem: MLAProblem, split: None, cus: int) -> tuple[float, float]:
        """(the most KV a cluster walks, in SM units; chunks per SM)."""
        tiles = int(self.per_batch) * problem.batch
        longest, chunks = _plan_makespan(tiles, problem.shard_len, self.clusters)
        return longest * self.clusters / cus, chunks / cus


class EvenBlocks:
    """How FlashMLA's decode (``dense/flashmla``) spreads the work: its metadata
    (``get_mla_metadata``) gives each of ``SMs / ceil(qlen x heads / 64)`` SM parts an even
    share of the requests' 64-key blocks, each request charged 5 blocks more (its fixed
    overhead), plus 5; a request cut over several parts is merged by the combine kernel,
    which walks its pieces in turn. So (W, C) here are the keys one part walks (its share,
    overhead included) and the pieces a request is cut into: at batch 1 a request's KV is cut
    over every part, and the combine's walk makes batch 1 slower than batch 4 at 4,096 keys
    on the H200 (28.5 against 25.6 us, 16 heads), which a balanced law cannot follow."""

    __slots__ = ("parts",)
    key = sized = None  # nothing sized
    balanced = chooses = False
    per_batch = 0.0  # the lower bound's terms: W >= B x S / parts and C >= 1 (c_fixed)
    c_fixed = 1.0
    OVERHEAD = 5  # blocks a request costs a part (FlashMLA's fixed_overhead_num_blocks)

    def __init__(self, problem: MLAProblem, cus: int):
        self.parts = max(1, cus // -(-problem.qlen * problem.kernel_heads // 64))

    def split(self, problem: MLAProblem, device: DeviceInfo) -> None:
        return None

    def bound_w(self, cus: int) -> float:
        """W's least per B x S token (W >= B S / parts)."""
        return 1.0 / self.parts

    def features(self, problem: MLAProblem, split: None, cus: int) -> tuple[float, float]:
        blocks = -(-problem.shard_len // 64)
        share = -(-problem.batch * (blocks + self.OVERHEAD) // self.parts)  # blocks a part
        return 64.0 * (share + self.OVERHEAD), float(-(-blocks // share))


def _plan_makespan(tiles: int, kv: int, clusters: int) -> tuple[int, int]:
    """(the largest KV a cluster gets, the chunks) when ``tiles`` tiles of ``kv`` tokens
    each are cut and handed out as FlashInfer's MLAPlan does, without playing it chunk by
    chunk: each round gives the next chunks in order to all the clusters at the least
    load (a tile's chunks are full ones, then its remainder)."""
    mean = -(-tiles * kv // clusters)
    limit = 32 if mean <= 8 else 64 if mean <= 16 else 128 if mean <= 32 else \
        192 if mean <= 64 else -(-mean // 256) * 256
    if kv <= limit:  # whole tiles, in rounds over the clusters
        return -(-tiles // clusters) * kv, tiles
    per_tile = -(-kv // limit)
    rest = kv - (per_tile - 1) * limit
    total = tiles * per_tile
    loads = {0: clusters}  # load -> clusters at it
    given = 0
    while given < total:
        least = min(loads)
        count = loads.pop(least)
        take = min(count, total - given)
        rests = (given + take) // per_tile - given // per_tile  # a tile's last chunk
        if count > take:
            loads[least] = count - take
        if take > rests:
            loads[least + limit] = loads.get(least + limit, 0) + take - rests
        if rests:
            loads[least + rest] = loads.get(least + rest, 0) + rests
        given += take
    return max(loads), total
