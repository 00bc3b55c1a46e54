"""Whether a call runs inside a CUDA graph pool that must hold nothing but the graph's
outputs when its warm-up or recording ends: the graph trees of ``torch.compile``'s
``reduce-overhead`` mode (Inductor checks, and later reuses, every other live block of the
pool). A step made there keeps no device memory past its call."""

from __future__ import annotations

import sys

import torch


def in_graph_tree(device: torch.device) -> bool:
    """True while Inductor's CUDA graph tree on ``device`` warms up or records a graph: it
    runs both on a stream of its own, current only then (its allocations go to the tree's
    pool). (Its state says RECORDING only once a recording has ended.) False where the
    tree's internals are not the ones read here (another torch): Inductor then refuses a
    graph whose pool holds a step, loudly, rather than every call failing here."""
    trees = sys.modules.get("torch._inductor.cudagraph_trees")
    if device.type != "cuda" or trees is None:
        return False  # no tree runs in a process that never loaded them
    try:
        if not torch._C._is_key_in_tls("tree_manager_containers"):
            return False  # no tree on this thread
        # The containers read as they are: get_manager would take a lock and make a
        # container for a device that has none, on every decode.
        containers = trees.get_obj(trees.local, "tree_manager_containers")
        index = torch.cuda.current_device() if device.index is None else device.index
        container = containers.get(index)
        manager = None if container is None else container.tree_manager
        return manager is not None and torch.cuda.current_stream(index) == manager.stream
    except (AttributeError, TypeError, KeyError):
        return False
