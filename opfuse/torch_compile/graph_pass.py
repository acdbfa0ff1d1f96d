"""The graph pass of the torch.compile backend: recognise opfuse ops in an aten graph, run the pass
pipeline (the same one ``ops.Sequential`` runs: rules, implementation choice, verify) on its op
graph, lower the fusions back to custom-op calls, and record a :class:`GraphProgram`.

It runs where Inductor runs its joint-graph custom passes (``joint_custom_post_pass``): on
AOTAutograd's joint forward+backward graph for training (before the partitioner decides what
the backward keeps, so a fused op's outputs, not the values it replaced, are what gets saved)
and on the forward graph for inference. By then DTensor and ``torch.distributed`` calls are
both explicit functional collectives.
"""

from __future__ import annotations

import itertools
import os
import time
from typing import Callable

from torch import fx
from torch._inductor.custom_graph_pass import CustomGraphPass

from ..config import config
from ..core.pipeline import PassContext, run_pipeline
from ..core.recorder import PassRecorder, new_dump_dir
from .agree import check_ranks_agree
from .batch_weight_casts import batch_weight_casts
from .fp8 import CompileSettings, plan_fp8, unfused_fp8
from .casts import merge_duplicate_casts
from .chunked_all_reduce import plan_chunked_all_reduces, split_all_reduces
from .fp8_aten import producers_in_aten
from .fp8_lower import JointLowering
from .direct_calls import use_direct_overloads
from .group_counts import integer_histogram_counts
from .grouped_attention import fold_grouped_queries
from .joins import view_adjacent_concatenations
from .layout_guard import joined_inputs
from .lower import lower_fusions
from .op_graph import OpGraphModule, build_op_graph
from .overlap import defer_weight_gradients, fill_with_weight_work, plan_overlaps, schedule_overlaps
from .program import GraphProgram
from .sm_carveout import carve_sms_under_collectives
from .reference_fusions import left_to_inductor

__all__ = ["FusionPass", "PassChain", "fuse_graph"]

_graph_ids = itertools.count()


def _phases(op_gm: fx.GraphModule) -> dict[str, str]:
    """``"backward"`` for nodes that depend on a tangent (an incoming gradient), else ``"forward"``."""
    backward = set()
    for node in op_gm.graph.nodes:
        if node.op == "placeholder" and node.name.startswith("tangents"):
            backward.add(node)
        elif any(arg in backward for arg in node.all_input_nodes):
            backward.add(node)
    return {node.name: ("backward" if node in backward else "forward") for node in op_gm.graph.nodes}


def _write_aten(dump_dir: str | None, stem: str, gm: fx.GraphModule) -> None:
    if dump_dir is not None:
        with open(os.path.join(dump_dir, stem + ".py"), "w") as handle:
            handle.write(gm.print_readable(print_output=False, include_stride=False, include_device=True))


def _is_parameter(settings: CompileSettings, placeholder: fx.Node) -> bool:
    """Whether a joint-graph placeholder is one of the model's parameters or buffers."""
    found = settings.input_of(placeholder)
    return found is not None and found.name is not None


