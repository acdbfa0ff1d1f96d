"""The torch.compile front end leaves a collective to NCCL where independent GEMMs can hide it
(issue 26.1): the backward all-reduce of a column-parallel layer's input gradient next to that
layer's weight-gradient GEMMs, and the backward reduce-scatter of a sequence-parallel layer's
all-gathered input, bf16 and FP8 alike. One gloo rank: the collectives are identities, the graphs
are real.
"""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import opfuse
from opfuse.torch_compile import overlap
from ..collectives_compat import all_gather, reduce_scatter
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


class SPBlock(nn.Module):
    """Megatron sequence parallelism by hand: ``x + reduce_scatter(down(gelu(up(all_gather(norm(x))))))``.
    Its backward reduce-scatters the gathered input's gradient; ``up``'s and ``down``'s weight
    gradients do not depend on it."""

    def __init__(self, group):
        super().__init__()
        self.group = group
        self.norm = nn.RMSNorm(H)
        self.up = nn.Linear(H, FFN, bias=False)
        self.down = nn.Linear(FFN, H, bias=False)

    def forward(self, x):
        gathered = all_gather(self.norm(x), 0, self.group)
        return x + reduce_scatter(self.down(F.gelu(self.up(gathered))), "sum", 0, self.group)


def _between(code: str, issue_name: str) -> list[str]:
    """The lines of Inductor's generated ``code`` between the first ``issue_name`` call and the
    first ``wait_tensor``."""
    lines = [line.strip() for line in code.splitlines() if not line.strip().startswith("#")]
    issue = next(i for i, line in enumerate(lines) if issue_name in line)
    wait = next(i for i, line in enumerate(lines) if "wait_tensor" in line and i > issue)
    return lines[issue + 1:wait]


def _fp8_against_the_recipe(make, recipe, x):
    """``(program, Inductor's backward code)`` of ``make()`` compiled with FP8 ``recipe``, its
    output and every gradient checked against a second ``make()`` with the same weights whose
    ``up`` and ``down`` run the recipe's emulation."""
    from torch._inductor.utils import run_and_get_code

    from opfuse import fp8

    torch.manual_seed(0)
    model, reference = make(), make()
    reference.load_state_dict(model.state_dict())
    for layer in (reference.up, reference.down):
        layer.forward = (lambda lin: lambda t: fp8.fp8_linear(t, lin.weight, None, recipe))(layer)
    compiled = opfuse.optimize(model, fp8=recipe)
    xc, xr = x.clone().requires_grad_(), x.clone().requires_grad_()
    out = compiled(xc)
    _, codes = run_and_get_code(lambda: out.sum().backward())
    want = reference(xr)
    want.sum().backward()
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
    for got, ref in [(xc.grad, xr.grad)] + [(p.grad, q.grad) for p, q in zip(model.parameters(),
                                                                            reference.parameters())]:
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    (program,) = opfuse.programs(compiled)
    return program, codes


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


def test_backward_reduce_scatter_is_left_to_nccl_with_the_weight_gradients_under_it(world1, cheap_collectives):
    """Sequence parallelism: the reduce-scatter of the gathered input's gradient is issued before
    the weight-gradient GEMMs and waited for after them, in the code Inductor generates; outputs
    and gradients are eager's."""
    from torch._inductor.utils import run_and_get_code

    torch.manual_seed(0)
    model = SPBlock(world1)
    x = torch.randn(16, H, requires_grad=True)
    compiled = opfuse.optimize(model)
    out, codes = run_and_get_code(lambda: compiled(x))
    _, codes = run_and_get_code(lambda: out.sum().backward())
    want = model(x)
    torch.testing.assert_close(out, want)
    torch.testing.assert_close(x.grad, torch.autograd.grad(want.sum(), x)[0])
    (program,) = opfuse.programs(compiled)
    assert len(program.overlap_decisions) == 1, program.explain()
    assert "reduce-scatter" in program.overlap_decisions[0][1] and "left to NCCL" in program.explain()
    backward = next(code for code in codes if "reduce_scatter_tensor" in code)
    between = _between(backward, "reduce_scatter_tensor")
    assert sum("extern_kernels.mm" in line for line in between) == 2, "\n".join(between)


