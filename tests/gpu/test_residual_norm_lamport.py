"""The pipelined Lamport two-shot (``allreduce_lamport.cu``, implementation ``cuda_twoshot_lamport``)
and PDL launches of the peer kernels, on one GPU with simulated ranks.

W regions in ordinary device memory stand for the W ranks' symmetric buffers and W kernels run
concurrently on W streams (tests/gpu/test_residual_norm_kernels.py's ``SimulatedRanks``). Every
check uses fresh random inputs against a float64 reference of the unfused math, NaN-poisoned
outputs (an element a kernel fails to write shows), and bitwise equality across ranks. The
protocol cases: odd sizes (1, 3, 17, 1000, 4099 tokens at hidden 5120 and 8192), -0.0 in the
inputs (the sentinel), back-to-back calls of changing sizes with no synchronisation between
them, CUDA-graph capture and replays with fresh data (11 calls per graph, so the two buffers
alternate between replays), a late peer (must still give the right answer) and an absent one
(must end with a timeout record naming the wait and the peer, not a hang). Every wait is bounded
(``TIMEOUT_NS``), so a protocol bug fails a test instead of hanging the session.
"""

import time

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

from opfuse.runtime import extension  # noqa: E402

from .test_residual_norm_kernels import SimulatedRanks, check_ranks, make, xs_elem  # noqa: E402

TIMEOUT_NS = 3_000_000_000  # a wait that never ends fails the test instead of hanging it
DTYPES = [torch.bfloat16, torch.float16, torch.float32]
# (tokens, hidden): the odd sizes at hidden 5120 and 8192, plus short and long rows.
SHAPES = [(1, 8192), (3, 5120), (17, 5120), (1000, 8192), (4099, 5120), (2, 16384), (33, 2880), (7, 1024),
          (130, 4096), (1, 1024)]


@pytest.fixture(scope="module")
def ext():
    return extension.load("residual_norm")


def capacity_for(shapes, dtype):
    return max(t * h for t, h in shapes) * xs_elem(dtype)


def run_checked(sim, xs, bias, res, w, nb, norm, dtype, write_h=True, what=""):
    ys, hs = sim.run(xs, bias, res, w, nb, norm, write_h=write_h, timeout_ns=TIMEOUT_NS)
    for r, watch in enumerate(sim.watches):
        assert not watch.failed(), f"{what}: rank {r} waited past the timeout: {watch.read()}"
    try:
        check_ranks(ys, hs, xs, bias, res, w, nb, norm, dtype)
    except AssertionError as err:
        raise AssertionError(f"{what}: {err}") from None


@pytest.mark.parametrize("world", [2, 3, 4, 8])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_lamport_kernel_matches_the_reference_at_odd_sizes(ext, world, dtype):
    gen = torch.Generator(device="cuda").manual_seed(1000 * world + DTYPES.index(dtype))
    sim = SimulatedRanks(ext, "lamport", world, dtype, capacity=capacity_for(SHAPES, dtype))
    for case, (tokens, hidden) in enumerate(SHAPES):
        norm = ("rms", "layer", "none")[case % 3]
        xs, bias, res, w, nb = make(tokens, hidden, dtype, world, gen, with_bias=case % 2 == 0,
                                    with_res=case % 4 != 3, with_w=case % 5 != 4, with_nb=norm == "layer")
        for r, x in enumerate(xs):  # -0.0 must not be taken for "not arrived yet"
            x.view(-1)[r::11] = -0.0
        run_checked(sim, xs, bias, res, w, nb, norm, dtype, write_h=case % 2 == 1,
                    what=f"world {world} {dtype} T={tokens} H={hidden} {norm}")


def test_lamport_kernel_rejects_messages_over_its_capacity(ext):
    sim = SimulatedRanks(ext, "lamport", 2, torch.bfloat16, capacity=1 << 20)
    gen = torch.Generator(device="cuda").manual_seed(3)
    xs, bias, res, w, _ = make(65, 8192, torch.bfloat16, 2, gen)  # 1040 KiB > 1 MiB
    with pytest.raises(RuntimeError, match="allreduce_lamport: opfuse Lamport two-shot: message larger than the region"):
        sim.launch(0, xs[0], bias, res, w, None, torch.empty_like(xs[0]), None, "rms")


# Back-to-back calls whose sizes change (odd token counts, rows of 2-32 KiB, a short last chunk),
# 11 per lap so the two buffers meet every size in turn; no synchronisation between calls.
SEQUENCE = [(1000, 8192), (1, 8192), (17, 5120), (4099, 5120), (3, 5120), (256, 2880), (2, 16384), (1000, 5120),
            (64, 8192), (1, 1024), (33, 4096)]


