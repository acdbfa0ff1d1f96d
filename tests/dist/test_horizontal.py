"""GatedLinear + the horizontal_gemm pass under tensor parallelism (gloo, world 2 and 4): fused and
unfused programs equal the unsharded float64 MLP, outputs and every gradient, for column and
sequence-parallel layouts with and without biases; the old SwiGLU layout is refused.

All cases for one world size run in one spawn (process start-up dominates on 2 CPU cores).
"""

import math

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import opfuse
from opfuse import ops

from .test_tensor_parallel import DT, check, cols, rows


def mlp_case(rank, world, sp, bias, fuse, seed):
    hidden, ffn, tokens = 4 * world, 6 * world, 2 * world
    g = torch.Generator().manual_seed(seed)  # the same full tensors on every rank
    rnd = lambda *s: torch.randn(*s, generator=g, dtype=DT)  # noqa: E731
    gate, up, down = rnd(ffn, hidden) / math.sqrt(hidden), rnd(ffn, hidden) / math.sqrt(hidden), rnd(hidden, ffn)
    gb, ub, norm = rnd(ffn) * 0.1, rnd(ffn) * 0.1, 1 + 0.1 * rnd(hidden)
    x, dy = rnd(tokens, hidden), rnd(tokens, hidden)

    block = ops.Sequential(
        ops.RMSNorm(hidden, dtype=DT),
        ops.GatedLinear(hidden, ffn, bias=bias, parallel="column", sequence_parallel=sp, dtype=DT),
        ops.Linear(ffn, hidden, bias=False, parallel="row", sequence_parallel=sp, dtype=DT))
    with torch.no_grad():
        block[0].weight.copy_(norm)
    block[1].load_unsharded(gate=gate, up=up, gate_bias=gb if bias else None, up_bias=ub if bias else None)
    block[2].load_unsharded(down)

    leaves = [t.clone().requires_grad_() for t in (x, norm, gate, up, gb, ub, down)]
    xr, nr, gr, ur, gbr, ubr, dr = leaves
    h = xr / torch.sqrt((xr * xr).mean(-1, keepdim=True) + 1e-6) * nr
    a, b = F.linear(h, gr), F.linear(h, ur)
    if bias:
        a, b = a + gbr, b + ubr
    y_ref = F.linear(F.silu(a) * b, dr)
    y_ref.backward(dy)

    shard = (lambda t: rows(t, rank, world)) if sp else (lambda t: t)
    xin = shard(x).clone().requires_grad_()
    tag = f"world={world} sp={sp} bias={bias} fuse={fuse}"
    with opfuse.config.override(fuse=fuse):
        y = block(xin)
        program = opfuse.compile(block, xin)
    y.backward(shard(dy))
    check(f"{tag} y", y, shard(y_ref.detach()))
    check(f"{tag} dx", xin.grad, shard(xr.grad))
    if sp:
        assert opfuse.sync_sequence_parallel_grads(block) == 1  # the norm weight
    check(f"{tag} dnorm", block[0].weight.grad, nr.grad)
    check(f"{tag} dgate", block[1].gate_weight.grad, rows(gr.grad, rank, world))
    check(f"{tag} dup", block[1].up_weight.grad, rows(ur.grad, rank, world))
    if bias:
        check(f"{tag} dgate_bias", block[1].gate_bias.grad, rows(gbr.grad, rank, world))
        check(f"{tag} dup_bias", block[1].up_bias.grad, rows(ubr.grad, rank, world))
    check(f"{tag} ddown", block[2].weight.grad, cols(dr.grad, rank, world))

    records = [f for f in program.fusions if f.rule == "horizontal_gemm"]
    if not fuse:
        assert records == []
        return
    record, gated = records
    expected = (["AllGather"] if sp else []) + (["BasicLinear", "Bias"] * 2 if bias else ["BasicLinear"] * 2)
    assert list(record.ops) == expected, record
    assert record.impl == "reference"  # CPU/gloo (p2p_overlap is for CUDA peers)
    assert gated.ops == ("GatedActivation",), gated  # on each rank's packed [gate_r | up_r]


def old_layout_is_refused(rank, world):
    block = ops.Sequential(ops.Linear(4, 2 * 2 * world, parallel="column", dtype=DT), ops.SwiGLU(),
                           ops.Linear(2 * world, 4, parallel="row", dtype=DT))
    try:
        block(torch.randn(3, 4, dtype=DT))
    except ops.PartitionError as error:
        assert "Use ops.GatedLinear" in str(error), error
    else:
        raise AssertionError("column Linear + SwiGLU compiled at world >= 2")


def all_cases(rank, world):
    torch.set_num_threads(1)
    seed = 100
    for sp in (False, True):
        for bias in (False, True):
            for fuse in (True, False):
                seed += 1
                mlp_case(rank, world, sp, bias, fuse, seed)
    old_layout_is_refused(rank, world)
    dist.barrier()


@pytest.mark.dist
@pytest.mark.parametrize("world", [2, 4])
def test_gated_mlp_horizontal_fusion(world, session_spawn):
    session_spawn.run(all_cases, world)


#: Run with other modules' Sequential cases in one spawn per world for the session
#: (tests/dist/shared_spawn.py); a case that does not finish there runs alone in its test.
SESSION_CASES = [(all_cases, 2, ()), (all_cases, 4, ())]
