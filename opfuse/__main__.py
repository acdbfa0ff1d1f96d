"""Command line: ``python -m opfuse {demo, dump, doctor, bench}`` and ``--version``."""

from __future__ import annotations

import importlib.util
import os
import runpy
import sys

USAGE = """usage: python -m opfuse COMMAND [options]      (python -m opfuse --version)

commands:
  demo     tensor-parallel MLP block (2 gloo processes, or all local GPUs over NCCL; under
           torchrun, torchrun's processes), forward and backward, checked against the unsharded
           float64 reference
  dump     the demo block's graph before and after fusion (--format python|text|dot|html, -o FILE)
  doctor   what this machine offers opfuse: torch, CUDA, nvcc, extension, settings, rules, implementations
  bench    run a benchmark from bench/ (python -m opfuse bench NAME [args]); no NAME lists them
"""

_BENCH_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench")


def _benchmarks() -> dict:
    """bench/common.py's BENCHMARKS (bench/ lives in the source checkout, not in the wheel)."""
    path = os.path.join(_BENCH_DIR, "common.py")
    if not os.path.isfile(path):
        return {}
    spec = importlib.util.spec_from_file_location("opfuse_bench_common", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.BENCHMARKS


def _bench(argv) -> int:
    benchmarks = _benchmarks()
    if not argv or argv[0] in ("-h", "--help"):
        if not benchmarks:
            print("benchmarks: none (bench/ lives in the source checkout)")
        else:
            print("benchmarks (python -m opfuse bench NAME [--help | options]):")
            for name, (gpus, what) in benchmarks.items():
                need = "CPU" if gpus == 0 else f"{gpus}+ GPU" + ("s" if gpus > 1 else "")
                print(f"  {name:<16} {what} [{need}]")
        return 0
    if argv[0] not in benchmarks:
        print(f"opfuse bench: unknown benchmark {argv[0]!r}; accepted: {', '.join(benchmarks) or 'none'}",
              file=sys.stderr)
        return 2
    script = os.path.join(_BENCH_DIR, argv[0] + ".py")
    sys.argv = [script] + list(argv[1:])
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as done:  # the benchmark's own exit status
        return done.code if isinstance(done.code, int) else (0 if done.code is None else 1)
    return 0


def _version() -> str:
    import torch

    from . import __version__

    return f"opfuse {__version__} (torch {torch.__version__}, python {sys.version.split()[0]})"


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0
    if argv[0] in ("-V", "--version"):
        print(_version())
        return 0
    command, rest = argv[0], argv[1:]
    from .cli.launch import LaunchError

    try:
        if command == "demo":
            from .cli.demo import main_demo

            return main_demo(rest)
        if command == "dump":
            from .cli.demo import main_dump

            return main_dump(rest)
        if command == "doctor":
            from .cli.doctor import main_doctor

            return main_doctor(rest)
        if command == "bench":
            return _bench(rest)
    except LaunchError as error:
        print(f"opfuse {command}: {error}", file=sys.stderr)
        return 1
    print(f"opfuse: unknown command {command!r}; accepted: demo, dump, doctor, bench (python -m opfuse --help)",
          file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
