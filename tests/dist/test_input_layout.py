"""A block's input layout follows the widths of the ops before its first parallel layer (issue 29,
item 4), at world 2 and 4 (gloo), outputs and every gradient against the unsharded float64 math.

``Linear(4, 2) -> Linear(2, 6, parallel="row")`` or ``SwiGLU -> Linear(2, 6, parallel="row")``
given a full-width replicated input used to be taken as a feature shard (the row layer's
``in_features`` compared with the *block's* input width) and failed blaming op 0 (for SwiGLU, a
column-parallel layer that does not exist). A row layer given a width it cannot take names both
widths it accepts.
"""

import pytest
import torch

from opfuse import ops
from opfuse.ops.base import OpInputError, PartitionError

from ..sequential_blocks import Case, Op, run_case


def cases(world):
    w = world

    def linear(i, o, layout, parallel=None, sp=False, bias=True):
        out = {"column": "feat", "row": "tok" if sp else "rep"}.get(parallel, layout)
        return Op("linear", i, o, layout, out, parallel=parallel, sp=sp, bias=bias)

    return {
        # The blocks, scaled with the world size: a width-changing op, then a row layer.
        "unsharded linear narrows, then row": Case(1, w, "rep", (3,), 2 * w, [
            linear(2 * w, w, "rep"), linear(w, 3 * w, "rep", "row")]),
        "swiglu halves, then row": Case(2, w, "rep", (3,), 2 * w, [
            Op("swiglu", 2 * w, w, "rep", "rep"), linear(w, 3 * w, "rep", "row")]),
        "unsharded linear widens, gelu, row sp": Case(3, w, "rep", (2 * w, 2), 2 * w, [
            linear(2 * w, 4 * w, "rep"), Op("gelu", 4 * w, 4 * w, "rep", "rep"),
            linear(4 * w, 2 * w, "rep", "row", sp=True)]),
        "unsharded gated, then row": Case(4, w, "rep", (), 2 * w, [
            Op("gated", 2 * w, 2 * w, "rep", "rep", bias=True, act="gelu"), linear(2 * w, w, "rep", "row")]),
        # What kept working: a feature shard through width-keeping ops, a token shard into a
        # sequence-parallel MLP, a 1-D input into a column-parallel gated layer.
        "feature shard through gelu and a residual": Case(5, w, "feat", (3,), 4 * w, [
            Op("gelu", 4 * w, 4 * w, "feat", "feat"), Op("add", 4 * w, 4 * w, "feat", "feat"),
            linear(4 * w, 2 * w, "feat", "row")]),
        "token shard into a sequence-parallel mlp": Case(6, w, "tok", (2 * w,), 2 * w, [
            Op("rmsnorm", 2 * w, 2 * w, "tok", "tok"), linear(2 * w, 4 * w, "tok", "column", sp=True),
            Op("gelu", 4 * w, 4 * w, "feat", "feat"), linear(4 * w, 2 * w, "feat", "row", sp=True),
            Op("add", 2 * w, 2 * w, "tok", "tok")]),
        "1-d input, column gated, row": Case(7, w, "rep", (), 2 * w, [
            Op("gated", 2 * w, 2 * w, "rep", "feat", parallel="column", act="silu"),
            linear(2 * w, w, "feat", "row", bias=False)]),
    }


def layouts_follow_widths(rank, world):
    for name, case in cases(world).items():
        for fuse in (True, False):
            assert run_case(case, rank, world, fuse=fuse) == "ok", name
    # A replicated value narrower than a row layer's input: the row layer is named, with the width
    # a replicated value must have.
    block = ops.Sequential(ops.Linear(world, world), ops.Linear(2 * world, 3, parallel="row"))
    with pytest.raises(OpInputError, match=rf"Sequential op 1: Linear\(in_features={2 * world}, .*parallel='row'.*\): "
                                           rf"input is replicated with {world} features .*expected all {2 * world} "
                                           rf"\(a shard of {2} features is what a column-parallel layer outputs\)"):
        block(torch.randn(3, world))
    # SwiGLU on a column layer's output is still refused by SwiGLU, not by a layer before it.
    block = ops.Sequential(ops.Linear(4, 4 * world, parallel="column"), ops.SwiGLU())
    with pytest.raises(PartitionError, match=r"Sequential op 1: SwiGLU: its input is sharded on features"):
        block(torch.randn(3, 4))


@pytest.mark.dist
@pytest.mark.parametrize("world", [2, 4])
def test_the_block_input_layout_follows_the_widths_before_the_first_parallel_layer(world, session_spawn):
    session_spawn.run(layouts_follow_widths, world)


#: Run with other modules' Sequential cases in one spawn per world for the session
#: (tests/dist/shared_spawn.py); a case that does not finish there runs alone in its test.
SESSION_CASES = [(layouts_follow_widths, 2, ()), (layouts_follow_widths, 4, ())]
