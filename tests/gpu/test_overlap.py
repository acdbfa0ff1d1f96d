"""Comm + GEMM overlap (``p2p_overlap``) on real GPUs, NCCL world 2, 3, 4 and 8 (as the host
allows), through opfuse programs:
outputs and every gradient against the non-overlapped distributed computation with the same
sharding in float32 (opfuse's differentiable NCCL collectives + F.linear), over several shapes
(1 token per rank up to thousands, 3-D inputs, odd widths, bias / no bias, both bias placements
of the reduce-scatter, per-rank biases that differ), regions and outputs poisoned with NaN before
every call; CUDA-graph capture of forward + backward replayed with fresh inputs; the fallbacks
(one-rank group, pool too small, float32) shown in ``Program.fusions``; non-divisible tokens as an
error at compile time.

Schedules covered: all-gather with grouped remote shards (automatic for these sizes), one GEMM
per shard (``OPFUSE_OVERLAP_CHUNKS=1``) and row sub-chunks (``=4``); the ring and the direct
reduce-scatter (pre-summed partials, own GEMM accumulating onto them); one and two GEMM streams;
eager calls issued instruction by instruction and replayed from a graph of their plan
(``OPFUSE_OVERLAP_EAGER_GRAPHS`` auto, on and off).

One spawn per world size (process start-up dominates): ``pytest -q tests/gpu/test_overlap.py``.
"""

import math
import os

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # inherited by the spawned ranks
os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402

GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
pytestmark = pytest.mark.skipif(GPUS < 2, reason="needs 2+ GPUs")

import opfuse  # noqa: E402
from opfuse import ops  # noqa: E402
from opfuse.machinery.implementation import ImplementationError  # noqa: E402
from opfuse.ops import collectives  # noqa: E402
from opfuse.ops.base import OpInputError  # noqa: E402

from ..dist.harness import run  # noqa: E402

IMPL = "p2p_overlap"
TOL = {torch.float32: 1e-5, torch.bfloat16: 1.6e-2, torch.float16: 2e-3}
BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32

# (tokens per rank, in features, local out features, dtype, bias, extra leading dims)
AG_CASES = [
    (1, 64, 48, BF16, True, ()),
    (8, 200, 120, FP16, False, (2,)),
    (3, 128, 64, BF16, True, ()),
    (512, 1024, 512, BF16, True, ()),
    (1024, 2048, 1024, BF16, False, ()),
    (257, 512, 256, FP16, True, ()),
    (16, 64, 32, FP32, True, ()),
]
# (tokens per rank after the scatter, local in features, out features, dtype, bias, leading dims)
RS_CASES = [
    (1, 64, 48, BF16, True, ()),
    (8, 120, 200, FP16, False, (2,)),
    (5, 64, 96, BF16, True, ()),
    (512, 512, 1024, BF16, True, ()),
    (1024, 1024, 1024, BF16, False, ()),
    (300, 256, 512, FP16, True, ()),
    (16, 64, 32, FP32, True, ()),
]
# Per-rank bias before the sum (BasicLinear -> Bias -> ReduceScatter).
RS_LOCAL_BIAS_CASES = [(2, 64, 96, BF16, ()), (64, 128, 256, FP16, ()), (600, 512, 768, BF16, ())]


