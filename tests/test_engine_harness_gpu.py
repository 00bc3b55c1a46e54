"""An engine backend's per-step call sequence over ``MLADecoder``, on a GPU (``pytest -m gpu``).

What a vLLM or SGLang backend does with ``mlatune.integrations.core``, without the engine:
DeepSeek-V3's 61 attention layers at 16 heads a rank, each with its own paged cache (the
vLLM layout (pages, 64, 576), or SGLang's (pages, 64, 1, 576)) over one block table; three
batch buckets sliced from persistent buffers, each warmed up eagerly and captured as a CUDA
graph (begin_step, then forward per layer: the first layer plans, the others reuse the
plan); then steps written in place (lengths with padded empty slots, a request shorter than
qlen, every slot empty, new queries) and the graph replayed. qlen 1 and 2, bf16 and fp8
caches (with their scale), the model's YaRN softmax scale, and DCP 2 simulated: two
decoders, one per rank over its round-robin shard, merged by their LSEs. Every warm-up and
replay is checked against the float64 reference at a sample of layers, outputs poisoned
first and NaN in the cache slots past each request's length; rows without keys are 0 and
-inf. Each rank's route per bucket is printed (run with -s) and must agree across ranks.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from dataclasses import dataclass, replace

import pytest
import torch

from mlatune import attention
from mlatune.check import reference
from mlatune.check.accuracy import check
from mlatune.check.inputs import DecodeInputs, KVShard, poison_, shard_lengths
from mlatune.integrations.core import MLADecoder, ServedModel
from mlatune.lse import combine
from mlatune.problem import DTYPES, MLAProblem

pytestmark = pytest.mark.gpu
LAYERS, HEADS, PAGE, CAP = 61, 16, 64, 1024  # CAP: each slot's capacity, the max_kv_len
BUCKETS = (2, 8, 32)
SAMPLED = (0, 30, 60)  # the layers checked: the planner, and two that read its plan
SCALE = 192 ** -0.5 * (0.1 * math.log(40.0) + 1.0) ** 2  # DeepSeek-V3's, YaRN factor 40
KV_SCALE = 0.02  # the fp8 cache holds value / KV_SCALE
FP8 = "fp8_e4m3fn"
# (qlen, cache dtype, dcp size, SGLang's 4-d cache layout)
CASES = [(1, "bf16", 1, False), (2, "bf16", 1, True), (1, FP8, 1, True), (2, FP8, 1, False),
         (1, "bf16", 2, False), (2, FP8, 2, True)]


@pytest.fixture(autouse=True)
def _needs_a_gpu():
    if not torch.cuda.is_available():  # fail, not skip: -m gpu without a GPU is no pass
        pytest.fail("GPU tests need a GPU: run them on the device machine")


def _steps(bucket: int, qlen: int, seed: int) -> list[list[int]]:
    """A bucket's lengths: the capture's (ragged, one at capacity), then the replays':
    every other slot padding, one request of a single token (shorter than qlen 2) among
    empty slots, every slot empty, ragged again."""
    rng = random.Random(seed)
    ragged = [CAP] + [rng.randint(qlen, CAP) for _ in range(bucket - 1)]
    padded = [rng.randint(qlen, CAP) if b % 2 == 0 else 0 for b in range(bucket)]
    single = [0] * (bucket - 1) + [1]
    again = [rng.randint(qlen, CAP) for _ in range(bucket)]
    return [ragged, padded, single, [0] * bucket, again]


@dataclass
class Rank:
    """One DCP rank's engine state: a decoder, a cache per layer, persistent buffers."""

    decoder: MLADecoder
    caches: list[torch.Tensor]  # per layer, in the engine's layout
    clean: dict[int, torch.Tensor]  # the sampled layers' caches before NaN is written
    pages: torch.Tensor  # (max bucket, pages a slot) each slot's page ids
    block_table: torch.Tensor  # persistent (max bucket, pages a slot), sliced per bucket
    seq_lens: torch.Tensor  # persistent (max bucket,) int32 global lengths
    kv_scale: torch.Tensor | None  # the fp8 cache's scale: one tensor, as a layer holds it


