"""Seconds opfuse's own passes take to compile a model (what ``bench/model.py`` reports as
"opfuse passes s"), on the CPU: ``examples/llama_tp.py``'s decoder over gloo, Inductor off, one
training step (or inference), with an optional cProfile of the compile restricted to opfuse's code.

    python3 tools/pass_time.py --layers 16 --world 2 --tp dtensor-sp [--inference] [--profile]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "examples")]

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402


def _worker(rank: int, args) -> None:
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(args.port))
    dist.init_process_group("gloo", rank=rank, world_size=args.world)
    try:
        import llama_tp

        import opfuse

        cfg = llama_tp.Config(dim=args.dim, layers=args.layers, heads=8, kv_heads=2, ffn=4 * args.dim)
        compiled = opfuse.optimize(llama_tp.build(args.tp, rank, args.world, cfg), options={"inductor": False})
        tokens = torch.randint(0, cfg.vocab, (1, args.tokens), generator=torch.Generator().manual_seed(0))
        profile = cProfile.Profile() if args.profile and rank == 0 else None
        if profile:
            profile.enable()
        with torch.set_grad_enabled(not args.inference):
            out = compiled(tokens)
            if not args.inference:
                out.sum().backward()
        if profile:
            profile.disable()
        if rank == 0:
            seconds = [getattr(p, "seconds", 0.0) for p in opfuse.programs(compiled)]
            print(f"{args.layers} layers, world {args.world}, tp {args.tp}, "
                  f"{'inference' if args.inference else 'training'}: opfuse passes "
                  f"{sum(seconds):.2f} s ({', '.join(f'{s:.2f}' for s in seconds)} per program)")
            if profile:
                text = io.StringIO()
                pstats.Stats(profile, stream=text).sort_stats("cumulative").print_stats("opfuse", args.profile_rows)
                print(text.getvalue())
    finally:
        dist.destroy_process_group()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--dim", type=int, default=256, help="hidden size (the passes' time hardly depends on it)")
    parser.add_argument("--world", type=int, default=1)
    parser.add_argument("--tp", choices=["dist", "dtensor", "dtensor-sp"], default="dist")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--inference", action="store_true", help="compile a forward without gradients")
    parser.add_argument("--profile", action="store_true", help="cProfile of rank 0's compile, opfuse's functions")
    parser.add_argument("--profile-rows", type=int, default=40)
    parser.add_argument("--port", type=int, default=29561)
    args = parser.parse_args(argv)
    if args.world < 1:
        parser.error(f"--world {args.world}: expected 1 or more")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    if args.world == 1:
        _worker(0, args)
    else:
        mp.spawn(_worker, args=(args,), nprocs=args.world)
    return 0


if __name__ == "__main__":
    sys.exit(main())
