"""The worker pool on a Ray cluster (``mlatune sweep --ray``): each worker is a Ray actor
holding one GPU (``num_gpus=1``; a share of one while compiling ahead) that runs
``worker.evaluate`` with its own ``worker._ProblemCache``, as a local worker process does.

``RayPool`` is the local ``WorkerPool`` with Ray workers: the same scheduling (a problem's
candidates to one worker), timeouts, deadline and records, the driver journaling every
result, so a stopped or killed driver resumes as a local sweep does. A worker is a
``RayWorkerProcess``: the verbs of ``pool.WorkerProcess``, its events (ready, inputs ready,
the result) forwarded by a thread from the actor to a local pipe the pool waits on. Each
actor holds its next candidate queued behind the one it runs, so that it never waits on the
driver between candidates. An actor that dies scores its candidate ``crashed`` (the one
queued, never started, goes to the next worker); one whose node died gives its candidate to
another worker once (the second time it is ``crashed``, killed from outside, and a resumed
sweep runs it again) and is not replaced.

GPU models: Ray gives every NVIDIA and AMD node an ``accelerator_type:<MODEL>`` resource
(``H100``, ``H200``, ...; a node's operator may declare it too). A ``Target`` is one model's
GPUs: its workers ask for that resource, and its rows go to its own table. Ray is an
optional dependency (``mlatune[ray]``): nothing else of mlatune imports this module.
"""

from __future__ import annotations

import contextlib
import functools
import math
import multiprocessing as mp
import os
import queue
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace
from typing import Any

from mlatune.arch import DeviceInfo
from mlatune.hardware import Hardware
from mlatune.measure.records import KILLED_FROM_OUTSIDE, Record, Result, Status, Task
from mlatune.sweep import runner, worker
from mlatune.sweep.candidates import Candidate
from mlatune.sweep.pool import (
    WORKER_START_TIMEOUT_S,
    Gone,
    Slot,
    WorkerPool,
    WorkerProcess,
)

try:
    import ray
    from ray.exceptions import GetTimeoutError, RayActorError
except ImportError:  # an optional dependency: --ray says what to install
    ray = None

INSTALL = "--ray needs Ray on this machine and every node: pip install 'mlatune[ray]'"
ACCELERATOR = "accelerator_type:"  # Ray's resource naming a node's GPU model
# The share of a node's accelerator_type resource (1 a node) one worker asks for: as Ray's
# own accelerator_type= option, so any number of workers fit where the GPUs do.
_MODEL_SHARE = 0.001
# The driver's variables a worker needs: plugins' routes (MLATUNE_PLUGINS) and settings,
# the Triton interpreter without a GPU.
_FORWARDED = ("MLATUNE_", "TRITON_INTERPRET")
# An actor's calls at once: two tasks' (the one running, the one ahead), each its inputs_ready
# and its evaluate; a thread each, whatever order Ray starts them in.
_CALLS_IN_FLIGHT = 4


class RayUnavailable(RuntimeError):
    """Ray is missing, or the cluster cannot run the sweep asked for (one line)."""


def connect(address: str | None) -> None:
    """Join the cluster at ``address``, else at RAY_ADDRESS, else Ray's choice: the instance
    this machine runs (``ray start``), else a new one. A process already connected stays
    so (tests)."""
    if ray is None:
        raise RayUnavailable(INSTALL)
    if ray.is_initialized():
        return
    address = address or os.environ.get("RAY_ADDRESS") or None
    try:
        ray.init(address=address, include_dashboard=False, logging_level="WARNING")
    except (Exception, SystemExit) as exc:  # Ray exits when no cluster answers at address
        why = "no answer" if isinstance(exc, SystemExit) else f"{type(exc).__name__}: {exc}"
        raise RayUnavailable(f"cannot join the Ray cluster at {address or 'this machine'} "
                             f"({why})") from None


@dataclass(frozen=True)
class Target:
    """One GPU model's share of the cluster: its workers' resources, its GPUs' count, and
    the device and figures a worker found on one of them."""

    model: str | None  # Ray's accelerator type; None: every GPU of a one-model cluster
    gpus: int
    device: DeviceInfo
    figures: Hardware | None

    @property
    def resources(self) -> dict[str, float]:
        return _resources(self.model)


