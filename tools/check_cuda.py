#!/usr/bin/env python3
"""Compile and link every family's CUDA/C++ sources without a GPU (``make check-cuda``).

Prints the per-kernel register/spill report (ptxas -v) when ``--resources`` is given.
"""

import argparse
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from opfuse.runtime import extension  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--nvcc", default=None)
    parser.add_argument("--resources", action="store_true", help="print ptxas register/spill usage")
    parser.add_argument("--out", default=None, help="keep the built modules in this directory")
    args = parser.parse_args()
    extra = ["-Xptxas", "-v"] if args.resources else []
    for family in extension.families():
        start = time.time()
        with tempfile.TemporaryDirectory() as tmp:
            path = extension.build(family, args.out or tmp, nvcc=args.nvcc, extra_flags=extra)
            print(f"check-cuda: built {os.path.basename(path)} from {len(extension.sources(family))} sources "
                  f"in {time.time() - start:.0f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
