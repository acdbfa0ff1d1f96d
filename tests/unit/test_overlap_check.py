"""Capability checks of the p2p_overlap implementations (the parts decidable without a GPU) and
their place in the implementation table."""

import pytest
import torch

import opfuse

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


def _gather_spec(x_shape, *, dtype=torch.bfloat16, device=CUDA, world=2):
    return CallSpec(op="all_gather_tokens", inputs={"x": TensorMeta(tuple(x_shape), dtype, device)}, attrs={},
                    group_name="tp", world_size=world)


def test_gather_alone_reasons(monkeypatch):
    """``all_gather_tokens``: the reasons decidable without a GPU, the size threshold at its edge
    (one row below it NCCL keeps the gather; at it, the next reason is the missing peer memory)."""
    check = impl.check_all_gather_tokens
    assert "OPFUSE_P2P_GRADIENT_GATHERS=1" in check(_gather_spec((512, 1024)))  # off by default
    monkeypatch.setattr(opfuse.config, "p2p_gradient_gathers", True)
    assert "needs CUDA" in check(_gather_spec((512, 1024), device=torch.device("cpu")))
    assert "not supported" in check(_gather_spec((512, 1024), dtype=torch.float32))
    assert "two or more ranks" in check(_gather_spec((512, 1024), world=1))
    assert "token dim" in check(_gather_spec((1 << 20,)))
    rows = impl.MIN_GATHER_BYTES // (2 * 1024)
    assert "NCCL's gather costs less" in check(_gather_spec((rows - 1, 1024)))
    assert "no peer memory" in check(_gather_spec((rows, 1024)))
    assert "no peer memory" in check(_gather_spec((rows // 4, 4, 1024)))  # leading dims count as rows
    names = [i.name for i in implementations.for_op("all_gather_tokens")]
    assert names == [impl.NAME, "reference"]


def test_gather_alone_has_no_backward():
    from opfuse.families.collective_linear.gather import AllGatherTokens

    with pytest.raises(RuntimeError, match="no backward"):
        AllGatherTokens()(torch.randn(4, 8, requires_grad=True))
