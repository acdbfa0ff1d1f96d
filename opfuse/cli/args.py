"""Argument parsing for ``python -m opfuse ...``: errors are one line, never a usage dump or a
traceback, so a wrong flag reads like ``python -m opfuse dump: error: --world=0: expected ...``."""

from __future__ import annotations

import argparse
import sys

__all__ = ["Parser", "positive_int"]


class Parser(argparse.ArgumentParser):
    """``argparse.ArgumentParser`` whose errors print one line to stderr and exit with status 2."""

    def error(self, message: str):  # noqa: D401 - argparse's hook
        sys.stderr.write(f"{self.prog}: error: {message}\n")
        raise SystemExit(2)


def positive_int(text: str) -> int:
    """An ``argparse`` type: an integer >= 1 (names the value it rejects)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is not a positive integer (expected >= 1)")
    return value
