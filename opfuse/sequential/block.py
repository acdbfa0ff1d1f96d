"""``ops.Sequential``: a block of basic ops that opfuse compiles and fuses on first call.

It lives with the compiler (it is the compiled block); ``opfuse.ops.Sequential`` names it.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from .. import epoch, log
from ..fp8.state import current_recipe
from ..ops.base import BasicOp, OpInputError
from .cache import build_program, call_key, default_group, state_key, uses_default_group
from .diagnose import diagnose_failure

__all__ = ["Sequential", "compile"]

_COLD = (-1, None, None, None)
#: The ``world`` entry of a block whose ops name their groups (or use none).
_ANY_GROUP = object()


class Sequential(nn.Sequential):
    """A chain of fusible ops, called as ``y = seq(x, *extra_inputs)``.

    Extra inputs are handed to the ops that declare them (``AddExtraInput``), left to right; the
    result is ``y`` alone, or ``(y, *extra_outputs)`` when ops such as ``MakeExtraOutput`` add
    outputs. On the first call for an input signature (shapes, dtypes, devices, requires_grad)
    the block is lowered to a torch.fx graph, partitioned, fused, and cached as a
    :class:`opfuse.Program`; :meth:`program` returns it. Changing the block (its ops, their
    attributes or parameters, ``.to()``), a setting or the rules recompiles it on the next call.

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
        self._state = None
        self._params: list = []
        # (epoch, call key, program, default group or _ANY_GROUP) of the last call: what the
        # next call checks first.
        self._hot = _COLD

    # Structure ---------------------------------------------------------------------------

    @staticmethod
    def _check_op(index, op) -> None:
        if not isinstance(op, BasicOp):
            raise TypeError(
                f"Sequential: element {index} is a {type(op).__module__}.{type(op).__name__}; "
                f"expected an opfuse op (opfuse.ops.Linear, RMSNorm, ...)"
            )

    def _structure_changed(self) -> None:
        if "_programs" in self.__dict__:  # not while nn.Sequential.__init__ adds the ops
            self.__dict__["_programs"] = {}
            self.__dict__["_hot"] = _COLD
        epoch.bump()

    def __setattr__(self, name, value):
        super().__setattr__(name, value)
        if isinstance(value, nn.Module):
            self._structure_changed()

    def __delattr__(self, name):
        super().__delattr__(name)
        self._structure_changed()

    def add_module(self, name: str, module) -> None:
        # nn.Sequential's append, insert helpers and register_module come through here.
        if module is not None:
            self._check_op(name, module)
        super().add_module(name, module)
        self._structure_changed()

    def append(self, op) -> "Sequential":
        self._check_op(len(self), op)
        super().append(op)
        return self

    def insert(self, index: int, op) -> "Sequential":
        self._check_op(index, op)
        super().insert(index, op)
        self._structure_changed()
        return self

    def extend(self, sequential) -> "Sequential":
        for op in list(sequential):
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

    def __add__(self, other) -> "Sequential":
        """A new block with the ops of both (shared, as with ``nn.Sequential``)."""
        if not isinstance(other, nn.Sequential):
            return NotImplemented
        return type(self)(*self, *other)

    def __iadd__(self, other) -> "Sequential":
        if not isinstance(other, nn.Sequential):
            return NotImplemented
        return self.extend(other)

    def __mul__(self, count: int) -> "Sequential":
        """The ops repeated ``count`` times (shared, as with ``nn.Sequential``)."""
        if not isinstance(count, int) or isinstance(count, bool) or count <= 0:
            raise ValueError(f"ops.Sequential * {count!r}: expected a positive int")
        return type(self)(*(list(self) * count))

    __rmul__ = __mul__

    def __imul__(self, count: int) -> "Sequential":
        repeated = self * count
        return self.extend(list(repeated)[len(self):])

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
        return self._lookup(inputs)

    def _lookup(self, inputs):
        """The program for ``inputs``, compiled if needed: the path a call takes when the guard in
        :meth:`forward` fails."""
        state = state_key(self)
        stale = state != self._state and bool(self._programs)
        if state != self._state:
            # An op, the structure, a setting, the rules or the passes changed: every program is stale.
            self.__dict__["_programs"] = {}
            self.__dict__["_state"] = state
            self.__dict__["_params"] = list(self.parameters())
        key = call_key(inputs, self._params)
        program = self._programs.get((state, key))
        if program is None:
            if stale or self._programs:
                log.recompile(type(self).__name__, "the block, a setting, the rules or the passes changed" if stale else
                              f"a new input signature ({len(self._programs)} program(s) cached)")
            program = build_program(self, inputs)
            self._programs[(state, key)] = program
        # Compiling creates ops (and so moves the epoch): record the epoch after it.
        world = default_group() if uses_default_group(self) else _ANY_GROUP
        self.__dict__["_hot"] = (epoch.value, key, program, world)
        return program

    def forward(self, *inputs):
        """``y = block(x, *extra_inputs)``. Per call: the inputs' shapes, dtypes, devices and
        ``requires_grad``, the grad mode, the parameters' ``requires_grad`` and the FP8 recipe are
        compared with the last call's, one integer (:mod:`opfuse.epoch`) stands for everything
        else, and a block with ops on the default group checks that it is still the same group."""
        now, last, program, world = self._hot
        try:
            key = (tuple([(t.shape, t.dtype, t.device, t.requires_grad) for t in inputs]), torch.is_grad_enabled(),
                   tuple([p.requires_grad for p in self._params]), current_recipe())
        except AttributeError:  # an input that is not a tensor: check_inputs names it
            key = None
        if now != epoch.value or key != last or key is None or (world is not _ANY_GROUP and world is not
                                                                 dist.group.WORLD):
            self.check_inputs(inputs)
            program = self._lookup(inputs)
        try:
            if program.check_call is not None:
                program.check_call(inputs)
            return program.run(*inputs)
        except Exception as error:
            diagnose_failure(self, program, inputs, error)
            raise

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
    return module._lookup(example_inputs)
