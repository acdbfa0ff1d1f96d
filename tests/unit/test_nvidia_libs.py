"""The optional NVIDIA-library implementations on CPU: nothing is imported with opfuse, a missing
library is a reason (with the install hint), the capability checks in order (with a fake cuDNN
frontend), the cuBLASMp matrix layouts simulated block by block against the ops' math at world
2, 3 and 4, the ctypes signatures against cublasmp.h and the cuDNN graphs against the real
frontend's IR (both where the packages are installed), and doctor's library lines."""

import contextlib
import ctypes
import os
import re
import subprocess
import sys

import pytest
import torch

from opfuse.families.collective_linear import cublasmp as mp_impl
from opfuse.families.grouped_linear import cudnn as grouped_cudnn
from opfuse.families.linear import cudnn as activation_cudnn
from opfuse.machinery.implementation import CallSpec
from opfuse.families.residual_norm import cudnn as norm_cudnn
from opfuse.runtime import cublasmp, cudnn_frontend
from opfuse.ops.base import TensorMeta

CUDA = torch.device("cuda", 0)
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(autouse=True)
def _fresh_libraries(monkeypatch):
    # Specs below describe world-2 groups; another test may have left a one-rank default group.
    monkeypatch.setattr(mp_impl.dist, "is_initialized", lambda: False)
    cudnn_frontend._reset_for_tests()
    cublasmp._reset_for_tests()
    yield
    cudnn_frontend._reset_for_tests()
    cublasmp._reset_for_tests()
    cudnn_frontend.clear()


def _norm_spec(norm="rms", tokens=6, hidden=64, dtype=torch.bfloat16, device=CUDA, weight=True, grad=False,
               weight_dtype=None):
    x = TensorMeta((tokens, hidden), dtype, device)
    w = TensorMeta((hidden,), weight_dtype or dtype, device) if weight else None
    return CallSpec(op=f"add_{norm}norm" if norm == "rms" else "add_layernorm",
                    inputs={"x": x, "residual": x, "bias": None, "weight": w, "norm_bias": None},
                    attrs={"norm": norm, "eps": 1e-5, "write_residual": True}, requires_grad=grad)


def _grouped_spec(tokens=32, groups=4, k=64, n=48, dtype=torch.bfloat16, bias=False, grad=False, device=CUDA):
    return CallSpec(op="grouped_linear",
                    inputs={"x": TensorMeta((tokens, k), dtype, device),
                            "group_sizes": TensorMeta((groups,), torch.int32, device),
                            "weight": TensorMeta((groups, n, k), dtype, device),
                            "bias": TensorMeta((groups, n), dtype, device) if bias else None},
                    attrs={"fsdp": False}, requires_grad=grad)


def _activation_spec(activation="gelu", dtype=torch.float16, grad=False, device=CUDA):
    return CallSpec(op="linear_bias_activation",
                    inputs={"x": TensorMeta((5, 32), dtype, device), "weight": TensorMeta((48, 32), dtype, device),
                            "bias": TensorMeta((48,), dtype, device)},
                    attrs={"activation": activation}, requires_grad=grad)


def _collective_spec(op="all_gather_linear", tokens=16, k=64, n=32, world=2, dtype=torch.bfloat16, device=CUDA):
    return CallSpec(op=op, inputs={"x": TensorMeta((tokens, k), dtype, device), "weight": TensorMeta((n, k), dtype, device),
                                   "bias": None},
                    attrs={}, group_name="tp", world_size=world)


# Import and missing libraries -----------------------------------------------------------------------------------


def test_importing_opfuse_loads_no_optional_library():
    code = ("import sys, opfuse, opfuse.core.dispatch, opfuse.cli.doctor; "
            "print(sorted(m for m in sys.modules if m == 'cudnn' or m.startswith('cudnn.')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True,
                         env={**os.environ, "PYTHONPATH": ROOT})
    assert out.stdout.strip() == "[]"


