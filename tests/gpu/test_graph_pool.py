"""State opfuse keeps across calls (FP8 weight copies, power-of-two scale hints) is never left in a
cudagraph tree's private pool: ``torch.compile(mode="reduce-overhead")`` warms a graph up with
every allocation of the thread going to that pool, and fails any tensor there it does not track.
Skipped without CUDA."""

import pytest
import torch

from opfuse.families.quantize import weight_cache, weight_pow2
from opfuse.runtime.device import allocating_to_graph_pool, outside_graph_pool

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
needs_sm90 = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0),
                                reason="the one-read FP8 weight quantizer runs on sm90 here")

_seen = []


@torch.library.custom_op("opfuse_test::cached_fp8_weight", mutates_args=())
def cached_fp8_weight(weight: torch.Tensor, key: int) -> torch.Tensor:
    """The FP8 weight through the weight cache and a hint made on first use, dequantized."""
    _seen.append(allocating_to_graph_pool())
    q = weight_cache.cached(weight, "test/w", lambda: weight_pow2.quantize_weight(weight, torch.float8_e4m3fn,
                                                                                   False, key=("test", key)))
    return q.data.float() * q.scale_inv


@cached_fp8_weight.register_fake
def _(weight, key):
    return weight.new_empty(weight.shape, dtype=torch.float32)


def test_a_capture_allocates_to_the_graph_pool():
    assert not allocating_to_graph_pool()
    x = torch.zeros(4, device="cuda")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        inside = allocating_to_graph_pool()
        x.add_(1)
    assert inside and not allocating_to_graph_pool()


def test_outside_graph_pool_runs_on_a_helper_thread_and_refuses_a_capture():
    made = outside_graph_pool(lambda: torch.full((3,), 7, device="cuda"))
    assert made.tolist() == [7, 7, 7]
    graph = torch.cuda.CUDAGraph()
    with pytest.raises(RuntimeError, match="during a CUDA-graph capture"):
        with torch.cuda.graph(graph):
            outside_graph_pool(lambda: torch.zeros(1, device="cuda"))


@needs_sm90
def test_weight_state_made_in_a_cudagraph_tree_warm_up_stays_out_of_its_pool():
    torch._dynamo.reset()
    _seen.clear()
    weight = torch.randn(256, 512, device="cuda", dtype=torch.bfloat16)
    key = weight_pow2.new_key()

    def fn(w):
        return cached_fp8_weight(w, key) * 2

    compiled = torch.compile(fn, mode="reduce-overhead", dynamic=False)
    for step in range(4):  # warm-up, recording, replays; the tree checks its pool on the way
        torch.compiler.cudagraph_mark_step_begin()
        got = compiled(weight).clone()
        want = fn(weight)
        assert torch.equal(got, want), step
        with torch.no_grad():
            weight.mul_(1.5)  # the replays must follow the weight, not a copy cached during warm-up
    assert _seen and _seen[0], "the warm-up call did not see the tree's pool"
    torch._dynamo.reset()
