"""GroupedLinear partition rules on spawned gloo processes: expert parallel (world 2), FSDP
(world 2) and expert parallel x FSDP over two different groups (world 4), forward and backward,
against a single-process float64 loop of matmuls over the full weights. Every rank can rebuild
every other rank's data from its seed, so each checks the summed FSDP gradients itself."""

import pytest
import torch
import torch.distributed as dist

from opfuse import ops

DT = torch.float64
GROUPS, K, N = 4, 6, 5


def full_params():
    g = torch.Generator().manual_seed(99)
    return torch.randn(GROUPS, N, K, generator=g, dtype=DT), torch.randn(GROUPS, N, generator=g, dtype=DT)


def rank_data(seed, experts):
    """Tokens of one rank for its ``experts`` (global ids): sizes with an empty group and a tail."""
    g = torch.Generator().manual_seed(1000 + seed)
    sizes = [int(c) for c in torch.randint(0, 5, (len(experts),), generator=g)]
    sizes[seed % len(experts)] = 0
    tokens = sum(sizes) + 2
    return (torch.randn(tokens, K, generator=g, dtype=DT), torch.tensor(sizes),
            torch.randn(tokens, N, generator=g, dtype=DT))


def reference(x, sizes, experts, dy):
    """float64 loop over the full weights: y, dx, dW [GROUPS, N, K] and db [GROUPS, N] (zero
    outside ``experts``)."""
    w, b = full_params()
    w, b, x = w.clone().requires_grad_(), b.clone().requires_grad_(), x.clone().requires_grad_()
    y = x.new_zeros(x.shape[0], N)
    start = 0
    for local, count in enumerate(sizes.tolist()):
        e = experts[local]
        y[start:start + count] = x[start:start + count] @ w[e].t() + b[e]
        start += count
    (y * dy).sum().backward()
    return y.detach(), x.grad, w.grad, b.grad


def close(name, got, want):
    try:
        torch.testing.assert_close(got, want, atol=1e-11, rtol=1e-10)
    except AssertionError as error:
        raise AssertionError(f"{name}: {error}") from None


def run_layer(layer, x, sizes, dy, compiled):
    x = x.clone().requires_grad_()
    layer.zero_grad(set_to_none=True)
    block = ops.Sequential(layer)
    y = block(x, sizes) if compiled else layer(x, sizes)
    y.backward(dy)
    return y.detach(), x.grad, layer.weight.grad, layer.bias.grad, block


def expert_parallel(rank, world, ep_group=None, fsdp_group=None):
    """Checks one rank of an expert-parallel (optionally also FSDP-sharded) layer."""
    ep_world, ep_rank = dist.get_world_size(ep_group), dist.get_rank(ep_group)
    local = GROUPS // ep_world
    experts = list(range(ep_rank * local, (ep_rank + 1) * local))
    parallel = "expert+fsdp" if fsdp_group is not None else "expert"
    w, b = full_params()
    for compiled in (False, True):
        layer = ops.GroupedLinear(GROUPS, K, N, bias=True, parallel=parallel, group=ep_group,
                                  fsdp_group=fsdp_group, dtype=DT)
        layer.load_unsharded(w, b)
        x, sizes, dy = rank_data(dist.get_rank(), experts)
        y, dx, dw, db, block = run_layer(layer, x, sizes, dy, compiled)
        ry, rdx, rdw, rdb = reference(x, sizes, experts, dy)
        tag = f"rank {rank} {parallel} compiled={compiled}"
        close(f"{tag} y", y, ry)
        close(f"{tag} dx", dx, rdx)
        want_w, want_b = rdw[experts], rdb[experts]
        if fsdp_group is not None:
            # Summed over the FSDP peers (same experts, their own tokens), this rank's rows kept.
            for peer in dist.get_process_group_ranks(fsdp_group):
                if peer != dist.get_rank():
                    px, psizes, pdy = rank_data(peer, experts)
                    _, _, pdw, pdb = reference(px, psizes, experts, pdy)
                    want_w, want_b = want_w + pdw[experts], want_b + pdb[experts]
            rows = layer.weight.shape[0]
            part = slice(dist.get_rank(fsdp_group) * rows, (dist.get_rank(fsdp_group) + 1) * rows)
            want_w, want_b = want_w.reshape(-1, K)[part], want_b.reshape(-1)[part]
        close(f"{tag} dW", dw, want_w)
        close(f"{tag} db", db, want_b)
        if compiled:
            program = block.program(x, sizes)
            assert [f.rule for f in program.fusions] == ["grouped_linear"], program.fusions
            out = [n for n in program.graph_module.graph.nodes if n.op == "call_module"][-1]
            assert out.meta["opfuse_sharding"].tokens, f"{tag}: EP output should be token-sharded"


