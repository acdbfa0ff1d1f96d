"""The Triton kernels of the FP8 grouped weight gradient's operands
(``kernels.quantize_group_columns``: per-group column amax, then the transposed cast into the padded
token layout) under Triton's CPU interpreter (``TRITON_INTERPRET=1``), against the reference
:func:`opfuse.fp8.grouped.group_columns_operand`: empty groups, sizes past the tokens, negative
sizes, one group larger than the amax kernel's slices, widths off the tile. Needs triton and numpy
(skipped otherwise, e.g. on CI); runs in a subprocess because the interpreter is chosen when
kernels are defined. The interpreter's own FP8 conversion rounds some values one E4M3 step away
from a GPU's and drops the carry of a value rounding up to a power of two (the existing cast
kernels show the same), so the values are compared up to that and the zeros (padding, empty
columns) exactly; tests/gpu compares the bytes exactly."""

import os
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("triton")
pytest.importorskip("numpy")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

SCRIPT = textwrap.dedent("""
    import torch
    from opfuse.fp8 import grouped
    from opfuse.families.quantize import kernels

    torch.manual_seed(0)
    for sizes, tokens, cols in [([5, 0, 37, 100], 150, 200), ([0, 0, 3], 10, 48), ([600, 1, 17], 630, 130),
                                ([50, 60], 100, 64), ([-3, 40, 200], 120, 32), ([0], 8, 16)]:
        group_sizes = torch.tensor(sizes)
        t = (torch.randn(tokens, cols) * torch.logspace(-3, 2, cols)).to(torch.bfloat16)
        t[:, 5] = 0                                   # a column without an amax
        want = grouped.group_columns_operand(t, group_sizes)
        got = kernels._group_columns_triton(t, group_sizes, grouped.padded_group_ends(group_sizes, tokens))
        assert got.data.shape == want.data.shape and got.data.shape[1] % grouped.TOKEN_ALIGN == 0
        assert torch.equal(got.scale_inv, want.scale_inv), sizes
        a, b = want.data.float(), got.data.float()
        assert torch.equal(a == 0, b == 0), sizes
        one_step = (a - b).abs() <= torch.maximum(a.abs(), b.abs()) / 8
        carry_lost = (2 * b == a) & (torch.frexp(a)[0].abs() == 0.5)  # rounded up to a power of two on a GPU
        assert bool((one_step | carry_lost).all()), sizes
        assert (a != b).float().mean() < 0.05, sizes
    print("ok")
""")


def test_group_column_quantizer_under_the_interpreter():
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=ROOT)
    done = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stdout + done.stderr
