"""Decode attention over repeated key/value heads on a GPU: opfuse's ``decode_attention`` (Triton,
split over the cache's positions) and the fold (the CUDA SDPA kernels: cuDNN's for bfloat16, the
memory-efficient one for float32, with boolean and float masks broadcast over the folded query
positions) equal eager, with Inductor and under CUDA graphs (``mode="reduce-overhead"``); the
kernels alone against the reference at odd sizes."""

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

import opfuse  # noqa: E402

from ..unit.test_grouped_attention import CachedAttention, notes  # noqa: E402


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.mark.parametrize("setting, expect", [("auto", "decode_attention=triton"),
                                             ("decode_attention", "decode_attention=triton"),
                                             ("fold", "folded into query positions")])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("mask", ["bool", "float", "none"])
@pytest.mark.parametrize("batch", [1, 8])
def test_decode_attention_over_the_unrepeated_cache_equals_eager(setting, expect, dtype, mask, batch):
    torch.manual_seed(batch)
    model = CachedAttention(batch=batch, kv_heads=4, groups=8, length=1024, dim=128).to("cuda", dtype)
    q = torch.randn(batch, 1, 32, 128, device="cuda", dtype=dtype)
    masks = {"bool": torch.arange(1024, device="cuda").view(1, 1, 1, 1024).expand(batch, 1, 1, 1024) < 300,
             "float": torch.randn(1, 1, 1, 1024, device="cuda", dtype=dtype), "none": None}
    with opfuse.config.override(grouped_query_attention=setting):
        compiled = opfuse.optimize(model, mode="reduce-overhead")
        with torch.no_grad():
            want = model(q, masks[mask])
            for _ in range(3):  # compile, warm up, record the graph; the last replays it
                got = compiled(q, masks[mask]).clone()
    tol = dict(atol=2e-2, rtol=2e-2) if dtype == torch.bfloat16 else dict(atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(got, want, **tol)
    assert any(expect in n for n in notes(compiled)), notes(compiled)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
def test_decode_attention_kernels_at_odd_sizes(dtype):
    from opfuse.families.attention import reference, triton_impl

    torch.manual_seed(3)
    for batch, kv_heads, groups, length, dim, kind in [(1, 4, 8, 1024, 128, "bool"), (3, 2, 6, 37, 80, "float"),
                                                       (2, 3, 1, 1, 64, None), (1, 1, 16, 4097, 128, "late"),
                                                       (64, 4, 8, 512, 128, "bool"), (64, 4, 8, 500, 128, "float"),
                                                       (2, 2, 4, 3000, 64, "bool")]:
        q = torch.randn(batch, 1, kv_heads * groups, dim, device="cuda").to(dtype).transpose(1, 2)
        k, v = (torch.randn(batch, kv_heads, length, dim, device="cuda").to(dtype) for _ in range(2))
        mask = None
        if kind == "bool":
            mask = torch.arange(length, device="cuda").view(1, 1, 1, length) < max(1, length // 3)
        elif kind == "float":
            mask = torch.randn(1, 1, 1, length, device="cuda")
            mask[..., length // 2:] = float("-inf")
        elif kind == "late":
            mask = torch.zeros(1, 1, 1, length, dtype=torch.bool, device="cuda")
            mask[..., -1] = True
        ref_mask = mask if mask is None or mask.dtype == torch.bool else mask.double()
        want = reference.forward(q.double(), k.double(), v.double(), ref_mask, dim ** -0.5)
        got = triton_impl.forward(q, k, v, mask, dim ** -0.5)
        tol = {torch.bfloat16: 2e-2, torch.float16: 5e-3, torch.float32: 2e-5}[dtype]
        err = (got.double() - want).abs().max().item()
        assert err <= tol * max(1.0, want.abs().max().item()), (batch, kv_heads, groups, length, dim, kind, err)
