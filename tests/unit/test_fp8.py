"""FP8 on CPU: the recipe API and ``autocast``, the quantization math against hand-computed values,
``Float8Activation``, the FP8 pass, and every FP8 fused op against an independent float64
computation of the documented quantization (quantize each operand as :mod:`opfuse.fp8.numerics`
says, dequantize, multiply in float64), forward and backward; dumps and explain; custom-op schemas;
a short training run in emulation within 2% of the unquantized loss."""

import math
import os
import sys

import pytest
import torch

import opfuse
from opfuse import fp8, ops
from opfuse.fp8 import numerics

from ..fp8_reference import E4M3, E5M2, fused_and_unfused, grouped_reference, linear_reference

RECIPES = [fp8.TensorScaling(), fp8.RowwiseScaling(), fp8.TensorScaling(fp8_wgrad=False),
           fp8.RowwiseScaling(grad_dtype=E5M2, fp8_wgrad=True), fp8.TensorScaling(pow2_weight_scales=True)]
IDS = ["tensor", "row", "tensor-hp-wgrad", "row-e5m2-fp8-wgrad", "tensor-pow2-weights"]


def rel(got, want):
    got, want = got.double(), want.double()
    return ((got - want).norm() / want.norm().clamp_min(1e-30)).item()


# Recipes and autocast ------------------------------------------------------------------------------------


def test_recipe_keys_round_trip_and_validate():
    for recipe in RECIPES:
        assert fp8.recipe_from_key(recipe.key()) == recipe
    assert fp8.TensorScaling().grad_dtype == E5M2 and fp8.RowwiseScaling().grad_dtype == E4M3
    with pytest.raises(ValueError, match="grad_dtype"):
        fp8.TensorScaling(grad_dtype=torch.bfloat16)
    with pytest.raises(TypeError, match="base class"):
        fp8.Recipe()
    with pytest.raises(ValueError, match="recipe key"):
        fp8.recipe_from_key("block/e4m3/e5m2/wgrad-fp8")
    with pytest.raises(TypeError, match="TensorScaling"):
        with fp8.autocast(recipe="tensor"):
            pass


def test_autocast_nests_and_disables():
    assert fp8.current_recipe() is None
    with fp8.autocast() as outer:
        assert outer == fp8.TensorScaling() and fp8.current_recipe() == outer
        with fp8.autocast(recipe=fp8.RowwiseScaling()):
            assert fp8.current_recipe() == fp8.RowwiseScaling()
            with fp8.autocast(enabled=False):
                assert fp8.current_recipe() is None
        assert fp8.current_recipe() == outer
    assert fp8.current_recipe() is None


def test_recipe_is_part_of_the_cache_key(world1, rng):
    block = ops.Sequential(ops.Linear(32, 48), ops.GELU())
    x = torch.randn(5, 32, generator=rng)
    plain = opfuse.compile(block, x)
    with fp8.autocast():
        tensor = opfuse.compile(block, x)
        y8 = block(x)
    with fp8.autocast(recipe=fp8.RowwiseScaling()):
        row = opfuse.compile(block, x)
    assert len({id(plain), id(tensor), id(row)}) == 3
    assert [f.rule for f in tensor.fusions] == ["fp8_linear"] and not any("fp8" in f.rule for f in plain.fusions)
    assert opfuse.compile(block, x) is plain
    y = block(x)  # outside autocast again: the plain program
    assert 1e-4 < rel(y8, y) < 0.1


# Numerics ----------------------------------------------------------------------------------------------


def test_quantize_hand_computed():
    x = torch.tensor([[1.0, -2.0, 0.5], [0.0, 0.0, 0.0]])
    q = numerics.quantize(x, E4M3, rowwise=True)
    assert q.data[0].float().tolist() == [224.0, -448.0, 112.0]  # amax 2 -> scale 224
    assert q.scale_inv[:, 0].tolist() == [torch.tensor(1 / 224, dtype=torch.float32).item(), 1.0]  # zero row: 1
    t = numerics.quantize(x, E5M2, rowwise=False)
    assert t.data[0, 1].float().item() == -57344.0 and t.scale_inv.shape == (1, 1)
    # Round to nearest even on the E4M3 grid (step 32 in [256, 512)): 1.2 * 224 = 268.8 -> 256
    assert numerics.quantize(torch.tensor([[1.2, 2.0]]), E4M3, False).data[0, 0].float().item() == 256.0
    empty = numerics.quantize(torch.empty(0, 4), E4M3, False)
    assert empty.data.shape == (0, 4) and empty.scale_inv.item() == 1.0


