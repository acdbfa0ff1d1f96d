"""Row-parallel GEMMs split along the tokens, each chunk's all-reduce under the next chunk's GEMM.

In tensor parallelism without sequence parallelism a row-parallel layer's GEMM yields partial sums
that a forward all-reduce adds up. Fused with the residual add and the norm after it, that
all-reduce runs in line on the compute stream and nothing hides it. Split into ``C`` chunks of
tokens instead, chunk ``i``'s all-reduce goes to NCCL's stream as soon as its GEMM is done and runs
while chunk ``i + 1`` multiplies: only the last chunk's all-reduce is exposed. The price: ``C``
smaller GEMMs, NCCL's kernel taking SMs from the GEMM it runs beside, one copy joining the chunks,
and the add + norm as a kernel of its own (opfuse's add + norm, or Inductor's).

Measured (``bench/gemm_allreduce.py``, 2x H100, docs/PERF_NOTES.model.md "Chunked row-parallel GEMM
+ all-reduce"): against GEMM + NCCL all-reduce + add + norm, chunks of 2048 tokens were 6-9% faster
at 8192 tokens; chunks of 1024 tokens were 4-5% slower at 2048 tokens. Hence ``auto``
(``OPFUSE_ALLREDUCE_CHUNKS=0``): chunks of at least :data:`CHUNK_ROWS` tokens, at most
:data:`MAX_CHUNKS`, only where that makes two or more; ``n >= 2`` splits into ``n`` chunks wherever
the tokens allow; ``1`` (the default) never splits. Off by default because the graph the split
replaces runs opfuse's fused all-reduce + add + norm, cheaper than NCCL's all-reduce alone at these
sizes: a whole model (train-tp, 8192 tokens, 2x H200) ran 0.7% slower split. It stays an opt-in,
not yet timed in a model whose all-reduces opfuse leaves to NCCL (where the per-layer measurement
says it should pay). FP8 graphs are not split: their GEMM inputs are quantized in the producing
kernel, which a split would undo.

Only the forward value changes: AOTAutograd's joint graph computes the GEMM's gradients from its
inputs, never from its output, so the backward autograd traced stays as it is. ``explain()`` lists
every split.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import fx

from ..machinery.aten import aten, c10d, calls, shape, value
from .overlap import backward_nodes, summing_reductions

__all__ = ["ChunkedAllReduce", "plan_chunked_all_reduces", "split_all_reduces", "CHUNK_ROWS", "MAX_CHUNKS"]

#: Fewest tokens per chunk under ``auto``.
CHUNK_ROWS = 2048
#: Most chunks under ``auto``.
MAX_CHUNKS = 4

_VIEWS = (aten.view.default, aten.reshape.default, aten._unsafe_view.default)
_GEMMS = (aten.mm.default, aten.addmm.default)


@dataclasses.dataclass(eq=False)
class ChunkedAllReduce:
    """A forward all-reduce of a GEMM's output to split: the GEMM, the collective, its wait, and
    the chunk count; after :func:`split_all_reduces`, the chunks' issue and wait nodes."""

    gemm: fx.Node
    issue: fx.Node
    wait: fx.Node
    chunks: int
    rows: int
    issues: list = dataclasses.field(default_factory=list)
    waits: list = dataclasses.field(default_factory=list)

    def describe(self) -> str:
        return (f"{self.wait.name}: row-parallel GEMM {self.gemm.name} ({self.rows} tokens) split into {self.chunks} "
                f"chunks, each chunk's all-reduce left to NCCL (asynchronous) under the next chunk's GEMM "
                f"(OPFUSE_ALLREDUCE_CHUNKS=1 keeps one GEMM and fuses its all-reduce)")


