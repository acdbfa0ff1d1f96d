"""FP8 training and inference of compiled models: ``opfuse.optimize(model, fp8=recipe)`` and
``torch.compile(model, backend="opfuse", options={"fp8": recipe})``.

The same FP8 pass as ``ops.Sequential`` under :func:`opfuse.fp8.autocast` runs on the op graph of
each compiled graph (the recipe is the pass context's): every recognised projection GEMM (a
``BasicLinear``, a linear whose weight is a graph input) becomes an FP8 GEMM and its input is
quantized, once per value (q, k and v share one quantization), above the all-gathers that move it.
The rules then fuse the quantization into its producer exactly as for ``Sequential`` blocks
(all-reduce + add + RMSNorm + quantize, add + norm + quantize, FP8 all-gather + GEMM, GEMM +
reduce-scatter), and :mod:`.fp8_lower` writes forward and backward FP8 GEMMs into the graph.

What stays in high precision, and why (``explain()`` lists each):

* the GEMMs ``fp8_filter(fqn, module)`` rejects (``fqn``: the owning module's fully qualified
  name, e.g. ``"output"``; ``module``: that module, ``None`` when it cannot be found);
* GEMMs whose backward GEMMs cannot be told apart in the joint graph (:mod:`.fp8_backward`: a
  weight used by several linears);
* everything that is not a recognised projection (attention's batched GEMMs, embeddings).

Scaling state: opfuse's recipes use current scaling (each tensor's scale from its own amax when it
is quantized), so there is no amax history or other state to keep, checkpoint or capture in CUDA
graphs; FP8 weights are quantized inside the graph on every call (a CUDA graph replay sees
optimizer steps).
"""

from __future__ import annotations

import dataclasses
from typing import Callable

from torch import fx

from ..fp8.recipe import Recipe
from ..machinery.region import is_input
from ..ops.grouped import BasicGroupedLinear
from ..ops.linear import BasicLinear
from ..families.grouped_linear.recognizers import grouped_backward, weight_source
from .fp8_backward import LinearGrads, linear_grads
from .inputs import GraphInput, dynamo_index, output_keys

__all__ = ["CompileSettings", "check_recipe", "check_filter", "Fp8Plan", "plan_fp8", "unfused_fp8"]


def check_recipe(recipe, who: str = "opfuse backend: options['fp8']") -> Recipe | None:
    """``recipe`` when it is an :mod:`opfuse.fp8` recipe (or ``None``); else a ``TypeError``
    naming the accepted values."""
    if recipe is None or isinstance(recipe, Recipe):
        return recipe
    raise TypeError(f"{who}={recipe!r}; expected an opfuse.fp8 recipe: opfuse.fp8.TensorScaling() or "
                    f"opfuse.fp8.RowwiseScaling() (or None for no FP8)")


def check_filter(fn, recipe, who: str = "opfuse backend: options['fp8_filter']"):
    if fn is None:
        return None
    if not callable(fn):
        raise TypeError(f"{who}={fn!r}; expected a function (fqn: str, module) -> bool")
    if recipe is None:
        raise ValueError(f"{who} given without an FP8 recipe (fp8=opfuse.fp8.TensorScaling() or RowwiseScaling())")
    return fn


@dataclasses.dataclass
class CompileSettings:
    """What one backend call compiles with: the FP8 recipe and filter, which model parameter each
    input of the Dynamo graph is, and whether Inductor compiles the result."""

    fp8: Recipe | None = None
    fp8_filter: Callable | None = None
    inputs: list[GraphInput] = dataclasses.field(default_factory=list)
    #: Inputs the fused graphs read as one view of their storage (:mod:`.layout_guard`).
    joined: list = dataclasses.field(default_factory=list)
    #: ``id`` of the linears that route rewritten MoE blocks (kept in high precision).
    routers: set = dataclasses.field(default_factory=set)
    #: Inductor compiles the fused graphs (``False``: ``options={"inductor": False}``, run eagerly).
    inductor: bool = True
    #: Inductor compiles them into CUDA graphs (``mode="reduce-overhead"``, ``triton.cudagraphs``).
    cuda_graphs: bool = False
    #: What the backend changed in Inductor's settings for this graph, and why (``explain()`` lists them).
    notes: list[str] = dataclasses.field(default_factory=list)

    def input_of(self, placeholder: fx.Node) -> GraphInput | None:
        """The Dynamo input a joint-graph placeholder stands for."""
        index = dynamo_index(placeholder)
        if index is None or index >= len(self.inputs):
            return None
        return self.inputs[index]


@dataclasses.dataclass
class Fp8Plan:
    """Which op-graph GEMMs stay in high precision (node name -> reason) and the backward GEMMs
    of the others."""

    exempt: dict[str, str] = dataclasses.field(default_factory=dict)
    grads: dict[str, LinearGrads] = dataclasses.field(default_factory=dict)
    fp8: list[str] = dataclasses.field(default_factory=list)
    notes: list[str] = dataclasses.field(default_factory=list)


def _is_router(settings: CompileSettings, weight: fx.Node) -> bool:
    found = settings.input_of(weight)
    return found is not None and found.module is not None and id(found.module) in settings.routers


