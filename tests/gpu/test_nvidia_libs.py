"""The optional NVIDIA-library implementations on real GPUs, each forced through opfuse programs
(``OPFUSE_FORCE_IMPL`` semantics: an incapable forced implementation is an error, with cuDNN's
or cuBLASMp's reason) and compared with float64 (one GPU) or float32 (NCCL) references of the
unfused math, forward and every gradient:

* cuDNN frontend, one GPU: ``add_rmsnorm`` / ``add_layernorm`` (bias, residual, exported residual
  or not, odd shapes, float32/bfloat16/float16), ``linear_bias_activation`` (exact and tanh GELU,
  inference and training), ``grouped_linear`` (several non-empty groups, an empty one, tail rows;
  every group checked on its own: with cuDNN 9.18-9.20 the FP8 variant was reported to compute only
  the first); each also captured with ``opfuse.graphed`` and replayed on fresh data (routing
  included) -- a capture failure here means "not CUDA-graph capturable";
* cuBLASMp 0.7, NCCL world 2 (and 4 where the host has 4 GPUs): ``all_gather_linear`` and
  ``linear_reduce_scatter`` through the overlap tests' cases and references, then a captured
  sequence-parallel MLP replayed with fresh data.

With ``OPFUSE_EXPECT_NVIDIA_LIBS=1`` (tools/gpu_session.sh nvidia-libs) a missing library fails
instead of skipping. ``PYTHONPATH=. python3 -m pytest -q tests/gpu/test_nvidia_libs.py``.
"""

import os

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # inherited by the spawned ranks
os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
os.environ.setdefault("NVSHMEM_DISABLE_NVLS", "1")

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
pytestmark = pytest.mark.skipif(GPUS < 1, reason="needs CUDA")

import opfuse  # noqa: E402
from opfuse import ops  # noqa: E402
from opfuse.machinery.implementation import ImplementationError  # noqa: E402
from opfuse.runtime import cublasmp, cudnn_frontend  # noqa: E402
from opfuse.cli.launch import run  # noqa: E402
from opfuse.graphs.graphed import graphed  # noqa: E402

from .test_graphed import close  # noqa: E402  (relative error of float64 views, non-finite = unwritten)

BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32
TOL = {FP32: 1e-5, BF16: 1.6e-2, FP16: 2e-3}
EXPECT = os.environ.get("OPFUSE_EXPECT_NVIDIA_LIBS") == "1"


def require(library):
    reason = library.status()
    if reason:
        if EXPECT:
            pytest.fail(f"OPFUSE_EXPECT_NVIDIA_LIBS=1 but {reason}")
        pytest.skip(reason)


def randn(gen, *shape, dtype, scale=1.0):
    return (scale * torch.randn(*shape, generator=gen, device="cuda")).to(dtype)


def forced(op, impl="cudnn"):
    return opfuse.config.override(force_impl=f"{op}={impl}")


def impl_of(block, *inputs):
    return {f.rule: f.impl for f in opfuse.compile(block, *inputs).fusions}


def forced_impl_or_skip(block, *inputs):
    """``impl_of`` under a forced implementation, skipping (also with OPFUSE_EXPECT_NVIDIA_LIBS=1)
    when the library is loaded but its capability check finds no engine for the graph on this
    GPU and cuDNN build: engine coverage is the library's, the check reporting it is opfuse's."""
    try:
        return impl_of(block, *inputs)
    except ImplementationError as error:
        if "cuDNN has no engine for this graph here" in str(error):
            pytest.skip(str(error))
        raise


# cuDNN: residual norms ---------------------------------------------------------------------------------------------


