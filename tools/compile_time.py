"""Whole compile time of a model, opfuse's backend against torch.compile: the first training call
(forward + backward) of ``examples/llama_tp.py``'s decoder, Inductor on, every compile from empty
caches, each compiler timed in turn in fresh processes (``--rounds`` times, alternating). Issue 26 asks opfuse
to compile no slower than torch.compile; ``tools/pass_time.py`` times opfuse's own passes alone.

    python3 tools/compile_time.py --layers 16 --world 2 [--tp dist] [--rounds 2] [--device cpu]

On the CPU host the world's ranks are gloo processes and Inductor generates C++; on GPUs (``--device
cuda``, one GPU per rank, NCCL) Triton.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
import warnings

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "examples")]

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

COMPILERS = ("compile", "opfuse")


def _worker(rank: int, args, compiler: str, result) -> None:
    warnings.filterwarnings("ignore", message="dynamo_pgo force disabled")  # what the empty caches ask for
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ["MASTER_PORT"] = str(args.port)
    cuda = args.device == "cuda"
    if cuda:
        torch.cuda.set_device(rank)
    dist.init_process_group("nccl" if cuda else "gloo", rank=rank, world_size=args.world)
    try:
        import llama_tp

        import opfuse

        cfg = llama_tp.Config(dim=args.dim, layers=args.layers, heads=8, kv_heads=2, ffn=4 * args.dim)
        device = "cuda" if cuda else "cpu"
        dtype = torch.bfloat16 if cuda else torch.float32
        model = llama_tp.build(args.tp, rank, args.world, cfg, dtype, device)
        tokens = torch.randint(0, cfg.vocab, (1, args.tokens), generator=torch.Generator().manual_seed(0)).to(device)
        compiled = opfuse.optimize(model) if compiler == "opfuse" else torch.compile(model, dynamic=False)
        started = time.perf_counter()
        out = compiled(tokens)
        out.float().sum().backward()
        if cuda:
            torch.cuda.synchronize()
        seconds = time.perf_counter() - started
        if rank == 0:
            result.put(seconds)
    finally:
        dist.destroy_process_group()


def _time(args, compiler: str) -> float:
    """Seconds of ``compiler``'s first training call, rank 0, in fresh processes with empty
    Inductor and Triton cache folders (a compiled kernel of the run before would otherwise be
    found on disk: without this, a second run measured 14 s where the first took 34)."""
    context = mp.get_context("spawn")
    result = context.SimpleQueue()
    saved = {name: os.environ.get(name)
             for name in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR", "TORCHINDUCTOR_FORCE_DISABLE_CACHES")}
    with tempfile.TemporaryDirectory(prefix="opfuse-compile-time-") as folder:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(folder, "inductor")
        os.environ["TRITON_CACHE_DIR"] = os.path.join(folder, "triton")
        os.environ["TORCHINDUCTOR_FORCE_DISABLE_CACHES"] = "1"
        try:
            mp.start_processes(_worker, args=(args, compiler, result), nprocs=args.world, start_method="spawn")
        finally:
            for name, value in saved.items():
                if value is None:
                    os.environ.pop(name, None)
                else:
                    os.environ[name] = value
        return result.get()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--dim", type=int, default=256, help="hidden size")
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--tp", choices=["dist", "dtensor", "dtensor-sp"], default="dist")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=2, help="compiles of each, alternating (default 2)")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--port", type=int, default=29571)
    args = parser.parse_args(argv)
    if args.device == "cuda" and torch.cuda.device_count() < args.world:
        print(f"compile_time: --device cuda needs {args.world} GPUs, {torch.cuda.device_count()} here; skipped")
        return 0
    seconds: dict[str, list[float]] = {name: [] for name in COMPILERS}
    for round_ in range(args.rounds):
        for compiler in COMPILERS if round_ % 2 == 0 else COMPILERS[::-1]:
            seconds[compiler].append(_time(args, compiler))
            print(f"round {round_}: {compiler} {seconds[compiler][-1]:.2f} s", flush=True)
    compile_s, opfuse_s = (statistics.median(seconds[name]) for name in COMPILERS)
    print(f"{args.layers} layers, world {args.world}, tp {args.tp}, {args.device}: first training call "
          f"torch.compile {compile_s:.2f} s, opfuse {opfuse_s:.2f} s (medians of {args.rounds}): "
          f"opfuse / torch.compile {opfuse_s / compile_s:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