def test_fp8_weight_gradients_run_under_the_backward_reduce_scatter(world1, cheap_collectives, monkeypatch):
    """With FP8 (the GEMMs written as aten ops, as on GPUs) the weight-gradient ``_scaled_mm``
    calls run under the reduce-scatter, and the gradients are still the recipe's."""
    from opfuse import fp8
    from opfuse.torch_compile import fp8_aten

    monkeypatch.setattr(fp8_aten, "IMPLEMENTATIONS", {"reference"})  # the CPU stand-in for scaled_mm
    program, codes = _fp8_against_the_recipe(lambda: SPBlock(world1), fp8.TensorScaling(), torch.randn(16, H))
    assert len(program.overlap_decisions) == 1, program.explain()
    backward = next(code for code in codes if "reduce_scatter_tensor" in code)
    between = _between(backward, "reduce_scatter_tensor")
    assert sum("_scaled_mm" in line for line in between) == 2, "\n".join(between)


def test_weight_only_work_moves_under_the_forward_collective(world1):
    """Work that reads only weights (here a cast standing in for FP8 weight quantization) moves
    from after a forward all-gather's wait to between its issue and wait (each weight's under the
    collective it follows); activation work and the values computed stay as they were."""
    from opfuse.machinery.aten import aten, c10d

    group = world1.group_name

    def block(x, w1, w2, w3):
        gathered = c10d.wait_tensor.default(c10d.all_gather_into_tensor.default(x, 1, group))
        h = aten.relu.default(gathered)  # activation work: stays after the wait
        w1q = aten._to_copy.default(aten.mul.Tensor(w1, 2.0), dtype=torch.bfloat16)
        y = aten.mm.default(h, aten._to_copy.default(w1q, dtype=torch.float32).t())
        again = c10d.wait_tensor.default(c10d.all_gather_into_tensor.default(y, 1, group))
        w2q = aten._to_copy.default(aten.mul.Tensor(w2, 2.0), dtype=torch.bfloat16)
        out = aten.mm.default(again, aten._to_copy.default(w2q, dtype=torch.float32).t())
        # a parameter all-gather (FSDP): reads only a weight, but is a collective; it stays in place
        return aten.add.Tensor(out, c10d.wait_tensor.default(c10d.all_gather_into_tensor.default(w3, 1, group)))

    gm = torch.fx.symbolic_trace(block)
    x, w1, w2, w3 = torch.randn(4, 8), torch.randn(8, 8), torch.randn(8, 8), torch.randn(4, 8)
    want = gm(x, w1, w2, w3)
    weights = {"w1", "w2", "w3"}
    before = [n.name for n in gm.graph.nodes]
    found = overlap.weight_only(gm.graph, lambda p: p.name in weights)
    assert not any("all_gather" in n.name or "wait" in n.name for n in found), found
    notes = overlap.fill_with_weight_work(gm.graph, lambda p: p.name in weights)
    gm.recompile()
    order = {n.name: i for i, n in enumerate(gm.graph.nodes)}
    issues = [n for n in gm.graph.nodes if "all_gather" in str(n.target)]
    waits = [n for n in gm.graph.nodes if "wait_tensor" in str(n.target)]
    under_first = [n.name for n in gm.graph.nodes if order[issues[0].name] < order[n.name] < order[waits[0].name]]
    # w1's scale and two casts (its ``.t()`` is a method call, not an aten op: it stays)
    assert under_first == ["mul_tensor", "_to_copy_default", "_to_copy_default_1"], under_first
    assert order["relu_default"] > order[waits[0].name]
    # w2's work follows the second all-gather: it moves under that one, not the first
    assert all(order[issues[1].name] < order[n] < order[waits[1].name]
               for n in ("mul_tensor_1", "_to_copy_default_2", "_to_copy_default_3"))
    assert len(notes) == 2 and "3 weight-only op(s)" in notes[0] and waits[0].name in notes[0], notes
    after = [n.name for n in gm.graph.nodes]
    assert after[-4:] == before[-4:]  # the parameter all-gather, its wait, the add, the output
    torch.testing.assert_close(gm(x, w1, w2, w3), want)