def test_power_of_two_scales_are_the_largest_power_of_two_below_the_exact_scale(rng):
    from ..fp8_reference import pow2_floor

    # amaxes over the whole float32 range, exact powers of two and their neighbours included
    a = torch.cat([torch.exp2(torch.empty(4000).uniform_(-140, 127, generator=rng)),
                   torch.exp2(torch.arange(-130.0, 127.0)), torch.tensor([448.0, 449.0, 447.0, 57344.0, 1e-45])])
    a = torch.cat([a, torch.nextafter(a, torch.tensor(0.0)), torch.nextafter(a, torch.tensor(float("inf")))])
    for dtype, limit in ((E4M3, 448.0), (E5M2, 57344.0)):
        scale, scale_inv = numerics.pow2_scales_from_amax(a, dtype)
        want = torch.where(a > 0, pow2_floor(torch.full_like(a, limit) / a), torch.ones_like(a))
        assert torch.equal(scale, want)
        assert torch.equal(scale * scale_inv, torch.ones_like(a))  # exact reciprocals
        exact, _ = numerics.scales_from_amax(a, dtype)
        inside = (exact > 2.0 ** -126) & (exact < 2.0 ** 127)
        assert (scale[inside] <= exact[inside]).all() and (scale[inside] * 2 > exact[inside]).all()
        assert (a[inside] * scale[inside] <= limit).all()  # nothing saturates
    zero = numerics.pow2_scales_from_amax(torch.zeros(1, 1), E4M3)
    assert zero[0].item() == 1.0 and zero[1].item() == 1.0
    q = numerics.quantize(torch.tensor([[3.0, -0.5]]), E4M3, False, pow2=True)  # 448 / 3 -> 128
    assert q.data.float().tolist() == [[384.0, -64.0]] and q.scale_inv.item() == 1 / 128


def test_power_of_two_weight_scales_are_a_tensor_scaling_option():
    recipe = fp8.TensorScaling(pow2_weight_scales=True)
    assert recipe.key().endswith("/w-pow2") and fp8.recipe_from_key(recipe.key()) == recipe
    assert recipe != fp8.TensorScaling() and "pow2" in recipe.describe()
    with pytest.raises(ValueError, match="pow2_weight_scales=True; accepted with TensorScaling only"):
        fp8.RowwiseScaling(pow2_weight_scales=True)
    with pytest.raises(ValueError, match="pow2_weight_scales='yes'"):
        fp8.TensorScaling(pow2_weight_scales="yes")
    with pytest.raises(ValueError, match="recipe key"):
        fp8.recipe_from_key("tensor/e4m3/e5m2/wgrad-fp8/w-pow3")


def test_one_read_weight_quantizer_off_cuda_is_the_reference(rng):
    """Off CUDA ``quantize_weight`` (and its custom op) is numerics' two-pass quantization with
    power-of-two scales; the Triton kernels are checked against it in tests/gpu."""
    from opfuse.families.quantize import weight_pow2

    w = torch.randn(40, 24, generator=rng, dtype=torch.bfloat16)
    q, qt = weight_pow2.quantize_weight(w, E4M3, True, key="k")
    want = numerics.quantize(w, E4M3, False, pow2=True)
    assert torch.equal(q.data.view(torch.uint8), want.data.view(torch.uint8))
    assert torch.equal(qt.data.view(torch.uint8), want.data.t().contiguous().view(torch.uint8))
    assert torch.equal(q.scale_inv, want.scale_inv) and q.scale_inv.shape == (1, 1)
    data, scale_inv, data_t = torch.ops.opfuse.quantize_weight_pow2(w, 3, "e4m3", False)
    assert torch.equal(data.view(torch.uint8), want.data.view(torch.uint8)) and data_t.numel() == 0
    torch.library.opcheck(torch.ops.opfuse.quantize_weight_pow2.default, (w, 3, "e4m3", True))
    # Compiled graphs call the direct overload: the same bytes, no output an input.
    for a, b in zip(torch.ops.opfuse.quantize_weight_pow2.direct(w, 3, "e4m3", True),
                    torch.ops.opfuse.quantize_weight_pow2.default(w, 3, "e4m3", True)):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)) and a.data_ptr() != w.data_ptr()
    # A graph reserves its hints while it is built, under a fake mode: the hint is real memory.
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

    with FakeTensorMode():
        weight_pow2.reserve_hint("reserved-in-fake-mode", torch.device("cpu"))
    hint = weight_pow2._hints[("reserved-in-fake-mode", torch.device("cpu"))]
    assert not isinstance(hint, FakeTensor) and hint.dtype == torch.int32 and hint.item() == weight_pow2._UNSET
    with pytest.raises(ValueError, match="must be 2-D"):
        weight_pow2.quantize_weight(w.reshape(-1), E4M3, False)
    with pytest.raises(ValueError, match="not an FP8 format"):
        weight_pow2.quantize_weight(w, torch.bfloat16, False)


