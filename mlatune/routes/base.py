"""The route contract: what every way of computing MLA must provide.

A route is a stateless object with a stable id ``<family>/<backend>``. Its
``supports`` answers from the problem and the device description alone (no GPU
work), so planning, the dispatcher and `mlatune plan` can call it anywhere.
``prepare`` does every allocation and the planning that depends on shapes only,
and returns a ``Prepared``: the step an engine calls every decode step.

An engine's step is a per-step plan and a launch, split as FlashMLA splits
get_mla_metadata from its kernel:

- ``plan`` rebuilds what depends on this step's length *values* (work lists,
  windows, index tables) into the prepared buffers. A route whose launch reads
  the lengths itself has none (``plan_on == "none"``); one that plans on the
  device is capturable with its launch; one that can only plan on the host
  (``plan_on == "host"``) is prepared again every step and is never captured.
- ``run`` only launches work: that is what the sweep times as the launch.

Stored ids never change meaning; a new variant gets a new id.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from mlatune.arch import DeviceInfo
from mlatune.check.accuracy import Rounding
from mlatune.check.inputs import DecodeInputs, PrefillInputs
from mlatune.problem import FP8_DTYPES, MLAProblem, is_power_of_two
from mlatune.steps import (  # noqa: F401  (re-exported: routes declare step kinds)
    DEVICE_PLANNED,
    HOST_PLANNED,
    LAUNCH_ONLY,
    PLAN_PLACES,
    PlanOn,
    StepKind,
)

if TYPE_CHECKING:
    from mlatune.routes.geometry import LaunchGeometry

Params = dict[str, Any]

# Bounds routes declare in ``param_limits``: KV splits a request (past this the partials
# alone outgrow a GPU at a large batch: 200 x 128 heads x 256 splits x 2 KB is 13 GB), and a
# Triton tile's sizes, warps and pipeline depth.
SPLIT_LIMIT = (1, 256)
TILE_LIMITS = MappingProxyType({"block_m": (1, 256), "block_n": (1, 256), "num_warps": (1, 16),
                                "num_stages": (1, 8)})
# Of those, what Triton takes only as a power of two (a tile's aranges, a block's warps).
POWER_OF_TWO_PARAMS = frozenset({"block_m", "block_n", "num_warps"})


@dataclass(frozen=True)
class Verdict:
    ok: bool
    reason: str = ""

    def __bool__(self) -> bool:
        return self.ok


YES = Verdict(True, "supported")


def no(reason: str) -> Verdict:
    return Verdict(False, reason)


@dataclass
class Prepared:
    """A ready-to-launch route call and the buffers it writes.

    For a decode problem with dcp_size > 1, ``out``/``lse`` are the partial
    results of one rank over its shard; the caller merges ranks. ``run`` must
    write every element of ``out`` (and of ``lse`` when present) on every call.

    ``plan_reads_lengths``: ``run`` depends on the *contents* of the length
    tensors (seq_lens / cu_seqlens / a shard's lengths: a work list, index lists,
    a minimum or maximum length) as they were when last planned. ``plan``, when
    given, replans from the current contents on the device without a host sync;
    without it only ``prepare`` replans (on the host). False: ``run`` reads the
    lengths when it launches and stays right when they are rewritten in place.
    """

    run: Callable[[], None]
    out: torch.Tensor
    lse: torch.Tensor | None = None
    graph_safe: bool = True  # ``run`` may be captured in a CUDA graph and replayed
    params: Params = field(default_factory=dict)
    plan_reads_lengths: bool = False
    plan: Callable[[], None] | None = None  # the per-step device plan (see above)
    # What ``plan`` fills (a ``SharedPlan``), for another prepare of the same route,
    # problem, parameters and rank to read (``prepare(plan_from=...)``): the attention
    # layers of one engine step plan once and launch many times.
    plan_state: SharedPlan | None = None
    # Device bytes ``prepare`` allocated that the call holds besides ``out`` and ``lse``
    # (split partials, plans, a vendor's buffers): measured by whoever prepares it
    # (``decode_step.prepare_route``), 0 where not measured (the CPU).
    workspace_bytes: int = 0

    @property
    def step_kind(self) -> StepKind:
        if not self.plan_reads_lengths:
            return StepKind("none", self.graph_safe)
        if self.plan is not None:
            return StepKind("device", self.graph_safe)
        return StepKind("host", False)

    def step(self) -> None:
        """One engine step: the device plan (if any), then the launch."""
        if self.plan is not None:
            self.plan()
        self.run()


@dataclass(frozen=True)
class SharedPlan:
    """A device plan's buffers and its launcher, for launches of other layers to read.

    ``key`` is what the plan was made for (route, problem key, parameters, rank, the
    length tensors): a prepare handed a plan made for anything else refuses it.
    """

    key: tuple
    buffers: Any
    plan: Callable[[], None]


def plan_key(route_id: str, problem: MLAProblem, params: Params, rank: int,
             *tensors: torch.Tensor) -> tuple:
    """What a shared plan must match: route, problem, parameters, rank, length tensors."""
    return (route_id, problem.key, tuple(sorted((k, str(v)) for k, v in params.items())),
            rank, *(t.data_ptr() for t in tensors))


def shared_buffers(plan_from: Prepared | None, key: tuple) -> SharedPlan | None:
    """``plan_from``'s plan when it was made for ``key``; None without one."""
    if plan_from is None:
        return None
    shared = plan_from.plan_state
    if shared is None or shared.key != key:
        raise ValueError("plan_from was prepared for another route, problem, parameters, "
                         "rank or length tensors: its plan cannot serve this call")
    return shared


