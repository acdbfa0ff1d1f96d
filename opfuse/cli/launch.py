"""Run a function in N spawned processes with a gloo (CPU) or NCCL (GPU) process group.

``run(fn, world, *args)`` starts ``world`` processes, each calling ``fn(rank, world, *args)``
after ``init_process_group``; an exception in any rank fails the caller with the traceback of the
rank that failed *first* (:class:`LaunchError`): a failing rank makes its peers fail too (gloo's
"connection reset"), and those are consequences, listed after it. A rank fails when ``fn``
raises, when one of its threads dies of an exception (the rank may keep running, waiting for
that thread's work, while its peers wait for it in a collective), and when its process ends with
a non-zero status without a traceback (a crash, a kill, ``os._exit``). Once a rank failed, the
others get a few seconds (:data:`FAILURE_GRACE_S`) to finish, then are stopped (they may wait for
the failed one forever: the process group's own timeout is minutes). ``fn`` must be importable
(module level): processes are spawned. Used by ``python -m opfuse demo/dump``, the benchmarks and
the distributed tests.

Under ``torchrun`` (``RANK``/``WORLD_SIZE``/``LOCAL_RANK`` set) the processes already exist:
:func:`run_here_or_spawn` joins torchrun's group in this process instead of spawning its own. A
failing rank there prints its traceback and exits at once (no barrier, no teardown of the group,
both of which wait for peers): its exit status is how torchrun learns to stop the others
(docs/guide_errors.md says what torchrun users of their own scripts set).
NCCL runs keep NVLink multicast off (``NCCL_NVLS_ENABLE=0``, ``TORCH_SYMM_MEM_DISABLE_MULTICAST=1``)
unless the caller's environment sets those variables.
"""

from __future__ import annotations

import os
import signal
import socket
import sys
import threading
import time
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from multiprocessing.connection import wait as wait_ready


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class LaunchError(AssertionError):
    """A spawned rank failed or hung."""


def _report_thread_errors(rank, errors) -> None:
    """An exception that ends a thread of this rank fails the rank (reported to the parent, which
    stops every rank), after the default hook printed it: the main thread may be waiting for that
    thread's work, and its peers for it, until the process group times out."""
    default = threading.excepthook

    def hook(exc):
        default(exc)
        if exc.exc_type is not SystemExit:
            text = "".join(traceback.format_exception(exc.exc_type, exc.exc_value, exc.exc_traceback))
            name = exc.thread.name if exc.thread is not None else "?"
            errors.put((time.time(), rank, f"in thread {name!r}:\n{text}"))

    threading.excepthook = hook


def _worker(rank, world, port, backend, fn, args, errors):
    _report_thread_errors(rank, errors)
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    ok = False
    try:
        if backend == "nccl":
            torch.cuda.set_device(rank)
            dist.init_process_group(backend, rank=rank, world_size=world, device_id=torch.device("cuda", rank))
        else:
            dist.init_process_group(backend, rank=rank, world_size=world)
        fn(rank, world, *args)
        ok = True
    except BaseException:  # noqa: BLE001 - reported to the parent
        errors.put((time.time(), rank, traceback.format_exc()))
    finally:
        try:
            if ok and dist.is_initialized():
                dist.barrier()  # nobody tears down while a peer still talks to it
                dist.destroy_process_group()
        except Exception:  # noqa: BLE001 - teardown problems must not mask the result
            pass
        sys.stdout.flush()
        sys.stderr.flush()
        # Skip interpreter teardown: gloo's background threads can abort the process at exit
        # ("terminate called without an active exception"), turning a passed run into a failure.
        os._exit(0 if ok else 1)


def default_backend() -> tuple[str, int]:
    """``("nccl", gpu_count)`` when this host has 2+ GPUs, else ``("gloo", 2)``."""
    if torch.cuda.is_available() and torch.cuda.device_count() >= 2:
        return "nccl", torch.cuda.device_count()
    return "gloo", 2


#: Seconds the other ranks get to finish (or report what the failure did to them) after one
#: failed, before they are stopped.
FAILURE_GRACE_S = 3.0


class _Watch:
    """The parent's view of its ranks: ``failures``, ``(time, rank, text)``, from the ranks'
    reports and from exits with an error status that no report explains."""

    def __init__(self, procs, errors):
        self.procs, self.errors = procs, errors
        self.failures: list = []
        self.silent: set = set()
        self.seen_alive = time.time()  # the last look: when ranks found dead next were still alive

    def look(self) -> None:
        # Exits first, then reports: a rank reports before it exits, so the report of a rank seen
        # dead here is already in the queue. A process's sentinel closes with its other files,
        # sockets included, so no peer saw it gone before the last look that found it open: that
        # look is a silent death's time, earlier than any failure it caused.
        looked = time.time()
        ended = set(wait_ready([p.sentinel for p in self.procs], timeout=0))
        while not self.errors.empty():
            self.failures.append(self.errors.get())
        reported = {rank for _, rank, _ in self.failures}
        for rank, proc in enumerate(self.procs):
            if proc.sentinel in ended and rank not in reported and rank not in self.silent:
                proc.join(timeout=5)  # reap it: its exit status
                if proc.exitcode:
                    self.silent.add(rank)
                    self.failures.append((self.seen_alive, rank, _exit_text(proc.exitcode)))
        self.seen_alive = looked