def chunk_count(rows: int, setting: int) -> int:
    """Chunks for a GEMM of ``rows`` tokens under ``OPFUSE_ALLREDUCE_CHUNKS=setting`` (see the
    module docstring); below 2 means no split."""
    if setting < 0:
        raise ValueError(f"OPFUSE_ALLREDUCE_CHUNKS={setting}: accepted 0 (auto), 1 (off) or a chunk count >= 2")
    if setting == 0:
        return min(MAX_CHUNKS, rows // CHUNK_ROWS)
    return min(setting, rows)


def _static(sizes) -> bool:
    return sizes is not None and all(isinstance(s, int) for s in sizes)


def plan_chunked_all_reduces(graph: fx.Graph, setting: int, exclude=()) -> list[ChunkedAllReduce]:
    """The forward all-reduces of ``graph`` to split: a summing all-reduce (not one in ``exclude``,
    not in the backward) whose input is a GEMM's output, through reshapes only, that nothing else
    reads, with static shapes and a split of two chunks or more."""
    backward = backward_nodes(graph)
    found = []
    for issue, wait in summing_reductions(graph):
        if issue in exclude or issue in backward or not calls(issue, c10d.all_reduce.default):
            continue
        node = issue.args[0]
        while calls(node, *_VIEWS) and len(node.users) == 1:
            node = node.args[0]
        if not calls(node, *_GEMMS) or len(node.users) != 1:
            continue
        a = node.args[1] if calls(node, aten.addmm.default) else node.args[0]
        rows = shape(a)
        val = value(wait)
        if not (_static(rows) and _static(shape(wait)) and _static(shape(node))) or val is None \
                or not val.dtype.is_floating_point:
            continue
        chunks = chunk_count(rows[0], setting)
        if chunks >= 2:
            found.append(ChunkedAllReduce(node, issue, wait, chunks, rows[0]))
    return found


def _add(graph: fx.Graph, target, args, val, like: fx.Node) -> fx.Node:
    node = graph.call_function(target, args)
    node.meta["val"] = val
    for key in ("stack_trace", "nn_module_stack", "source_fn_stack"):
        if key in like.meta:
            node.meta[key] = like.meta[key]
    return node


def split_all_reduces(graph: fx.Graph, plans: list[ChunkedAllReduce]) -> None:
    """Rewrite each plan: at the GEMM, per chunk a row slice of its input, the GEMM of that slice
    and its all-reduce; at the wait, every chunk's wait, their concatenation, and the wait's shape
    (a view) in place of the wait's result."""
    for plan in plans:
        gemm, issue, wait = plan.gemm, plan.issue, plan.wait
        addmm = calls(gemm, aten.addmm.default)
        a = gemm.args[1] if addmm else gemm.args[0]
        a_val = value(a)
        weight = gemm.args[2] if addmm else gemm.args[1]
        bounds = [round(i * plan.rows / plan.chunks) for i in range(plan.chunks + 1)]
        with graph.inserting_before(gemm):
            for lo, hi in zip(bounds, bounds[1:]):
                piece = _add(graph, aten.slice.Tensor, (a, 0, lo, hi), a_val[lo:hi], gemm)
                args = (gemm.args[0], piece, weight) if addmm else (piece, weight)
                product = _add(graph, gemm.target, args,
                               gemm.target(*[value(x) if isinstance(x, fx.Node) else x for x in args]), gemm)
                reduce = _add(graph, issue.target, (product, *issue.args[1:]), product.meta["val"].clone(), issue)
                plan.issues.append(reduce)
        with graph.inserting_before(wait):
            for reduce in plan.issues:
                plan.waits.append(_add(graph, wait.target, (reduce,), value(reduce).clone(), wait))
            joined = _add(graph, aten.cat.default, (plan.waits, 0), torch.cat([value(w) for w in plan.waits]), wait)
            out = _add(graph, aten.view.default, (joined, list(shape(wait))), value(joined).view(shape(wait)), wait)
        wait.replace_all_uses_with(out)
        chain, node = [wait, issue], issue.args[0]
        while node is not gemm:
            chain.append(node)
            node = node.args[0]
        for node in chain + [gemm]:
            graph.erase_node(node)
    if plans:
        graph.lint()
