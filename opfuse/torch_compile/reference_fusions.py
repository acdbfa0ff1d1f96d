"""Fusions a compiled graph is better without: those only their reference implementation can run,
and those Inductor makes as well itself.

A fused op's reference implementation is plain torch ops (and ``torch.distributed``), called from
inside an opaque custom op. For some fused ops it is exactly the aten ops the fusion covers: an
add + RMSNorm, an all-reduce + add + norm, a GEMM + bias + GELU (``FusedOp.reference_is_unfused``).
Where their kernels refuse a call (a float32 residual stream next to bfloat16 activations, as
``torch.autocast`` training gives; rows of an odd size; a dtype the kernels lack), keeping the
fusion would replace what Inductor fuses into one generated kernel by the same ops run one by one
through a custom op's Python: slower than not using opfuse at all. In a graph Inductor compiles,
such a fusion is therefore not made: its aten nodes stay as they were and ``explain()`` says why
(``opfuse.config.reference_fusions``: ``auto`` on CUDA devices, ``inductor`` on every device,
``keep`` never). A fused op whose reference does worse than the graph on any device
(``FusedOp.reference_is_slower``: an all-gather in line where the graph's ran asynchronously) is
left on every device unless ``keep``. Fused ops whose reference still does less than the ops it replaces (one GEMM for
merged projections, one collective instead of two) are made whatever implementation runs them.

A fused op whose ops Inductor fuses into one kernel of its own (``FusedOp.inductor_fuses_alike``:
an add + norm with no collective) is left to Inductor under the same setting, whichever
implementation could run it: its kernel reads and writes what Inductor's does, and each call of a
custom op costs host time that a generated kernel's launch does not. Measured on a 16-layer model
(hidden 2048, one H200, train-tp 2048 tokens): 1.20x of torch.compile's step with the fusion,
1.01x without (docs/PERF_NOTES.model.md, session 25).
"""

from __future__ import annotations

import operator

import torch
from torch import fx

from ..config import config, parse_force_impl
from ..machinery.fused_op import FusedOp

__all__ = ["left_to_inductor", "fused_values"]


def _device(node: fx.Node):
    for arg in node.args:
        meta = arg.meta.get("opfuse_meta") if isinstance(arg, fx.Node) else None
        if meta is not None:
            return torch.device(meta.device)
    return None


def _applies(device, slower: bool) -> bool:
    if config.reference_fusions == "keep":
        return False
    if config.reference_fusions == "inductor" or slower:
        return True
    return device is not None and device.type == "cuda"


def fused_values(node: fx.Node) -> list[fx.Node]:
    """The op-graph values of fused node ``node``: itself (one output), or its ``getitem`` users."""
    if "opfuse_replaces" in node.meta:
        return [node]
    return [u for u in node.users if u.op == "call_function" and u.target is operator.getitem]


def _outputs_map_back(node: fx.Node, aten: dict) -> bool:
    """Every value of ``node`` that something reads stands for an aten value of the graph (so its
    readers can be given that value instead)."""
    values = fused_values(node)
    if "opfuse_replaces" not in node.meta and len(values) != len(node.users):
        return False
    return all(v.meta.get("opfuse_replaces") in aten for v in values if v.users)


def left_to_inductor(gm: fx.GraphModule, aten: dict) -> dict[str, str]:
    """Fused node name -> why it is left to Inductor (see the module docstring), for the fused
    ops of op graph ``gm`` (after implementation choice; ``aten``: op-graph name -> aten node).
    A reference that ``OPFUSE_FORCE_IMPL`` asked for runs as asked."""
    left = {}
    forced = parse_force_impl(config.force_impl)
    for node in gm.graph.nodes:
        if node.op != "call_module":
            continue
        module = gm.get_submodule(node.target)
        if not isinstance(module, FusedOp) or not module.reference_is_unfused:
            continue
        alike = module.impl != "reference"  # a kernel could run it: left only where Inductor fuses alike
        if alike and not module.inductor_fuses_alike:
            continue
        if forced.get(module.name, forced.get(None)) == module.impl:
            continue  # the implementation OPFUSE_FORCE_IMPL asked for runs as asked
        if not _applies(_device(node), module.reference_is_slower) or not _outputs_map_back(node, aten):
            continue
        if alike:
            left[node.name] = (f"{node.name}: {module.name} left to Inductor: it fuses these ops into one kernel "
                               f"itself, as fast as the {module.impl} kernel and without a custom op's host time "
                               f"per call (OPFUSE_REFERENCE_FUSIONS=keep fuses it anyway)")
            continue
        refused = "; ".join(f"{impl}: {reason}" for impl, reason in module.skipped) or "no other implementation"
        left[node.name] = (f"{node.name}: {module.name} left to Inductor: only its reference implementation can run it "
                           f"here ({refused}), and Inductor's code for the same ops is as good or better "
                           f"(OPFUSE_REFERENCE_FUSIONS=keep fuses it anyway)")
    return left
