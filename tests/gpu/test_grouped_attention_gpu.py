"""Decode attention over repeated key/value heads on a GPU: the folded attention (the CUDA SDPA
kernels: cuDNN's for bfloat16, the memory-efficient one for float32, with boolean and float masks
broadcast over the folded query positions) equals eager, with Inductor and under CUDA graphs
(``mode="reduce-overhead"``); batch x key/value heads >= MIN_FOLDED_HEADS, so every call folds."""

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


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("mask", ["bool", "float", "none"])
@pytest.mark.parametrize("batch", [4, 8])
def test_folded_decode_attention_equals_eager(dtype, mask, batch):
    torch.manual_seed(batch)
    model = CachedAttention(batch=batch, kv_heads=4, groups=8, length=1024, dim=128).to("cuda", dtype)
    q = torch.randn(batch, 1, 32, 128, device="cuda", dtype=dtype)
    masks = {"bool": torch.rand(batch, 1, 1, 1024, device="cuda") > 0.2,
             "float": torch.randn(1, 1, 1, 1024, device="cuda", dtype=dtype), "none": None}
    compiled = opfuse.optimize(model, mode="reduce-overhead")
    with torch.no_grad():
        want = model(q, masks[mask])
        for _ in range(3):  # compile, warm up, record the graph; the last replays it
            got = compiled(q, masks[mask]).clone()
    tol = dict(atol=2e-2, rtol=2e-2) if dtype == torch.bfloat16 else dict(atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(got, want, **tol)
    assert any(n.startswith("1 decode attention(s) read the key/value cache") for n in notes(compiled)), notes(compiled)