def test_quantize_error_bound_and_tail_rows(rng):
    x = torch.randn(64, 128, generator=rng) * torch.logspace(-2, 2, 64).unsqueeze(1)
    for rowwise, bound in ((True, 2 ** -4), (False, None)):
        d = numerics.quantize(x, E4M3, rowwise).dequantize()
        err = (d - x).abs()
        if bound:  # per-row scales: every element within half an E4M3 step of its row's range
            assert (err <= bound * x.abs().amax(-1, keepdim=True)).all()
    valid = torch.tensor(10)
    x[10:] = 1e6  # a static buffer's unused tail must not set the scale
    q = numerics.quantize(x, E4M3, False, valid_rows=valid)
    assert torch.equal(q.scale_inv, numerics.quantize(x[:10], E4M3, False).scale_inv)


def test_float8_activation_behaves_as_its_value(rng):
    x = torch.randn(6, 16, generator=rng, requires_grad=True)
    q = fp8.quantize_activation(x, E4M3, rowwise=True)
    assert isinstance(q, fp8.Float8Activation) and q.dtype == x.dtype and q.shape == x.shape
    value = q.dequantize()
    torch.testing.assert_close(q + 1, value + 1)
    assert isinstance(q.detach(), fp8.Float8Activation) and isinstance(q.view_as(q), fp8.Float8Activation)
    assert "float8_e4m3fn, scale per row" in repr(q) and str(ops.TensorMeta.of(q)).startswith("e4m3/row~float32")
    (q * torch.arange(16.0)).sum().backward()  # the gradient passes through the quantization
    torch.testing.assert_close(x.grad, torch.arange(16.0).expand(6, 16))