def rel(got, ref):
    got, ref = got.double(), ref.double()
    return ((got - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def check(name, got, ref, dtype):
    assert got is not None, f"{name}: missing"
    assert tuple(got.shape) == tuple(ref.shape), f"{name}: shape {tuple(got.shape)} != {tuple(ref.shape)}"
    assert bool(torch.isfinite(got).all()), f"{name}: non-finite values (an element was never written)"
    err = rel(got, ref)
    assert err < TOL[dtype], f"{name}: relative error {err:.3e} >= {TOL[dtype]}"


def randn(gen, *shape, dtype, scale=1.0):
    return (torch.randn(*shape, generator=gen, device="cuda") * scale).to(dtype)


def randomize(model, gen):
    """Fresh random parameters, different on every rank (generators are seeded per rank)."""
    with torch.no_grad():
        for p in model.parameters():
            scale = 1 / math.sqrt(p.shape[-1]) if p.dim() > 1 else 0.5
            p.copy_(randn(gen, *p.shape, dtype=p.dtype, scale=scale))


def poison(*likes):
    """NaN into every overlap region of every pool and into the allocator blocks the next outputs
    will most likely get, so an unwritten element shows up as non-finite."""
    from opfuse.runtime.symm_pool import _POOLS

    for pool in _POOLS.values():
        for name, region in pool.regions.items():
            if name.startswith("overlap/"):
                region.local_tensor(torch.uint8).fill_(0xFF)  # 0xFFFF is NaN in bf16 and fp16
    junk = [torch.full_like(t, float("nan")) for t in likes]
    del junk
    torch.cuda.synchronize()
    dist.barrier()


def zero_grads(*tensors):
    for t in tensors:
        t.grad = None


def fusions(program):
    return [(f.rule, f.impl) for f in program.fusions]


def expect_impl(dtype):
    return "reference" if dtype == FP32 else IMPL


# Cases ---------------------------------------------------------------------------------------------


def run_ag_case(rank, world, pg, gen, tokens, k, n_local, dtype, bias, lead, calls=2):
    layer = ops.Linear(k, n_local * world, bias=bias, parallel="column", sequence_parallel=True, group=pg,
                       device="cuda", dtype=dtype)
    model = ops.Sequential(layer)
    randomize(model, gen)
    params = list(model.parameters())
    for call in range(calls):  # later calls reuse the bound plan and the regions (and replay its graph)
        x = randn(gen, tokens, *lead, k, dtype=dtype).requires_grad_()
        dy = randn(gen, tokens * world, *lead, n_local, dtype=dtype)
        program = opfuse.compile(model, x)
        assert fusions(program) == [("all_gather_linear", expect_impl(dtype))], program.fusions
        zero_grads(x, *params)
        poison(dy, x, *params)
        y = model(x)
        y.backward(dy)
        x32 = x.detach().float().requires_grad_()
        w32 = layer.weight.detach().float().requires_grad_()
        b32 = layer.bias.detach().float().requires_grad_() if bias else None
        y32 = F.linear(collectives.all_gather(x32, pg), w32, b32)
        y32.backward(dy.float())
        what = f"AG rank {rank} tokens={tokens} k={k} n={n_local} {dtype} bias={bias} lead={lead} call={call}"
        check(f"{what}: y", y, y32, dtype)
        check(f"{what}: dx", x.grad, x32.grad, dtype)
        check(f"{what}: dw", layer.weight.grad, w32.grad, dtype)
        if bias:
            check(f"{what}: db", layer.bias.grad, b32.grad, dtype)


def run_rs_case(rank, world, pg, gen, tokens, kl, n, dtype, bias, lead, bias_after=True, calls=2):
    if bias_after:
        layer = ops.Linear(kl * world, n, bias=bias, parallel="row", sequence_parallel=True, group=pg,
                           device="cuda", dtype=dtype)
        model = ops.Sequential(layer)
        weight, bias_param, rule = layer.weight, layer.bias, "linear_reduce_scatter"
    else:
        linear = ops.BasicLinear(kl, n, device="cuda", dtype=dtype)
        add = ops.Bias(n, device="cuda", dtype=dtype)
        model = ops.Sequential(linear, add, ops.ReduceScatter(group=pg))
        weight, bias_param, rule = linear.weight, add.bias, "linear_bias_reduce_scatter"
    randomize(model, gen)  # row-parallel biases differ per rank too: each rank's own must be used
    params = list(model.parameters())
    for call in range(calls):
        x = randn(gen, tokens * world, *lead, kl, dtype=dtype).requires_grad_()
        dy = randn(gen, tokens, *lead, n, dtype=dtype)
        program = opfuse.compile(model, x)
        assert fusions(program) == [(rule, expect_impl(dtype))], program.fusions
        zero_grads(x, *params)
        poison(dy, x, *params)
        y = model(x)
        y.backward(dy)
        x32 = x.detach().float().requires_grad_()
        w32 = weight.detach().float().requires_grad_()
        b32 = bias_param.detach().float().requires_grad_() if bias else None
        if bias_after:
            y32 = collectives.reduce_scatter(F.linear(x32, w32), pg)
            y32 = y32 + b32 if bias else y32
        else:
            y32 = collectives.reduce_scatter(F.linear(x32, w32, b32), pg)
        y32.backward(dy.float())
        what = (f"RS rank {rank} tokens={tokens} k={kl} n={n} {dtype} bias={bias} bias_after={bias_after} "
                f"lead={lead} call={call}")
        check(f"{what}: y", y, y32, dtype)
        check(f"{what}: dx", x.grad, x32.grad, dtype)
        check(f"{what}: dw", weight.grad, w32.grad, dtype)
        if bias:
            check(f"{what}: db", bias_param.grad, b32.grad, dtype)


def check_cases(rank, world, calls=2):
    pg = dist.group.WORLD
    gen = torch.Generator(device="cuda").manual_seed(1234 + rank)
    for case in AG_CASES:
        run_ag_case(rank, world, pg, gen, *case, calls=calls)
    for case in RS_CASES:
        run_rs_case(rank, world, pg, gen, *case, calls=calls)
    for tokens, kl, n, dtype, lead in RS_LOCAL_BIAS_CASES:
        run_rs_case(rank, world, pg, gen, tokens, kl, n, dtype, True, lead, bias_after=False, calls=calls)
    # More sub-chunks than the default (several per gather shard, 4 per ring chunk).
    with opfuse.config.override(overlap_chunks=4):
        run_ag_case(rank, world, pg, gen, 512, 256, 128, BF16, True, ())
        run_rs_case(rank, world, pg, gen, 2048, 256, 256, BF16, True, ())
        run_rs_case(rank, world, pg, gen, 64, 128, 256, FP16, True, (), bias_after=False)
    # One GEMM per gathered shard (the automatic setting groups small shards) and the direct
    # reduce-scatter at a size where the automatic setting picks the ring.
    with opfuse.config.override(overlap_chunks=1):
        run_ag_case(rank, world, pg, gen, 256, 256, 128, BF16, True, ())
        run_rs_case(rank, world, pg, gen, 1024, 128, 256, BF16, True, ())
    # The GEMM-stream rule forced both ways (small test shapes alone would always alternate).
    for forced in ("off", "on"):
        with opfuse.config.override(overlap_alternate_streams=forced):
            run_ag_case(rank, world, pg, gen, 96, 256, 192, BF16, True, ())
            run_rs_case(rank, world, pg, gen, 96, 128, 256, FP16, True, ())


def check_graph_replay(rank, world, chunks):
    """Forward + backward of a sequence-parallel MLP captured in one CUDA graph, replayed with
    fresh inputs: no host sync (capture would fail), no host-side state between calls.
    ``chunks=0``: the automatic schedules (direct reduce-scatter at this size); ``2``: the ring
    and two sub-chunks per gathered shard."""
    pg, dtype = dist.group.WORLD, BF16
    tokens, hidden, ffn_local = 256, 512, 384
    fc1 = ops.Linear(hidden, ffn_local * world, parallel="column", sequence_parallel=True, group=pg, device="cuda",
                     dtype=dtype)
    fc2 = ops.Linear(ffn_local * world, hidden, parallel="row", sequence_parallel=True, group=pg, device="cuda",
                     dtype=dtype)
    model = ops.Sequential(fc1, fc2)
    gen = torch.Generator(device="cuda").manual_seed(77 + rank)
    randomize(model, gen)
    params = list(model.parameters())
    static_x = randn(gen, tokens, hidden, dtype=dtype).requires_grad_()
    static_dy = randn(gen, tokens, hidden, dtype=dtype)
    program = opfuse.compile(model, static_x)
    assert fusions(program) == [("all_gather_linear", IMPL), ("linear_reduce_scatter", IMPL)], program.fusions

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            zero_grads(static_x, *params)
            model(static_x).backward(static_dy)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    dist.barrier()

    zero_grads(static_x, *params)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_y = model(static_x)
        static_y.backward(static_dy)
    for replay in range(6):
        with torch.no_grad():
            static_x.copy_(randn(gen, tokens, hidden, dtype=dtype))
            static_dy.copy_(randn(gen, tokens, hidden, dtype=dtype))
        graph.replay()
        x32 = static_x.detach().float().requires_grad_()
        p32 = [p.detach().float().requires_grad_() for p in params]
        h = F.linear(collectives.all_gather(x32, pg), p32[0], p32[1])
        y32 = collectives.reduce_scatter(F.linear(h, p32[2]), pg) + p32[3]
        y32.backward(static_dy.float())
        what = f"graph replay {replay} rank {rank} chunks={chunks}"
        check(f"{what}: y", static_y, y32, dtype)
        check(f"{what}: dx", static_x.grad, x32.grad, dtype)
        for name, p, ref in zip(("w1", "b1", "w2", "b2"), params, p32):
            check(f"{what}: d{name}", p.grad, ref.grad, dtype)
    torch.cuda.synchronize()
    dist.barrier()


def check_fallbacks(rank, world):
    # A one-rank group has no peers: the reference (sequential NCCL path) runs, and says why.
    subgroups = [dist.new_group([r]) for r in range(world)]
    mine = subgroups[rank]
    model = ops.Sequential(
        ops.Linear(64, 96, parallel="column", sequence_parallel=True, group=mine, device="cuda", dtype=BF16),
        ops.Linear(96, 64, parallel="row", sequence_parallel=True, group=mine, device="cuda", dtype=BF16))
    gen = torch.Generator(device="cuda").manual_seed(5 + rank)
    randomize(model, gen)
    x = randn(gen, 16, 64, dtype=BF16)
    program = opfuse.compile(model, x)
    for record in program.fusions:
        assert record.impl == "reference", program.fusions
        reasons = dict(record.skipped)
        assert "one rank" in reasons.get(IMPL, ""), record.skipped
    p = [q.float() for q in model.parameters()]
    check("one-rank group", model(x), F.linear(F.linear(x.float(), p[0], p[1]), p[2], p[3]), BF16)

    # A pool too small for the regions: the reference runs on every rank, with the reason.
    small = dist.new_group(list(range(world)))
    with opfuse.config.override(symm_pool_mb=1, symm_pool_max_mb=1):
        layer = ops.Linear(1024, 512 * world, parallel="column", sequence_parallel=True, group=small, device="cuda",
                           dtype=BF16)
        model = ops.Sequential(layer)
        randomize(model, gen)
        x = randn(gen, 512, 1024, dtype=BF16)
        program = opfuse.compile(model, x)
        assert fusions(program) == [("all_gather_linear", "reference")], program.fusions
        assert "no room" in dict(program.fusions[0].skipped)[IMPL], program.fusions[0].skipped
        check("pool too small", model(x),
              F.linear(collectives.raw_all_gather(x.float(), small), layer.weight.float(), layer.bias.float()), BF16)

    # Forcing the overlap implementation where it cannot run is an error, not a silent fallback.
    with opfuse.config.override(force_impl=f"all_gather_linear={IMPL}"):
        model = ops.Sequential(ops.Linear(64, 32 * world, parallel="column", sequence_parallel=True, device="cuda",
                                          dtype=FP32))
        with pytest.raises(ImplementationError, match="float32"):
            opfuse.compile(model, torch.randn(4, 64, device="cuda"))

    # Tokens not divisible by the world size cannot be reduce-scattered: an error when compiling.
    model = ops.Sequential(ops.BasicLinear(64, 32, device="cuda", dtype=BF16), ops.ReduceScatter())
    with pytest.raises(OpInputError, match="not divisible"):
        opfuse.compile(model, torch.randn(world * 3 + 1, 64, device="cuda", dtype=BF16))
    torch.cuda.synchronize()
    dist.barrier()


def all_checks(rank, world):
    # A schedule bug then traps with "[FATAL] ... failed to receive signal from rank ..." instead
    # of hanging until the harness timeout.
    opfuse.config.peer_timeout_ms = 120_000
    check_cases(rank, world)
    for chunks in (0, 2):
        with opfuse.config.override(overlap_chunks=chunks):
            check_graph_replay(rank, world, chunks)
    check_fallbacks(rank, world)


@pytest.mark.parametrize("world", [2, 3, 4, 8])
def test_overlap(world):
    if GPUS < world:
        pytest.skip(f"needs {world} GPUs (have {GPUS})")
    run(all_checks, world, backend="nccl", timeout=600)
