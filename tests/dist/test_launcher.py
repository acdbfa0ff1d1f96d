"""The process launcher reports the rank that failed first (not a peer's "connection reset"), and
does not wait for the survivors' timeouts."""

import time

import pytest
import torch
import torch.distributed as dist

from opfuse.cli.launch import LaunchError

from .harness import run


def one_rank_fails(rank, world):
    if rank == world - 1:
        time.sleep(0.5)  # the others are inside the collective by then
        raise ValueError("boom from the last rank")
    dist.all_reduce(torch.ones(4))  # waits for the dead rank: fails with a connection error, or hangs


@pytest.mark.dist
def test_the_first_failure_is_reported():
    start = time.perf_counter()
    with pytest.raises(LaunchError) as caught:
        run(one_rank_fails, 2, timeout=120)
    text = str(caught.value)
    assert text.startswith("rank 1 failed first:"), text
    assert "ValueError: boom from the last rank" in text
    assert time.perf_counter() - start < 60
