"""The row-parallel GEMM split along the tokens with each chunk's all-reduce left to NCCL
(``OPFUSE_ALLREDUCE_CHUNKS``, opfuse/torch_compile/chunked_all_reduce.py) at world 2 and 4 (gloo):
outputs and every gradient against the unsharded float64 model, chunk counts that divide the tokens
and ones that do not, with and without a bias on the row-parallel layer, eager graphs and Inductor's;
``explain()`` lists the split, and the add + norm after it still fuses. ``auto`` leaves a GEMM of fewer than 2 x 2048 tokens whole and splits one of 4098 in two.

Every case runs in one spawn per world (tests/dist/shared_spawn.py; a case that fails there runs alone
in its test)."""

import pytest
import torch
import torch.distributed as dist

from .test_compile_collectives import FFN, H, Block


def _case(rank, world, chunks, tokens, bias, inductor, expected):
    import opfuse

    torch.manual_seed(0)
    full = Block(None, 1, True, bias).double()
    with torch.no_grad():
        for p in full.parameters():
            p.add_(0.1 * torch.randn_like(p))
    mine = Block(dist.group.WORLD, world, True, bias)
    cols = slice(rank * FFN // world, (rank + 1) * FFN // world)
    with torch.no_grad():
        mine.up.weight.copy_(full.up.weight[cols])
        mine.down.weight.copy_(full.down.weight[:, cols])
        mine.norm.weight.copy_(full.norm.weight)
        if bias:
            mine.bias.copy_(full.bias)
    x = torch.randn(2, tokens // 2, H, generator=torch.Generator().manual_seed(1))
    xs, xd = x.clone().requires_grad_(), x.double().requires_grad_()
    compiled = opfuse.optimize(mine, options={"inductor": inductor})
    with opfuse.config.override(allreduce_chunks=chunks):
        got = compiled(xs)
        (got * torch.arange(got.numel()).view(got.shape).sin()).sum().backward()
    want = full(xd)
    (want * torch.arange(want.numel()).view(want.shape).sin()).sum().backward()
    scale = max(1.0, (tokens / 12) ** 0.5)  # float32 sums over the tokens (weight gradients) grow like sqrt(n)
    tol = dict(atol=1e-5 * scale, rtol=1e-5 * scale)
    torch.testing.assert_close(got.double(), want, **tol)
    torch.testing.assert_close(xs.grad.double(), xd.grad, **tol)
    torch.testing.assert_close(mine.up.weight.grad.double(), full.up.weight.grad[cols], **tol)
    torch.testing.assert_close(mine.down.weight.grad.double(), full.down.weight.grad[:, cols], **tol)
    torch.testing.assert_close(mine.norm.weight.grad.double(), full.norm.weight.grad, **tol)
    if bias:
        torch.testing.assert_close(mine.bias.grad.double(), full.bias.grad, **tol)
    (program,) = opfuse.programs(compiled)
    text = program.explain()
    split = expected >= 2
    assert (f"split into {expected} chunks" in text) == split and ("split into" in text) == split, text
    rules = {(f.rule, program.phases[f.fused_node]) for f in program.fusions}
    assert ("add_rmsnorm" if split else "allreduce_add_rmsnorm", "forward") in rules, text


WORLDS = [2, 4]
SPLITS = [(2, 12, False, 2), (5, 12, True, 5), (1, 12, False, 1), (0, 12, False, 1), (0, 4098, True, 2)]
INDUCTOR = (3, 12, True, True, 3)  # chunks, tokens, bias, inductor, expected (world 2)


@pytest.mark.dist
@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("chunks, tokens, bias, expected", SPLITS,
                         ids=["2-even", "5-uneven-bias", "off", "auto-small", "auto-4098"])
def test_chunked_all_reduce_matches_float64(world, chunks, tokens, bias, expected, shared_spawn):
    shared_spawn.run(_case, world, chunks, tokens, bias, False, expected, timeout=600)


@pytest.mark.dist
def test_chunked_all_reduce_under_inductor_matches_float64(shared_spawn):
    shared_spawn.run(_case, 2, *INDUCTOR, timeout=900)


#: Every test's case, run in one spawn per world (tests/dist/shared_spawn.py); a case that does not
#: finish there runs alone in its test.
SHARED_CASES = ([(_case, world, (chunks, tokens, bias, False, expected))
                 for world in WORLDS for chunks, tokens, bias, expected in SPLITS]
                + [(_case, 2, INDUCTOR)])
