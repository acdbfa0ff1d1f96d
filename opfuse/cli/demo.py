"""``python -m opfuse demo``: a tensor-parallel MLP block, forward and backward, checked against
the unsharded float64 reference; ``python -m opfuse dump`` prints its graphs before/after fusion.

The block: RMSNorm -> column Linear -> GELU -> row Linear -> + residual -> RMSNorm,
returned as ``(y, new_residual)``. Every rank builds the same full weights from one seed, loads
its shard, and compares its outputs and gradients with the single-process reference.
"""

from __future__ import annotations

import dataclasses
import math
import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F

import opfuse
from opfuse import ops

from .args import Parser, positive_int
from .launch import default_backend, run_here_or_spawn, torchrun_backend, torchrun_world

__all__ = ["build_block", "main_demo", "main_dump"]


@dataclasses.dataclass
class DemoOptions:
    world: int
    backend: str
    tokens: int
    hidden: int
    ffn: int
    dtype: str
    sequence_parallel: bool
    fmt: str = "python"
    output: str | None = None


def build_block(hidden: int, ffn: int, *, sequence_parallel: bool = False, group=None, dtype=None, device=None):
    """The demo MLP block as an ``ops.Sequential``; call it as ``y, residual = block(x, residual)``."""
    kw = dict(dtype=dtype, device=device)
    return ops.Sequential(
        ops.RMSNorm(hidden, **kw),
        ops.Linear(hidden, ffn, parallel="column", sequence_parallel=sequence_parallel, group=group, **kw),
        ops.GELU(),
        ops.Linear(ffn, hidden, parallel="row", sequence_parallel=sequence_parallel, group=group, **kw),
        ops.AddExtraInput(),
        ops.MakeExtraOutput(),
        ops.RMSNorm(hidden, **kw),
    )


def _full(opts: DemoOptions) -> dict:
    g = torch.Generator().manual_seed(20261122)
    rnd = lambda *shape: torch.randn(*shape, generator=g, dtype=torch.float64)  # noqa: E731
    return {
        "n1": 1 + 0.1 * rnd(opts.hidden), "w1": rnd(opts.ffn, opts.hidden) / math.sqrt(opts.hidden),
        "b1": 0.1 * rnd(opts.ffn), "w2": rnd(opts.hidden, opts.ffn) / math.sqrt(opts.ffn), "b2": 0.1 * rnd(opts.hidden),
        "n2": 1 + 0.1 * rnd(opts.hidden), "x": rnd(opts.tokens, opts.hidden), "res": rnd(opts.tokens, opts.hidden),
        "dy": rnd(opts.tokens, opts.hidden), "dres": rnd(opts.tokens, opts.hidden),
    }


def _reference(full: dict) -> dict:
    leaves = {k: full[k].clone().requires_grad_() for k in ("x", "res", "n1", "w1", "b1", "w2", "b2", "n2")}

    def rms(t, w):
        return t / torch.sqrt((t * t).mean(-1, keepdim=True) + 1e-6) * w

    h = F.linear(F.gelu(F.linear(rms(leaves["x"], leaves["n1"]), leaves["w1"], leaves["b1"])),
                 leaves["w2"], leaves["b2"]) + leaves["res"]
    y = rms(h, leaves["n2"])
    (y * full["dy"] + h * full["dres"]).sum().backward()
    out = {"y": y.detach(), "residual": h.detach()}
    out.update({f"d{k}": v.grad for k, v in leaves.items()})
    return out


def _setup(rank: int, world: int, opts: DemoOptions):
    # Both launchers select this process's GPU before calling the worker (under torchrun the
    # rank is not the local device index).
    device = torch.device("cuda", torch.cuda.current_device()) if opts.backend == "nccl" else torch.device("cpu")
    dtype = getattr(torch, opts.dtype)
    full = _full(opts)
    block = build_block(opts.hidden, opts.ffn, sequence_parallel=opts.sequence_parallel, dtype=dtype, device=device)
    with torch.no_grad():
        block[0].weight.copy_(full["n1"])
        block[6].weight.copy_(full["n2"])
    block[1].load_unsharded(full["w1"], full["b1"])
    block[3].load_unsharded(full["w2"], full["b2"])
    n = opts.tokens // world

    def shard(t):
        return t[rank * n:(rank + 1) * n] if opts.sequence_parallel else t

    x = shard(full["x"]).to(device, dtype).requires_grad_()
    res = shard(full["res"]).to(device, dtype).requires_grad_()
    return block, full, shard, x, res


