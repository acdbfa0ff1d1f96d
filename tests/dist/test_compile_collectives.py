"""The torch.compile front end's session-5 collective paths at world 2 and 4 (gloo), outputs and every
gradient against the unsharded float64 model:

* a Megatron MLP block whose backward all-reduce is left to NCCL and scheduled under the
  weight-gradient GEMMs (issue 26; a cost model under which this small block qualifies), and the
  same with every collective fused (``OPFUSE_OVERLAP_COLLECTIVES=fuse``);
* a block that ends with the all-reduce + residual add and no norm (a graph per block under FSDP2:
  the ``allreduce`` rule takes the add, issue 29.6);
* a sequence-parallel block whose backward reduce-scatter is left to NCCL under the weight-gradient
  GEMMs (session 15), and the same with ``OPFUSE_OVERLAP_COLLECTIVES=fuse``.

Every case runs in one spawn per world (tests/dist/shared_spawn.py; a case that fails there runs alone
in its test).
"""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from ..collectives_compat import all_gather, reduce_scatter
from ..megatron_tp import CopyToTP, ReduceFromTP

H, FFN, TOKENS = 16, 32, 6


class Block(nn.Module):
    """``[norm](x + row(gelu(column(x))) [+ bias])`` with the column/row shards of one rank
    (``shards`` ways); the optional bias is the row layer's, added once after the reduction."""

    def __init__(self, group, shards: int, norm: bool, bias: bool = False):
        super().__init__()
        self.group = group
        self.up = nn.Linear(H, FFN // shards, bias=False)
        self.down = nn.Linear(FFN // shards, H, bias=False)
        self.bias = nn.Parameter(torch.zeros(H)) if bias else None
        self.norm = nn.RMSNorm(H) if norm else None

    def forward(self, x):
        h = CopyToTP.apply(x, self.group) if self.group is not None else x
        y = self.down(F.gelu(self.up(h)))
        y = ReduceFromTP.apply(y, self.group) if self.group is not None else y
        if self.bias is not None:
            y = y + self.bias
        out = x + y
        return self.norm(out) if self.norm is not None else out


def _copy_shards(mine, full, rank: int, world: int) -> slice:
    """This rank's column/row shards of ``full``'s ``up``/``down`` (and its norm) into ``mine``;
    returns the ffn columns it holds."""
    cols = slice(rank * FFN // world, (rank + 1) * FFN // world)
    with torch.no_grad():
        mine.up.weight.copy_(full.up.weight[cols])
        mine.down.weight.copy_(full.down.weight[:, cols])
        if mine.norm is not None:
            mine.norm.weight.copy_(full.norm.weight)
    return cols


def _train_both(mine, full, xs, xd, setting):
    """``(compiled, output, float64 output)``: ``mine`` compiled by opfuse (eager graphs) under
    ``overlap_collectives=setting`` and ``full`` in float64, forward and backward of ``.sum()``."""
    import opfuse

    compiled = opfuse.optimize(mine, options={"inductor": False})
    with opfuse.config.override(overlap_collectives=setting):
        got = compiled(xs)
        got.sum().backward()
    want = full(xd)
    want.sum().backward()
    return compiled, got, want


def _case(rank, world, norm, setting):
    import opfuse
    from opfuse.torch_compile import overlap

    overlap.LATENCY_BYTES, overlap.FLOPS_PER_BYTE = 0, 1  # this small block's GEMMs "hide" its all-reduce
    torch.manual_seed(0)
    full = Block(None, 1, norm).double()
    with torch.no_grad():
        for p in full.parameters():
            p.add_(0.1 * torch.randn_like(p))
    mine = Block(dist.group.WORLD, world, norm)
    cols = _copy_shards(mine, full, rank, world)
    x = torch.randn(2, TOKENS, H, generator=torch.Generator().manual_seed(1))
    xs, xd = x.clone().requires_grad_(), x.double().requires_grad_()
    compiled, got, want = _train_both(mine, full, xs, xd, setting)
    tol = dict(atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got.double(), want, **tol)
    torch.testing.assert_close(xs.grad.double(), xd.grad, **tol)
    torch.testing.assert_close(mine.up.weight.grad.double(), full.up.weight.grad[cols], **tol)
    torch.testing.assert_close(mine.down.weight.grad.double(), full.down.weight.grad[:, cols], **tol)
    if norm:
        torch.testing.assert_close(mine.norm.weight.grad.double(), full.norm.weight.grad, **tol)
    (program,) = opfuse.programs(compiled)
    rules = {(f.rule, program.phases[f.fused_node]) for f in program.fusions}
    forward_rule = "allreduce_add_rmsnorm" if norm else "allreduce"
    assert (forward_rule, "forward") in rules, program.explain()
    assert (len(program.overlap_decisions) == 1) == (setting == "auto"), program.explain()
    assert (("allreduce", "backward") in rules) == (setting == "fuse"), program.explain()


WORLDS = [2, 4]
BLOCKS = [(True, "auto"), (True, "fuse"), (False, "auto")]
SP_SETTINGS = ["auto", "fuse"]


@pytest.mark.dist
@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("norm, setting", BLOCKS, ids=["norm-overlap", "norm-fuse-all", "add-only"])
def test_compiled_collectives_match_float64(world, norm, setting, shared_spawn):
    shared_spawn.run(_case, world, norm, setting, timeout=600)


class SequenceParallelBlock(nn.Module):
    """``x + reduce_scatter(row(gelu(column(all_gather(norm(x))))))`` over token shards (the
    unsharded model without a group)."""

    def __init__(self, group, shards: int):
        super().__init__()
        self.group = group
        self.norm = nn.RMSNorm(H)
        self.up = nn.Linear(H, FFN // shards, bias=False)
        self.down = nn.Linear(FFN // shards, H, bias=False)

    def forward(self, x):
        h = self.norm(x)
        h = all_gather(h, 0, self.group) if self.group is not None else h
        y = self.down(F.gelu(self.up(h)))
        return x + (reduce_scatter(y, "sum", 0, self.group) if self.group is not None else y)


def _sequence_parallel_case(rank, world, setting):
    import opfuse
    from opfuse.torch_compile import overlap

    overlap.LATENCY_BYTES, overlap.FLOPS_PER_BYTE = 0, 1  # this small block's GEMMs "hide" its reduce-scatter
    torch.manual_seed(0)
    full = SequenceParallelBlock(None, 1).double()
    with torch.no_grad():
        for p in full.parameters():
            p.add_(0.1 * torch.randn_like(p))
    mine = SequenceParallelBlock(dist.group.WORLD, world)
    cols = _copy_shards(mine, full, rank, world)
    rows = slice(rank * 4, (rank + 1) * 4)
    x = torch.randn(4 * world, H, generator=torch.Generator().manual_seed(1))
    xs, xd = x[rows].clone().requires_grad_(), x.double().requires_grad_()
    compiled, got, want = _train_both(mine, full, xs, xd, setting)
    tol = dict(atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got.double(), want[rows], **tol)
    torch.testing.assert_close(xs.grad.double(), xd.grad[rows], **tol)
    torch.testing.assert_close(mine.up.weight.grad.double(), full.up.weight.grad[cols], **tol)
    torch.testing.assert_close(mine.down.weight.grad.double(), full.down.weight.grad[:, cols], **tol)
    norm_grad = mine.norm.weight.grad.clone()  # this rank's tokens' share
    dist.all_reduce(norm_grad)
    torch.testing.assert_close(norm_grad.double(), full.norm.weight.grad, **tol)
    (program,) = opfuse.programs(compiled)
    decisions = [text for _, text in program.overlap_decisions]
    if setting == "auto":
        assert len(decisions) == 1 and "reduce-scatter" in decisions[0], program.explain()
    else:
        assert not decisions, program.explain()


@pytest.mark.dist
@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("setting", SP_SETTINGS)
def test_sequence_parallel_reduce_scatter_left_to_nccl_matches_float64(world, setting, shared_spawn):
    shared_spawn.run(_sequence_parallel_case, world, setting, timeout=600)


#: Every test's case, run in one spawn per world (tests/dist/shared_spawn.py); a case that does not
#: finish there runs alone in its test.
SHARED_CASES = ([(_case, world, (norm, setting)) for world in WORLDS for norm, setting in BLOCKS]
                + [(_sequence_parallel_case, world, (setting,)) for world in WORLDS for setting in SP_SETTINGS])
