"""A rank that fails ends every rank within seconds, with that rank's error (issue 29, item 7):
under opfuse's launcher when the rank raised in a thread and keeps running, or died without a
traceback; under torchrun when the failing rank would otherwise linger (a thread still running).
Its peers wait in a collective meanwhile, which without this lasts until the process group's
timeout (30 minutes for gloo)."""

import os
import signal
import subprocess
import threading
import time

import pytest
import torch
import torch.distributed as dist

from opfuse.cli.launch import LaunchError

from .harness import run
from .test_cli import ROOT, env, torchrun

#: Far below gloo's timeout (what a rank left waiting would take), above what starting two ranks
#: (importing torch) takes on a loaded 2-core host: 65 s was seen while other test runs shared it.
BOUND_S = 100


def raises_in_a_thread_and_keeps_running(rank, world):
    if rank == 1:
        done = threading.Event()

        def load():
            time.sleep(0.5)  # the peer is in its collective by then
            raise ValueError("boom from rank 1's loader thread")

        threading.Thread(target=load, name="loader").start()
        done.wait()  # the main thread waits for the thread's work, forever
    dist.all_reduce(torch.ones(4))


def dies_without_a_traceback(rank, world):
    if rank == 1:
        time.sleep(0.5)
        os.kill(os.getpid(), signal.SIGKILL)
    dist.all_reduce(torch.ones(4))  # a connection error here is a consequence, not the cause


@pytest.mark.dist
def test_a_rank_whose_thread_raised_stops_every_rank_with_its_error():
    start = time.perf_counter()
    with pytest.raises(LaunchError) as caught:
        run(raises_in_a_thread_and_keeps_running, 2, timeout=240)
    text = str(caught.value)
    assert time.perf_counter() - start < BOUND_S, text
    assert text.startswith("rank 1 failed first:\nin thread 'loader':"), text
    assert "ValueError: boom from rank 1's loader thread" in text
    assert "ranks stopped after it: [0, 1]" in text


@pytest.mark.dist
def test_a_rank_killed_without_a_traceback_is_named_first():
    start = time.perf_counter()
    with pytest.raises(LaunchError) as caught:
        run(dies_without_a_traceback, 2, timeout=240)
    text = str(caught.value)
    assert time.perf_counter() - start < BOUND_S, text
    assert text.startswith("rank 1 failed first:\nthe process was killed by SIGKILL"), text


SCRIPT = """
import threading, time, torch
from opfuse import ops
from opfuse.cli.launch import run_here_or_spawn

def fn(rank, world):
    if rank == 1:
        threading.Thread(target=time.sleep, args=(600,), daemon=False).start()  # keeps the process alive
        time.sleep(0.5)
        raise ValueError("boom from rank 1 under torchrun")
    # Compiling waits for rank 1's program signature in the store (OPFUSE_PEER_TIMEOUT_MS, 10 minutes):
    # nothing that rank 1's teardown closes, unlike a gloo collective's connection.
    ops.Sequential(ops.Linear(8, 8, parallel="column"))(torch.ones(2, 8))

if __name__ == "__main__":
    run_here_or_spawn(fn, 2)
"""


@pytest.mark.dist
def test_a_failing_torchrun_rank_leaves_so_torchrun_stops_the_others(tmp_path):
    script = tmp_path / "fails.py"
    script.write_text(SCRIPT)
    start = time.perf_counter()
    result = subprocess.run(torchrun() + ["--standalone", "--nproc-per-node", "2", str(script)], cwd=ROOT, env=env(),
                            capture_output=True, text=True, timeout=240)
    elapsed = time.perf_counter() - start
    assert result.returncode != 0
    assert "ValueError: boom from rank 1 under torchrun" in result.stderr, result.stderr[-3000:]
    assert elapsed < BOUND_S + 10, (elapsed, result.stderr[-3000:])  # torchrun itself takes a few seconds
