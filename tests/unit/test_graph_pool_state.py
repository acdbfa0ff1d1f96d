"""How opfuse tells that a cudagraph tree is warming up or recording on this thread (its state
found, never created), on CPU with a stand-in for ``torch._inductor.cudagraph_trees``; the
behaviour on a GPU is in tests/gpu/test_graph_pool.py."""

import sys
import threading
import types

import torch

from opfuse.runtime import device


def _fake_trees(containers=None):
    module = types.ModuleType("torch._inductor.cudagraph_trees")
    module.local = threading.local()
    if containers is not None:
        module.local.tree_manager_containers = containers
    return module


def test_no_tree_module_means_no_tree(monkeypatch):
    monkeypatch.delitem(sys.modules, "torch._inductor.cudagraph_trees", raising=False)
    assert device._cudagraph_tree_stream(0) is None


def test_the_tree_stream_of_the_device_is_found(monkeypatch):
    stream = object()
    manager = types.SimpleNamespace(stream=stream)
    containers = {0: types.SimpleNamespace(tree_manager=manager), 1: types.SimpleNamespace(tree_manager=None)}
    monkeypatch.setitem(sys.modules, "torch._inductor.cudagraph_trees", _fake_trees(containers))
    assert device._cudagraph_tree_stream(0) is stream
    assert device._cudagraph_tree_stream(1) is None  # a container whose tree was never made
    assert device._cudagraph_tree_stream(2) is None  # no container for that device


def test_a_thread_without_tree_state_gets_none_and_creates_none(monkeypatch):
    fake = _fake_trees()
    monkeypatch.setitem(sys.modules, "torch._inductor.cudagraph_trees", fake)
    monkeypatch.setattr(torch._C, "_is_key_in_tls", lambda key: False)
    assert device._cudagraph_tree_stream(0) is None
    assert not hasattr(fake.local, "tree_manager_containers")


def test_off_cuda_nothing_allocates_to_a_graph_pool(monkeypatch):
    stream = types.SimpleNamespace(cuda_stream=0)
    containers = {0: types.SimpleNamespace(tree_manager=types.SimpleNamespace(stream=stream))}
    monkeypatch.setitem(sys.modules, "torch._inductor.cudagraph_trees", _fake_trees(containers))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert device.allocating_to_graph_pool() is False
