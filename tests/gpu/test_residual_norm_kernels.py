"""The residual-norm CUDA kernels on one GPU.

The peer-memory kernels are exercised with *simulated ranks*: W regions in ordinary device memory
stand for the W ranks' symmetric buffers (every pointer is valid on the one GPU), and W kernels
run concurrently on W streams, each believing it is rank r. This checks the Lamport and flag
protocols, the reduction order (bitwise-identical results across ranks) and the epilogue without
a multi-GPU machine; tests/gpu/test_residual_norm_dist.py runs them across real GPUs.
"""

import math
import time

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

from opfuse.backend.runtime import extension  # noqa: E402

TOL = {torch.float32: 1e-5, torch.bfloat16: 1.6e-2, torch.float16: 2e-3}


@pytest.fixture(scope="module")
def ext():
    return extension.load("residual_norm")


def code(dtype):
    """The kernels' dtype code, from the module itself."""
    return extension.load("residual_norm").DTYPES[str(dtype).replace("torch.", "")]


def norm_code(norm):
    return extension.load("residual_norm").NORMS[norm]


def rel(a, b):
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def reference(xs, bias, residual, weight, norm_bias, norm, eps):
    h = sum(x.double() for x in xs)
    if bias is not None:
        h = h + bias.double()
    if residual is not None:
        h = h + residual.double()
    if norm == "none":
        return h, h
    if norm == "rms":
        y = h / torch.sqrt((h * h).mean(-1, keepdim=True) + eps)
    else:
        mu = h.mean(-1, keepdim=True)
        y = (h - mu) / torch.sqrt(((h - mu) ** 2).mean(-1, keepdim=True) + eps)
    if weight is not None:
        y = y * weight.double()
    if norm_bias is not None:
        y = y + norm_bias.double()
    return y, h


def make(tokens, hidden, dtype, world, gen, with_bias=True, with_res=True, with_w=True, with_nb=False):
    rnd = lambda *s: torch.randn(*s, generator=gen, device="cuda", dtype=torch.float32).to(dtype)  # noqa: E731
    xs = [rnd(tokens, hidden) for _ in range(world)]
    return (xs, rnd(hidden) if with_bias else None, rnd(tokens, hidden) if with_res else None,
            (1 + 0.2 * rnd(hidden)) if with_w else None, rnd(hidden) if with_nb else None)


def ptr(t):
    return 0 if t is None else t.data_ptr()


