"""FlashInfer's fused all-reduce + residual + RMSNorm over a process group, with the workspace in
torch symmetric memory, configured as vLLM runs it on Hopper.

The kernel reads a device array of ``3 * world + 1`` pointers:

  [0, W)       two-shot buffers, one per rank: the kernel copies its input there and writes the
               reduced rows after it, so each holds two messages
  [W, 2W)      barrier flags of the two-shot kernel, one per rank: ``256 * W`` int32, zero
  [2W, 3W)     Lamport buffers of the one-shot kernel, one per rank: three rotating buffers of
               ``comm_size`` bytes (W slots of one message each), every 16-bit element -0.0
  3W           this rank's control words (int32, local memory): completed-block counter,
               two-shot flag, Lamport buffer index, ``comm_size`` in bytes, elements to clear

Settings as vLLM's compilation pass passes them on compute capability 9.0
(vllm/compilation/passes/fusion/allreduce_rms_fusion.py, read 2026-11): float32 accumulation,
PDL on, completion triggered at the end of the kernel, one-shot up to 32 MiB per rank at world 2,
2 MiB at world 4 and 0.5 MiB at world 8 (two-shot above), and the fused path used at all only up
to 64 / 2 / 0.5 MiB (vLLM runs its unfused path above; the bench times the kernel anyway).
"""

from __future__ import annotations

import ctypes

import torch
import torch.distributed as dist

from . import build

__all__ = ["FlashInferFusion", "WORLDS", "vllm_uses_oneshot", "vllm_fuses"]

MiB = 1 << 20
WORLDS = (2, 4, 8)  # the world sizes fiar.cu instantiates (FlashInfer also has 16)
_BARRIER_FLAGS = 256  # FlashInfer's kBarrierFlagCount
_ONESHOT_MAX = {2: 32 * MiB, 4: 2 * MiB, 8: MiB // 2}
_FUSED_MAX = {2: 64 * MiB, 4: 2 * MiB, 8: MiB // 2}
_DTYPES = {torch.bfloat16: 1, torch.float16: 2}


def vllm_uses_oneshot(message_bytes: int, world: int) -> bool:
    return message_bytes <= _ONESHOT_MAX[world]


def vllm_fuses(message_bytes: int, world: int) -> bool:
    """Whether vLLM would call the fused kernel at all for this message (else NCCL + its norm)."""
    return message_bytes <= _FUSED_MAX[world]


def _align(n: int, to: int = 256) -> int:
    return (n + to - 1) // to * to


class _SymmetricBuffer:
    """``nbytes`` of torch symmetric memory on every rank of ``group``, and every rank's address."""

    def __init__(self, nbytes: int, group, device: torch.device):
        from torch.distributed import _symmetric_memory as symm_mem

        self.tensor = symm_mem.empty(nbytes, dtype=torch.uint8, device=device)
        self.handle = symm_mem.rendezvous(self.tensor, group.group_name)
        rank = dist.get_rank(group)
        # torch may place the tensor inside a larger symmetric allocation: buffer_ptrs are the
        # allocations' bases, at the same offset on every rank.
        offset = self.tensor.data_ptr() - self.handle.buffer_ptrs[rank]
        self.ptrs = [base + offset for base in self.handle.buffer_ptrs]


class FlashInferFusion:
    """``norm_out, residual_out <- rmsnorm(all_reduce(x) + residual)`` with FlashInfer's kernel.

    ``max_message_bytes``: the largest ``x`` (bytes per rank) any call passes. Collective: every
    rank of ``group`` constructs it at the same point and calls it with the same shapes.
    """

    def __init__(self, group, max_message_bytes: int, device: torch.device | None = None):
        self.world = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        if self.world not in WORLDS:
            raise build.FlashInferUnavailable(f"world size {self.world} not supported (FlashInfer: 2, 4, 8, 16; "
                                              f"the bench binding: {', '.join(map(str, WORLDS))})")
        self._lib = build.load()
        device = device or torch.device("cuda", torch.cuda.current_device())
        self.max_message = max_message_bytes
        self.oneshot_max = min(_ONESHOT_MAX[self.world], max_message_bytes)
        self.comm_size = _align(self.world * self.oneshot_max)
        self._twoshot = _SymmetricBuffer(_align(2 * max_message_bytes), group, device)
        self._flags = _SymmetricBuffer(_align(_BARRIER_FLAGS * self.world * 4), group, device)
        self._lamport = _SymmetricBuffer(3 * self.comm_size, group, device)
        self._flags.tensor.zero_()
        self._lamport.tensor.view(torch.int16).fill_(-0x8000)  # 0x8000: -0.0 in bfloat16 and float16
        self._control = torch.zeros(8, dtype=torch.int32, device=device)
        self._control[3] = self.comm_size
        pointers = self._twoshot.ptrs + self._flags.ptrs + self._lamport.ptrs + [self._control.data_ptr()]
        self.workspace = torch.tensor(pointers, dtype=torch.int64, device=device)
        # Every rank's buffers must hold their initial state before any peer writes into them.
        torch.cuda.synchronize(device)
        dist.barrier(group=group)

    def can_run(self, tokens: int, message_bytes: int, oneshot: bool) -> str | None:
        """Why a call of this size cannot run on this workspace, or None."""
        if message_bytes > self.max_message:
            return f"message of {message_bytes} bytes exceeds the workspace's {self.max_message}"
        if oneshot and self.world * message_bytes > self.comm_size:
            return f"one-shot needs {self.world * message_bytes} bytes of Lamport slots, has {self.comm_size}"
        if not oneshot and tokens <= self.world:
            return f"two-shot needs more tokens than ranks ({tokens} <= {self.world})"
        return None

    def __call__(self, x: torch.Tensor, residual: torch.Tensor, gamma: torch.Tensor, eps: float,
                 norm_out: torch.Tensor, residual_out: torch.Tensor, oneshot: bool | None = None,
                 pdl: bool = True) -> None:
        """One fused call on the current stream; ``oneshot=None`` applies vLLM's choice."""
        hidden = x.shape[-1]
        tokens = x.numel() // hidden
        message = x.numel() * x.element_size()
        if oneshot is None:
            oneshot = vllm_uses_oneshot(message, self.world)
        for name, t in (("x", x), ("residual", residual), ("norm_out", norm_out), ("residual_out", residual_out)):
            if t.shape != x.shape or t.dtype != x.dtype or not t.is_contiguous():
                raise ValueError(f"flashinfer fusion: {name} must be contiguous {x.dtype} {list(x.shape)}, got "
                                 f"{t.dtype} {list(t.shape)}")
        if x.dtype not in _DTYPES or gamma.dtype != x.dtype or gamma.shape != (hidden,):
            raise ValueError(f"flashinfer fusion: x and gamma [{hidden}] must be one of bfloat16/float16, got "
                             f"{x.dtype} and {gamma.dtype} {list(gamma.shape)}")
        why = self.can_run(tokens, message, oneshot)
        if why:
            raise ValueError(f"flashinfer fusion: {why}")
        stream = torch.cuda.current_stream().cuda_stream
        error = self._lib.opfuse_fiar_residual_rmsnorm(
            _DTYPES[x.dtype], self.world, self.rank, tokens, hidden, self.workspace.data_ptr(), x.data_ptr(),
            residual.data_ptr(), residual_out.data_ptr(), norm_out.data_ptr(), gamma.data_ptr(), ctypes.c_float(eps),
            int(oneshot), int(pdl), 1, ctypes.c_void_p(stream))
        if error:
            raise RuntimeError(error.decode())
