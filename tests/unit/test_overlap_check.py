"""Capability checks of the p2p_overlap implementations (the parts decidable without a GPU) and
their place in the implementation table."""

import pytest
import torch

from opfuse.core import dispatch as implementations
from opfuse.machinery.implementation import CallSpec
from opfuse.families.collective_linear import p2p as impl
from opfuse.ops.base import OpInputError, TensorMeta

CUDA = torch.device("cuda", 0)


def spec(op, x_shape, w_shape, *, dtype=torch.bfloat16, device=CUDA, world=4, bias=False, bias_after=True):
    inputs = {"x": TensorMeta(tuple(x_shape), dtype, device), "weight": TensorMeta(tuple(w_shape), dtype, device),
              "bias": TensorMeta((w_shape[0],), dtype, device) if bias else None}
    attrs = {"bias_after": bias_after} if op == "linear_reduce_scatter" else {}
    return CallSpec(op=op, inputs=inputs, attrs=attrs, group_name="tp", world_size=world, requires_grad=True)


def test_registered_before_the_reference():
    for op in ("all_gather_linear", "linear_reduce_scatter"):
        names = [i.name for i in implementations.for_op(op)]
        assert names[0] == impl.NAME and names[-1] == "reference"


@pytest.mark.parametrize("x_shape", [(10, 64), (6, 2, 64)])
def test_reduce_scatter_tokens_not_divisible_is_an_error(x_shape):
    with pytest.raises(OpInputError, match=r"not divisible by the world size 4.*multiple of 4"):
        impl.check_linear_reduce_scatter(spec("linear_reduce_scatter", x_shape, (32, 64)))


@pytest.mark.parametrize("op,x_shape,w_shape", [("all_gather_linear", (8, 64), (32, 64)),
                                                ("linear_reduce_scatter", (8, 64), (32, 64))])
def test_reasons(op, x_shape, w_shape):
    check = impl.check_all_gather_linear if op == "all_gather_linear" else impl.check_linear_reduce_scatter
    assert "needs CUDA" in check(spec(op, x_shape, w_shape, device=torch.device("cpu")))
    assert "float32" in check(spec(op, x_shape, w_shape, dtype=torch.float32))
    assert "one rank" in check(spec(op, x_shape, w_shape, world=1))
    mixed = spec(op, x_shape, w_shape)
    mixed.inputs["weight"] = TensorMeta(tuple(w_shape), torch.float16, CUDA)
    assert "mixed dtypes" in check(mixed)
