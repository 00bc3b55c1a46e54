"""The route contract: what every way of computing MLA must provide.

A route is a stateless object with a stable id ``<family>/<backend>``. Its
``supports`` answers from the problem and the device description alone (no GPU
work), so planning, the dispatcher and `mlatune plan` can call it anywhere.
``prepare`` does every allocation and all planning (metadata, padding buffers)
and returns a ``Prepared`` whose ``run`` only launches work: that is what gets
timed. Stored ids never change meaning; a new variant gets a new id.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import torch

from mlatune.arch import DeviceInfo
from mlatune.inputs import DecodeInputs, PrefillInputs
from mlatune.problem import MLAProblem

Params = dict[str, Any]


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

    ``plan_reads_lengths``: ``prepare`` planned from the *contents* of the length
    tensors (seq_lens / cu_seqlens / a shard's lengths: a host-side work list,
    index lists, a minimum or maximum length), so ``run`` is right only for the
    lengths those tensors held then. False: ``run`` reads the lengths when it
    launches and stays right when they are rewritten in place.
    """

    run: Callable[[], None]
    out: torch.Tensor
    lse: torch.Tensor | None = None
    graph_safe: bool = True  # may be captured in a CUDA graph and replayed
    params: Params = field(default_factory=dict)
    plan_reads_lengths: bool = False


@runtime_checkable
class Route(Protocol):
    id: str  # "<family>/<backend>"

    def supports(self, problem: MLAProblem, device: DeviceInfo) -> Verdict:
        """Whether this route can serve the problem on the device, and if not why."""
        ...

    def param_space(self, problem: MLAProblem, device: DeviceInfo) -> list[Params]:
        """Candidate parameter sets to tune over (``[{}]`` when there is nothing to tune)."""
        ...

    def prepare(
        self,
        problem: MLAProblem,
        inputs: DecodeInputs | PrefillInputs,
        *,
        rank: int = 0,
        params: Params | None = None,
        want_lse: bool = True,
    ) -> Prepared:
        """Plan and allocate for ``inputs`` (decode: DCP rank ``rank``'s shard)."""
        ...


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
    sized = getattr(route, "sized_params", ())
    if not sized or measured_at == problem:
        return params

    def recipe(p: Params) -> Params:
        return {k: v for k, v in p.items() if k not in sized}

    want = recipe(params)
    there = [p for p in route.param_space(measured_at, device) if recipe(p) == want]
    here = [p for p in route.param_space(problem, device) if recipe(p) == want]
    asked = next((p for p in there if all(params.get(k) == p[k] for k in sized if k in p)),
                 None)
    if asked is None or not here:
        return params
    target = {k: asked[k] * here[0][k] / there[0][k] for k in sized if k in asked}
    best = min(here, key=lambda p: sum(abs(math.log(p[k] / v)) for k, v in target.items()))
    return best
