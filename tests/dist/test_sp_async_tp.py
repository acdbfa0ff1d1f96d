"""Sequence parallelism at batch > 1 with opfuse's gather/scatter fusions *and* Inductor's async TP
rewriting the same graphs (the pair opfuse/core/passes/sequence_batch.py refuses on CUDA): on CPU,
with torch's reference implementations of the symm-mem fused ops standing in for its CUDA ones
(tools/sp_async_tp_bisect.py --cpu), the pair's graphs compute what eager does. So the graph
rewrites of the two compose; what the GPU run got wrong lies in code only the CUDA path runs (the
keep's reference implementation is as wrong there as its peer-memory one: torch's CUDA symm-mem
path, docs/PERF_NOTES.model.md session 11)."""

import os
import sys

import pytest

from .harness import run

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _check(rank, world):
    sys.path.insert(0, os.path.join(ROOT, "tools"))
    from sp_async_tp_bisect import check_variant

    errors, rules, found = check_variant(rank, world, "both", batch=2, seq=8, cpu=True)
    assert max(errors.values()) < 1e-5, errors
    rules = {rule.split("=")[0] for rule in rules}  # "rule=implementation"
    assert {"linear_reduce_scatter_batch", "all_gather_keep"} <= rules, rules
    assert any("fused_all_gather_matmul" in graph for graph in found), found  # async TP did rewrite


@pytest.mark.dist
def test_batch_fusions_and_async_tp_rewrites_compose_on_cpu():
    pytest.importorskip("torch.distributed._symmetric_memory")
    run(_check, 2, timeout=600)
