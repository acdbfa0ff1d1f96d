"""Which model parameter each input of a compiled graph is.

Dynamo hands the backend its graph with one placeholder per input (parameters and buffers are
inputs too) and the real tensors as ``example_inputs``; AOTAutograd's joint graph names its
placeholders ``primals_N`` and records where each comes from in ``node.meta["desc"]``
(``PlainAOTInput(idx)``: Dynamo's input ``idx``; ``SubclassGetAttrAOTInput``: the local tensor of
a DTensor input). Together they say which parameter (fully qualified name, owning module) a
joint-graph input is, and which joint-graph output is its gradient.

A parameter's name is found by identity among the parameters of the model handed to
:func:`opfuse.optimize` (or of the ``nn.Module`` values of the frame Dynamo is compiling, for
``torch.compile(model, backend="opfuse")``), else parsed from Dynamo's source of the input
(``L['self']._modules['layers']._modules['0']...._parameters['weight']`` -> ``layers.0....weight``;
the module is then unknown).
"""

from __future__ import annotations

import dataclasses
import re

import torch
from torch import fx, nn

__all__ = ["GraphInput", "describe_inputs", "input_key", "output_keys", "dynamo_index", "candidate_roots"]


@dataclasses.dataclass(frozen=True)
class GraphInput:
    """One input of a Dynamo graph: its position, the parameter or buffer it is (``name``, the
    fully qualified name in its model, and the owning ``module``), and Dynamo's source string."""

    index: int
    name: str | None = None
    module: nn.Module | None = None
    source: str | None = None

    @property
    def module_name(self) -> str | None:
        """The owning module's fully qualified name (``name`` without its last part)."""
        if self.name is None:
            return None
        return self.name.rpartition(".")[0]


_TOKEN = re.compile(r"\._(?:modules|parameters|buffers)\['([^']+)'\]|\.([A-Za-z_]\w*)|\[(\d+)\]|\['([^']+)'\]")


def _name_from_source(source: str) -> str | None:
    """``L['self']._modules['a']._modules['0']._parameters['weight']`` -> ``a.0.weight``."""
    match = re.match(r"^(?:L|G)\['[^']+'\]", source)
    if match is None:
        return None
    parts = []
    for token in _TOKEN.finditer(source, match.end()):
        parts.append(next(group for group in token.groups() if group is not None))
    return ".".join(parts) or None


def candidate_roots() -> list[nn.Module]:
    """The ``nn.Module`` values among the locals of the frame Dynamo is compiling (the module
    itself for ``torch.compile(model)``), when called from inside a backend."""
    try:
        from torch._dynamo.symbolic_convert import InstructionTranslator

        tx = InstructionTranslator.current_tx()
    except Exception:  # noqa: BLE001 - not inside Dynamo, or another torch version
        return []
    values = list(getattr(tx, "f_locals", {}).values()) if tx is not None else []
    return [v for v in values if isinstance(v, nn.Module)]


def _index_params(roots) -> dict[int, tuple[str, nn.Module]]:
    found: dict[int, tuple[str, nn.Module]] = {}
    for root in roots:
        for prefix, module in root.named_modules(remove_duplicate=False):
            for attr, tensor in list(module._parameters.items()) + list(module._buffers.items()):
                if tensor is not None and id(tensor) not in found:
                    found[id(tensor)] = (f"{prefix}.{attr}" if prefix else attr, module)
    return found


def describe_inputs(gm: fx.GraphModule, example_inputs, roots=()) -> list[GraphInput]:
    """A :class:`GraphInput` per input of Dynamo graph ``gm`` (in ``example_inputs`` order)."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    known = _index_params(list(roots) or candidate_roots())
    described = []
    for index, node in enumerate(placeholders):
        arg = node.meta.get("grapharg")
        source = getattr(getattr(arg, "source", None), "name", None)
        source = source() if callable(source) else source
        tensor = example_inputs[index] if index < len(example_inputs) else None
        name, module = known.get(id(tensor), (None, None))
        if name is None and isinstance(source, str):
            name = _name_from_source(source)
        described.append(GraphInput(index, name, module, source))
    return described


# AOTAutograd descriptors -------------------------------------------------------------------------------


def input_key(desc) -> tuple | None:
    """A comparable key of an AOTAutograd input descriptor: ``("in", idx)`` for Dynamo's input
    ``idx``, extended by the attribute for a tensor subclass's inner tensor (a DTensor's local
    tensor)."""
    kind = type(desc).__name__
    if kind == "PlainAOTInput":
        return ("in", desc.idx)
    if kind == "ParamAOTInput" or kind == "BufferAOTInput":
        return ("param", desc.target)
    if kind == "SubclassGetAttrAOTInput":
        base = input_key(desc.base)
        return None if base is None else base + (desc.attr,)
    return None


def _output_key(desc) -> tuple | None:
    kind = type(desc).__name__
    if kind == "GradAOTOutput":
        base = input_key(desc.grad_of)
        return None if base is None else ("grad",) + base
    if kind == "SubclassGetAttrAOTOutput":
        base = _output_key(desc.base)
        return None if base is None else base + (desc.attr,)
    return None


def output_keys(graph: fx.Graph) -> dict[tuple, fx.Node]:
    """``("grad",) + input_key`` -> the node a joint graph returns as that input's gradient."""
    output = graph.output_node()
    values = output.args[0]
    descs = output.meta.get("desc")
    if not isinstance(values, (list, tuple)) or not isinstance(descs, (list, tuple)) or len(descs) != len(values):
        return {}
    found = {}
    for value, desc in zip(values, descs):
        key = _output_key(desc) if desc is not None else None
        if key is not None and isinstance(value, fx.Node):
            found[key] = value
    return found


def dynamo_index(placeholder: fx.Node) -> int | None:
    """The Dynamo input a joint-graph placeholder comes from (``None``: a tangent, a seed)."""
    key = input_key(placeholder.meta.get("desc"))
    if key is None or key[0] != "in":
        return None
    return key[1]


def storage_key(val) -> tuple | None:
    """``(storage identity, element offset)`` of a (fake) tensor, or ``None``."""
    if not isinstance(val, torch.Tensor):
        return None
    try:
        return val.untyped_storage()._cdata, val.storage_offset()
    except (RuntimeError, NotImplementedError, AttributeError):
        return None