def test_missing_libraries_are_reasons_with_the_install_hint(monkeypatch):
    monkeypatch.setitem(sys.modules, "cudnn", None)  # "import cudnn" raises ImportError
    assert "pip install opfuse[cudnn]" in cudnn_frontend.status()
    assert norm_cudnn.check(_norm_spec()) == cudnn_frontend.status()
    assert grouped_cudnn.check(_grouped_spec()) in (cudnn_frontend.status(),
                                                    "needs triton for its tail-row fix-up: triton is not installed")
    assert activation_cudnn.check(_activation_spec()) == cudnn_frontend.status()
    with pytest.raises(RuntimeError, match=r"pip install opfuse\[cudnn\]"):
        cudnn_frontend.module()
    monkeypatch.setattr(sys, "path", [])
    assert "pip install opfuse[cublasmp]" in cublasmp.status()
    assert mp_impl.check_all_gather_linear(_collective_spec()) == cublasmp.status()


def test_checks_reject_before_asking_for_the_library():
    cpu = torch.device("cpu")
    assert norm_cudnn.check(_norm_spec(device=cpu)) == "needs a CUDA device"
    assert "dtype float64" in norm_cudnn.check(_norm_spec(dtype=torch.float64))
    assert "norm weight" in norm_cudnn.check(_norm_spec(weight=False))
    assert "weight is float32" in norm_cudnn.check(_norm_spec(weight_dtype=torch.float32))
    assert "no bias input" in grouped_cudnn.check(_grouped_spec(bias=True))
    assert "dtype float32" in grouped_cudnn.check(_grouped_spec(dtype=torch.float32))
    assert "dtype float32" in activation_cudnn.check(_activation_spec(dtype=torch.float32))
    assert "nothing to overlap" in mp_impl.check_all_gather_linear(_collective_spec(world=1))
    assert "multiple of 8" in mp_impl.check_all_gather_linear(_collective_spec(tokens=12))
    assert "multiple of 8" in mp_impl.check_linear_reduce_scatter(
        _collective_spec(op="linear_reduce_scatter", tokens=24, world=2))  # 12 tokens per rank
    with pytest.raises(Exception, match="not divisible by the world size 3"):
        mp_impl.check_linear_reduce_scatter(_collective_spec(op="linear_reduce_scatter", tokens=16, world=3))


def test_cublasmp_needs_a_world_spanning_group(monkeypatch):
    monkeypatch.setattr(mp_impl.dist, "is_initialized", lambda: True)
    monkeypatch.setattr(mp_impl.dist, "get_world_size", lambda group=None: 4)
    assert "group of 2 ranks inside a world of 4" in mp_impl.check_all_gather_linear(_collective_spec())


# A fake cuDNN frontend: what the checks ask of it -----------------------------------------------------------------


class _Enum:
    def __init__(self, *names):
        for name in names:
            setattr(self, name, name)


class _FakeTensor:
    def __getattr__(self, name):
        if name.startswith("set_"):
            return lambda *a, **k: self
        raise AttributeError(name)


class _FakeGraph:
    def __init__(self, fake, **kwargs):
        self.fake, self.ops = fake, []

    def tensor(self, **kwargs):
        return _FakeTensor()

    def __getattr__(self, op):
        def node(*args, **kwargs):
            self.ops.append(op)
            phase = kwargs.get("norm_forward_phase")
            if op in self.fake.refuse or f"{op}:{phase}" in self.fake.refuse:
                raise RuntimeError(f"GRAPH_NOT_SUPPORTED: no engine for {op}")
            count = {"rmsnorm": 2, "layernorm": 3, "rmsnorm_backward": 3, "layernorm_backward": 3}.get(op, 1)
            outs = tuple(_FakeTensor() for _ in range(count))
            return outs if count > 1 else outs[0]
        return node

    def validate(self):
        self.fake.graphs.append(self.ops)

    def build_operation_graph(self):
        pass

    def create_execution_plans(self, modes):
        pass

    def check_support(self):
        pass


class _FakeCudnn:
    __version__ = "1.32.0-fake"

    def __init__(self, refuse=()):
        self.refuse, self.graphs = set(refuse), []
        self.data_type = _Enum("FLOAT", "BFLOAT16", "HALF", "INT32")
        self.norm_forward_phase = _Enum("INFERENCE", "TRAINING")
        self.heur_mode = _Enum("A", "FALLBACK")
        self.moe_grouped_matmul_mode = _Enum("NONE")

    def pygraph(self, **kwargs):
        return _FakeGraph(self, **kwargs)

    def backend_version(self):
        return 91900


