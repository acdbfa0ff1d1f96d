"""Tensor-parallel ops and blocks on spawned gloo processes (world 2 and 4), against an unsharded
single-process float64 reference built from the same full weights.

All cases for one world size run in one spawn (process start-up dominates on 2 CPU cores).
"""

import math

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import opfuse
from opfuse import ops

DT = torch.float64
TOL = dict(atol=1e-10, rtol=1e-9)


def rows(t, rank, world):
    n = t.shape[0] // world
    return t[rank * n:(rank + 1) * n]


def cols(t, rank, world):
    n = t.shape[-1] // world
    return t[..., rank * n:(rank + 1) * n]


def ref_rms(x, w, eps=1e-6):
    return x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps) * w


class Full:
    """Unsharded parameters and inputs, identical on every rank (same seed)."""

    def __init__(self, hidden, ffn, tokens, gate=False):
        g = torch.Generator().manual_seed(4321)
        rnd = lambda *s: torch.randn(*s, generator=g, dtype=DT)  # noqa: E731
        out1 = 2 * ffn if gate else ffn
        self.w1, self.b1 = rnd(out1, hidden) / math.sqrt(hidden), rnd(out1) * 0.1
        self.w2, self.b2 = rnd(hidden, ffn) / math.sqrt(ffn), rnd(hidden) * 0.1
        self.n1, self.n2 = 1 + 0.1 * rnd(hidden), 1 + 0.1 * rnd(hidden)
        self.x, self.res = rnd(tokens, hidden), rnd(tokens, hidden)
        self.dy, self.dres = rnd(tokens, hidden), rnd(tokens, hidden)


def grads_of(tensors):
    return [t.grad for t in tensors]


def check(name, got, want):
    try:
        torch.testing.assert_close(got, want, **TOL)
    except AssertionError as error:
        raise AssertionError(f"{name}: {error}") from None


def single_linears(rank, world):
    hidden, out, tokens = 4 * world, 6 * world, 2 * world
    g = torch.Generator().manual_seed(7)
    w, b = torch.randn(out, hidden, generator=g, dtype=DT), torch.randn(out, generator=g, dtype=DT)
    x, dy = torch.randn(tokens, hidden, generator=g, dtype=DT), torch.randn(tokens, out, generator=g, dtype=DT)
    xr = x.clone().requires_grad_()
    wr, br = w.clone().requires_grad_(), b.clone().requires_grad_()
    y_ref = F.linear(xr, wr, br)
    y_ref.backward(dy)
    for parallel, sp in [("column", False), ("row", False), ("column", True), ("row", True)]:
        lin = ops.Linear(hidden, out, parallel=parallel, sequence_parallel=sp, dtype=DT)
        lin.load_unsharded(w, b)
        seq = ops.Sequential(lin)
        x_in = x
        if parallel == "column" and sp:
            x_in = rows(x, rank, world)
        if parallel == "row":
            x_in = cols(x, rank, world)
        x_in = x_in.clone().requires_grad_()
        y = seq(x_in)
        tag = f"{parallel}{'+sp' if sp else ''}"
        if parallel == "column":
            want_y, local_dy = cols(y_ref, rank, world), cols(dy, rank, world)
        else:
            want_y = rows(y_ref, rank, world) if sp else y_ref
            local_dy = rows(dy, rank, world) if sp else dy
        check(f"{tag} y", y, want_y.detach())
        y.backward(local_dy)
        want_dx = xr.grad
        if parallel == "column" and sp:
            want_dx = rows(want_dx, rank, world)
        if parallel == "row":
            want_dx = cols(want_dx, rank, world)
        check(f"{tag} dx", x_in.grad, want_dx)
        want_dw = rows(wr.grad, rank, world) if parallel == "column" else cols(wr.grad, rank, world)
        check(f"{tag} dW", lin.weight.grad, want_dw)
        db = lin.bias.grad.clone()
        if parallel == "row" and sp:
            dist.all_reduce(db)  # token-sharded bias: partial gradient per rank
            assert lin.bias.sequence_parallel
        check(f"{tag} db", db, rows(br.grad, rank, world) if parallel == "column" else br.grad)


def mlp_block(world, hidden, ffn, sp, act="gelu"):
    if act == "swiglu":  # separate gate and up weights; the activation is part of the layer
        first, activation = ops.GatedLinear(hidden, ffn, bias=True, parallel="column", sequence_parallel=sp,
                                            dtype=DT), ops.Identity()
    else:
        first, activation = ops.Linear(hidden, ffn, parallel="column", sequence_parallel=sp, dtype=DT), ops.GELU()
    return ops.Sequential(
        ops.RMSNorm(hidden, dtype=DT), first, activation,
        ops.Linear(ffn, hidden, parallel="row", sequence_parallel=sp, dtype=DT),
        ops.AddExtraInput(), ops.MakeExtraOutput(), ops.RMSNorm(hidden, dtype=DT))


