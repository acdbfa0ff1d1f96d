"""Command line: ``python -m opfuse {demo, dump, doctor, bench}``."""

from __future__ import annotations

import os
import runpy
import sys

USAGE = """usage: python -m opfuse COMMAND [options]

commands:
  demo     tensor-parallel MLP block (2 gloo processes, or all local GPUs over NCCL), forward and
           backward, checked against the unsharded float64 reference
  dump     the demo block's graph before and after fusion (--format python|text|dot|html)
  doctor   what this machine offers opfuse: torch, CUDA, nvcc, extension, settings, rules, implementations
  bench    run a benchmark from bench/ (python -m opfuse bench NAME [args]); no NAME lists them
"""


def _bench(argv) -> int:
    root = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench")
    names = sorted(f[:-3] for f in os.listdir(root) if f.endswith(".py")) if os.path.isdir(root) else []
    if not argv or argv[0] not in names:
        print("benchmarks: " + (", ".join(names) if names else "none (bench/ lives in the source checkout)"))
        return 0 if not argv else 2
    sys.argv = [os.path.join(root, argv[0] + ".py")] + list(argv[1:])
    runpy.run_path(sys.argv[0], run_name="__main__")
    return 0


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
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
    print(f"opfuse: unknown command {command!r}\n\n{USAGE}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