def norm_block(norm, hidden, dtype, export):
    kw = dict(dtype=dtype, device="cuda")
    norm_op = ops.RMSNorm(hidden, **kw) if norm == "rms" else ops.LayerNorm(hidden, **kw)
    chain = [ops.Bias(hidden, **kw), ops.AddExtraInput()] + ([ops.MakeExtraOutput()] if export else []) + [norm_op]
    block = ops.Sequential(*chain)
    gen = torch.Generator(device="cuda").manual_seed(hidden)
    with torch.no_grad():
        for p in block.parameters():
            p.copy_(1 + randn(gen, *p.shape, dtype=p.dtype, scale=0.2))
    return block, norm_op.eps


def norm_reference(block, norm, eps, x, r, export):
    """float64 outputs of the unfused chain and their gradient function."""
    params = [p.detach().double().requires_grad_() for p in block.parameters()]
    xd, rd = (t.detach().double().requires_grad_() for t in (x, r))
    h = xd + params[0] + rd
    if norm == "rms":
        y = h / torch.sqrt((h * h).mean(-1, keepdim=True) + eps) * params[1]
    else:
        mu = h.mean(-1, keepdim=True)
        y = (h - mu) / torch.sqrt(((h - mu) ** 2).mean(-1, keepdim=True) + eps) * params[1] + params[2]
    return (y, h) if export else (y,), [xd, rd] + params


# (dtype, tokens, hidden, residual exported): every shape in bfloat16, two in the other dtypes
NORM_CASES = ([(BF16, 1, 2880, True), (BF16, 37, 5120, False), (BF16, 512, 8192, True), (BF16, 3, 16384, True),
               (BF16, 7, 1000, False)]
              + [(dtype, *case) for dtype in (FP16, FP32) for case in [(37, 5120, True), (512, 8192, False)]])


@pytest.mark.parametrize("norm", ["rms", "layer"])
@pytest.mark.parametrize("dtype,tokens,hidden,export", NORM_CASES, ids=str)
def test_cudnn_add_norm(dtype, norm, tokens, hidden, export):
    require(cudnn_frontend)
    block, eps = norm_block(norm, hidden, dtype, export)
    gen = torch.Generator(device="cuda").manual_seed(tokens)
    x = randn(gen, tokens, hidden, dtype=dtype).requires_grad_()
    r = randn(gen, tokens, hidden, dtype=dtype).requires_grad_()
    with forced(f"add_{norm}norm" if norm == "rms" else "add_layernorm"):
        try:
            chosen = impl_of(block, x, r)
        except ImplementationError as error:
            if hidden == 1000 and "no engine" in str(error):
                pytest.skip(f"cuDNN has no engine for hidden {hidden} here (reported, as the contract says): {error}")
            raise
        assert set(chosen.values()) == {"cudnn"}, chosen
        outs = block(x, r)
    outs = outs if isinstance(outs, tuple) else (outs,)
    grads_out = [randn(gen, tokens, hidden, dtype=dtype) for _ in outs]
    torch.autograd.backward(outs, grads_out)
    refs, leaves = norm_reference(block, norm, eps, x, r, export)
    torch.autograd.backward(refs, [g.double() for g in grads_out])
    what = f"{norm} {dtype} {tokens}x{hidden} export={export}"
    for name, got, ref in zip(("y", "h"), outs, refs):
        close(f"{what}: {name}", got, ref, TOL[dtype])
    names = ["dx", "dr"] + [n for n, _ in block.named_parameters()]
    for name, got, ref in zip(names, [x.grad, r.grad] + [p.grad for p in block.parameters()],
                              [t.grad for t in leaves]):
        close(f"{what}: {name}", got, ref, 3 * TOL[dtype])


def test_cudnn_norm_is_chosen_when_the_kernel_cannot_run():
    """Table order: ``cuda`` first; without the CUDA extension (OPFUSE_CUDA=0) ``cudnn`` runs."""
    require(cudnn_frontend)
    block, _ = norm_block("layer", 4096, BF16, True)
    x = torch.randn(8, 4096, device="cuda", dtype=BF16)
    assert impl_of(block, x, x)["add_layernorm"] == "cuda"
    with opfuse.config.override(cuda=False):
        program = opfuse.compile(block, x, x)
        assert program.fusions[0].impl == "cudnn", program.fusions
        assert "cuda" in dict(program.fusions[0].skipped)


