"""One call for an engine: MLA decode/verify on a paged latent cache, route chosen for you.

``decode`` builds the problem from the tensors, asks the dispatcher which route
serves it, prepares that route once and then, every call, runs its step: the
per-step plan (from the lengths the tensors hold now) and the launch. The
prepared step is kept per tensor set (data pointers, dtypes, shapes, strides),
problem bucket (every key field but batch and kv_len) and call options (scale,
LSE, capturability): an engine's persistent buffers, whose contents change
between steps, find their step in a dict. A call whose q, out or LSE are new
tensors of a shape seen before (an eager model's activations) reuses the last
such call's route and parameters, prepared again over them (nothing chosen,
no host sync), and keeps that step only once the same tensors come back.

- ``max_kv_len`` grows every decode step, so steps are not keyed on it: a step
  serves every ``max_kv_len`` up to the next power of two above the one it was
  made for (the route chosen for the actual length, checked to support the
  problem at that power of two, which it is prepared for). Crossing a power of
  two prepares again. Kernels take every length from the device: split-KV cuts
  each request's keys by its own length; the persistent and segmented routes
  rebuild their work lists on the device in the step's plan.
- ``capturable=True`` (the default while a CUDA graph is being captured) takes
  only routes whose whole step replays from a graph with new lengths and block
  table entries written in place. A route that plans on the host (the AITER
  decode routes) is otherwise prepared again on every call, from the current
  lengths: it pays a host sync per step.
- With dcp_size > 1 this rank's shard lengths are derived from the global
  ``seq_lens`` on the device, every call, before the route's plan.
- ``return_lse=True`` takes the first route, in the dispatcher's order, whose
  step returns an LSE (some, like AITER's Gluon decode, return none).

From its second eager call on, a capturable step on a GPU is replayed from a CUDA
graph of its own (captured then, once): the host pays one graph launch instead of
one Triton launch per kernel. Inside the caller's capture the kernels are launched
as such, so they land in the caller's graph.

Without ``out=`` (and ``lse_out=``) the returned tensors are the step's own
buffers: the next call with the same tensors overwrites them, as a CUDA-graph
engine expects (except where a step is prepared again: new ones). Clone them to
keep a result across calls.

Checks (``mlatune.runtime_checks``; docs/faults.md has what each costs): types, shapes,
dtypes, devices, fp8 scales and outputs that overlap an input, when a step is made (no
device work). The length values (lengths >= 0 and within the block table, page ids in
the cache): on CPU tensors at every call, held steps' too (free); on a GPU when a step
is made outside a graph capture (one sync then, none per call), and at every call only
with ``MLATUNE_CHECK`` on (a sync per call).

Under ``torch.compile`` the call goes through the custom op ``mlatune::decode``
(it writes ``out`` and ``lse_out``), so ``fullgraph=True`` compiles. Inside the CUDA graph
trees of its ``reduce-overhead`` mode (``graph_pools``) a step is made for the call alone
and none is kept (their pool must hold nothing else), so ``reuse_plan`` plans again there.
"""

from __future__ import annotations

import logging
import threading
import weakref

import torch

from mlatune import graph_pools, runtime_checks
from mlatune.check.inputs import DecodeInputs, KVShard
from mlatune.check.policy import Policy, policy_named
from mlatune.decode_step import (
    DecodeStep,
    address,
    check_values,
    checks_values,
    fill_local_lens,
    new_step,
    prepare_route,
    rebound,
    sharing_step,
)
from mlatune.dispatch import Dispatcher, by_handle, first_sight
from mlatune.errors import DecodeArgumentError, SettingError
from mlatune.problem import DTYPE_NAMES, DTYPES, MLAProblem, next_power_of_two, output_dtype
from mlatune.routes import rounding, step_kind_of

log = logging.getLogger("mlatune")

# Steps kept per dispatcher, the least recently used dropped first: a step holds the
# caller's tensors alive (an eager caller's fresh q and out each call would pile up), so the
# set is bounded, in steps and in bytes (those tensors: q, out, lse; and the route's
# workspace: split partials, plans).
PLAN_LIMIT = 1024
PLAN_BYTES = 1 << 30
# Length tensors (and call options) per dispatcher whose last planning step later layers may
# read (``reuse_plan``), the least recently planned dropped first; those steps stay kept.
PLANNER_LIMIT = 16

