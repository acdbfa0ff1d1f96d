"""The ``cublasmp`` implementation of ``all_gather_linear`` and ``linear_reduce_scatter``: cuBLASMp
0.7's tensor-parallel matmuls (``pip install opfuse[cublasmp]``, loaded through ctypes by
:mod:`opfuse.runtime.cublasmp`), peer-to-peer split pipelines (never multicast).

Each torch process group gets, at ``prepare`` on every rank, its own NCCL communicator over the
same ranks (rank 0's ``ncclUniqueId`` broadcast through the torch group; a separate communicator
keeps cuBLASMp's traffic out of the order of torch's NCCL stream), a cuBLASMp handle, the two
1-D process grids (``P x 1`` and ``1 x P``), and the NVSHMEM workspace (symmetric heap, collective
allocation; it only grows, and an outgrown one is kept, since captured CUDA graphs may hold it).

cuBLASMp is column-major; a row-major torch ``[rows, cols]`` buffer is its ``cols x rows`` matrix.
In cuBLASMp's terms (``D = op(A) @ B``, ``m x n`` with contraction ``k``):

=========================  ======  ========================================================  =========
call                       kind    m / n / k                                                 A (op)
=========================  ======  ========================================================  =========
AllGatherLinear fwd        AG      ``N_total`` / ``M_total`` (gathered tokens) / ``K``       W (T)
AllGatherLinear bwd dx     RS      ``K`` / ``M_total`` / ``N_total`` (summed over ranks)     W (N)
LinearReduceScatter fwd    RS      ``N`` / ``M_total`` (scattered tokens) / ``K_total``      W (T)
LinearReduceScatter bwd dx AG      ``K_total`` / ``M_total`` / ``N``                         W (N)
=========================  ======  ========================================================  =========

``B`` is always the rank's activation (``x`` or ``dy``) as stored; ``D`` the rank's output. AG
distributes ``A`` and ``D`` over ``m`` and ``B`` over ``n``; RS distributes ``A`` and ``B`` over
``k`` and ``D`` over ``n``; blocks are one per rank (no cyclic distribution, which lets cuBLASMp
overlap the collective with the split GEMMs). The weight gradients need the gathered input or
gathered ``dy``: an asynchronous NCCL all-gather runs while cuBLASMp computes ``dx``, then one
cuBLAS GEMM. Biases are added with torch after the matmul.
"""

from __future__ import annotations

import ctypes
import dataclasses
from typing import Optional

import torch
import torch.distributed as dist
from torch import Tensor

from ...ops import group as groups
from ...ops.base import OpInputError
from ...ops.collectives import raw_all_reduce
from ...ops.norm import compute_dtype
from ...runtime import cublasmp as mp
from ...runtime.device import current_stream, is_capturing
from .operands import operand_reason

__all__ = ["NAME", "check_all_gather_linear", "check_linear_reduce_scatter", "prepare",
           "all_gather_linear_forward", "all_gather_linear_backward", "linear_reduce_scatter_forward",
           "linear_reduce_scatter_backward", "layout"]

NAME = "cublasmp"
SUPPORTED_DTYPES = {torch.bfloat16: mp.CUDA_R_16BF, torch.float16: mp.CUDA_R_16F}
# Rows of 16 bytes (8 bf16/fp16 elements) for every local matrix: what cuBLAS's fast kernels want;
# not a documented cuBLASMp limit, a conservative one.
_ALIGN = 8


# Layouts (pure arithmetic, tested on CPU) ---------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Desc:
    """A cuBLASMp matrix descriptor: global ``rows x cols``, block ``mb x nb``, local leading
    dimension, and which 1-D grid (``"col"`` = ``P x 1``, ``"row"`` = ``1 x P``)."""

    rows: int
    cols: int
    mb: int
    nb: int
    lld: int
    grid: str


