"""The baselines of bench/block.py: the same MLP block in torch.nn style with torch.distributed
collectives (Megatron's f/g autograd functions, the sequence-parallel gather and scatter), and the
accounting of Inductor's async tensor parallelism for the torch.compile variant."""

from __future__ import annotations

import contextlib
import logging

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from opfuse import ops
from opfuse.ops import collectives

EPS = 1e-6


# The torch baselines --------------------------------------------------------------------------------

def _wait(t):
    return torch.ops._c10d_functional.wait_tensor(t)


class _SumFn(torch.autograd.Function):  # "g": all-reduce forward, identity backward
    @staticmethod
    def forward(ctx, x, name):
        return _wait(torch.ops._c10d_functional.all_reduce(x.contiguous(), "sum", name))

    @staticmethod
    def backward(ctx, dy):
        return dy, None


class _CopyFn(torch.autograd.Function):  # "f": identity forward, all-reduce backward
    @staticmethod
    def forward(ctx, x, name):
        ctx.name = name
        return x.view_as(x)

    @staticmethod
    def backward(ctx, dy):
        return _wait(torch.ops._c10d_functional.all_reduce(dy.contiguous(), "sum", ctx.name)), None


class _GatherFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, world, name):
        ctx.world, ctx.name = world, name
        return _wait(torch.ops._c10d_functional.all_gather_into_tensor(x.contiguous(), world, name))

    @staticmethod
    def backward(ctx, dy):
        return _wait(torch.ops._c10d_functional.reduce_scatter_tensor(dy.contiguous(), "sum", ctx.world,
                                                                      ctx.name)), None, None


class _ScatterFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, world, name):
        ctx.world, ctx.name = world, name
        return _wait(torch.ops._c10d_functional.reduce_scatter_tensor(x.contiguous(), "sum", world, name))

    @staticmethod
    def backward(ctx, dy):
        return _wait(torch.ops._c10d_functional.all_gather_into_tensor(dy.contiguous(), ctx.world,
                                                                       ctx.name)), None, None


class TorchBlock(nn.Module):
    """The block in plain torch over the opfuse block's parameters. ``functional``: functional
    collectives (traceable by torch.compile); else torch.distributed's eager NCCL calls."""

    def __init__(self, block: ops.Sequential, act: str, sp: bool, functional: bool):
        super().__init__()
        self.n1 = block[0].weight
        if act == "gelu":
            self.w1, self.b1 = block[1].weight, block[1].bias
        else:  # separate gate and up projections, as Hugging Face's LlamaMLP runs them (two GEMMs)
            self.gate = (block[1].gate_weight, block[1].gate_bias)
            self.up = (block[1].up_weight, block[1].up_bias)
        self.w2, self.b2, self.n2 = block[3].weight, block[3].bias, block[6].weight
        self.act, self.sp, self.functional = act, sp, functional
        self.world, self.name = dist.get_world_size(), dist.group.WORLD.group_name

    def _comm(self, kind, x):
        if self.functional:
            if kind in ("gather", "scatter"):
                return (_GatherFn if kind == "gather" else _ScatterFn).apply(x, self.world, self.name)
            return (_CopyFn if kind == "copy" else _SumFn).apply(x, self.name)
        return {"gather": collectives.all_gather, "scatter": collectives.reduce_scatter,
                "copy": collectives.grad_all_reduce, "sum": collectives.all_reduce}[kind](x, None)

    def forward(self, x, res):
        hidden = x.shape[-1]
        h = self._comm("gather" if self.sp else "copy", F.rms_norm(x, (hidden,), self.n1, EPS))
        # Compiled: the bias as its own add, so Inductor's async-TP matcher sees a plain mm after the
        # all-gather (an addmm is not matched, and bf16 addmm stays fused in recent Inductor); the
        # add fuses into the activation kernel. Eager: what nn.Linear runs (addmm).
        linear = (lambda t, w, b: F.linear(t, w) + b) if self.functional else F.linear
        if self.act == "gelu":
            a = F.gelu(linear(h, self.w1, self.b1), approximate="tanh")
        else:
            a = F.silu(linear(h, *self.gate)) * linear(h, *self.up)
        r = self._comm("scatter" if self.sp else "sum", F.linear(a, self.w2)) + self.b2 + res
        return F.rms_norm(r, (hidden,), self.n2, EPS), r


# Async-TP accounting --------------------------------------------------------------------------------------

class AsyncTP:
    """Turns on Inductor's micro-pipeline TP and counts the collectives it fuses (by wrapping the
    post-grad pass; compile caches are bypassed while counting, else a cached graph skips it)."""

    def __init__(self):
        self.fused = {"all_gather+mm": 0, "mm+reduce_scatter": 0}
        self.candidates = {"all_gather": 0, "reduce_scatter": 0}
        self.note = None
        try:
            from torch.distributed import _symmetric_memory as symm_mem
            from torch._inductor import config as inductor_config
            from torch._inductor.fx_passes import micro_pipeline_tp, post_grad

            enable = getattr(symm_mem, "enable_symm_mem_for_group", None)
            if enable is not None:
                enable(dist.group.WORLD.group_name)
            inductor_config._micro_pipeline_tp = True
            original = post_grad.micro_pipeline_tp_pass

            def counting(graph):
                try:  # the patterns the pass looks at (whether or not it then fuses them)
                    self.candidates["all_gather"] += len(micro_pipeline_tp.find_all_gather_patterns(graph))
                    self.candidates["reduce_scatter"] += len(micro_pipeline_tp.find_reduce_scatter_patterns(graph))
                except Exception:  # noqa: BLE001 - diagnostics only
                    pass
                original(graph)
                for node in graph.nodes:
                    name = str(node.target)
                    if "fused_all_gather_matmul" in name:
                        self.fused["all_gather+mm"] += 1
                    elif "fused_matmul_reduce_scatter" in name:
                        self.fused["mm+reduce_scatter"] += 1

            post_grad.micro_pipeline_tp_pass = counting
        except Exception as error:  # noqa: BLE001 - report, compile without it
            self.note = f"async TP unavailable: {type(error).__name__}: {error}"
        logging.getLogger("torch._inductor.fx_passes.micro_pipeline_tp").setLevel(logging.ERROR)

    @staticmethod
    def uncached():
        stack = contextlib.ExitStack()
        from torch._inductor import config as inductor_config

        stack.enter_context(inductor_config.patch(fx_graph_cache=False))
        try:
            from torch._functorch import config as functorch_config

            if hasattr(functorch_config, "enable_autograd_cache"):
                stack.enter_context(functorch_config.patch(enable_autograd_cache=False))
        except Exception:  # noqa: BLE001
            pass
        return stack