@pytest.mark.parametrize("norm", ["rms", "layer"])
def test_cudnn_norm_graph_replays(norm):
    """Forward + backward captured by opfuse.graphed and replayed on fresh data (a capture error
    here means cuDNN's norm engines are not capturable)."""
    require(cudnn_frontend)
    tokens, hidden, dtype = 64, 2048, BF16
    block, eps = norm_block(norm, hidden, dtype, export=True)
    gen = torch.Generator(device="cuda").manual_seed(11)
    x = randn(gen, tokens, hidden, dtype=dtype).requires_grad_()
    r = randn(gen, tokens, hidden, dtype=dtype).requires_grad_()
    with forced("add_rmsnorm" if norm == "rms" else "add_layernorm"):
        step = graphed(block, x, r)
        assert set(impl_of(block, x, r).values()) == {"cudnn"}
        for replay in range(10):
            x = randn(gen, tokens, hidden, dtype=dtype).requires_grad_()
            r = randn(gen, tokens, hidden, dtype=dtype).requires_grad_()
            for p in block.parameters():
                p.grad = None
            dy, dh = randn(gen, tokens, hidden, dtype=dtype), randn(gen, tokens, hidden, dtype=dtype)
            y, h = step(x, r)
            torch.autograd.backward((y, h), (dy, dh))
            refs, leaves = norm_reference(block, norm, eps, x, r, True)
            torch.autograd.backward(refs, (dy.double(), dh.double()))
            close(f"replay {replay} y", y, refs[0], TOL[dtype])
            close(f"replay {replay} h", h, refs[1], TOL[dtype])
            for name, got, ref in zip(["dx", "dr", "dbias", "dweight", "dnorm_bias"],
                                      [x.grad, r.grad] + [p.grad for p in block.parameters()],
                                      [t.grad for t in leaves]):
                close(f"replay {replay} {name}", got, ref, 3 * TOL[dtype])


# cuDNN: matmul + bias + GELU ----------------------------------------------------------------------------------------


# (dtype, GELU approximation, rows, K, N, training): each cuDNN graph here is a runtime-compiled kernel
EPILOGUE_CASES = [(BF16, "none", 64, 1024, 4096, False), (BF16, "tanh", 64, 1024, 4096, False),
                  (FP16, "none", 37, 520, 776, True), (BF16, "tanh", 37, 520, 776, True),
                  (BF16, "none", 512, 2048, 1024, True), (FP16, "tanh", 1, 256, 512, True)]


@pytest.mark.parametrize("dtype,approximate,rows,k,n,training", EPILOGUE_CASES, ids=str)
def test_cudnn_linear_bias_gelu(dtype, approximate, rows, k, n, training):
    require(cudnn_frontend)
    block = ops.Sequential(ops.Linear(k, n, dtype=dtype, device="cuda"), ops.GELU(approximate))
    gen = torch.Generator(device="cuda").manual_seed(rows + k)
    with torch.no_grad():
        block[0].weight.copy_(randn(gen, n, k, dtype=dtype, scale=k ** -0.5))
        block[0].bias.copy_(randn(gen, n, dtype=dtype, scale=0.5))
    x = randn(gen, rows, k, dtype=dtype).requires_grad_(training)
    with forced("linear_bias_activation"), torch.set_grad_enabled(training):
        assert impl_of(block, x) == {"linear_bias_activation": "cudnn"}
        y = block(x)
    xd, wd, bd = (t.detach().double().requires_grad_() for t in (x, block[0].weight, block[0].bias))
    yd = F.gelu(F.linear(xd, wd, bd), approximate=approximate)
    what = f"gelu({approximate}) {dtype} {rows}x{k}->{n}"
    close(f"{what}: y", y, yd, TOL[dtype])
    if training:
        dy = randn(gen, rows, n, dtype=dtype)
        y.backward(dy)
        yd.backward(dy.double())
        for name, got, ref in (("dx", x.grad, xd.grad), ("dw", block[0].weight.grad, wd.grad),
                               ("db", block[0].bias.grad, bd.grad)):
            close(f"{what}: {name}", got, ref, 3 * TOL[dtype])


