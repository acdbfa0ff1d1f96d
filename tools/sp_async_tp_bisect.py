"""Which part of the pair "opfuse's sequence-parallel batch > 1 fusions + Inductor's async TP" gives
wrong gradients (docs/PERF_NOTES.model.md, sessions 7-8: relative error 1.4 on 2 GPUs, train-sp
at batch 4; each alone is right; opfuse/core/passes/sequence_batch.py refuses the pair on CUDA).

The Llama-style example (examples/llama_tp.py, DTensor sequence parallelism, training, bf16 on
GPUs) is compiled with Inductor's async TP on and the refusal lifted, once per variant:

* ``both``: ``all_gather_keep`` and ``linear_reduce_scatter_batch`` (what the refusal stops);
* ``keep-only`` / ``scatter-only``: one of the two passes disabled (``OPFUSE_DISABLE_PASSES``);
* ``neither``: both disabled (async TP alone: the baseline, known right);
* ``both-no-async-tp``: the fusions without async TP (known right).

For each it prints the output's and every gradient's relative error against the eager model,
the worst gradients by name, and what each pass fused (opfuse's rules; Inductor's fused
all-gather / reduce-scatter matmuls per graph), so one device call tells which fusion, which
tensors and which graph the error starts from.

    PYTHONPATH=. python3 tools/sp_async_tp_bisect.py --world 2 --batch 4    # GPUs (NCCL)
    PYTHONPATH=. python3 tools/sp_async_tp_bisect.py --cpu                  # gloo, torch's symm-mem fallbacks

``--cpu`` runs Inductor's async-TP pass on CPU by standing in torch's own reference
implementations of its fused ops (``torch.distributed._symmetric_memory._test_mode``): the graph
rewrites are the GPU run's, the kernels are not (session 10: every variant matches eager there,
so the GPU error lies in a kernel or a layout only the CUDA path produces).
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "examples"))

BATCH_PASSES = ("all_gather_keep", "linear_reduce_scatter_batch")
VARIANTS = {  # name -> (passes disabled, async TP, forced implementations)
    "both": ((), True, ""),
    "keep-only": (("linear_reduce_scatter_batch",), True, ""),
    # the gather keep run by its reference (NCCL all-gather, then a GEMM) instead of the peer-memory
    # pipeline: whether the pair's fault needs opfuse's symmetric-memory implementation
    "keep-only-reference": (("linear_reduce_scatter_batch",), True, "all_gather_linear_keep=reference"),
    "scatter-only": (("all_gather_keep",), True, ""),
    "neither": (BATCH_PASSES, True, ""),
    "both-no-async-tp": ((), False, ""),
}


def _cpu_stand_ins():
    """torch's reference implementations of the symm-mem fused ops for CPU tensors, and the checks
    that keep Inductor's async-TP pass off without NCCL lifted."""
    import torch.distributed._symmetric_memory as symm_mem

    lib = torch.library.Library("symm_mem", "IMPL")
    for name in ("fused_all_gather_matmul", "fused_matmul_reduce_scatter"):
        lib.impl(name, getattr(symm_mem, f"_{name}_fallback"), "CPU")
    torch.distributed.is_nccl_available = lambda: True
    return lib, symm_mem._test_mode()


def _count_async_tp(found: list):
    """Record, per graph Inductor compiles, the fused ops its async-TP pass inserted."""
    from torch._inductor.fx_passes import micro_pipeline_tp, post_grad

    original = micro_pipeline_tp.micro_pipeline_tp_pass

    def counting(graph):
        original(graph)
        fused = [str(n.target).split(".")[-2] for n in graph.nodes if "symm_mem" in str(n.target)]
        found.append(fused)

    post_grad.micro_pipeline_tp_pass = counting


def check_variant(rank: int, world: int, variant: str, batch: int, seq: int, cpu: bool):
    """``(errors, opfuse rules, async-TP fused ops per graph)`` of one variant on this rank."""
    import llama_tp

    from opfuse.config import config
    from opfuse.core.passes import sequence_batch

    disabled, async_tp, force_impl = VARIANTS[variant]
    stand_ins = _cpu_stand_ins() if cpu else None
    found: list = []
    _count_async_tp(found)
    if cpu:
        cfg, dtype = llama_tp.Config(dim=64, layers=1, heads=4, kv_heads=2, ffn=128, vocab=128, max_seq=64), \
            torch.float32
    else:
        cfg, dtype = llama_tp.Config(dim=512, layers=2, heads=8, kv_heads=4, ffn=1536, vocab=512, max_seq=256), \
            torch.bfloat16
    try:
        if stand_ins is not None:
            stand_ins[1].__enter__()
        with config.override(disabled_passes=tuple(disabled), force_impl=force_impl), \
                sequence_batch.refusal_lifted():  # the pair under test
            errors, programs = llama_tp.run_check(rank, world, "dtensor-sp", True, True, cfg=cfg, dtype=dtype,
                                                  batch=batch, seq=seq, verbose=False,
                                                  options={"_micro_pipeline_tp": async_tp})
    finally:
        if stand_ins is not None:
            stand_ins[1].__exit__(None, None, None)
    return errors, sorted(f"{f.rule}={f.impl}" for p in programs for f in p.fusions), found


def _worker(rank: int, world: int, variant: str, batch: int, seq: int, cpu: bool) -> None:
    errors, rules, found = check_variant(rank, world, variant, batch, seq, cpu)
    if rank == 0:
        grads = {k: v for k, v in errors.items() if k.startswith("grad")}
        worst = sorted(grads, key=grads.get, reverse=True)[:4]
        print(f"{variant:17s} output {errors['output']:.1e}  max grad {max(grads.values()):.1e}  worst: "
              + ", ".join(f"{k[5:]} {grads[k]:.1e}" for k in worst), flush=True)
        print(f"{'':17s} opfuse: {', '.join(f'{r} x{rules.count(r)}' for r in sorted(set(rules)))}; "
              f"async TP per graph: {found}", flush=True)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=None, help="tokens per sequence (default 128 on GPUs, 16 on CPU)")
    parser.add_argument("--cpu", action="store_true", help="gloo ranks, torch's symm-mem reference implementations")
    parser.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=list(VARIANTS))
    args = parser.parse_args(argv)
    sys.path.insert(0, os.path.dirname(HERE))
    from opfuse.cli.launch import run

    backend = "gloo" if args.cpu else "nccl"
    seq = args.seq or (16 if args.cpu else 128)
    print(f"world {args.world}, batch {args.batch}, seq {seq}, {backend}: relative errors against eager "
          f"(bf16 on GPUs: ~1e-2 is rounding)", flush=True)
    for variant in args.variants:
        run(_worker, args.world, variant, args.batch, seq, args.cpu, backend=backend, timeout=900)
    return 0


if __name__ == "__main__":
    sys.exit(main())
