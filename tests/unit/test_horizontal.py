"""The horizontal_gemm pass and GatedLinear on one process: fused == unfused == float64 formulas
(outputs and every gradient), zero-copy joined weights, hand-built graphs through run_pipeline,
and the SwiGLU layout error (the tensor-parallel cases are in tests/dist/test_horizontal.py)."""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import fx

import opfuse
from opfuse import ops
from opfuse.ops.packing import adjacent, join_rows, pack_rows_
from opfuse.passes import PassContext, disabled_passes
from opfuse.core.pipeline import run_pipeline

from .test_ops import randomize_

DT = torch.float64
H, FFN = 8, 12
ACT = {"silu": F.silu, "gelu": F.gelu, "gelu_tanh": lambda t: F.gelu(t, approximate="tanh")}


def gated_mlp(bias, activation, dtype=DT):
    return ops.Sequential(ops.RMSNorm(H, dtype=dtype),
                          ops.GatedLinear(H, FFN, bias=bias, activation=activation, dtype=dtype),
                          ops.Linear(FFN, H, bias=False, dtype=dtype))


def reference(block, x, activation):
    """The MLP from float64 formulas over leaf copies of the parameters: (y, leaves)."""
    norm, gated, down = block
    leaves = {name: p.detach().to(DT).clone().requires_grad_() for name, p in block.named_parameters()}
    h = x / torch.sqrt((x * x).mean(-1, keepdim=True) + 1e-6) * leaves["0.weight"]
    gate, up = F.linear(h, leaves["1.gate_weight"]), F.linear(h, leaves["1.up_weight"])
    if gated.gate_bias is not None:
        gate, up = gate + leaves["1.gate_bias"], up + leaves["1.up_bias"]
    return F.linear(ACT[activation](gate) * up, leaves["2.weight"]), leaves


def run(block, x, dy, fuse=True):
    block.zero_grad()
    x = x.clone().requires_grad_()
    with opfuse.config.override(fuse=fuse):
        y = block(x)
        program = opfuse.compile(block, x)
    y.backward(dy)
    return y.detach(), x.grad, {name: p.grad.clone() for name, p in block.named_parameters()}, program


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("activation", ["silu", "gelu", "gelu_tanh"])
def test_gated_mlp_fused_equals_unfused_and_formulas(rng, bias, activation):
    block = randomize_(gated_mlp(bias, activation), rng)
    x, dy = torch.randn(5, H, generator=rng, dtype=DT), torch.randn(5, H, generator=rng, dtype=DT)
    xr = x.clone().requires_grad_()
    y_ref, leaves = reference(block, xr, activation)
    y_ref.backward(dy)
    fused, unfused = run(block, x, dy, True), run(block, x, dy, False)
    gemm, gated = [f for f in fused[3].fusions if f.rule == "horizontal_gemm"]
    covered = ["BasicLinear", "Bias"] * 2 if bias else ["BasicLinear"] * 2
    assert gemm.by == "pass" and list(gemm.ops) == covered and gemm.impl == "reference"
    assert gated.ops == ("GatedActivation",) and gated.impl == "reference"  # reads the packed [gate | up]
    assert not any(f.rule == "horizontal_gemm" for f in unfused[3].fusions)
    for y, dx, grads, _ in (fused, unfused):
        torch.testing.assert_close(y, y_ref.detach(), atol=1e-12, rtol=1e-12)
        torch.testing.assert_close(dx, xr.grad, atol=1e-12, rtol=1e-12)
        for name, grad in grads.items():
            torch.testing.assert_close(grad, leaves[name].grad, atol=1e-12, rtol=1e-12, msg=name)


def test_the_joined_weight_is_a_view_of_the_parameters(rng):
    block = randomize_(gated_mlp(True, "silu", torch.float32), rng).double()   # .to() moves each parameter
    gated = block[1]
    assert adjacent([gated.gate_weight, gated.up_weight]) and adjacent([gated.gate_bias, gated.up_bias])
    joined = join_rows([gated.gate_weight, gated.up_weight])
    assert joined.data_ptr() == gated.gate_weight.data_ptr() and joined.shape == (2 * FFN, H)
    x = torch.randn(3, H, dtype=DT, generator=rng)
    program = opfuse.compile(block, x)
    fused = [n for n in program.graph_module.graph.nodes if n.name == "fused_horizontal_gemm"]
    assert fused and program.graph_module.get_submodule(fused[0].target).weights[0] is gated.gate_weight
    # An optimizer step (in place) is seen by the next call: nothing was copied at compile time.
    with torch.no_grad():
        gated.up_weight.add_(1.0)
    y_ref, _ = reference(block, x, "silu")
    torch.testing.assert_close(block(x), y_ref.detach())
    block.load_state_dict({k: v.clone() for k, v in block.state_dict().items()})
    assert adjacent([gated.gate_weight, gated.up_weight])


