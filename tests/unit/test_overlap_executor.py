"""The CUDA executor and the impl functions, run on CPU: each rank is a thread, the symmetric pool
is shared CPU storage, signals block like torch's (put spins while set, wait spins until set), and
torch.cuda's stream/event calls are no-ops (CPU ops complete in issue order, so this checks the
host issue order is deadlock-free and that every view, transpose, bias and gradient is bound right;
the stream-level schedule is checked by the simulator tests)."""

from __future__ import annotations

import threading

import pytest
import torch

from opfuse.families.collective_linear import reference as collective_reference
from opfuse.families.collective_linear.overlap import executor, resources
from opfuse.families.collective_linear import p2p as impl

DT = torch.float64


class _Signals:
    def __init__(self, world: int, deadline: float = 20.0):
        self.world = world
        self.slots: dict = {}
        self.cond = threading.Condition()
        self.deadline = deadline
        self.counts = {"put": 0, "wait": 0, "barrier": 0}

    def _spin(self, ready):
        with self.cond:
            if not self.cond.wait_for(ready, timeout=self.deadline):
                raise TimeoutError("signal never arrived (deadlock in issue order)")

    def put(self, src, dst, ch):
        key = (dst, ch, src)
        with self.cond:
            self.counts["put"] += 1
        self._spin(lambda: self.slots.get(key, 0) == 0)
        with self.cond:
            self.slots[key] = 1
            self.cond.notify_all()

    def wait(self, me, src, ch):
        key = (me, ch, src)
        with self.cond:
            self.counts["wait"] += 1
        self._spin(lambda: self.slots.get(key, 0) == 1)
        with self.cond:
            self.slots[key] = 0
            self.cond.notify_all()


class _Handle:
    def __init__(self, signals: _Signals, rank: int):
        self.signals, self.rank = signals, rank

    def put_signal(self, dst, channel=0, timeout_ms=0):
        self.signals.put(self.rank, dst, channel)

    def wait_signal(self, src, channel=0, timeout_ms=0):
        self.signals.wait(self.rank, src, channel)

    def barrier(self, channel=0, timeout_ms=0):
        self.signals.counts["barrier"] += 1
        peers = [p for p in range(self.signals.world) if p != self.rank]
        for p in peers:
            self.signals.put(self.rank, p, channel)
        for p in peers:
            self.signals.wait(self.rank, p, channel)


class _Region:
    def __init__(self, pool, offset, nbytes):
        self.pool, self.offset, self.nbytes = pool, offset, nbytes

    @property
    def handle(self):
        return self.pool.handle

    def local_tensor(self, dtype=torch.uint8, shape=None):
        view = self.peer_tensor(self.pool.rank, torch.uint8, (self.nbytes,)).view(dtype)
        return view if shape is None else view.view(shape)

    def peer_tensor(self, rank, dtype, shape):
        storage = self.pool.storages[rank]
        elt = torch.empty((), dtype=dtype).element_size()
        count = 1
        for s in shape:
            count *= s
        return storage[self.offset:self.offset + count * elt].view(dtype).view(shape)


class _Pool:
    def __init__(self, storages, rank, handle, capacity):
        self.storages, self.rank, self.handle, self.capacity = storages, rank, handle, capacity
        self.used, self.regions = 0, {}

    def reserve(self, name, nbytes):
        if name in self.regions:
            return self.regions[name] if self.regions[name].nbytes >= nbytes else None
        nbytes = (nbytes + 255) // 256 * 256
        if self.used + nbytes > self.capacity:
            return None
        self.regions[name] = _Region(self, self.used, nbytes)
        self.used += nbytes
        return self.regions[name]


class _Stream:
    device = torch.device("cpu")

    def wait_event(self, event):
        pass


class FakeApi:
    """The stream/event primitives of :class:`executor.CudaApi`, as no-ops (CPU ops complete in
    issue order) that count their calls."""

    def __init__(self):
        self.streams = {}
        self.side = tuple((_Stream(), ("side", i, 0)) for i in range(3))
        self.counts = {"set": 0, "record": 0, "wait": 0}

    def current(self):
        return ("compute", 0, 0)

    def stream(self, key):
        self.streams[key] = _Stream()
        return self.streams[key]

    def set(self, *key):
        self.counts["set"] += 1

    def record(self, event, stream):
        self.counts["record"] += 1

    def wait(self, event, stream):
        self.counts["wait"] += 1

    def new_event(self):
        return object()


