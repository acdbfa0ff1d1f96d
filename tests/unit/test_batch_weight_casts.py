"""Same-shape FP8 weight casts of a compiled graph become one ``opfuse::quantize_weights_pow2`` call
(opfuse/torch_compile/batch_weight_casts.py): which casts join (shape, dtypes, the window between
two collectives, the size cap), that a weight computed after the batch's first cast is moved ahead
of it, that what reads a gradient stays alone; and end to end, that a compiled FP8 model gives the
same bytes batched and unbatched."""

import operator
import re

import pytest
import torch
from torch import fx, nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx

import opfuse
from opfuse import fp8
from opfuse.families.quantize import weight_pow2
from opfuse.fp8 import numerics
from opfuse.torch_compile.batch_weight_casts import batch_weight_casts

CAST = torch.ops.opfuse.quantize_weight_pow2.default
BATCH = torch.ops.opfuse.quantize_weights_pow2.default


def traced(fn, *shapes, names=None):
    """``fn`` traced on fake bf16 tensors of ``shapes`` (placeholder names ``names``)."""
    mode = FakeTensorMode()
    with mode:
        args = [torch.empty(s, dtype=torch.bfloat16) for s in shapes]
    gm = make_fx(fn)(*args)
    if names:
        for node, name in zip([n for n in gm.graph.nodes if n.op == "placeholder"], names):
            node.name = node.target = name
    return gm


def cast(w, transpose=True):
    return CAST(w, 0, "e4m3", transpose)


def batches(graph):
    return [len(n.args[0]) for n in graph.nodes if n.target is BATCH]


def singles(graph):
    return sum(n.target is CAST for n in graph.nodes)


def test_same_shape_casts_join_one_call_per_shape_and_keep_the_graph_valid():
    def fn(a, b, c, d, e):
        outs = [cast(w) for w in (a, b, c, d, e)]
        return [o[0] for o in outs] + [o[1] for o in outs] + [o[2] for o in outs]

    gm = traced(fn, (64, 32), (64, 32), (32, 64), (64, 32), (32, 64))
    notes = batch_weight_casts(gm.graph, 256)
    gm.recompile()
    assert sorted(batches(gm.graph)) == [2, 3] and singles(gm.graph) == 0
    assert notes and "5 FP8 weight casts quantized in 2 launch(es)" in notes[0]
    # each former output now reads its weight's slice of the stack
    (batch,) = [n for n in gm.graph.nodes if n.target is BATCH and len(n.args[0]) == 3]
    assert [w.name for w in batch.args[0]] == ["a_1", "b_1", "d_1"]
    selects = [n for n in gm.graph.nodes if n.target is torch.ops.aten.select.int and n.args[0].args[0] is batch]
    assert sorted(n.args[2] for n in selects) == [0, 0, 1, 1, 2, 2]  # data and data_t of each


def test_casts_that_differ_in_dtype_or_transposition_stay_apart():
    def fn(a, b, c):
        return [cast(a)[0], cast(b, transpose=False)[0], CAST(c, 0, "e5m2", True)[0]]

    gm = traced(fn, (64, 32), (64, 32), (64, 32))
    assert batch_weight_casts(gm.graph, 256) == []
    assert singles(gm.graph) == 3


def test_the_size_cap_splits_a_set_and_zero_batches_nothing():
    def fn(*ws):
        return [cast(w)[0] for w in ws]

    # 1024 x 512 weights: 1 MiB of FP8 output each with the transposed bytes
    gm = traced(fn, *[(1024, 512)] * 5)
    assert batch_weight_casts(gm.graph, 0) == [] and singles(gm.graph) == 5
    batch_weight_casts(gm.graph, 2)
    assert batches(gm.graph) == [2, 2] and singles(gm.graph) == 1


def test_a_collective_between_casts_separates_their_batches():
    def fn(a, b, c, d):
        return [cast(w)[0] for w in (a, b, c, d)]

    gm = traced(fn, *[(64, 32)] * 4)
    graph = gm.graph
    third = [n for n in graph.nodes if n.target is CAST][2]
    with graph.inserting_before(third):
        wait = graph.call_function(torch.ops._c10d_functional.wait_tensor.default, (third.args[0],))
    wait.meta["val"] = third.args[0].meta["val"]
    batch_weight_casts(graph, 256)
    assert batches(graph) == [2, 2]
    order = list(graph.nodes)
    first, second = [n for n in order if n.target is BATCH]
    assert order.index(first) < order.index(wait) < order.index(second)


def test_a_weight_computed_after_the_first_cast_moves_ahead_of_the_batch():
    def fn(a, packed):
        first = cast(a)
        late = packed[:64]  # e.g. a member of a packed q/k/v, sliced where the GEMM reads it
        return first[0], cast(late)[0]

    gm = traced(fn, (64, 32), (128, 32))
    batch_weight_casts(gm.graph, 256)
    gm.graph.lint()
    assert batches(gm.graph) == [2]


def test_a_cast_of_a_value_computed_from_a_gradient_is_left_alone():
    def fn(a, tangents_1):
        return cast(a)[0], cast(tangents_1 * 2)[0]

    gm = traced(fn, (64, 32), (64, 32), names=["primals_1", "tangents_1"])
    assert batch_weight_casts(gm.graph, 256) == []
    assert singles(gm.graph) == 2