def _rank(model: ServedModel, kv: str, four_d: bool, seed: int) -> Rank:
    gen = torch.Generator(device="cuda").manual_seed(seed)
    share = int(shard_lengths(torch.tensor([CAP]), model.dcp_rank, model.dcp_size)[0])
    per_slot, slots = -(-share // PAGE), max(BUCKETS)
    total = slots * per_slot
    caches = []
    for _ in range(LAYERS):
        values = torch.randn(total, PAGE, 576, device="cuda", generator=gen)
        cache = (values / KV_SCALE).clamp(-448, 448).to(DTYPES[FP8]) if kv == FP8 \
            else values.to(torch.bfloat16)
        caches.append(cache.unsqueeze(2) if four_d else cache)
    pages = torch.randperm(total, device="cuda", generator=gen).to(torch.int32)
    return Rank(MLADecoder.load(model, device="cuda", engine="harness"), caches,
                {n: caches[n].clone() for n in SAMPLED}, pages.view(slots, -1),
                torch.zeros(slots, per_slot, dtype=torch.int32, device="cuda"),
                torch.zeros(slots, dtype=torch.int32, device="cuda"),
                torch.tensor([KV_SCALE], device="cuda") if kv == FP8 else None)


def _write(rank: Rank, lens: list[int]) -> None:
    """The step's lengths and block-table rows in place (an empty slot's row zero), and NaN
    in the sampled layers' cache slots past each request's share."""
    n, world, me = len(lens), rank.decoder.model.dcp_size, rank.decoder.model.dcp_rank
    live = torch.tensor([length > 0 for length in lens], device="cuda")
    rank.seq_lens[:n].copy_(torch.tensor(lens, dtype=torch.int32))
    rank.block_table[:n].copy_(torch.where(live[:, None], rank.pages[:n], 0))
    local = shard_lengths(torch.tensor(lens), me, world).tolist()
    for layer, clean in rank.clean.items():
        cache = rank.caches[layer]
        cache.copy_(clean)
        slots = cache.view(torch.uint8) if cache.element_size() == 1 else cache
        nan = 0x7F if cache.element_size() == 1 else float("nan")  # e4m3fn's NaN bits
        for b, length in enumerate(local):
            if lens[b] == 0:  # its row reads page 0, another slot's: left as it is
                continue
            for j, page in enumerate(rank.pages[b].tolist()):
                if length < (j + 1) * PAGE:
                    slots[page, max(0, length - j * PAGE):] = nan


def _forward_all(rank: Rank, n: int, qlen: int, queries: list[torch.Tensor], outs: list | None
                 ) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The engine's step for a bucket of ``n``: begin_step, then every layer's forward."""
    rank.decoder.begin_step(rank.block_table[:n], rank.seq_lens[:n], qlen=qlen,
                            max_kv_len=CAP)
    results = []
    for layer in range(LAYERS):
        out, lse = (None, None) if outs is None else outs[layer]
        results.append(rank.decoder.forward(queries[layer][:n * qlen], rank.caches[layer],
                                            kv_scale=rank.kv_scale, out=out, lse_out=lse))
    return results


def _check(ranks: list[Rank], n: int, qlen: int, queries, results, kv: str, what: str) -> None:
    """The sampled layers, the ranks' partials merged, against the float64 reference."""
    world = len(ranks)
    problem = MLAProblem(num_heads=HEADS, qlen=qlen, q_dtype="bf16", kv_dtype=kv, batch=n,
                         kv_len=CAP, page_size=PAGE, dcp_size=world)
    seq_lens = ranks[0].seq_lens[:n]
    for layer in SAMPLED:
        shards = tuple(KVShard(r, rank.caches[layer].view(-1, PAGE, 576),
                               rank.block_table[:n], shard_lengths(seq_lens, r, world))
                       for r, rank in enumerate(ranks))
        inputs = DecodeInputs(problem, queries[layer][:n * qlen], None, ranks[0].kv_scale, seq_lens,
                              shards, sm_scale=SCALE)
        want_out, want_lse = reference.run(inputs, torch.float64)
        parts = [result[layer] for result in results]
        out, lse = parts[0] if world == 1 else combine([o.float() for o, _ in parts],
                                                      [s for _, s in parts])
        accuracy = check(problem, out, want_out, lse, want_lse)
        assert accuracy.ok, f"{what}, layer {layer}: {accuracy.reason} ({accuracy.summary})"
        empty = torch.isneginf(want_lse)
        assert (out[empty] == 0).all(), f"{what}, layer {layer}: rows without keys"


def _capture(step: Callable[[], list]) -> tuple[torch.cuda.CUDAGraph, list]:
    """``step`` captured in a CUDA graph, and what it returned (the tensors a replay fills)."""
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        results = step()
    return graph, results


def _serve_bucket(ranks: list[Rank], n: int, qlen: int, queries, outs, kv: str) -> None:
    """Warm up, capture, then replay the bucket's later steps written in place."""
    steps = _steps(n, qlen, seed=n)
    for rank in ranks:
        _write(rank, steps[0])
    eager = [_forward_all(rank, n, qlen, queries, outs) for rank in ranks]
    torch.cuda.synchronize()
    _check(ranks, n, qlen, queries, eager, kv, f"bucket {n} eager, lengths {steps[0]}")
    made = [len(attention.plans_of(rank.decoder.dispatcher)) for rank in ranks]
    graphs, captured = zip(*(_capture(lambda rank=rank: _forward_all(rank, n, qlen, queries,
                                                                      outs))
                             for rank in ranks), strict=True)
    assert [len(attention.plans_of(rank.decoder.dispatcher)) for rank in ranks] == made, \
        "the capture made a step: the warm-up's must serve it"
    for lens in steps[1:]:
        for q in queries:
            q.normal_()  # this step's queries
        for rank, graph, results in zip(ranks, graphs, captured, strict=True):
            _write(rank, lens)
            # The engine's metadata step runs every step; a replay calls no forward.
            rank.decoder.begin_step(rank.block_table[:n], rank.seq_lens[:n], qlen=qlen,
                                    max_kv_len=CAP)
            for out, lse in results:
                poison_(out, lse)
            graph.replay()
        torch.cuda.synchronize()
        _check(ranks, n, qlen, queries, captured, kv, f"bucket {n} replayed, lengths {lens}")


@pytest.mark.parametrize(("qlen", "kv", "dcp", "four_d"), CASES,
                         ids=[f"q{q}-{kv}-dcp{d}{'-4d' if f else ''}" for q, kv, d, f in CASES])
def test_an_engines_steps_captured_and_replayed(qlen, kv, dcp, four_d):
    torch.manual_seed(qlen * 10 + dcp)
    model = ServedModel(num_heads=HEADS, softmax_scale=SCALE, q_dtype=torch.bfloat16,
                        kv_cache_dtype=DTYPES[kv], page_size=PAGE, num_layers=LAYERS,
                        dcp_size=dcp, max_qlen=qlen)
    ranks = [_rank(replace(model, dcp_rank=r), kv, four_d, seed=7 + r)
             for r in range(dcp)]
    rows, heads = max(BUCKETS) * qlen, HEADS * dcp
    queries = [torch.randn(rows, heads, 576, device="cuda").to(torch.bfloat16)
               for _ in range(LAYERS)]
    for n in BUCKETS:
        # One engine's own output buffers per layer (DCP: the steps' own buffers).
        outs = None if dcp > 1 else [
            (torch.empty(n * qlen, heads, 512, dtype=torch.bfloat16, device="cuda"),
             torch.empty(n * qlen, heads, device="cuda")) for _ in range(LAYERS)]
        _serve_bucket(ranks, n, qlen, queries, outs, kv)
    for rank in ranks:
        print(f"\nrank {rank.decoder.model.dcp_rank}: {rank.decoder.summary()}")
        assert set(rank.decoder.captured) == {(n, qlen) for n in BUCKETS}
        # Replays are not counted: each bucket's warm-up and capture, every layer.
        assert sum(rank.decoder.routes_served.values()) == 2 * LAYERS * len(BUCKETS)
        assert "unknown" not in rank.decoder.routes_served
    assert all(r.decoder.captured == ranks[0].decoder.captured for r in ranks), \
        "DCP ranks must capture the same route per bucket"
