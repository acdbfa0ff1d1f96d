#!/usr/bin/env python3
"""Run the Python code blocks of README.md and docs/*.md, as CI does (tests/unit/test_docs.py).

A document's ```python blocks run in order, in one namespace (a later block may use what an earlier
one defined), in a fresh process whose working directory is a scratch directory. A block preceded by
a line ``<!-- skip: reason -->`` does not run (for what needs GPUs, several processes or torchrun);
every skip names its reason. A fenced block with the info string ``output`` right after a Python
block is what that block prints: the runner compares them, where a line ``...`` stands for any
lines and ``...`` inside a line for any text.

    python3 tools/doc_blocks.py docs/EXTENDING.md      # run one document's blocks, report
"""

from __future__ import annotations

import dataclasses
import io
import os
import re
import sys
import tempfile
import traceback
from contextlib import redirect_stdout

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FENCE = re.compile(r"^```([\w-]*)[^\n]*\n(.*?)^```[ \t]*$", re.S | re.M)
SKIP = re.compile(r"<!--\s*skip:\s*(.*?)\s*-->\s*$")


@dataclasses.dataclass
class Block:
    """One ```python block: its code, its first line in the document, why it is skipped (if it
    is) and the ```output block after it (if any)."""

    code: str
    line: int
    skip: str | None = None
    output: str | None = None


def documents() -> list[str]:
    """README.md and every docs/*.md, relative to the repository root."""
    docs = sorted(os.path.join("docs", f) for f in os.listdir(os.path.join(ROOT, "docs")) if f.endswith(".md"))
    return ["README.md", *docs]


def blocks(path: str) -> list[Block]:
    """The Python blocks of ``path`` (relative to the repository root)."""
    with open(os.path.join(ROOT, path)) as handle:
        text = handle.read()
    found: list[Block] = []
    previous_end = 0
    for match in FENCE.finditer(text):
        lang, body = match.group(1), match.group(2)
        line = text.count("\n", 0, match.start()) + 2
        between = text[previous_end:match.start()]
        previous_end = match.end()
        if lang == "python":
            before = text[:match.start()].rstrip("\n").rsplit("\n", 1)[-1]
            skip = SKIP.match(before.strip())
            found.append(Block(body, line, skip.group(1) if skip else None))
        elif lang == "output" and found and not between.strip():
            found[-1].output = body
    return found


def _line_matches(pattern: str, line: str) -> bool:
    parts = [re.escape(p) for p in pattern.split("...")]
    return re.fullmatch(".*".join(parts), line) is not None


def output_matches(expected: str, got: str) -> bool:
    """``got`` is ``expected``, where a line ``...`` matches any lines (none included) and ``...``
    inside a line any text; trailing white space is ignored."""
    want = [line.rstrip() for line in expected.rstrip("\n").split("\n")]
    have = [line.rstrip() for line in got.rstrip("\n").split("\n")] if got.strip() else []

    def match(i: int, j: int) -> bool:
        if i == len(want):
            return j == len(have)
        if want[i] == "...":
            return any(match(i + 1, k) for k in range(j, len(have) + 1))
        return j < len(have) and _line_matches(want[i], have[j]) and match(i + 1, j + 1)

    return match(0, 0)


def run(path: str) -> list[str]:
    """Run the blocks of ``path`` here (in this process); returns a report line per block, raises
    ``AssertionError`` naming the block on the first failure."""
    report = []
    namespace: dict = {"__name__": "__main__"}
    for block in blocks(path):
        where = f"{path}:{block.line}"
        if block.skip is not None:
            report.append(f"{where}: skipped ({block.skip})")
            continue
        printed = io.StringIO()
        try:
            with redirect_stdout(printed):
                # Padded so that tracebacks and the file:line opfuse records name the document's lines.
                code = compile("\n" * (block.line - 1) + block.code, path, "exec")
                exec(code, namespace)  # noqa: S102 - the repository's own docs
        except Exception:  # noqa: BLE001 - reported with the block's place
            raise AssertionError(f"{where}: the block raised\n{traceback.format_exc()}\n{printed.getvalue()}") from None
        if block.output is not None and not output_matches(block.output, printed.getvalue()):
            raise AssertionError(f"{where}: the block printed\n{printed.getvalue()}\nthe document shows\n{block.output}")
        report.append(f"{where}: ran" + (", output as shown" if block.output is not None else ""))
    return report


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print(__doc__)
        return 2
    path = os.path.relpath(os.path.abspath(argv[0]), ROOT) if os.path.exists(argv[0]) else argv[0]
    with tempfile.TemporaryDirectory() as scratch:
        os.chdir(scratch)
        try:
            for line in run(path):
                print(line)
        except AssertionError as error:
            print(error)
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
