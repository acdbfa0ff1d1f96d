"""The basic-op contract every fusible op follows.

A basic op is an ``nn.Module`` whose ``forward`` is the pure-torch reference (differentiable, so
backward comes from autograd or from the op's own ``autograd.Function``). Besides computing, an op
answers one question without touching data: given the metadata of its inputs, what is the
metadata of its output (:meth:`BasicOp.infer_meta`)? Lowering uses that to annotate every graph
value, validate user inputs with errors that name the op, and give fusion rules shapes and dtypes
to test.
"""

from __future__ import annotations

import dataclasses
import operator
from typing import ClassVar, Sequence

import torch
from torch import nn

from .. import epoch
from ..fp8.tensor import Float8Activation
from ..runtime.device import dtype_name  # noqa: F401 - also the ops' name for it (opfuse.ops.base.dtype_name)

__all__ = ["BasicOp", "ImplementationError", "OpInputError", "PartitionError", "TensorMeta", "check_flag",
           "check_meta_equal", "check_size", "dtype_name", "output_meta"]


class OpInputError(ValueError):
    """An op received inputs of the wrong count, shape, dtype or device."""


class PartitionError(OpInputError):
    """A sharding combination the partition rules do not allow."""


class ImplementationError(RuntimeError):
    """No implementation can run a fused op, or a forced one cannot (``OPFUSE_FORCE_IMPL``).

    Defined with the ops (``opfuse.machinery.implementation`` re-exports it): an op called directly runs
    its reference math and refuses a forced implementation of its fused op with this error too."""


@dataclasses.dataclass(frozen=True)
class TensorMeta:
    """Shape, dtype, device and requires_grad of a tensor, without its data.

    ``quantized`` describes an FP8 activation (:class:`opfuse.fp8.Float8Activation`), e.g.
    ``"e4m3/tensor"`` (format / what one scale covers); ``dtype`` is then the dtype the value
    stands for (what autograd sees).
    """

    shape: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device
    requires_grad: bool = False
    quantized: str | None = None

    @classmethod
    def of(cls, tensor: torch.Tensor) -> "TensorMeta":
        return cls(tuple(tensor.shape), tensor.dtype, tensor.device, bool(tensor.requires_grad),
                   _quantized_tag(tensor))

    def with_(self, **changes) -> "TensorMeta":
        return dataclasses.replace(self, **changes)

    @property
    def features(self) -> int:
        return self.shape[-1]

    @property
    def tokens(self) -> int:
        """Product of the leading dims (every dim but the last)."""
        count = 1
        for size in self.shape[:-1]:
            count *= size
        return count

    @property
    def nbytes(self) -> int:
        count = 1
        for size in self.shape:
            count *= size
        return count * torch.empty((), dtype=self.dtype).element_size()

    def __str__(self) -> str:
        dims = ", ".join(str(s) for s in self.shape)
        dtype = dtype_name(self.dtype) if self.quantized is None else f"{self.quantized}~{dtype_name(self.dtype)}"
        return f"{dtype}[{dims}]@{self.device}"


def _quantized_tag(tensor: torch.Tensor) -> str | None:
    return tensor.tag if isinstance(tensor, Float8Activation) else None


def check_meta_equal(op: "BasicOp", what: str, got: TensorMeta, expected: TensorMeta) -> None:
    """Raise :class:`OpInputError` unless ``got`` has ``expected``'s shape, dtype and device."""
    for field, label in (("shape", "shape"), ("dtype", "dtype"), ("device", "device")):
        want, have = getattr(expected, field), getattr(got, field)
        if field == "device":
            want, have = torch.device(want), torch.device(have)
        if want != have:
            raise OpInputError(
                f"{op.describe()}: {what} has {label} {_fmt(have)}, expected {_fmt(want)}"
            )


def check_size(value, who: str, name: str, minimum: int = 1):
    """``value`` as an int (a ``torch.SymInt`` as it is) when it is an integer >= ``minimum``; else
    a ``ValueError`` naming ``who``, ``name`` and the value. ``True`` is not a size, nor is ``4.0``
    (``int()`` would have taken both, and a negative size failed deep inside ``torch.empty``)."""
    if isinstance(value, torch.SymInt):
        return value
    if not isinstance(value, bool) and hasattr(value, "__index__"):
        number = operator.index(value)
        if number >= minimum:
            return number
    wanted = "a positive int" if minimum == 1 else f"an int >= {minimum}"
    raise ValueError(f"{who}: {name}={value!r}; expected {wanted}")


def check_flag(value, who: str, name: str) -> bool:
    """``value`` when it is a bool; else a ``TypeError`` naming it (``"no"`` would be truthy)."""
    if isinstance(value, bool):
        return value
    raise TypeError(f"{who}: {name}={value!r}; expected True or False")


def output_meta(op: "BasicOp", *metas: TensorMeta) -> TensorMeta:
    """``op.infer_meta(*metas)``, with the FP8 tag cleared unless the op keeps its input FP8."""
    meta = op.infer_meta(*metas)
    if meta.quantized is not None and not op.keeps_quantized:
        meta = meta.with_(quantized=None)
    return meta


def _fmt(value) -> str:
    if isinstance(value, torch.dtype):
        return dtype_name(value)
    if isinstance(value, tuple):
        return "[" + ", ".join(str(v) for v in value) + "]"
    return str(value)


class Described:
    """``kind`` (what rules match on: the class name) and ``describe()`` (for messages and dumps)
    of ops and fused ops."""

    @property
    def kind(self) -> str:
        return type(self).__name__

    def describe(self) -> str:
        extra = self.extra_repr()
        return f"{self.kind}({extra})" if extra else self.kind


