"""GEMMs scheduled under a collective left to NCCL can leave some SMs free for it.

:mod:`.overlap` leaves a backward reduction to NCCL and orders the graph so that the weight-gradient
GEMMs run between its issue and its wait. That makes the two *able* to run together, not sure to:
cuBLAS's Hopper GEMMs are persistent (one block per SM, each SM held until the last tile), and
inside a CUDA graph the collective and the GEMMs are sibling nodes launched in no set order, so a
GEMM that reaches the SMs first can keep NCCL's kernel waiting for a free SM until it ends.

:func:`carve_sms_under_collectives` rewrites the GEMMs between a backward collective's issue and
wait (``aten._scaled_mm``, ``aten.mm``: those under the reductions left to NCCL, and the weight
gradients :func:`.overlap.defer_weight_gradients` moved under a gather) into calls that ask cuBLASLt for ``SMs - carveout`` SMs
(``CUBLASLT_MATMUL_DESC_SM_COUNT_TARGET``, which torch sets from
``torch._C._set_sm_carveout_experimental`` for the call), so that NCCL's blocks find SMs at once.
The GEMM then runs on fewer SMs for its whole length: a carveout pays only where the collective it
uncovers is longer than that slowdown. ``opfuse.config.overlap_sm_carveout``
(``OPFUSE_OVERLAP_SM_CARVEOUT``, SMs) sets it; 0, the default, leaves the GEMMs alone (what it
gave on GPUs: docs/PERF_NOTES.md, "Results, session 21").
"""

from __future__ import annotations

import contextlib
from typing import Optional

import torch
from torch import Tensor, fx

from ..machinery.aten import aten, calls
from ..machinery.fused_op import graph_op
from .overlap import backward_nodes, issued_collectives

__all__ = ["carve_sms_under_collectives", "scaled_mm_sm_carveout", "mm_sm_carveout"]


@contextlib.contextmanager
def _carveout(sms: int, through_lt: bool):
    """cuBLASLt GEMMs issued inside target ``SMs - sms`` SMs; ``through_lt`` routes ``mm`` through
    cuBLASLt for the scope (the cuBLAS path does not read the carveout). torch prints once per
    process that the setting is experimental."""
    previous = torch._C._get_sm_carveout_experimental()
    backend = torch._C._get_blas_preferred_backend()
    torch._C._set_sm_carveout_experimental(sms)
    if through_lt:
        torch._C._set_blas_preferred_backend(torch._C._BlasBackend.Cublaslt)
    try:
        yield
    finally:
        torch._C._set_sm_carveout_experimental(previous)
        if through_lt:
            torch._C._set_blas_preferred_backend(backend)


def _check_sms(sms: int, device: torch.device) -> None:
    """A carveout must leave the GEMM at least one SM of ``device``."""
    if device.type != "cuda":
        return
    count = torch.cuda.get_device_properties(device).multi_processor_count
    if not 0 <= sms < count:
        raise ValueError(f"opfuse: OPFUSE_OVERLAP_SM_CARVEOUT={sms} (opfuse.config.overlap_sm_carveout) leaves the "
                         f"GEMMs no SM of the {count} on {torch.cuda.get_device_name(device)}; accepted: 0 to "
                         f"{count - 1}")


def _scaled_mm_fake(a, b, scale_a, scale_b, bias, out_dtype, use_fast_accum, carveout):
    return a.new_empty((a.shape[0], b.shape[1]), dtype=out_dtype or a.dtype)


