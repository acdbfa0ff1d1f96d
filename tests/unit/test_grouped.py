"""GroupedLinear on CPU: the op, the compiled program (reference implementation through the custom
op), gradients, validation errors, partition errors and the dispatch table, against an independent
float64 loop of matmuls."""

import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

import opfuse
from opfuse import ops
from opfuse.core import dispatch as implementations
from opfuse.families.grouped_linear import torch_mm, triton_impl
from opfuse.machinery.implementation import CallSpec, ImplementationError, choose
from opfuse.ops.base import OpInputError, TensorMeta
from opfuse.passes import PartitionError

TOL = {torch.float64: 1e-12, torch.float32: 2e-5, torch.bfloat16: 1.6e-2, torch.float16: 2e-3}


def rel_err(got, ref):
    got, ref = got.double(), ref.double()
    return ((got - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def loop_reference(x, sizes, w, b=None):
    """float64 loop of matmuls (independent of opfuse); rows past sum(sizes) are zero."""
    x, w = x.double(), w.double()
    y = x.new_zeros(x.shape[0], w.shape[1])
    start = 0
    for g, count in enumerate(sizes):
        rows = x[start:start + count] @ w[g].t()
        y[start:start + count] = rows + (b[g].double() if b is not None else 0)
        start += count
    return y


def make_layer(groups, k, n, dtype, gen, bias=True):
    layer = ops.GroupedLinear(groups, k, n, bias=bias, dtype=dtype)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(layer.weight.shape, generator=gen, dtype=torch.float64) / math.sqrt(k))
        if bias:
            layer.bias.copy_(torch.randn(layer.bias.shape, generator=gen, dtype=torch.float64))
    return layer


CASES = [  # (tokens, sizes): uneven, empty first/middle/last, all in one group, a zero tail
    (23, [5, 0, 11, 7]),
    (16, [0, 16, 0, 0]),
    (19, [3, 4, 0, 9]),     # 3 rows past sum(sizes)
    (7, [0, 0, 0, 0]),      # nothing routed: every row is tail
]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("tokens,sizes", CASES)
def test_forward_matches_loop(dtype, tokens, sizes, rng):
    layer = make_layer(4, 24, 10, dtype, rng)
    x = torch.randn(tokens, 24, generator=rng, dtype=torch.float64).to(dtype)
    counts = torch.tensor(sizes, dtype=torch.int32)
    want = loop_reference(x, sizes, layer.weight, layer.bias)
    program = opfuse.compile(ops.Sequential(layer), x, counts)
    assert [(f.rule, f.impl) for f in program.fusions] == [("grouped_linear", "reference")]
    for got in (layer(x, counts), program(x, counts)):
        assert got.dtype == dtype and got.shape == (tokens, 10)
        assert rel_err(got, want) <= TOL[dtype] or want.abs().max() == 0
        assert torch.equal(got[sum(sizes):], torch.zeros_like(got[sum(sizes):]))


@pytest.mark.parametrize("tokens,sizes", CASES)
@pytest.mark.parametrize("compiled", [False, True])
def test_gradients_match_loop(tokens, sizes, compiled, rng):
    dtype = torch.float32
    layer = make_layer(4, 12, 6, dtype, rng)
    x = torch.randn(tokens, 12, generator=rng, dtype=dtype, requires_grad=True)
    dy = torch.randn(tokens, 6, generator=rng, dtype=dtype)
    counts = torch.tensor(sizes, dtype=torch.int64)
    # Stale gradients from an earlier step must be overwritten only where they are accumulated.
    y = ops.Sequential(layer)(x, counts) if compiled else layer(x, counts)
    y.backward(dy)

    xr = x.detach().double().requires_grad_()
    wr = layer.weight.detach().double().requires_grad_()
    br = layer.bias.detach().double().requires_grad_()
    yr = loop_reference(xr, sizes, wr, br)
    (yr * dy.double()).sum().backward()
    for name, got, want in (("x", x.grad, xr.grad), ("weight", layer.weight.grad, wr.grad),
                            ("bias", layer.bias.grad, br.grad)):
        assert got is not None, f"{name}.grad is None"
        assert rel_err(got, want) <= 1e-5 or want.abs().max() == 0, name
    for g, count in enumerate(sizes):
        if count == 0:   # empty groups: exactly zero gradients, not absent and not stale
            assert torch.equal(layer.weight.grad[g], torch.zeros_like(layer.weight.grad[g]))
            assert torch.equal(layer.bias.grad[g], torch.zeros_like(layer.bias.grad[g]))
    assert torch.equal(x.grad[sum(sizes):], torch.zeros_like(x.grad[sum(sizes):]))


def test_moe_mlp_block_matches_loop(rng):
    groups, hidden, ffn, tokens = 3, 16, 8, 21
    sizes = [9, 0, 12]
    up = make_layer(groups, hidden, 2 * ffn, torch.float64, rng)
    down = make_layer(groups, ffn, hidden, torch.float64, rng, bias=False)
    block = ops.Sequential(up, ops.SwiGLU(), down)
    x = torch.randn(tokens, hidden, generator=rng, dtype=torch.float64)
    counts = torch.tensor(sizes)
    h = loop_reference(x, sizes, up.weight, up.bias)
    gate, lin = h.chunk(2, dim=-1)
    want = loop_reference(F.silu(gate) * lin, sizes, down.weight)
    got = block(x, counts, counts)
    assert rel_err(got, want) <= 1e-12
    assert [f.rule for f in block.program(x, counts, counts).fusions] == ["grouped_linear", "grouped_linear"]


def test_new_group_sizes_reuse_the_program(rng):
    layer = make_layer(3, 8, 4, torch.float32, rng)
    block = ops.Sequential(layer)
    x = torch.randn(10, 8, generator=rng)
    first = block.program(x, torch.tensor([2, 3, 5]))
    for sizes in ([10, 0, 0], [0, 0, 4], [1, 1, 1]):
        counts = torch.tensor(sizes)
        assert block.program(x, counts) is first
        assert rel_err(block(x, counts), loop_reference(x, sizes, layer.weight, layer.bias)) <= TOL[torch.float32]


def test_reference_rejects_impossible_sizes(rng):
    layer = make_layer(2, 4, 4, torch.float32, rng)
    x = torch.randn(5, 4, generator=rng)
    for sizes in ([4, 2], [-1, 3]):
        with pytest.raises(ValueError, match="non-negative and sum to at most the 5 rows"):
            layer(x, torch.tensor(sizes))
        with pytest.raises(ValueError, match="non-negative and sum to at most the 5 rows"):
            ops.Sequential(layer)(x, torch.tensor(sizes))


# Validation -------------------------------------------------------------------------------------


def meta(shape, dtype=torch.float32, device="cpu"):
    return TensorMeta(tuple(shape), dtype, torch.device(device))


@pytest.mark.parametrize("x,sizes,match", [
    (meta([6, 8]), meta([3], torch.float32), "group_sizes has dtype float32, expected int32 or int64"),
    (meta([6, 8]), meta([4], torch.int32), r"group_sizes has shape \[4\], expected \[3\]"),
    (meta([6, 8]), meta([3, 1], torch.int64), r"expected \[3\] \(one count per local group\)"),
    (meta([6, 8]), meta([3], torch.int32, "meta"), "group_sizes is on meta but x is on cpu"),
    (meta([2, 3, 8]), meta([3], torch.int32), r"x has shape \[2, 3, 8\], expected 2 dims"),
    (meta([6, 7]), meta([3], torch.int32), "x has 7 features"),
    (meta([6, 8], torch.int32), meta([3], torch.int32), "x has dtype int32, expected a floating point"),
    (meta([6, 8], torch.float64), meta([3], torch.int32), "differs from the parameter dtype float32"),
])
def test_infer_meta_errors_name_the_value(x, sizes, match):
    layer = ops.GroupedLinear(3, 8, 5)
    with pytest.raises(OpInputError, match=match):
        layer.infer_meta(x, sizes)


def test_sequential_reports_the_op_index():
    block = ops.Sequential(ops.GroupedLinear(3, 8, 5))
    with pytest.raises(OpInputError, match=r"Sequential op 0: GroupedLinear\(num_groups=3.*group_sizes has dtype"):
        block(torch.randn(4, 8), torch.ones(3))


@pytest.mark.parametrize("kwargs,match", [
    (dict(num_groups=0), "num_groups=0; expected a positive int"),
    (dict(parallel="tensor"), "parallel='tensor'; accepted: None, 'expert', 'fsdp', 'expert\\+fsdp'"),
    (dict(fsdp_group=object()), "fsdp_group= is only used with parallel='expert\\+fsdp'"),
])
def test_constructor_errors(kwargs, match):
    args = dict(num_groups=4, in_features=8, out_features=8) | kwargs
    with pytest.raises(ValueError, match=match):
        ops.GroupedLinear(**args)


def test_expert_and_fsdp_over_one_group_is_an_error(world1):
    with pytest.raises(ValueError, match="expert-parallel group and the FSDP group are the same group"):
        ops.GroupedLinear(4, 8, 8, parallel="expert+fsdp", group=None, fsdp_group=world1)
    with pytest.raises(ValueError, match="pass fsdp_group="):
        ops.GroupedLinear(4, 8, 8, parallel="expert+fsdp", group=world1)


def test_feature_sharded_input_is_a_partition_error(world1):
    block = ops.Sequential(ops.Linear(8, 8, bias=False, parallel="column", group=world1),
                           ops.GroupedLinear(2, 8, 4))
    with pytest.raises(PartitionError, match="input is sharded on features.*needs all 8 input features"):
        block(torch.randn(4, 8), torch.tensor([1, 3]))


def test_single_rank_parallel_modes_equal_plain(world1, rng):
    x = torch.randn(9, 8, generator=rng, dtype=torch.float64)
    counts = torch.tensor([4, 0, 5, 0])
    full_w = torch.randn(4, 6, 8, generator=rng, dtype=torch.float64)
    full_b = torch.randn(4, 6, generator=rng, dtype=torch.float64)
    want = loop_reference(x, [4, 0, 5, 0], full_w, full_b)
    for parallel in ("expert", "fsdp"):
        layer = ops.GroupedLinear(4, 8, 6, bias=True, parallel=parallel, group=world1, dtype=torch.float64)
        layer.load_unsharded(full_w, full_b)
        assert rel_err(ops.Sequential(layer)(x, counts), want) <= 1e-12, parallel
        assert rel_err(layer(x, counts), want) <= 1e-12, parallel


# Dispatch and kernel planning ------------------------------------------------------------------


def spec(dtype=torch.bfloat16, device="cuda", k=64, n=64, groups=8, bias=False):
    return CallSpec(
        op="grouped_linear",
        inputs={"x": meta([128, k], dtype, device), "group_sizes": meta([groups], torch.int32, device),
                "weight": meta([groups, n, k], dtype, device),
                "bias": meta([groups, n], dtype, device) if bias else None},
        attrs={"fsdp": False})


def test_dispatch_table_order_and_cpu_choice():
    names = [impl.name for impl in implementations.for_op("grouped_linear")]
    assert names == ["triton", "triton_tma", "torch_grouped_mm", "triton_persistent", "cudnn", "reference"]
    choice = choose(spec(torch.float32, "cpu"), implementations.for_op("grouped_linear"))
    assert choice.name == "reference"
    assert dict(choice.skipped) == {name: "needs a CUDA device" for name in names[:-1]}


def test_capability_checks_explain_rejections():
    assert "only bfloat16 runs without a host sync" in torch_mm.check(spec(torch.float16))
    assert "bfloat16" in torch_mm.check(spec(torch.float32))
    if not torch.cuda.is_available():
        return
    assert "multiples of 8" in (torch_mm.check(spec(k=60)) or "multiples of 8")


def test_forcing_an_incapable_implementation_fails_loudly(rng):
    layer = make_layer(2, 4, 4, torch.float32, rng)
    with opfuse.config.override(force_impl="grouped_linear=triton"):
        with pytest.raises(ImplementationError, match="forced implementation 'triton' cannot run"):
            ops.Sequential(layer)(torch.randn(3, 4), torch.tensor([1, 2]))


def test_tile_configs():
    large = triton_impl.gemm_config(32768, 32, 2048, 7168, torch.bfloat16)
    assert (large.bm, large.bn, large.bk, large.num_warps) == (128, 256, 64, 8)
    decode = triton_impl.gemm_config(256, 32, 2048, 7168, torch.bfloat16)
    assert decode.bm == 16 and decode.bn == 64
    small = triton_impl.gemm_config(100, 2, 20, 9, torch.float16)
    assert small.bn == 32 and small.bk == 16          # shrunk to the problem, >= 16 for tl.dot
    odd = triton_impl.gemm_config(4096, 4, 77, 1001, torch.bfloat16, aligned=False)
    assert (odd.bm, odd.bn) == (64, 64)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 300), min_size=1, max_size=40), st.integers(0, 300),
       st.sampled_from([16, 32, 64, 128]))
def test_m_tile_bound_covers_any_sizes(counts, tail, bm):
    # The kernel's grid is fixed by shapes; it must cover every group's tiles plus the tail's.
    tokens = sum(counts) + tail
    needed = sum(-(-c // bm) for c in counts) + (-(-tail // bm))
    assert needed <= triton_impl.m_tile_bound(tokens, len(counts), bm)


def test_device_offsets_clamp_like_the_kernels():
    offs = torch_mm.device_offsets(torch.tensor([5, -3, 7, 100], dtype=torch.int32), 50)
    assert offs.dtype == torch.int32 and offs.tolist() == [5, 5, 12, 50]
