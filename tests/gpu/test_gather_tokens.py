"""``all_gather_tokens`` over peer memory (``p2p_overlap``: copy-engine pushes) on real GPUs, NCCL
world 2, 3 and 4 as the host allows: bitwise equal to NCCL's all-gather for bf16 / fp16, 2-D and 3-D
inputs, one row to thousands, odd widths; back-to-back calls whose sizes change, each with fresh
data (a row the plan failed to write would still hold the previous call's values); a CUDA graph of
the call replayed with fresh inputs; the threshold below which NCCL keeps the gather; and the
torch.compile backend's ``gradient_all_gather`` rule in a DTensor sequence-parallel training step
(the example model's gradients against eager, the rule run by ``p2p_overlap``).

One spawn per world size: ``pytest -q tests/gpu/test_gather_tokens.py``.
"""

import os
import sys

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # inherited by the spawned ranks
os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
pytestmark = pytest.mark.skipif(GPUS < 2, reason="needs 2+ GPUs")

from opfuse.cli.launch import run  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                                "examples"))

BF16, FP16 = torch.bfloat16, torch.float16
# (rows per rank, features, dtype, extra dims after the first)
CASES = [(1, 64, BF16, ()), (3, 200, FP16, ()), (8, 64, BF16, (5,)), (257, 1000, BF16, ()),
         (1024, 4096, BF16, ()), (512, 1024, FP16, (2,)), (2048, 2048, BF16, ())]


def _pool(world):
    from opfuse.ops import group as groups
    from opfuse.runtime import symm_pool

    group = dist.group.WORLD
    assert symm_pool.open_pool(group, torch.device("cuda", torch.cuda.current_device())) is not None
    return groups.group_name(group)


def check_calls(rank, world):
    from opfuse.families.collective_linear import p2p
    from opfuse.ops.collectives import raw_all_gather

    name = _pool(world)
    gen = torch.Generator(device="cuda").manual_seed(11 + rank)
    for rows, k, dtype, extra in CASES + CASES[::-1]:  # sizes change from call to call, up and down
        for call in range(2):
            x = torch.randn((rows,) + extra + (k,), generator=gen, device="cuda", dtype=dtype)
            got = p2p.all_gather_tokens_forward(x, name)
            want = raw_all_gather(x, dist.group.WORLD)
            assert got.shape == want.shape, (got.shape, want.shape)
            assert torch.equal(got, want), f"rank {rank} rows {rows} k {k} {dtype} extra {extra} call {call}"
    torch.cuda.synchronize()
    dist.barrier()


def check_graph_replay(rank, world):
    from opfuse.families.collective_linear import p2p
    from opfuse.ops.collectives import raw_all_gather

    name = _pool(world)
    gen = torch.Generator(device="cuda").manual_seed(23 + rank)
    static_x = torch.randn(640, 1536, generator=gen, device="cuda", dtype=BF16)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # binds the plan outside capture
        for _ in range(2):
            p2p.all_gather_tokens_forward(static_x, name)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    dist.barrier()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = p2p.all_gather_tokens_forward(static_x, name) * 1  # the op's output, read inside the graph
    for replay in range(5):
        static_x.copy_(torch.randn(640, 1536, generator=gen, device="cuda", dtype=BF16))
        graph.replay()
        want = raw_all_gather(static_x, dist.group.WORLD)
        assert torch.equal(static_out, want), f"rank {rank} replay {replay}"
    torch.cuda.synchronize()
    dist.barrier()


def check_threshold(rank, world):
    """Below ``MIN_GATHER_BYTES`` per rank the check refuses with the reason; at it, it accepts."""
    from opfuse.families.collective_linear import p2p
    from opfuse.machinery.implementation import CallSpec
    from opfuse.ops.base import TensorMeta

    name = _pool(world)
    cols = 1024
    for rows, capable in ((p2p.MIN_GATHER_BYTES // (2 * cols) - 1, False), (p2p.MIN_GATHER_BYTES // (2 * cols), True)):
        meta = TensorMeta((rows, cols), BF16, torch.device("cuda", torch.cuda.current_device()), False)
        spec = CallSpec(op="all_gather_tokens", inputs={"x": meta}, attrs={}, group_name=name, world_size=world)
        reason = p2p.check_all_gather_tokens(spec)
        assert (reason is None) == capable, (rows, reason)
        if not capable:
            assert "NCCL's gather costs less" in reason, reason


def check_compiled_training(rank, world):
    """The backward gathers of a DTensor sequence-parallel step run over peer memory (threshold
    lowered: this model's gradients are 64 KiB per rank), with eager's gradients."""
    import llama_tp
    from opfuse.families.collective_linear import p2p

    p2p.MIN_GATHER_BYTES = 0
    cfg = llama_tp.Config(dim=512, layers=2, heads=8, kv_heads=4, ffn=1536, vocab=512, max_seq=256)
    errors, programs = llama_tp.run_check(rank, world, "dtensor-sp", True, True, cfg=cfg, dtype=torch.bfloat16,
                                          batch=1, seq=128, verbose=False)
    bad = {key: value for key, value in errors.items() if not value <= 3e-2}
    assert not bad, f"compiled differs from eager: {bad}"
    gathers = [f for p in programs for f in p.fusions if f.rule == "gradient_all_gather"]
    assert gathers and all(f.impl == "p2p_overlap" for f in gathers), [(f.impl, f.skipped) for f in gathers]


def all_checks(rank, world):
    import opfuse

    opfuse.config.peer_timeout_ms = 120_000
    opfuse.config.p2p_gradient_gathers = True
    check_calls(rank, world)
    check_graph_replay(rank, world)
    check_threshold(rank, world)
    check_compiled_training(rank, world)


@pytest.mark.parametrize("world", [2, 3, 4])
def test_gather_tokens(world):
    if GPUS < world:
        pytest.skip(f"needs {world} GPUs (have {GPUS})")
    run(all_checks, world, backend="nccl", timeout=600)
