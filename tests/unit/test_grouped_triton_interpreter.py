"""The Triton grouped-GEMM kernels under Triton's CPU interpreter (``TRITON_INTERPRET=1``), so their
index arithmetic (group lookup from device sizes, tail rows, empty groups, TMA and pointer loads,
the persistent kernels' tile map and work items, device-side descriptors) is checked on machines
without a GPU. Needs triton installed (skipped otherwise, e.g. on CI);
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
    from opfuse.families.grouped_linear import torch_mm, triton_impl as ti
    from opfuse.families.grouped_linear.reference import reference_forward, reference_backward

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
        torch_mm.zero_tail_rows(y, s)
        end = int(eff.sum())
        assert (y[:end] == 7).all() and (y[end:] == 0).all()
        dw = torch.full((groups, n, k), 5.0, dtype=dtype)
        torch_mm.zero_empty_groups(dw, s, tokens)
        for g in range(groups):
            assert (dw[g] == (5.0 if eff[g] > 0 else 0.0)).all()
    print("interpreter ok")
""")


PERSISTENT_SCRIPT = textwrap.dedent("""
    import torch
    import triton
    from triton.runtime import _allocation
    from opfuse.families.grouped_linear import persistent as P, tuning
    from opfuse.families.grouped_linear.persistent_kernels import grouped_tile_map_kernel
    from opfuse.families.grouped_linear.triton_impl import m_tile_bound

    def clamp(sizes, tokens):
        out, start = [], 0
        for c in sizes:
            end = min(start + max(c, 0), tokens)
            out.append((start, end))
            start = end
        return out

    def loop64(x, sizes, w, b, dy):
        # float64 loop of matmuls over the clamped row ranges (rows past them: zero).
        x, w, dy = x.double(), w.double(), dy.double()
        y, dx = x.new_zeros(x.shape[0], w.shape[1]), torch.zeros_like(x)
        dw, db = torch.zeros_like(w), x.new_zeros(w.shape[:2])
        for g, (s, e) in enumerate(clamp(sizes, x.shape[0])):
            y[s:e] = x[s:e] @ w[g].t() + (b[g].double() if b is not None else 0)
            dx[s:e], dw[g], db[g] = dy[s:e] @ w[g], dy[s:e].t() @ x[s:e], dy[s:e].sum(0)
        return y, dx, dw, db

    # The tile map: every group's rows and the tail, BM rows per m-tile, group-major.
    for sizes, tokens, bm in [([5, 0, 40, 17], 70, 16), ([0, 0], 9, 16), ([30, -2, 50], 64, 32), ([3] * 33, 100, 16)]:
        counts = torch.tensor(sizes, dtype=torch.int32)
        bound = m_tile_bound(tokens, len(sizes), bm)
        tile_map = torch.full((1 + 3 * bound,), -7, dtype=torch.int32)
        gp = triton.next_power_of_2(len(sizes) + 1)
        grouped_tile_map_kernel[(1,)](counts, tile_map, tokens, len(sizes), BM=bm, GP=gp, BLOCK=P._map_block(gp))
        ranges = clamp(sizes, tokens) + [(clamp(sizes, tokens)[-1][1], tokens)]
        want = [(g, s, e) for g, (s0, e) in enumerate(ranges) for s in range(s0, e, bm)]
        got = tile_map[1:1 + 3 * len(want)].view(-1, 3).tolist()
        assert tile_map[0].item() == len(want) and got == [list(t) for t in want], (sizes, got, want)

    cases = [  # tokens, groups, K, N, sizes, bias
        (40, 3, 48, 40, [10, 0, 25], True),             # empty middle group, 5 tail rows
        (37, 5, 40, 24, [0, 7, 0, 9, 21], False),       # odd T, K and N not tile multiples
        (64, 2, 32, 32, [0, 0], True),                  # every group empty: zeros everywhere
        (50, 3, 64, 64, [70, -4, 20], True),            # sum > T and a negative count: clamped
        (90, 4, 16, 56, [30, 30, 0, 30], False),        # several m-tiles per group
    ]
    configs = [tuning.Tiles(16, 16, 16, 4, 2), tuning.Tiles(32, 32, 32, 4, 3, group_m=2), None]
    for tokens, groups, k, n, sizes, bias in cases:
        dtype = torch.float16
        gen = torch.Generator().manual_seed(tokens * 7 + k)
        x = torch.randn(tokens, k, generator=gen).to(dtype)
        w = (torch.randn(groups, n, k, generator=gen) / k ** 0.5).to(dtype)
        b = torch.randn(groups, n, generator=gen).to(dtype) if bias else None
        dy = torch.randn(tokens, n, generator=gen).to(dtype)
        s = torch.tensor(sizes, dtype=torch.int32)
        nan = lambda *shape: torch.full(shape, float("nan"), dtype=dtype)
        want_y, want_dx, want_dw, want_db = loop64(x, sizes, w, b, dy)
        tol = dict(atol=2e-2, rtol=2e-2)
        for cfg in configs:
            y = P.grouped_mm_persistent(x, s, w, nk=True, bias=b, out=nan(tokens, n), config=cfg)
            dx = P.grouped_mm_persistent(dy, s, w, nk=False, out=nan(tokens, k), config=cfg)
            for name, got, want in (("y", y, want_y), ("dx", dx, want_dx)):
                torch.testing.assert_close(got.double(), want, **tol, msg=lambda m: f"{name} {sizes, cfg}: {m}")
        dw, db = P.grouped_wgrad_tma(dy, x, s, groups, need_db=bias, dw=nan(groups, n, k),
                                     db=nan(groups, n) if bias else None)
        torch.testing.assert_close(dw.double(), want_dw, **tol, msg=lambda m: f"dw {sizes}: {m}")
        if bias:
            torch.testing.assert_close(db.double(), want_db, **tol, msg=lambda m: f"db {sizes}: {m}")
        for g, (lo, hi) in enumerate(clamp(sizes, tokens)):
            if hi == lo:
                assert (dw[g] == 0).all(), (sizes, g)
        # The public entries (forward/backward as the dispatch calls them).
        y = P.forward(x, s, w, b)
        dx, dw2, db2 = P.backward(dy, x, s, w, need_dx=True, need_dw=True, need_db=bias)
        torch.testing.assert_close(y.double(), want_y, **tol)
        torch.testing.assert_close(dx.double(), want_dx, **tol)
        torch.testing.assert_close(dw2.double(), want_dw, **tol)
    # The launch-scoped allocator did not leak into the caller's context.
    assert _allocation._allocator.get() is _allocation._NULL_ALLOCATOR
    print("persistent interpreter ok")
""")

OLD_NUMPY = pytest.mark.skipif(tuple(int(p) for p in numpy.__version__.split(".")[:2]) >= (2, 3),
                               reason="triton's interpreter converts 1-element arrays to int, which numpy >= 2.3 "
                                      "refuses")


def _interpret(script: str, marker: str) -> None:
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0 and marker in done.stdout, done.stdout + done.stderr


@OLD_NUMPY
def test_kernels_under_the_triton_interpreter():
    _interpret(SCRIPT, "interpreter ok")


@OLD_NUMPY
def test_persistent_kernels_under_the_triton_interpreter():
    _interpret(PERSISTENT_SCRIPT, "persistent interpreter ok")