def _resources(model: str | None) -> dict[str, float]:
    """What a worker asks for besides its GPU: a share of its model's resource."""
    return {f"{ACCELERATOR}{model}": _MODEL_SHARE} if model else {}


def gpus_by_model() -> dict[str | None, int]:
    """The live nodes' GPUs by model (None: a node without an accelerator type)."""
    counts: Counter[str | None] = Counter()
    for node in ray.nodes():
        resources = node.get("Resources", {})
        if node.get("Alive") and resources.get("GPU", 0) > 0:
            models = [k.removeprefix(ACCELERATOR) for k in resources if k.startswith(ACCELERATOR)]
            counts[models[0] if len(models) == 1 else None] += int(resources["GPU"])
    return dict(counts)


def targets(models: Sequence[str] = ()) -> list[Target]:
    """The models named (every GPU of the cluster when none is, which must then be of one
    model), each with a worker's look at its device; RayUnavailable otherwise."""
    found = gpus_by_model()
    have = ", ".join(f"{m or 'unlabelled'} x{n}"
                     for m, n in sorted(found.items(), key=lambda item: str(item[0])))
    if not found:
        raise RayUnavailable("the Ray cluster has no GPU (a node declares its GPUs with "
                             "ray start --num-gpus N)")
    if not models and len(found) > 1:
        raise RayUnavailable(f"the Ray cluster has GPUs of several models ({have}): name "
                             f"them with --gpu-model, one table each")
    for model in models:
        if not found.get(model):
            raise RayUnavailable(f"no GPU of model {model} in the Ray cluster (it has {have})")
    if not models:
        return [_probed(None, sum(found.values()))]
    return [_probed(model, found[model]) for model in models]


def _probed(model: str | None, gpus: int) -> Target:
    # max_calls=1: its process leaves, and its CUDA context with it, before the workers come
    probe = ray.remote(max_calls=1)(_look).options(
        num_gpus=1, num_cpus=0, resources=_resources(model), runtime_env=_runtime_env())
    try:
        device, figures = ray.get(probe.remote(), timeout=WORKER_START_TIMEOUT_S)
    except GetTimeoutError:
        raise RayUnavailable(f"no GPU{f' of model {model}' if model else ''} became free "
                             f"within {WORKER_START_TIMEOUT_S:.0f}s") from None
    # index -1: a device this process does not hold (the driver may have no GPU)
    return Target(model, gpus, replace(DeviceInfo(**device), index=-1),
                  Hardware.from_json(figures))


def _look() -> tuple[dict, str | None]:
    """On a worker's GPU: its device, and its figures with the bandwidth measured."""
    from mlatune import hardware
    from mlatune.arch import current_device

    device = current_device()
    if not device.is_gpu:
        return device.as_dict(), None
    return device.as_dict(), hardware.of_device(device,
                                                hardware.measure_bandwidth(device)).as_json()


@contextlib.contextmanager
def serving(target: Target) -> Iterator[None]:
    """The runner's passes run on ``target``'s Ray workers while inside."""
    token = runner.POOL.set(functools.partial(RayPool, target))
    try:
        yield
    finally:
        runner.POOL.reset(token)


