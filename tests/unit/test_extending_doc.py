"""docs/EXTENDING.md's basic-op example runs as written, and its sharding rule behaves as stated."""

import os
import re

import pytest
import torch

from opfuse import ops
from opfuse.ops.base import PartitionError
from opfuse.ops.sharding import REPLICATED, Sharding

DOC = os.path.join(os.path.dirname(__file__), "..", "..", "docs", "EXTENDING.md")


def _first_python_block() -> str:
    with open(DOC) as handle:
        return re.search(r"```python\n(.*?)```", handle.read(), re.S).group(1)


def test_basic_op_example_runs_in_a_block():
    namespace = {}
    exec(compile(_first_python_block(), "EXTENDING.md", "exec"), namespace)  # noqa: S102 - our own doc
    scale = namespace["Scale"](3.0)
    x = torch.randn(4, 8, dtype=torch.float64)
    torch.testing.assert_close(ops.Sequential(scale)(x), 3.0 * x)
    assert scale.propagate_sharding(REPLICATED) is REPLICATED
    with pytest.raises(PartitionError, match="partial sum"):
        scale.propagate_sharding(Sharding(partial=True))


def test_an_op_without_a_sharding_rule_refuses_sharded_values():
    class NoRule(ops.BasicOp):
        def forward(self, x):
            return x

        def infer_meta(self, x, *extra):
            return x

    assert NoRule().propagate_sharding(REPLICATED) is REPLICATED
    with pytest.raises(PartitionError, match=r"NoRule: declares no sharding rule .*features-sharded"):
        NoRule().propagate_sharding(Sharding(features=True))
