"""The documentation runs and is current: every ```python block of README.md and docs/*.md runs in CI
(tools/doc_blocks.py; blocks that need GPUs, torchrun or several processes are marked with their
reason), the outputs the docs show are what the code prints, docs/reference.md's tables are the
registries', the README stays short, and every OPFUSE_* variable opfuse reads is documented."""

import os
import re
import subprocess
import sys

import pytest

from .tools_support import ROOT, load_tool

doc_blocks = load_tool("doc_blocks")
ENV = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")


@pytest.mark.parametrize("path", [p for p in doc_blocks.documents() if doc_blocks.blocks(p)])
def test_code_blocks_run_and_print_what_the_docs_show(path):
    result = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "doc_blocks.py"), path], cwd=ROOT, env=ENV,
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    ran = [line for line in result.stdout.splitlines() if ": ran" in line]
    assert ran, result.stdout


def test_skipped_blocks_name_their_reason_and_are_few():
    skipped = [(path, block) for path in doc_blocks.documents() for block in doc_blocks.blocks(path)
               if block.skip is not None]
    assert all(len(block.skip) > 10 for _, block in skipped), skipped
    assert len(skipped) <= 4, [f"{path}:{block.line}" for path, block in skipped]


def test_the_readme_is_short_and_its_samples_run():
    with open(os.path.join(ROOT, "README.md")) as handle:
        lines = handle.read().splitlines()
    assert len(lines) <= 150
    blocks = doc_blocks.blocks("README.md")
    assert len(blocks) == 2 and all(b.skip is None and b.output for b in blocks)


def test_output_matching():
    match = doc_blocks.output_matches
    assert match("a\nb\n", "a\nb")
    assert match("a [...rules.py:...] z", "a [/x/opfuse/rules.py:93] z")
    assert match("first\n...\nlast", "first\nx\ny\nlast") and match("first\n...\nlast", "first\nlast")
    assert not match("a\nb", "a\nc") and not match("a", "a\nb")


def test_reference_tables_are_current():
    result = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "reference_tables.py")], cwd=ROOT, env=ENV,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    with open(os.path.join(ROOT, "docs", "reference.md")) as handle:
        text = handle.read()
    assert result.stdout.strip() in text, "docs/reference.md: run python3 tools/reference_tables.py --write"
    assert len(re.findall(r"^\| \d+ \| `\w+` \|", text, re.M)) >= 18  # every rule


def _variables_read() -> set[str]:
    """``OPFUSE_*`` names in quotes in opfuse/, bench/, tools/ and tests/ (what code reads), and the
    settings' variables."""
    import opfuse
    from opfuse.config import env_name

    found = {env_name(field) for field in opfuse.config.__dataclass_fields__}
    pattern = re.compile(r"[\"'](OPFUSE_[A-Z_]+)[\"']")
    for top in ("opfuse", "bench", "tools", "tests"):
        for folder, dirs, files in os.walk(os.path.join(ROOT, top)):
            dirs[:] = [d for d in dirs if d not in ("node_modules", "__pycache__")]
            for name in files:
                if name.endswith((".py", ".sh")):
                    with open(os.path.join(folder, name)) as handle:
                        found.update(pattern.findall(handle.read()))
    return {name for name in found if not name.endswith("_")}


def test_every_opfuse_variable_is_documented_in_the_guide():
    with open(os.path.join(ROOT, "docs", "guide.md")) as handle:
        guide = handle.read()
    missing = sorted(name for name in _variables_read() if f"`{name}" not in guide)
    assert not missing, f"docs/guide.md, Settings: document {missing}"
