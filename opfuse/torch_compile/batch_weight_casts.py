"""One launch for a graph's same-shape FP8 weight casts.

With power-of-two weight scales each FP8 GEMM of a compiled graph casts its weight through
``opfuse::quantize_weight_pow2``: two Triton launches and four allocations on the host per
weight, per step. A model of many small layers has a hundred of them (Llama 3.2 1B's decoder:
112 per training step), and without CUDA graphs that host time, not the GPU, set the FP8 step's
time (docs/PERF_NOTES.model.md, session 25). The weights of one shape (every layer's o
projection, every layer's down projection, ...) are independent and read only parameters, so
:func:`batch_weight_casts` replaces each such set by one ``opfuse::quantize_weights_pow2`` call,
which finds the weights through a table of their addresses and writes the same bytes into one
stacked output; each GEMM reads its slice.

Only casts between the same two collectives are batched: the overlap pass moved each cast under
the forward collective before it (:func:`.overlap.fill_with_weight_work`), and gathering them in
one place would undo that. A batch holds at most ``opfuse.config.fp8_weight_batch_mb`` MiB of
FP8 output (``OPFUSE_FP8_WEIGHT_BATCH_MB``; 0 = never batch): a cast moved ahead of the layers
before it keeps its output alive from there, so the cap bounds the extra peak memory.
"""

from __future__ import annotations

import operator

import torch
from torch import fx

from ..families.quantize import weight_pow2
from .lower import graph_fake_mode, trace_into
from .overlap import backward_nodes, is_collective, weight_only

__all__ = ["batch_weight_casts"]

_CAST = torch.ops.opfuse.quantize_weight_pow2.default


def _not_a_gradient(placeholder: fx.Node) -> bool:
    return not placeholder.name.startswith("tangents")


def _outputs(cast: fx.Node) -> dict[int, list[fx.Node]] | None:
    """The cast's ``getitem`` users by index, or ``None`` when it is read another way."""
    found = {}
    for user in cast.users:
        if user.target is not operator.getitem or not isinstance(user.args[1], int):
            return None
        found.setdefault(user.args[1], []).append(user)
    return found


def _batchable(cast: fx.Node, computed: set[fx.Node], backward: set[fx.Node]) -> tuple | None:
    """The batch key of ``cast`` (window excluded), or ``None`` where it stays as it is. A cast
    only the backward reads joins only others like it: batched with the forward's, its bytes would
    be kept from the forward to the backward. ``computed``: the nodes computed from graph inputs
    other than gradients alone (no collective, no side effect on the way), which can move anywhere
    after the placeholders."""
    weight, _, dtype, transpose = cast.args
    val = weight.meta.get("val")
    outputs = _outputs(cast)
    if (not isinstance(val, torch.Tensor) or val.dim() != 2 or not all(isinstance(d, int) for d in val.shape)
            or outputs is None or (not transpose and 2 in outputs)
            or not (weight in computed or weight.op == "placeholder" and _not_a_gradient(weight))):
        return None
    for_backward = all(user in backward for getitems in outputs.values() for g in getitems for user in g.users)
    return tuple(val.shape), val.dtype, val.device, dtype, transpose, for_backward


def _hoist(graph: fx.Graph, weight: fx.Node, before: fx.Node) -> None:
    """Move ``weight``'s computation (graph inputs only: :func:`_batchable`) that follows ``before``
    to just ahead of it, in graph order."""
    if weight.op == "placeholder":
        return
    order = {n: i for i, n in enumerate(graph.nodes)}
    late, stack = set(), [weight]
    while stack:
        node = stack.pop()
        if node.op != "placeholder" and order[node] > order[before] and node not in late:
            late.add(node)
            stack.extend(node.all_input_nodes)
    for node in sorted(late, key=order.__getitem__):
        before.prepend(node)


def _placeholders_first(graph: fx.Graph) -> None:
    """Move every placeholder ahead of every computation, keeping their order (the graph's
    signature): the lowering inserted fused ops right after their first input, between
    placeholders, and a batched cast must follow all of its weights."""
    first = next((n for n in graph.nodes if n.op != "placeholder"), None)
    if first is None:
        return
    for node in [n for n in graph.nodes if n.op == "placeholder"]:
        first.prepend(node)


def _rewrite(graph: fx.Graph, casts: list[fx.Node], fake_mode) -> None:
    first = casts[0]
    for cast in casts[1:]:
        _hoist(graph, cast.args[0], first)
    weights = [cast.args[0] for cast in casts]
    _, _, dtype, transpose = first.args
    key = weight_pow2.new_key()
    count = len(casts)

    def run(*tensors):
        data, data_t, scales = torch.ops.opfuse.quantize_weights_pow2(list(tensors), key, dtype, transpose)
        return [(data[i], scales[i], data_t[i] if transpose else None) for i in range(count)]

    replaced = trace_into(graph, run, weights, first, fake_mode, "batch_weight_casts")
    for cast, values in zip(casts, replaced):
        for index, getitems in _outputs(cast).items():
            for getitem in getitems:
                getitem.replace_all_uses_with(values[index])
                graph.erase_node(getitem)
        graph.erase_node(cast)
    weight_pow2.reserve_hint(key, weights[0].meta["val"].device, count)


def batch_weight_casts(graph: fx.Graph, max_mb: int) -> list[str]:
    """Replace the power-of-two FP8 weight casts of ``graph`` that share a shape, dtypes and a window
    between collectives by one call each, in batches of at most ``max_mb`` MiB of output (see the
    module docstring); returns a line for ``explain()`` (none when nothing was batched)."""
    if max_mb <= 0:
        return []
    computed, backward = weight_only(graph, _not_a_gradient), backward_nodes(graph)
    batches: dict[tuple, list[list[fx.Node]]] = {}
    window = 0
    for node in graph.nodes:
        if is_collective(node):
            window += 1
        elif node.op == "call_function" and node.target is _CAST:
            key = _batchable(node, computed, backward)
            if key is None:
                continue
            (rows, cols), transpose = key[0], key[4]
            size = rows * cols * (2 if transpose else 1)
            runs = batches.setdefault((window,) + key, [[]])
            if runs[-1] and (len(runs[-1]) + 1) * size > max_mb << 20:
                runs.append([])
            runs[-1].append(node)
    chosen = [casts for runs in batches.values() for casts in runs if len(casts) > 1]
    if not chosen:
        return []
    fake_mode = graph_fake_mode(graph)
    _placeholders_first(graph)
    for casts in chosen:
        _rewrite(graph, casts, fake_mode)
    graph.lint()
    total = sum(len(casts) for casts in chosen)
    return [f"{total} FP8 weight casts quantized in {len(chosen)} launch(es), one per set of same-shape weights "
            f"between two collectives (at most {max_mb} MiB each: OPFUSE_FP8_WEIGHT_BATCH_MB; 0 casts each alone)"]