@pytest.mark.parametrize("block", ["tp", "sp"])
@pytest.mark.parametrize("rowwise", [False, True], ids=["tensor", "row"])
def test_fp8_custom_op_backward_splits_so_the_weight_gradient_runs_under_the_collective(
        world1, cheap_collectives, block, rowwise):
    """Where the FP8 backward stays a custom op (per-row scales; implementations not built on
    torch._scaled_mm), the linear whose input gradient is reduced gets a data-gradient call and a
    weight-gradient call, and the latter runs between the collective and its wait; gradients are
    the recipe's."""
    from opfuse import fp8

    recipe = fp8.RowwiseScaling() if rowwise else fp8.TensorScaling()
    make = (lambda: TPBlock(world1)) if block == "tp" else (lambda: SPBlock(world1))
    x = torch.randn(2, 8, H) if block == "tp" else torch.randn(16, H)
    program, codes = _fp8_against_the_recipe(make, recipe, x)
    assert len(program.overlap_decisions) == 1, program.explain()
    issue = "all_reduce" if block == "tp" else "reduce_scatter_tensor"
    backward = next(code for code in codes if issue in code and "wait_tensor" in code)
    between = _between(backward, issue)
    assert any("fp8_linear_backward" in line for line in between), "\n".join(between)


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_gemms_under_the_collective_leave_sms_to_it(world1, cheap_collectives, monkeypatch, fp8):
    """With ``overlap_sm_carveout`` the weight-gradient GEMMs between the reduce-scatter and its
    wait become carveout calls (``mm`` and ``_scaled_mm`` alike), the data-gradient GEMMs that feed
    the collective stay as they were, gradients are unchanged, the setting is restored after each call and explain() says it."""
    from torch._inductor.utils import run_and_get_code

    from opfuse import fp8 as opfuse_fp8
    from opfuse.torch_compile import fp8_aten

    with opfuse.config.override(overlap_sm_carveout=8):
        if fp8:
            monkeypatch.setattr(fp8_aten, "IMPLEMENTATIONS", {"reference"})
            program, codes = _fp8_against_the_recipe(lambda: SPBlock(world1), opfuse_fp8.TensorScaling(),
                                                     torch.randn(16, H))
        else:
            torch.manual_seed(0)
            model = SPBlock(world1)
            x = torch.randn(16, H, requires_grad=True)
            compiled = opfuse.optimize(model)
            out = compiled(x)
            _, codes = run_and_get_code(lambda: out.sum().backward())
            torch.testing.assert_close(x.grad, torch.autograd.grad(model(x).sum(), x)[0])
            (program,) = opfuse.programs(compiled)
    assert torch._C._get_sm_carveout_experimental() is None
    backward = next(code for code in codes if "reduce_scatter_tensor" in code)
    between = _between(backward, "reduce_scatter_tensor")
    op = "scaled_mm_sm_carveout" if fp8 else "mm_sm_carveout"
    assert sum(f"{op}.direct(" in line and not line.startswith("assert") for line in between) == 2, \
        "\n".join(between)
    calls = [line for line in backward.splitlines() if not line.strip().startswith(("#", "assert"))]
    before = calls[:next(i for i, line in enumerate(calls) if "reduce_scatter_tensor" in line)]
    # the data gradients, which feed the collective, keep all the SMs
    assert not any(op in line for line in before)
    assert any(("_scaled_mm" if fp8 else "extern_kernels.mm") in line for line in before), "\n".join(before)
    assert "the 2 GEMM(s) under the collective leave 8 SMs to NCCL" in program.explain(), program.explain()


def test_sm_carveout_setting_is_checked():
    with pytest.raises(ValueError, match="overlap_sm_carveout=-1.*integer >= 0"):
        opfuse.config.overlap_sm_carveout = -1


