"""``ops.Sequential``: a block of basic ops that opfuse compiles and fuses on first call.

It lives with the compiler (it is the compiled block); ``opfuse.ops.Sequential`` names it.
"""

from __future__ import annotations

import torch
from torch import nn

from ..ops.base import BasicOp, OpInputError, structure_version
from .compile import cached_program

__all__ = ["Sequential", "compile"]


class Sequential(nn.Sequential):
    """A chain of fusible ops, called as ``y = seq(x, *extra_inputs)``.

    Extra inputs are handed to the ops that declare them (``AddExtraInput``), left to right; the
    result is ``y`` alone, or ``(y, *extra_outputs)`` when ops such as ``MakeExtraOutput`` add
    outputs. On the first call for an input signature (shapes, dtypes, devices, requires_grad)
    the block is lowered to a torch.fx graph, partitioned, fused, and cached as a
    :class:`opfuse.Program`; :meth:`program` returns it.

    Examples
    --------
    >>> tail = ops.Sequential(
    ...     ops.Linear(ffn, hidden, parallel="row", group=tp),
    ...     ops.AddExtraInput(), ops.MakeExtraOutput(), ops.RMSNorm(hidden))  # doctest: +SKIP
    >>> y, residual = tail(x, residual)                                    # doctest: +SKIP
    """

    def __init__(self, *ops):
        super().__init__(*ops)
        for index, op in enumerate(self):
            self._check_op(index, op)
        self._programs: dict = {}
        self._params_version = -1
        self._params: list = []

    # Structure ---------------------------------------------------------------------------

    @staticmethod
    def _check_op(index, op) -> None:
        if not isinstance(op, BasicOp):
            raise TypeError(
                f"Sequential: element {index} is a {type(op).__module__}.{type(op).__name__}; "
                f"expected an opfuse op (opfuse.ops.Linear, RMSNorm, ...)"
            )

    def _structure_changed(self) -> None:
        self._programs = {}
        self._params_version = -1

    def requires_grad_key(self) -> tuple:
        """``requires_grad`` of every parameter (part of the compile-cache key), from a parameter
        list cached until an op's parameters are replaced (walking modules costs ~10 us)."""
        version = structure_version()
        if self._params_version != version:
            self._params = list(self.parameters())
            self._params_version = version
        return tuple(p.requires_grad for p in self._params)

    def append(self, op) -> "Sequential":
        self._check_op(len(self), op)
        super().append(op)
        self._structure_changed()
        return self

    def insert(self, index: int, op) -> "Sequential":
        self._check_op(index, op)
        super().insert(index, op)
        self._structure_changed()
        return self

    def extend(self, sequential) -> "Sequential":
        for op in sequential:
            self.append(op)
        return self

    def __setitem__(self, idx, op) -> None:
        self._check_op(idx, op)
        super().__setitem__(idx, op)
        self._structure_changed()

    def __delitem__(self, idx) -> None:
        super().__delitem__(idx)
        self._structure_changed()

    def __getitem__(self, idx):
        if isinstance(idx, slice):
            return type(self)(*list(self._modules.values())[idx])
        return super().__getitem__(idx)

    @property
    def num_extra_inputs(self) -> int:
        return sum(op.num_extra_inputs for op in self)

    @property
    def num_extra_outputs(self) -> int:
        return sum(op.num_extra_outputs for op in self)

    # Calling -----------------------------------------------------------------------------

    def check_inputs(self, inputs) -> None:
        """Raise :class:`OpInputError` if the number or kind of inputs is wrong."""
        if len(self) == 0:
            raise OpInputError("Sequential: the block has no ops")
        expected = 1 + self.num_extra_inputs
        if len(inputs) != expected:
            owners = [f"{i}:{op.kind}" for i, op in enumerate(self) for _ in range(op.num_extra_inputs)]
            detail = f" (extra inputs for {', '.join(owners)})" if owners else ""
            raise OpInputError(
                f"Sequential: expected {expected} input(s): x{detail}; got {len(inputs)}"
            )
        for position, value in enumerate(inputs):
            if not isinstance(value, torch.Tensor):
                raise OpInputError(
                    f"Sequential: input {position} is a {type(value).__name__}; expected a torch.Tensor"
                )

    def program(self, *inputs):
        """The compiled :class:`opfuse.Program` for these inputs (compiling it if needed)."""
        self.check_inputs(inputs)
        return cached_program(self, inputs)

    def forward(self, x, *extra_inputs):
        inputs = (x,) + extra_inputs
        return self.program(*inputs)(*inputs)

    def __repr__(self) -> str:
        return super().__repr__().replace("Sequential(", "opfuse.ops.Sequential(", 1)



def compile(module, *example_inputs):  # noqa: A001 - mirrors torch.compile
    """Compile ``module`` (an ``ops.Sequential`` or a single op) for ``example_inputs``.

    Returns the same cached :class:`~opfuse.Program` that ``module(*example_inputs)`` runs.

    Examples
    --------
    >>> program = opfuse.compile(block, x, residual)       # doctest: +SKIP
    >>> [f.rule for f in program.fusions]                  # doctest: +SKIP
    ['allreduce_add_rmsnorm']
    >>> print(program.dump("python"))                      # doctest: +SKIP
    """
    if isinstance(module, BasicOp) and not isinstance(module, Sequential):
        module = Sequential(module)
    if not isinstance(module, Sequential):
        raise TypeError(
            f"opfuse.compile: expected an opfuse.ops.Sequential or an opfuse op, got {type(module).__name__}")
    module.check_inputs(example_inputs)
    return cached_program(module, example_inputs)