class Sequence:
    """Inputs and outputs of SEQUENCE on every simulated rank, allocated once (graph-friendly)."""

    def __init__(self, sim, dtype, gen, shapes=SEQUENCE):
        self.sim, self.dtype, self.gen, self.shapes = sim, dtype, gen, shapes
        self.inputs = [make(t, h, dtype, sim.world, gen) for t, h in shapes]
        self.ys = [[torch.empty((t, h), device="cuda", dtype=dtype) for _ in range(sim.world)] for t, h in shapes]
        self.hs = [[torch.empty_like(y) for y in ys] for ys in self.ys]
        self.refill()

    def refill(self):
        """Fresh random inputs in place (with -0.0 in every rank's message) and NaN outputs."""
        for (xs, bias, res, w, _), ys, hs in zip(self.inputs, self.ys, self.hs):
            for r, x in enumerate(xs):
                x.copy_(torch.randn(x.shape, generator=self.gen, device="cuda"))
                x.view(-1)[r::7] = -0.0
            for t in (bias, res):
                t.copy_(torch.randn(t.shape, generator=self.gen, device="cuda"))
            w.copy_(1 + 0.2 * torch.randn(w.shape, generator=self.gen, device="cuda"))
            for out in (*ys, *hs):
                out.fill_(float("nan"))

    def enqueue(self):
        """Every call on every rank, back to back on each rank's stream."""
        self.sim.fork()
        for (xs, bias, res, w, nb), ys, hs in zip(self.inputs, self.ys, self.hs):
            for r in range(self.sim.world):
                self.sim.launch(r, xs[r], bias, res, w, nb, ys[r], hs[r], "rms", timeout_ns=TIMEOUT_NS)
        self.sim.join()

    def check(self, what):
        torch.cuda.synchronize()
        for r, watch in enumerate(self.sim.watches):
            assert not watch.failed(), f"{what}: rank {r} waited past the timeout: {watch.read()}"
        for (t, h), (xs, bias, res, w, nb), ys, hs in zip(self.shapes, self.inputs, self.ys, self.hs):
            try:
                check_ranks(ys, hs, xs, bias, res, w, nb, "rms", self.dtype)
            except AssertionError as err:
                raise AssertionError(f"{what}, call ({t} x {h}), world {self.sim.world}: {err}") from None


@pytest.mark.parametrize("pdl", [False, True], ids=["plain", "pdl"])
@pytest.mark.parametrize("world", [1, 2, 3, 4, 8])
def test_lamport_back_to_back_calls_of_changing_sizes(ext, world, pdl):
    dtype = torch.bfloat16
    gen = torch.Generator(device="cuda").manual_seed(70 + world)
    sim = SimulatedRanks(ext, "lamport", world, dtype, capacity=capacity_for(SEQUENCE, dtype), pdl=pdl)
    seq = Sequence(sim, dtype, gen)
    for lap in range(3):  # 33 calls: each buffer meets every size class
        seq.enqueue()
        seq.check(f"lap {lap}")
        seq.refill()


@pytest.mark.parametrize("kind", ["lamport", "oneshot"])
@pytest.mark.parametrize("pdl", [False, True], ids=["plain", "pdl"])
@pytest.mark.parametrize("world", [2, 4])
def test_graph_replays_with_fresh_data(ext, kind, world, pdl):
    """SEQUENCE captured once (every rank's stream) in one CUDA graph, replayed with new inputs:
    the call counter lives in device memory, so each replay continues the buffer rotation (11
    calls: the other parity each replay). With PDL the launches become programmatic edges."""
    dtype = torch.bfloat16
    shapes = SEQUENCE if kind == "lamport" else [(t, h) for t, h in SEQUENCE if t * h <= 1 << 20]
    gen = torch.Generator(device="cuda").manual_seed(90 + world + 2 * pdl)
    sim = SimulatedRanks(ext, kind, world, dtype, capacity=capacity_for(shapes, dtype), pdl=pdl)
    seq = Sequence(sim, dtype, gen, shapes)
    seq.enqueue()  # eager first (the kernels are loaded before capture)
    seq.check("eager")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        seq.enqueue()
    for replay in range(6):
        seq.refill()
        graph.replay()
        seq.check(f"{kind} replay {replay}")


@pytest.mark.parametrize("world", [2, 3, 4])
def test_oneshot_back_to_back_with_pdl(ext, world):
    """The one-shot's protocol (two buffers, each pack cleared as it is read) with PDL launches."""
    dtype = torch.bfloat16
    shapes = [(t, h) for t, h in SEQUENCE if t * h <= 1 << 20]
    gen = torch.Generator(device="cuda").manual_seed(110 + world)
    sim = SimulatedRanks(ext, "oneshot", world, dtype, capacity=capacity_for(shapes, dtype), pdl=True)
    seq = Sequence(sim, dtype, gen, shapes)
    for lap in range(3):
        seq.enqueue()
        seq.check(f"lap {lap}")
        seq.refill()