class RayPool(WorkerPool):
    """``WorkerPool`` on ``target``'s GPUs: one worker a GPU, or where ``devices`` names
    each device k times (compiling ahead), k workers a GPU each holding 1/k of it."""

    def __init__(self, target: Target, devices: list[str], timeout_s: float,
                 task_of: Callable[[Candidate], Task],
                 on_result: Callable[[Record], None] = lambda record: None,
                 deadline: float = math.inf):
        per_gpu = max(Counter(devices).values())
        super().__init__(["ray"] * (target.gpus * per_gpu), timeout_s, task_of, on_result,
                         deadline)
        self.target, self.gpu_share = target, 1.0 / per_gpu
        self._requeued: set[str] = set()  # candidates whose node died once

    def start_worker(self, device: str) -> RayWorkerProcess:
        process = RayWorkerProcess(self.target, self.gpu_share)
        process.start()
        return process

    def worker_lost(self, slot: Slot, event: Gone) -> bool:
        """A worker whose node died is not replaced: its candidate goes to another worker,
        once, and its problem's rest back to the queue. Losing the cluster stops the sweep:
        that says nothing of the candidate in flight."""
        if slot.process.lost:
            raise RuntimeError(event.reason)
        if not slot.process.node_died:
            return False
        candidate = slot.candidate
        if candidate is not None and candidate.id in self._requeued:
            self._finish(slot, Result(status=Status.CRASHED, reason=event.reason))
        elif candidate is not None:
            self._requeued.add(candidate.id)
            slot.group.appendleft(candidate)
            slot.candidate = None
        if slot.group:
            self._groups.appendleft(slot.group)
        slot.process.kill()
        self._slots.remove(slot)
        if not self._slots and self._groups:
            raise RuntimeError("every Ray worker's node died")
        return True

    def handed_over(self, slot: Slot) -> None:
        """Queue the worker's next candidate on its actor, so that the actor starts it the
        moment the current one ends: the result's way back and the next hand-over overlap
        the run. It is its problem's next, else, while as many problems wait as there are
        workers (the others still find one each), the next problem's, which the slot takes.
        It stays in ``slot.group`` until sent: a worker lost passes it on with the group."""
        if (not slot.group and len(self._groups) >= len(self._slots)
                and self._fits(self._groups[0], time.monotonic())):
            slot.group = self._groups.popleft()
        if slot.group:
            slot.process.put_ahead(self.task_of(slot.group[0]))


class RayWorkerProcess(WorkerProcess):
    """A Ray actor on one GPU, with a ``WorkerProcess``'s verbs: ``get`` reads the events a
    courier thread forwards from the actor to a local pipe, and a dead actor closes it;
    ``put_ahead`` queues the next task on the actor before its ``put``."""

    def __init__(self, target: Target, gpu_share: float = 1.0):
        self.kind = "cuda" if target.device.is_gpu else "cpu"
        super().__init__(self.kind)  # ``device`` becomes where it runs, once it runs
        self.target, self.gpu_share = target, gpu_share
        self.node_id: str | None = None
        self.pid = 0  # the actor's process, once it runs
        self.node_died = False
        self.lost = False  # Ray itself failed (the cluster gone), not the actor
        self._reason = ""
        self._tasks: queue.SimpleQueue = queue.SimpleQueue()
        self._sent = 0  # tasks submitted to the actor, which runs them in this order
        self._ahead: tuple[Task, tuple[Any, Any]] | None = None  # submitted, not yet put
        self._actor: Any = None
        self._courier: threading.Thread | None = None

    def start(self) -> None:
        self._conn, feed = mp.Pipe()
        self._actor = _actor_class().options(
            num_gpus=self.gpu_share, num_cpus=0, resources=self.target.resources,
            max_concurrency=_CALLS_IN_FLIGHT, runtime_env=_runtime_env()).remote(self.kind)
        self._courier = threading.Thread(target=self._forward, args=(feed,), daemon=True)
        self._courier.start()
        self.started_at = time.monotonic()

    def alive(self) -> bool:
        return self._courier is not None and self._courier.is_alive()

    def put(self, task: Task) -> None:
        if not self.alive():
            raise OSError(self._reason or "the Ray worker is gone")
        ahead, self._ahead = self._ahead, None
        self._tasks.put(ahead[1] if ahead and ahead[0] == task else self._submit(task))

    def put_ahead(self, task: Task) -> None:
        """Submit ``task`` behind the one running, to start as soon as that one ends; the
        next ``put`` of it hands it over (its events then come)."""
        if self._ahead is None and self.alive():
            self._ahead = (task, self._submit(task))

    def _submit(self, task: Task) -> tuple[Any, Any]:
        """The actor's calls for ``task``: its inputs ready, its result."""
        self._sent += 1
        return (self._actor.inputs_ready.remote(self._sent),
                self._actor.evaluate.remote(task.to_json(), self._sent))

    def stop(self) -> None:
        self._tasks.put(None)
        with contextlib.suppress(Exception):  # already gone
            self._actor.__ray_terminate__.remote()

    def wait(self, timeout: float) -> None:
        if self._courier is not None:
            self._courier.join(timeout)

    def kill(self) -> None:
        with contextlib.suppress(Exception):  # already gone, or Ray shut down
            ray.kill(self._actor)
        self._tasks.put(None)
        self.wait(10)
        self._conn.close()

    def death_reason(self) -> str:
        self.wait(10)
        return self._reason or "the Ray worker stopped"

    def _forward(self, feed: Any) -> None:
        """The actor's events into ``feed``: ready (with where it runs), then per task its
        inputs ready and its result; on the actor's death, why, and ``feed`` closed."""
        try:
            self.node_id, self.device, self.pid = ray.get(self._actor.where.remote())
            feed.send({"ready": True})
            while (refs := self._tasks.get()) is not None:
                inputs, result = refs
                ray.get(inputs)
                feed.send({"inputs_ready": True})
                feed.send(ray.get(result))
        except RayActorError as exc:
            self.node_died = self.node_id is not None and not _alive(self.node_id)
            self._reason = (f"{KILLED_FROM_OUTSIDE} (its Ray node died)" if self.node_died
                            else f"Ray worker died: {_death(exc)}")
        except OSError:  # the pool closed its end (killed it)
            pass
        except Exception as exc:  # Ray itself failed (shut down, lost the cluster)
            self.lost = True
            self._reason = f"lost the Ray cluster: {type(exc).__name__}: {exc}"[:500]
        finally:
            feed.close()


