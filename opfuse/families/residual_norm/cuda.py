"""CUDA implementations of the residual-norm fused ops (module ``_opfuse_residual_norm``, sources
in ``csrc/``).

========================  =========================================================  ==================
implementation            what runs                                                  when capable
========================  =========================================================  ==================
``cuda_oneshot``          one kernel: Lamport push of x to every peer, reduce, add,  message <= OPFUSE_ONESHOT_MAX_BYTES
                          norm
``cuda_twoshot_lamport``  one kernel: pipelined two-shot over Lamport buffers (rows  message <= OPFUSE_TWOSHOT_MAX_BYTES
                          pushed a step ahead of their reduction, sums pushed as
                          they are rounded, no flags or fences), add, norm
``cuda_twoshot``          one kernel: reduce-scatter rows, all-gather sums (flags    message <= OPFUSE_TWOSHOT_MAX_BYTES
                          per block and stage), add, norm
``nccl+cuda``             NCCL all-reduce, then the fused single-GPU add+norm kernel any CUDA group
``cuda``                  single GPU: the fused add+norm kernel (``add_*norm`` ops)  CUDA
========================  =========================================================  ==================

With ``opfuse.config.pdl`` (``OPFUSE_PDL=1``) the peer kernels launch with programmatic dependent
launch (PDL: their launch overlaps the tail of the kernel before them; they read nothing before the
grid-dependency wait).

Peer buffers are regions of the group's :class:`~opfuse.runtime.symm_pool.SymmetricPool`:
the checks only ask whether a region would fit; ``prepare`` (the chosen implementation, every
rank, in program order) reserves and initialises it; a call only looks it up. Backward of every
variant: the fused RMSNorm / LayerNorm backward kernels (:func:`norm_backward`). The message limits
that pick between them (by world size and row size) are in :mod:`.crossovers`.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist

from ...config import config, parse_force_impl
from ...ops import group as groups
from ...ops.base import dtype_name
from ...runtime import extension, peer_watch, symm_pool
from ...runtime.device import current_stream, device_name, is_capturing, sm_count
from . import crossovers, reference

__all__ = ["check_oneshot", "check_twoshot", "check_lamport", "check_nccl_then_kernel", "check_local",
           "prepare_oneshot", "prepare_twoshot", "prepare_lamport", "oneshot_forward", "twoshot_forward",
           "lamport_forward", "nccl_then_kernel_forward", "local_forward", "norm_backward", "one_dtype_reason",
           "operands", "peer_launch", "ptr", "SUPPORTED_DTYPES", "FAMILY", "KINDS"]

FAMILY = "residual_norm"
#: The fused ops the peer kernels run (a kernel records its op's index here on a timeout).
_PEER_OPS = ("allreduce", "allreduce_add_rmsnorm", "allreduce_add_layernorm", "allreduce_add_rmsnorm_quantize")
#: The fused op of each norm kind, without an FP8 epilogue.
_NORM_OPS = {"none": "allreduce", "rms": "allreduce_add_rmsnorm", "layer": "allreduce_add_layernorm"}
SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
#: The peer kernels: one-shot, pipelined Lamport two-shot, flag-based two-shot.
KINDS = ("oneshot", "lamport", "twoshot")
_MIN_CAPACITY = {"oneshot": 256 << 10, "twoshot": 8 << 20, "lamport": 1 << 20}


def oneshot_limit(world: int, row_bytes: int = 0, gpu: str | None = None) -> int:
    """Largest message the one-shot kernel takes at ``world`` ranks with rows of ``row_bytes`` on GPU
    ``gpu`` (``OPFUSE_ONESHOT_MAX_BYTES``, else the crossover table; 0: none)."""
    if config.oneshot_max_bytes:
        return config.oneshot_max_bytes
    return crossovers.table().limits(world, row_bytes, gpu).oneshot_max


def twoshot_limit(world: int, row_bytes: int, gpu: str | None = None) -> int | None:
    """Largest message the two-shot kernel takes (``OPFUSE_TWOSHOT_MAX_BYTES``, else the crossover
    table; None: no limit); larger ones go to NCCL + the local kernel."""
    if config.twoshot_max_bytes:
        return config.twoshot_max_bytes
    return crossovers.table().limits(world, row_bytes, gpu).twoshot_max


def lamport_limit(world: int, row_bytes: int, gpu: str | None = None) -> int | None:
    """Largest message the pipelined Lamport two-shot takes: the crossover table's ``lamport_max``
    (0: never, None: no limit), bounded by ``OPFUSE_TWOSHOT_MAX_BYTES`` when that is set (a setting
    never turns on a kernel the table keeps off: force it with ``OPFUSE_FORCE_IMPL``)."""
    limit = crossovers.table().limits(world, row_bytes, gpu).lamport_max
    if config.twoshot_max_bytes and limit != 0:
        return config.twoshot_max_bytes if limit is None else min(limit, config.twoshot_max_bytes)
    return limit


# Capability checks (pure) ---------------------------------------------------------------------


def one_dtype_reason(spec) -> str | None:
    """Why a kernel of this family cannot take ``spec``'s device and dtypes (one CUDA dtype for the
    activations and every parameter), or ``None``."""
    if spec.device.type != "cuda":
        return "needs a CUDA device"
    if spec.dtype not in SUPPORTED_DTYPES:
        return f"dtype {dtype_name(spec.dtype)} not supported (float32, bfloat16, float16)"
    for name in ("residual", "bias", "weight", "norm_bias"):
        meta = spec.inputs.get(name)
        if meta is not None and meta.dtype != spec.dtype:
            return f"{name} is {dtype_name(meta.dtype)}, input is {dtype_name(spec.dtype)} (kernels take one dtype)"
    return None


def _row_reason(hidden: int, dtype: torch.dtype) -> str | None:
    """Why rows of ``hidden`` elements do not suit the packed-row kernels, or ``None``."""
    element = torch.empty((), dtype=dtype).element_size()
    if hidden * element % 16:
        return f"hidden size {hidden} x {element} bytes is not a multiple of 16 bytes"
    if hidden * element > 128 * 1024:
        return f"hidden size {hidden} exceeds the kernels' 128 KiB rows"
    return None


def _kernel_reason(spec) -> str | None:
    reason = one_dtype_reason(spec)
    if reason:
        return reason
    reason = _row_reason(spec.x.features, spec.dtype)
    if reason:
        return reason
    try:
        extension.load(FAMILY)
    except extension.ExtensionUnavailable as error:
        return f"CUDA extension unavailable: {error}"
    return None


def _capacity(kind: str, message: int) -> int:
    """Regions come in power-of-two size classes, so programs of similar sizes share one."""
    capacity = _MIN_CAPACITY[kind]
    while capacity < message:
        capacity *= 2
    return capacity


def _region_name(kind: str, dtype: torch.dtype, capacity: int) -> str:
    return f"residual_norm/{kind}/{dtype_name(dtype)}/{capacity}"


def _region_bytes(kind: str, world: int, capacity: int) -> int:
    ext = extension.load(FAMILY)
    return getattr(ext, f"{kind}_region_bytes")(world, capacity)


def _forced(op: str, impl: str) -> bool:
    """``OPFUSE_FORCE_IMPL`` names ``impl`` for fused op ``op`` (or as a bare name)."""
    forced = parse_force_impl(config.force_impl)
    return forced.get(op, forced.get(None)) == impl


def _check_peer(kind: str, limit):
    def check(spec) -> str | None:
        reason = _kernel_reason(spec)
        if reason:
            return reason
        message = spec.x.nbytes
        row_bytes = spec.x.features * torch.empty((), dtype=spec.dtype).element_size()
        most = limit(spec.world_size, row_bytes, device_name(spec.device))
        if kind == "lamport" and _forced(spec.op, "cuda_twoshot_lamport"):
            most = None  # forced, it runs at any size it holds, also where the table keeps it off (unmeasured)
        if most is not None and message > most:
            setting = "OPFUSE_ONESHOT_MAX_BYTES" if kind == "oneshot" else "OPFUSE_TWOSHOT_MAX_BYTES"
            if most == 0:
                override = f"{setting} overrides it" if kind != "lamport" else "OPFUSE_FORCE_IMPL forces it"
                return (f"the {kind} kernel is not used at world {spec.world_size} with {row_bytes}-byte rows (limit 0 "
                        f"in the crossover table; {override})")
            return (f"message of {message} bytes exceeds the {kind} limit of {most} bytes ({setting}; automatic "
                    f"when 0: by world size and row size, here world {spec.world_size}, {row_bytes}-byte rows)")
        if spec.world_size > extension.load(FAMILY).MAX_WORLD:
            return f"world size {spec.world_size} > {extension.load(FAMILY).MAX_WORLD}"
        if (spec.group_name, spec.device.index, kind, spec.dtype, _capacity(kind, message)) in _plans:
            return None
        pool, why = symm_pool.lookup(spec.group_name, spec.device)
        if pool is None:
            return f"no peer memory: {why}"
        capacity = _capacity(kind, message)
        size = _region_bytes(kind, spec.world_size, capacity)
        if not pool.can_reserve_all([(_region_name(kind, spec.dtype, capacity), size)]):
            return (f"symmetric pool cannot hold {size >> 20} MiB more (OPFUSE_SYMM_POOL_MB={config.symm_pool_mb}, "
                    f"OPFUSE_SYMM_POOL_MAX_MB={config.symm_pool_max_mb}"
                    + (", or a CUDA-graph capture is in progress)" if is_capturing() else ")"))
        return None

    return check


check_oneshot = _check_peer("oneshot", oneshot_limit)
check_twoshot = _check_peer("twoshot", twoshot_limit)
check_lamport = _check_peer("lamport", lamport_limit)


def check_nccl_then_kernel(spec) -> str | None:
    reason = _kernel_reason(spec)
    if reason:
        return reason
    if dist.get_backend(groups.from_name(spec.group_name)) != "nccl":
        return "group backend is not NCCL"
    return None


def check_local(spec) -> str | None:
    return _kernel_reason(spec)


# Peer regions (prepared at compile time, looked up per call) ----------------------------------------


@dataclasses.dataclass
class _PeerPlan:
    region: object          # the pool Region
    peer_region: object     # _opfuse_residual_norm.PeerRegion
    peers: torch.Tensor     # device array of peer addresses (kept alive)
    capacity: int
    watch: peer_watch.PeerWatch  # the bound on its waits, checked before every launch


_plans: dict[tuple, _PeerPlan] = {}


def _prepare_peer(kind: str):
    def prepare(spec) -> None:
        capacity = _capacity(kind, spec.x.nbytes)
        device = spec.device.index
        key = (spec.group_name, device, kind, spec.dtype, capacity)
        if key in _plans:
            return
        pool, why = symm_pool.lookup(spec.group_name, spec.device)
        ext = extension.load(FAMILY)
        size = _region_bytes(kind, spec.world_size, capacity)
        region = pool.reserve(_region_name(kind, spec.dtype, capacity), size) if pool is not None else None
        if region is None:  # the check said it fits: a bug, not a fallback
            raise RuntimeError(f"residual_norm {kind}: reserving {size} bytes failed after the check passed ({why})")
        peers = torch.tensor(region.peer_ptrs(), dtype=torch.int64, device=torch.device("cuda", device))
        peer_region = ext.PeerRegion(peers.data_ptr(), region.local_ptr(), pool.rank, pool.world_size, size, capacity)
        stream = current_stream()
        if kind == "twoshot":
            ext.twoshot_init(peer_region, stream)
        else:  # one-shot and Lamport two-shot: zeroed state, sentinel-filled buffers
            getattr(ext, f"{kind}_init")(peer_region, ext.DTYPES[dtype_name(spec.dtype)], stream)
        with torch.cuda.device(device):
            record = ext.PeerWatch()
        watch = peer_watch.PeerWatch(record, _PEER_OPS, ext.PEER_WAIT_SITES,
                                     dist.get_process_group_ranks(pool.group),
                                     f"residual_norm {kind} region of group {spec.group_name!r}")
        # Every rank's buffers must hold their initial state before any peer pushes into them.
        torch.cuda.synchronize()
        dist.barrier(group=pool.group)
        _plans[key] = _PeerPlan(region, peer_region, peers, capacity, watch)

    return prepare


prepare_oneshot = _prepare_peer("oneshot")
prepare_twoshot = _prepare_peer("twoshot")
prepare_lamport = _prepare_peer("lamport")


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


def operands(x, bias, residual, weight, norm_bias):
    """``(x, residual, bias, weight, norm_bias)`` validated for the kernels (copied where their
    layout does not suit them)."""
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


def ptr(t: torch.Tensor | None) -> int:
    """The device address of ``t`` (0 for ``None``: an absent kernel operand)."""
    return 0 if t is None else t.data_ptr()


def _outputs(x, norm, write_residual):
    y = torch.empty_like(x)
    h = torch.empty_like(x) if (write_residual and norm != "none") else x.new_empty(0)
    return y, h


def peer_launch(kind: str, x, bias, residual, weight, norm_bias, eps, group, y, h, *, norm, op, epilogue=None):
    """Launch ``kind``'s (:data:`KINDS`) kernel on operands from :func:`operands`
    into ``y`` and ``h`` (empty: not written) with the optional FP8 ``epilogue``
    (``Fp8Epilogue``; then ``y`` is ``None``); ``op`` names the fused op on a timeout."""
    plan = _plans.get((group, x.device.index, kind, x.dtype, _capacity(kind, x.numel() * x.element_size())))
    if plan is None:
        raise RuntimeError(f"residual_norm {kind}: no peer region for group {group!r} and {tuple(x.shape)} "
                           f"{dtype_name(x.dtype)}; the program that chose this implementation prepares it")
    watch = plan.watch
    watch.check()  # a wait of an earlier call timed out: the region is out of step with the peers
    hidden = x.shape[-1]
    tokens = x.numel() // hidden
    if tokens == 0:  # the kernels launch nothing for no rows (and empty tensors have no address)
        return
    ext = extension.load(FAMILY)
    args = (ptr(x), ptr(bias), ptr(residual), ptr(weight), ptr(norm_bias), ptr(y),
            ptr(h if h.numel() else None), tokens, hidden, float(eps), ext.NORMS[norm],
            ext.DTYPES[dtype_name(x.dtype)], plan.peer_region, watch.flag, watch.address,
            peer_watch.timeout_ns(), _PEER_OPS.index(op))
    if kind == "twoshot":  # flag slots per block: the grid is the same on every rank
        grid = max(1, min(ext.MAX_BLOCKS, -(-tokens // plan.peer_region.world)))
    else:  # a bound on the grid (the same on every rank: same GPU kind)
        grid = sm_count()
    if epilogue is None:
        getattr(ext, f"allreduce_{kind}")(*args, grid, current_stream(), config.pdl)
    else:
        getattr(ext, f"allreduce_{kind}_fp8")(epilogue, *args, grid, current_stream(), config.pdl)


def _peer_forward(kind: str):
    def forward(x, bias, residual, weight, norm_bias, eps, group, write_residual, *, norm):
        x, residual, bias, weight, norm_bias = operands(x, bias, residual, weight, norm_bias)
        y, h = _outputs(x, norm, write_residual)
        peer_launch(kind, x, bias, residual, weight, norm_bias, eps, group, y, h, norm=norm, op=_NORM_OPS[norm])
        return y, h

    return forward


oneshot_forward = _peer_forward("oneshot")
twoshot_forward = _peer_forward("twoshot")
lamport_forward = _peer_forward("lamport")


def _local(x, bias, residual, weight, norm_bias, *, norm, eps, write_residual):
    y, h = _outputs(x, norm, write_residual)
    hidden = x.shape[-1]
    tokens = x.numel() // hidden
    ext = extension.load(FAMILY)
    ext.add_norm(ptr(x), ptr(bias), ptr(residual), ptr(weight), ptr(norm_bias), y.data_ptr(),
                 ptr(h if h.numel() else None), tokens, hidden, float(eps), ext.NORMS[norm],
                 ext.DTYPES[dtype_name(x.dtype)], max(1, min(tokens, 4 * sm_count())), current_stream())
    return y, h


def local_forward(x, bias, residual, weight, norm_bias, eps, group, write_residual, *, norm):
    x, residual, bias, weight, norm_bias = operands(x, bias, residual, weight, norm_bias)
    return _local(x, bias, residual, weight, norm_bias, norm=norm, eps=eps, write_residual=write_residual)


def nccl_then_kernel_forward(x, bias, residual, weight, norm_bias, eps, group, write_residual, *, norm):
    x, residual, bias, weight, norm_bias = operands(x, bias, residual, weight, norm_bias)
    summed = x.clone()
    dist.all_reduce(summed, group=groups.from_name(group))
    if norm == "none" and bias is None and residual is None:
        # A plain all-reduce: NCCL's sum is the result; the kernel would only copy it.
        return summed, summed.new_empty(0)
    return _local(summed, bias, residual, weight, norm_bias, norm=norm, eps=eps, write_residual=write_residual)


# Backward -----------------------------------------------------------------------------------


def _backward_reason(dy, h, dh_out, weight, norm_bias, norm) -> str | None:
    """Why the backward kernels cannot take these operands (the reference then runs), or ``None``."""
    if dy is None or h.numel() == 0:
        return "no output gradient" if dy is None else "no rows"
    if h.dtype not in SUPPORTED_DTYPES:
        return f"dtype {dtype_name(h.dtype)} not supported"
    for name, t in (("dy", dy), ("dh_out", dh_out), ("weight", weight), ("norm_bias", norm_bias)):
        if t is not None and (t.dtype != h.dtype or t.device != h.device):
            return f"{name} is {dtype_name(t.dtype)} on {t.device}, h is {dtype_name(h.dtype)} on {h.device}"
    if norm == "rms":  # the LayerNorm kernel takes any row (a scalar kernel for unpacked ones)
        return _row_reason(h.shape[-1], h.dtype)
    return None


def norm_backward(dy, h, dh_out, weight, norm_bias, eps, *, norm):
    """The fused norm backward kernels: ``(dh, dweight, dnorm_bias)`` (the latter two empty when
    absent), with ``dh_out`` (the gradient reaching ``h`` from its other use) added in float32
    and ``dh`` rounded once. RMSNorm needs rows of whole 16-byte packs; LayerNorm takes any row.
    Operands the kernels cannot take (mixed dtypes, no rows, other norms) get the reference."""
    if norm not in ("rms", "layer") or _backward_reason(dy, h, dh_out, weight, norm_bias, norm):
        return reference.backward(dy, h, dh_out, weight, norm_bias, eps, norm=norm)
    dy, h = dy.contiguous(), h.contiguous()
    dh_out = None if dh_out is None else dh_out.contiguous()
    weight = None if weight is None else weight.contiguous()
    hidden = h.shape[-1]
    tokens = h.numel() // hidden
    blocks = max(1, min(tokens, 2 * sm_count()))
    dh = torch.empty_like(h)
    dw = torch.empty_like(weight) if weight is not None else None
    ext = extension.load(FAMILY)
    code = ext.DTYPES[dtype_name(h.dtype)]
    if norm == "rms":
        partial = torch.empty(blocks, hidden, dtype=torch.float32, device=h.device) if weight is not None else None
        ext.rms_norm_backward(dy.data_ptr(), h.data_ptr(), ptr(weight), ptr(dh_out), dh.data_ptr(), ptr(partial),
                              ptr(dw), tokens, hidden, float(eps), code, blocks, current_stream())
        return dh, _or_empty(dw, dy), dy.new_empty(0)
    db = torch.empty_like(norm_bias) if norm_bias is not None else None
    asked = dw is not None or db is not None
    partial = torch.empty(2, blocks, hidden, dtype=torch.float32, device=h.device) if asked else None
    ext.layer_norm_backward(dy.data_ptr(), h.data_ptr(), ptr(weight), ptr(dh_out), dh.data_ptr(), ptr(partial),
                            ptr(dw), ptr(db), tokens, hidden, float(eps), code, blocks, current_stream())
    return dh, _or_empty(dw, dy), _or_empty(db, dy)


def _or_empty(t: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor:
    return like.new_empty(0) if t is None else t