def _demo_worker(rank: int, world: int, opts: DemoOptions) -> None:
    block, full, shard, x, res = _setup(rank, world, opts)
    y, residual = block(x, res)
    (y.double() * shard(full["dy"]).to(y.device) + residual.double() * shard(full["dres"]).to(y.device)).sum().backward()
    if opts.sequence_parallel:
        opfuse.sync_sequence_parallel_grads(block)
    ref = _reference(full)
    f = block[1].weight.shape[0]
    h = block[3].weight.shape[1]
    pairs = {
        "y": (y, shard(ref["y"])), "residual": (residual, shard(ref["residual"])),
        "dx": (x.grad, shard(ref["dx"])), "dresidual": (res.grad, shard(ref["dres"])),
        "dW1 (column shard)": (block[1].weight.grad, ref["dw1"][rank * f:(rank + 1) * f]),
        "db1": (block[1].bias.grad, ref["db1"][rank * f:(rank + 1) * f]),
        "dW2 (row shard)": (block[3].weight.grad, ref["dw2"][:, rank * h:(rank + 1) * h]),
        "db2": (block[3].bias.grad, ref["db2"]),
        "dnorm1": (block[0].weight.grad, ref["dn1"]), "dnorm2": (block[6].weight.grad, ref["dn2"]),
    }
    errors = []
    for name, (got, want) in pairs.items():
        got, want = got.detach().double().cpu(), want.double()
        errors.append(((got - want).norm() / want.norm().clamp_min(1e-30)).item())
    errs = torch.tensor(errors, dtype=torch.float64, device=y.device)
    dist.all_reduce(errs, op=dist.ReduceOp.MAX)
    program = opfuse.compile(block, x, res)
    if rank == 0:
        tol = {"float32": 1e-4, "float64": 1e-10, "bfloat16": 3e-2, "float16": 5e-3}[opts.dtype]
        print(f"opfuse demo: tensor-parallel MLP block, world={world} ({opts.backend}, {y.device.type}), "
              f"tokens={opts.tokens} hidden={opts.hidden} ffn={opts.ffn} {opts.dtype}"
              f"{' sequence-parallel' if opts.sequence_parallel else ''}")
        print("block: " + " -> ".join(op.kind + (f"({op.parallel})" if getattr(op, "parallel", None) else "")
                                      for op in block))
        print("fusions:")
        for record in program.fusions:
            print(f"  {record.rule:<24} covers {', '.join(record.ops):<55} impl={record.impl}")
        print(f"check vs the unsharded float64 reference (relative error, max over ranks; tolerance {tol:g}):")
        for name, err in zip(pairs, errs.tolist()):
            print(f"  {name:<20} {err:.2e}")
        ok = all(e <= tol for e in errs.tolist())
        print("result: check " + ("PASSED" if ok else "FAILED"))
        if not ok:
            raise SystemExit(1)


def _dump_worker(rank: int, world: int, opts: DemoOptions) -> None:
    block, _, _, x, res = _setup(rank, world, opts)
    program = opfuse.compile(block, x, res)
    if rank != 0:
        return
    document = program.dump(opts.fmt, graph="both")
    if opts.fmt in ("python", "text"):
        document = f"# demo block on world={world} ({opts.backend}), rank 0's program\n{document}"
    # dot and html must stay one clean document (piped into `dot` or a browser): the explain text
    # goes to stderr for them, and whenever the document goes to a file.
    notes = sys.stdout if opts.fmt in ("python", "text") and not opts.output else sys.stderr
    if opts.output:
        with open(opts.output, "w") as handle:
            handle.write(document)
        print(f"wrote {opts.output} ({opts.fmt}, world={world}, {opts.backend})", file=sys.stderr)
    else:
        sys.stdout.write(document)
        sys.stdout.flush()
    print(program.explain(), file=notes)


