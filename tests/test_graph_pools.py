"""``graph_pools.in_graph_tree`` against stand-ins for Inductor's graph trees (no GPU here):
true only on the tree's own stream, false without a tree, and false (not an error in every
decode call) where the trees' internals differ."""

import sys
import types

import pytest
import torch

from mlatune import graph_pools

CUDA = torch.device("cuda", 0)


@pytest.fixture
def tree(monkeypatch):
    """A stand-in trees module whose thread-local containers hold one manager on device 0
    with stream "s1"; the current stream is "s0" until a test changes it."""
    manager = types.SimpleNamespace(stream="s1")
    containers = {0: types.SimpleNamespace(tree_manager=manager)}
    module = types.SimpleNamespace(
        local=types.SimpleNamespace(tree_manager_containers=containers),
        get_obj=lambda local, name: getattr(local, name))
    monkeypatch.setitem(sys.modules, "torch._inductor.cudagraph_trees", module)
    tls = {"on": True}
    monkeypatch.setattr(torch._C, "_is_key_in_tls", lambda key: tls["on"])
    module.tls = tls
    current = {"stream": "s0"}
    monkeypatch.setattr(torch.cuda, "current_stream", lambda index=None: current["stream"])
    return manager, module, current


def test_only_the_trees_own_stream_is_inside_it(tree):
    _, _, current = tree
    assert not graph_pools.in_graph_tree(CUDA)
    current["stream"] = "s1"
    assert graph_pools.in_graph_tree(CUDA)
    assert not graph_pools.in_graph_tree(torch.device("cpu"))


def test_no_manager_or_no_tree_module_is_outside(tree, monkeypatch):
    _, module, current = tree
    current["stream"] = "s1"
    module.tls["on"] = False  # the thread never ran a tree
    assert not graph_pools.in_graph_tree(CUDA)
    module.tls["on"] = True
    assert not graph_pools.in_graph_tree(torch.device("cuda", 1))  # no container there
    containers = module.local.tree_manager_containers
    assert set(containers) == {0}  # reading made none
    containers[0].tree_manager = None  # a container whose tree was freed
    assert not graph_pools.in_graph_tree(CUDA)
    monkeypatch.delitem(sys.modules, "torch._inductor.cudagraph_trees")
    assert not graph_pools.in_graph_tree(CUDA)


def test_other_internals_answer_false_not_an_error(tree):
    _, module, current = tree
    current["stream"] = "s1"
    del module.get_obj
    assert not graph_pools.in_graph_tree(CUDA)
    module.get_obj = lambda local, name: None  # containers kept some other way
    assert not graph_pools.in_graph_tree(CUDA)


def test_torchs_own_trees_module_reads_as_outside_on_the_cpu():
    """The real module's internals are the ones read: no tree here answers False, and
    reading makes no container."""
    from torch._inductor import cudagraph_trees as trees

    containers = trees.get_obj(trees.local, "tree_manager_containers")
    before = dict(containers)
    assert not graph_pools.in_graph_tree(torch.device("cuda", 7))
    assert containers == before


def test_flashinfers_shared_workspace_is_not_made_inside_a_tree(monkeypatch):
    """FlashInfer's float workspace, shared per device, is kept only when made outside a
    tree: inside one it is the step's own (the tree's pool must not keep it)."""
    from mlatune.routes import flashinfer

    device = torch.device("cpu")
    monkeypatch.setattr(flashinfer, "_workspaces", {})
    monkeypatch.setattr(graph_pools, "in_graph_tree", lambda device: True)
    first = flashinfer._workspace(device)
    assert first.nbytes == flashinfer.WORKSPACE_BYTES and flashinfer._workspaces == {}
    assert flashinfer._workspace(device) is not first
    monkeypatch.setattr(graph_pools, "in_graph_tree", lambda device: False)
    kept = flashinfer._workspace(device)
    assert flashinfer._workspaces == {device: kept} and flashinfer._workspace(device) is kept
    monkeypatch.setattr(graph_pools, "in_graph_tree", lambda device: True)
    assert flashinfer._workspace(device) is kept  # made outside: served inside too
