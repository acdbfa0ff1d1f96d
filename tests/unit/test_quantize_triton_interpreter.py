"""Triton quantizer kernels under Triton's CPU interpreter (``TRITON_INTERPRET=1``), so their index
arithmetic is checked on hosts without a GPU: the FP8 grouped weight gradient's operands
(``kernels.quantize_group_columns``: per-group column amax, then the transposed cast into the padded
token layout) against :func:`opfuse.fp8.grouped.group_columns_operand` (empty groups, sizes past
the tokens, negative sizes, one group larger than the amax kernel's slices, widths off the tile),
the one-read power-of-two weight quantizer over a stack of expert weights
(``weight_pow2.quantize_stack``) and one matrix, through right and wrong hints, and the per-row
quantizer in both its forms.

Needs triton and numpy (skipped otherwise, e.g. on CI); each check runs in a subprocess because
the interpreter is chosen when kernels are defined. The interpreter's own FP8 conversion rounds
some values one E4M3 step away from a GPU's and drops the carry of a value rounding up to a power
of two (the older cast kernels show the same), so bytes are compared up to that, scales, hints and
zeros exactly; tests/gpu compares the bytes exactly."""

import os
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("triton")
pytest.importorskip("numpy")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

CLOSE = textwrap.dedent("""
    import torch

    def close(want, got):
        # within one E4M3 step (or one subnormal step), or the carry into the exponent dropped
        a, b = want.float(), got.float()
        one_step = (a - b).abs() <= torch.maximum(torch.maximum(a.abs(), b.abs()) / 8, torch.tensor(2.0 ** -9))
        carry_lost = (2 * b == a) & (torch.frexp(a)[0].abs() == 0.5)
        return bool((one_step | carry_lost).all()) and (a != b).float().mean() < 0.08
""")

GROUP_COLUMNS = CLOSE + textwrap.dedent("""
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
        assert torch.equal(want.data.float() == 0, got.data.float() == 0), sizes  # padding, empty columns
        assert close(want.data, got.data), sizes
    print("ok")
""")

POW2_STACK = CLOSE + textwrap.dedent("""
    from opfuse.families.quantize import weight_pow2
    from opfuse.fp8 import numerics

    torch.manual_seed(0)
    base = torch.randn(3, 40, 300) * torch.tensor([1.0, 100.0, 0.01]).view(3, 1, 1)
    # the hint: unset, right, wrong upwards, wrong downwards with one matrix zero, all zero
    for step, factor in enumerate([1.0, 1.0, 3.0, 0.2, 0.0]):
        w = (base * factor).to(torch.bfloat16)
        if step == 3:
            w[2] = 0
        want = weight_pow2.quantize_stack(w, torch.float8_e4m3fn)  # a CPU tensor: the torch reference
        got = (torch.empty(3, 40, 300, dtype=torch.float8_e4m3fn), torch.empty(3, 300, 40, dtype=torch.float8_e4m3fn),
               torch.empty(3))
        weight_pow2._one_read(w, torch.float8_e4m3fn, True, "stack", True, *got)
        assert torch.equal(want[2], got[2]), step
        assert close(want[0], got[0]) and torch.equal(got[1], got[0].transpose(1, 2)), step
        exponents = numerics.pow2_exponent(w.float().reshape(3, -1).abs().amax(1), torch.float8_e4m3fn)
        assert torch.equal(weight_pow2._hints[("stack", w.device, 3)], exponents.int()), step
    w = (torch.randn(33, 257) * 5).to(torch.bfloat16)  # one matrix, as quantize_weight launches it
    want = numerics.quantize(w, torch.float8_e4m3fn, False, pow2=True)
    data, data_t, scale_inv = (torch.empty(1, 33, 257, dtype=torch.float8_e4m3fn),
                               torch.empty(1, 257, 33, dtype=torch.float8_e4m3fn), torch.empty(1))
    weight_pow2._one_read(w.unsqueeze(0), torch.float8_e4m3fn, True, "matrix", True, data, data_t, scale_inv)
    assert torch.equal(scale_inv.reshape(1, 1), want.scale_inv) and close(want.data, data[0])
    assert torch.equal(data_t[0], data[0].t())
    print("ok")
""")


