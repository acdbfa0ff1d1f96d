"""The fused all-reduce + residual + norm through opfuse programs on real GPUs (NCCL, world 2 and 4):
every implementation vs the float64 reference, ranks bitwise equal, gradients, CUDA-graph replay
with fresh inputs, and every fallback path shown in ``Program.fusions``."""

import pytest
import torch
import torch.distributed as dist

pytestmark = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                                reason="needs 2+ GPUs")

import opfuse  # noqa: E402
from opfuse import ops  # noqa: E402
from opfuse.families.residual_norm.cuda import oneshot_limit  # noqa: E402
from opfuse.runtime.device import device_name  # noqa: E402
from opfuse.cli.launch import run  # noqa: E402

TOL = {torch.float32: 1e-5, torch.bfloat16: 1.6e-2, torch.float16: 2e-3}
PEER_IMPLS = ("cuda_oneshot", "cuda_twoshot_lamport", "cuda_twoshot")


def rel(a, b):
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def partials(seed, world, tokens, hidden, dtype):
    """Every rank's partial sums, generated identically on every rank."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    return [torch.randn(tokens, hidden, generator=gen, device="cuda").to(dtype) for _ in range(world)]


def block(hidden, dtype, norm="rms", bias=True):
    norm_op = ops.RMSNorm(hidden, dtype=dtype, device="cuda") if norm == "rms" else \
        ops.LayerNorm(hidden, dtype=dtype, device="cuda")
    seq = [ops.AllReduce()]
    if bias:
        seq.append(ops.Bias(hidden, dtype=dtype, device="cuda"))
    seq += [ops.AddExtraInput(), ops.MakeExtraOutput(), norm_op]
    model = ops.Sequential(*seq)
    gen = torch.Generator(device="cuda").manual_seed(99)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_((1 + 0.2 * torch.randn(p.shape, generator=gen, device="cuda")).to(dtype))
    return model


def reference(model, xs, res):
    h = sum(x.double() for x in xs)
    params = dict(model.named_parameters())
    if "1.bias" in params:
        h = h + params["1.bias"].double()
    h = h + res.double()
    norm = model[-1]
    if isinstance(norm, ops.RMSNorm):
        y = h / torch.sqrt((h * h).mean(-1, keepdim=True) + norm.eps) * norm.weight.double()
    else:
        mu = h.mean(-1, keepdim=True)
        y = (h - mu) / torch.sqrt(((h - mu) ** 2).mean(-1, keepdim=True) + norm.eps) * norm.weight.double() \
            + norm.bias.double()
    return y, h


def assert_bitwise_across_ranks(t, what):
    gathered = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, t.contiguous())
    for r, other in enumerate(gathered):
        assert torch.equal(other, gathered[0]), f"{what}: rank {r} differs from rank 0"


def check_impls(rank, world):
    cases = [(1, 8192, torch.bfloat16), (7, 5120, torch.bfloat16), (64, 2880, torch.float16),
             (1000, 8192, torch.bfloat16), (33, 4096, torch.float32), (4096, 8192, torch.bfloat16)]
    for impl in ("cuda_oneshot", "cuda_twoshot_lamport", "cuda_twoshot", "nccl+cuda", "reference"):
        for tokens, hidden, dtype in cases:
            limit = oneshot_limit(world, hidden * dtype.itemsize, device_name(torch.cuda.current_device()))
            if impl == "cuda_oneshot" and tokens * hidden * dtype.itemsize > limit:
                continue
            for norm in ("rms", "layer"):
                model = block(hidden, dtype, norm)
                xs = partials(tokens + hidden, world, tokens, hidden, dtype)
                res = partials(1, 1, tokens, hidden, dtype)[0]
                with opfuse.config.override(force_impl=f"allreduce_add_{norm}norm={impl}"):
                    y, h = model(xs[rank], res)
                    record = opfuse.compile(model, xs[rank], res).fusions[0]
                assert record.rule.startswith("allreduce_add_") and record.impl == impl, record
                y_ref, h_ref = reference(model, xs, res)
                tag = f"{impl} {norm} T={tokens} H={hidden} {dtype}"
                assert rel(y, y_ref) < TOL[dtype], f"{tag}: y {rel(y, y_ref)}"
                assert rel(h, h_ref) < TOL[dtype], f"{tag}: h {rel(h, h_ref)}"
                assert_bitwise_across_ranks(y, tag + " y")
                assert_bitwise_across_ranks(h, tag + " h")


def check_auto_choice_and_plain_allreduce(rank, world):
    for tokens in (1, 16, 2048):
        hidden, dtype = 8192, torch.bfloat16
        model = block(hidden, dtype)
        xs = partials(tokens, world, tokens, hidden, dtype)
        res = partials(2, 1, tokens, hidden, dtype)[0]
        y, h = model(xs[rank], res)
        impl = opfuse.compile(model, xs[rank], res).fusions[0].impl
        assert impl in PEER_IMPLS, impl
        y_ref, _ = reference(model, xs, res)
        assert rel(y, y_ref) < TOL[dtype]
        plain = ops.Sequential(ops.AllReduce())
        out = plain(xs[rank])
        assert opfuse.compile(plain, xs[rank]).fusions[0].impl in PEER_IMPLS
        assert rel(out, sum(x.double() for x in xs)) < TOL[dtype]
        assert_bitwise_across_ranks(out, "plain all-reduce")
    # Plain all-reduce past the peer kernels' limits (e.g. a large message of short rows): NCCL alone.
    xs = partials(9, world, 64, 4096, torch.bfloat16)
    with opfuse.config.override(oneshot_max_bytes=1024, twoshot_max_bytes=1024):
        plain = ops.Sequential(ops.AllReduce())
        out = plain(xs[rank])
        assert opfuse.compile(plain, xs[rank]).fusions[0].impl == "nccl+cuda"
    assert rel(out, sum(x.double() for x in xs)) < TOL[torch.bfloat16]
    assert_bitwise_across_ranks(out, "plain all-reduce through NCCL")


def check_gradients(rank, world):
    for impl in PEER_IMPLS:
        hidden, tokens, dtype = 4096, 24, torch.float32
        model = block(hidden, dtype)
        xs = partials(5, world, tokens, hidden, dtype)
        res = partials(6, 1, tokens, hidden, dtype)[0]
        dy, dh = partials(7, 2, tokens, hidden, dtype)
        x_in = xs[rank].clone().requires_grad_()
        r_in = res.clone().requires_grad_()
        with opfuse.config.override(force_impl=f"allreduce_add_rmsnorm={impl}"):
            y, h = model(x_in, r_in)
        (y * dy + h * dh).sum().backward()
        with opfuse.config.override(fuse=False):
            model2 = block(hidden, dtype)
            x2, r2 = xs[rank].clone().requires_grad_(), res.clone().requires_grad_()
            y2, h2 = model2(x2, r2)
            (y2 * dy + h2 * dh).sum().backward()
        for a, b, what in [(x_in.grad, x2.grad, "dx"), (r_in.grad, r2.grad, "dres"),
                           (model[-1].weight.grad, model2[-1].weight.grad, "dw"),
                           (model[1].bias.grad, model2[1].bias.grad, "dbias")]:
            assert rel(a, b) < 1e-5, f"{impl} {what}: {rel(a, b)}"


def check_graph_replays(rank, world):
    for impl, tokens in (("cuda_oneshot", 4), ("cuda_twoshot", 512), ("cuda_twoshot_lamport", 512)):
        hidden, dtype = 8192, torch.bfloat16
        model = block(hidden, dtype)
        static_x = torch.empty(tokens, hidden, device="cuda", dtype=dtype)
        static_r = torch.empty(tokens, hidden, device="cuda", dtype=dtype)
        static_x.copy_(partials(0, world, tokens, hidden, dtype)[rank])
        static_r.copy_(partials(1, 1, tokens, hidden, dtype)[0])  # replicated: the same on every rank
        with opfuse.config.override(force_impl=f"allreduce_add_rmsnorm={impl}"):
            with torch.no_grad():
                model(static_x, static_r)  # compile (reserves peer buffers) outside capture
                stream = torch.cuda.Stream()
                stream.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(stream):
                    model(static_x, static_r)
                torch.cuda.current_stream().wait_stream(stream)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    y, h = model(static_x, static_r)
        for step in range(1000):
            xs = partials(10_000 + step, world, tokens, hidden, dtype)
            res = partials(20_000 + step, 1, tokens, hidden, dtype)[0]
            static_x.copy_(xs[rank])
            static_r.copy_(res)
            y.fill_(float("nan"))
            graph.replay()
            if step % 50 == 0 or step == 999:
                y_ref, h_ref = reference(model, xs, res)
                assert rel(y, y_ref) < TOL[dtype], f"{impl} replay {step}: {rel(y, y_ref)}"
                assert rel(h, h_ref) < TOL[dtype]
                assert_bitwise_across_ranks(y, f"{impl} replay {step}")
            else:
                assert not torch.isnan(y).any(), f"{impl} replay {step}: unwritten output"


def check_fallbacks(rank, world):
    hidden, tokens, dtype = 2048, 8, torch.bfloat16
    xs = partials(3, world, tokens, hidden, dtype)
    res = partials(4, 1, tokens, hidden, dtype)[0]
    # A fresh group with a pool too small for any region: NCCL + the fused local kernel.
    small = dist.new_group(list(range(world)))
    with opfuse.config.override(symm_pool_mb=1, symm_pool_max_mb=1):
        model = ops.Sequential(ops.AllReduce(small), ops.AddExtraInput(), ops.RMSNorm(hidden, dtype=dtype,
                                                                                      device="cuda"))
        model(xs[rank], res)
        record = opfuse.compile(model, xs[rank], res).fusions[0]
    assert record.impl == "nccl+cuda", record
    assert any("symmetric pool" in reason for _, reason in record.skipped), record.skipped
    # float64: no kernel supports it -> reference.
    m64 = block(hidden, torch.float64)
    x64 = [x.double() for x in xs]
    m64(x64[rank], res.double())
    assert opfuse.compile(m64, x64[rank], res.double()).fusions[0].impl == "reference"
    # Kernels off.
    with opfuse.config.override(cuda=False):
        model = block(hidden, dtype)
        model(xs[rank], res)
        record = opfuse.compile(model, xs[rank], res).fusions[0]
    assert record.impl in ("reference",), record
    # A message over the two-shot limit: NCCL + kernel.
    with opfuse.config.override(oneshot_max_bytes=1024, twoshot_max_bytes=1024):
        model = block(hidden, dtype)
        model(xs[rank], res)
        assert opfuse.compile(model, xs[rank], res).fusions[0].impl == "nccl+cuda"
    # Bad direct calls give clear errors.
    from opfuse.families.residual_norm.cuda import oneshot_forward

    with pytest.raises(ValueError, match="residual is torch.float16, x is torch.bfloat16"):
        oneshot_forward(xs[rank], None, res.half(), None, None, norm="rms", eps=1e-6,
                        group=dist.group.WORLD.group_name, write_residual=True)
    with pytest.raises(ValueError, match=r"residual has shape \[4, 2048\]"):
        oneshot_forward(xs[rank], None, res[:4], None, None, norm="rms", eps=1e-6,
                        group=dist.group.WORLD.group_name, write_residual=True)
    # A non-contiguous residual is copied, not rejected.
    wide = torch.randn(tokens, 2 * hidden, device="cuda", dtype=dtype)
    y, _ = oneshot_forward(xs[rank], None, wide[:, :hidden], None, None, norm="rms", eps=1e-6,
                           group=dist.group.WORLD.group_name, write_residual=False)
    assert not torch.isnan(y).any()


def all_checks(rank, world):
    check_impls(rank, world)
    check_auto_choice_and_plain_allreduce(rank, world)
    check_gradients(rank, world)
    check_graph_replays(rank, world)
    check_fallbacks(rank, world)


@pytest.mark.parametrize("world", [2, 3, 4, 8])
def test_residual_norm_on_gpus(world):
    if torch.cuda.device_count() < world:
        pytest.skip(f"needs {world} GPUs")
    run(all_checks, world, backend="nccl", timeout=600)
