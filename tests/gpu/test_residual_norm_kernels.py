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

from opfuse.runtime import extension  # noqa: E402

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
    """W ranks on one GPU: W peer regions in plain device memory, one stream per rank.

    ``kind``: ``"oneshot"``, ``"twoshot"`` or ``"lamport"`` (the pipelined Lamport two-shot).
    ``pdl``: launch with programmatic dependent launch; a rank's next call can then be resident
    (waiting) while its current one runs, so every rank gets half the grid."""

    def __init__(self, ext, kind, world, dtype, capacity, pdl=False):
        self.ext, self.kind, self.world, self.pdl = ext, kind, world, pdl
        size = getattr(ext, f"{kind}_region_bytes")(world, capacity)
        self.buffers = [torch.empty(size, dtype=torch.uint8, device="cuda") for _ in range(world)]
        self.peers = torch.tensor([b.data_ptr() for b in self.buffers], dtype=torch.int64, device="cuda")
        self.regions = [ext.PeerRegion(self.peers.data_ptr(), b.data_ptr(), r, world, size, capacity)
                        for r, b in enumerate(self.buffers)]
        self.streams = [torch.cuda.Stream() for _ in range(world)]
        stream = torch.cuda.current_stream().cuda_stream
        for region in self.regions:
            if kind == "twoshot":
                ext.twoshot_init(region, stream)
            else:
                getattr(ext, f"{kind}_init")(region, code(dtype), stream)
        torch.cuda.synchronize()
        sms = torch.cuda.get_device_properties(0).multi_processor_count
        # Every rank's grid must be resident at once (with PDL: two grids per rank).
        self.blocks = max(1, (sms - 4) // (world * (2 if pdl else 1)))
        self.watches = [ext.PeerWatch() for _ in range(world)]

    def launch(self, r, x, bias, residual, weight, norm_bias, y, h, norm, eps=1e-6, timeout_ns=0, epilogue=None):
        """Enqueue rank ``r``'s call on its stream; nothing waits for it. ``epilogue``: an
        ``Fp8Epilogue`` (the FP8 launchers; y is then left unwritten)."""
        tokens, hidden = x.shape
        watch = self.watches[r]
        args = (ptr(x), ptr(bias), ptr(residual), ptr(weight), ptr(norm_bias), y.data_ptr(), ptr(h),
                tokens, hidden, eps, norm_code(norm), code(x.dtype), self.regions[r], watch.flag,
                watch.record, timeout_ns, 7)
        launch = getattr(self.ext, f"allreduce_{self.kind}")
        fp8_launch = getattr(self.ext, f"allreduce_{self.kind}_fp8")
        if self.kind == "twoshot":
            grid = max(1, min(self.blocks, math.ceil(tokens / self.world)))
        else:  # one-shot, Lamport: a bound on the grid
            grid = self.blocks
        with torch.cuda.stream(self.streams[r]):
            if epilogue is None:
                launch(*args, grid, self.streams[r].cuda_stream, pdl=self.pdl)
            else:
                fp8_launch(epilogue, *args, grid, self.streams[r].cuda_stream, pdl=self.pdl)

    def fork(self):
        for stream in self.streams:
            stream.wait_stream(torch.cuda.current_stream())

    def join(self):
        for stream in self.streams:
            torch.cuda.current_stream().wait_stream(stream)

    def run(self, xs, bias, residual, weight, norm_bias, norm, eps=1e-6, write_h=True, ranks=None, timeout_ns=0,
            epilogues=None, sync=True):
        """One call on every rank (or on ``ranks`` only: the others skip it); ``epilogues``: one
        ``Fp8Epilogue`` per rank; ``sync=False`` inside a CUDA-graph capture."""
        ys = [torch.full_like(xs[0], float("nan")) for _ in range(self.world)]
        hs = [torch.full_like(xs[0], float("nan")) if write_h else None for _ in range(self.world)]
        self.fork()
        for r in range(self.world) if ranks is None else ranks:
            self.launch(r, xs[r], bias, residual, weight, norm_bias, ys[r], hs[r], norm, eps, timeout_ns,
                        None if epilogues is None else epilogues[r])
        self.join()
        if sync:
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
# previous user covered it). (tokens, hidden) per call; 11 calls (odd), so the receive buffers meet
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


@pytest.mark.parametrize("kind", ["oneshot", "lamport"])
@pytest.mark.parametrize("world", [2, 3])
def test_grid_changes_between_calls(ext, kind, world):
    """The one-shot and Lamport kernels keep their call state in one slot per block index, and a
    block writes the next state into every slot of its residue class: calls whose grids grow and
    shrink (1 to 64 blocks, and past the largest grid seen), back to back without synchronisation,
    must all land in the right buffers."""
    dtype = torch.bfloat16
    gen = torch.Generator(device="cuda").manual_seed(90 + world)
    tokens, hidden = 80, 4096
    sim = SimulatedRanks(ext, kind, world, dtype, capacity=tokens * hidden * xs_elem(dtype))
    grids = [g for g in (1, 64, 3, 17, 2, 64, 1, 5, 40, 7) if g <= sim.blocks]
    calls = [make(tokens - 7 * i, hidden, dtype, world, gen) for i in range(len(grids))]
    outs = [[(torch.full((tokens - 7 * i, hidden), float("nan"), device="cuda", dtype=dtype),
              torch.full((tokens - 7 * i, hidden), float("nan"), device="cuda", dtype=dtype)) for _ in range(world)]
            for i in range(len(grids))]
    sim.fork()
    for grid, (xs, bias, res, w, nb), out in zip(grids, calls, outs):
        sim.blocks = grid
        for r in range(world):
            sim.launch(r, xs[r], bias, res, w, nb, out[r][0], out[r][1], "rms", timeout_ns=SEQUENCE_TIMEOUT_NS)
    sim.join()
    torch.cuda.synchronize()
    for r, watch in enumerate(sim.watches):
        assert not watch.failed(), f"rank {r} waited past the timeout: {watch.read()}"
    for grid, (xs, bias, res, w, nb), out in zip(grids, calls, outs):
        try:
            check_ranks([y for y, _ in out], [h for _, h in out], xs, bias, res, w, nb, "rms", dtype)
        except AssertionError as err:
            raise AssertionError(f"{kind}, grid {grid}: {err}") from None


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
def test_oneshot_rows_split_over_clusters(ext, world, dtype):
    """At small token counts the one-shot splits each row over a cluster of up to 8 blocks
    (allreduce_oneshot.cu row_split: the largest power of two with tokens x split <= the grid
    bound and 128-512 packs per block), whose reductions combine through distributed shared
    memory. The grid bound picks the split here: every split from 8 down to whole rows, rows whose
    packs do not divide evenly (2880, 5120), every norm, -0.0 in the messages; ranks bitwise equal,
    and every split within the reference's bound."""
    gen = torch.Generator(device="cuda").manual_seed(70 + world)
    sim = SimulatedRanks(ext, "oneshot", world, dtype, capacity=1 << 20)
    bounds = [b for b in (1, 2, 3, 4, 8, 16, 24) if b <= sim.blocks]
    for tokens, hidden, norm in [(1, 8192, "rms"), (2, 5120, "layer"), (3, 2880, "rms"), (1, 1024, "none"),
                                 (1, 16384, "layer"), (2, 4096, "rms")]:
        if dtype == torch.float32 and hidden == 16384:
            continue  # 64 KiB rows of float32: past the capacity of this region
        xs, bias, res, w, nb = make(tokens, hidden, dtype, world, gen, with_nb=norm == "layer")
        for r, x in enumerate(xs):
            x[:, r::9] = -0.0
        for bound in bounds:
            sim.blocks = bound
            ys, hs = sim.run(xs, bias, res, w, nb, norm)
            try:
                check_ranks(ys, hs, xs, bias, res, w, nb, norm, dtype)
            except AssertionError as err:
                raise AssertionError(f"{tokens} x {hidden} {norm}, grid bound {bound}: {err}") from None


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


def layer_backward_reference(dy, h, w, b, dh_out, eps):
    """float64 gradients of ``y = LayerNorm(h) * w + b`` (unfused math) plus ``dh_out``:
    ``(dh, dw, db)``, ``None`` for an absent parameter."""
    hr = h.double().requires_grad_()
    wr = None if w is None else w.double().requires_grad_()
    br = None if b is None else b.double().requires_grad_()
    mu = hr.mean(-1, keepdim=True)
    yr = (hr - mu) / torch.sqrt(((hr - mu) ** 2).mean(-1, keepdim=True) + eps)
    if wr is not None:
        yr = yr * wr
    if br is not None:
        yr = yr + br
    yr.backward(dy.double())
    dh = hr.grad + (0 if dh_out is None else dh_out.double())
    return dh, None if wr is None else wr.grad, None if br is None else br.grad


def run_layer_backward(ext, dy, h, w, b, dh_out, eps, blocks):
    """The raw kernel on NaN-filled outputs (an element it fails to write shows)."""
    tokens, hidden = h.shape
    dh = torch.full_like(h, float("nan"))
    dw = None if w is None else torch.full_like(w, float("nan"))
    db = None if b is None else torch.full_like(b, float("nan"))
    partial = torch.full((2, blocks, hidden), float("nan"), device="cuda") if (w is not None or b is not None) else None
    ext.layer_norm_backward(dy.data_ptr(), h.data_ptr(), ptr(w), ptr(dh_out), dh.data_ptr(), ptr(partial), ptr(dw),
                            ptr(db), tokens, hidden, eps, code(h.dtype), blocks,
                            torch.cuda.current_stream().cuda_stream)
    return dh, dw, db


# (tokens, hidden): packed rows (one / odd / many rows per block, 1-8 packs per thread) and rows
# that are not whole 16-byte packs (the scalar kernel), with more rows than blocks. float32 at
# 65536 exceeds 8 packs per thread: the scalar kernel too.
LAYER_BACKWARD_SHAPES = [(1, 2880), (37, 8192), (700, 1024), (4, 16384), (3, 65536), (1, 1), (5, 1001), (600, 777),
                         (2, 4097), (9, 24)]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
def test_layer_backward_kernel(ext, dtype):
    gen = torch.Generator(device="cuda").manual_seed(11)
    rnd = lambda *s: torch.randn(*s, generator=gen, device="cuda").to(dtype)  # noqa: E731
    eps = 1e-5
    for case, (tokens, hidden) in enumerate(LAYER_BACKWARD_SHAPES):
        # weight / norm bias / residual gradient each on and off across the cases
        with_w, with_b, with_extra = case % 3 != 1, case % 2 == 0, case % 4 != 3
        h = (3 * rnd(tokens, hidden) + 0.5).to(dtype)  # a mean far from zero: centring matters
        dy = rnd(tokens, hidden)
        w = (1 + 0.1 * rnd(hidden)).to(dtype) if with_w else None
        b = rnd(hidden) if with_b else None
        dh_out = rnd(tokens, hidden) if with_extra else None
        blocks = min(tokens, 264)
        dh, dw, db = run_layer_backward(ext, dy, h, w, b, dh_out, eps, blocks)
        want_dh, want_dw, want_db = layer_backward_reference(dy, h, w, b, dh_out, eps)
        what = (dtype, tokens, hidden, with_w, with_b, with_extra)
        assert rel(dh, want_dh) < 2 * TOL[dtype], (what, rel(dh, want_dh))
        if with_w:
            assert rel(dw, want_dw) < 2 * TOL[dtype], (what, rel(dw, want_dw))
        if with_b:
            assert rel(db, want_db) < 2 * TOL[dtype], (what, rel(db, want_db))
        # Deterministic: the same call again gives the same bits (no atomics, fixed order).
        again = run_layer_backward(ext, dy, h, w, b, dh_out, eps, blocks)
        for first, second in zip((dh, dw, db), again):
            if first is not None:
                assert torch.equal(first, second), what


def test_layer_backward_kernel_unaligned_rows_and_no_rows(ext):
    """Operands 2 bytes off 16-byte alignment take the scalar kernel; zero rows give zero
    parameter gradients."""
    gen = torch.Generator(device="cuda").manual_seed(12)
    tokens, hidden, dtype = 33, 1024, torch.bfloat16
    storage = torch.randn(3, tokens * hidden + 1, generator=gen, device="cuda").to(dtype)
    h, dy, dh_out = (row[1:].view(tokens, hidden) for row in storage)  # not 16-byte aligned
    w = (1 + 0.1 * torch.randn(hidden, generator=gen, device="cuda")).to(dtype)
    b = torch.randn(hidden, generator=gen, device="cuda").to(dtype)
    dh, dw, db = run_layer_backward(ext, dy, h, w, b, dh_out, 1e-5, 16)
    want = layer_backward_reference(dy, h, w, b, dh_out, 1e-5)
    for got, ref in zip((dh, dw, db), want):
        assert rel(got, ref) < 2 * TOL[dtype], rel(got, ref)
    empty = torch.empty(0, hidden, device="cuda", dtype=dtype)
    dw = torch.full_like(w, float("nan"))
    db = torch.full_like(b, float("nan"))
    partial = torch.empty(2, 1, hidden, device="cuda")
    ext.layer_norm_backward(empty.data_ptr(), empty.data_ptr(), w.data_ptr(), 0, empty.data_ptr(),
                            partial.data_ptr(), dw.data_ptr(), db.data_ptr(), 0, hidden, 1e-5, code(dtype), 1,
                            torch.cuda.current_stream().cuda_stream)
    torch.cuda.synchronize()
    assert not dw.any() and not db.any() and not dw.isnan().any()


@pytest.mark.parametrize("hidden", [4096, 1001])
def test_layer_norm_backward_through_the_family_and_a_graph(hidden):
    """``cuda.norm_backward`` (what every residual-norm implementation's backward calls) uses the
    kernel for LayerNorm at packed and odd hidden sizes, matches the float64 reference, and
    replays in a CUDA graph on fresh data; RMSNorm at an odd size falls back to the reference."""
    from opfuse.families.residual_norm import cuda as norm_cuda
    from opfuse.families.residual_norm.fp8 import triton_impl as quantize_triton

    gen = torch.Generator(device="cuda").manual_seed(hidden)
    dtype, tokens, eps = torch.bfloat16, 300, 1e-5
    rnd = lambda *s: torch.randn(*s, generator=gen, device="cuda").to(dtype)  # noqa: E731
    dy, h, dh_out = rnd(tokens, hidden), rnd(tokens, hidden), rnd(tokens, hidden)
    w, b = (1 + 0.1 * rnd(hidden)).to(dtype), rnd(hidden)
    got = norm_cuda.norm_backward(dy, h, dh_out, w, b, eps, norm="layer")
    for g, ref in zip(got, layer_backward_reference(dy, h, w, b, dh_out, eps)):
        assert rel(g, ref) < 2 * TOL[dtype], (hidden, rel(g, ref))
    # add_layernorm_quantize's backward is the family's
    for g, k in zip(quantize_triton.backward(dy, h, dh_out, w, b, eps, norm="layer"), got):
        assert torch.equal(g, k)
    # RMSNorm: packed rows take its kernel, odd ones the reference (no error either way)
    dh_rms, dw_rms, _ = norm_cuda.norm_backward(dy, h, dh_out, w, None, eps, norm="rms")
    hr, wr = h.double().requires_grad_(), w.double().requires_grad_()
    (hr / torch.sqrt((hr * hr).mean(-1, keepdim=True) + eps) * wr).backward(dy.double())
    assert rel(dh_rms, hr.grad + dh_out.double()) < 2 * TOL[dtype] and rel(dw_rms, wr.grad) < 2 * TOL[dtype]

    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        norm_cuda.norm_backward(dy, h, dh_out, w, b, eps, norm="layer")  # warm-up outside capture
        with torch.cuda.graph(graph, stream=stream):
            outs = norm_cuda.norm_backward(dy, h, dh_out, w, b, eps, norm="layer")
    torch.cuda.current_stream().wait_stream(stream)
    for _ in range(2):
        for t in (dy, h, dh_out, w, b):
            t.copy_(rnd(*t.shape) if t.dim() == 2 else (1 + 0.1 * rnd(hidden)).to(dtype))
        graph.replay()
        torch.cuda.synchronize()
        for g, ref in zip(outs, layer_backward_reference(dy, h, w, b, dh_out, eps)):
            assert rel(g, ref) < 2 * TOL[dtype], (hidden, rel(g, ref))


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
    stream = torch.cuda.current_stream().cuda_stream
    with pytest.raises(RuntimeError, match="partial .*required with dw or db"):
        ext.layer_norm_backward(x.data_ptr(), x.data_ptr(), 0, 0, y.data_ptr(), 0, 0, x.data_ptr(), 4, 128, 1e-5, 1,
                                8, stream)
    with pytest.raises(RuntimeError, match="h at address 0x[0-9a-f]+ is not aligned to its 2-byte elements"):
        ext.layer_norm_backward(x.data_ptr(), x.data_ptr() + 1, 0, 0, y.data_ptr(), 0, 0, 0, 2, 128, 1e-5, 1, 8,
                                stream)
    with pytest.raises(RuntimeError, match="blocks 0; need >= 1"):
        ext.layer_norm_backward(x.data_ptr(), x.data_ptr(), 0, 0, y.data_ptr(), 0, 0, 0, 2, 128, 1e-5, 1, 0, stream)
    with pytest.raises(RuntimeError, match="dtype 5; accepted"):
        ext.layer_norm_backward(x.data_ptr(), x.data_ptr(), 0, 0, y.data_ptr(), 0, 0, 0, 2, 128, 1e-5, 5, 8, stream)


@pytest.mark.parametrize("kind, tokens, hidden", [("oneshot", 64, 1024), ("oneshot", 1, 8192), ("twoshot", 64, 1024)])
def test_a_peer_that_skips_a_call_times_out_instead_of_hanging(ext, kind, tokens, hidden):
    """Rank 1 of 2 never launches: rank 0's kernel gives up after the timeout, finishes, and its
    record names the wait and the peer; no trap, the context stays usable. (1 x 8192: the one-shot's
    row split over a cluster, whose blocks still exchange their sums after their waits gave up.)"""
    gen = torch.Generator(device="cuda").manual_seed(5)
    ranks = SimulatedRanks(ext, kind, 2, torch.bfloat16, 8 << 20)
    xs, bias, res, w, nb = make(tokens, hidden, torch.bfloat16, 2, gen)
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