@pytest.fixture
def fake_cudnn(monkeypatch):
    def install(refuse=()):
        fake = _FakeCudnn(refuse)
        cudnn_frontend._reset_for_tests(fake_module=fake)
        monkeypatch.setattr(cudnn_frontend, "handle", lambda device: "handle")
        monkeypatch.setattr(cudnn_frontend, "device_scope", lambda device: contextlib.nullcontext())
        return fake
    return install


def test_norm_check_asks_cudnn_for_each_graph_of_the_program(fake_cudnn):
    fake = fake_cudnn()
    assert norm_cudnn.check(_norm_spec("rms")) is None
    assert fake.graphs == [["rmsnorm"]]
    fake.graphs.clear()
    assert norm_cudnn.check(_norm_spec("layer", grad=True)) is None
    # forward, backward with dx in bf16 and (optional) in float32, the (optional) statistics recompute
    assert fake.graphs == [["layernorm"], ["layernorm_backward"], ["layernorm_backward"], ["layernorm"]]
    fake.graphs.clear()
    assert norm_cudnn.check(_norm_spec("layer", grad=True)) is None and fake.graphs == []  # cached answers


def test_optional_norm_graphs_do_not_decide_capability(fake_cudnn):
    fake_cudnn(refuse={"layernorm:TRAINING"})  # no engine for the statistics recompute: torch's kernel then
    assert norm_cudnn.check(_norm_spec("layer", grad=True)) is None


def test_cudnn_refusal_is_the_reason(fake_cudnn):
    fake_cudnn(refuse={"rmsnorm_backward", "gelu", "moe_grouped_matmul"})
    assert norm_cudnn.check(_norm_spec("rms")) is None
    reason = norm_cudnn.check(_norm_spec("rms", tokens=7, grad=True))
    assert reason.startswith("backward graph: cuDNN has no engine for this graph here") and "GRAPH_NOT_SUPPORTED" in reason
    assert "no engine" in activation_cudnn.check(_activation_spec("gelu"))
    assert activation_cudnn.check(_activation_spec("gelu_tanh")) is None


def test_grouped_check_needs_triton_or_cudnn_for_each_piece(fake_cudnn, monkeypatch):
    fake_cudnn(refuse={"moe_grouped_matmul_bwd"})
    monkeypatch.setattr(grouped_cudnn.triton_impl, "triton_status", lambda: None)
    assert grouped_cudnn.check(_grouped_spec()) is None
    monkeypatch.setattr(grouped_cudnn.triton_impl, "check", lambda spec: "no GPU for Triton")
    reason = grouped_cudnn.check(_grouped_spec(grad=True))
    assert reason == "cuDNN has no wgrad engine here and the Triton fallback cannot run: no GPU for Triton"
    monkeypatch.setattr(grouped_cudnn.triton_impl, "check", lambda spec: None)
    assert grouped_cudnn.check(_grouped_spec(tokens=33, grad=True)) is None


def test_first_token_offsets_are_device_side_and_clamped():
    sizes = torch.tensor([3, 0, 5, 9], dtype=torch.int32)
    offsets = grouped_cudnn.first_token_offsets(sizes, tokens=12)
    assert offsets.dtype == torch.int32 and offsets.shape == (5, 1, 1)
    assert offsets.flatten().tolist() == [0, 3, 3, 8, 12]


def test_rms_statistics_recompute_matches_the_reference():
    h = torch.randn(9, 40, dtype=torch.float64).to(torch.bfloat16)
    _, inv_var = norm_cudnn._statistics(h, None, None, 1e-5, "rms")
    want = torch.rsqrt(h.double().pow(2).mean(-1, keepdim=True) + 1e-5)
    torch.testing.assert_close(inv_var.double(), want, rtol=1e-6, atol=0)


# cuBLASMp layouts, simulated -----------------------------------------------------------------------------------------


def _local_of(desc, world, rank, full):
    """Rank ``rank``'s block of the global column-major matrix ``full`` (rows x cols), as the
    row-major torch tensor cuBLASMp reads (``[local cols, lld]``)."""
    if desc.grid == "col":  # P x 1: row blocks
        block = full[rank * desc.mb:(rank + 1) * desc.mb, :]
    else:  # 1 x P: column blocks
        block = full[:, rank * desc.nb:(rank + 1) * desc.nb]
    assert block.shape[0] == desc.lld
    return block.t()


