"""How :func:`opfuse.graphed` records and replays one block call: CUDA graphs, or an eager
stand-in with the same buffer semantics.

A *replayer* owns a forward recording and, for training, a backward recording of one input
signature. :mod:`opfuse.graphs.graphed` drives it in a fixed order: ``warmup(step)`` (run the
block a few times outside capture: compiles the opfuse program, reserves symmetric-memory
regions, binds overlap plans, initialises NCCL communicators and cuBLAS handles), then
``capture_forward(body)``, then ``capture_backward(body)``; afterwards ``replay_forward()`` /
``replay_backward()`` per call.

``body`` callables return flat lists of tensors. After ``capture_forward`` the replayer's
``static_outputs`` are the tensors every forward replay rewrites, and ``autograd_outputs()`` the
outputs whose autograd graph the backward body differentiates; after ``capture_backward``,
``static_grads`` are the tensors every backward replay rewrites.

* :class:`CudaGraphReplayer`: ``torch.cuda.CUDAGraph`` captures sharing one memory pool (private
  unless the caller passes one), warm-up on a side stream, as
  ``torch.cuda.make_graphed_callables`` does.
* :class:`EagerReplayer`: replays by running the bodies again and copying their results into the
  static tensors. Same aliasing and lifetime rules as the CUDA graphs, any device, no capture: a
  debugging aid (does a wrong result come from capture or from the buffer plumbing?) and what the
  CPU tests use.
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence

import torch

__all__ = ["CudaGraphReplayer", "EagerReplayer", "make_replayer", "REPLAY_MODES"]

REPLAY_MODES = ("cuda_graph", "eager")

Body = Callable[[], Sequence[Optional[torch.Tensor]]]


class CudaGraphReplayer:
    """Forward and backward recorded as CUDA graphs on ``device``."""

    mode = "cuda_graph"
    #: A program compiled during capture is an error (its checks saw the capture and fell back).
    strict_programs = True

    def __init__(self, device: torch.device, pool=None):
        self.device = device
        self.pool = pool if pool is not None else torch.cuda.graph_pool_handle()
        self.forward_graph = torch.cuda.CUDAGraph()
        self.backward_graph: Optional[torch.cuda.CUDAGraph] = None
        self.static_outputs: list = []
        self.static_grads: list = []

    def warmup(self, step: Callable[[], None], iterations: int) -> None:
        # Lazy initialisation (program compile, pool reservations, NCCL communicators, cuBLAS
        # workspaces, autotuning) must happen here, not inside a capture. A side stream, as
        # torch.cuda.make_graphed_callables uses, keeps the warm-up off the caller's stream.
        torch.cuda.synchronize(self.device)
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for _ in range(iterations):
                step()
        torch.cuda.current_stream(self.device).wait_stream(stream)
        torch.cuda.synchronize(self.device)

    def capture_forward(self, body: Body) -> list:
        with torch.cuda.graph(self.forward_graph, pool=self.pool):
            outputs = list(body())
        self.static_outputs = outputs
        return outputs

    def autograd_outputs(self) -> list:
        return self.static_outputs

    def capture_backward(self, body: Body) -> list:
        # Same pool, captured after the forward: the backward graph reads the activations the
        # forward graph writes, and its temporaries may reuse memory the capture freed, which is
        # safe because replays run in capture order (forward, then backward).
        self.backward_graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.backward_graph, pool=self.pool):
            grads = list(body())
        self.static_grads = grads
        return grads

    def replay_forward(self) -> None:
        self.forward_graph.replay()

    def replay_backward(self) -> None:
        self.backward_graph.replay()


class EagerReplayer:
    """Replays by re-running the bodies (no CUDA graph); see the module docstring."""

    mode = "eager"
    strict_programs = False  # nothing is captured: a recompile is only slower

    def __init__(self, device: torch.device, pool=None):
        self.device = device
        self._forward: Optional[Body] = None
        self._backward: Optional[Body] = None
        self._live: list = []
        self._grad_mode = False
        self.static_outputs: list = []
        self.static_grads: list = []

    def warmup(self, step: Callable[[], None], iterations: int) -> None:
        for _ in range(iterations):
            step()

    def capture_forward(self, body: Body) -> list:
        # Replays run inside autograd.Function.forward (grad disabled): re-enter the capture's mode.
        self._grad_mode = torch.is_grad_enabled()
        self._forward = body
        self._live = list(body())
        self.static_outputs = [_own(t) for t in self._live]
        return self.static_outputs

    def autograd_outputs(self) -> list:
        return self._live

    def capture_backward(self, body: Body) -> list:
        self._backward = body
        self.static_grads = [_own(g) for g in body()]
        return self.static_grads

    def replay_forward(self) -> None:
        with torch.set_grad_enabled(self._grad_mode):
            self._live = list(self._forward())
        _copy_into(self.static_outputs, self._live)

    def replay_backward(self) -> None:
        _copy_into(self.static_grads, self._backward())


def _own(t: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    return None if t is None else t.detach().clone()


def _copy_into(static: list, fresh: Sequence[Optional[torch.Tensor]]) -> None:
    with torch.no_grad():
        for dst, src in zip(static, fresh):
            if dst is not None:
                dst.copy_(src)


def make_replayer(mode: str, device: torch.device, pool=None):
    if mode == "cuda_graph":
        return CudaGraphReplayer(device, pool)
    if mode == "eager":
        return EagerReplayer(device, pool)
    raise ValueError(f"opfuse.graphed: replay={mode!r}; accepted: {', '.join(map(repr, REPLAY_MODES))}")