@pytest.fixture
def fake_cuda(monkeypatch):
    api = FakeApi()
    monkeypatch.setattr(executor, "cuda_api", lambda device: api)
    monkeypatch.setattr(resources, "signal_pad_bytes", lambda: 2048)
    return api


def _run_ranks(world, fn, capacity=1 << 22):
    """``fn(rank, ctx)`` in ``world`` threads sharing a fake pool; returns per-rank results."""
    signals = _Signals(world)
    storages = [torch.full((capacity,), 255, dtype=torch.uint8) for _ in range(world)]  # NaN-ish garbage
    contexts = [resources.Context(None, _Pool(storages, r, _Handle(signals, r), capacity), r, world)
                for r in range(world)]
    results, errors = [None] * world, []

    def body(r):
        try:
            results[r] = fn(r, contexts[r])
        except BaseException as error:  # noqa: BLE001 - reported below
            errors.append((r, error))
            with signals.cond:
                signals.deadline = 0.01
                signals.cond.notify_all()

    threads = [threading.Thread(target=body, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    if errors:
        raise errors[0][1]
    return results, signals


def _patch_context(monkeypatch, contexts_by_thread):
    monkeypatch.setattr(impl, "_context", lambda group, t: contexts_by_thread[threading.current_thread().name])


def _with_ctx(monkeypatch):
    table = {}
    _patch_context(monkeypatch, table)

    def wrap(fn):
        def inner(r, ctx):
            table[threading.current_thread().name] = ctx
            return fn(r, ctx)
        return inner
    return wrap


def _randn(*shape, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=DT)


@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("lead", [(), (2,)])
def test_all_gather_linear_forward_backward(fake_cuda, monkeypatch, world, bias, lead):
    tokens, k, n = 4, 6, 5
    wrap = _with_ctx(monkeypatch)
    xs = [_randn(tokens, *lead, k, seed=10 + r) for r in range(world)]
    ws = [_randn(n, k, seed=20 + r) for r in range(world)]
    bs = [_randn(n, seed=30 + r) for r in range(world)]
    dys = [_randn(tokens * world, *lead, n, seed=40 + r) for r in range(world)]

    def fn(r, ctx):
        outs = []
        for _ in range(2):  # two calls: the second reuses the bound plans and regions
            y = impl.all_gather_linear_forward(xs[r], ws[r], bs[r] if bias else None, group="g")
            grads = impl.all_gather_linear_backward(dys[r], xs[r], ws[r], group="g", need_dx=True, need_dw=True,
                                                    need_db=bias)
            outs.append((y, grads))
        return outs

    results, signals = _run_ranks(world, wrap(fn))
    full_x = torch.cat(xs)
    for r in range(world):
        ref_y = full_x @ ws[r].T + (bs[r] if bias else 0)
        rows = tokens * (2 if lead else 1)
        dx_full = sum(dys[p].reshape(-1, n) @ ws[p] for p in range(world))
        for y, (dx, dw, db) in results[r]:
            torch.testing.assert_close(y, ref_y)
            torch.testing.assert_close(dx, dx_full[r * rows:(r + 1) * rows].view(xs[r].shape))
            torch.testing.assert_close(dw, dys[r].reshape(-1, n).T @ full_x.reshape(-1, k))
            if bias:
                torch.testing.assert_close(db, dys[r].reshape(-1, n).sum(0))
    assert signals.counts["put"] == signals.counts["wait"]


@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize("lead", [(), (2,)])
def test_all_gather_linear_keep_forward(fake_cuda, monkeypatch, world, lead):
    """The pipeline of all_gather_linear_keep (the own shard in the gathered region too): the GEMM
    and the whole gathered input, as a copy that a later overlap call does not overwrite."""
    tokens, k, n = 4, 6, 5
    wrap = _with_ctx(monkeypatch)
    xs = [_randn(tokens, *lead, k, seed=10 + r) for r in range(world)]
    ws = [_randn(n, k, seed=20 + r) for r in range(world)]
    bs = [_randn(n, seed=30 + r) for r in range(world)]

    def fn(r, ctx):
        first = impl.all_gather_linear_keep_forward(xs[r], ws[r], bs[r], group="g")
        second = impl.all_gather_linear_keep_forward([x * 2 for x in xs][r], ws[r], bs[r], group="g")
        return first, second

    results, signals = _run_ranks(world, wrap(fn))
    full_x = torch.cat(xs)
    for r in range(world):
        for scale, (y, gathered) in zip((1, 2), results[r]):
            torch.testing.assert_close(gathered, scale * full_x)
            torch.testing.assert_close(y, scale * full_x @ ws[r].T + bs[r])
    assert signals.counts["put"] == signals.counts["wait"] > 0  # the peer pipeline ran, not the reference


@pytest.mark.parametrize("world", [2, 3, 4, 5])
@pytest.mark.parametrize("bias_after", [True, False])
@pytest.mark.parametrize("rows_per_rank", [2, 1024])
def test_linear_reduce_scatter_forward_backward(fake_cuda, monkeypatch, world, bias_after, rows_per_rank):
    k, n = 3, 4
    wrap = _with_ctx(monkeypatch)
    tokens = rows_per_rank * world
    xs = [_randn(tokens, k, seed=50 + r) for r in range(world)]
    ws = [_randn(n, k, seed=60 + r) for r in range(world)]
    biases = [_randn(n, seed=70 + r) for r in range(world)]  # per-rank biases need not agree
    monkeypatch.setattr(impl, "_sum_over_ranks", lambda t, ctx: sum(biases))
    dys = [_randn(rows_per_rank, n, seed=80 + r) for r in range(world)]

    def fn(r, ctx):
        y = impl.linear_reduce_scatter_forward(xs[r], ws[r], biases[r], bias_after=bias_after, group="g")
        grads = impl.linear_reduce_scatter_backward(dys[r], xs[r], ws[r], bias_after=bias_after, group="g",
                                                    need_dx=True, need_dw=True, need_db=True)
        return y, grads

    results, signals = _run_ranks(world, wrap(fn), capacity=1 << 24)
    partial_sum = sum(xs[p] @ ws[p].T for p in range(world))
    dy_full = torch.cat(dys)
    for r in range(world):
        y, (dx, dw, db) = results[r]
        ref = partial_sum[r * rows_per_rank:(r + 1) * rows_per_rank] + (biases[r] if bias_after else sum(biases))
        torch.testing.assert_close(y, ref)
        torch.testing.assert_close(dx, dy_full @ ws[r])
        torch.testing.assert_close(dw, dy_full.T @ xs[r])
        torch.testing.assert_close(db, dys[r].sum(0) if bias_after else dy_full.sum(0))
    assert signals.counts["put"] == signals.counts["wait"]


@pytest.mark.parametrize("need", [(True, False, False), (False, True, False), (False, False, True),
                                  (False, True, True)])
def test_partial_gradients(fake_cuda, monkeypatch, need):
    world, tokens, k, n = 2, 2, 4, 3
    need_dx, need_dw, need_db = need
    wrap = _with_ctx(monkeypatch)
    xs = [_randn(tokens, k, seed=r) for r in range(world)]
    ws = [_randn(n, k, seed=5 + r) for r in range(world)]
    dys = [_randn(tokens * world, n, seed=9 + r) for r in range(world)]

    def fn(r, ctx):
        ours = impl.all_gather_linear_backward(dys[r], xs[r], ws[r], group="g", need_dx=need_dx, need_dw=need_dw,
                                               need_db=need_db)
        return ours

    results, _ = _run_ranks(world, wrap(fn))
    for r in range(world):
        dx, dw, db = results[r]
        assert dx.numel() == (xs[r].numel() if need_dx else 0)
        assert dw.numel() == (ws[r].numel() if need_dw else 0)
        assert db.numel() == (n if need_db else 0)
        if need_dw:
            torch.testing.assert_close(dw, dys[r].T @ torch.cat(xs))


def test_missing_region_falls_back_to_reference(fake_cuda, monkeypatch):
    """A pool without room makes every rank run the reference (here: the gloo-free reference is
    replaced by a marker, since no process group exists)."""
    wrap = _with_ctx(monkeypatch)
    called = []
    monkeypatch.setattr(collective_reference, "ag_linear_forward",
                        lambda x, w, b, group: called.append(group) or torch.zeros(1, dtype=DT))

    def fn(r, ctx):
        return impl.all_gather_linear_forward(_randn(4, 4, seed=r), _randn(3, 4, seed=7), None, group="g")

    _run_ranks(2, wrap(fn), capacity=16)
    assert called == ["g", "g"]


@pytest.mark.parametrize("chunks", [0, 1, 2, 3])
@pytest.mark.parametrize("world", [2, 4])
def test_every_schedule_through_the_executor(fake_cuda, monkeypatch, chunks, world):
    """OPFUSE_OVERLAP_CHUNKS picks the schedules: 1 = direct reduce-scatter, 2/3 = ring with column
    (or row) sub-chunks, several sub-chunks per gathered shard; forward and backward of both ops."""
    from opfuse import config

    monkeypatch.setattr(config, "overlap_chunks", chunks)
    tokens, k, n = 6, 6, 12
    wrap = _with_ctx(monkeypatch)
    xs = [_randn(tokens, k, seed=100 + r) for r in range(world)]
    ws = [_randn(n, k, seed=110 + r) for r in range(world)]
    bs = [_randn(n, seed=120 + r) for r in range(world)]
    dys = [_randn(tokens * world, n, seed=130 + r) for r in range(world)]
    xr = [_randn(tokens * world, n, seed=140 + r) for r in range(world)]
    wr = [_randn(k, n, seed=150 + r) for r in range(world)]
    dyr = [_randn(tokens, k, seed=160 + r) for r in range(world)]

    def fn(r, ctx):
        y = impl.all_gather_linear_forward(xs[r], ws[r], bs[r], group="g")
        g = impl.all_gather_linear_backward(dys[r], xs[r], ws[r], group="g", need_dx=True, need_dw=True, need_db=True)
        z = impl.linear_reduce_scatter_forward(xr[r], wr[r], bs[r][:k], bias_after=True, group="g")
        h = impl.linear_reduce_scatter_backward(dyr[r], xr[r], wr[r], bias_after=True, group="g", need_dx=True,
                                                need_dw=True, need_db=True)
        return y, g, z, h

    results, signals = _run_ranks(world, wrap(fn))
    full_x, full_dyr = torch.cat(xs), torch.cat(dyr)
    dx_full = sum(dys[p] @ ws[p] for p in range(world))
    z_full = sum(xr[p] @ wr[p].T for p in range(world))
    for r in range(world):
        y, (dx, dw, db), z, (hdx, hdw, hdb) = results[r]
        torch.testing.assert_close(y, full_x @ ws[r].T + bs[r])
        torch.testing.assert_close(dx, dx_full[r * tokens:(r + 1) * tokens])
        torch.testing.assert_close(dw, dys[r].T @ full_x)
        torch.testing.assert_close(db, dys[r].sum(0))
        torch.testing.assert_close(z, z_full[r * tokens:(r + 1) * tokens] + bs[r][:k])
        torch.testing.assert_close(hdx, full_dyr @ wr[r])
        torch.testing.assert_close(hdw, full_dyr.T @ xr[r])
        torch.testing.assert_close(hdb, dyr[r].sum(0))
    assert signals.counts["put"] == signals.counts["wait"]


@pytest.mark.parametrize("forced", ["off", "on"])
@pytest.mark.parametrize("chunks", [0, 1])
def test_forced_stream_setups(fake_cuda, monkeypatch, forced, chunks):
    """``OPFUSE_OVERLAP_ALTERNATE_STREAMS`` forced off / on (the bench's ours:1s / ours:2s) and
    one GEMM per shard (chunks=1) bind and compute the same results."""
    from opfuse import config

    monkeypatch.setattr(config, "overlap_chunks", chunks)
    monkeypatch.setattr(config, "overlap_alternate_streams", forced)
    world, tokens, k, n = 4, 4, 6, 5
    wrap = _with_ctx(monkeypatch)
    xs = [_randn(tokens, k, seed=200 + r) for r in range(world)]
    ws = [_randn(n, k, seed=210 + r) for r in range(world)]
    xr = [_randn(tokens * world, n, seed=220 + r) for r in range(world)]
    wr = [_randn(k, n, seed=230 + r) for r in range(world)]

    def fn(r, ctx):
        y = impl.all_gather_linear_forward(xs[r], ws[r], None, group="g")
        z = impl.linear_reduce_scatter_forward(xr[r], wr[r], None, bias_after=True, group="g")
        streams = {ins.stream for bound in ctx.plans.values() for ins in bound.plan.instructions}
        return y, z, streams

    results, _ = _run_ranks(world, wrap(fn))
    full_x = torch.cat(xs)
    z_full = sum(xr[p] @ wr[p].T for p in range(world))
    for r in range(world):
        y, z, streams = results[r]
        torch.testing.assert_close(y, full_x @ ws[r].T)
        torch.testing.assert_close(z, z_full[r * tokens:(r + 1) * tokens])
        assert ("aux" in streams) == (forced == "on")
