"""Sequential front end (issue 29, items 4 and 5), one process: inputs without leading dims, and
misuse that must raise an error naming the value and what is accepted."""

import pytest
import torch
import torch.nn.functional as F

import opfuse
from opfuse import ops

DT = torch.float64


@pytest.mark.parametrize("bias", [False, True])
def test_gated_linear_on_a_1d_input_fuses_and_matches_the_formula(bias):
    # The horizontal_gemm pass builds one GEMM over [gate; up]; its output had a token dim the
    # 1-D input does not have (a RuleError at compile).
    gen = torch.Generator().manual_seed(3)
    layer = ops.GatedLinear(6, 5, bias=bias, dtype=DT)
    gate, up = torch.randn(5, 6, generator=gen, dtype=DT), torch.randn(5, 6, generator=gen, dtype=DT)
    gb, ub = (torch.randn(5, generator=gen, dtype=DT) for _ in range(2))
    layer.load_unsharded(gate, up, *((gb, ub) if bias else ()))
    block = ops.Sequential(layer)
    x = torch.randn(6, generator=gen, dtype=DT, requires_grad=True)
    dy = torch.randn(5, generator=gen, dtype=DT)
    y = block(x)
    assert "horizontal_gemm" in [f.rule for f in block.program(x).fusions]
    y.backward(dy)

    xr, gr, ur = (t.detach().clone().requires_grad_() for t in (x, gate, up))
    g = F.linear(xr, gr, gb if bias else None)
    u = F.linear(xr, ur, ub if bias else None)
    (F.silu(g) * u * dy).sum().backward()
    assert y.shape == (5,)
    torch.testing.assert_close(y, F.silu(g) * u)
    torch.testing.assert_close(x.grad, xr.grad)
    torch.testing.assert_close(layer.gate_weight.grad, gr.grad)
    torch.testing.assert_close(layer.up_weight.grad, ur.grad)