_plans: weakref.WeakKeyDictionary[Dispatcher, dict[tuple, DecodeStep]] = \
    weakref.WeakKeyDictionary()
# Per dispatcher, by the length tensors (and call options), the step that last planned.
_planners: weakref.WeakKeyDictionary[Dispatcher, dict[tuple, DecodeStep]] = \
    weakref.WeakKeyDictionary()
# Per dispatcher, the steps a CUDA graph captured: a graph replays their buffers at any later
# time, so PLAN_LIMIT never drops them (kept as long as the dispatcher).
_captured: weakref.WeakKeyDictionary[Dispatcher, dict[int, DecodeStep]] = \
    weakref.WeakKeyDictionary()
# Per dispatcher, by a call's signature without its q/out/LSE addresses (``_held_step``),
# the last step made for it, released (``DecodeStep.released``): how the next call with
# new tensors of that signature is served without choosing again.
_seen: weakref.WeakKeyDictionary[Dispatcher, dict[tuple, DecodeStep]] = \
    weakref.WeakKeyDictionary()
# Per dispatcher, the step its last call ran (``last_step``).
_last: weakref.WeakKeyDictionary[Dispatcher, DecodeStep] = weakref.WeakKeyDictionary()
_default: dict[tuple[bool, str], Dispatcher] = {}  # by capturable and accuracy policy
# Guards the caches above: an engine may call decode from several threads (one a layer
# group, one a model); the steps themselves run outside it.
_lock = threading.RLock()


def default_dispatcher(capturable: bool = False, accuracy: str | None = None) -> Dispatcher:
    """``Dispatcher.from_bundled(capturable=..., accuracy=...)``, made once per process and
    policy on first use (``accuracy`` None: ``MLATUNE_ACCURACY``'s, else strict)."""
    key = (capturable, _policy(accuracy).name)
    with _lock:
        if key not in _default:
            _default[key] = Dispatcher.from_bundled(capturable=capturable, accuracy=key[1])
        return _default[key]


def _policy(accuracy: str | None) -> Policy:
    """The policy ``accuracy`` names; a bad name is a DecodeArgumentError naming the argument
    (a bad ``MLATUNE_ACCURACY`` stays the SettingError naming the variable)."""
    try:
        return policy_named(accuracy)
    except SettingError:
        raise
    except ValueError as exc:
        raise DecodeArgumentError(str(exc)) from None


def _check_plan_from_policy(plan_from: DecodeStep | None, accuracy: str | None) -> None:
    """A step reading another's plan runs that step's route: the policy asked must admit it."""
    if plan_from is None or accuracy is None or not isinstance(plan_from, DecodeStep):
        return
    policy = _policy(accuracy)
    route, problem = plan_from.route, plan_from.problem
    cls = rounding(route, problem, dict(plan_from.choice.params))
    if not policy.admits_class(problem.q_dtype, cls):
        raise DecodeArgumentError(
            f"accuracy: plan_from serves {route.id} ({cls}), which accuracy {policy.name!r} "
            f"holds back: make the planning step under that policy too")


def _dispatcher_for(dispatcher: Dispatcher | None, capturable: bool, accuracy: str | None
                    ) -> Dispatcher:
    """The dispatcher given (which must serve ``accuracy`` where one is named), else the
    default one for ``capturable`` and ``accuracy``."""
    if dispatcher is None:
        return default_dispatcher(capturable, accuracy)
    if not isinstance(dispatcher, Dispatcher):
        raise DecodeArgumentError(f"dispatcher: must be a mlatune.dispatch.Dispatcher or "
                                  f"None, got {type(dispatcher).__name__}")
    if accuracy is not None and _policy(accuracy) != dispatcher.accuracy:
        raise DecodeArgumentError(
            f"accuracy: {accuracy!r} asked, but the dispatcher given serves "
            f"{dispatcher.accuracy.name!r} (load it with accuracy={accuracy!r})")
    return dispatcher


