"""One prepared decode step: a route chosen and prepared over one call's tensors, called
again every engine step (``mlatune.attention`` keeps them; ``prepare_decode`` hands one to
an engine), and the ways a step is made from another: a layer reading a planning step's
device plan (``sharing_step``), a step over new tensors of the same geometry
(``rebound``)."""

from __future__ import annotations

import copy
import dataclasses
import weakref
from dataclasses import dataclass

import torch

from mlatune import runtime_checks
from mlatune.check.inputs import DecodeInputs, KVShard
from mlatune.dispatch import Choice
from mlatune.errors import DecodeArgumentError
from mlatune.measure import timers
from mlatune.problem import MLAProblem
from mlatune.routes import Prepared, Route

# The tensors a held step holds, named as decode's arguments (``held_layout``'s order); a
# step without an LSE holds None there.
HELD_TENSORS = ("q", "kv_cache", "block_table", "seq_lens", "out", "lse_out")


@dataclass
class DecodeStep:
    """One prepared decode step for fixed tensors (``prepare_decode``; ``decode`` keeps
    them per tensor set). Calling it runs the step on what the tensors hold now."""

    problem: MLAProblem  # kv_len: the power of two up to which this step serves max_kv_len
    choice: Choice
    route: Route
    inputs: DecodeInputs  # what the route is prepared from (again, if it plans on the host)
    prepared: Prepared
    local_lens: torch.Tensor | None  # this rank's shard lengths, refreshed per call (DCP)
    rank: int
    out: torch.Tensor  # what the call returns: the caller's out= or the route's own
    lse: torch.Tensor | None
    buffers: dict  # the caller's out=/lse= when the route writes into them
    planner: DecodeStep | None = None  # the step whose device plan this one reads
    # A released step's weak references to the caller's q, out= and lse_out= (``holds``).
    callers: tuple = ()

    def __post_init__(self) -> None:
        self.want_lse = self.lse is not None
        kind = self.prepared.step_kind
        self.host_planned = kind.plan_on == "host"
        shard = self.inputs.shards[self.rank]
        self.values_free = runtime_checks.values_free_to_check(self.inputs.seq_lens,
                                                               shard.block_table)
        self.fresh = True  # just prepared from these lengths
        # Eager calls after the first replay the step from a private CUDA graph: one
        # launch where each Triton launch costs tens of microseconds of host time.
        self.replayable = kind.capturable and self.out.is_cuda
        self.graph: torch.cuda.CUDAGraph | None = None
        self.layout = self.held_layout()

    def held_layout(self) -> tuple:
        """The memory, shape and strides (``address``) of every tensor the step holds, in
        ``HELD_TENSORS`` order."""
        shard = self.inputs.shards[self.rank]
        return tuple(address(t) for t in (self.inputs.q, shard.kv_cache, shard.block_table,
                                          self.inputs.seq_lens, self.out, self.lse))

    def __call__(self) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Run the step (``call``); returns out, and the LSE when the step has one. The
        length values are checked first where that is free (CPU tensors) or asked for."""
        now = self.held_layout()
        if now != self.layout:
            changed = [name for name, a, b in zip(HELD_TENSORS, now, self.layout, strict=True)
                       if a != b]
            raise DecodeArgumentError(
                f"{', '.join(changed)}: a held decode step's tensors were resized or moved "
                f"since it was prepared (it serves the batch, shapes and memory it was made "
                f"for); prepare a new step")
        shard = self.inputs.shards[self.rank]
        if checks_values(self.values_free, self.inputs.seq_lens, made=False):
            check_values(self.problem, shard.kv_cache, shard.block_table,
                         self.inputs.seq_lens, self.rank)
        self.call()
        return self.out if self.lse is None else (self.out, self.lse)

    def released(self) -> DecodeStep:
        """This step holding none of the caller's q, out and LSE (nor the route's launch
        over them: its device plan alone; no host plan, which is made anew), only weak
        references to them: what ``rebound`` prepares again for the next call of the same
        signature with other tensors."""
        recipe = copy.copy(self)
        recipe.inputs = dataclasses.replace(self.inputs, q=None)
        recipe.prepared = None if self.host_planned else dataclasses.replace(
            self.prepared, run=_released, out=None, lse=None)
        recipe.out = recipe.lse = recipe.planner = recipe.graph = None
        recipe.callers = tuple(None if t is None else weakref.ref(t)
                               for t in (self.inputs.q, self.buffers["out"],
                                         self.buffers["lse"]))
        recipe.buffers = {}
        return recipe

    def emptied(self) -> DecodeStep:
        """This step's problem, route, choice and step kind, holding no tensor (nor launching
        anything): what ``last_step`` keeps of a step that must free its memory."""
        record = copy.copy(self)
        kept = self.prepared
        record.prepared = Prepared(run=_released, out=None, graph_safe=kept.graph_safe,
                                   params=kept.params, plan_reads_lengths=kept.plan_reads_lengths,
                                   plan=None if kept.plan is None else _released)
        record.inputs = record.local_lens = record.out = record.lse = None
        record.planner = record.graph = None
        record.buffers = {}
        return record

    def holds(self, q: torch.Tensor, out: torch.Tensor | None,
              lse_out: torch.Tensor | None) -> bool:
        """Whether a released step's caller passed these very tensors (alive since: the
        caller keeps them, so a step over them is worth keeping)."""
        return all((None if ref is None else ref()) is t
                   for ref, t in zip(self.callers, (q, out, lse_out), strict=True))

    def call(self) -> None:
        """One call of the caller's: eager, or inside the caller's own graph capture."""
        if self.graph is not None:
            if not torch.cuda.is_current_stream_capturing():
                self.graph.replay()
                return
        elif self.replayable and not self.fresh and not torch.cuda.is_current_stream_capturing():
            self.graph = timers.capture_graph(self.step, self.out.device)  # runs this call
            self.replayable = self.graph is not None
            if self.graph is not None:
                return
        self.step()

    def step(self) -> None:
        plans = self.planner is None  # else the planner's call planned this step already
        if self.local_lens is not None and plans:
            fill_local_lens(self.local_lens, self.inputs.seq_lens, self.rank,
                            self.problem.dcp_size)
        if self.host_planned and not self.fresh:  # planned on the host: prepare again
            # (from the planner's plan of this step, where a layer reads another's)
            self.prepared = prepare_route(self.route, self.problem, self.inputs, self.rank,
                                          self.choice, self.want_lse, self.buffers,
                                          plan_from=None if self.planner is None
                                          else self.planner.prepared)
        self.fresh = False
        if plans or self.host_planned:
            self.prepared.step()
        else:
            self.prepared.run()
        # A route that cannot write into the caller's out= or lse_out= (either alone)
        if self.out is not self.prepared.out:
            self.out.copy_(self.prepared.out)
        if self.lse is not None and self.lse is not self.prepared.lse:
            self.lse.copy_(self.prepared.lse)


def _released() -> None:
    raise RuntimeError("a released decode step launches nothing (DecodeStep.released)")


def fill_local_lens(local_lens: torch.Tensor, seq_lens: torch.Tensor, rank: int,
                    world: int) -> None:
    """Round-robin share of each request on ``rank``: ceil((len - rank) / world), in place
    (``mlatune.check.inputs.shard_lengths`` without allocating)."""
    local_lens.copy_(seq_lens).add_(world - 1 - rank)
    local_lens.div_(world, rounding_mode="floor").clamp_(min=0)


def checks_values(free: bool, seq_lens: torch.Tensor, *, made: bool) -> bool:
    """Whether the length values are checked now: always where they are ``free`` to read
    (CPU tensors); on a GPU (a host sync) never inside a graph capture, else when a step
    is ``made`` and, at the calls of a step made before, only with MLATUNE_CHECK on. (It
    is read either way, so a bad value is refused on every device.)"""
    asked = runtime_checks.checking_enabled()
    return free or ((made or asked) and runtime_checks.values_readable(seq_lens))


def check_values(problem: MLAProblem, kv_cache: torch.Tensor, block_table: torch.Tensor,
                 seq_lens: torch.Tensor, dcp_rank: int) -> None:
    runtime_checks.check_length_values(seq_lens, block_table, num_pages=kv_cache.shape[0],
                                       page_size=problem.page_size, qlen=problem.qlen,
                                       dcp_rank=dcp_rank, dcp_size=problem.dcp_size)


def sharing_step(planner: DecodeStep, problem: MLAProblem, q, kv_cache, block_table,
                 seq_lens, dcp_rank: int, q_scale, kv_scale, softmax_scale, want_lse: bool,
                 buffers: dict) -> DecodeStep:
    """Another layer's step over the planner's lengths: its route and parameters, its
    lengths (this rank's too) and, where the route can read it, its device plan. The call's
    block table, lengths and rank must be the planner's: the step reads the planner's."""
    if planner.problem != problem or planner.want_lse != want_lse:
        raise DecodeArgumentError(
            f"plan_from was made for {planner.problem.key}"
            f"{' with an LSE' if planner.want_lse else ''}; this call is "
            f"{problem.key}{' with an LSE' if want_lse else ''}")
    theirs = planner.inputs.shards[planner.rank]
    for name, mine, its in (("block_table", block_table, theirs.block_table),
                            ("seq_lens", seq_lens, planner.inputs.seq_lens)):
        if address(mine) != address(its):
            raise DecodeArgumentError(
                f"{name}: plan_from's step reads its own {name}; pass that tensor (the same "
                f"memory, shape and strides), or prepare this layer without plan_from")
    if dcp_rank != planner.rank:
        raise DecodeArgumentError(f"dcp_rank: plan_from's step is rank {planner.rank}'s, "
                                  f"this call rank {dcp_rank}'s")
    shard = KVShard(planner.rank, kv_cache, theirs.block_table, theirs.seq_lens)
    shards = tuple(shard if r == planner.rank else None for r in range(problem.dcp_size))
    inputs = DecodeInputs(problem, q, q_scale, kv_scale, planner.inputs.seq_lens,
                          shards, sm_scale=softmax_scale)  # type: ignore[arg-type]
    buffers = dict(buffers)
    prepared = prepare_route(planner.route, problem, inputs, planner.rank, planner.choice,
                             want_lse, buffers, plan_from=planner.prepared)
    return new_step(problem, planner.choice, planner.route, inputs, prepared,
                    planner.local_lens, planner.rank, buffers, want_lse, planner)


def address(t: torch.Tensor | None) -> tuple | None:
    """What tells a tensor's memory and layout apart: two tensors of one address are views
    of the same memory, of the same dtype, shape and strides."""
    return None if t is None else (t.data_ptr(), t.dtype, t.shape, t.stride(), t.device)


def new_step(problem: MLAProblem, choice: Choice, route: Route, inputs: DecodeInputs,
             prepared: Prepared, local_lens: torch.Tensor | None, rank: int, buffers: dict,
             want_lse: bool, planner: DecodeStep | None = None) -> DecodeStep:
    """The step of a prepared route: out and the LSE the caller's buffers, else the
    route's own."""
    out, lse = buffers["out"], buffers["lse"]
    return DecodeStep(problem, choice, route, inputs, prepared, local_lens, rank,
                      prepared.out if out is None else out,
                      (prepared.lse if lse is None else lse) if want_lse else None, buffers,
                      planner=planner)


def prepare_route(route: Route, problem: MLAProblem, inputs: DecodeInputs, rank: int,
                  choice: Choice, want_lse: bool, buffers: dict,
                  plan_from: Prepared | None = None) -> Prepared:
    """The route prepared for this rank, writing into the caller's buffers if it can, and
    reading ``plan_from``'s device plan if it has one the route can read; the device memory
    it allocated besides its outputs measured (``workspace_bytes``)."""
    into = {k: v for k, v in buffers.items() if v is not None} if route.writes_into else {}
    if plan_from is not None and plan_from.plan_state is not None and route.shares_plan:
        into["plan_from"] = plan_from
    before = _allocated(inputs.q)
    prepared = route.prepare(problem, inputs, rank=rank, params=dict(choice.params),
                             want_lse=want_lse, **into)
    outputs = sum(t.nbytes for t, given in ((prepared.out, buffers.get("out")),
                                             (prepared.lse, buffers.get("lse")))
                  if t is not None and (given is None or t.data_ptr() != given.data_ptr()))
    prepared.workspace_bytes = max(0, _allocated(inputs.q) - before - outputs)
    return prepared


def _allocated(q: torch.Tensor) -> int:
    """The device memory allocated now on q's GPU (0 on the CPU: not measured there)."""
    return torch.cuda.memory_allocated(q.device) if q.is_cuda else 0


def rebound(step: DecodeStep, q: torch.Tensor, out: torch.Tensor | None,
            lse_out: torch.Tensor | None, planner: DecodeStep | None) -> DecodeStep:
    """``step``'s route, parameters and lengths over these tensors, of its geometry: the
    route prepared again, nothing chosen or checked; a layer that reads another's plan
    reads ``planner``'s. A device plan is shared (each call replans it); a host plan is made
    anew from the lengths of now (``step``'s was made from those of its own first call)."""
    buffers = {"out": out, "lse": lse_out}
    theirs = step.inputs
    if planner is not None:  # the caller found the planner by these very lengths and table
        own = planner.inputs.shards[planner.rank]
        return sharing_step(planner, step.problem, q, theirs.shards[step.rank].kv_cache,
                            own.block_table, planner.inputs.seq_lens, planner.rank,
                            theirs.q_scale, theirs.kv_scale, theirs.sm_scale,
                            step.want_lse, buffers)
    inputs = dataclasses.replace(theirs, q=q)
    prepared = prepare_route(step.route, step.problem, inputs, step.rank, step.choice,
                             step.want_lse, buffers,
                             plan_from=None if step.host_planned else step.prepared)
    return new_step(step.problem, step.choice, step.route, inputs, prepared,
                    step.local_lens, step.rank, buffers, step.want_lse)