def test_cudnn_linear_bias_gelu_replays():
    require(cudnn_frontend)
    dtype, rows, k, n = BF16, 128, 1024, 2048
    block = ops.Sequential(ops.Linear(k, n, dtype=dtype, device="cuda"), ops.GELU())
    gen = torch.Generator(device="cuda").manual_seed(3)
    x = randn(gen, rows, k, dtype=dtype)
    with forced("linear_bias_activation"), torch.no_grad():
        step = graphed(block, x)
        for replay in range(10):
            x = randn(gen, rows, k, dtype=dtype)
            y = step(x)
            ref = F.gelu(F.linear(x.double(), block[0].weight.double(), block[0].bias.double()))
            close(f"replay {replay}", y, ref, TOL[dtype])


# cuDNN: MoE grouped GEMM -----------------------------------------------------------------------------------------------


def grouped_reference(x, sizes, weight):
    out, start = torch.zeros(x.shape[0], weight.shape[1], dtype=torch.float64, device=x.device), 0
    for g, count in enumerate(sizes):
        out[start:start + count] = x[start:start + count].double() @ weight[g].double().t()
        start += count
    return out


def per_group(what, got, ref, sizes, tol):
    """Each group's rows on their own (a kernel that computes only the first group fails here
    even where the overall error would be diluted), and the tail rows zero."""
    start = 0
    for g, count in enumerate(sizes):
        if count:
            close(f"{what} group {g}", got[start:start + count], ref[start:start + count], tol)
        start += count
    if start < got.shape[0]:
        assert bool((got[start:] == 0).all()), f"{what}: tail rows past sum(group_sizes) are not zero"


@pytest.mark.parametrize("dtype", [BF16, FP16], ids=str)
@pytest.mark.parametrize("sizes,tail,k,n", [([40, 0, 25, 70, 1, 16, 33, 9], 7, 256, 512),
                                            ([128, 256, 64, 512], 0, 1024, 768),
                                            ([0, 300, 5, 0, 211], 13, 512, 384)])
def test_cudnn_grouped_gemm(dtype, sizes, tail, k, n):
    require(cudnn_frontend)
    groups, tokens = len(sizes), sum(sizes) + tail
    layer = ops.GroupedLinear(groups, k, n, bias=False, dtype=dtype, device="cuda")
    block = ops.Sequential(layer)
    gen = torch.Generator(device="cuda").manual_seed(tokens)
    with torch.no_grad():
        layer.weight.copy_(randn(gen, *layer.weight.shape, dtype=dtype, scale=k ** -0.5))
    x = randn(gen, tokens, k, dtype=dtype).requires_grad_()
    group_sizes = torch.tensor(sizes, dtype=torch.int32, device="cuda")
    with forced("grouped_linear"):
        assert forced_impl_or_skip(block, x, group_sizes) == {"grouped_linear": "cudnn"}
        y = block(x, group_sizes)
    weight = layer.weight.detach().view(groups, n, k)
    what = f"grouped {dtype} sizes={sizes} tail={tail} {k}->{n}"
    per_group(f"{what} y", y, grouped_reference(x, sizes, weight), sizes, TOL[dtype])
    dy = randn(gen, tokens, n, dtype=dtype)
    y.backward(dy)
    xd, wd = x.detach().double().requires_grad_(), weight.double().requires_grad_()
    grouped_reference_grad = grouped_reference(xd, sizes, wd)
    grouped_reference_grad.backward(dy.double())
    per_group(f"{what} dx", x.grad, xd.grad, sizes, 3 * TOL[dtype])
    dw = layer.weight.grad.view(groups, n, k)
    for g, count in enumerate(sizes):
        if count:
            close(f"{what} dw group {g}", dw[g], wd.grad[g], 3 * TOL[dtype])
        else:
            assert bool((dw[g] == 0).all()), f"{what}: dw of empty group {g} is not zero"