@graph_op("opfuse::scaled_mm_sm_carveout", _scaled_mm_fake)
def scaled_mm_sm_carveout(a: Tensor, b: Tensor, scale_a: Tensor, scale_b: Tensor, bias: Optional[Tensor],
                          out_dtype: Optional[torch.dtype], use_fast_accum: bool, carveout: int) -> Tensor:
    """``torch._scaled_mm(a, b, scale_a, scale_b, bias=bias, out_dtype=out_dtype,
    use_fast_accum=use_fast_accum)`` leaving ``carveout`` SMs free."""
    _check_sms(carveout, a.device)
    if a.stride(-1) != 1:
        a = a.contiguous()
    if b.stride(0) != 1:
        b = b.t().contiguous().t()
    with _carveout(carveout, through_lt=False):
        return torch._scaled_mm(a, b, scale_a, scale_b, bias=bias, out_dtype=out_dtype, use_fast_accum=use_fast_accum)


def _mm_fake(a, b, carveout):
    return a.new_empty((a.shape[0], b.shape[1]))


@graph_op("opfuse::mm_sm_carveout", _mm_fake)
def mm_sm_carveout(a: Tensor, b: Tensor, carveout: int) -> Tensor:
    """``a @ b`` leaving ``carveout`` SMs free."""
    _check_sms(carveout, a.device)
    with _carveout(carveout, through_lt=a.is_cuda and torch.version.hip is None):
        return torch.mm(a, b)


def _rewrite(graph: fx.Graph, node: fx.Node, sms: int) -> bool:
    """Replace GEMM ``node`` with its carveout twin; False where it has none (a scaled GEMM with an
    output scale, arguments this op does not take)."""
    if calls(node, aten.mm.default):
        target, args = torch.ops.opfuse.mm_sm_carveout.default, (*node.args, sms)
    else:
        schema = node.target._schema.arguments
        kw = {arg.name: arg.default_value for arg in schema if arg.has_default_value()}
        kw.update(zip((arg.name for arg in schema), node.args))
        kw.update(node.kwargs)
        if kw.get("scale_result") is not None or set(kw) != {arg.name for arg in schema}:
            return False
        target = torch.ops.opfuse.scaled_mm_sm_carveout.default
        args = (kw["self"], kw["mat2"], kw["scale_a"], kw["scale_b"], kw.get("bias"), kw.get("out_dtype"),
                bool(kw.get("use_fast_accum", False)), sms)
    with graph.inserting_before(node):
        new = graph.call_function(target, args)
    new.meta.update({key: item for key, item in node.meta.items() if key != "eager_input_vals"})
    traced = [a.meta.get("val") if isinstance(a, fx.Node) else a for a in args]
    if all(t is not None for t, a in zip(traced, args) if isinstance(a, fx.Node)):
        # Inductor lays a custom op's arguments out as these were when traced (a GEMM operand
        # transposed stays transposed: cuBLASLt takes row- and column-major operands only)
        new.meta["eager_input_vals"] = (tuple(traced), {})
    node.replace_all_uses_with(new)
    graph.erase_node(node)
    return True


def carve_sms_under_collectives(graph: fx.Graph, sms: int) -> list[str]:
    """Rewrite the GEMMs scheduled between each backward collective's issue and wait (the
    reductions :mod:`.overlap` left to NCCL and the gathers it gave a weight-gradient GEMM; see
    the module docstring) to leave ``sms`` SMs to the collective; a line per collective for
    ``explain()``."""
    if sms <= 0:
        return []
    backward = backward_nodes(graph)
    notes = []
    for issue, wait in issued_collectives(graph):
        if issue not in backward:
            continue
        gemms, node = [], issue.next
        while node is not wait and node.op != "output":
            if calls(node, aten.mm.default, aten._scaled_mm.default):
                gemms.append(node)
            node = node.next
        if gemms and isinstance(gemms[0].meta.get("val"), torch.Tensor):
            _check_sms(sms, gemms[0].meta["val"].device)
        done = sum(_rewrite(graph, gemm, sms) for gemm in gemms)
        if done:
            notes.append(f"{wait.name}: the {done} GEMM(s) under the collective leave {sms} SMs to NCCL "
                         f"(OPFUSE_OVERLAP_SM_CARVEOUT={sms})")
    if notes:
        graph.lint()
    return notes
