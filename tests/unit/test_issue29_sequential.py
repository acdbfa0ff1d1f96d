"""Sequential front end (issue 29, item 4), one process: inputs without leading dims or without
tokens, and sequence-parallel layers given a value without a token dim."""

import pytest
import torch
import torch.nn.functional as F

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


@pytest.mark.parametrize("grad", [False, True])
def test_zero_tokens_through_the_token_to_feature_all_to_all(world1, grad):
    # A row layer fed token shards re-shards them on features with one all-to-all; its reshape
    # could not infer a dim of an empty tensor.
    block = ops.Sequential(ops.Linear(2, 6, parallel="row", sequence_parallel=True, dtype=DT),
                           ops.Linear(6, 4, parallel="row", dtype=DT))
    x = torch.randn(0, 3, 2, dtype=DT, requires_grad=grad)
    with torch.set_grad_enabled(grad):
        y = block(x)
    assert y.shape == (0, 3, 4)
    if grad:
        y.sum().backward()
        assert x.grad.shape == x.shape and block[0].weight.grad.abs().sum() == 0


@pytest.mark.parametrize("layer", [
    lambda: ops.Linear(4, 4, parallel="column", sequence_parallel=True),
    lambda: ops.GatedLinear(4, 4, parallel="column", sequence_parallel=True),
    lambda: ops.Linear(4, 4, parallel="row", sequence_parallel=True),
])
def test_a_sequence_parallel_layer_refuses_a_value_without_a_token_dim(world1, layer):
    # Dim 0 of a 1-D value is its features: gathering it gathered features.
    with pytest.raises(ops.OpInputError, match=r"Sequential op 0: .*input has shape \[\d+\]; a token-sharded "
                                               r"\(sequence-parallel\) value needs a token dim"):
        ops.Sequential(layer())(torch.randn(4))

