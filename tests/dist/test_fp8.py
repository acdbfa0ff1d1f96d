"""FP8 under tensor, sequence, expert and FSDP parallelism on spawned gloo processes (world 2 and 4),
both recipes: each parallel linear layout against a float64 reference of the documented
quantization computed from the unsharded data (the all-gather of FP8 bytes must give one scale for
the gathered tensor; the reduce-scatter sums partials of the local FP8 GEMMs), the MLP block fused
against its unfused FP8 program, and GroupedLinear (expert, FSDP, expert x FSDP) against a
quantization of the full weight (the FSDP gather of FP8 shards must reproduce it exactly)."""

import pytest
import torch
import torch.distributed as dist

import opfuse
from opfuse import fp8, ops

from ..fp8_reference import grouped_reference, linear_reference

DT = torch.float32
RECIPES = (fp8.TensorScaling(), fp8.RowwiseScaling())
TOL = dict(atol=2e-4, rtol=2e-4)


def close(name, got, want):
    try:
        torch.testing.assert_close(got.double(), want.double(), **TOL)
    except AssertionError as error:
        raise AssertionError(f"{name}: {error}") from None


def data(seed, *shape):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=DT)


def linear_layouts(rank, world, recipe):
    hidden, out, tokens = 16 * world, 32 * world, 4 * world
    w, b = data(1, out, hidden) / hidden ** 0.5, data(2, out)
    x = data(3, tokens, hidden)
    for parallel, sp in (("column", True), ("row", True), ("column", False), ("row", False)):
        lin = ops.Linear(hidden, out, parallel=parallel, sequence_parallel=sp, dtype=DT)
        lin.load_unsharded(w, b)
        block = ops.Sequential(lin)
        rows, cols = slice(rank * tokens // world, (rank + 1) * tokens // world), \
            slice(rank * hidden // world, (rank + 1) * hidden // world)
        shard = lambda t, r: t[r * out // world:(r + 1) * out // world]  # noqa: E731 - column shard of W / b
        kshard = lambda t, r: t[:, r * hidden // world:(r + 1) * hidden // world]  # noqa: E731
        if parallel == "column":
            dys = [data(10 + r, tokens, out // world) for r in range(world)]
            x_in = x[rows] if sp else x
            refs = [linear_reference(x, shard(w, r), shard(b, r), dys[r], recipe) for r in range(world)]
            want_y = refs[rank][0]
            dx_full = sum(ref[1] for ref in refs)
            want_dx = dx_full[rows] if sp else dx_full
            want_dw, want_db = refs[rank][2], refs[rank][3]
        else:
            dy_full = data(20, tokens, out)
            x_in = x[:, cols]
            refs = [linear_reference(kshard(x, r), kshard(w, r), None, dy_full, recipe) for r in range(world)]
            y_full = sum(ref[0] for ref in refs) + b.double()
            want_y = y_full[rows] if sp else y_full
            want_dx, want_dw = refs[rank][1], refs[rank][2]
            want_db = dy_full.double().sum(0)
            dys = {rank: dy_full[rows] if sp else dy_full}
        x_in = x_in.clone().requires_grad_()
        with fp8.autocast(recipe=recipe):
            y = block(x_in)
            program = opfuse.compile(block, x_in)
        y.backward(dys[rank])
        tag = f"rank {rank} {recipe.describe()} {parallel}{'+sp' if sp else ''}"
        rules = [f.rule for f in program.fusions]
        if sp:
            want_rule = "all_gather_linear_fp8" if parallel == "column" else "linear_reduce_scatter_fp8"
            assert want_rule in rules, (tag, rules)
        close(f"{tag} y", y, want_y)
        close(f"{tag} dx", x_in.grad, want_dx)
        close(f"{tag} dW", lin.weight.grad, want_dw)
        db = lin.bias.grad.clone()
        if parallel == "row" and sp:
            dist.all_reduce(db)  # a token-sharded bias: per-rank partial gradients
        close(f"{tag} db", db, want_db)


def block_fused_vs_unfused(rank, world, recipe):
    hidden, ffn, tokens = 8 * world, 32 * world, 6 * world
    for sp in (True, False):
        block = ops.Sequential(ops.RMSNorm(hidden, dtype=DT),
                               ops.Linear(hidden, ffn, parallel="column", sequence_parallel=sp, dtype=DT),
                               ops.GELU("tanh"),
                               ops.Linear(ffn, hidden, parallel="row", sequence_parallel=sp, dtype=DT),
                               ops.AddExtraInput(), ops.MakeExtraOutput(), ops.RMSNorm(hidden, dtype=DT))
        with torch.no_grad():
            for i, p in enumerate(block.parameters()):
                p.copy_(data(100 + i, *p.shape) * (p.shape[-1] ** -0.5 if p.dim() == 2 else 0.1) + (p.dim() == 1))
        local = tokens // world if sp else tokens
        x, r = data(200 + rank, local, hidden), data(300 + rank, local, hidden)
        if not sp:
            x, r = data(200, local, hidden), data(300, local, hidden)
        results = []
        for fuse in (True, False):
            xg = x.clone().requires_grad_()
            block.zero_grad(set_to_none=True)
            with opfuse.config.override(fuse=fuse), fp8.autocast(recipe=recipe):
                y, h = block(xg, r)
                program = opfuse.compile(block, xg, r)
            (y.sum() + (h * h).sum()).backward()
            results.append([y, h, xg.grad] + [p.grad for p in block.parameters()])
            if fuse:
                rules = [f.rule for f in program.fusions]
                want = ["add_rmsnorm_quantize", "all_gather_linear_fp8", "linear_reduce_scatter_fp8"] if sp else \
                    ["add_rmsnorm_quantize", "fp8_linear", "allreduce_add_rmsnorm"]
                assert all(w in rules for w in want), rules
        for i, (got, want) in enumerate(zip(*results)):
            close(f"rank {rank} {recipe.describe()} sp={sp} block output {i}", got, want)


def grouped(rank, world, recipe, ep_group=None, fsdp_group=None):
    groups, k, n = 4, 32, 16
    w, b = data(400, groups, n, k) / k ** 0.5, data(401, groups, n)
    if ep_group is None and fsdp_group is None:
        parallel, experts = "fsdp", list(range(groups))
    else:
        ep_world, ep_rank = dist.get_world_size(ep_group), dist.get_rank(ep_group)
        local = groups // ep_world
        experts = list(range(ep_rank * local, (ep_rank + 1) * local))
        parallel = "expert+fsdp" if fsdp_group is not None else "expert"
    fsdp = fsdp_group if parallel == "expert+fsdp" else (dist.group.WORLD if parallel == "fsdp" else None)

    def rank_data(seed):
        g = torch.Generator().manual_seed(500 + seed)
        sizes = [int(c) for c in torch.randint(0, 6, (len(experts),), generator=g)]
        sizes[seed % len(experts)] = 0
        tokens = sum(sizes) + 3
        return data(600 + seed, tokens, k), torch.tensor(sizes), data(700 + seed, tokens, n)

    layer = ops.GroupedLinear(groups, k, n, bias=True, parallel=parallel, group=ep_group if ep_group else None,
                              fsdp_group=fsdp_group, dtype=DT)
    layer.load_unsharded(w, b)
    x, sizes, dy = rank_data(dist.get_rank())
    xg = x.clone().requires_grad_()
    with fp8.autocast(recipe=recipe):
        y = ops.Sequential(layer)(xg, sizes)
    y.backward(dy)
    ry, rdx, rdw, rdb = grouped_reference(x, sizes, w[experts], b[experts], dy, recipe)
    tag = f"rank {rank} {recipe.describe()} {parallel}"
    close(f"{tag} y", y, ry)
    close(f"{tag} dx", xg.grad, rdx)
    want_w, want_b = rdw, rdb
    if fsdp is not None:
        for peer in dist.get_process_group_ranks(fsdp):
            if peer != dist.get_rank():
                px, psizes, pdy = rank_data(peer)
                _, _, pdw, pdb = grouped_reference(px, psizes, w[experts], b[experts], pdy, recipe)
                want_w, want_b = want_w + pdw, want_b + pdb
        part_rows = layer.weight.shape[0]
        me = dist.get_rank(fsdp)
        want_w = want_w.reshape(-1, k)[me * part_rows:(me + 1) * part_rows]
        want_b = want_b.reshape(-1)[me * part_rows:(me + 1) * part_rows]
    close(f"{tag} dW", layer.weight.grad, want_w)
    close(f"{tag} db", layer.bias.grad, want_b)


def all_cases(rank, world):
    for recipe in RECIPES:
        linear_layouts(rank, world, recipe)
        block_fused_vs_unfused(rank, world, recipe)
        if world == 2:
            grouped(rank, world, recipe)                              # fsdp over both ranks
            grouped(rank, world, recipe, ep_group=dist.group.WORLD)   # expert parallel
        else:
            ep = [dist.new_group([0, 1]), dist.new_group([2, 3])]
            fs = [dist.new_group([0, 2]), dist.new_group([1, 3])]
            grouped(rank, world, recipe, ep_group=ep[rank // 2], fsdp_group=fs[rank % 2])
    # power-of-two expert scales, from the experts' amax all-reduced over the FSDP group
    pow2 = fp8.TensorScaling(pow2_weight_scales=True)
    if world == 2:
        grouped(rank, world, pow2)
    else:
        grouped(rank, world, pow2, ep_group=ep[rank // 2], fsdp_group=fs[rank % 2])


@pytest.mark.dist
@pytest.mark.parametrize("world", [2, 4])
def test_fp8_parallel_layouts(world, session_spawn):
    session_spawn.run(all_cases, world)


#: Run with other modules' Sequential cases in one spawn per world for the session
#: (tests/dist/shared_spawn.py); a case that does not finish there runs alone in its test.
SESSION_CASES = [(all_cases, 2, ()), (all_cases, 4, ())]
