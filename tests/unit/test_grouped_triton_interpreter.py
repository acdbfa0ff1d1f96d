"""The Triton grouped-GEMM kernels under Triton's CPU interpreter (``TRITON_INTERPRET=1``), so their
index arithmetic (group lookup from device sizes, tail rows, empty groups, TMA and pointer loads)
is checked on machines without a GPU. Needs triton installed (skipped otherwise, e.g. on CI);
bfloat16 is left to tests/gpu because the interpreter's bfloat16 dot is not exact. Runs in a
subprocess: the interpreter is chosen when kernels are defined."""

import os
import subprocess
import sys
import textwrap

import pytest

triton = pytest.importorskip("triton")
numpy = pytest.importorskip("numpy")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

SCRIPT = textwrap.dedent("""
    import torch
    from opfuse.backend.grouped_linear import torch_mm, triton_impl as ti
    from opfuse.backend.grouped_linear.reference import reference_forward, reference_backward

    def clamp(sizes, tokens):
        out, start = [], 0
        for c in sizes:
            end = min(start + max(c, 0), tokens)
            out.append(end - start)
            start = end
        return torch.tensor(out)

    cases = [  # tokens, groups, K, N, sizes, dtype, bias
        (40, 3, 48, 40, [10, 0, 25], torch.float32, True),
        (37, 4, 20, 24, [0, 17, 3, 17], torch.float32, False),
        (64, 2, 32, 32, [0, 0], torch.float32, True),
        (300, 3, 96, 64, [129, 0, 150], torch.float32, True),
        (50, 3, 64, 64, [70, -4, 20], torch.float32, True),     # sum > T: clamped
        (130, 2, 64, 48, [100, 30], torch.float16, True),
        (33, 5, 40, 24, [7, 0, 9, 8, 9], torch.float16, False),
    ]
    for tokens, groups, k, n, sizes, dtype, bias in cases:
        gen = torch.Generator().manual_seed(tokens)
        x = torch.randn(tokens, k, generator=gen).to(dtype)
        w = (torch.randn(groups, n, k, generator=gen) / k ** 0.5).to(dtype)
        b = torch.randn(groups, n, generator=gen).to(dtype) if bias else None
        dy = torch.randn(tokens, n, generator=gen).to(dtype)
        s = torch.tensor(sizes, dtype=torch.int32)
        eff = clamp(sizes, tokens)
        nan = lambda *shape: torch.full(shape, float("nan"), dtype=dtype)
        want_y = reference_forward(x, eff, w, b)
        want = reference_backward(dy, x, eff, w, need_dx=True, need_dw=True, need_db=bias)
        tol = dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
        for tma in (False, True):
            y = ti.grouped_mm(x, s, w, nk=True, bias=b, use_tma=tma, out=nan(tokens, n))
            dx = ti.grouped_mm(dy, s, w, nk=False, use_tma=tma, out=nan(tokens, k))
            dw, db = ti.grouped_wgrad(dy, x, s, groups, need_db=bias, dw=nan(groups, n, k),
                                      db=nan(groups, n) if bias else None)
            got = [y, dx, dw] + ([db] if bias else [])
            for name, g, r in zip(["y", "dx", "dw", "db"], got, [want_y, *want]):
                torch.testing.assert_close(g.float(), r.float(), **tol,
                                           msg=lambda m: f"{name} {tokens, sizes, dtype, tma}: {m}")
        y = torch.full((tokens, n), 7.0, dtype=dtype)
        torch_mm._zero_tail_rows(y, s)
        end = int(eff.sum())
        assert (y[:end] == 7).all() and (y[end:] == 0).all()
        dw = torch.full((groups, n, k), 5.0, dtype=dtype)
        torch_mm._zero_empty_groups(dw, s, tokens)
        for g in range(groups):
            assert (dw[g] == (5.0 if eff[g] > 0 else 0.0)).all()
    print("interpreter ok")
""")


@pytest.mark.skipif(tuple(int(p) for p in numpy.__version__.split(".")[:2]) >= (2, 3),
                    reason="triton's interpreter converts 1-element arrays to int, which numpy >= 2.3 refuses")
def test_kernels_under_the_triton_interpreter():
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    done = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0 and "interpreter ok" in done.stdout, done.stdout + done.stderr