def test_a_cast_whose_result_is_read_whole_is_left_alone():
    graph = fx.Graph()
    mode = FakeTensorMode()
    nodes = []
    for i in range(2):
        w = graph.placeholder(f"w{i}")
        with mode:
            w.meta["val"] = torch.empty(64, 32, dtype=torch.bfloat16)
        nodes.append(graph.call_function(CAST, (w, 0, "e4m3", True)))
    graph.output([nodes[0], graph.call_function(operator.getitem, (nodes[1], 0))])
    assert batch_weight_casts(graph, 256) == []


def test_quantize_weights_is_each_weight_quantized_alone_and_refuses_mixed_weights():
    torch.manual_seed(0)
    ws = [(torch.randn(24, 40) * s).to(torch.bfloat16) for s in (1.0, 300.0, 0.0)]
    data, data_t, scale_inv = weight_pow2.quantize_weights(ws, torch.float8_e4m3fn, True)
    for g, w in enumerate(ws):
        want = numerics.quantize(w, torch.float8_e4m3fn, False, pow2=True)
        assert torch.equal(data[g].view(torch.uint8), want.data.view(torch.uint8))
        assert torch.equal(data_t[g].view(torch.uint8), want.data.t().contiguous().view(torch.uint8))
        assert torch.equal(scale_inv[g:g + 1], want.scale_inv.reshape(1))
    assert weight_pow2.quantize_weights(ws, torch.float8_e4m3fn, False)[1] is None
    with pytest.raises(ValueError, match="at least one weight"):
        weight_pow2.quantize_weights([], torch.float8_e4m3fn, True)
    with pytest.raises(ValueError, match=r"one shape, dtype and device; got .*\[24, 41\]"):
        weight_pow2.quantize_weights([ws[0], torch.zeros(24, 41, dtype=torch.bfloat16)], torch.float8_e4m3fn, True)
    with pytest.raises(ValueError, match="bfloat16 is not an FP8 format"):
        weight_pow2.quantize_weights(ws, torch.bfloat16, True)


class Layer(nn.Module):
    def __init__(self, hidden=32, ffn=64):
        super().__init__()
        self.q, self.o = nn.Linear(hidden, hidden, bias=False), nn.Linear(hidden, hidden, bias=False)
        self.up, self.down = nn.Linear(hidden, ffn, bias=False), nn.Linear(ffn, hidden, bias=False)

    def forward(self, x):
        x = x + self.o(torch.tanh(self.q(x)))
        return x + self.down(torch.relu(self.up(x)))


def _compiled_step(batch_mb, x, tmp_path, inductor):
    torch.manual_seed(0)
    model = nn.Sequential(Layer(), Layer(), Layer())
    recipe = fp8.TensorScaling(pow2_weight_scales=True)
    with opfuse.config.override(fp8_weight_batch_mb=batch_mb, dump_dir=str(tmp_path)):
        compiled = opfuse.optimize(model, fp8=recipe, options={"inductor": inductor}, merge_projections=False)
        xi = x.clone().requires_grad_()
        y = compiled(xi)
        y.backward(torch.randn(y.shape, generator=torch.Generator().manual_seed(1)))
    return [y, xi.grad] + [p.grad for p in model.parameters()], opfuse.programs(compiled)


@pytest.mark.parametrize("inductor", [False, True], ids=["eager-graph", "inductor"])
def test_a_compiled_fp8_model_gives_the_same_bytes_with_its_casts_batched(world1, tmp_path, monkeypatch, inductor):
    from opfuse.torch_compile import fp8_aten

    monkeypatch.setattr(fp8_aten, "IMPLEMENTATIONS", {"reference"})
    x = torch.randn(2, 8, 32)
    alone, _ = _compiled_step(0, x, tmp_path / "alone", inductor)
    batched, programs = _compiled_step(256, x, tmp_path / "batched", inductor)
    for a, b in zip(alone, batched):
        assert torch.equal(a, b)
    (folder,) = list((tmp_path / "batched").iterdir())
    after = (folder / "aten_after.py").read_text()
    # q and o (one shape, 3 layers), up, down: three launches for twelve weights, none alone
    assert sorted(len(w.split(",")) for w in re.findall(r"quantize_weights_pow2\.direct\(\[([^\]]*)\]", after)) \
        == [3, 3, 6]
    assert "quantize_weight_pow2.direct(" not in after
    assert "12 FP8 weight casts quantized in 3 launch(es)" in programs[0].explain()


def test_casts_only_the_backward_reads_do_not_join_the_forwards():
    def fn(a, b, c, tangents_1):
        forward = [cast(w)[0] for w in (a, b)]
        late = cast(c)[2]                      # read only with the incoming gradient
        return forward + [tangents_1 @ late.float()]

    gm = traced(fn, (64, 32), (64, 32), (64, 32), (8, 32), names=["primals_1", "primals_2", "primals_3",
                                                                  "tangents_1"])
    batch_weight_casts(gm.graph, 256)
    assert batches(gm.graph) == [2] and singles(gm.graph) == 1
    (batch,) = [n for n in gm.graph.nodes if n.target is BATCH]
    assert [w.name for w in batch.args[0]] == ["primals_1", "primals_2"]