@pytest.mark.parametrize("kind", ["lamport", "oneshot", "twoshot"])
def test_pdl_and_plain_launches_give_the_same_bits(ext, kind):
    dtype, world = torch.bfloat16, 2
    gen = torch.Generator(device="cuda").manual_seed(5)
    shapes = [(17, 5120), (1, 8192), (200, 8192)]
    outs = {}
    for pdl in (False, True):
        sim = SimulatedRanks(ext, kind, world, dtype, capacity=8 << 20, pdl=pdl)
        gen.manual_seed(5)
        results = []
        for tokens, hidden in shapes:
            xs, bias, res, w, _ = make(tokens, hidden, dtype, world, gen)
            ys, hs = sim.run(xs, bias, res, w, None, "rms", timeout_ns=TIMEOUT_NS)
            check_ranks(ys, hs, xs, bias, res, w, None, "rms", dtype)
            results.append((ys[0], hs[0]))
        outs[pdl] = results
    for (y0, h0), (y1, h1) in zip(outs[False], outs[True]):
        assert torch.equal(y0, y1) and torch.equal(h0, h1), f"{kind}: PDL changed the result"


def test_a_late_peer_still_gets_the_right_answer(ext):
    """Rank 1 starts ~50 ms after rank 0 (a spin kernel on its stream first): rank 0's waits
    outlast it and every output is right; no timeout is recorded."""
    dtype, world = torch.bfloat16, 2
    gen = torch.Generator(device="cuda").manual_seed(8)
    sim = SimulatedRanks(ext, "lamport", world, dtype, capacity=8 << 20)
    xs, bias, res, w, _ = make(300, 8192, dtype, world, gen)
    ys = [torch.full_like(xs[0], float("nan")) for _ in range(world)]
    hs = [torch.full_like(xs[0], float("nan")) for _ in range(world)]
    sim.fork()
    with torch.cuda.stream(sim.streams[1]):
        torch.cuda._sleep(100_000_000)  # 1e8 cycles: 50-70 ms at H100 / H200 clocks
    for r in range(world):
        sim.launch(r, xs[r], bias, res, w, None, ys[r], hs[r], "rms", timeout_ns=TIMEOUT_NS)
    sim.join()
    torch.cuda.synchronize()
    assert not any(watch.failed() for watch in sim.watches), [watch.read() for watch in sim.watches]
    check_ranks(ys, hs, xs, bias, res, w, None, "rms", dtype)


def test_an_absent_peer_times_out_with_a_record_instead_of_hanging(ext):
    """Rank 1 of 2 never launches: rank 0 gives up after the timeout, finishes, and its record
    names the Lamport reduce-scatter wait and peer 1; the context stays usable."""
    gen = torch.Generator(device="cuda").manual_seed(9)
    sim = SimulatedRanks(ext, "lamport", 2, torch.bfloat16, 8 << 20)
    xs, bias, res, w, nb = make(64, 1024, torch.bfloat16, 2, gen)
    sim.run(xs, bias, res, w, nb, "rms", timeout_ns=TIMEOUT_NS)  # both ranks: fine
    assert not sim.watches[0].failed()
    start = time.perf_counter()
    sim.run(xs, bias, res, w, nb, "rms", ranks=[0], timeout_ns=200_000_000)  # synchronizes
    elapsed = time.perf_counter() - start
    assert 0.2 <= elapsed < 5, elapsed
    failed, site, rank, peer, op, block, waited_ns = sim.watches[0].read()
    assert failed and (rank, peer, op) == (0, 1, 7) and waited_ns >= 200_000_000
    assert site == ext.PEER_WAIT_SITES["Lamport two-shot reduce-scatter"]
    torch.ones(1, device="cuda").sum().item()  # the context is alive


@pytest.mark.parametrize("world", [2, 3])
def test_fp8_epilogue_of_the_lamport_kernel(ext, world):
    """Per row and per tensor: the FP8 bytes and scales equal the reference quantizer applied to the
    plain kernel's y, bit for bit, on every rank (as the other peer kernels' FP8 tests)."""
    from .test_fp8_allreduce_norm_kernels import SHAPES as FP8_SHAPES
    from .test_fp8_allreduce_norm_kernels import check_against_plain, fp8_call

    dtype = torch.bfloat16
    gen = torch.Generator(device="cuda").manual_seed(130 + world)
    sim = SimulatedRanks(ext, "lamport", world, dtype, capacity=4 << 20)
    for i, (tokens, hidden) in enumerate(FP8_SHAPES):
        xs, bias, res, w, _ = make(tokens, hidden, dtype, world, gen, with_bias=i % 2 == 0)
        ys, hs = sim.run(xs, bias, res, w, None, "rms")
        for fmt in ("e4m3", "e5m2"):
            for rowwise in (True, False):
                results = fp8_call(ext, sim, xs, bias, res, w, fmt, rowwise)
                check_against_plain(results, ys[0], hs[0], fmt, rowwise,
                                    f"lamport world {world} T={tokens} H={hidden} {fmt} {'row' if rowwise else 'tensor'}")
