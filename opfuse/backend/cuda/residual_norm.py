"""CUDA implementations of the residual-norm family (``opfuse::residual_norm``).

================  =================================================================  ==================
implementation    what runs                                                          when capable
================  =================================================================  ==================
``cuda_oneshot``  one kernel: Lamport push of x to every peer, reduce, add, norm     message <= OPFUSE_ONESHOT_MAX_BYTES
``cuda_twoshot``  one kernel: reduce-scatter rows, all-gather sums, add, norm        message <= OPFUSE_TWOSHOT_MAX_BYTES
``nccl+cuda``     NCCL all-reduce, then the fused single-GPU add+norm kernel         any CUDA group
``cuda``          single GPU: the fused add+norm kernel (``add_norm`` op)            CUDA
================  =================================================================  ==================

Peer buffers are regions of the group's :class:`~opfuse.backend.symm_pool.SymmetricPool`,
reserved and initialised (collectively) when a program is compiled, never during a call.
Backward of every variant: the fused RMSNorm backward kernel (LayerNorm: the reference).
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist

from ...config import config
from ...ops import group as groups
from .. import extension
from ..fused.residual_norm import reference_backward, reference_forward
from ..symm_pool import SymmetricPool, unavailable_reason

__all__ = ["check_oneshot", "check_twoshot", "check_nccl_then_kernel", "check_local", "oneshot_forward",
           "twoshot_forward", "nccl_then_kernel_forward", "local_forward", "norm_backward", "DTYPES"]

DTYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
NORMS = {"none": 0, "rms": 1, "layer": 2}
_MIN_CAPACITY = {"oneshot": 256 << 10, "twoshot": 8 << 20}
# Largest message (bytes per rank) for which the one-shot kernel beats the two-shot one, by world
# size, measured with bench/allreduce_norm.py (docs/PERF_NOTES.md). OPFUSE_ONESHOT_MAX_BYTES
# overrides it.
# World 2: one-shot sends the same bytes as two-shot with one hop instead of two; it won up to
# 2 MiB, tied at 8 MiB and lost at 32 MiB against the staged two-shot; world 4: it won up to
# 512 KiB and tied at 2 MiB. World 3 is interpolated (not measured); larger worlds keep 512 KiB.
_ONESHOT_AUTO_MAX = {2: 8 << 20, 3: 2 << 20, 4: 1 << 20}
_ONESHOT_DEFAULT_MAX = 512 << 10


# Largest message for the two-shot kernel (beyond it: NCCL all-reduce + the local add+norm
# kernel), by row size; OPFUSE_TWOSHOT_MAX_BYTES overrides it. With 16 KiB rows (hidden 8192,
# bf16) the two-shot won up to 128 MiB at world 2 and 4; with 8 KiB rows (hidden 4096) it tied
# with NCCL + kernel at 16 MiB (+-3 %) and lost by 11-14 % at 64 MiB (docs/PERF_NOTES.md).
_TWOSHOT_SHORT_ROW_BYTES = 16 << 10
_TWOSHOT_SHORT_ROW_MAX = 16 << 20
_TWOSHOT_DEFAULT_MAX = 256 << 20


def oneshot_limit(world: int, row_bytes: int = 0) -> int:
    """Largest message the one-shot kernel takes at ``world`` ranks."""
    if config.oneshot_max_bytes:
        return config.oneshot_max_bytes
    return _ONESHOT_AUTO_MAX.get(world, _ONESHOT_DEFAULT_MAX)


def twoshot_limit(world: int, row_bytes: int) -> int:
    """Largest message the two-shot kernel takes for rows of ``row_bytes``."""
    if config.twoshot_max_bytes:
        return config.twoshot_max_bytes
    return _TWOSHOT_SHORT_ROW_MAX if row_bytes < _TWOSHOT_SHORT_ROW_BYTES else _TWOSHOT_DEFAULT_MAX


# Capability checks -------------------------------------------------------------------------


def _kernel_reason(spec) -> str | None:
    if spec.device.type != "cuda":
        return "needs a CUDA device"
    if spec.dtype not in DTYPES:
        return f"dtype {spec.dtype} not supported (float32, bfloat16, float16)"
    for name in ("residual", "bias", "weight", "norm_bias"):
        meta = spec.inputs.get(name)
        if meta is not None and meta.dtype != spec.dtype:
            return f"{name} is {meta.dtype}, input is {spec.dtype} (kernels take one dtype)"
    element = torch.empty((), dtype=spec.dtype).element_size()
    hidden = spec.x.features
    if hidden * element % 16:
        return f"hidden size {hidden} x {element} bytes is not a multiple of 16 bytes"
    if hidden * element > 128 * 1024:
        return f"hidden size {hidden} exceeds the kernels' 128 KiB rows"
    try:
        extension.load()
    except extension.ExtensionUnavailable as error:
        return f"CUDA extension unavailable: {error}"
    return None


def _message_bytes(spec) -> int:
    return spec.x.nbytes


@dataclasses.dataclass
class _PeerPlan:
    region: object          # the pool Region
    peer_region: object     # _opfuse_cuda.PeerRegion
    peers: torch.Tensor     # device array of peer addresses (kept alive)
    capacity: int


_plans: dict[tuple, _PeerPlan] = {}


def _capacity(kind: str, message: int) -> int:
    """Regions come in power-of-two size classes, so programs of similar sizes share one."""
    capacity = _MIN_CAPACITY[kind]
    while capacity < message:
        capacity *= 2
    return capacity


def _plan(group_name: str, kind: str, dtype: torch.dtype, message: int) -> _PeerPlan | str:
    """The initialised peer region for ``kind`` (reserving it collectively on first use)."""
    capacity = _capacity(kind, message)
    device = torch.cuda.current_device()
    key = (group_name, device, kind, DTYPES[dtype], capacity)
    if key in _plans:
        return _plans[key]
    pg = groups.from_name(group_name)
    pool = SymmetricPool.get(pg)
    if pool is None:
        return f"no peer memory: {unavailable_reason(pg)}"
    ext = extension.load()
    world = pool.world_size
    if world > ext.MAX_WORLD:
        return f"world size {world} > {ext.MAX_WORLD}"
    size = (ext.oneshot_region_bytes if kind == "oneshot" else ext.twoshot_region_bytes)(world, capacity)
    region = pool.reserve(f"residual_norm/{kind}/{dtype}/{capacity}", size)
    if region is None:
        return (f"symmetric pool cannot hold {size >> 20} MiB more (OPFUSE_SYMM_POOL_MB={config.symm_pool_mb}, "
                f"OPFUSE_SYMM_POOL_MAX_MB={config.symm_pool_max_mb}, or CUDA-graph capture in progress)")
    peers = torch.tensor(region.peer_ptrs(), dtype=torch.int64, device=torch.device("cuda", device))
    peer_region = ext.PeerRegion(peers.data_ptr(), region.local_ptr(), pool.rank, world, size, capacity)
    stream = torch.cuda.current_stream().cuda_stream
    if kind == "oneshot":
        ext.oneshot_init(peer_region, DTYPES[dtype], stream)
    else:
        ext.twoshot_init(peer_region, stream)
    # Every rank's buffers must hold their initial state before any peer pushes into them.
    torch.cuda.synchronize()
    dist.barrier(group=pg)
    plan = _PeerPlan(region, peer_region, peers, capacity)
    _plans[key] = plan
    return plan


def _check_peer(kind: str, limit):
    def check(spec) -> str | None:
        reason = _kernel_reason(spec)
        if reason:
            return reason
        message = _message_bytes(spec)
        row_bytes = spec.x.features * torch.empty((), dtype=spec.dtype).element_size()
        most = limit(spec.world_size, row_bytes)
        if message > most:
            setting = "OPFUSE_ONESHOT_MAX_BYTES" if kind == "oneshot" else "OPFUSE_TWOSHOT_MAX_BYTES"
            return (f"message of {message} bytes exceeds the {kind} limit of {most} bytes ({setting}; automatic "
                    f"when 0: by world size and row size, here world {spec.world_size}, {row_bytes}-byte rows)")
        plan = _plan(spec.group_name, kind, spec.dtype, message)
        return plan if isinstance(plan, str) else None

    return check


check_oneshot = _check_peer("oneshot", oneshot_limit)
check_twoshot = _check_peer("twoshot", twoshot_limit)


def check_nccl_then_kernel(spec) -> str | None:
    reason = _kernel_reason(spec)
    if reason:
        return reason
    if dist.get_backend(groups.from_name(spec.group_name)) != "nccl":
        return "group backend is not NCCL"
    return None


def check_local(spec) -> str | None:
    return _kernel_reason(spec)


# Forward ------------------------------------------------------------------------------------


def _ready(t: torch.Tensor | None, like: torch.Tensor, what: str) -> torch.Tensor | None:
    """Validate a kernel operand; copy it when its layout does not suit the kernels."""
    if t is None:
        return None
    if t.dtype != like.dtype:
        raise ValueError(f"opfuse residual_norm: {what} is {t.dtype}, x is {like.dtype}; pass one dtype")
    if t.device != like.device:
        raise ValueError(f"opfuse residual_norm: {what} is on {t.device}, x on {like.device}")
    if not t.is_contiguous() or t.data_ptr() % 16:
        t = t.contiguous() if not t.is_contiguous() else t.clone()
    return t


def _operands(x, bias, residual, weight, norm_bias):
    if x.device.index != torch.cuda.current_device():
        raise ValueError(f"opfuse residual_norm: x is on {x.device} but the current device is "
                         f"cuda:{torch.cuda.current_device()}; call torch.cuda.set_device first")
    hidden = x.shape[-1]
    x = _ready(x, x, "x")
    residual = _ready(residual, x, "residual")
    if residual is not None and residual.shape != x.shape:
        raise ValueError(f"opfuse residual_norm: residual has shape {list(residual.shape)}, x {list(x.shape)}")
    vectors = []
    for name, t in (("bias", bias), ("weight", weight), ("norm_bias", norm_bias)):
        t = _ready(t, x, name)
        if t is not None and tuple(t.shape) != (hidden,):
            raise ValueError(f"opfuse residual_norm: {name} has shape {list(t.shape)}, expected [{hidden}]")
        vectors.append(t)
    return x, residual, *vectors


def _ptr(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.data_ptr()


def _outputs(x, norm, write_residual):
    y = torch.empty_like(x)
    h = torch.empty_like(x) if (write_residual and norm != "none") else x.new_empty(0)
    return y, h


_SM_COUNT: dict[int, int] = {}


def _current_stream() -> int:
    # The raw handle straight from C (torch.cuda.current_stream() builds a Python Stream object,
    # which costs several microseconds of host time per call on the GPU hosts).
    return torch._C._cuda_getCurrentRawStream(torch.cuda.current_device())


def _sm_count() -> int:
    device = torch.cuda.current_device()
    if device not in _SM_COUNT:
        _SM_COUNT[device] = torch.cuda.get_device_properties(device).multi_processor_count
    return _SM_COUNT[device]


def _peer_forward(kind: str):
    def forward(x, bias, residual, weight, norm_bias, *, norm, eps, group, write_residual):
        x, residual, bias, weight, norm_bias = _operands(x, bias, residual, weight, norm_bias)
        plan = _plan(group, kind, x.dtype, x.numel() * x.element_size())
        if isinstance(plan, str):  # the region vanished (never expected after compile): stay correct
            return reference_forward(x, bias, residual, weight, norm_bias, norm=norm, eps=eps, group=group,
                                     write_residual=write_residual)
        y, h = _outputs(x, norm, write_residual)
        hidden = x.shape[-1]
        tokens = x.numel() // hidden
        ext = extension.load()
        stream = _current_stream()
        args = (_ptr(x), _ptr(bias), _ptr(residual), _ptr(weight), _ptr(norm_bias), y.data_ptr(), _ptr(h if h.numel() else None),
                tokens, hidden, float(eps), NORMS[norm], DTYPES[x.dtype], plan.peer_region)
        if kind == "oneshot":
            ext.allreduce_oneshot(*args, _sm_count(), stream)
        else:
            world = plan.peer_region.world
            blocks = max(1, min(ext.MAX_BLOCKS, -(-tokens // world)))
            ext.allreduce_twoshot(*args, blocks, stream)
        return y, h

    return forward


oneshot_forward = _peer_forward("oneshot")
twoshot_forward = _peer_forward("twoshot")


def _local(x, bias, residual, weight, norm_bias, *, norm, eps, write_residual):
    y, h = _outputs(x, norm, write_residual)
    hidden = x.shape[-1]
    tokens = x.numel() // hidden
    extension.load().add_norm(_ptr(x), _ptr(bias), _ptr(residual), _ptr(weight), _ptr(norm_bias), y.data_ptr(),
                              _ptr(h if h.numel() else None), tokens, hidden, float(eps), NORMS[norm],
                              DTYPES[x.dtype], max(1, min(tokens, 4 * _sm_count())), _current_stream())
    return y, h


def local_forward(x, bias, residual, weight, norm_bias, *, norm, eps, group, write_residual):
    x, residual, bias, weight, norm_bias = _operands(x, bias, residual, weight, norm_bias)
    return _local(x, bias, residual, weight, norm_bias, norm=norm, eps=eps, write_residual=write_residual)


def nccl_then_kernel_forward(x, bias, residual, weight, norm_bias, *, norm, eps, group, write_residual):
    x, residual, bias, weight, norm_bias = _operands(x, bias, residual, weight, norm_bias)
    summed = x.clone()
    dist.all_reduce(summed, group=groups.from_name(group))
    if norm == "none" and bias is None and residual is None:
        # A plain all-reduce: NCCL's sum is the result; the kernel would only copy it.
        return summed, summed.new_empty(0)
    return _local(summed, bias, residual, weight, norm_bias, norm=norm, eps=eps, write_residual=write_residual)


# Backward -----------------------------------------------------------------------------------


def norm_backward(dy, h, weight, norm_bias, *, norm, eps):
    """RMSNorm: the fused kernel; LayerNorm (and unsupported layouts): the reference."""
    if norm != "rms" or dy.dtype not in DTYPES or (weight is not None and weight.dtype != dy.dtype):
        return reference_backward(dy, h, weight, norm_bias, norm=norm, eps=eps)
    dy, h = dy.contiguous(), h.contiguous()
    hidden = h.shape[-1]
    tokens = h.numel() // hidden
    blocks = max(1, min(tokens, 2 * _sm_count()))
    dh = torch.empty_like(h)
    if weight is not None:
        weight = weight.contiguous()
        dw = torch.empty_like(weight)
        partial = torch.empty(blocks, hidden, dtype=torch.float32, device=h.device)
    else:
        dw, partial = dy.new_empty(0), None
    extension.load().rms_norm_backward(dy.data_ptr(), h.data_ptr(), _ptr(weight), 0, dh.data_ptr(), _ptr(partial),
                                       _ptr(dw if weight is not None else None), tokens, hidden, float(eps),
                                       DTYPES[h.dtype], blocks, _current_stream())
    return dh, dw, dy.new_empty(0)
