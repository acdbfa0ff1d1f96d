"""Per-group token counts that a model computes as floats, read as the integers they are.

Grouped GEMMs take their group offsets as ``cumsum(counts, 0, dtype=torch.int32)``. Hugging Face's
mixture-of-experts layers (transformers 5, ``experts_implementation="grouped_mm"``) count the
tokens of each expert with ``torch.histc``, which on CPU takes floats only: the counts are then a
float32 tensor holding integers, which ``BasicGroupedLinear`` (integer group sizes) refuses. A
histogram's bins hold counts, so casting them to int32 before the cumulative sum changes no value;
:func:`integer_histogram_counts` inserts that cast into the aten graph, and the grouped GEMMs'
recognizer then finds integer group sizes. Nothing else reads the cast (the float counts keep their
other users).
"""

from __future__ import annotations

import torch
from torch import fx

from ..machinery.aten import aten, calls, dtype, value

__all__ = ["integer_histogram_counts"]


def integer_histogram_counts(graph: fx.Graph) -> int:
    """Give every ``cumsum(histc(...), 0, dtype=<int>)`` an int32 copy of the counts to sum;
    returns how many it changed."""
    changed = 0
    for node in list(graph.nodes):
        if not calls(node, aten.cumsum.default) or len(node.args) < 2 or node.args[1] not in (0, -1):
            continue
        counts = node.args[0]
        want = node.kwargs.get("dtype")
        if not calls(counts, aten.histc.default) or want not in (torch.int32, torch.int64):
            continue
        if dtype(counts) not in (torch.float32, torch.float64):
            continue
        with graph.inserting_after(counts):
            cast = graph.call_function(torch.ops.prims.convert_element_type.default, (counts, torch.int32))
        fake = value(counts)
        if fake is not None:
            with fake.fake_mode:
                cast.meta["val"] = fake.to(torch.int32)
        node.replace_input_with(counts, cast)
        changed += 1
    return changed
