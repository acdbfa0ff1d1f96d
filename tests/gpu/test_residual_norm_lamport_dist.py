"""The pipelined Lamport two-shot (``cuda_twoshot_lamport``) through opfuse programs on real GPUs
(NCCL groups of 2, 3, 4, 8 ranks as the host has GPUs), and the PDL launches of every peer kernel.

Fresh random inputs against a float64 reference of the unfused math at odd sizes (1, 3, 17, 1000,
4099 tokens; hidden 5120 and 8192), RMSNorm / LayerNorm / plain all-reduce, bf16 / fp16 / fp32;
ranks bitwise equal; back-to-back calls of changing sizes with no synchronisation; one CUDA graph
holding calls of three sizes (three regions) replayed many times with fresh data and poisoned
outputs; PDL on and off give the same bits; the automatic choice takes the kernel past the
one-shot limit; a late peer still gets the right answer (a peer that never calls:
tests/gpu/test_peer_timeout.py, parametrized over this implementation too).
"""

import time

import pytest
import torch
import torch.distributed as dist

pytestmark = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                                reason="needs 2+ GPUs")

import opfuse  # noqa: E402
from opfuse import ops  # noqa: E402
from opfuse.families.residual_norm import cuda as norm_cuda  # noqa: E402
from opfuse.cli.launch import run  # noqa: E402
from opfuse.runtime.device import device_name  # noqa: E402

from .test_residual_norm_dist import TOL, assert_bitwise_across_ranks, block, partials, reference, rel  # noqa: E402

IMPL = "cuda_twoshot_lamport"
TIMEOUT_MS = 60_000  # a protocol bug becomes a PeerTimeoutError, not a hang
CASES = [(1, 8192, torch.bfloat16), (3, 5120, torch.bfloat16), (17, 5120, torch.float16),
         (1000, 8192, torch.bfloat16), (4099, 5120, torch.bfloat16), (33, 4096, torch.float32),
         (4096, 8192, torch.bfloat16)]


def forced(norm="rms"):
    op = {"rms": "allreduce_add_rmsnorm", "layer": "allreduce_add_layernorm", "none": "allreduce"}[norm]
    return opfuse.config.override(force_impl=f"{op}={IMPL}")


def check_forced_sizes(rank, world):
    for tokens, hidden, dtype in CASES:
        for norm in ("rms", "layer"):
            model = block(hidden, dtype, norm, bias=tokens % 2 == 1)
            xs = partials(tokens + hidden, world, tokens, hidden, dtype)
            res = partials(1, 1, tokens, hidden, dtype)[0]
            with forced(norm):
                y, h = model(xs[rank], res)
                record = opfuse.compile(model, xs[rank], res).fusions[0]
            assert record.impl == IMPL, record
            y_ref, h_ref = reference(model, xs, res)
            tag = f"{IMPL} {norm} T={tokens} H={hidden} {dtype} world {world}"
            assert not torch.isnan(y).any() and not torch.isnan(h).any(), f"{tag}: unwritten output"
            assert rel(y, y_ref) < TOL[dtype], f"{tag}: y {rel(y, y_ref)}"
            assert rel(h, h_ref) < TOL[dtype], f"{tag}: h {rel(h, h_ref)}"
            assert_bitwise_across_ranks(y, tag + " y")
            assert_bitwise_across_ranks(h, tag + " h")
        # The plain all-reduce (no norm) on the same kernel.
        xs = partials(tokens * 7, world, tokens, hidden, dtype)
        with forced("none"):
            plain = ops.Sequential(ops.AllReduce())
            out = plain(xs[rank])
            assert opfuse.compile(plain, xs[rank]).fusions[0].impl == IMPL
        assert rel(out, sum(x.double() for x in xs)) < TOL[dtype], f"plain T={tokens} H={hidden}"
        assert_bitwise_across_ranks(out, f"plain all-reduce T={tokens} H={hidden}")


