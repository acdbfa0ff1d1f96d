"""The Triton kernels of ``gated_activation`` under Triton's CPU interpreter (``TRITON_INTERPRET=1``):
forward and backward against the reference for every activation, odd widths, several rows and a
row stride wider than the value (a view). Needs triton and numpy (skipped otherwise, e.g. on CI);
runs in a subprocess because the interpreter is chosen when kernels are defined."""

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
    from opfuse.families.gated_activation import reference, triton_impl

    torch.manual_seed(0)
    for rows, n, dtype in [(1, 5, torch.float32), (7, 300, torch.float32), (70, 33, torch.float16),
                           (3, 1030, torch.float32)]:
        wide = torch.randn(rows, 2 * n + 6, dtype=torch.float32).to(dtype)
        y = wide[:, 3:3 + 2 * n]                      # a row stride wider than the value
        dout = torch.randn(rows, n, dtype=torch.float32).to(dtype)
        for activation in ("silu", "gelu", "gelu_tanh"):
            tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-3, rtol=2e-3)
            torch.testing.assert_close(triton_impl.forward(y, activation), reference.forward(y, activation), **tol)
            torch.testing.assert_close(triton_impl.backward(dout, y, activation),
                                       reference.backward(dout, y, activation), **tol)
    print("ok")
""")


def test_gated_activation_kernels_under_the_interpreter():
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=ROOT)
    done = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stdout + done.stderr
