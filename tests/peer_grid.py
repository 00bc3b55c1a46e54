"""The peers' decode test cases in mlatune's terms, shared by tests/test_peers.py (the CPU,
Triton in the interpreter) and tests/test_peers_gpu.py.

FlashMLA's and FlashInfer's decode suites (docs/peers.md lists their grids) lay the paged
cache out so that a kernel that reads one slot too many, or trusts a table entry it should
not, gives a wrong answer: pages shuffled over the whole cache, NaN in every slot no request
attends, and table entries past a request's used pages pointing nowhere. ``PeerBatch`` does
the same with mlatune's seeded inputs; ``run_case`` calls ``attention.decode`` as an engine
does (the caller's poisoned ``out=`` and ``lse_out=``, lengths rewritten in place between
calls) and checks every call against the float64 reference.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from mlatune import attention, routes, table
from mlatune.arch import DeviceInfo
from mlatune.check.accuracy import check
from mlatune.check.inputs import DecodeInputs, KVShard, make_decode_inputs, poison_
from mlatune.dispatch import Dispatcher
from mlatune.problem import DTYPES, FP8_DTYPES, MLAProblem
from mlatune.routes import Route
from tests.helpers import expected_now
from tests.table_helpers import make_table, result_row

FAR_PAGE = torch.iinfo(torch.int32).max  # a page id past any cache
FP8_NAN = 0x7F  # e4m3fn's NaN bit pattern
# The routes whose whole step a CUDA graph replays, as the dispatcher may serve them for a
# single-rank decode (cprr and segmented serve DCP only; FlashInfer and AITER plan on the host).
CAPTURABLE = ("padded/triton", "gluon/triton", "wgmma/gluon", "seesaw/gluon",
              "transposed/gluon", "transposed-mma8/gluon", "dense/flashmla")


@dataclass(frozen=True)
class PeerCase:
    """One case of a peer's grid: the shape, and the lengths of each call (the first call's,
    then each rewritten in place). ``pad``: the block table covers the longest length
    rounded up to this many tokens (FlashMLA pads to 256)."""

    peer: str  # whose suite the case follows
    heads: int
    qlen: int
    page: int
    lens: tuple[tuple[int, ...], ...]
    kv: str = "bf16"
    q: str = "bf16"
    causal: bool = True
    scale: float | None = None  # the softmax scale; None: the problem's default, 192 ** -0.5
    shared_pages: bool = False  # page ids drawn with repeats: requests share pages
    q_gain: float = 1.0  # q scaled up: the scores' spread grows with it
    pad: int = 256

    @property
    def capacity(self) -> int:
        """Tokens each request's pages hold (``max_kv_len`` of every call)."""
        longest = max(max(lens) for lens in self.lens)
        return max(self.pad, -(-longest // self.pad) * self.pad, self.qlen)

    @property
    def batch(self) -> int:
        return len(self.lens[0])

    def problem(self) -> MLAProblem:
        return MLAProblem(num_heads=self.heads, qlen=self.qlen, q_dtype=self.q,
                          kv_dtype=self.kv, batch=self.batch, kv_len=self.capacity,
                          causal=self.causal, page_size=self.page)

    @property
    def label(self) -> str:
        extras = [name for name, on in (("noncausal", not self.causal),
                                        ("shared", self.shared_pages),
                                        ("scaled", self.scale is not None),
                                        (f"qx{self.q_gain:g}", self.q_gain != 1.0)) if on]
        return "-".join([self.peer, f"h{self.heads}", f"q{self.qlen}", f"p{self.page}",
                         f"b{self.batch}", self.kv, *extras])


def rows_without_keys(lens: list[int] | tuple[int, ...], qlen: int, causal: bool
                      ) -> torch.Tensor:
    """Which query rows attend no key: a request of length 0, and a causal token whose
    window ``[0, length - qlen + t]`` ends before key 0."""
    last = [n - qlen + t if causal else n - 1 for n in lens for t in range(qlen)]
    return torch.tensor([x < 0 for x in last])


class PeerBatch:
    """A case's tensors: each request owns pages for the capacity, one shuffle over every
    page of the cache (or ids drawn with repeats); ``write`` sets the lengths in place and,
    as the peers do, NaN in every cache slot no request attends and a page id that points
    nowhere (past the cache, or -1) in each table entry past a request's used pages."""

    def __init__(self, case: PeerCase, seed: int, device: str | torch.device):
        self.case = case
        self.problem = case.problem()
        made = make_decode_inputs(self.problem, seed=seed, device=device)
        shard = made.shards[0]
        if case.q_gain != 1.0:
            made.q.mul_(case.q_gain)
        if case.shared_pages:
            gen = torch.Generator().manual_seed(seed)
            ids = torch.randint(0, shard.kv_cache.shape[0], tuple(shard.block_table.shape),
                                generator=gen, dtype=torch.int32)
            shard.block_table.copy_(ids)
        self.inputs = dataclasses.replace(made, sm_scale=case.scale)
        self.shard = shard
        self.clean_cache = shard.kv_cache.clone()
        self.clean_table = shard.block_table.cpu().clone()
        # The reference reads -1 where the kernels meet a page id past the cache: it gathers
        # a shorter request's unused entries beside a longer one's (masked, but indexed).
        ref_shard = KVShard(0, shard.kv_cache, shard.block_table.clone(), shard.seq_lens)
        self.reference = dataclasses.replace(self.inputs, shards=(ref_shard,))

    def write(self, lens: tuple[int, ...]) -> None:
        page, shard = self.case.page, self.shard
        lengths = torch.tensor(lens, dtype=torch.int32)
        self.inputs.seq_lens.copy_(lengths)
        shard.seq_lens.copy_(lengths)
        rows, ref_rows = self.clean_table.clone(), self.clean_table.clone()
        live = torch.zeros(shard.kv_cache.shape[:2], dtype=torch.bool)
        for b, n in enumerate(lens):
            tokens = torch.arange(n)
            live[rows[b, tokens // page].long(), tokens % page] = True
            used = -(-n // page)
            rows[b, used:] = FAR_PAGE if b % 2 == 0 else -1
            ref_rows[b, used:] = -1
        shard.block_table.copy_(rows)
        self.reference.shards[0].block_table.copy_(ref_rows)
        shard.kv_cache.copy_(self.clean_cache)
        fp8 = shard.kv_cache.element_size() == 1
        slots = shard.kv_cache.view(torch.uint8) if fp8 else shard.kv_cache
        slots[~live.to(slots.device)] = FP8_NAN if fp8 else float("nan")


def forms(route: Route, problem: MLAProblem, device: DeviceInfo) -> list[dict]:
    """The first capturable set of each kernel form in the route's space at the problem
    (padded's split and persistent forms, the Gluon routes' named forms)."""
    firsts: dict[tuple, dict] = {}
    for params in route.param_space(problem, device):
        if route.step_kind(params).capturable:
            firsts.setdefault((bool(params.get("persistent")), params.get("form")), params)
    return list(firsts.values())


def forced(problem: MLAProblem, route_id: str, params: dict, path: Path,
           device: DeviceInfo) -> Dispatcher:
    """A dispatcher whose one-problem table has ``route_id`` with ``params`` fastest (under
    the ``fast`` policy, so a route that rounds past the dtypes is served too)."""
    rows = [result_row(problem, route_id, 1.0, device=device, params=params),
            result_row(problem, "reference/torch", 9.0, device=device)]
    return Dispatcher.load(table.write(make_table(rows), path), device=device,
                           accuracy="fast")


def decode(inputs: DecodeInputs, dispatcher: Dispatcher | None, out: torch.Tensor | None = None,
           lse: torch.Tensor | None = None, capturable: bool = True
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """``attention.decode`` on rank 0's shard of ``inputs``, as an engine calls it: the
    problem's kv_len as ``max_kv_len``, the inputs' softmax scale; synchronised."""
    p, shard = inputs.problem, inputs.shards[0]
    got = attention.decode(inputs.q, shard.kv_cache, shard.block_table, inputs.seq_lens,
                           num_heads=p.num_heads, qlen=p.qlen, causal=p.causal,
                           kv_scale=inputs.kv_scale, softmax_scale=inputs.sm_scale, out=out,
                           lse_out=lse, max_kv_len=p.kv_len, return_lse=True,
                           capturable=capturable, dispatcher=dispatcher)
    if got[0].is_cuda:
        torch.cuda.synchronize()
    return got


def run_case(batch: PeerBatch, dispatcher: Dispatcher | None, capturable: bool = True,
             fresh_q: bool = False
             ) -> Iterator[tuple[tuple[int, ...], torch.Tensor, torch.Tensor]]:
    """``decode`` once per lengths of the case, into the caller's out= and lse_out= (poisoned
    before each call), the lengths and table rows rewritten in place between calls; yields
    (lengths, out, lse) after each call. ``fresh_q``: q a new tensor each call (its values
    the case's), as an eager model's activations are."""
    problem, rows = batch.problem, batch.inputs.q.shape[0]
    device = batch.inputs.q.device
    out = torch.empty(rows, problem.num_heads, problem.d_v, dtype=DTYPES[problem.out_dtype],
                      device=device)
    lse = torch.empty(rows, problem.num_heads, dtype=torch.float32, device=device)
    for lens in batch.case.lens:
        batch.write(lens)
        poison_(out, lse)
        inputs = dataclasses.replace(batch.inputs, q=batch.inputs.q.clone()) if fresh_q \
            else batch.inputs
        got = decode(inputs, dispatcher, out, lse, capturable)
        assert got[0] is out and got[1] is lse, "decode must return the caller's buffers"
        yield lens, out, lse


def rope_dominated(problem: MLAProblem, seed: int, device: str | torch.device) -> DecodeInputs:
    """FlashInfer's rope-aliasing case at softmax scale 1: q's rope dims 1, key 4's rope dims
    +1 and key 8's -1, their first latent channel +100 and -100, every other value noise of
    0.01. Key 4 takes almost all the weight, so a kernel that reads one key's rope dims for
    another's moves the output's first channel away from 100. Pages shuffled."""
    gen = torch.Generator().manual_seed(seed)
    d_v, width, page = problem.d_v, problem.d_qk, problem.page_size
    q = 0.01 * torch.randn(problem.batch * problem.qlen, problem.kernel_heads, width,
                           generator=gen)
    q[..., d_v:] = 1.0
    keys = 0.01 * torch.randn(problem.batch, problem.kv_len, width, generator=gen)
    keys[:, 4, d_v:], keys[:, 8, d_v:] = 1.0, -1.0
    keys[:, 4, 0], keys[:, 8, 0] = 100.0, -100.0
    pages_each = -(-problem.kv_len // page)
    padded = torch.full((problem.batch, pages_each * page, width), float("nan"))
    padded[:, :problem.kv_len] = keys
    ids = torch.randperm(problem.batch * pages_each, generator=gen).to(torch.int32)
    cache = torch.empty(problem.batch * pages_each, page, width)
    cache[ids.long()] = padded.view(-1, page, width)
    kv_scale = None
    if problem.kv_dtype in FP8_DTYPES:
        kv_scale = torch.tensor([100.0 / torch.finfo(DTYPES[problem.kv_dtype]).max])
        cache = cache / kv_scale
    lens = torch.full((problem.batch,), problem.kv_len, dtype=torch.int32)
    shard = KVShard(0, cache.to(DTYPES[problem.kv_dtype]).to(device),
                    ids.view(problem.batch, pages_each).to(device), lens.to(device))
    return DecodeInputs(problem, q.to(DTYPES[problem.q_dtype]).to(device), None,
                        None if kv_scale is None else kv_scale.to(device), lens.to(device),
                        (shard,), sm_scale=1.0)


def assert_rope_key_wins(inputs: DecodeInputs, route: Route, params: dict,
                         dispatcher: Dispatcher) -> None:
    """``rope_dominated``'s inputs served as the reference has them: key 4's 100 comes out."""
    out, lse = decode(inputs, dispatcher)
    want_out, want_lse = expected_now(inputs)
    acc = check(inputs.problem, out, want_out, lse, want_lse,
                rounding=routes.rounding(route, inputs.problem, params))
    assert acc.ok, f"{route.id} {params}: {acc.reason} ({acc.summary})"
    assert (out[..., 0].float() > 50).all(), f"{route.id} {params}: key 4 does not win"
    assert {s.choice.route_id for s in attention.plans_of(dispatcher).values()} == {route.id}


def decode_into_its_own_buffers(batch: PeerBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """The last call of ``run_case`` again with the bundled dispatcher, without out= and
    lse_out=: the step's own buffers come back."""
    return decode(batch.inputs, None)


def assert_served(batch: PeerBatch, route: Route, params: dict, out: torch.Tensor,
                  lse: torch.Tensor, lens: tuple[int, ...], what: str) -> None:
    """The reference's answer within the route's rounding class; rows without keys exactly
    0 and -inf."""
    problem = batch.problem
    want_out, want_lse = expected_now(batch.reference)
    acc = check(problem, out, want_out, lse, want_lse,
                rounding=routes.rounding(route, problem, params))
    assert acc.ok, f"{what}, lengths {list(lens)}: {acc.reason} ({acc.summary})"
    empty = rows_without_keys(lens, problem.qlen, problem.causal).to(out.device)
    assert (out[empty] == 0).all(), f"{what}, lengths {list(lens)}: rows without keys not 0"
    assert torch.isneginf(lse[empty]).all(), f"{what}, lengths {list(lens)}: LSE not -inf"


def served_routes(dispatcher: Dispatcher, before: set) -> list[attention.DecodeStep]:
    """The steps ``decode`` made with ``dispatcher`` since ``before`` (its step keys then)."""
    return [s for k, s in attention.plans_of(dispatcher).items() if k not in before]