def test_join_rows_gradients_and_packing(rng):
    buf = torch.randn(7, 3, dtype=DT, generator=rng)
    a, b = torch.nn.Parameter(buf[:3]), torch.nn.Parameter(buf[3:])
    apart = torch.nn.Parameter(torch.randn(2, 3, dtype=DT, generator=rng))
    assert adjacent([a, b]) and not adjacent([b, a]) and not adjacent([a, apart])
    for tensors in ([a, b], [b, apart]):
        joined = join_rows(tensors)
        assert (joined.data_ptr() == tensors[0].data_ptr()) == (tensors[1] is b)
        g = torch.randn(joined.shape, dtype=DT, generator=rng)
        joined.backward(g)
        for t, part in zip(tensors, g.split([t.shape[0] for t in tensors])):
            torch.testing.assert_close(t.grad, part)
            t.grad = None
    before = (b.detach().clone(), apart.detach().clone())
    pack_rows_([b, apart])
    assert adjacent([b, apart]) and torch.equal(b, before[0]) and torch.equal(apart, before[1])
    with pytest.raises(ValueError, match="differ in dtype, device or trailing shape"):
        pack_rows_([a, torch.nn.Parameter(torch.zeros(2, 4, dtype=DT))])


def test_disabled_pass_or_fuse_off_leaves_two_gemms(rng):
    block, x = randomize_(gated_mlp(False, "silu"), rng), torch.randn(2, H, dtype=DT)
    with disabled_passes("horizontal_gemm"):
        program = opfuse.compile(block, x)
    assert [f.rule for f in program.fusions] == ["add_rmsnorm"]
    gemms = [n.name for n in program.graph_module.graph.nodes if n.op == "call_module"
             and program.graph_module.get_submodule(n.target).kind == "BasicLinear"]
    assert gemms == ["op1_gated_linear_gate", "op1_gated_linear_up", "op2_linear_basic_linear"]


# Hand-built graphs, compiled through the pipeline's one entry point (as the torch.compile front end does)


def qkv_graph(rng, packed):
    """x -> (q, k, v, o) with four BasicLinears on x; q/k/v weights in one buffer when ``packed``."""
    weights = [torch.nn.Parameter(torch.randn(n, H, dtype=DT, generator=rng)) for n in (H, 4, 4, 6)]
    if packed:
        pack_rows_(weights[:3])
    root, graph = torch.nn.Module(), fx.Graph()
    x = graph.placeholder("x")
    x.meta["opfuse_meta"] = ops.TensorMeta((5, H), DT, torch.device("cpu"), True)
    x.meta["opfuse_sharding"] = ops.Sharding()
    outs = []
    for name, w in zip(("q", "k", "v", "o"), weights):
        root.add_module(name, ops.BasicLinear(H, w.shape[0], weight=w))
        node = graph.call_module(name, (x,))
        node.meta["opfuse_meta"] = ops.TensorMeta((5, w.shape[0]), DT, torch.device("cpu"), True)
        node.meta["opfuse_sharding"] = ops.Sharding()
        outs.append(node)
    graph.output(tuple(outs))
    ctx = PassContext()
    gm = fx.GraphModule(root, graph)
    run_pipeline(gm, ctx, lambda name, module: None)
    return gm, ctx, weights


@pytest.mark.parametrize("packed", [True, False])
def test_hand_built_graph_through_run_pipeline(rng, packed):
    gm, ctx, weights = qkv_graph(rng, packed)
    fused = [r for r in ctx.fusions if r.rule == "horizontal_gemm"]
    if packed:
        (record,) = fused
        assert record.nodes == ("q", "k", "v")
        assert any("o read x as other GEMMs do, but their weights are stored apart" in m for _, m in ctx.notes)
    else:
        assert fused == [] and len(ctx.notes) == 1
    x = torch.randn(5, H, dtype=DT, generator=rng, requires_grad=True)
    outs = gm(x)
    dys = [torch.randn(o.shape, dtype=DT, generator=rng) for o in outs]
    torch.autograd.backward(outs, dys)
    xr = x.detach().clone().requires_grad_()
    refs = [w.detach().clone().requires_grad_() for w in weights]
    torch.autograd.backward([F.linear(xr, w) for w in refs], dys)
    for got, w in zip(outs, refs):
        torch.testing.assert_close(got, F.linear(xr, w))
    torch.testing.assert_close(x.grad, xr.grad)
    for w, r in zip(weights, refs):
        torch.testing.assert_close(w.grad, r.grad)