# Linear ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("recipe", RECIPES, ids=IDS)
@pytest.mark.parametrize("tokens", [0, 1, 7])
def test_fp8_linear_against_float64_reference(world1, rng, recipe, tokens):
    layer = ops.Linear(24, 40)
    with torch.no_grad():
        layer.bias.normal_(generator=rng)
    block = ops.Sequential(layer)
    x = torch.randn(tokens, 3, 24, generator=rng).requires_grad_()
    dy = torch.randn(tokens, 3, 40, generator=rng)
    for fuse in (True, False):
        x.grad = None
        layer.zero_grad(set_to_none=True)
        with opfuse.config.override(fuse=fuse), fp8.autocast(recipe=recipe):
            y = block(x)
            program = opfuse.compile(block, x)
        (y * dy).sum().backward()
        y_ref, dx_ref, dw_ref, db_ref = linear_reference(x.detach(), layer.weight.detach(), layer.bias.detach(), dy,
                                                         recipe)
        tol = dict(atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(y.double(), y_ref, **tol)
        torch.testing.assert_close(x.grad.double(), dx_ref, **tol)
        torch.testing.assert_close(layer.weight.grad.double(), dw_ref, **tol)
        torch.testing.assert_close(layer.bias.grad.double(), db_ref, **tol)
        assert [f.rule for f in program.fusions] == (["fp8_linear"] if fuse else [])


def test_the_fp8_pass_quantizes_above_the_movers_and_dumps_show_it(world1, rng):
    block = ops.Sequential(ops.RMSNorm(32), ops.Linear(32, 64, parallel="column"), ops.GELU(),
                           ops.Linear(64, 32, parallel="row"))
    x = torch.randn(4, 32, generator=rng)
    with fp8.autocast():
        program = opfuse.compile(block, x)
    unfused = [n for n in program.unfused_graph_module.graph.nodes if n.op == "call_module"]
    kinds = [program.unfused_graph_module.get_submodule(n.target).kind for n in unfused]
    assert kinds[:4] == ["RMSNorm", "Quantize", "GradAllReduce", "BasicLinear"], kinds
    assert "Quantize" in kinds[kinds.index("GELU"):]
    text = program.dump("python", graph="both")
    assert "Quantize(e4m3, scale per tensor)" in text and "e4m3/tensor~float32[4, 32]" in text
    assert "fp8=TensorScaling(grad=e5m2)" in text
    rules = [f.rule for f in program.fusions]
    assert "add_rmsnorm_quantize" in rules and "fp8_linear" in rules, rules
    explain = program.explain(verbose=True)
    # The column layer's Quantize sits above GradAllReduce (so the norm can emit FP8): explain says
    # why fp8_linear did not take it.
    assert "fp8_linear" in explain and "found op1_linear_grad_all_reduce (GradAllReduce)" in explain


def test_user_quantize_without_autocast_runs_the_gemm_on_dequantized_values(world1, rng):
    block = ops.Sequential(ops.Quantize(E4M3, rowwise=True), ops.Linear(16, 8))
    x = torch.randn(5, 16, generator=rng)
    y = block(x)
    assert not any("fp8" in f.rule for f in opfuse.compile(block, x).fusions)
    lin = block[1]
    torch.testing.assert_close(y, numerics.quantize(x, E4M3, True).dequantize() @ lin.weight.t() + lin.bias)
    with pytest.raises(ValueError, match="float8"):
        ops.Quantize(torch.bfloat16)


# Norm + quantize ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("norm", ["rms", "layer"])
@pytest.mark.parametrize("recipe", RECIPES[:2], ids=IDS[:2])
def test_norm_emitting_fp8_against_float64_reference(world1, rng, norm, recipe):
    hidden = 32
    norm_op = ops.RMSNorm(hidden) if norm == "rms" else ops.LayerNorm(hidden)
    lin = ops.Linear(hidden, 16, bias=False)
    with torch.no_grad():
        for p in norm_op.parameters():
            p.copy_(1 + 0.2 * torch.randn(p.shape, generator=rng))
    block = ops.Sequential(ops.AddExtraInput(), ops.MakeExtraOutput(), norm_op, lin)
    x, r = torch.randn(6, hidden, generator=rng), torch.randn(6, hidden, generator=rng)
    xg, rg = x.clone().requires_grad_(), r.clone().requires_grad_()
    dy, dh = torch.randn(6, 16, generator=rng), torch.randn(6, hidden, generator=rng)
    with fp8.autocast(recipe=recipe):
        y, h = block(xg, rg)
        program = opfuse.compile(block, xg, rg)
    assert [f.rule for f in program.fusions] == [f"add_{norm}norm_quantize", "fp8_linear"]
    ((y * dy).sum() + (h * dh).sum()).backward()
    # float64 reference: the norm in float32 (as the op), its output quantized, the FP8 linear
    hr = (x + r).double().requires_grad_()
    normed = (hr / torch.sqrt((hr * hr).mean(-1, keepdim=True) + norm_op.eps) * norm_op.weight.double()
              if norm == "rms" else torch.nn.functional.layer_norm(hr, (hidden,), norm_op.weight.double(),
                                                                   norm_op.bias.double(), norm_op.eps))
    y_ref, dnormed, dw_ref, _ = linear_reference(normed.detach().float(), lin.weight.detach(), None, dy, recipe)
    torch.testing.assert_close(y.double(), y_ref, atol=2e-4, rtol=2e-4)
    torch.testing.assert_close(h, x + r)
    torch.autograd.backward([normed, hr], [dnormed, dh.double()])
    torch.testing.assert_close(xg.grad.double(), hr.grad, atol=2e-4, rtol=2e-4)
    torch.testing.assert_close(lin.weight.grad.double(), dw_ref, atol=2e-4, rtol=2e-4)


# Grouped -----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("recipe", RECIPES, ids=IDS)
@pytest.mark.parametrize("sizes", [[5, 0, 9, 3], [0, 0, 0, 0], [12, 30, 0, 1]])
def test_grouped_fp8_against_float64_reference(world1, rng, recipe, sizes):
    layer = ops.GroupedLinear(4, 32, 48, bias=True)
    with torch.no_grad():
        layer.bias.normal_(generator=rng)
    block = ops.Sequential(layer)
    sizes = torch.tensor(sizes)
    x = torch.randn(20, 32, generator=rng)
    x[int(sizes.sum().clamp(max=20)):] = 1e4  # the unused tail: must not set the scale
    dy = torch.randn(20, 48, generator=rng)
    y_ref, dx_ref, dw_ref, db_ref = grouped_reference(x, sizes, layer.weight.detach(), layer.bias.detach(), dy, recipe)
    for fuse in (True, False):
        xg = x.clone().requires_grad_()
        layer.zero_grad(set_to_none=True)
        with opfuse.config.override(fuse=fuse), fp8.autocast(recipe=recipe):
            y = block(xg, sizes)
            program = opfuse.compile(block, xg, sizes)
        (y * dy).sum().backward()
        assert [f.rule for f in program.fusions] == (["grouped_linear_fp8"] if fuse else [])
        tol = dict(atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(y.double(), y_ref, **tol)
        torch.testing.assert_close(xg.grad.double(), dx_ref, **tol)
        torch.testing.assert_close(layer.weight.grad.double(), dw_ref, **tol)
        torch.testing.assert_close(layer.bias.grad.double(), db_ref, **tol)


# Custom ops -------------------------------------------------------------------------------------------------


def test_fp8_custom_ops_pass_opcheck(world1, rng):
    from opfuse.ops import group as groups

    name = groups.group_name(None)
    x = torch.randn(4, 32, generator=rng, requires_grad=True)
    w = torch.randn(16, 32, generator=rng, requires_grad=True)
    b = torch.randn(16, generator=rng, requires_grad=True)
    key = fp8.TensorScaling().key()
    # Ops returning the FP8 operand they quantized: the AOT test sums every output, which torch
    # cannot do for FP8 tensors on CPU; the schema, autograd and fake checks run.
    checks = ("test_schema", "test_autograd_registration", "test_faketensor")
    torch.library.opcheck(torch.ops.opfuse.fp8_linear.default, (x, None, None, w, b, key, "reference"),
                          test_utils=checks)
    for op in (torch.ops.opfuse.all_gather_linear_fp8, torch.ops.opfuse.linear_reduce_scatter_fp8):
        torch.library.opcheck(op.default, (x, None, None, w, b, name, key, "reference"), test_utils=checks)
    gw = torch.randn(3, 16, 32, generator=rng, requires_grad=True)
    torch.library.opcheck(torch.ops.opfuse.grouped_linear_fp8.default,
                          (x, torch.tensor([1, 0, 2]), gw, None, "", 3, fp8.RowwiseScaling().key(), "reference"))


# A short training run ---------------------------------------------------------------------------------------------


def test_short_training_run_tracks_the_unquantized_loss():
    """The bench's training comparison in emulation: a small MLP block on a fixed random regression
    task, FP8 (tensor and row scaling) vs float32, final losses within 2%."""
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "bench"))
    from fp8_training import smoothed, train

    losses = {name: train(recipe, steps=150, hidden=64, ffn=256, tokens=64, device="cpu", dtype=torch.float32)
              for name, recipe in (("fp32", None), ("tensor", fp8.TensorScaling()), ("row", fp8.RowwiseScaling()))}
    base = smoothed(losses["fp32"])
    assert base < 0.25 * losses["fp32"][0], "the block did not train"
    for name in ("tensor", "row"):
        final = smoothed(losses[name])
        assert math.isfinite(final) and abs(final - base) <= 0.02 * base, (name, final, base)