def check_auto_choice(rank, world):
    """Past the one-shot limit the automatic choice follows the packaged table: the Lamport kernel
    exactly where its ``lamport_max`` covers the message."""
    tokens, hidden, dtype = 4096, 8192, torch.bfloat16  # 64 MiB per rank: past every one-shot limit
    model = block(hidden, dtype)
    xs = partials(3, world, tokens, hidden, dtype)
    res = partials(4, 1, tokens, hidden, dtype)[0]
    y, _ = model(xs[rank], res)
    row_bytes, message = hidden * 2, tokens * hidden * 2
    limit = norm_cuda.lamport_limit(world, row_bytes, device_name(torch.cuda.current_device()))  # this GPU's
    chosen = opfuse.compile(model, xs[rank], res).fusions[0].impl
    assert (chosen == IMPL) == (limit is None or limit >= message), (chosen, limit)
    assert rel(y, reference(model, xs, res)[0]) < TOL[dtype]


SEQUENCE = [(1000, 8192), (1, 8192), (17, 5120), (4099, 5120), (3, 5120), (64, 8192), (1000, 5120)]


def check_back_to_back(rank, world):
    """Calls of changing sizes (several regions, both buffers of each) issued back to back with no
    host synchronisation; all checked at the end."""
    dtype = torch.bfloat16
    models = {}
    with forced():
        for tokens, hidden in SEQUENCE:  # compile (and prepare: a barrier) outside the timed sequence
            if hidden not in models:
                models[hidden] = block(hidden, dtype)
            models[hidden](partials(0, world, tokens, hidden, dtype)[rank], partials(0, 1, tokens, hidden, dtype)[0])
        torch.cuda.synchronize()
        dist.barrier()
        results = []
        for lap in range(3):
            for i, (tokens, hidden) in enumerate(SEQUENCE):
                seed = 1000 * lap + 10 * i
                xs = partials(seed, world, tokens, hidden, dtype)
                res = partials(seed + 1, 1, tokens, hidden, dtype)[0]
                y, h = models[hidden](xs[rank], res)
                results.append((lap, tokens, hidden, models[hidden], xs, res, y, h))
    opfuse.check_peers()
    for lap, tokens, hidden, model, xs, res, y, h in results:
        y_ref, h_ref = reference(model, xs, res)
        tag = f"back-to-back lap {lap} T={tokens} H={hidden}"
        assert rel(y, y_ref) < TOL[dtype], f"{tag}: y {rel(y, y_ref)}"
        assert rel(h, h_ref) < TOL[dtype], f"{tag}: h {rel(h, h_ref)}"
        assert_bitwise_across_ranks(y, tag)


def check_graph_replays(rank, world, replays=300):
    """One graph of three calls in three size classes (three regions, each flipping its buffer every
    replay), replayed with fresh inputs; outputs poisoned before every replay."""
    dtype = torch.bfloat16
    shapes = [(4099, 5120), (17, 5120), (1000, 8192)]
    models = [block(hidden, dtype) for _, hidden in shapes]
    xs_static = [torch.empty(t, h, device="cuda", dtype=dtype) for t, h in shapes]
    res_static = [torch.empty(t, h, device="cuda", dtype=dtype) for t, h in shapes]
    for x, r, (t, h) in zip(xs_static, res_static, shapes):
        x.copy_(partials(t, world, t, h, dtype)[rank])
        r.copy_(partials(t + 1, 1, t, h, dtype)[0])  # replicated: the same on every rank
    with forced(), torch.no_grad():
        for model, x, r in zip(models, xs_static, res_static):
            model(x, r)  # compile and prepare outside capture
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for model, x, r in zip(models, xs_static, res_static):
                model(x, r)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            outs = [model(x, r) for model, x, r in zip(models, xs_static, res_static)]
    for step in range(replays):
        fresh = []
        for i, (t, h) in enumerate(shapes):
            xs = partials(50_000 + 10 * step + i, world, t, h, dtype)
            res = partials(90_000 + 10 * step + i, 1, t, h, dtype)[0]
            xs_static[i].copy_(xs[rank])
            res_static[i].copy_(res)
            outs[i][0].fill_(float("nan"))
            outs[i][1].fill_(float("nan"))
            fresh.append((xs, res))
        graph.replay()
        if step % 50 == 0 or step == replays - 1:
            opfuse.check_peers()
            for i, ((t, h), (xs, res)) in enumerate(zip(shapes, fresh)):
                y_ref, h_ref = reference(models[i], xs, res)
                y, hh = outs[i]
                tag = f"graph replay {step} T={t} H={h}"
                assert rel(y, y_ref) < TOL[dtype], f"{tag}: y {rel(y, y_ref)}"
                assert rel(hh, h_ref) < TOL[dtype], f"{tag}: h {rel(hh, h_ref)}"
                assert_bitwise_across_ranks(y, tag)
        else:
            for i, (y, hh) in enumerate(outs):
                assert not torch.isnan(y).any() and not torch.isnan(hh).any(), f"replay {step} call {i}: unwritten"