def _describe(settings: CompileSettings, weight: fx.Node) -> tuple[str, object]:
    """``(module fqn, module)`` owning the weight graph input ``weight`` (for a view of inputs,
    the stacked experts of an MoE block: the first input's)."""
    weight = weight_source(weight) or weight
    found = settings.input_of(weight)
    if found is None or found.name is None:
        return weight.name, None
    return found.module_name, found.module


def _keep(settings: CompileSettings, name: str, module) -> bool:
    if settings.fp8_filter is None:
        return True
    verdict = settings.fp8_filter(name, module)
    if not isinstance(verdict, bool):
        raise TypeError(f"opfuse: fp8_filter({name!r}, {type(module).__name__}) returned {verdict!r}; expected "
                        f"True (FP8) or False (high precision)")
    return verdict


def _detach_weight_gradient(gm: fx.GraphModule, linear: fx.Node, grads: LinearGrads) -> None:
    """In the op graph, let the weight-gradient GEMM read a stand-in for the FP8 input the forward
    keeps (a placeholder named ``<linear>_fp8_input``) instead of the high-precision input: after
    lowering it reads that payload, so the input (a norm's output) has no other reader and its
    producer may emit FP8 (the op graph decides what may fuse from who reads what; it is not run)."""
    if grads.wgrad is None:
        return
    copies = {n.name: n for n in gm.graph.nodes if n.op == "call_function"}
    wgrad = copies.get(grads.wgrad.name)
    if wgrad is None:
        return
    x_side = wgrad.args[1] if not grads.wgrad_transposed else wgrad.args[0]
    with gm.graph.inserting_before(next(iter(gm.graph.nodes))):
        saved = gm.graph.placeholder(f"{linear.name}_fp8_input")
    saved.meta.update({k: v for k, v in x_side.meta.items() if k.startswith("opfuse_")})
    wgrad.replace_input_with(x_side, saved)
    # Opaque views of the input that only the weight gradient read go too.
    stack = [x_side]
    while stack:
        node = stack.pop()
        if node.op == "call_function" and not node.users:
            inputs = node.all_input_nodes
            gm.graph.erase_node(node)
            stack.extend(inputs)


def plan_fp8(op_graph, aten_gm: fx.GraphModule, settings: CompileSettings) -> Fp8Plan:
    """Decide, before the pass pipeline, which recognised GEMMs may become FP8 (module docstring)."""
    plan = Fp8Plan()
    graph = aten_gm.graph
    training = any(n.op == "placeholder" and n.name.startswith("tangents") for n in graph.nodes)
    outputs = output_keys(graph) if training else {}
    kept = []
    gm = op_graph.gm
    for node in gm.graph.nodes:
        if node.op != "call_module":
            continue
        op = gm.get_submodule(node.target)
        if not isinstance(op, (BasicLinear, BasicGroupedLinear)):
            continue
        region = op_graph.regions.get(node.name)
        weight = next(iter(region.params.values())).node
        name, module = _describe(settings, weight)
        reason = None
        if not is_input(weight_source(weight) or weight):
            # torch.autocast casts the float32 weight in the graph: the recipe quantizes parameters
            reason = "its weight is cast in the graph (torch.autocast over float32 parameters)"
        elif _is_router(settings, weight):
            reason = "MoE router: routing stays in high precision"
        elif not _keep(settings, name, module):
            reason = "fp8_filter"
        elif isinstance(op, BasicGroupedLinear):
            if training and grouped_backward(region.value) is None:
                reason = "backward not found: no grouped_linear_backward reads its operands"
        else:
            found = linear_grads(region, outputs, training)
            if isinstance(found, str):
                reason = f"backward not found: {found}"
            else:
                plan.grads[node.name] = found
                _detach_weight_gradient(gm, node, found)
        if isinstance(op, BasicGroupedLinear):
            name = f"{name.replace('.experts.0.', '.experts.*.')} (grouped)"
        if reason is None:
            plan.fp8.append(name)
        else:
            plan.exempt[node.name] = reason
            kept.append(f"{name} ({reason})")
    recipe = settings.fp8.describe()
    if plan.fp8:
        plan.notes.append(f"{recipe}: {len(plan.fp8)} projection GEMM(s) in FP8, forward and backward: "
                          f"{', '.join(plan.fp8)}")
    else:
        plan.notes.append(f"{recipe}: no projection GEMM (a linear whose weight is a graph input) of this graph "
                          f"runs in FP8" + ("" if kept else ": none was recognised"))
    if kept:
        plan.notes.append(f"{recipe}: kept in high precision: {', '.join(kept)}")
    return plan


def unfused_fp8(gm: fx.GraphModule) -> str | None:
    """A note when GEMMs the FP8 pass marked stayed unfused (rules or fusion switched off): only
    fused ops are lowered into a compiled graph, so those run in high precision there."""
    left = []
    for node in gm.graph.nodes:
        if node.op == "call_module":
            op = gm.get_submodule(node.target)
            if isinstance(op, (BasicLinear, BasicGroupedLinear)) and op.recipe is not None:
                left.append(node.name)
    if not left:
        return None
    return (f"{len(left)} GEMM(s) marked FP8 stayed unfused ({', '.join(left)}; a rule or fusion switched off): "
            f"a compiled graph runs unfused ops as written, in high precision")
