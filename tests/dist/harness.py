"""Spawned-process harness for the distributed tests (the package's launcher)."""

from opfuse.cli.launch import run  # noqa: F401