# All-reduce + norm + quantize ----------------------------------------------------------------------------------


@pytest.mark.parametrize("recipe", RECIPES[:2], ids=IDS[:2])
def test_allreduce_norm_emitting_fp8_fires_and_matches_the_unfused_block(world1, rng, recipe):
    """Row-parallel GEMM -> all-reduce + add + RMSNorm -> FP8 GEMM: the FP8 all-reduce norm
    outranks the plain one, lists its implementations in order, and forward and gradients equal the
    unfused block's (multi-rank numerics: tests/dist/test_fp8_allreduce_norm.py)."""
    from opfuse.core import dispatch as implementations

    assert implementations.names()["allreduce_add_rmsnorm_quantize"] == [
        "cuda_oneshot", "cuda_twoshot_lamport", "cuda_twoshot", "allreduce+triton", "reference"]
    block = ops.Sequential(ops.Linear(48, 32, parallel="row"), ops.AddExtraInput(), ops.MakeExtraOutput(),
                           ops.RMSNorm(32), ops.Linear(32, 48, parallel="column"))
    x, r = torch.randn(7, 48, generator=rng), torch.randn(7, 32, generator=rng)
    dy, dh = torch.randn(7, 48, generator=rng), torch.randn(7, 32, generator=rng)
    results, fusions = fused_and_unfused(block, x, r, dy, dh, recipe)
    assert fusions.get("allreduce_add_rmsnorm_quantize") == "reference", fusions
    assert "allreduce_add_rmsnorm" not in fusions and "quantize" not in fusions, fusions
    for got, want in zip(*results):
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)