def check_pdl_off_gives_the_same_bits(rank, world):
    dtype = torch.bfloat16
    for impl, tokens in (("cuda_oneshot", 5), (IMPL, 1000), ("cuda_twoshot", 1000)):
        hidden = 8192
        xs = partials(77 + tokens, world, tokens, hidden, dtype)
        res = partials(78, 1, tokens, hidden, dtype)[0]
        outs = []
        for pdl in (True, False):
            with opfuse.config.override(force_impl=f"allreduce_add_rmsnorm={impl}", pdl=pdl):
                model = block(hidden, dtype)
                outs.append(model(xs[rank], res))
        (y0, h0), (y1, h1) = outs
        assert torch.equal(y0, y1) and torch.equal(h0, h1), f"{impl}: PDL on and off differ"


def check_late_peer(rank, world):
    """The last rank calls 1.5 s after the others: they wait (bounded by the timeout) and all get
    the right answer."""
    tokens, hidden, dtype = 1000, 8192, torch.bfloat16
    model = block(hidden, dtype)
    xs = partials(11, world, tokens, hidden, dtype)
    res = partials(12, 1, tokens, hidden, dtype)[0]
    with forced():
        model(xs[rank], res)  # compile and prepare on every rank
        torch.cuda.synchronize()
        dist.barrier()
        if rank == world - 1:
            time.sleep(1.5)
        start = time.perf_counter()
        y, h = model(xs[rank], res)
        torch.cuda.synchronize()
        waited = time.perf_counter() - start
    opfuse.check_peers()
    if rank == 0:
        assert waited >= 1.0, f"rank 0 returned after {waited:.2f} s: it did not wait for the late peer"
    y_ref, h_ref = reference(model, xs, res)
    assert rel(y, y_ref) < TOL[dtype] and rel(h, h_ref) < TOL[dtype]
    assert_bitwise_across_ranks(y, "late peer")


def all_checks(rank, world):
    opfuse.config.peer_timeout_ms = TIMEOUT_MS
    check_forced_sizes(rank, world)
    check_auto_choice(rank, world)
    check_graph_replays(rank, world)
    check_pdl_off_gives_the_same_bits(rank, world)
    check_late_peer(rank, world)
    # Last: on 2x H200 (session 7) its warm-up compile of the 4099 x 5120 block raised
    # ReplicatedMismatchError for the residual, which every rank draws from the same seed; not
    # reproduced on CPU (gloo). Until explained it must not hide the checks above.
    check_back_to_back(rank, world)


@pytest.mark.parametrize("world", [2, 3, 4, 8])
def test_lamport_two_shot_on_gpus(world):
    if torch.cuda.device_count() < world:
        pytest.skip(f"needs {world} GPUs")
    run(all_checks, world, backend="nccl", timeout=600)