POW2_TABLE = CLOSE + textwrap.dedent("""
    from opfuse.families.quantize import kernels, weight_pow2
    from opfuse.fp8 import numerics

    weight_pow2.fast_path_reason = lambda x: None          # the Triton path on CPU tensors (interpreter)
    torch.manual_seed(0)
    base = [torch.randn(40, 300) * s for s in (1.0, 100.0, 0.01)]
    for step, factor in enumerate([1.0, 1.0, 3.0, 0.2, 0.0]):
        ws = [(b * factor).to(torch.bfloat16) for b in base]
        if step == 3:
            ws[2].zero_()
        ws[1] = torch.cat([ws[1], ws[1]], 1)[:, :300]        # a strided weight: copied, then in the table
        want = numerics.quantize_stack(torch.stack(ws), torch.float8_e4m3fn, pow2=True)
        capturing = step == 2                                # a new table cannot be copied in a capture
        weight_pow2.is_capturing = lambda: capturing
        data, data_t, scale_inv = weight_pow2.quantize_weights(ws, torch.float8_e4m3fn, True, "table")
        assert torch.equal(want[2], scale_inv), step
        assert close(want[0], data) and torch.equal(data_t, data.transpose(1, 2)), step
        exponents = numerics.pow2_exponent(torch.stack(ws).float().reshape(3, -1).abs().amax(1), torch.float8_e4m3fn)
        assert torch.equal(weight_pow2._hints[("table", ws[0].device, 3)], exponents.int()), step
        addresses, table = weight_pow2._tables[("table", ws[0].device)]
        assert table.tolist() == list(addresses), step
        # the table follows the weights, except in the capture (each weight launched alone there)
        assert (addresses[0], addresses[2]) != (ws[0].data_ptr(), ws[2].data_ptr()) if capturing \
            else (addresses[0], addresses[2]) == (ws[0].data_ptr(), ws[2].data_ptr()), step
    print("ok")
""")


ROWWISE = CLOSE + textwrap.dedent("""
    from opfuse.families.quantize import kernels
    from opfuse.fp8 import numerics

    torch.manual_seed(0)
    for rows, cols in [(5, 300), (3, 16), (4, 1030), (2, 2049)]:
        x = (torch.randn(rows, cols) * torch.logspace(-2, 2, rows).view(rows, 1)).to(torch.bfloat16)
        x[1] = 0                                          # a row without an amax
        x[0, 3] = -7.5
        given = x.float().abs().amax(1) * 2               # the amax given per row (e.g. per expert)
        for amax in (None, given):
            want = numerics.quantize(x, torch.float8_e4m3fn, True, None if amax is None else amax.view(-1, 1))
            for one_read in (True, False):
                got = kernels._rowwise_triton(x, torch.float8_e4m3fn, amax, one_read)
                assert torch.equal(got.scale_inv, want.scale_inv), (rows, cols, one_read)
                assert close(want.data, got.data), (rows, cols, one_read)
    print("ok")
""")


def _run(script: str) -> None:
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=ROOT)
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stdout + done.stderr


def test_group_column_quantizer_under_the_interpreter():
    _run(GROUP_COLUMNS)


def test_one_read_pow2_quantizer_of_a_stack_under_the_interpreter():
    """Scales and hints exact through right and wrong hints (one exponent per matrix)."""
    _run(POW2_STACK)


def test_one_read_pow2_quantizer_of_separate_weights_through_an_address_table_under_the_interpreter():
    """``quantize_weights``: weights found through the table (a strided one copied first), hints
    and scales exact through right and wrong hints; inside a capture (no new table) each weight
    alone, same results."""
    _run(POW2_TABLE)


def test_rowwise_quantizer_one_read_and_two_reads_under_the_interpreter():
    """Both forms of the per-row kernel (the row held in registers, or read twice), with the amax
    computed or given, rows of widths off the block; scales exact."""
    _run(ROWWISE)