def _alive(node_id: str) -> bool:
    return any(n.get("NodeID") == node_id and n.get("Alive") for n in ray.nodes())


def _death(exc: Exception) -> str:
    """Ray's account of an actor's death in a line: its exit detail where it gives one."""
    text = " ".join(str(exc).split())
    cause = text.split("Worker exit detail: ", 1)[-1].split("The actor is dead because ")[-1]
    return cause.split(" Some common causes", 1)[0][:300]


def _runtime_env() -> dict[str, Any]:
    return {"env_vars": {k: v for k, v in os.environ.items() if k.startswith(_FORWARDED)}}


class _Worker:
    """One sweep worker in a Ray actor: ``worker.evaluate`` with its own problem cache on the
    GPU Ray gave it (Ray sets CUDA_VISIBLE_DEVICES to it: cuda:0 here), or on the CPU. Its
    calls run on threads: task n's ``evaluate`` waits for task n - 1's to end, and its
    ``inputs_ready`` answers once the task's inputs exist."""

    def __init__(self, kind: str):
        import torch

        self.device = torch.device("cuda", 0) if kind == "cuda" else torch.device("cpu")
        if kind == "cuda":
            torch.cuda.set_device(self.device)
        self.cache = worker._ProblemCache()
        self._progress = threading.Condition()
        self._inputs_for = 0  # the last task whose inputs exist (or that ended without)
        self._ended = 0  # the last task that ended

    def where(self) -> tuple[str, str, int]:
        """Its node's id, where it runs as a record's ``device`` says it, and its pid."""
        node = ray.get_runtime_context().get_node_id()
        gpus = ",".join(str(g) for g in ray.get_gpu_ids()) or "-"
        return node, f"{ray.util.get_node_ip_address()}/{node[:8]} gpu {gpus}", os.getpid()

    def evaluate(self, task: dict[str, Any], n: int) -> dict[str, Any]:
        with self._progress:
            self._progress.wait_for(lambda: self._ended >= n - 1)
        try:
            return worker.evaluate(task, self.device, self.cache,
                                   lambda: self._reached(n)).to_json()
        finally:
            self._reached(n, ended=True)

    def inputs_ready(self, n: int) -> None:
        """Returns once task ``n``'s inputs and references exist."""
        with self._progress:
            self._progress.wait_for(lambda: self._inputs_for >= n)

    def _reached(self, n: int, ended: bool = False) -> None:
        with self._progress:
            self._inputs_for = max(self._inputs_for, n)
            self._ended = n if ended else self._ended
            self._progress.notify_all()


@functools.cache
def _actor_class() -> Any:
    return ray.remote(_Worker)