def mlp(rank, world, sp, act, fuse):
    hidden, ffn, tokens = 4 * world, 8 * world, 3 * world
    full = Full(hidden, ffn, tokens, gate=act == "swiglu")
    block = mlp_block(world, hidden, ffn, sp, act)
    with torch.no_grad():
        block[0].weight.copy_(full.n1)
        block[6].weight.copy_(full.n2)
    if act == "swiglu":
        # The checkpoint layout torch.cat([gate, up]) loads as it is.
        block[1].load_unsharded(gate_up=full.w1, gate_up_bias=full.b1)
    else:
        block[1].load_unsharded(full.w1, full.b1)
    block[3].load_unsharded(full.w2, full.b2)

    leaves = [t.clone().requires_grad_() for t in (full.x, full.res, full.n1, full.w1, full.b1, full.w2, full.b2,
                                                    full.n2)]
    x, res, n1, w1, b1, w2, b2, n2 = leaves
    hid = F.linear(ref_rms(x, n1), w1, b1)
    if act == "gelu":
        hid = F.gelu(hid)
    else:
        a, b = hid.chunk(2, -1)
        hid = F.silu(a) * b
    h_ref = F.linear(hid, w2, b2) + res
    y_ref = ref_rms(h_ref, n2)
    (y_ref * full.dy + h_ref * full.dres).sum().backward()

    shard = (lambda t: rows(t, rank, world)) if sp else (lambda t: t)
    xin, rin = shard(full.x).clone().requires_grad_(), shard(full.res).clone().requires_grad_()
    with opfuse.config.override(fuse=fuse):
        y, h = block(xin, rin)
        program = opfuse.compile(block, xin, rin)
        tag = f"mlp {act} sp={sp} fuse={fuse}"
        check(f"{tag} y", y, shard(y_ref).detach())
        check(f"{tag} h", h, shard(h_ref).detach())
        (y * shard(full.dy) + h * shard(full.dres)).sum().backward()
    check(f"{tag} dx", xin.grad, shard(x.grad))
    check(f"{tag} dres", rin.grad, shard(res.grad))
    if sp:
        assert opfuse.sync_sequence_parallel_grads(block) == 3  # two norms + row bias
    check(f"{tag} dn1", block[0].weight.grad, n1.grad)
    check(f"{tag} dn2", block[6].weight.grad, n2.grad)
    check(f"{tag} db2", block[3].bias.grad, b2.grad)
    check(f"{tag} dW2", block[3].weight.grad, cols(w2.grad, rank, world))
    if act == "gelu":
        check(f"{tag} dW1", block[1].weight.grad, rows(w1.grad, rank, world))
        check(f"{tag} db1", block[1].bias.grad, rows(b1.grad, rank, world))
    else:
        (gate_dw, up_dw), (gate_db, up_db) = w1.grad.chunk(2), b1.grad.chunk(2)
        check(f"{tag} dW gate", block[1].gate_weight.grad, rows(gate_dw, rank, world))
        check(f"{tag} dW up", block[1].up_weight.grad, rows(up_dw, rank, world))
        check(f"{tag} db gate", block[1].gate_bias.grad, rows(gate_db, rank, world))
        check(f"{tag} db up", block[1].up_bias.grad, rows(up_db, rank, world))
    return program


def all_cases(rank, world):
    torch.set_num_threads(1)
    single_linears(rank, world)
    for sp in (False, True):
        for fuse in (True, False):
            program = mlp(rank, world, sp, "gelu", fuse)
            rules = [f.rule for f in program.fusions]
            if fuse and not sp:
                record = next(f for f in program.fusions if f.rule == "allreduce_add_rmsnorm")
                assert {"AllReduce", "AddExtraInput", "MakeExtraOutput", "RMSNorm"} <= set(record.ops), record
            if fuse and sp:
                assert {"all_gather_linear", "linear_reduce_scatter", "add_rmsnorm"} <= set(rules), rules
            if not fuse:
                assert rules == []
    mlp(rank, world, False, "swiglu", True)


@pytest.mark.dist
@pytest.mark.parametrize("world", [2, 4])
def test_tensor_parallel_ops_and_blocks(world, session_spawn):
    session_spawn.run(all_cases, world)


#: Run with other modules' Sequential cases in one spawn per world for the session
#: (tests/dist/shared_spawn.py); a case that does not finish there runs alone in its test.
SESSION_CASES = [(all_cases, 2, ()), (all_cases, 4, ())]