class Route(ABC):
    """One way of computing MLA, declaring everything about itself.

    Subclasses set ``id`` and implement the three abstract methods; every other hook has a
    default that says "nothing special", so a route declares only what sets it apart.
    Nothing outside a route asks what it is by its id or probes it for attributes.
    """

    id: ClassVar[str]  # "<family>/<backend>"; a stored id never changes meaning
    # Parameters derived from the problem's sizes (KV splits): redone for a neighbour's
    # shape by ``params_at`` rather than carried over as they ran there.
    sized_params: ClassVar[tuple[str, ...]] = ()
    # Kernel options added after rows were stored, at the value a stored set without them ran.
    kernel_options: ClassVar[Mapping[str, object]] = MappingProxyType({})
    writes_into: ClassVar[bool] = False  # ``prepare`` takes the caller's ``out=`` and ``lse=``
    # ``prepare`` takes ``plan_from=`` (a Prepared of the same route, problem, parameters
    # and rank) and reads its device plan: the layers of one step plan once.
    shares_plan: ClassVar[bool] = False
    # The integer parameters a stored set may name and their bounds, inclusive: what a
    # kernel allocates or launches by (a table naming a set outside them is refused on load).
    param_limits: ClassVar[Mapping[str, tuple[int, int]]] = MappingProxyType({})
    # Kernel forms whose stored sets belong to a route of their own now: form id -> its id.
    moved_forms: ClassVar[Mapping[str, str]] = MappingProxyType({})

    @abstractmethod
    def supports(self, problem: MLAProblem, device: DeviceInfo) -> Verdict:
        """Whether this route can serve the problem on the device, and if not why."""

    @abstractmethod
    def param_space(self, problem: MLAProblem, device: DeviceInfo) -> list[Params]:
        """Candidate parameter sets to tune over (``[{}]`` when there is nothing to tune)."""

    @abstractmethod
    def prepare(self, problem: MLAProblem, inputs: DecodeInputs | PrefillInputs, *,
                rank: int = 0, params: Params | None = None, want_lse: bool = True,
                **buffers: Any) -> Prepared:
        """Plan and allocate for ``inputs`` (decode: DCP rank ``rank``'s shard); ``buffers``
        are ``out=``/``lse=`` (``writes_into``) and ``plan_from=`` (``shares_plan``)."""

    def unusable(self, device: DeviceInfo) -> str | None:
        """Why it can run nothing on ``device`` in this process (its library missing or
        broken here); None: it may run, ``supports`` deciding per problem."""
        return None

    def step_kind(self, params: Params) -> StepKind:
        """What ``prepare(params=params)``'s ``Prepared.step_kind`` will be, known without a GPU."""
        return LAUNCH_ONLY

    def rounding(self, problem: MLAProblem, params: Params) -> Rounding:
        """What it rounds beyond the problem's dtypes when run with ``params`` (empty: its
        first set at the problem): its numeric class, which the accuracy bound and the
        caller's accuracy policy read."""
        return Rounding.NONE

    def fill_defaults(self, params: Params, space: list[Params]) -> Params:
        """``params`` as the route runs them, ``space`` being its sets at the problem: the first
        set where none are given; else the given ones over that set, each of
        ``kernel_options`` at the value a set stored without it ran."""
        options = dict(self.kernel_options)
        if not params:
            return {**options, **space[0]}
        return {**space[0], **options, **params}

    def launch_geometry(self, problem: MLAProblem, recipe: Mapping[str, Any], cus: int
                        ) -> LaunchGeometry | None:
        """How a recipe (parameters less the sized ones) spreads its work over ``cus`` SMs, for
        the predictor's cost law (``routes.geometry``); None: taken as balanced."""
        return None

    def check_params(self, params: Params) -> str | None:
        """Why a stored set cannot be run as it says (None: it can): by default a parameter
        of ``param_limits`` that is not an integer within its bounds, or a tile size or warp
        count (``POWER_OF_TWO_PARAMS``) that is not a power of two."""
        for name, (low, high) in self.param_limits.items():
            value = params.get(name, low)
            if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
                return f"{name} {value!r} is not an integer in [{low}, {high}]"
            if name in POWER_OF_TWO_PARAMS and not is_power_of_two(value):
                return f"{name} {value} is not a power of two"
        return None

    def upgrade_params(self, params: Params) -> Params | None:
        """A stored parameter set in this route's current spelling; None when it names a kernel
        form that no longer exists (its rows are then stale: re-measure, never served)."""
        return params

    def route_of(self, params: Params) -> str:
        """The route a stored set of this one belongs to: this route, or the one its form
        moved to (``moved_forms``)."""
        form = params.get("form")
        return self.moved_forms.get(form, self.id) if isinstance(form, str) else self.id

    def serves_empty(self, problem: MLAProblem, params: Params) -> bool:
        """Whether rows that attend no key (a request of length 0, a short request's tokens
        before its first key) get output 0 and LSE -inf; False: never served where the lengths
        may hold them (a held step, a CUDA graph's bucket)."""
        return True