def _global_of(desc, world, locals_):
    """The global column-major matrix from every rank's row-major local tensor."""
    blocks = [t.t() for t in locals_]
    return torch.cat(blocks, 0 if desc.grid == "col" else 1)


def _simulate(kind, transa, m, n, k, world, a_locals, b_locals):
    """Every rank's ``D`` block of ``op(A) @ B`` under the descriptors of :func:`layout`."""
    a_desc, b_desc, d_desc = mp_impl.layout(kind, transa, m, n, k, world)
    a = _global_of(a_desc, world, a_locals)
    b = _global_of(b_desc, world, b_locals)
    assert b.shape == (k, n)
    d = (a.t() if transa else a) @ b
    assert d.shape == (m, n)
    return [_local_of(d_desc, world, r, d) for r in range(world)], (a_desc, b_desc, d_desc)


@pytest.mark.parametrize("world", [2, 3, 4])
def test_cublasmp_layouts_compute_the_ops(world):
    g = torch.Generator().manual_seed(world)
    rnd = lambda *shape: torch.randn(*shape, generator=g, dtype=torch.float64)  # noqa: E731
    m_local, k, n_local = 8, 24, 16
    m_total = m_local * world
    # all_gather_linear forward: out_r = gather(x) @ W_r.T
    xs, ws = [rnd(m_local, k) for _ in range(world)], [rnd(n_local, k) for _ in range(world)]
    (kind, transa, m, n, kk), = mp_impl._requests("all_gather_linear", m_local, k, n_local, world, False)
    outs, descs = _simulate(kind, transa, m, n, kk, world, ws, xs)
    full_x = torch.cat(xs)
    for r in range(world):
        assert tuple(mp_impl.local_shape(descs[0], world)) == tuple(ws[r].shape)
        assert tuple(mp_impl.local_shape(descs[1], world)) == tuple(xs[r].shape)
        torch.testing.assert_close(outs[r], full_x @ ws[r].t())
    # its backward dx: dx_r = reduce_scatter(sum_r dy_r @ W_r)
    dys = [rnd(m_total, n_local) for _ in range(world)]
    (kind, transa, m, n, kk) = mp_impl._requests("all_gather_linear", m_local, k, n_local, world, True)[1]
    dxs, _ = _simulate(kind, transa, m, n, kk, world, ws, dys)
    summed = sum(dys[r] @ ws[r] for r in range(world))
    for r in range(world):
        torch.testing.assert_close(dxs[r], summed[r * m_local:(r + 1) * m_local])
    # linear_reduce_scatter forward: y_r = rows r of sum_r x_r @ W_r.T (x_r [M_total, K_local])
    k_local, n = 16, 24
    xs, ws = [rnd(m_total, k_local) for _ in range(world)], [rnd(n, k_local) for _ in range(world)]
    (kind, transa, m, nn, kk), = mp_impl._requests("linear_reduce_scatter", m_total, k_local, n, world, False)
    ys, _ = _simulate(kind, transa, m, nn, kk, world, ws, xs)
    summed = sum(xs[r] @ ws[r].t() for r in range(world))
    for r in range(world):
        torch.testing.assert_close(ys[r], summed[r * m_local:(r + 1) * m_local])
    # its backward dx: dx_r = gather(dy) @ W_r
    dys = [rnd(m_local, n) for _ in range(world)]
    (kind, transa, m, nn, kk) = mp_impl._requests("linear_reduce_scatter", m_total, k_local, n, world, True)[1]
    dxs, _ = _simulate(kind, transa, m, nn, kk, world, ws, dys)
    for r in range(world):
        torch.testing.assert_close(dxs[r], torch.cat(dys) @ ws[r])


def test_cublasmp_layout_rejects_undivisible_sizes():
    with pytest.raises(ValueError, match="n=10 is not divisible by the world size 4"):
        mp_impl.layout("ag", True, 8, 10, 16, 4)


# Against the real packages, where installed ------------------------------------------------------------------------


_C_KINDS = {"int64_t": ctypes.c_int64, "size_t": ctypes.c_size_t, "uint32_t": ctypes.c_uint32}


