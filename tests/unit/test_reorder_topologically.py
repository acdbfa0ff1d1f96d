"""``machinery.rewrite.reorder_topologically``: the whole graph, and only the span a rewrite
touched (what the passes call after each replacement), give the same order; a graph already in
order is left as it is."""

from __future__ import annotations

import operator
import random

import pytest
import torch
from torch import fx

from opfuse.machinery.rewrite import reorder_topologically


def _chain_graph(length: int) -> tuple[fx.Graph, list[fx.Node]]:
    graph = fx.Graph()
    x = graph.placeholder("x")
    nodes, value = [], x
    for i in range(length):
        value = graph.call_function(operator.add, (value, i))
        nodes.append(value)
    graph.output(value)
    return graph, nodes


def _names(graph: fx.Graph) -> list[str]:
    return [n.name for n in graph.nodes]


def _valid(graph: fx.Graph) -> bool:
    seen = set()
    for node in graph.nodes:
        if any(dep not in seen for dep in node.all_input_nodes):
            return False
        seen.add(node)
    return True


def _rewired(seed: int):
    """A random DAG, then a rewrite as the passes make one: a node inserted after the span's
    last node that earlier nodes of the span now read."""
    rng = random.Random(seed)
    graph = fx.Graph()
    values = [graph.placeholder("x"), graph.placeholder("y")]
    for _ in range(40):
        a, b = rng.sample(values, 2)
        values.append(graph.call_function(operator.mul if rng.random() < 0.5 else operator.add, (a, b)))
    graph.output(values[-1])
    body = values[2:]
    lo = rng.randrange(5, 20)
    hi = lo + rng.randrange(3, 15)
    span = body[lo:hi]
    before = span[0].prev
    inputs = [v for v in values if v not in span and values.index(v) < values.index(span[0])]
    with graph.inserting_after(span[-1]):
        new = graph.call_function(operator.sub, (rng.choice(inputs), rng.choice(inputs)))
    # Some nodes inside the span read the new value (they precede it now).
    for node in span[1:]:
        if rng.random() < 0.4:
            node.args = (new, node.args[1])
    return graph, before, new


@pytest.mark.parametrize("seed", range(30))
def test_span_reorder_equals_whole_graph_reorder(seed):
    whole, _, _ = _rewired(seed)
    reorder_topologically(whole)
    spanned, before, new = _rewired(seed)
    reorder_topologically(spanned, before, new)
    assert _valid(whole) and _valid(spanned)
    assert _names(spanned) == _names(whole)


def test_graph_in_order_is_left_alone():
    graph, nodes = _chain_graph(10)
    order = _names(graph)
    reorder_topologically(graph)
    reorder_topologically(graph, nodes[2], nodes[6])
    assert _names(graph) == order


def test_span_must_run_forward():
    graph, nodes = _chain_graph(5)
    with pytest.raises(ValueError, match="does not follow"):
        reorder_topologically(graph, nodes[3], nodes[1])


def test_reorder_moves_a_reader_after_its_new_input():
    graph, nodes = _chain_graph(4)
    x = next(iter(graph.nodes))
    with graph.inserting_after(nodes[3]):
        late = graph.call_function(torch.neg, (x,))
    nodes[1].args = (nodes[0], late)  # nodes[1] now reads a value defined after it
    reorder_topologically(graph, nodes[0], late)
    assert _valid(graph)
    assert _names(graph).index(late.name) < _names(graph).index(nodes[1].name)