def step_kind_of(route: Route, params: Params) -> StepKind:
    """The step kind ``route`` declares for ``params``."""
    return route.step_kind(params)


def rounding(route: Route, problem: MLAProblem, params: Params | None = None) -> Rounding:
    """What ``route`` run with ``params`` (None: its defaults) rounds past the problem's
    dtypes (``Route.rounding``); NONE over an fp8 q, whose own bound is the fp8 one."""
    if problem.q_dtype in FP8_DTYPES:
        return Rounding.NONE
    return Rounding(route.rounding(problem, params or {}))


def with_defaults(route: Route, params: Params | None, space: list[Params]) -> Params:
    """``params`` as ``route`` runs them (``Route.fill_defaults``)."""
    return route.fill_defaults(params or {}, space)


def params_at(route: Route, params: Params, measured_at: MLAProblem, problem: MLAProblem,
              device: DeviceInfo) -> Params:
    """How to call ``route`` on ``problem`` when ``params`` won at ``measured_at``, a
    neighbour that differs in batch and KV length only.

    A route may name ``sized_params``: numbers it derives from the problem's sizes
    (KV splits), its first set of each recipe (the rest: tiles, warps, variant) being
    the one its rule picks (the split that fills the device). ``params`` is a set of the
    neighbour's list as the route ran it (defaults filled in). The answer is the
    recipe's set of ``problem`` whose sized values stand to the rule's there as
    ``params``' stand to the rule's at the neighbour (nearest in log scale), as the
    list has it: the route fills in its defaults for ``problem`` (a persistent set
    does not keep the neighbour's unused split). ``params`` itself when the route
    names no sized parameters or the recipe is not in the neighbour's list.
    """
    sized = route.sized_params
    if not sized or measured_at == problem:
        return params
    # Kernel options are matched apart from the recipe and kept as ``params`` ran them.
    options = {k: params.get(k, v) for k, v in route.kernel_options.items()}

    def recipe(p: Params) -> Params:
        return {k: v for k, v in p.items() if k not in sized and k not in options}

    want = recipe(params)
    there = [p for p in route.param_space(measured_at, device) if recipe(p) == want]
    here = [p for p in route.param_space(problem, device) if recipe(p) == want]
    asked = next((p for p in there if all(params.get(k) == p[k] for k in sized if k in p)),
                 None)
    if asked is None or not here:
        return params
    target = {k: asked[k] * here[0][k] / there[0][k] for k in sized if k in asked}
    best = min(here, key=lambda p: sum(abs(math.log(p[k] / v)) for k, v in target.items()))
    return {**best, **options}