def _header_kind(ctype: str):
    ctype = ctype.replace("const ", "").strip()
    if "*" in ctype or ctype in ("cublasMpHandle_t", "cublasMpGrid_t", "cublasMpMatrixDescriptor_t",
                                 "cublasMpMatmulDescriptor_t", "ncclComm_t", "cudaStream_t"):
        return "pointer"
    return _C_KINDS.get(ctype, ctypes.c_int)  # enums


def _ctypes_kind(argtype):
    if argtype is ctypes.c_void_p or (isinstance(argtype, type) and issubclass(argtype, ctypes._Pointer)):
        return "pointer"
    return argtype


def test_ctypes_signatures_match_cublasmp_header():
    header = cublasmp._search(("nvidia/cublasmp/cu13/include",), "cublasmp.h")
    if header is None:
        pytest.skip("nvidia-cublasmp-cu13 is not installed here")
    text = open(header).read()
    for name, (restype, argtypes) in cublasmp.SIGNATURES.items():
        found = re.search(r"(\w+)\s+" + name + r"\s*\(([^;]*?)\);", text)
        assert found, name
        params = [p.strip() for p in found.group(2).split(",") if p.strip() and p.strip() != "void"]
        types = [re.sub(r"\s*\b\w+$", "", p) if not p.endswith("*") else p for p in params]
        assert [_header_kind(t) for t in types] == [_ctypes_kind(a) for a in argtypes], name
        assert (restype is ctypes.c_int64) == (found.group(1) == "int64_t"), name


def test_cudnn_graphs_build_in_the_real_frontend_ir():
    """Every graph the implementations build, through the installed frontend's IR (cuDNN's own
    support answer needs a GPU: tests/gpu)."""
    cudnn = pytest.importorskip("cudnn")
    for norm in ("rms", "layer"):
        for training in (False, True):
            g = norm_cudnn.build_forward(cudnn, None, norm=norm, tokens=5, hidden=24, dtype=torch.bfloat16,
                                         training=training)
            uids = {t.uid for t in g.get_outputs()}
            assert uids == ({norm_cudnn.Y} | ({norm_cudnn.INV_VAR} | ({norm_cudnn.MEAN} if norm == "layer" else set())
                                              if training else set()))
        g = norm_cudnn.build_backward(cudnn, None, norm=norm, tokens=5, hidden=24, dtype=torch.bfloat16,
                                      dx_dtype=torch.float32)
        outs = {t.uid: t for t in g.get_outputs()}
        assert outs[norm_cudnn.DX].data_type == cudnn.data_type.FLOAT
        assert (norm_cudnn.DBIAS in outs) == (norm == "layer")
    for save_pre in (False, True):
        g = activation_cudnn.build(cudnn, None, rows=7, k=16, n=24, dtype=torch.float16, activation="gelu",
                                   save_pre=save_pre)
        assert {t.uid for t in g.get_outputs()} == ({activation_cudnn.Y, activation_cudnn.PRE} if save_pre
                                                    else {activation_cudnn.Y})
    g = grouped_cudnn.build_matmul(cudnn, None, tokens=9, groups=3, k=16, n=24, dtype=torch.bfloat16, weight_nk=True)
    (out,) = g.get_outputs()
    assert list(out.dim) == [1, 9, 24]
    g = grouped_cudnn.build_wgrad(cudnn, None, tokens=9, groups=3, k=16, n=24, dtype=torch.bfloat16)
    (dw,) = g.get_outputs()
    assert list(dw.dim) == [3, 16, 24] and list(dw.stride) == [16 * 24, 1, 16]


def test_doctor_lists_the_optional_libraries(capsys):
    from opfuse.cli.doctor import main_doctor

    assert main_doctor([]) == 0
    out = capsys.readouterr().out
    assert re.search(r"^  cuDNN frontend: ", out, re.M) and re.search(r"^  cuBLASMp: ", out, re.M)
    assert "implementation 'cudnn' of add_rmsnorm, add_layernorm, linear_bias_activation, grouped_linear:" in out
    assert "implementation 'cublasmp' of all_gather_linear, linear_reduce_scatter:" in out
    assert re.search(r"add_layernorm\s+cuda, cudnn, reference", out)


# The norm implementation's wiring, with cuDNN's graphs emulated by torch ----------------------------------------


class _Compiled:
    def __init__(self, kind, norm, dx_dtype=None):
        self.kind, self.norm, self.dx_dtype = kind, norm, dx_dtype