def _exit_text(code: int) -> str:
    """What a rank's exit status says when the rank reported no Python traceback."""
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return f"the process was killed by {name} (no Python traceback: a crash, the OOM killer, a kill)"
    return f"the process exited with status {code} without a Python traceback (os._exit, a crash in native code)"


def _last_line(text: str) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return lines[-1] if lines else text


def run(fn, world: int, *args, backend: str = "gloo", timeout: float = 300.0) -> None:
    """Spawn ``world`` processes, each running ``fn(rank, world, *args)`` in a ``backend`` group;
    raises :class:`LaunchError` when a rank fails or does not finish within ``timeout`` seconds."""
    if backend == "nccl" and torch.cuda.device_count() < world:
        raise LaunchError(f"world={world} needs {world} GPUs for NCCL, this host has {torch.cuda.device_count()}")
    ctx = mp.get_context("spawn")
    errors = ctx.SimpleQueue()  # put() writes through before the worker's os._exit
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(r, world, port, backend, fn, args, errors)) for r in range(world)]
    for proc in procs:
        proc.start()
    watch = _Watch(procs, errors)
    deadline = time.monotonic() + timeout
    stop_at = deadline
    while any(p.is_alive() for p in procs) and time.monotonic() < stop_at:
        watch.look()
        if watch.failures:
            stop_at = min(stop_at, time.monotonic() + FAILURE_GRACE_S)
        time.sleep(0.05)
    watch.look()  # ranks that ended since the last look
    alive = [p for p in procs if p.is_alive()]
    for proc in alive:
        proc.kill()
    for proc in procs:
        proc.join()
    failures = watch.failures
    while not errors.empty():
        failures.append(errors.get())
    if failures:
        failures.sort()
        _, rank, text = failures[0]
        later = "".join(f"\nthen rank {r} failed: {_last_line(t)}" for _, r, t in failures[1:])
        stopped = f"\nranks stopped after it: {sorted(procs.index(p) for p in alive)}" if alive else ""
        raise LaunchError(f"rank {rank} failed first:\n{text}{later}{stopped}")
    if alive:
        raise LaunchError(f"{len(alive)} rank(s) did not finish within {timeout}s (deadlock?)")
    bad = [p.exitcode for p in procs if p.exitcode != 0]
    if bad:
        raise LaunchError(f"ranks exited with codes {bad}")


# torchrun ---------------------------------------------------------------------------------------

_TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK")


def torchrun_world() -> int | None:
    """``WORLD_SIZE`` when this process was started by ``torchrun`` (its rank variables are set),
    else ``None``."""
    if all(name in os.environ for name in _TORCHRUN_VARS):
        return int(os.environ["WORLD_SIZE"])
    return None


def torchrun_backend() -> str:
    """NCCL when every local rank of this torchrun job has its own GPU, else gloo on the CPU."""
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("WORLD_SIZE", "1")))
    if torch.cuda.is_available() and torch.cuda.device_count() >= local_world:
        return "nccl"
    return "gloo"


def run_in_torchrun(fn, *args, backend: str) -> None:
    """Run ``fn(rank, world, *args)`` in this process, in the group torchrun's environment
    describes (``MASTER_ADDR``/``MASTER_PORT``), and tear the group down afterwards."""
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if backend == "nccl":
        local = int(os.environ["LOCAL_RANK"])
        torch.cuda.set_device(local)
        dist.init_process_group("nccl", device_id=torch.device("cuda", local))
    else:
        dist.init_process_group("gloo")
    try:
        fn(rank, world, *args)
    except SystemExit as done:
        if done.code not in (None, 0):
            _leave(done.code if isinstance(done.code, int) else 1)
    except BaseException:  # noqa: BLE001 - printed, then this rank leaves
        traceback.print_exc()
        _leave(1)
    dist.barrier()  # nobody tears down while a peer still talks to it
    dist.destroy_process_group()


def _leave(code: int) -> None:
    """End this torchrun rank now: the barrier and the group's teardown would wait for peers that
    may be blocked in a collective with it (NCCL's teardown waits for its pending work), and
    threads still running would keep the process alive; its exit is what tells torchrun to stop
    the others."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def run_here_or_spawn(fn, world: int, *args, backend: str = "gloo", timeout: float = 300.0) -> None:
    """:func:`run_in_torchrun` when started by torchrun, else :func:`run` (spawn ``world``
    processes). Under torchrun, ``world`` must equal torchrun's ``WORLD_SIZE``."""
    joined = torchrun_world()
    if joined is None:
        run(fn, world, *args, backend=backend, timeout=timeout)
        return
    if world != joined:
        raise LaunchError(f"--world={world} but torchrun started {joined} processes (WORLD_SIZE={joined}); "
                          f"leave --world out under torchrun")
    run_in_torchrun(fn, *args, backend=backend)
