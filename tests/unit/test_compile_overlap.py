"""The torch.compile front end leaves a collective to NCCL where independent GEMMs can hide it
(issue 26.1): the backward all-reduce of a column-parallel layer's input gradient next to that
layer's weight-gradient GEMMs. One gloo rank: the collectives are identities, the graphs are real.
"""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import opfuse
from opfuse.torch_compile import overlap
from ..megatron_tp import CopyToTP, ReduceFromTP

EAGER = {"inductor": False}
H, FFN = 32, 64


class TPBlock(nn.Module):
    """Megatron MLP block written by hand: ``norm(x + row(gelu(column(copy(x)))))``."""

    def __init__(self, group):
        super().__init__()
        self.group = group
        self.up = nn.Linear(H, FFN, bias=False)
        self.down = nn.Linear(FFN, H, bias=False)
        self.norm = nn.RMSNorm(H)

    def forward(self, x):
        h = CopyToTP.apply(x, self.group)
        y = ReduceFromTP.apply(self.down(F.gelu(self.up(h))), self.group)
        return self.norm(x + y)


@pytest.fixture
def cheap_collectives(monkeypatch):
    """A cost model under which this small block's weight-gradient GEMMs hide its all-reduce (the
    real constants need GEMMs of GPU size)."""
    monkeypatch.setattr(overlap, "LATENCY_BYTES", 0)
    monkeypatch.setattr(overlap, "FLOPS_PER_BYTE", 1)


pytestmark = pytest.mark.usefixtures("fresh_dynamo")


def _run(model, x, **settings):
    compiled = opfuse.optimize(model, options=EAGER)
    with opfuse.config.override(**settings):
        out = compiled(x)
        (grad,) = torch.autograd.grad(out.sum(), x)
    return compiled, out, grad


def test_backward_all_reduce_is_left_to_nccl_and_explained(world1, cheap_collectives):
    torch.manual_seed(0)
    model = TPBlock(world1)
    x = torch.randn(2, 8, H, requires_grad=True)
    compiled, out, grad = _run(model, x)
    want = model(x)
    (want_grad,) = torch.autograd.grad(want.sum(), x)
    torch.testing.assert_close(out, want)
    torch.testing.assert_close(grad, want_grad)
    (program,) = opfuse.programs(compiled)
    rules = [(f.rule, program.phases[f.fused_node]) for f in program.fusions]
    assert ("allreduce", "backward") not in rules, rules  # the backward all-reduce stays with NCCL
    assert ("allreduce_add_rmsnorm", "forward") in rules  # the forward one has nothing to hide under
    assert len(program.overlap_decisions) == 1
    text = program.explain()
    assert "left to NCCL" in text and "independent GEMM" in text and "OPFUSE_OVERLAP_COLLECTIVES" in text


def test_fuse_setting_fuses_every_collective(world1, cheap_collectives):
    torch.manual_seed(0)
    model = TPBlock(world1)
    x = torch.randn(2, 8, H, requires_grad=True)
    compiled, _, _ = _run(model, x, overlap_collectives="fuse")
    (program,) = opfuse.programs(compiled)
    assert not program.overlap_decisions
    assert ("allreduce", "backward") in [(f.rule, program.phases[f.fused_node]) for f in program.fusions]


def test_real_cost_model_fuses_a_small_all_reduce(world1):
    """At this size the collective's latency dwarfs the GEMMs: fusing it wins."""
    torch.manual_seed(0)
    compiled, _, _ = _run(TPBlock(world1), torch.randn(2, 8, H, requires_grad=True))
    (program,) = opfuse.programs(compiled)
    assert not program.overlap_decisions