class BasicOp(Described, nn.Module):
    """Base class of fusible ops.

    Subclasses set the class attributes below, implement ``forward(x, *extra_inputs)`` as the
    pure-torch reference, :meth:`infer_meta`, and, unless they only ever see replicated values,
    :meth:`propagate_sharding` (composite ops: ``expand``).
    """

    #: Extra inputs consumed from ``Sequential``'s extra arguments, left to right.
    num_extra_inputs: ClassVar[int] = 0
    #: Extra outputs appended after ``Sequential``'s main output.
    num_extra_outputs: ClassVar[int] = 0
    #: True for ops that only rearrange data across processes (no local arithmetic).
    is_collective: ClassVar[bool] = False
    #: True for composite ops that the partition pass expands into basic ops.
    is_composite: ClassVar[bool] = False
    #: True for ops whose output is their FP8 input itself (moved, not recomputed), so it stays
    #: an FP8 activation (``TensorMeta.quantized``); other ops see FP8 inputs dequantized.
    keeps_quantized: ClassVar[bool] = False

    #: Bumped by every attribute assignment and dtype/device conversion of this op: compiled
    #: programs read attributes (``eps``, ``group``, ...) and hold references to parameters, so
    #: their cache key includes it (:mod:`opfuse.sequential.cache`).
    _op_version: int = 0

    def __setattr__(self, name, value):
        super().__setattr__(name, value)
        if name != "training":  # train()/eval() every epoch must not recompile: no op reads it
            self._changed()

    def __delattr__(self, name):
        super().__delattr__(name)
        self._changed()

    def _apply(self, fn, recurse=True):
        # .to(), .double(), .cuda(), ...: parameters keep their identity but may change dtype or
        # device. A conversion that changes nothing (.to() of where it already is) keeps programs.
        before = self._tensor_placement()
        result = super()._apply(fn, recurse)
        if self._tensor_placement() != before:
            self._changed()
        return result

    def _tensor_placement(self) -> tuple:
        return tuple((t.dtype, t.device, t.shape) if t is not None else None
                     for t in (*self._parameters.values(), *self._buffers.values()))

    def _changed(self) -> None:
        self.__dict__["_op_version"] = self.__dict__.get("_op_version", 0) + 1
        epoch.bump()

    def infer_meta(self, x: TensorMeta, *extra: TensorMeta) -> TensorMeta:
        """Output metadata for inputs with metadata ``x`` (main) and ``extra``; raise
        :class:`OpInputError` naming this op and the expected value when inputs are invalid."""
        raise NotImplementedError(f"{type(self).__name__}.infer_meta")

    def propagate_sharding(self, x, *extra):
        """The layout (:class:`~opfuse.ops.sharding.Sharding`) of the output for inputs laid out
        as ``x`` (main) and ``extra``; raise :class:`PartitionError` naming this op for layouts it
        cannot work on.

        The default accepts replicated inputs only: an op that does not say how it treats a
        sharded value must not silently pass one through (a feature-mixing op on a
        feature-sharded value would compute garbage).
        """
        if x.replicated and all(e.replicated for e in extra):
            return x
        layouts = ", ".join(s.describe() for s in (x, *extra))
        raise PartitionError(
            f"{self.describe()}: declares no sharding rule and its input is not replicated ({layouts}); "
            f"implement {type(self).__name__}.propagate_sharding(x, *extra) to say how the op treats sharded "
            f"values, or place it where values are replicated")

    def process_groups(self) -> list:
        """The process groups this op communicates over (``None`` = the default group). Every rank
        of each must compile the same program (checked once per compile)."""
        return []

    def natural_input_sharding(self, x: TensorMeta):
        """The layout this op expects of ``x`` (the value it receives, after the ops before it) when
        it is the first op of its block to state one, or ``None`` (no preference). The block's
        input takes that layout when the ops before it hand it through unchanged."""
        return None

    # Helpers for subclasses -------------------------------------------------------------

    def _require_features(self, x: TensorMeta, expected: int, what: str = "input") -> None:
        if len(x.shape) < 1:
            raise OpInputError(f"{self.describe()}: {what} must have at least 1 dim, got a scalar")
        if x.features != expected:
            raise OpInputError(
                f"{self.describe()}: {what} has {x.features} features (last dim of shape "
                f"{list(x.shape)}), expected {expected}"
            )

    def _require_float(self, x: TensorMeta, what: str = "input") -> None:
        if not x.dtype.is_floating_point:
            raise OpInputError(
                f"{self.describe()}: {what} has dtype {dtype_name(x.dtype)}, expected a floating "
                f"point dtype (float32, bfloat16, float16, float64)"
            )

    def _require_param_match(self, x: TensorMeta, params: Sequence[torch.Tensor], what: str = "input",
                             check_dtype: bool = True) -> None:
        for param in params:
            if param is None:
                continue
            if check_dtype and param.dtype != x.dtype:
                raise OpInputError(
                    f"{self.describe()}: {what} dtype {dtype_name(x.dtype)} differs from the "
                    f"parameter dtype {dtype_name(param.dtype)}; convert the module with .to(dtype) "
                    f"or the input"
                )
            if param.device.type != "meta" and torch.device(param.device) != torch.device(x.device):
                raise OpInputError(
                    f"{self.describe()}: {what} is on {x.device} but the parameters are on "
                    f"{param.device}"
                )