def test_dtensor_graphs_keep_the_collectives_where_the_schedule_put_them(world1, monkeypatch):
    """A DTensor model's Dynamo graph has no collective (AOTAutograd adds them when it lowers the
    subclass), so the backend recognises DTensor inputs: their graphs too are compiled without
    Inductor's peak-memory reordering, which otherwise moves every wait back before the GEMMs
    scheduled under it (measured on 2x H200: no NCCL kernel of a sequence-parallel FP8 step ran
    beside another kernel). A model without DTensors keeps Inductor's default."""
    from torch._inductor import compile_fx as compile_fx_module
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, distribute_tensor

    seen = []  # the backend's call's patches (compile_fx calls itself again inside them, with none)
    real = compile_fx_module.compile_fx

    def recording(gm, example_inputs, config_patches=None, **kwargs):
        if config_patches:
            seen.append(dict(config_patches))
        return real(gm, example_inputs, config_patches=config_patches, **kwargs)

    monkeypatch.setattr(compile_fx_module, "compile_fx", recording)
    mesh = init_device_mesh("cpu", (1,))
    torch.manual_seed(0)
    plain = nn.Linear(H, H, bias=False)
    sharded = nn.Linear(H, H, bias=False)
    sharded.weight = nn.Parameter(distribute_tensor(plain.weight.detach().clone(), mesh, [Replicate()]))
    x = torch.randn(4, H)
    out = opfuse.optimize(sharded)(distribute_tensor(x, mesh, [Replicate()]))
    torch.testing.assert_close(out.to_local(), plain(x))
    assert seen and seen[0].get("reorder_for_peak_memory") is False, seen
    seen.clear()
    opfuse.optimize(plain)(x)
    assert seen and "reorder_for_peak_memory" not in seen[0], seen
    seen.clear()
    with opfuse.config.override(overlap_collectives="fuse"):  # nothing left to NCCL: nothing to keep
        torch._dynamo.reset()
        opfuse.optimize(sharded)(distribute_tensor(x, mesh, [Replicate()]))
    assert seen and "reorder_for_peak_memory" not in seen[0], seen


class TwoSPBlocks(nn.Module):
    """Two :class:`SPBlock` in a row. In the backward, the second block's output-gradient all-gather
    feeds its GEMMs at once (nothing of its own to hide under), while the reduce-scatter before it
    holds two weight-gradient GEMMs."""

    def __init__(self, group):
        super().__init__()
        self.first, self.second = SPBlock(group), SPBlock(group)

    def forward(self, x):
        return self.second(self.first(x))


def _collective_windows(code: str, issue_name: str) -> list[list[str]]:
    """The lines between each ``issue_name`` call and its ``wait_tensor`` in Inductor's ``code``."""
    lines = [line.strip() for line in code.splitlines() if line.strip() and not line.strip().startswith("#")]
    windows = []
    for i, line in enumerate(lines):
        if issue_name in line and "=" in line and "assert" not in line:
            buffer = line.split("=")[0].strip()
            wait = next(j for j in range(i + 1, len(lines)) if f"wait_tensor.default({buffer})" in lines[j])
            windows.append(lines[i + 1:wait])
    return windows


