"""Misuse at world 2 and 4 (gloo), one spawn per world:

* layout errors name the op that cannot take the layout (never a per-rank shape error about a
  later op);
* ranks that disagree on a program fail at compile time, on every rank, with an error naming what
  differs (never a gloo "collective mismatch" or a hang); a rank that does not compile at all is
  named after the timeout;
* group misuse (a group of the wrong type, a rank outside the group, a process group re-created
  with another size) raises errors that say so.
"""

import os
import time

import pytest
import torch
import torch.distributed as dist

import opfuse
from opfuse import ops
from opfuse.sequential.agree import RankMismatchError
from opfuse.ops.base import OpInputError, PartitionError
from opfuse.ops.group import GroupError

from .harness import run


def layout_errors(rank, world):
    h = 4 * world
    x = torch.randn(2, h)
    cases = [
        ("a norm on a feature-sharded value", [ops.Linear(h, h, parallel="column"), ops.RMSNorm(h)], (x,),
         r"Sequential op 1: RMSNorm\(.*its input is sharded on features"),
        ("two column layers in a row", [ops.Linear(h, h, parallel="column"), ops.Linear(h, h, parallel="column")],
         (x,), r"Sequential op 1: Linear\(.*parallel='column'.*sharded on features \(K\) but the weight is not"),
        ("column -> GroupedLinear", [ops.Linear(h, h, parallel="column"), ops.GroupedLinear(2, h, h)],
         (x, torch.tensor([1, 1])), r"Sequential op 1: GroupedLinear\(.*sharded on features"),
        ("column -> unsharded linear", [ops.Linear(h, h, parallel="column"), ops.Linear(h, h)], (x,),
         r"Sequential op 1: Linear\(in_features=.*sharded on features but the layer is not parallel"),
        ("column -> layernorm -> row", [ops.Linear(h, h, parallel="column"), ops.LayerNorm(h),
                                        ops.Linear(h, h, parallel="row")], (x,), r"Sequential op 1: LayerNorm"),
    ]
    for what, body, inputs, message in cases:
        with pytest.raises(PartitionError, match=message):
            ops.Sequential(*body)(*inputs)
    # An extra input laid out wrongly blames the extra input, and says which layout it needs.
    block = ops.Sequential(ops.Linear(h, h, parallel="row", sequence_parallel=True), ops.AddExtraInput())
    with pytest.raises(OpInputError, match=r"Sequential op 1: AddExtraInput: extra input has shape \[4, "
                                           r".*tokens-sharded over its process group.*pass this rank's part"):
        block(torch.randn(4, h // world), torch.randn(4, h))


def expect_mismatch(rank, block, inputs, *patterns):
    with pytest.raises(RankMismatchError) as caught:
        block(*inputs)
    text = str(caught.value)
    for pattern in patterns:
        assert pattern in text, f"rank {rank}: {pattern!r} not in:\n{text}"


def disagreements(rank, world):
    h = 4 * world
    odd = rank == world - 1  # the rank that differs
    # Different parallel modes.
    layer = ops.Linear(h, h, parallel="row" if odd else "column")
    x = torch.randn(3, h // world if odd else h)
    expect_mismatch(rank, ops.Sequential(layer), (x,), "compiled different programs", "first difference",
                    f"global ranks [{world - 1}]" if not odd else "differ from global rank")
    # A replicated input of another shape on one rank.
    block = ops.Sequential(ops.RMSNorm(h), ops.Linear(h, h, parallel="column"))
    expect_mismatch(rank, block, (torch.randn(5 if odd else 3, h),), "float32[5, ", "float32[3, ")
    # Another dtype.
    block = ops.Sequential(ops.Linear(h, h, parallel="column", dtype=torch.float64 if odd else torch.float32))
    expect_mismatch(rank, block, (torch.randn(3, h, dtype=torch.float64 if odd else torch.float32),), "float64")
    # Uneven sequence-parallel shards.
    block = ops.Sequential(ops.Linear(h, h, parallel="column", sequence_parallel=True))
    expect_mismatch(rank, block, (torch.randn(3 if odd else 2, h),), "x: placeholder -> float32[3, ", "tokens-sharded")
    # Different settings.
    block = ops.Sequential(ops.Linear(h, h, parallel="row"), ops.AddExtraInput(), ops.RMSNorm(h))
    with opfuse.config.override(fuse=not odd):
        expect_mismatch(rank, block, (torch.randn(2, h // world), torch.randn(2, h)), "settings")
    # A rank whose inputs the block refuses: the others learn why at once.
    block = ops.Sequential(ops.Linear(h, h, parallel="column"), ops.GELU())
    start = time.perf_counter()
    if odd:
        with pytest.raises(opfuse.ops.OpInputError):
            block(torch.randn(2, h + 1))
    else:
        expect_mismatch(rank, block, (torch.randn(2, h),), f"compiling failed on global rank {world - 1}: OpInputError")
    assert time.perf_counter() - start < 30
    # Agreeing ranks compile and run as usual (the expert-parallel case, where ranks hold
    # different numbers of rows, runs in test_grouped.py).
    block = ops.Sequential(ops.Linear(h, h, parallel="column"), ops.GELU(), ops.Linear(h, h, parallel="row"))
    block(torch.randn(2, h, generator=torch.Generator().manual_seed(0)))  # replicated: the same on every rank
    # One rank compiles a program the others never compile. On a group of its own: that group's
    # compile count is out of step afterwards.
    sub = dist.new_group(list(range(world)))
    block = ops.Sequential(ops.Linear(h, h, parallel="column", group=sub))
    with opfuse.config.override(peer_timeout_ms=1500):
        if rank == 0:
            start = time.perf_counter()
            expect_mismatch(rank, block, (torch.randn(7, h),), "did not compile this program within 1500 ms",
                            f"global rank(s) {list(range(1, world))}")
            assert time.perf_counter() - start < 20


def group_errors(rank, world, store_path):
    with pytest.raises(TypeError, match=r"Linear: group='0' is a str; expected a torch.distributed.ProcessGroup"):
        ops.Linear(8, 8, parallel="column", group="0")
    with pytest.raises(TypeError, match=r"AllReduce: group=0 is a int"):
        ops.AllReduce(0)
    first = dist.new_group([0])
    if rank != 0:
        with pytest.raises(GroupError, match=rf"global rank {rank}\) is not a member"):
            ops.Linear(8, 8, parallel="column", group=first)
    else:
        ops.Linear(8, 8, parallel="column", group=first)
    h = 4 * world
    block = ops.Sequential(ops.Linear(h, h, parallel="column"), ops.Linear(h, h, parallel="row"))
    x = torch.randn(3, h, generator=torch.Generator().manual_seed(0))  # replicated: the same on every rank
    block(x)
    # The default group is re-created with half the ranks: the block's layers no longer fit.
    dist.barrier()
    dist.destroy_process_group()
    if rank >= world // 2:
        return
    dist.init_process_group("gloo", store=dist.FileStore(store_path, world // 2), rank=rank, world_size=world // 2)
    with pytest.raises(GroupError, match=rf"built as rank {rank} of {world} of its process group, which now has this "
                                         rf"process as rank {rank} of {world // 2}"):
        block(x)


def misuse(rank, world, store_path):
    torch.set_num_threads(1)
    layout_errors(rank, world)
    disagreements(rank, world)
    group_errors(rank, world, store_path)  # last: it re-creates the default group


@pytest.mark.dist
@pytest.mark.parametrize("world", [2, 4])
def test_misuse_is_named(world, tmp_path):
    run(misuse, world, os.fspath(tmp_path / "store"))
