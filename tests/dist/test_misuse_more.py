"""Misuse that needs several ranks (issue 29, item 5), at world 2 (gloo): replicated inputs that
differ between ranks, a sequence-parallel block given the whole sequence on every rank, and a
row-parallel layer given a width it cannot take."""

import pytest
import torch

import opfuse
from opfuse import ops
from opfuse.sequential.replicated import ReplicatedMismatchError
from opfuse.ops.base import OpInputError


def replicated_inputs(rank, world):
    h = 4 * world
    peer = 1 - rank if world == 2 else None
    block = ops.Sequential(ops.Linear(h, h, parallel="column"), ops.Linear(h, h, parallel="row"), ops.AddExtraInput())
    same, zeros = torch.ones(3, h), torch.zeros(3, h)
    # The main input differs: every rank raises, naming the input and the other rank.
    with pytest.raises(ReplicatedMismatchError, match=rf"input x is replicated in this block \(every rank must pass "
                                                      rf"the same tensor\) but global ranks \[{peer}\] passed other "
                                                      rf"values than global rank {rank} \(.*sum {24 * (1 + rank)}"):
        block(same * (1 + rank), zeros)
    # A residual added after the all-reduce differs.
    with pytest.raises(ReplicatedMismatchError, match=r"input extra0_add_extra_input2 is replicated"):
        block(same, zeros + rank)
    torch.testing.assert_close(block(same, zeros).sum(), block(same, zeros).sum())  # equal inputs: no error
    # Off: accepted (each rank computes with its own values).
    with opfuse.config.override(check_replicated="off"):
        block(same * (1 + rank), zeros)
    # Per-rank data where it is per rank by design: each rank's partial sum into an all-reduce (the
    # residual added after it is replicated again), an expert-parallel grouped layer's tokens.
    tail = ops.Sequential(ops.AllReduce(), ops.AddExtraInput(), ops.RMSNorm(h))
    tail(same * rank, zeros)
    with pytest.raises(ReplicatedMismatchError, match=r"input extra0_add_extra_input1 is replicated"):
        ops.Sequential(ops.AllReduce(), ops.AddExtraInput(), ops.RMSNorm(h))(same, zeros + rank)
    experts = ops.Sequential(ops.GroupedLinear(world, h, h, parallel="expert"))
    experts(torch.randn(2 + rank, h), torch.tensor([1 + rank]))
    # The whole sequence on every rank of a sequence-parallel block: a warning when it compiles.
    sp = ops.Sequential(ops.RMSNorm(h), ops.Linear(h, h, parallel="column", sequence_parallel=True))
    whole = torch.arange(2 * world * h, dtype=torch.float32).view(2 * world, h)
    with pytest.warns(UserWarning, match=rf"input x is token-sharded .* but every rank passed the same {2 * world} "
                                         rf"tokens .*each rank passes 2 tokens .*OPFUSE_CHECK_REPLICATED=always makes "
                                         r"this an error"):
        sp(whole)
    with opfuse.config.override(check_replicated="always"):
        block(same, zeros)  # compiles (equal inputs), then every call is checked
        with pytest.raises(ReplicatedMismatchError, match=r"\), a call: input x is replicated"):
            block(same * (1 + rank), zeros)
        # The whole sequence on every rank of a sequence-parallel block: the same tokens everywhere.
        with pytest.raises(ReplicatedMismatchError, match=rf"input x is token-sharded \(sequence parallel: each rank "
                                                          rf"passes its own part of the sequence\) but every rank "
                                                          rf"passed the same {2 * world} tokens .*each rank passes 2 "
                                                          rf"tokens \(x.chunk\({world}\)\[rank\]\)"):
            sp(whole)
        full = torch.randn(2 * world, h, generator=torch.Generator().manual_seed(0))
        sp(full.chunk(world)[rank])  # each rank's part: accepted


def row_widths(rank, world):
    layer = ops.Linear(256, 64, parallel="row")
    with pytest.raises(OpInputError, match=rf"Sequential op 0: Linear\(in_features=256, .*parallel='row'.*\): "
                                           rf"input has "
                                           rf"100 features \(last dim of shape \[3, 100\]\); expected {256 // world} "
                                           rf"\(this rank's shard of in_features=256, e.g. a column-parallel layer's "
                                           rf"output\) or 256 \(a replicated value: the layer keeps its shard\)"):
        ops.Sequential(layer)(torch.randn(3, 100))
    for width in (256 // world, 256):
        x = torch.randn(3, width, generator=torch.Generator().manual_seed(1))  # equal on every rank
        assert ops.Sequential(layer)(x).shape == (3, 64)


@pytest.mark.dist
def test_replicated_inputs_that_differ_between_ranks_are_named(shared_spawn):
    shared_spawn.run(replicated_inputs, 2)


@pytest.mark.dist
def test_a_row_layer_given_a_width_it_cannot_take_names_both_widths_it_accepts(shared_spawn):
    shared_spawn.run(row_widths, 2)


#: Both tests' cases in one spawn (tests/dist/shared_spawn.py); a case that does not finish there
#: runs alone in its test.
SHARED_CASES = [(replicated_inputs, 2, ()), (row_widths, 2, ())]
