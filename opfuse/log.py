"""opfuse's log: why a call was slow.

Everything goes through the standard :mod:`logging` hierarchy under ``"opfuse"``
(``opfuse.build``, ``opfuse.pool``, ``opfuse.dispatch``, ``opfuse.compile``). Quiet by default:
only warnings, through whatever handlers the application configured. ``OPFUSE_LOG=info`` (or
``opfuse.config.log = "info"``) prints, on stderr and prefixed with the process's rank, the
events that cost time:

* the first-use nvcc build of the CUDA extension (start, end, seconds),
* growth of a symmetric-memory pool,
* a fused op falling back to a slower implementation (which one ran, and why the faster ones
  were skipped),
* a block recompiled (the reason: new input signature, changed settings, ...).

``OPFUSE_LOG=debug`` adds extension cache hits and every implementation choice. An application
that configures ``logging`` itself can ignore the setting and attach handlers to ``"opfuse"``.

Example::

    $ OPFUSE_LOG=info python train.py
    opfuse[rank 0] INFO opfuse.dispatch: allreduce_add_norm: running reference; skipped cuda_oneshot (no CUDA device)
"""

from __future__ import annotations

import logging
import sys
import time
from typing import Callable, Iterable, TypeVar

from .config import config

__all__ = ["logger", "get_logger", "extension_build", "extension_cached", "pool_growth", "fallback",
           "recompile", "LEVELS"]

#: ``OPFUSE_LOG`` value -> logging level.
LEVELS = {"warning": logging.WARNING, "info": logging.INFO, "debug": logging.DEBUG}

logger = logging.getLogger("opfuse")
_T = TypeVar("_T")
_applied: str | None = None
_handler: logging.Handler | None = None


class _RankFilter(logging.Filter):
    """Adds ``record.rank``: the process's rank when torch.distributed is initialised, else ``-``."""

    def filter(self, record: logging.LogRecord) -> bool:
        rank = "-"
        try:
            import torch.distributed as dist

            if dist.is_available() and dist.is_initialized():
                rank = str(dist.get_rank())
        except Exception:  # noqa: BLE001 - a log line must never fail the caller
            pass
        record.rank = rank
        return True


class _StderrHandler(logging.StreamHandler):
    """Writes to whatever ``sys.stderr`` is at the time of the record (redirections and test
    capture replace it after the handler was made)."""

    def __init__(self):
        super().__init__(sys.stderr)

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, value):  # StreamHandler.__init__ assigns it; the property always answers
        pass


def _sync() -> None:
    """Apply ``config.log`` when it changed: the level of the ``opfuse`` logger, and our stderr
    handler while the level is below warning (the default adds nothing, as a library should)."""
    global _applied, _handler
    wanted = config.log
    if wanted == _applied:
        return
    _applied = wanted
    level = LEVELS[wanted]
    logger.setLevel(level)
    if level < logging.WARNING and _handler is None:
        _handler = _StderrHandler()
        _handler.addFilter(_RankFilter())
        _handler.setFormatter(logging.Formatter("opfuse[rank %(rank)s] %(levelname)s %(name)s: %(message)s"))
        logger.addHandler(_handler)
        logger.propagate = False  # the lines would print twice with a configured root logger
    elif level >= logging.WARNING and _handler is not None:
        logger.removeHandler(_handler)
        _handler = None
        logger.propagate = True


def get_logger(part: str) -> logging.Logger:
    """The logger ``opfuse.<part>``, with ``OPFUSE_LOG`` applied."""
    _sync()
    return logger.getChild(part)


def extension_build(path: str, build: Callable[[], _T]) -> _T:
    """Run ``build()`` (the nvcc build of the CUDA extension into ``path``), logging its start,
    its end and how long it took (INFO): the one slow first call a GPU host sees."""
    log = get_logger("build")
    log.info("building the CUDA extension with nvcc (first use on this host; cached afterwards): %s", path)
    start = time.perf_counter()
    try:
        result = build()
    except Exception as error:
        log.warning("CUDA extension build failed after %.1f s: %s", time.perf_counter() - start,
                    str(error).splitlines()[0] if str(error) else type(error).__name__)
        raise
    log.info("built the CUDA extension in %.1f s", time.perf_counter() - start)
    return result


def extension_cached(path: str) -> None:
    """The extension was already built for these sources (DEBUG)."""
    get_logger("build").debug("CUDA extension cache hit: %s", path)


def pool_growth(group: str, added_mb: float, total_mb: float, limit_mb: float, reason: str = "") -> None:
    """A symmetric-memory pool grew by a segment (INFO): the allocation and rendezvous cost a
    collective on every rank of ``group``."""
    get_logger("pool").info("symmetric pool of group %s grew by %.0f MiB to %.0f MiB (limit %.0f MiB)%s",
                            group, added_mb, total_mb, limit_mb, f": {reason}" if reason else "")


def fallback(op: str, chosen: str, skipped: Iterable[tuple[str, str]]) -> None:
    """Implementation choice for fused op ``op``: ``chosen`` runs, ``skipped`` lists the
    ``(implementation, reason)`` pairs tried before it. INFO when faster ones were skipped (a
    fallback), DEBUG when the first choice runs."""
    skipped = list(skipped)
    log = get_logger("dispatch")
    if skipped:
        why = "; ".join(f"{name} ({reason})" for name, reason in skipped)
        log.info("%s: running %s; skipped %s", op, chosen, why)
    else:
        log.debug("%s: running %s (first choice)", op, chosen)


def recompile(block: str, reason: str) -> None:
    """A block was compiled again (INFO): ``reason`` says what changed (new input signature,
    settings, rules...). Each compile runs the pass pipeline, and possibly collectives."""
    get_logger("compile").info("compiling %s: %s", block, reason)
