"""A peer that stops calling must not hang the others: through an opfuse program on 2 GPUs (NCCL),
one rank skips a call of the fused all-reduce + residual + RMSNorm; the other's kernel gives up
after ``opfuse.config.peer_timeout_ms`` and the next check raises an error naming the op and the
peer, then every later call raises it too."""

import time

import pytest
import torch
import torch.distributed as dist

pytestmark = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                                reason="needs 2+ GPUs")

import opfuse  # noqa: E402
from opfuse import ops  # noqa: E402
from opfuse.cli.launch import run  # noqa: E402

TIMEOUT_MS = 1500


def skipped_call(rank, world, impl):
    hidden, dtype = 2048, torch.bfloat16
    model = ops.Sequential(ops.AllReduce(), ops.AddExtraInput(), ops.MakeExtraOutput(),
                           ops.RMSNorm(hidden, dtype=dtype, device="cuda"))
    x = torch.randn(16, hidden, device="cuda", dtype=dtype)
    # The residual is replicated: the same on every rank (opfuse checks it on the first call).
    res = torch.randn(16, hidden, device="cuda", dtype=dtype, generator=torch.Generator("cuda").manual_seed(7))
    with opfuse.config.override(force_impl=f"allreduce_add_rmsnorm={impl}", peer_timeout_ms=TIMEOUT_MS), \
            torch.no_grad():
        model(x, res)  # every rank: fine
        torch.cuda.synchronize()
        opfuse.check_peers()
        dist.barrier()
        if rank == 0:
            start = time.perf_counter()
            model(x, res)  # rank 1 skips this call
            torch.cuda.synchronize()  # returns: the kernel gave up instead of spinning forever
            elapsed = time.perf_counter() - start
            assert TIMEOUT_MS / 1000 <= elapsed < TIMEOUT_MS / 1000 + 10, elapsed
            with pytest.raises(opfuse.PeerTimeoutError) as caught:
                opfuse.check_peers()
            text = str(caught.value)
            assert "allreduce_add_rmsnorm" in text and "peer rank 1 (global rank 1)" in text, text
            assert "rank 0 of its group" in text and "OPFUSE_PEER_TIMEOUT_MS" in text, text
            with pytest.raises(opfuse.PeerTimeoutError, match="allreduce_add_rmsnorm"):
                model(x, res)  # every later call raises before launching
        torch.cuda.synchronize()
        dist.barrier()


@pytest.mark.parametrize("impl", ["cuda_oneshot", "cuda_twoshot_lamport", "cuda_twoshot"])
def test_a_rank_that_skips_a_call_fails_the_others_within_the_timeout(impl):
    run(skipped_call, 2, impl, backend="nccl", timeout=300)