def fsdp(rank, world):
    w, b = full_params()
    experts = list(range(GROUPS))
    for compiled in (False, True):
        layer = ops.GroupedLinear(GROUPS, K, N, bias=True, parallel="fsdp", dtype=DT)
        layer.load_unsharded(w, b)
        assert tuple(layer.weight.shape) == (GROUPS * N // world, K)
        x, sizes, dy = rank_data(rank, experts)
        y, dx, dw, db, _ = run_layer(layer, x, sizes, dy, compiled)
        ry, rdx, _, _ = reference(x, sizes, experts, dy)
        close(f"rank {rank} fsdp y", y, ry)
        close(f"rank {rank} fsdp dx", dx, rdx)
        total_w, total_b = 0, 0
        for peer in range(world):
            px, psizes, pdy = rank_data(peer, experts)
            _, _, pdw, pdb = reference(px, psizes, experts, pdy)
            total_w, total_b = total_w + pdw, total_b + pdb
        rows = GROUPS * N // world
        close(f"rank {rank} fsdp dW shard", dw, total_w.reshape(-1, K)[rank * rows:(rank + 1) * rows])
        close(f"rank {rank} fsdp db shard", db, total_b.reshape(-1)[rank * rows:(rank + 1) * rows])


def errors(rank, world):
    with pytest.raises(ValueError, match="num_groups=3 is not divisible by the expert-parallel world size 2"):
        ops.GroupedLinear(3, K, N, parallel="expert")
    with pytest.raises(ValueError, match="the 9 weight rows .* not divisible by the FSDP world size 2"):
        ops.GroupedLinear(3, K, 3, parallel="fsdp")
    with pytest.raises(ValueError, match="the same group"):
        ops.GroupedLinear(GROUPS, K, N, parallel="expert+fsdp", group=dist.group.WORLD, fsdp_group=dist.group.WORLD)
    layer = ops.GroupedLinear(GROUPS, K, N, parallel="expert")
    with pytest.raises(ops.OpInputError, match=r"group_sizes has shape \[4\], expected \[2\]"):
        layer(torch.randn(3, K), torch.tensor([1, 1, 1, 0]))   # global counts given to an EP layer


def world2(rank, world):
    expert_parallel(rank, world)
    fsdp(rank, world)
    errors(rank, world)


def world4(rank, world):
    # EP over {0,1} and {2,3}; FSDP over {0,2} and {1,3}: every rank calls new_group for all.
    ep = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    fs = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    expert_parallel(rank, world, ep_group=ep[rank // 2], fsdp_group=fs[rank % 2])


@pytest.mark.dist
def test_grouped_linear_world2(session_spawn):
    session_spawn.run(world2, 2)


@pytest.mark.dist
def test_grouped_linear_expert_x_fsdp_world4(session_spawn):
    session_spawn.run(world4, 4)


#: Run with other modules' Sequential cases in one spawn per world for the session
#: (tests/dist/shared_spawn.py); a case that does not finish there runs alone in its test.
SESSION_CASES = [(world2, 2, ()), (world4, 4, ())]