def test_cudnn_grouped_gemm_replays_with_fresh_routing():
    require(cudnn_frontend)
    dtype, groups, tokens, k, n = BF16, 6, 640, 512, 256
    layer = ops.GroupedLinear(groups, k, n, bias=False, dtype=dtype, device="cuda")
    block = ops.Sequential(layer)
    gen = torch.Generator(device="cuda").manual_seed(9)
    with torch.no_grad():
        layer.weight.copy_(randn(gen, *layer.weight.shape, dtype=dtype, scale=k ** -0.5))
    x = randn(gen, tokens, k, dtype=dtype)
    sizes = torch.tensor([100] * groups, dtype=torch.int32, device="cuda")
    with forced("grouped_linear"), torch.no_grad():
        assert forced_impl_or_skip(block, x, sizes) == {"grouped_linear": "cudnn"}
        step = graphed(block, x, sizes)
        weight = layer.weight.view(groups, n, k)
        for replay in range(10):
            raw = torch.randint(0, 2 * tokens // groups, (groups,), generator=torch.Generator().manual_seed(replay))
            counts, left = [], tokens - 5  # at least 5 tail rows, which must come out zero
            for c in raw.tolist():
                counts.append(min(c, left))
                left -= counts[-1]
            x = randn(gen, tokens, k, dtype=dtype)
            y = step(x, torch.tensor(counts, dtype=torch.int32, device="cuda"))
            per_group(f"replay {replay} sizes={counts}", y, grouped_reference(x, counts, weight), counts, TOL[dtype])


# cuBLASMp: comm + GEMM -------------------------------------------------------------------------------------------------

# (tokens per rank, in features, local out features, dtype, bias, extra leading dims): multiples of 8
AG_CASES = [(8, 256, 128, BF16, True, ()), (64, 512, 256, BF16, True, (2,)), (512, 1024, 512, BF16, True, ()),
            (1024, 2048, 1024, FP16, False, ())]
# (tokens per rank after the scatter, local in features, out features, dtype, bias, leading dims)
RS_CASES = [(8, 128, 256, BF16, True, ()), (64, 256, 512, FP16, False, (2,)), (512, 512, 1024, BF16, True, ()),
            (1024, 1024, 1024, BF16, False, ())]


def cublasmp_checks(rank, world):
    import torch.distributed as dist

    from tests.gpu import test_overlap as overlap

    overlap.IMPL = "cublasmp"  # the overlap tests' cases and float32 references, expecting this implementation
    pg = dist.group.WORLD
    gen = torch.Generator(device="cuda").manual_seed(4321 + rank)
    with opfuse.config.override(force_impl="all_gather_linear=cublasmp,linear_reduce_scatter=cublasmp"):
        for case in AG_CASES:
            overlap.run_ag_case(rank, world, pg, gen, *case)
        for case in RS_CASES:
            overlap.run_rs_case(rank, world, pg, gen, *case)
        overlap.run_rs_case(rank, world, pg, gen, 64, 128, 256, FP16, True, (), bias_after=False)
        overlap.check_graph_replay(rank, world, chunks=0)
    torch.cuda.synchronize()
    dist.barrier()


@pytest.mark.parametrize("world", [w for w in (2, 4) if w <= GPUS] or [2])
def test_cublasmp_collective_linears(world):
    require(cublasmp)
    if GPUS < world:
        pytest.skip(f"needs {world} GPUs")
    run(cublasmp_checks, world, backend="nccl", timeout=180)
