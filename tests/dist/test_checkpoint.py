"""``opfuse.unsharded_state_dict`` / ``load_unsharded_state_dict`` on spawned gloo processes: a
sharded block loaded from full weights gives those exact weights back, and its outputs equal the
same block built unsharded from the gathered state dict (so the layout, GatedLinear's gate and up
shards included, is the unsharded model's)."""

import pytest
import torch
import torch.distributed as dist

import opfuse
from opfuse import ops

DT = torch.float64
H, F = 8, 12  # hidden, ffn (F divisible by 2 and 4)


def mlp(parallel: bool, act: str, sp: bool = False):
    """RMSNorm -> fc1 (column) -> GELU | GatedLinear (column, SwiGLU) -> fc2 (row) -> + residual -> RMSNorm."""
    col, row = ("column", "row") if parallel else (None, None)
    if act == "swiglu":
        first = [ops.GatedLinear(H, F, bias=True, parallel=col, sequence_parallel=sp, dtype=DT), ops.Identity()]
    else:
        first = [ops.Linear(H, F, parallel=col, sequence_parallel=sp, dtype=DT), ops.GELU()]
    return ops.Sequential(
        ops.RMSNorm(H, dtype=DT), *first,
        ops.Linear(F, H, parallel=row, sequence_parallel=sp, dtype=DT),
        ops.AddExtraInput(), ops.MakeExtraOutput(), ops.RMSNorm(H, dtype=DT))


def full_state(block) -> dict:
    """Distinct random values for every entry of an unsharded block's state dict (same on every rank)."""
    g = torch.Generator().manual_seed(4321)
    return {k: torch.randn(v.shape, generator=g, dtype=DT) for k, v in block.state_dict().items()}


def exact(name, got, want):
    assert set(got) == set(want), f"{name}: keys {sorted(got)} != {sorted(want)}"
    for key in want:
        assert torch.equal(got[key], want[key]), f"{name}: {key} differs after the round trip"


def mlp_round_trip(rank, world):
    for act in ("gelu", "swiglu"):
        plain = mlp(False, act)
        full = full_state(plain)
        plain.load_state_dict(full)
        sharded = mlp(True, act)
        opfuse.load_unsharded_state_dict(sharded, full)
        # The shards are what load_unsharded takes.
        f1 = F // world
        if act == "gelu":
            assert torch.equal(sharded[1].weight, full["1.weight"][rank * f1:(rank + 1) * f1])
        else:
            for name in ("gate_weight", "up_weight", "gate_bias", "up_bias"):
                assert torch.equal(getattr(sharded[1], name), full[f"1.{name}"][rank * f1:(rank + 1) * f1])
        assert torch.equal(sharded[3].weight, full["3.weight"][:, rank * f1:(rank + 1) * f1])
        exact(f"rank {rank} {act}", opfuse.unsharded_state_dict(sharded), full)
        g = torch.Generator().manual_seed(7)
        x, res = torch.randn(5, H, generator=g, dtype=DT), torch.randn(5, H, generator=g, dtype=DT)
        for got, want in zip(sharded(x, res), plain(x, res)):
            torch.testing.assert_close(got, want, atol=1e-12, rtol=1e-12)


def grouped_round_trip(rank, world, parallel, group=None, fsdp_group=None):
    experts, k, n = 4, 6, 10
    g = torch.Generator().manual_seed(11)
    full = {"0.weight": torch.randn(experts, n, k, generator=g, dtype=DT),
            "0.bias": torch.randn(experts, n, generator=g, dtype=DT)}
    layer = ops.GroupedLinear(experts, k, n, bias=True, parallel=parallel, group=group, fsdp_group=fsdp_group,
                              dtype=DT)
    block = ops.Sequential(layer)
    layer.load_unsharded(full["0.weight"], full["0.bias"])
    exact(f"rank {rank} {parallel}", opfuse.unsharded_state_dict(block), full)
    # And back through load_unsharded_state_dict: the same shards as load_unsharded.
    again = ops.Sequential(ops.GroupedLinear(experts, k, n, bias=True, parallel=parallel, group=group,
                                             fsdp_group=fsdp_group, dtype=DT))
    opfuse.load_unsharded_state_dict(again, full)
    assert torch.equal(again[0].weight, layer.weight) and torch.equal(again[0].bias, layer.bias)


def world2(rank, world):
    mlp_round_trip(rank, world)
    grouped_round_trip(rank, world, "expert")
    grouped_round_trip(rank, world, "fsdp")


def world4(rank, world):
    mlp_round_trip(rank, world)
    grouped_round_trip(rank, world, "fsdp")
    # EP over {0,1} and {2,3}; FSDP over {0,2} and {1,3}: every rank calls new_group for all.
    ep = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    fs = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    grouped_round_trip(rank, world, "expert+fsdp", group=ep[rank // 2], fsdp_group=fs[rank % 2])


@pytest.mark.dist
def test_unsharded_state_dict_round_trip_world2(session_spawn):
    session_spawn.run(world2, 2)


@pytest.mark.dist
def test_unsharded_state_dict_round_trip_world4(session_spawn):
    session_spawn.run(world4, 4)


#: Run with other modules' Sequential cases in one spawn per world for the session
#: (tests/dist/shared_spawn.py); a case that does not finish there runs alone in its test.
SESSION_CASES = [(world2, 2, ()), (world4, 4, ())]
