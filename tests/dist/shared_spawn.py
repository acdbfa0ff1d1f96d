"""Several tests' spawned cases run in one group of processes per world size (the ``shared_spawn``
fixture of tests/dist/conftest.py).

On 2 CPU cores most of a small distributed test's time is starting its ranks (importing torch and
opfuse) and the first ``torch.compile`` in each of them, not the case itself. A test module that
lists its cases in ``SHARED_CASES`` (``(fn, world, args)`` per test, ``fn(rank, world, *args)`` as
:func:`opfuse.cli.launch.run` calls it) has them run one after the other in a single spawn per world,
the first time one of its tests asks. Each rank leaves a marker file after each case it finished
without an exception; a test passes on its case's markers from every rank. Any case without all its
markers (it failed, or an earlier case failed and stopped the spawn) runs alone, as the test always
did (``run(fn, world, *args)``), so a failing test fails with its own case's error, and only a case
that ran to its end on every rank counts as passed.

Between cases each rank starts from what a fresh process would have: Dynamo's caches reset, the
torch.compile backend's record of settings agreed per group cleared (the ranks check their settings
again, as at a first compile), torch's default generator re-seeded with its start-up seed; the ranks
meet in a barrier before each case.

When only some of a module's tests are selected (``-k``, a node id), each of them spawns alone.

The ``session_spawn`` fixture does the same over modules: the ``SESSION_CASES`` of every module whose
tests use it (Sequential front-end tests, no torch.compile) run in one spawn per world for the
whole session, in the order of the tests; when only some of those tests are selected, each spawns
alone.
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist

from opfuse.cli.launch import LaunchError, run

#: How long one world's shared spawn may take before its cases are run alone (a deadlock).
SHARED_TIMEOUT_S = 900.0


def _marker(folder: str, world: int, index: int, rank: int) -> str:
    return os.path.join(folder, f"world{world}-case{index}.rank{rank}")


def _fresh_process_state(seed: int) -> None:
    """What a fresh rank starts from, for the next case (see the module docstring)."""
    if "torch._dynamo" in sys.modules:
        torch._dynamo.reset()
    agree = sys.modules.get("opfuse.torch_compile.agree")
    if agree is not None:
        agree._agreed.clear()
    torch.manual_seed(seed)


def run_cases(rank, world, folder, cases):
    """The spawned ranks' side: ``cases`` (``(index, fn, args)``) in order, a marker after each."""
    seed = torch.initial_seed()
    for index, fn, args in cases:
        _fresh_process_state(seed)
        dist.barrier()
        fn(rank, world, *args)
        with open(_marker(folder, world, index, rank), "w"):
            pass


class SharedSpawn:
    """Planned cases (``(fn, world, args)``, one per test) and the spawns that ran them."""

    def __init__(self, planned: list, selected: int, folder: str):
        self.planned = [(fn, world, tuple(args)) for fn, world, args in planned]
        # Only when every planned case's test runs in this session (one test per case).
        self.enabled = selected == len(self.planned)
        self.folder = folder
        self.ran: dict[int, str | None] = {}  # world -> the shared spawn's error (None: every case finished)

    def _run_world(self, world: int) -> None:
        cases = [(index, fn, args) for index, (fn, w, args) in enumerate(self.planned) if w == world]
        try:
            run(run_cases, world, self.folder, cases, timeout=SHARED_TIMEOUT_S)
            self.ran[world] = None
        except LaunchError as error:  # the cases without markers run alone, each in its test
            self.ran[world] = str(error)

    def finished(self, fn, world: int, *args) -> bool:
        """Whether ``fn(rank, world, *args)`` ran to its end on every rank of the shared spawn (run
        first if it has not been yet)."""
        key = (fn, world, tuple(args))
        if not self.enabled or key not in self.planned:
            return False
        if world not in self.ran:
            self._run_world(world)
        index = self.planned.index(key)
        return all(os.path.exists(_marker(self.folder, world, index, rank)) for rank in range(world))

    def run(self, fn, world: int, *args, timeout: float = 300.0) -> None:
        """Like :func:`opfuse.cli.launch.run`: passes when the case finished on every rank of the
        shared spawn, else spawns it alone (its failure is then the test's)."""
        if not self.finished(fn, world, *args):
            run(fn, world, *args, timeout=timeout)