def test_custom_op_contract_and_torch_compile(world1, rng):
    x = torch.randn(4, H, dtype=torch.float32, generator=rng, requires_grad=True)
    w = torch.randn(10, H, generator=rng, requires_grad=True)
    b = torch.randn(10, generator=rng, requires_grad=True)
    name = dist.group.WORLD.group_name
    torch.library.opcheck(torch.ops.opfuse.horizontal_linear.default, (x, w, b, None, "reference"))
    torch.library.opcheck(torch.ops.opfuse.horizontal_linear.default, (x, w, None, name, "reference"))
    packed = torch.randn(3, 2, 10, generator=rng, requires_grad=True)
    for activation in ("silu", "gelu", "gelu_tanh"):
        torch.library.opcheck(torch.ops.opfuse.gated_activation.default, (packed, activation, "reference"))
    block = randomize_(gated_mlp(True, "silu", torch.float32), rng)
    program = opfuse.compile(block, x.detach())
    compiled = torch.compile(program.graph_module, backend="aot_eager", fullgraph=True)
    torch.testing.assert_close(compiled(x.detach())[0], block(x.detach()))


# Layouts -------------------------------------------------------------------------------------


def test_swiglu_after_a_column_layer_is_refused(world1):
    block = ops.Sequential(ops.Linear(H, 2 * FFN, parallel="column"), ops.SwiGLU(), ops.Linear(FFN, H, parallel="row"))
    with pytest.raises(ops.PartitionError, match=r"SwiGLU: its input is sharded on features .* Use "
                                                 r"ops.GatedLinear\(in_features, ffn, parallel='column'"):
        block(torch.randn(2, H))
    ops.Sequential(ops.Linear(H, 2 * FFN), ops.SwiGLU())(torch.randn(2, H))  # whole features: fine


def test_gated_linear_arguments_and_loading(world1, rng):
    with pytest.raises(ValueError, match="parallel='row'; accepted: None, 'column'; a gated activation needs whole"):
        ops.GatedLinear(H, FFN, parallel="row")
    with pytest.raises(ValueError, match="activation='relu'; accepted: 'silu', 'gelu', 'gelu_tanh'"):
        ops.GatedLinear(H, FFN, activation="relu")
    layer = ops.GatedLinear(H, FFN, bias=True, parallel="column", dtype=DT)
    gate, up = torch.randn(FFN, H, dtype=DT, generator=rng), torch.randn(FFN, H, dtype=DT, generator=rng)
    gb, ub = torch.randn(FFN, dtype=DT, generator=rng), torch.randn(FFN, dtype=DT, generator=rng)
    layer.load_unsharded(gate_up=torch.cat([gate, up]), gate_up_bias=torch.cat([gb, ub]))
    assert torch.equal(layer.gate_weight, gate) and torch.equal(layer.up_weight, up)
    assert torch.equal(layer.gate_bias, gb) and torch.equal(layer.up_bias, ub)
    layer.load_unsharded(gate=up, up=gate, gate_bias=ub, up_bias=gb)
    assert torch.equal(layer.gate_weight, up) and adjacent([layer.gate_weight, layer.up_weight])
    for kwargs, message in [(dict(gate=gate), "pass both gate= and up="),
                            (dict(gate=gate, up=up, gate_up=gate), "not both"),
                            (dict(gate_up=gate), r"gate_up has shape \[12, 8\], expected \[24, 8\]"),
                            (dict(gate=gate, up=up, gate_bias=gb), "both gate_bias= and up_bias=, or neither"),
                            (dict(gate=gate.T, up=up), r"gate has shape \[8, 12\], expected \[12, 8\]")]:
        with pytest.raises(ValueError, match=message):
            layer.load_unsharded(**kwargs)



def test_gated_linear_declares_its_group_like_linear(world1):
    """A column-parallel GatedLinear takes part in the once-per-compile rank agreement and the
    default-group guard (its process_groups), and validates group= like Linear."""
    layer = ops.GatedLinear(8, 8, parallel="column")
    assert layer.process_groups() == [None] == ops.Linear(8, 8, parallel="column").process_groups()
    assert ops.GatedLinear(8, 8).process_groups() == []
    with pytest.raises(TypeError, match=r"GatedLinear: group='0' is a str; expected a torch.distributed.ProcessGroup"):
        ops.GatedLinear(8, 8, parallel="column", group="0")