@pytest.mark.parametrize("recipe", [None, "tensor"], ids=["bf16", "fp8"])
def test_exposed_backward_gather_gets_a_weight_gradient_from_the_reduction_before(world1, cheap_collectives,
                                                                                  monkeypatch, recipe):
    """The backward all-gather of a sequence-parallel output's gradient (no GEMM of its own) gets a
    weight-gradient GEMM that the previous reduce-scatter did not need (it keeps one); the
    gradients are those of the traced order (``OPFUSE_OVERLAP_COLLECTIVES=fuse``) and, in bf16,
    eager's; explain() says what moved."""
    from torch._inductor.utils import run_and_get_code

    from opfuse import fp8
    from opfuse.torch_compile import fp8_aten

    monkeypatch.setattr(fp8_aten, "IMPLEMENTATIONS", {"reference"})  # the CPU stand-in for scaled_mm
    kwargs = {"fp8": fp8.TensorScaling()} if recipe else {}
    torch.manual_seed(0)
    model = TwoSPBlocks(world1)
    x = torch.randn(16, H)

    def grads(setting):
        torch._dynamo.reset()
        xi = x.clone().requires_grad_()
        with opfuse.config.override(overlap_collectives=setting):
            compiled = opfuse.optimize(model, **kwargs)
            out = compiled(xi)
            params = list(model.parameters())
            _, codes = run_and_get_code(lambda: out.sum().backward(inputs=[xi] + params))
        got = [xi.grad] + [p.grad.clone() for p in params]
        model.zero_grad(set_to_none=True)
        return compiled, codes, got

    compiled, codes, got = grads("auto")
    _, _, traced = grads("fuse")
    for g, t in zip(got, traced):
        torch.testing.assert_close(g, t, rtol=1e-5, atol=1e-5)
    if recipe is None:
        xe = x.clone().requires_grad_()
        model(xe).sum().backward()
        torch.testing.assert_close(got[0], xe.grad)
    backward = next(code for code in codes if "all_gather_into_tensor" in code and "reduce_scatter_tensor" in code)
    gemm = ("extern_kernels.mm", "_scaled_mm")
    gathers = _collective_windows(backward, "all_gather_into_tensor")
    scatters = _collective_windows(backward, "reduce_scatter_tensor")
    assert len(gathers) == 2 and len(scatters) == 2, backward
    assert not any(g in line for g in gemm for line in gathers[0])  # the first has nothing before it to take
    assert any(g in line for g in gemm for line in gathers[1]), "\n".join(gathers[1])
    assert all(any(g in line for g in gemm for line in window) for window in scatters), scatters
    (program,) = opfuse.programs(compiled)
    assert "moved under this backward collective" in program.explain()


@pytest.mark.parametrize("recipe", [None, "tensor"], ids=["bf16", "fp8"])
def test_the_weight_gradient_moved_under_a_gather_leaves_sms_to_it(world1, cheap_collectives, monkeypatch, recipe):
    """With ``overlap_sm_carveout`` the weight-gradient GEMM that ``defer_weight_gradients`` moved
    under a backward all-gather becomes a carveout call too (measured on 2x H200 in session 20: the
    persistent GEMM held every SM and NCCL's gather started in its last microseconds), as do those
    under the reduce-scatters; the gradients are those without the carveout."""
    from torch._inductor.utils import run_and_get_code

    from opfuse import fp8
    from opfuse.torch_compile import fp8_aten

    monkeypatch.setattr(fp8_aten, "IMPLEMENTATIONS", {"reference"})
    kwargs = {"fp8": fp8.TensorScaling()} if recipe else {}
    torch.manual_seed(0)
    model = TwoSPBlocks(world1)
    x = torch.randn(16, H)

    def grads(sms):
        torch._dynamo.reset()
        xi = x.clone().requires_grad_()
        with opfuse.config.override(overlap_sm_carveout=sms):
            compiled = opfuse.optimize(model, **kwargs)
            out = compiled(xi)
            params = list(model.parameters())
            _, codes = run_and_get_code(lambda: out.sum().backward(inputs=[xi] + params))
        got = [xi.grad] + [p.grad.clone() for p in params]
        model.zero_grad(set_to_none=True)
        return compiled, codes, got

    compiled, codes, got = grads(8)
    _, _, plain = grads(0)
    for g, p in zip(got, plain):
        torch.testing.assert_close(g, p, rtol=1e-5, atol=1e-5)
    op = "scaled_mm_sm_carveout" if recipe else "mm_sm_carveout"
    backward = next(code for code in codes if "all_gather_into_tensor" in code and "reduce_scatter_tensor" in code)
    gathers = _collective_windows(backward, "all_gather_into_tensor")
    scatters = _collective_windows(backward, "reduce_scatter_tensor")
    assert any(f"{op}.direct(" in line for line in gathers[1]), "\n".join(gathers[1])
    assert all(any(f"{op}.direct(" in line for line in window) for window in scatters), scatters
    (program,) = opfuse.programs(compiled)
    assert program.explain().count("leave 8 SMs to NCCL") == 3, program.explain()