def _geometry(t: torch.Tensor | None) -> tuple | None:
    """What a prepared step assumes of a tensor besides its address."""
    return None if t is None else (t.dtype, t.shape, t.stride(), t.device)


def decode(q: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor,
           seq_lens: torch.Tensor, *, num_heads: int, qlen: int = 1, causal: bool = True,
           kv_scale: torch.Tensor | None = None, q_scale: torch.Tensor | None = None,
           softmax_scale: float | None = None, out: torch.Tensor | None = None,
           lse_out: torch.Tensor | None = None, dcp_rank: int = 0, dcp_size: int = 1,
           max_kv_len: int | None = None, kv_lora_rank: int = 512, return_lse: bool = False,
           capturable: bool | None = None, reuse_plan: bool = False,
           dispatcher: Dispatcher | None = None, accuracy: str | None = None
           ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """MLA decode (qlen 1) or speculative verify (qlen > 1) for one DCP rank.

    q: (batch * qlen, num_heads * dcp_size, kv_lora_rank + rope_dim), request-major;
    kv_cache: (pages, page_size, d_qk) or (pages, page_size, 1, d_qk), this rank's
    shard; block_table: (batch, max_pages) int32 page ids of this rank's shard;
    seq_lens: (batch,) int32 *global* KV lengths (the new tokens included; with
    dcp_size > 1 each rank's share is derived from them); 0 is an empty request (a graph
    bucket's padding) and a length below qlen gets the causal window over the keys that
    exist: rows that attend no key return output 0 and LSE -inf. ``max_kv_len`` is
    max(seq_lens): pass it when the engine knows it, since reading it from a GPU
    tensor synchronises. fp8 tensors take their per-tensor fp32 scales (required).
    ``softmax_scale``: the model's (DeepSeek's YaRN scaling multiplies the default
    ``qk_head_dim ** -0.5`` by mscale squared); None: that default.
    ``out`` (batch * qlen, num_heads * dcp_size, kv_lora_rank) and ``lse_out``
    (batch * qlen, num_heads * dcp_size) fp32: buffers the caller owns, written in
    place and returned. ``capturable``: only routes whose step a CUDA graph can
    replay with new lengths; None: True while the current stream is capturing.
    ``reuse_plan``: read the device plan that the last call with these ``seq_lens`` and
    ``block_table`` tensors made (the same arguments otherwise) instead of planning
    again: an engine plans in its first attention layer of a step and passes True in the
    others, which then pay the launch alone (a dispatcher made with ``plan_calls`` = the
    layer count ranks routes so). ``accuracy``: the accuracy policy the route must meet
    (``mlatune.check.policy``: "strict", the default, serves no rounding beyond the
    problem's dtypes; None: ``MLATUNE_ACCURACY``'s, else strict); a ``dispatcher`` given
    serves its own, and naming another is a DecodeArgumentError.

    Returns out and, with ``return_lse`` (or ``lse_out``), lse fp32 (natural log); with
    dcp_size > 1 both are this rank's partials, merged by the caller."""
    want_lse = return_lse or lse_out is not None
    if torch.compiler.is_compiling():  # checked where the op runs (a traced scale: no value)
        return _decode_compiled(q, kv_cache, block_table, seq_lens, num_heads, qlen, causal,
                                kv_scale, q_scale, softmax_scale, out, lse_out, dcp_rank,
                                dcp_size, max_kv_len, kv_lora_rank, want_lse, capturable,
                                reuse_plan, dispatcher, accuracy)
    softmax_scale = runtime_checks.check_options(
        num_heads=num_heads, qlen=qlen, dcp_rank=dcp_rank, dcp_size=dcp_size,
        kv_lora_rank=kv_lora_rank, causal=causal, softmax_scale=softmax_scale,
        return_lse=return_lse, capturable=capturable, reuse_plan=reuse_plan)
    tensors = (q, kv_cache, block_table, seq_lens)
    made = dict(num_heads=num_heads, qlen=qlen, causal=causal, kv_scale=kv_scale,
                q_scale=q_scale, softmax_scale=softmax_scale, out=out, lse_out=lse_out,
                dcp_rank=dcp_rank, dcp_size=dcp_size, kv_lora_rank=kv_lora_rank,
                want_lse=want_lse, capturable=capturable)
    try:
        step = _decode_step(tensors, max_kv_len, reuse_plan, dispatcher, accuracy, made)
    except (AttributeError, TypeError):  # an argument of a foreign type, before the checks
        _check_args(tensors, made)  # its DecodeArgumentError names it
        raise
    step.call()
    return (step.out, step.lse) if want_lse else step.out


def _decode_step(tensors: tuple, max_kv_len: int | None, reuse_plan: bool,
                 dispatcher: Dispatcher | None, accuracy: str | None, made: dict
                 ) -> DecodeStep:
    """The step ``decode`` runs for these arguments (``_held_step``; inside torch.compile's
    CUDA graph trees one made for the call alone, ``_pooled_step``), once the defaults that
    read the tensors are filled in."""
    q, seq_lens = tensors[0], tensors[3]
    if made["capturable"] is None:
        made["capturable"] = q.is_cuda and torch.cuda.is_current_stream_capturing()
    dispatcher = _dispatcher_for(dispatcher, made["capturable"], accuracy)
    if max_kv_len is None:  # (no batch: 0, and the argument checks say why)
        max_kv_len = int(seq_lens.max()) if seq_lens.numel() else 0
    runtime_checks.check_max_kv_len(max_kv_len, none_ok=True)
    with _lock:
        if graph_pools.in_graph_tree(q.device):
            return _pooled_step(tensors, max_kv_len, dispatcher, made)
        return _held_step(*tensors, max_kv_len, reuse_plan, dispatcher, made)


def _pooled_step(tensors: tuple, max_kv_len: int, dispatcher: Dispatcher, made: dict
                 ) -> DecodeStep:
    """A step made for this call alone, inside a graph pool that must hold nothing of it
    afterwards (``graph_pools``): none is kept or read, and each call plans (``reuse_plan``
    has no planning step to read). The graph being recorded replays its plan and launch."""
    step = _make_plan(*tensors, max_kv_len=max_kv_len, dispatcher=dispatcher, **made)
    _last[dispatcher] = step.emptied()
    return step


def _check_args(tensors: tuple, made: dict) -> None:
    """The argument checks (``runtime_checks.check_decode_args``) of ``decode``'s tensors
    and options: a DecodeArgumentError names a bad one, also one of a foreign type (a list
    as q) that failed before they ran."""
    checked = ("num_heads", "qlen", "dcp_rank", "dcp_size", "kv_lora_rank", "kv_scale",
               "q_scale", "softmax_scale", "out", "lse_out", "causal")
    runtime_checks.check_decode_args(*tensors, **{k: made[k] for k in checked})


def _held_step(q: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor,
               seq_lens: torch.Tensor, max_kv_len: int, reuse_plan: bool,
               dispatcher: Dispatcher, made: dict) -> DecodeStep:
    """The step ``decode`` holds for these arguments, made (and remembered) where none serves
    ``max_kv_len``; with ``reuse_plan`` it reads the plan of the last call that planned for
    these length tensors. New q/out/LSE tensors of a signature seen before are served by the
    last such step prepared again (``rebound``), kept only once they come back."""
    lengths = (made["num_heads"], made["qlen"], made["causal"], made["dcp_rank"],
               made["dcp_size"], made["kv_lora_rank"], made["want_lse"], made["capturable"],
               address(block_table), address(seq_lens))  # what a plan is made from
    callers = (q, made["out"], made["lse_out"])
    unbound = (*lengths, reuse_plan, made["softmax_scale"], address(kv_cache),
               address(made["kv_scale"]), address(made["q_scale"]), *map(_geometry, callers))
    key = (*unbound, *(None if t is None else t.data_ptr() for t in callers))
    steps = _plans.setdefault(dispatcher, {})
    planners = _planners.setdefault(dispatcher, {})
    planner = planners.get(lengths) if reuse_plan else None
    if reuse_plan and planner is None:
        raise DecodeArgumentError("reuse_plan: no call with these seq_lens and block_table "
                                  "tensors has planned yet; pass reuse_plan=False in the "
                                  "step's first call")
    served = _served_len(max_kv_len, made["qlen"])
    if planner is not None and planner.problem.kv_len != served:
        raise DecodeArgumentError(
            f"reuse_plan: the step's planning call (reuse_plan=False) was prepared for "
            f"max_kv_len up to {planner.problem.kv_len}; this call's max_kv_len "
            f"{max_kv_len} needs one up to {served}: pass every layer of a step the same "
            f"max_kv_len")
    step = steps.pop(key, None)
    if step is not None and step.problem.kv_len == served:
        if step.planner is not planner:  # the layers' planning step is another now
            step = rebound(step, *callers, planner)
        steps[key] = step  # put back last: the most recently used
        _check_held(step, kv_cache, block_table, seq_lens, made["dcp_rank"])
    else:
        step, keep = _unheld_step(q, kv_cache, block_table, seq_lens, max_kv_len, planner,
                                  dispatcher, made, _seen.setdefault(dispatcher, {}), unbound)
        if keep:
            _make_room(steps, planners, _held_bytes(step))
            steps[key] = step
    if not reuse_plan:
        planners.pop(lengths, None)  # put back last: the most recently planned
        planners[lengths] = step
        while len(planners) > PLANNER_LIMIT:
            del planners[next(iter(planners))]
    if q.is_cuda and torch.cuda.is_current_stream_capturing():
        _captured.setdefault(dispatcher, {})[id(step)] = step
    _last[dispatcher] = step
    return step


def _unheld_step(q: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor,
                 seq_lens: torch.Tensor, max_kv_len: int, planner: DecodeStep | None,
                 dispatcher: Dispatcher, made: dict, seen: dict[tuple, DecodeStep],
                 unbound: tuple) -> tuple[DecodeStep, bool]:
    """The step for arguments no held step serves: the last step of the same signature
    prepared again over these tensors (``rebound``), else one made anew (``_make_plan``);
    and whether it is worth holding (made anew, or over the tensors the signature's last
    call passed too: its caller keeps them)."""
    recipe = seen.pop(unbound, None)
    if recipe is None or recipe.problem.kv_len != _served_len(max_kv_len, made["qlen"]):
        try:
            step = _make_plan(q, kv_cache, block_table, seq_lens, max_kv_len=max_kv_len,
                              dispatcher=dispatcher, plan_from=planner, **made)
        except DecodeArgumentError as exc:  # plan_from is not decode's word: reuse_plan is
            said = str(exc).replace("plan_from was made",
                                    "reuse_plan: the step's planning call was made", 1)
            if said == str(exc):
                raise
            raise DecodeArgumentError(said) from None
        keep = True
    else:
        _check_args((q, kv_cache, block_table, seq_lens), made)
        step = rebound(recipe, q, made["out"], made["lse_out"], planner)
        keep = recipe.holds(q, made["out"], made["lse_out"])
        _check_held(step, kv_cache, block_table, seq_lens, made["dcp_rank"])
    seen[unbound] = step.released()
    while len(seen) > PLAN_LIMIT:
        del seen[next(iter(seen))]
    return step, keep


def _check_held(step: DecodeStep, kv_cache: torch.Tensor, block_table: torch.Tensor,
                seq_lens: torch.Tensor, dcp_rank: int) -> None:
    """A held step's call checks the length values where that is free or asked for."""
    if checks_values(step.values_free, seq_lens, made=False):
        check_values(step.problem, kv_cache, block_table, seq_lens, dcp_rank)


def _held_bytes(step: DecodeStep) -> int:
    """The bytes ``step`` holds alive: the caller's q, out and LSE, and the route's
    workspace (measured on a GPU)."""
    held = (step.inputs.q, step.out, step.lse)
    return sum(t.nbytes for t in held if t is not None) + step.prepared.workspace_bytes


def _make_room(steps: dict[tuple, DecodeStep], planners: dict[tuple, DecodeStep],
               adding: int) -> None:
    """Drop the least recently used steps until one more step, holding ``adding`` bytes,
    keeps within PLAN_LIMIT and PLAN_BYTES; never a step whose plan later layers may read
    (a planner's: those are bounded by PLANNER_LIMIT)."""
    held = sum(_held_bytes(s) for s in steps.values())
    planning = {id(s) for s in planners.values()}
    for key in [k for k, s in steps.items() if id(s) not in planning]:
        if len(steps) < PLAN_LIMIT and held + adding <= PLAN_BYTES:
            return
        held -= _held_bytes(steps.pop(key))


def prepare_decode(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    num_heads: int,
    max_kv_len: int,
    qlen: int = 1,
    causal: bool = True,
    kv_scale: torch.Tensor | None = None,
    q_scale: torch.Tensor | None = None,
    softmax_scale: float | None = None,
    out: torch.Tensor | None = None,
    lse_out: torch.Tensor | None = None,
    dcp_rank: int = 0,
    dcp_size: int = 1,
    kv_lora_rank: int = 512,
    return_lse: bool = False,
    capturable: bool = False,
    plan_from: DecodeStep | None = None,
    dispatcher: Dispatcher | None = None,
    accuracy: str | None = None,
) -> DecodeStep:
    """``decode``'s step for these tensors, chosen and prepared now, for an engine that
    keeps it: ``step()`` then costs no lookup (the plan/run split of FlashInfer's
    wrappers). Arguments as ``decode``'s; the step serves lengths up to the block
    table's capacity, chosen for ``max_kv_len``."""
    _check_plan_from_policy(plan_from, accuracy)
    softmax_scale = runtime_checks.check_options(
        num_heads=num_heads, qlen=qlen, dcp_rank=dcp_rank, dcp_size=dcp_size,
        kv_lora_rank=kv_lora_rank, causal=causal, softmax_scale=softmax_scale,
        return_lse=return_lse, capturable=capturable)
    dispatcher = _dispatcher_for(dispatcher, capturable, accuracy)
    if plan_from is not None and not isinstance(plan_from, DecodeStep):
        raise DecodeArgumentError(f"plan_from: must be a step prepare_decode returned, or "
                                  f"None, got {type(plan_from).__name__}")
    return _make_plan(q, kv_cache, block_table, seq_lens, num_heads=num_heads, qlen=qlen,
                      causal=causal, kv_scale=kv_scale, q_scale=q_scale,
                      softmax_scale=softmax_scale, out=out, lse_out=lse_out, dcp_rank=dcp_rank,
                      dcp_size=dcp_size, max_kv_len=max_kv_len, kv_lora_rank=kv_lora_rank,
                      want_lse=return_lse or lse_out is not None, capturable=capturable,
                      dispatcher=dispatcher, plan_from=plan_from)


def _served_len(max_kv_len: int, qlen: int) -> int:
    """The kv_len of the step that serves ``max_kv_len``: the power of two at or above it,
    and at least qlen's (a batch of empty or short requests is served as a problem of qlen
    keys, the fewest a problem holds)."""
    return next_power_of_two(max(max_kv_len, qlen))


def _make_plan(q, kv_cache, block_table, seq_lens, *, num_heads, qlen, causal, kv_scale,
               q_scale, softmax_scale, out, lse_out, dcp_rank, dcp_size, max_kv_len,
               kv_lora_rank, want_lse, capturable, dispatcher,
               plan_from: DecodeStep | None = None) -> DecodeStep:
    """Check the tensors, build the problem, pick and prepare a route.

    The route is chosen for ``max_kv_len`` and prepared for its power of two (it must
    support that too): the first, in the dispatcher's order, whose step returns an LSE
    when one is wanted and is capturable when asked.
    """
    runtime_checks.check_decode_args(
        q, kv_cache, block_table, seq_lens, num_heads=num_heads, qlen=qlen, dcp_rank=dcp_rank,
        dcp_size=dcp_size, kv_lora_rank=kv_lora_rank, kv_scale=kv_scale, q_scale=q_scale,
        softmax_scale=softmax_scale, out=out, lse_out=lse_out, causal=causal)
    runtime_checks.check_max_kv_len(max_kv_len)
    if kv_cache.dim() == 4:
        kv_cache = kv_cache.view(kv_cache.shape[0], kv_cache.shape[1], kv_cache.shape[3])
    problem = MLAProblem(
        phase="decode", num_heads=num_heads, qlen=qlen, q_dtype=DTYPE_NAMES[q.dtype],
        kv_dtype=DTYPE_NAMES[kv_cache.dtype], batch=block_table.shape[0],
        kv_len=max(max_kv_len, qlen),
        dcp_size=dcp_size, causal=causal, page_size=kv_cache.shape[1],
        kv_lora_rank=kv_lora_rank, rope_dim=kv_cache.shape[-1] - kv_lora_rank)
    if checks_values(runtime_checks.values_free_to_check(seq_lens, block_table), seq_lens,
                     made=True):
        check_values(problem, kv_cache, block_table, seq_lens, dcp_rank)
    capped = problem.with_(kv_len=_served_len(max_kv_len, qlen))
    if plan_from is not None:
        return sharing_step(plan_from, capped, q, kv_cache, block_table, seq_lens, dcp_rank,
                            q_scale, kv_scale, softmax_scale, want_lse,
                            {"out": out, "lse": lse_out})
    local_lens = None
    if dcp_size > 1:  # this rank's lengths, filled before any route plans from them
        local_lens = torch.empty_like(seq_lens)
        fill_local_lens(local_lens, seq_lens, dcp_rank, dcp_size)
    shard = KVShard(dcp_rank, kv_cache, block_table, seq_lens if local_lens is None
                    else local_lens)
    # This rank holds only its own shard; the other slots stay empty so a route
    # that reached for another rank's cache would fail loudly, not read garbage.
    shards = tuple(shard if r == dcp_rank else None for r in range(dcp_size))
    inputs = DecodeInputs(capped, q, q_scale, kv_scale, seq_lens, shards,  # type: ignore[arg-type]
                          sm_scale=softmax_scale)
    buffers = {"out": out, "lse": lse_out}
    if first_sight.enabled(dispatcher) and first_sight.unsure(dispatcher.select(problem)):
        first_sight.measure(dispatcher, problem, capped, inputs, dcp_rank, want_lse)
    return _first_serving(dispatcher, problem, inputs, buffers, local_lens, dcp_rank,
                          want_lse, capturable)


def _first_serving(dispatcher: Dispatcher, problem: MLAProblem, inputs: DecodeInputs,
                   buffers: dict, local_lens: torch.Tensor | None, dcp_rank: int,
                   want_lse: bool, capturable: bool) -> DecodeStep:
    """The step of the first route, in the dispatcher's order for ``problem`` (prepared for
    ``inputs.problem``, its power of two), that serves the call: capturable when asked, empty
    requests, an LSE when wanted. None serving it is a RuntimeError saying why each
    route that supports the problem was passed over."""
    capped = inputs.problem
    skipped = []  # (route, why)
    for choice in dispatcher.alternatives(capped, first=dispatcher.select(problem)):
        route = dispatcher.route(choice.route_id)
        if capturable and not step_kind_of(route, dict(choice.params)).capturable:
            skipped.append((choice.route_id, "its step is not capturable"))
            continue
        # A held step meets whatever lengths are written in place later, 0 among them.
        if not route.serves_empty(capped, dict(choice.params)):
            skipped.append((choice.route_id, "serves no empty request"))
            continue
        try:
            prepared = prepare_route(route, capped, inputs, dcp_rank, choice, want_lse,
                                     buffers)
        except DecodeArgumentError:
            raise
        except Exception as exc:  # a route that breaks here (a plugin's, out of memory)
            why = f"its prepare raised {type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
            log.warning("mlatune: %s at %s: %s; the next route serves", choice.route_id,
                        capped.key, why)
            skipped.append((choice.route_id, why))
            continue
        if want_lse and prepared.lse is None:
            skipped.append((choice.route_id, "returns no LSE"))
            continue
        return new_step(capped, choice, route, inputs, prepared, local_lens, dcp_rank,
                        buffers, want_lse)
    needs = " and ".join(n for n, on in (("returns an LSE", want_lse),
                                          ("is capturable", capturable)) if on)
    why = "; ".join(f"{route}: {reason}" for route, reason in skipped) or \
        "none supports it here (`mlatune lookup` says why)"
    raise RuntimeError(f"no route that serves {problem.key} {needs} ({why})")


def last_step(dispatcher: Dispatcher | None = None) -> DecodeStep | None:
    """The step the dispatcher's last ``decode`` call ran (its route: ``.route``), for an
    engine's counters; None before any. A step made inside torch.compile's CUDA graph trees
    is kept as its record alone (``DecodeStep.emptied``: no tensors, and it cannot run)."""
    return _last.get(dispatcher or default_dispatcher())


def plans_of(dispatcher: Dispatcher | None = None) -> dict[tuple, DecodeStep]:
    """The cached steps of a dispatcher (for tests and diagnostics)."""
    return _plans.get(dispatcher or default_dispatcher(), {})


# --- torch.compile: the same call as a custom op -----------------------------------------
@torch.library.custom_op("mlatune::decode", mutates_args=("out", "lse_out"))
def _decode_op(q: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor,
               seq_lens: torch.Tensor, kv_scale: torch.Tensor | None,
               q_scale: torch.Tensor | None, out: torch.Tensor, lse_out: torch.Tensor | None,
               num_heads: int, qlen: int, causal: bool, softmax_scale: float | None,
               dcp_rank: int, dcp_size: int, max_kv_len: int | None, kv_lora_rank: int,
               capturable: bool | None, reuse_plan: bool, dispatcher_handle: int,
               accuracy: str) -> None:
    # capturable None: decided here, when the op runs (a graph being captured or not), as
    # an eager call decides it; torch.compile's reduce-overhead mode captures this op.
    decode(q, kv_cache, block_table, seq_lens, num_heads=num_heads, qlen=qlen, causal=causal,
           kv_scale=kv_scale, q_scale=q_scale, softmax_scale=softmax_scale, out=out,
           lse_out=lse_out, dcp_rank=dcp_rank, dcp_size=dcp_size, max_kv_len=max_kv_len,
           kv_lora_rank=kv_lora_rank, capturable=capturable, reuse_plan=reuse_plan,
           dispatcher=by_handle(dispatcher_handle), accuracy=accuracy or None)


@_decode_op.register_fake
def _(q, kv_cache, block_table, seq_lens, kv_scale, q_scale, out, lse_out, num_heads, qlen,
      causal, softmax_scale, dcp_rank, dcp_size, max_kv_len, kv_lora_rank, capturable,
      reuse_plan, dispatcher_handle, accuracy) -> None:
    return None


def _decode_compiled(q, kv_cache, block_table, seq_lens, num_heads, qlen, causal, kv_scale,
                     q_scale, softmax_scale, out, lse_out, dcp_rank, dcp_size, max_kv_len,
                     kv_lora_rank, want_lse, capturable, reuse_plan, dispatcher, accuracy):
    """decode() as torch.compile traces it: buffers allocated here, the work in the op."""
    softmax_scale = runtime_checks.plain_float(softmax_scale)
    rows, heads = q.shape[0], q.shape[1]
    if out is None:
        # (a dtype decode refuses: q's, so that the op's argument checks name it)
        out_dtype = DTYPES[output_dtype(DTYPE_NAMES[q.dtype])] if q.dtype in DTYPE_NAMES \
            else q.dtype
        out = q.new_empty(rows, heads, kv_lora_rank, dtype=out_dtype)
    if want_lse and lse_out is None:
        lse_out = q.new_empty(rows, heads, dtype=torch.float32)
    _decode_op(q, kv_cache, block_table, seq_lens, kv_scale, q_scale, out, lse_out, num_heads,
               qlen, causal, softmax_scale, dcp_rank, dcp_size, max_kv_len, kv_lora_rank,
               capturable, reuse_plan, 0 if dispatcher is None else dispatcher.handle,
               accuracy or "")
    return (out, lse_out) if want_lse else out