def layout(kind: str, transa: bool, m: int, n: int, k: int, world: int) -> tuple[Desc, Desc, Desc]:
    """``(A, B, D)`` descriptors of an all-gather (``"ag"``) or reduce-scatter (``"rs"``) matmul
    (``B`` never transposed; one block per rank)."""
    for name, size in (("m", m), ("n", n), ("k", k)):
        if (kind == "ag" and name in "mn" or kind == "rs" and name in "kn") and size % world:
            raise ValueError(f"cuBLASMp {kind} matmul: {name}={size} is not divisible by the world size {world}")
    if kind == "ag":
        a = Desc(k, m, k, m // world, k, "row") if transa else Desc(m, k, m // world, k, m // world, "col")
        b = Desc(k, n, k, n // world, k, "row")
        d = Desc(m, n, m // world, n // world, m // world, "col")
    elif kind == "rs":
        a = Desc(k, m, k // world, m, k // world, "col") if transa else Desc(m, k, m, k // world, m, "row")
        b = Desc(k, n, k // world, n // world, k // world, "col")
        d = Desc(m, n, m, n // world, m, "row")
    else:
        raise ValueError(f"cuBLASMp matmul kind {kind!r}; accepted: 'ag', 'rs'")
    return a, b, d


def local_shape(desc: Desc, world: int) -> tuple[int, int]:
    """The row-major torch shape ``[cols, rows]`` of one rank's block of ``desc``."""
    rows = desc.mb if desc.grid == "col" else desc.rows
    cols = desc.nb if desc.grid == "row" else desc.cols
    return cols, rows


def _requests(op: str, x_rows: int, x_cols: int, w_rows: int, world: int, training: bool):
    """``[(kind, transa, m, n, k)]`` of the matmuls a program's calls run (see the module table)."""
    if op == "all_gather_linear":  # x [M_local, K], w [N_local, K]
        m_total, k, n_total = x_rows * world, x_cols, w_rows * world
        reqs = [("ag", True, n_total, m_total, k)]
        if training:
            reqs.append(("rs", False, k, m_total, n_total))
    else:  # x [M_total, K_local], w [N, K_local]
        m_total, k_total, n = x_rows, x_cols * world, w_rows
        reqs = [("rs", True, n, m_total, k_total)]
        if training:
            reqs.append(("ag", False, k_total, m_total, n))
    return reqs


# Per-group state (prepared on every rank in program order) ---------------------------------------------


@dataclasses.dataclass
class _Plan:
    descs: tuple  # (A, B, D) cublasMpMatrixDescriptor_t
    matmul: ctypes.c_void_p
    m: int
    n: int
    k: int
    workspace_bytes: int
    host_workspace: ctypes.Array


@dataclasses.dataclass
class _Group:
    device: int
    world: int
    rank: int
    comm: ctypes.c_void_p
    handle: ctypes.c_void_p
    grids: dict
    probe: Tensor  # a small device buffer: pointers for cublasMpMatmul_bufferSize
    workspace: int = 0
    workspace_bytes: int = 0
    retired: list = dataclasses.field(default_factory=list)
    plans: dict = dataclasses.field(default_factory=dict)


_groups: dict[tuple[str, int], _Group] = {}
_ALPHA, _BETA = ctypes.c_float(1.0), ctypes.c_float(0.0)


def _nccl_comm(pg, device: int) -> ctypes.c_void_p:
    """A new NCCL communicator over ``pg``'s ranks (collective over ``pg``)."""
    nccl = mp.nccl()
    uid = mp.NcclUniqueId()
    rank, world = dist.get_rank(pg), dist.get_world_size(pg)
    if rank == 0:
        mp.check_nccl(nccl.ncclGetUniqueId(ctypes.byref(uid)), "ncclGetUniqueId")
    on = torch.device("cuda", device) if dist.get_backend(pg) == "nccl" else torch.device("cpu")
    raw = torch.tensor(list(bytes(uid)), dtype=torch.uint8, device=on)
    dist.broadcast(raw, src=dist.get_global_rank(pg, 0), group=pg)
    ctypes.memmove(ctypes.addressof(uid), bytes(raw.cpu().tolist()), ctypes.sizeof(uid))
    comm = ctypes.c_void_p()
    mp.check_nccl(nccl.ncclCommInitRank(ctypes.byref(comm), world, uid, rank), "ncclCommInitRank")
    return comm


def _group(name: str, device: int) -> _Group:
    ctx = _groups.get((name, device))
    if ctx is not None:
        return ctx
    lib = mp.lib()
    pg = groups.from_name(name)
    world = dist.get_world_size(pg)
    with torch.cuda.device(device):
        comm = _nccl_comm(pg, device)
        handle = ctypes.c_void_p()
        mp.check(lib.cublasMpCreate(ctypes.byref(handle), ctypes.c_void_p(current_stream())), "cublasMpCreate")
        grids = {}
        for key, (rows, cols, order) in {"col": (world, 1, mp.GRID_COL_MAJOR),
                                         "row": (1, world, mp.GRID_ROW_MAJOR)}.items():
            grid = ctypes.c_void_p()
            # The first grid of the process initialises NVSHMEM (collective over the ranks).
            mp.check(lib.cublasMpGridCreate(rows, cols, order, comm, ctypes.byref(grid)), "cublasMpGridCreate")
            grids[key] = grid
        probe = torch.empty(256, dtype=torch.uint8, device=torch.device("cuda", device))
    ctx = _groups[(name, device)] = _Group(device, world, dist.get_rank(pg), comm, handle, grids, probe)
    return ctx


def _attr(matmul, attr: int, value: int) -> None:
    buf = ctypes.c_int(value)
    mp.check(mp.lib().cublasMpMatmulDescriptorAttributeSet(matmul, attr, ctypes.byref(buf), ctypes.sizeof(buf)),
             "cublasMpMatmulDescriptorAttributeSet")


def _plan(ctx: _Group, request, dtype: torch.dtype) -> _Plan:
    """The descriptors and workspace of one matmul shape (every rank, same order: the workspace
    allocation is collective)."""
    key = (request, dtype)
    plan = ctx.plans.get(key)
    if plan is not None:
        return plan
    if is_capturing():
        raise RuntimeError(f"cuBLASMp plan {request} not prepared before CUDA-graph capture")
    lib = mp.lib()
    kind, transa, m, n, k = request
    cuda_type = SUPPORTED_DTYPES[dtype]
    descs = []
    for d in layout(kind, transa, m, n, k, ctx.world):
        desc = ctypes.c_void_p()
        mp.check(lib.cublasMpMatrixDescriptorCreate(d.rows, d.cols, d.mb, d.nb, 0, 0, d.lld, cuda_type,
                                                    ctx.grids[d.grid], ctypes.byref(desc)),
                 "cublasMpMatrixDescriptorCreate")
        descs.append(desc)
    matmul = ctypes.c_void_p()
    mp.check(lib.cublasMpMatmulDescriptorCreate(ctypes.byref(matmul), mp.CUBLAS_COMPUTE_32F),
             "cublasMpMatmulDescriptorCreate")
    _attr(matmul, mp.ATTR_TRANSA, mp.CUBLAS_OP_T if transa else mp.CUBLAS_OP_N)
    _attr(matmul, mp.ATTR_TRANSB, mp.CUBLAS_OP_N)
    _attr(matmul, mp.ATTR_ALGO_TYPE, mp.ALGO_SPLIT_P2P)
    device_bytes, host_bytes = ctypes.c_size_t(), ctypes.c_size_t()
    probe = ctypes.c_void_p(ctx.probe.data_ptr())
    with torch.cuda.device(ctx.device):
        mp.check(lib.cublasMpMatmul_bufferSize(
            ctx.handle, matmul, m, n, k, ctypes.byref(_ALPHA), probe, 1, 1, descs[0], probe, 1, 1, descs[1],
            ctypes.byref(_BETA), None, 1, 1, None, probe, 1, 1, descs[2],
            ctypes.byref(device_bytes), ctypes.byref(host_bytes)), "cublasMpMatmul_bufferSize")
        _reserve(ctx, device_bytes.value)
    plan = ctx.plans[key] = _Plan(tuple(descs), matmul, m, n, k, device_bytes.value,
                                  ctypes.create_string_buffer(max(host_bytes.value, 1)))
    return plan


def _reserve(ctx: _Group, nbytes: int) -> None:
    if nbytes <= ctx.workspace_bytes:
        return
    # Collective: every rank prepares the same plans in the same order.
    ptr = mp.nvshmem().nvshmem_malloc(nbytes)
    if not ptr:
        raise RuntimeError(f"cuBLASMp: nvshmem_malloc({nbytes}) failed (raise NVSHMEM_SYMMETRIC_SIZE)")
    if ctx.workspace:
        ctx.retired.append(ctx.workspace)
    ctx.workspace, ctx.workspace_bytes = ptr, nbytes


def _run(ctx: _Group, plan: _Plan, a: Tensor, b: Tensor, d: Tensor) -> None:
    lib = mp.lib()
    mp.check(lib.cublasMpStreamSet(ctx.handle, ctypes.c_void_p(current_stream())), "cublasMpStreamSet")
    mp.check(lib.cublasMpMatmul(
        ctx.handle, plan.matmul, plan.m, plan.n, plan.k, ctypes.byref(_ALPHA),
        ctypes.c_void_p(a.data_ptr()), 1, 1, plan.descs[0], ctypes.c_void_p(b.data_ptr()), 1, 1, plan.descs[1],
        ctypes.byref(_BETA), None, 1, 1, None, ctypes.c_void_p(d.data_ptr()), 1, 1, plan.descs[2],
        ctypes.c_void_p(ctx.workspace), ctx.workspace_bytes, plan.host_workspace, len(plan.host_workspace)),
        "cublasMpMatmul")


# Capability checks (pure) and prepare ------------------------------------------------------------------


def _check(spec) -> Optional[str]:
    reason = operand_reason(spec)
    if reason:
        return reason
    x, w = spec.x, spec.inputs["weight"]
    rows, cols = x.tokens, x.features
    if spec.op == "linear_reduce_scatter" and rows % spec.world_size:
        raise OpInputError(
            f"linear_reduce_scatter: dim 0 of x {list(x.shape)} is {rows}, not divisible by the world size "
            f"{spec.world_size}; pass a token count that is a multiple of {spec.world_size}")
    local_rows = rows // spec.world_size if spec.op == "linear_reduce_scatter" else rows
    for what, size in (("tokens per rank", local_rows), ("in_features per rank", cols),
                       ("out_features per rank", w.shape[0])):
        if size % _ALIGN or size == 0:
            return f"{what} = {size} is not a positive multiple of {_ALIGN}"
    world = dist.get_world_size() if dist.is_initialized() else spec.world_size
    if spec.world_size != world:
        return (f"group of {spec.world_size} ranks inside a world of {world}: cuBLASMp 0.7 initialises NVSHMEM "
                f"once per process over every rank, so only world-spanning groups run here")
    reason = mp.status()
    if reason:
        return reason
    ctx = _groups.get((spec.group_name, spec.device.index))
    if is_capturing() and (ctx is None or any((r, spec.dtype) not in ctx.plans for r in _spec_requests(spec))):
        return "cuBLASMp plans cannot be prepared during CUDA-graph capture"
    return None


def _spec_requests(spec):
    return _requests(spec.op, spec.x.tokens, spec.x.features, spec.inputs["weight"].shape[0], spec.world_size,
                     spec.requires_grad)


def check_all_gather_linear(spec) -> Optional[str]:
    """Capable on CUDA for bfloat16/float16 at world >= 2 over a world-spanning group, with local
    tokens and features multiples of 8, when cuBLASMp 0.7 loads."""
    return _check(spec)


def check_linear_reduce_scatter(spec) -> Optional[str]:
    """As :func:`check_all_gather_linear`; tokens not divisible by the world size are an error."""
    return _check(spec)


def prepare(spec) -> None:
    """The group's communicator, grids and handle (first program over the group), then the
    program's matmul plans and their workspace (collective, every rank in program order)."""
    ctx = _group(spec.group_name, spec.device.index)
    for request in _spec_requests(spec):
        _plan(ctx, request, spec.dtype)


def _context(group: str, t: Tensor) -> _Group:
    ctx = _groups.get((group, t.device.index))
    if ctx is None:
        if is_capturing():
            raise RuntimeError("cuBLASMp group not prepared before CUDA-graph capture")
        ctx = _group(group, t.device.index)
    return ctx


def _sum_rows(t: Tensor) -> Tensor:
    return t.sum(0, dtype=compute_dtype(t.dtype)).to(t.dtype)


def _gather_async(t: Tensor, pg, world: int):
    out = t.new_empty((t.shape[0] * world,) + tuple(t.shape[1:]))
    return out, dist.all_gather_into_tensor(out, t, group=pg, async_op=True)


# AllGatherLinear --------------------------------------------------------------------------------------


def all_gather_linear_forward(x: Tensor, weight: Tensor, bias: Optional[Tensor], group: str) -> Tensor:
    """``all_gather_tokens(x) @ weight.T + bias`` as one cuBLASMp AG matmul."""
    ctx = _context(group, x)
    k, n_local = x.shape[-1], weight.shape[0]
    x2 = x.reshape(-1, k).contiguous()
    rows = x2.shape[0]
    plan = _plan(ctx, ("ag", True, n_local * ctx.world, rows * ctx.world, k), x.dtype)
    out = x.new_empty((rows * ctx.world, n_local))
    _run(ctx, plan, weight.contiguous(), x2, out)
    if bias is not None:
        out.add_(bias)
    return out.view((x.shape[0] * ctx.world,) + tuple(x.shape[1:-1]) + (n_local,))


def all_gather_linear_backward(dy: Tensor, x: Tensor, weight: Tensor, group: str, need_dx: bool, need_dw: bool,
                               need_db: bool):
    """``dx = reduce_scatter(dy @ weight)`` (cuBLASMp RS) while NCCL re-gathers ``x`` for
    ``dw = dy.T @ gathered x``; ``db = sum(dy)``."""
    ctx = _context(group, dy)
    n_local, k = weight.shape
    dy2, x2 = dy.reshape(-1, n_local).contiguous(), x.reshape(-1, k).contiguous()
    empty = dy.new_empty(0)
    dx = dw = db = empty
    gathered = work = None
    if need_dw:
        gathered, work = _gather_async(x2, groups.from_name(group), ctx.world)
    if need_dx:
        plan = _plan(ctx, ("rs", False, k, dy2.shape[0], n_local * ctx.world), dy.dtype)
        dx2 = dy.new_empty((x2.shape[0], k))
        _run(ctx, plan, weight.contiguous(), dy2, dx2)
        dx = dx2.view(x.shape)
    if need_dw:
        work.wait()
        dw = dy2.t().mm(gathered)
    if need_db:
        db = _sum_rows(dy2)
    return dx, dw, db


# LinearReduceScatter ----------------------------------------------------------------------------------


def linear_reduce_scatter_forward(x: Tensor, weight: Tensor, bias: Optional[Tensor], bias_after: bool,
                                  group: str) -> Tensor:
    """``reduce_scatter_tokens(x @ weight.T) + bias`` as one cuBLASMp RS matmul (``bias_after=False``:
    plus the sum of every rank's bias, all-reduced: [N] elements)."""
    ctx = _context(group, x)
    k_local, n = x.shape[-1], weight.shape[0]
    x2 = x.reshape(-1, k_local).contiguous()
    rows = x2.shape[0] // ctx.world
    plan = _plan(ctx, ("rs", True, n, x2.shape[0], k_local * ctx.world), x.dtype)
    out = x.new_empty((rows, n))
    _run(ctx, plan, weight.contiguous(), x2, out)
    if bias is not None:
        out.add_(bias if bias_after else raw_all_reduce(bias, groups.from_name(group)))
    return out.view((x.shape[0] // ctx.world,) + tuple(x.shape[1:-1]) + (n,))


def linear_reduce_scatter_backward(dy: Tensor, x: Tensor, weight: Tensor, bias_after: bool, group: str,
                                   need_dx: bool, need_dw: bool, need_db: bool):
    """``dx = all_gather(dy) @ weight`` (cuBLASMp AG) while NCCL gathers ``dy`` for
    ``dw = gathered.T @ x`` (and a per-rank bias's ``db``)."""
    ctx = _context(group, dy)
    n, k_local = weight.shape
    dy2, x2 = dy.reshape(-1, n).contiguous(), x.reshape(-1, k_local).contiguous()
    empty = dy.new_empty(0)
    dx = dw = db = empty
    keep = need_dw or (need_db and not bias_after)
    gathered = work = None
    if keep:
        gathered, work = _gather_async(dy2, groups.from_name(group), ctx.world)
    if need_dx:
        plan = _plan(ctx, ("ag", False, k_local * ctx.world, x2.shape[0], n), dy.dtype)
        dx2 = dy.new_empty((x2.shape[0], k_local))
        _run(ctx, plan, weight.contiguous(), dy2, dx2)
        dx = dx2.view(x.shape)
    if keep:
        work.wait()
    if need_dw:
        dw = gathered.t().mm(x2)
    if need_db:
        db = _sum_rows(dy2 if bias_after else gathered)
    return dx, dw, db