def test_schedule_issues_early_and_waits_late(world1, cheap_collectives):
    """In the scheduled graph the weight-gradient GEMM runs between the all-reduce and its wait."""
    from torch._functorch.aot_autograd import aot_module_simplified
    from torch._inductor.compile_fx import select_decomp_table

    torch.manual_seed(0)
    model = TPBlock(world1)
    seen = []

    def inspect(gm, _inputs):
        seen.append(gm)
        return gm.forward

    def backend(gm, inputs):
        def joint_pass(joint, joint_inputs, **kwargs):
            from torch._functorch.partitioners import default_partition

            planned = overlap.plan_overlaps(joint.graph)
            overlap.schedule_overlaps(joint.graph, planned)
            joint.recompile()
            seen.append(planned)
            return default_partition(joint, joint_inputs, **kwargs)

        return aot_module_simplified(gm, inputs, fw_compiler=inspect, bw_compiler=inspect, partition_fn=joint_pass,
                                     decompositions=select_decomp_table())

    x = torch.randn(2, 8, H, requires_grad=True)
    torch.compile(model, backend=backend)(x).sum().backward()
    (planned,) = [s for s in seen if isinstance(s, list)]
    assert len(planned) == 1
    backward = seen[-1].graph
    order = {n.name: i for i, n in enumerate(backward.nodes)}
    issue = next(n for n in backward.nodes if "all_reduce" in str(n.target))
    wait = next(n for n in backward.nodes if "wait_tensor" in str(n.target) and n.args[0] is issue)
    between = [n for n in backward.nodes if order[issue.name] < order[n.name] < order[wait.name]]
    assert any("mm" in str(n.target) for n in between), [n.name for n in between]


def test_inductor_keeps_the_gemms_under_the_collective(world1, cheap_collectives):
    """Compiled by Inductor, the backward issues the all-reduce, runs the weight-gradient GEMMs,
    then waits (Inductor's peak-memory reordering would move the wait back before them)."""
    from torch._inductor.utils import run_and_get_code

    torch.manual_seed(0)
    model = TPBlock(world1)
    x = torch.randn(2, 8, H, requires_grad=True)
    compiled = opfuse.optimize(model)
    _, codes = run_and_get_code(lambda: compiled(x).sum().backward())
    backward = next(code for code in codes if "all_reduce_" in code and "wait_tensor" in code)
    lines = [line.strip() for line in backward.splitlines()]
    issue = next(i for i, line in enumerate(lines) if "all_reduce_" in line and not line.startswith("#"))
    wait = next(i for i, line in enumerate(lines) if "wait_tensor" in line and not line.startswith("#"))
    assert any("extern_kernels.mm" in line for line in lines[issue + 1:wait]), "\n".join(lines[issue:wait + 1])
    torch.testing.assert_close(x.grad, torch.autograd.grad(model(x).sum(), x)[0])


def test_async_tp_is_turned_off_under_cuda_graphs_and_explained():
    """Inductor's fused matmul + collective ops allocate their workspace during a cudagraph tree's
    warm-up, inside the graph's pool, which the tree refuses: the backend turns micro-pipeline TP
    off for graphs with collectives compiled with CUDA graphs, and only for those."""
    from torch._inductor import config as inductor_config

    from opfuse.torch_compile import backend
    from opfuse.torch_compile.fp8 import CompileSettings

    def with_collective(x):
        return torch.ops._c10d_functional.wait_tensor(torch.ops._c10d_functional.all_reduce(x, "sum", "0")) + 1

    collective, plain = torch.fx.symbolic_trace(with_collective), torch.fx.symbolic_trace(lambda x: x + 1)
    with inductor_config.patch(_micro_pipeline_tp=True):
        for gm, patches, turned_off in [(collective, {"triton.cudagraphs": True}, True),
                                        (plain, {"triton.cudagraphs": True}, False),
                                        (collective, {}, False),
                                        (collective, {"triton.cudagraphs": True, "_micro_pipeline_tp": False}, False)]:
            settings = CompileSettings()
            before = dict(patches)
            backend._no_async_tp_under_graphs(gm, patches, inductor_config, settings)
            if turned_off:
                assert patches["_micro_pipeline_tp"] is False
                assert len(settings.notes) == 1 and "cudagraph" in settings.notes[0], settings.notes
            else:
                assert patches == before and not settings.notes, (patches, settings.notes)