def _emulate(compiled, buffers):
    """What cuDNN's norm graphs compute, by uid (statistics in float64 here)."""
    n = norm_cudnn
    hidden = buffers[n.X].shape[-1]
    x = buffers[n.X].reshape(-1, hidden).double()
    scale = buffers[n.SCALE].double()
    if compiled.kind in ("forward", "stats"):
        eps = float(buffers[n.EPS])
        mean = x.mean(-1, keepdim=True) if compiled.norm == "layer" else torch.zeros_like(x[:, :1])
        inv = torch.rsqrt(((x - mean) ** 2).mean(-1, keepdim=True) + eps)
        y = (x - mean) * inv * scale + (buffers[n.BIAS].double() if compiled.norm == "layer" else 0)
        buffers[n.Y].copy_(y.reshape(buffers[n.Y].shape))
        if compiled.kind == "stats":
            buffers[n.MEAN].copy_(mean)
            buffers[n.INV_VAR].copy_(inv)
        return
    dy = buffers[n.DY].reshape(-1, hidden).double()
    inv = buffers[n.INV_VAR].double().reshape(-1, 1)
    mean = buffers[n.MEAN].double().reshape(-1, 1) if compiled.norm == "layer" else 0
    xhat = (x - mean) * inv
    g = dy * scale
    if compiled.norm == "layer":
        dx = inv * (g - g.mean(-1, keepdim=True) - xhat * (g * xhat).mean(-1, keepdim=True))
        buffers[n.DBIAS].copy_(dy.sum(0))
    else:
        dx = inv * (g - xhat * (g * xhat).mean(-1, keepdim=True))
    assert buffers[n.DX].dtype == compiled.dx_dtype
    buffers[n.DX].copy_(dx.reshape(buffers[n.DX].shape))
    buffers[n.DSCALE].copy_((dy * xhat).sum(0))


@pytest.mark.parametrize("norm", ["rms", "layer"])
@pytest.mark.parametrize("float32_dx,cudnn_stats", [(True, True), (False, False)])
def test_norm_implementation_wiring(monkeypatch, norm, float32_dx, cudnn_stats):
    """forward / backward of the ``cudnn`` implementation against the reference, with cuDNN's
    graphs emulated: buffers by uid, recomputed statistics, the residual gradient summed in (with
    and without the optional float32-dx and statistics graphs)."""
    from opfuse.families.residual_norm import reference

    def plan(kind, x, norm_, extra=()):
        hidden = x.shape[-1]
        if (kind == "stats" and not cudnn_stats) or (extra and extra[0] == torch.float32 and x.dtype != torch.float32
                                                     and not float32_dx):
            return None, x.numel() // hidden, hidden
        return _Compiled(kind, norm_, extra[0] if extra else None), x.numel() // hidden, hidden

    monkeypatch.setattr(norm_cudnn, "_plan", plan)
    monkeypatch.setattr(norm_cudnn.frontend, "execute", _emulate)
    gen = torch.Generator().manual_seed(3)
    rnd = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64).to(torch.bfloat16)  # noqa: E731
    x, r, bias, w = rnd(2, 5, 48), rnd(2, 5, 48), rnd(48), 1 + 0.1 * rnd(48)
    nb = rnd(48) if norm == "layer" else None
    y, h = norm_cudnn.forward(x, bias, r, w, nb, 1e-5, "", True, norm=norm)
    y_ref, h_ref = reference.forward(x, bias, r, w, nb, 1e-5, "", True, norm=norm)
    torch.testing.assert_close(h, h_ref, rtol=0, atol=0)
    torch.testing.assert_close(y.float(), y_ref.float(), rtol=2e-2, atol=2e-2)
    for dh_out in (None, rnd(2, 5, 48)):
        dy = rnd(2, 5, 48)
        got = norm_cudnn.backward(dy, h, dh_out, w, nb, 1e-5, norm=norm)
        want = reference.backward(dy, h, dh_out, w, nb, 1e-5, norm=norm)
        for name, a, b in zip(("dh", "dw", "db"), got, want):
            assert a.shape == b.shape and a.dtype == b.dtype, name
            torch.testing.assert_close(a.float(), b.float(), rtol=3e-2, atol=3e-2, msg=name)