def _unwritable(path: str | None) -> str | None:
    """Why ``path`` cannot be written as a file (``None`` when it can, or when there is no path).
    It is opened for appending (created, then removed again, when it did not exist): permission
    bits do not tell everything (read-only mounts, /proc, a root user)."""
    if path is None:
        return None
    if not path:
        return "an empty path"
    if os.path.isdir(path):
        return "is a directory"
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.exists(parent):
        return f"its directory {parent!r} does not exist"
    if not os.path.isdir(parent):
        return f"{parent!r} is not a directory"
    existed = os.path.exists(path)
    try:
        with open(path, "a"):
            pass
    except OSError as error:
        return f"cannot be written ({error.strerror or error})"
    if not existed:
        try:
            os.remove(path)
        except OSError:
            pass
    return None


def _parse(argv, prog: str) -> DemoOptions:
    joined = torchrun_world()
    if joined is not None:  # torchrun made the processes: its world and its devices
        backend, world = torchrun_backend(), joined
        where = "torchrun's WORLD_SIZE"
    else:
        (backend, world), where = default_backend(), "processes to spawn"
    parser = Parser(prog=prog)
    parser.add_argument("--world", type=positive_int, default=world, help=f"{where} (default {world})")
    parser.add_argument("--backend", choices=["gloo", "nccl"], default=backend)
    parser.add_argument("--tokens", type=positive_int, default=None)
    parser.add_argument("--hidden", type=positive_int, default=None)
    parser.add_argument("--ffn", type=positive_int, default=None)
    parser.add_argument("--dtype", choices=["float32", "bfloat16", "float16", "float64"], default=None)
    parser.add_argument("--sequence-parallel", action="store_true")
    if prog.endswith("dump"):
        parser.add_argument("--format", dest="fmt", choices=["python", "text", "dot", "html"], default="python")
        parser.add_argument("-o", "--output", default=None, metavar="FILE",
                            help="write the document to FILE instead of stdout")
    args = parser.parse_args(argv)
    # Rank 0 writes the document (under torchrun every rank parses these arguments).
    problem = _unwritable(getattr(args, "output", None)) if os.environ.get("RANK", "0") == "0" else None
    if problem:
        # Checked before any process starts: the document is written after the whole compile.
        parser.error(f"-o/--output {args.output!r}: {problem}; expected a writable file path")
    if joined is not None and args.world != joined:
        parser.error(f"--world={args.world} but torchrun started {joined} processes (WORLD_SIZE={joined}); "
                     f"leave --world out under torchrun")
    gpu = args.backend == "nccl"
    defaults = dict(tokens=64 if gpu else 8, hidden=1024 if gpu else 64, ffn=4096 if gpu else 256,
                    dtype="bfloat16" if gpu else "float32")
    values = {k: getattr(args, k) if getattr(args, k) is not None else v for k, v in defaults.items()}
    if values["tokens"] % args.world and args.sequence_parallel:
        parser.error(f"--tokens={values['tokens']} must be divisible by --world={args.world} with --sequence-parallel")
    for name in ("hidden", "ffn"):
        if values[name] % args.world:
            parser.error(f"--{name}={values[name]} must be divisible by --world={args.world}")
    if args.backend == "nccl" and joined is None and torch.cuda.device_count() < args.world:
        parser.error(f"--world={args.world} with --backend=nccl needs {args.world} GPUs, this host has "
                     f"{torch.cuda.device_count()} (use --backend gloo)")
    return DemoOptions(world=args.world, backend=args.backend, sequence_parallel=args.sequence_parallel,
                       fmt=getattr(args, "fmt", "python"), output=getattr(args, "output", None), **values)


def main_demo(argv) -> int:
    """``python -m opfuse demo [options]`` (spawns its processes, or joins torchrun's)."""
    opts = _parse(argv, "python -m opfuse demo")
    run_here_or_spawn(_demo_worker, opts.world, opts, backend=opts.backend)
    return 0


def main_dump(argv) -> int:
    """``python -m opfuse dump [--format F] [-o FILE] [options]``."""
    opts = _parse(argv, "python -m opfuse dump")
    run_here_or_spawn(_dump_worker, opts.world, opts, backend=opts.backend)
    return 0
