"""The torch.compile front end's session-5 collective paths at world 2 and 4 (gloo), outputs and every
gradient against the unsharded float64 model:

* a Megatron MLP block whose backward all-reduce is left to NCCL and scheduled under the
  weight-gradient GEMMs (issue 26; a cost model under which this small block qualifies), and the
  same with every collective fused (``OPFUSE_OVERLAP_COLLECTIVES=fuse``);
* a block that ends with the all-reduce + residual add and no norm (a graph per block under FSDP2:
  the ``allreduce`` rule takes the add, issue 29.6).
"""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from .harness import run
from ..megatron_tp import CopyToTP, ReduceFromTP

H, FFN, TOKENS = 16, 32, 6


class Block(nn.Module):
    """``[norm](x + row(gelu(column(x))))`` with the column/row shards of one rank (``shards`` ways)."""

    def __init__(self, group, shards: int, norm: bool):
        super().__init__()
        self.group = group
        self.up = nn.Linear(H, FFN // shards, bias=False)
        self.down = nn.Linear(FFN // shards, H, bias=False)
        self.norm = nn.RMSNorm(H) if norm else None

    def forward(self, x):
        h = CopyToTP.apply(x, self.group) if self.group is not None else x
        y = self.down(F.gelu(self.up(h)))
        y = ReduceFromTP.apply(y, self.group) if self.group is not None else y
        out = x + y
        return self.norm(out) if self.norm is not None else out


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
    cols = slice(rank * FFN // world, (rank + 1) * FFN // world)
    with torch.no_grad():
        mine.up.weight.copy_(full.up.weight[cols])
        mine.down.weight.copy_(full.down.weight[:, cols])
        if norm:
            mine.norm.weight.copy_(full.norm.weight)
    x = torch.randn(2, TOKENS, H, generator=torch.Generator().manual_seed(1))
    xs, xd = x.clone().requires_grad_(), x.double().requires_grad_()
    compiled = opfuse.optimize(mine, options={"inductor": False})
    with opfuse.config.override(overlap_collectives=setting):
        got = compiled(xs)
        got.sum().backward()
    want = full(xd)
    want.sum().backward()
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


@pytest.mark.dist
@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("norm, setting", [(True, "auto"), (True, "fuse"), (False, "auto")],
                         ids=["norm-overlap", "norm-fuse-all", "add-only"])
def test_compiled_collectives_match_float64(world, norm, setting):
    run(_case, world, norm, setting, timeout=600)