def test_weight_cache_keeps_a_views_copy_with_its_base():
    """A compiled graph hands an FP8 op a fresh view of the same parameter storage on every call
    (stacked expert weights): the view's FP8 copy is kept with its base, a different view of the
    same base gets its own, and an in-place update of the base (through any view) invalidates."""
    from opfuse.families.quantize import weight_cache

    base = torch.randn(4, 6, 8)
    builds = []

    def build_for(view):
        return lambda: builds.append(view.sum().item()) or view.clone()

    first = base[1:3]
    got = weight_cache.cached(first, "k", build_for(first))
    again = base[1:3]  # a new Python object for the same view
    assert again is not first and weight_cache.cached(again, "k", build_for(again)) is got
    assert len(builds) == 1
    other = base[0:2]  # same shape, another offset: another entry
    assert torch.equal(weight_cache.cached(other, "k", build_for(other)), base[0:2])
    assert len(builds) == 2
    base[2].mul_(2.0)  # bumps the version counter the views share
    fresh = weight_cache.cached(base[1:3], "k", build_for(base[1:3]))
    assert len(builds) == 3 and torch.equal(fresh, base[1:3])
    weight_cache.clear()


def test_forward_keeps_a_weight_form_for_the_backward_of_the_same_activation():
    """What Inductor's code needs (it passes a fresh alias of a weight's storage on every call, whose
    version says nothing): the forward's FP8 weight handed to the backward called with the same
    activation tensor, once; nothing for another activation, another weight view or a second take;
    dropped when the activation is freed."""
    import gc

    from opfuse.families.quantize import weight_cache

    storage = torch.randn(2, 4, 8)
    x = torch.randn(5, 8)

    def alias(i):  # a new tensor object on the same storage, without a base (as Inductor's aliases)
        return torch.empty(0).set_(storage.untyped_storage(), i * 32, (4, 8), (8, 1))

    assert alias(0)._base is None and alias(0) is not alias(0)
    weight_cache.keep_for_backward(x, alias(1), "k", "forward's copy of weight 1")
    assert weight_cache.take_for_backward(torch.randn(5, 8), alias(1), "k") is None  # another activation
    assert weight_cache.take_for_backward(x, alias(0), "k") is None  # another weight
    assert weight_cache.take_for_backward(x, alias(1), "other") is None  # another form
    assert weight_cache.take_for_backward(x, alias(1), "k") == "forward's copy of weight 1"
    assert weight_cache.take_for_backward(x, alias(1), "k") is None  # handed over once
    weight_cache.keep_for_backward(x, alias(0), "k", "kept")
    del x
    gc.collect()
    assert not weight_cache._KEPT  # gone with the activation
    weight_cache.clear()
