"""Compiling kernels before a sweep times them.

Triton compiles a kernel on its first launch in a process, on the CPU, one at a
time: a timing worker that meets a new kernel leaves its GPU idle meanwhile.
So before the timed pass, several processes per GPU run the first accuracy
check of one small problem per group of candidates that share kernels, and
the compiled kernels land in Triton's on-disk cache for the timing workers.
This module chooses those candidates and the default number of processes per
GPU; the runner runs them (with no more processes than problems).
"""

from __future__ import annotations

import os
from collections.abc import Iterable

from mlatune.problem import MLAProblem
from mlatune.sweep.candidates import Candidate


def default_workers(gpus: int) -> int:
    """Compile processes per GPU: the cores beyond one per timing worker, at most 8."""
    return max(1, min(8, (os.cpu_count() or 2) // gpus - 1))


def representatives(candidates: Iterable[Candidate]) -> list[Candidate]:
    """One candidate per (route, parameters, problem bucket): the smallest problem.

    Problem sizes are runtime arguments of the kernels, so within a bucket
    (every key field but batch and kv_len) a route's parameter set compiles to
    the same kernels; checking the smallest problem compiles them cheaply.
    """
    def size(c: Candidate) -> tuple[int, int]:
        return c.problem.batch * c.problem.kv_len, c.problem.batch

    smallest: dict[tuple, Candidate] = {}
    for c in candidates:
        group = (c.route_id, c.params_json, c.problem.bucket)
        if group not in smallest or size(c) < size(smallest[group]):
            smallest[group] = c
    # Problems whose candidates bring a (route, parameters, dtypes) not seen before go
    # first: those are the likeliest new kernels, so the workers compile different
    # kernels at once rather than the same one side by side. A problem's candidates
    # stay together, so that a worker makes its inputs once.
    by_problem: dict[MLAProblem, list[Candidate]] = {}
    for c in smallest.values():
        by_problem.setdefault(c.problem, []).append(c)
    seen: set[tuple] = set()
    novel = set()
    for problem, same in by_problem.items():
        kinds = {(c.route_id, c.params_json, problem.phase, problem.q_dtype, problem.kv_dtype)
                 for c in same}
        if kinds - seen:
            novel.add(problem)
        seen |= kinds
    order = sorted(by_problem, key=lambda p: p not in novel)  # stable: plan order within
    return [c for p in order for c in by_problem[p]]