class SimulatedRanks:
    """W ranks on one GPU: W peer regions in plain device memory, one stream per rank."""

    def __init__(self, ext, kind, world, dtype, capacity):
        self.ext, self.kind, self.world = ext, kind, world
        size = (ext.oneshot_region_bytes if kind == "oneshot" else ext.twoshot_region_bytes)(world, capacity)
        self.buffers = [torch.empty(size, dtype=torch.uint8, device="cuda") for _ in range(world)]
        self.peers = torch.tensor([b.data_ptr() for b in self.buffers], dtype=torch.int64, device="cuda")
        self.regions = [ext.PeerRegion(self.peers.data_ptr(), b.data_ptr(), r, world, size, capacity)
                        for r, b in enumerate(self.buffers)]
        self.streams = [torch.cuda.Stream() for _ in range(world)]
        stream = torch.cuda.current_stream().cuda_stream
        for region in self.regions:
            if kind == "oneshot":
                ext.oneshot_init(region, code(dtype), stream)
            else:
                ext.twoshot_init(region, stream)
        torch.cuda.synchronize()
        sms = torch.cuda.get_device_properties(0).multi_processor_count
        self.blocks = max(1, (sms - 4) // world)  # every rank's grid must be resident at once
        self.watches = [ext.PeerWatch() for _ in range(world)]

    def launch(self, r, x, bias, residual, weight, norm_bias, y, h, norm, eps=1e-6, timeout_ns=0):
        """Enqueue rank ``r``'s call on its stream; nothing waits for it."""
        tokens, hidden = x.shape
        watch = self.watches[r]
        args = (ptr(x), ptr(bias), ptr(residual), ptr(weight), ptr(norm_bias), y.data_ptr(), ptr(h),
                tokens, hidden, eps, norm_code(norm), code(x.dtype), self.regions[r], watch.flag,
                watch.record, timeout_ns, 7)
        with torch.cuda.stream(self.streams[r]):
            if self.kind == "oneshot":
                self.ext.allreduce_oneshot(*args, self.blocks, self.streams[r].cuda_stream)
            else:
                blocks = max(1, min(self.blocks, math.ceil(tokens / self.world)))
                self.ext.allreduce_twoshot(*args, blocks, self.streams[r].cuda_stream)

    def fork(self):
        for stream in self.streams:
            stream.wait_stream(torch.cuda.current_stream())

    def join(self):
        for stream in self.streams:
            torch.cuda.current_stream().wait_stream(stream)

    def run(self, xs, bias, residual, weight, norm_bias, norm, eps=1e-6, write_h=True, ranks=None, timeout_ns=0):
        """One call on every rank (or on ``ranks`` only: the others skip it)."""
        ys = [torch.full_like(xs[0], float("nan")) for _ in range(self.world)]
        hs = [torch.full_like(xs[0], float("nan")) if write_h else None for _ in range(self.world)]
        self.fork()
        for r in range(self.world) if ranks is None else ranks:
            self.launch(r, xs[r], bias, residual, weight, norm_bias, ys[r], hs[r], norm, eps, timeout_ns)
        self.join()
        torch.cuda.synchronize()
        return ys, hs


def check_ranks(ys, hs, xs, bias, residual, weight, norm_bias, norm, dtype, eps=1e-6):
    y_ref, h_ref = reference(xs, bias, residual, weight, norm_bias, norm, eps)
    for r, y in enumerate(ys):
        assert not torch.isnan(y).any(), f"rank {r}: unwritten output elements"
        assert torch.equal(y, ys[0]), f"rank {r} differs from rank 0 (must be bitwise identical)"
        assert rel(y, y_ref) < TOL[dtype], f"rank {r}: y error {rel(y, y_ref)}"
        if hs[r] is not None:
            assert torch.equal(hs[r], hs[0])
            assert rel(hs[r], h_ref) < TOL[dtype], f"rank {r}: h error {rel(hs[r], h_ref)}"


@pytest.mark.parametrize("kind", ["oneshot", "twoshot"])
@pytest.mark.parametrize("world", [2, 3, 4, 8])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
def test_peer_kernels_simulated_ranks(ext, kind, world, dtype):
    gen = torch.Generator(device="cuda").manual_seed(world * 100 + [torch.float32, torch.bfloat16, torch.float16].index(dtype))
    sim = SimulatedRanks(ext, kind, world, dtype, capacity=4 << 20)
    # Consecutive calls of different sizes exercise buffer rotation and the dirty-size bookkeeping.
    for tokens, hidden, norm in [(5, 2880, "rms"), (1, 8192, "rms"), (33, 5120, "layer"), (2, 1024, "none"),
                                 (64, 4096, "rms"), (7, 2880, "rms"), (3, 16384, "rms")]:
        if kind == "twoshot" and tokens * hidden * xs_elem(dtype) > 4 << 20:
            continue
        xs, bias, res, w, nb = make(tokens, hidden, dtype, world, gen, with_nb=norm == "layer")
        ys, hs = sim.run(xs, bias, res, w, nb, norm)
        check_ranks(ys, hs, xs, bias, res, w, nb, norm, dtype)


def xs_elem(dtype):
    return torch.empty((), dtype=dtype).element_size()


@pytest.mark.parametrize("kind", ["oneshot", "twoshot"])
def test_peer_kernels_negative_zero_and_options(ext, kind):
    dtype, world = torch.bfloat16, 4
    gen = torch.Generator(device="cuda").manual_seed(7)
    sim = SimulatedRanks(ext, kind, world, dtype, capacity=1 << 20)
    for step in range(6):
        xs, bias, res, w, _ = make(9, 1024, dtype, world, gen, with_bias=step % 2 == 0, with_res=step % 3 != 0,
                                   with_w=step != 4)
        for r, x in enumerate(xs):  # -0.0 must not be taken for "not arrived yet"
            x[:, r::5] = -0.0
        ys, hs = sim.run(xs, bias, res, w, None, "rms", write_h=step % 2 == 1)
        check_ranks(ys, hs, xs, bias, res, w, None, "rms", dtype)


# Back-to-back calls whose sizes change so that every receive buffer is reused after a larger
# call (stale data past the smaller message, or at other offsets when the row size changes) and
# after a smaller one (the larger message lands on cleared sentinels only if the clearing of the
# previous user covered it). (tokens, hidden) per call; 11 calls, so the three buffers meet
# different sizes on every lap and in every graph replay.
SEQUENCE = [(96, 8192), (1, 8192), (7, 2048), (33, 5120), (1, 5120), (128, 4096), (2, 16384), (5, 8192),
            (64, 2880), (1, 1024), (40, 8192)]
SEQUENCE_TIMEOUT_NS = 2_000_000_000  # a wait that never ends fails the test instead of hanging it


class Sequence:
    """Inputs and outputs of SEQUENCE on every simulated rank, allocated once (graph-friendly)."""

    def __init__(self, sim, dtype, gen):
        self.sim, self.dtype, self.gen = sim, dtype, gen
        self.inputs = [make(t, h, dtype, sim.world, gen) for t, h in SEQUENCE]
        self.ys = [[torch.full((t, h), float("nan"), device="cuda", dtype=dtype) for _ in range(sim.world)]
                   for t, h in SEQUENCE]
        self.hs = [[torch.full_like(y, float("nan")) for y in ys] for ys in self.ys]
        self.refill()

    def refill(self):
        """Fresh random inputs (in place; -0.0 in every rank's message) and NaN outputs."""
        for (xs, bias, res, w, nb), ys, hs in zip(self.inputs, self.ys, self.hs):
            for r, x in enumerate(xs):
                x.copy_(torch.randn(x.shape, generator=self.gen, device="cuda"))
                x[:, r::7] = -0.0
            for t in (bias, res):
                t.copy_(torch.randn(t.shape, generator=self.gen, device="cuda"))
            w.copy_(1 + 0.2 * torch.randn(w.shape, generator=self.gen, device="cuda"))
            for out in (*ys, *hs):
                out.fill_(float("nan"))

    def enqueue(self):
        """Every call on every rank, back to back on each rank's stream: no host or cross-rank
        synchronisation between calls, so a fast rank runs into its next call (pushing, clearing)
        while a slow one still reduces the previous."""
        self.sim.fork()
        for (xs, bias, res, w, nb), ys, hs in zip(self.inputs, self.ys, self.hs):
            for r in range(self.sim.world):
                self.sim.launch(r, xs[r], bias, res, w, nb, ys[r], hs[r], "rms", timeout_ns=SEQUENCE_TIMEOUT_NS)
        self.sim.join()

    def check(self, what):
        torch.cuda.synchronize()
        for r, watch in enumerate(self.sim.watches):
            assert not watch.failed(), f"{what}: rank {r} waited past the timeout: {watch.read()}"
        for (t, h), (xs, bias, res, w, nb), ys, hs in zip(SEQUENCE, self.inputs, self.ys, self.hs):
            try:
                check_ranks(ys, hs, xs, bias, res, w, nb, "rms", self.dtype)
            except AssertionError as err:
                raise AssertionError(f"{what}, call ({t} x {h}), world {self.sim.world}: {err}") from None


@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_oneshot_back_to_back_calls_of_changing_sizes(ext, world, dtype):
    gen = torch.Generator(device="cuda").manual_seed(40 + world)
    capacity = max(t * h for t, h in SEQUENCE) * xs_elem(dtype)
    sim = SimulatedRanks(ext, "oneshot", world, dtype, capacity=capacity)
    seq = Sequence(sim, dtype, gen)
    for lap in range(3):  # 33 calls: every buffer is reused by every size class
        seq.enqueue()
        seq.check(f"lap {lap}")
        seq.refill()


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_oneshot_graph_replays_with_fresh_data(ext, world):
    """SEQUENCE captured once per rank in one CUDA graph, replayed with new inputs each time: the
    buffer index and dirty sizes live in device memory, so every replay starts where the last
    ended (11 calls: a different buffer each replay)."""
    dtype = torch.bfloat16
    gen = torch.Generator(device="cuda").manual_seed(60 + world)
    capacity = max(t * h for t, h in SEQUENCE) * xs_elem(dtype)
    sim = SimulatedRanks(ext, "oneshot", world, dtype, capacity=capacity)
    seq = Sequence(sim, dtype, gen)
    seq.enqueue()  # eager first (the kernels are loaded before capture)
    seq.check("eager")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        seq.enqueue()
    for replay in range(4):
        seq.refill()
        graph.replay()
        seq.check(f"replay {replay}")


def test_add_norm_kernel_many_shapes(ext):
    gen = torch.Generator(device="cuda").manual_seed(3)
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        for tokens, hidden in [(1, 128), (3, 2880), (17, 5120), (256, 8192), (1000, 1024), (2, 16384), (5, 40960)]:
            if dtype == torch.float32 and hidden > 32768:
                continue
            for norm in ("rms", "layer", "none"):
                xs, bias, res, w, nb = make(tokens, hidden, dtype, 1, gen, with_nb=norm == "layer")
                y = torch.full_like(xs[0], float("nan"))
                h = torch.full_like(xs[0], float("nan"))
                ext.add_norm(xs[0].data_ptr(), ptr(bias), ptr(res), ptr(w), ptr(nb), y.data_ptr(), h.data_ptr(),
                             tokens, hidden, 1e-5, norm_code(norm), code(dtype), 264,
                             torch.cuda.current_stream().cuda_stream)
                torch.cuda.synchronize()
                y_ref, h_ref = reference(xs, bias, res, w, nb, norm, 1e-5)
                assert not torch.isnan(y).any() and not torch.isnan(h).any()
                assert rel(y, y_ref) < TOL[dtype], (dtype, tokens, hidden, norm, rel(y, y_ref))
                assert rel(h, h_ref) < TOL[dtype]


def test_rms_backward_kernel(ext):
    gen = torch.Generator(device="cuda").manual_seed(5)
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        for tokens, hidden in [(1, 2880), (37, 8192), (700, 1024), (4, 16384)]:
            h = torch.randn(tokens, hidden, generator=gen, device="cuda").to(dtype)
            dy = torch.randn(tokens, hidden, generator=gen, device="cuda").to(dtype)
            dh_out = torch.randn(tokens, hidden, generator=gen, device="cuda").to(dtype)
            w = (1 + 0.1 * torch.randn(hidden, generator=gen, device="cuda")).to(dtype)
            blocks = min(tokens, 264)
            dh = torch.full_like(h, float("nan"))
            dw = torch.full_like(w, float("nan"))
            partial = torch.full((blocks, hidden), float("nan"), device="cuda")
            ext.rms_norm_backward(dy.data_ptr(), h.data_ptr(), w.data_ptr(), dh_out.data_ptr(), dh.data_ptr(),
                                  partial.data_ptr(), dw.data_ptr(), tokens, hidden, 1e-6, code(dtype), blocks,
                                  torch.cuda.current_stream().cuda_stream)
            hr, wr = h.double().requires_grad_(), w.double().requires_grad_()
            yr = hr / torch.sqrt((hr * hr).mean(-1, keepdim=True) + 1e-6) * wr
            yr.backward(dy.double())
            assert rel(dh, hr.grad + dh_out.double()) < 2 * TOL[dtype], (dtype, tokens, hidden)
            assert rel(dw, wr.grad) < 2 * TOL[dtype], (dtype, tokens, hidden, rel(dw, wr.grad))


def test_kernel_argument_errors(ext):
    x = torch.randn(4, 100, device="cuda", dtype=torch.bfloat16)  # 200 bytes per row: not a multiple of 16
    y = torch.empty_like(x)
    with pytest.raises(RuntimeError, match="multiple of 16 bytes"):
        ext.add_norm(x.data_ptr(), 0, 0, 0, 0, y.data_ptr(), 0, 4, 100, 1e-6, 1, 1, 8,
                     torch.cuda.current_stream().cuda_stream)
    x = torch.randn(4, 128, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="16-byte aligned"):
        ext.add_norm(x.data_ptr() + 2, 0, 0, 0, 0, x.data_ptr(), 0, 2, 128, 1e-6, 1, 1, 8,
                     torch.cuda.current_stream().cuda_stream)


@pytest.mark.parametrize("kind", ["oneshot", "twoshot"])
def test_a_peer_that_skips_a_call_times_out_instead_of_hanging(ext, kind):
    """Rank 1 of 2 never launches: rank 0's kernel gives up after the timeout, finishes, and its
    record names the wait and the peer; no trap, the context stays usable."""
    gen = torch.Generator(device="cuda").manual_seed(5)
    ranks = SimulatedRanks(ext, kind, 2, torch.bfloat16, 8 << 20)
    xs, bias, res, w, nb = make(64, 1024, torch.bfloat16, 2, gen)
    ranks.run(xs, bias, res, w, nb, "rms")  # both ranks: fine
    assert not ranks.watches[0].failed()
    start = time.perf_counter()
    ranks.run(xs, bias, res, w, nb, "rms", ranks=[0], timeout_ns=200_000_000)  # synchronizes
    elapsed = time.perf_counter() - start
    assert 0.2 <= elapsed < 5, elapsed
    failed, site, rank, peer, op, block, waited_ns = ranks.watches[0].read()
    assert failed and (rank, peer, op) == (0, 1, 7) and waited_ns >= 200_000_000
    assert site == ext.PEER_WAIT_SITES["one-shot" if kind == "oneshot" else "two-shot reduce-scatter"]
    torch.ones(1, device="cuda").sum().item()  # the context is alive