def fuse_graph(gm: fx.GraphModule, settings: CompileSettings | None = None) -> GraphProgram:
    """Fuse what the rules match in aten graph ``gm`` (edited in place); returns its program.
    ``settings``: the FP8 recipe and filter, and the model parameter of each input."""
    settings = settings or CompileSettings()
    # Before anything is rewritten: ranks compiling under different settings would rewrite their
    # collectives differently and hang in them (.agree).
    check_ranks_agree(gm, settings)
    started = time.perf_counter()
    index = next(_graph_ids)
    training = any(n.op == "placeholder" and n.name.startswith("tangents") for n in gm.graph.nodes)
    dump_dir = new_dump_dir("graph")
    _write_aten(dump_dir, "aten_before", gm)
    joined = view_adjacent_concatenations(gm.graph)
    casts = merge_duplicate_casts(gm.graph)
    integer_histogram_counts(gm.graph)
    _, attention_notes = fold_grouped_queries(gm)
    overlaps = plan_overlaps(gm.graph) if config.overlap_collectives == "auto" else []
    chunked = []
    if config.overlap_collectives == "auto" and settings.fp8 is None:
        chunked = plan_chunked_all_reduces(gm.graph, config.allreduce_chunks, exclude={o.issue for o in overlaps})
        split_all_reduces(gm.graph, chunked)
    op_graph = build_op_graph(gm, exclude={node for o in overlaps for node in (o.issue, o.wait)}
                              | {node for c in chunked for node in c.issues + c.waits})
    if casts:
        op_graph.notes.append(f"{casts} repeated dtype cast(s) of one value merged (torch.autocast casts per op)")
    op_graph.notes.extend(attention_notes)
    if joined:
        op_graph.notes.append(f"{joined} concatenation(s) of parameters stored back to back read as views of "
                              f"their storage (no copy)")
    phases = _phases(op_graph.gm)
    ctx = PassContext(recipe=settings.fp8, without_autograd=True,  # lowered under no_grad into an aten graph
                      joint_graph=training)
    grads = {}
    if settings.fp8 is not None:
        plan = plan_fp8(op_graph, gm, settings)
        ctx.fp8_exempt = plan.exempt
        ctx.notes.extend(("fp8", note) for note in plan.notes)
        grads = plan.grads
    recorder = PassRecorder(ctx, dump_dir, module_class=OpGraphModule)
    run_pipeline(op_graph.gm, ctx, recorder)
    if settings.fp8 is not None and unfused_fp8(op_graph.gm):
        ctx.notes.append(("fp8", unfused_fp8(op_graph.gm)))
    left = left_to_inductor(op_graph.gm, op_graph.aten) if settings.inductor else {}
    hideable = {gemm for o in overlaps for gemm in o.gemms}
    lowering = JointLowering(op_graph, gm, grads, hideable,
                             aten_producers=producers_in_aten(settings.inductor, settings.cuda_graphs))
    lower_fusions(op_graph, gm, lowering, left=left)
    if lowering.producers_written_as_aten:
        ctx.notes.append(("fp8", f"{len(lowering.producers_written_as_aten)} FP8 producer(s) written as aten ops for "
                                 f"Inductor to fuse and launch, not opfuse's kernels behind a custom op (no CUDA "
                                 f"graphs: a custom-op call's host time would exceed its kernels' gain; "
                                 f"OPFUSE_FP8_ATEN=never keeps the kernels): "
                                 f"{', '.join(lowering.producers_written_as_aten)}"))
    for names, what in ((lowering.gathers_written_as_aten, "all-gather + FP8 GEMM(s) written as aten ops (the "
                         "FP8 bytes gathered by a functional collective, then torch._scaled_mm)"),
                        (lowering.scatters_written_as_aten, "FP8 GEMM + reduce-scatter(s) written as aten ops "
                         "(torch._scaled_mm, then the reduce-scatter as a functional collective)")):
        if names:
            ctx.notes.append(("fp8", f"{len(names)} {what}, not the custom op's GEMM chunks over peer memory (no CUDA "
                                     f"graphs: that op's host time per call would exceed its overlap's gain; "
                                     f"OPFUSE_FP8_ATEN=never keeps it): {', '.join(names)}"))
    if left:
        ctx.fusions[:] = [record for record in ctx.fusions if record.fused_node not in left]
        ctx.notes.extend(("reference_fusions", why) for why in left.values())
    schedule_overlaps(gm.graph, overlaps)
    filled = fill_with_weight_work(gm.graph, lambda p: _is_parameter(settings, p)) \
        + defer_weight_gradients(gm.graph) if config.overlap_collectives == "auto" else []
    carved = carve_sms_under_collectives(gm.graph, config.overlap_sm_carveout) \
        if config.overlap_collectives == "auto" else []
    batched = batch_weight_casts(gm.graph, config.fp8_weight_batch_mb) if settings.fp8 is not None else []
    use_direct_overloads(gm.graph)
    gm.recompile()
    settings.joined.extend(joined_inputs(gm.graph))
    _write_aten(dump_dir, "aten_after", gm)
    fused_phases = {}
    for record in ctx.fusions:
        covered = [phases.get(name, "forward") for name in record.nodes]
        fused_phases[record.fused_node] = "backward" if "backward" in covered else "forward"
    program = GraphProgram(index, "training" if training else "inference", op_graph.gm, ctx.unfused, ctx.fusions,
                           fused_phases, [("torch_compile", note) for note in op_graph.notes + settings.notes]
                           + ctx.notes
                           + [("overlap", o.describe()) for o in overlaps] + [("overlap", c.describe()) for c in chunked]
                           + [("overlap", note) for note in filled + carved] + [("fp8", note) for note in batched],
                           len(gm.graph.nodes))
    program.overlap_decisions = [(o.wait.name, o.describe()) for o in overlaps]
    program.seconds = time.perf_counter() - started
    recorder.write_explanation(program)
    return program


class FusionPass(CustomGraphPass):
    """Inductor's ``joint_custom_post_pass``: :func:`fuse_graph`, then ``on_program(program)``.

    ``uuid()`` is ``None``, which keeps these graphs out of Inductor's FX-graph cache: a cached
    artifact would skip this pass, and with it the programs it records and the ``prepare()`` of
    the chosen implementations (peer-memory reservations) that its custom-op calls rely on.
    """

    def __init__(self, on_program: Callable[[GraphProgram], None], settings: CompileSettings | None = None):
        self.on_program = on_program
        self.settings = settings

    def __call__(self, graph: fx.Graph) -> None:
        self.on_program(fuse_graph(graph.owning_module, self.settings))

    def uuid(self):
        return None


class PassChain(CustomGraphPass):
    """Several joint-graph passes run as one (a pass the user configured, then opfuse's)."""

    def __init__(self, *passes):
        self.passes = passes

    def __call__(self, graph: fx.Graph) -> None:
        for item in self.passes:
            item(graph)

    def uuid(self):
        return None
