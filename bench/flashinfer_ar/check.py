"""Check the FlashInfer binding on this host before a benchmark relies on it.

    PYTHONPATH=. python3 bench/flashinfer_ar/check.py [--world 2 4]

At each world size (as the host has GPUs): one-shot and two-shot calls at small and odd shapes
against a float64 reference (all-reduce of the partial sums + residual, RMSNorm), 30 back-to-back
calls with fresh inputs (the Lamport buffers rotate and are cleared), and a CUDA graph of both
paths replayed with new data. Prints ``flashinfer check passed`` last, or what failed; a hang
(wrong workspace) ends at ``--timeout`` and tools/gpu_session.sh then runs the benchmark without
the FlashInfer column.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))                   # bench/
sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))  # the repository

from flashinfer_ar import build  # noqa: E402
from flashinfer_ar.fusion import WORLDS, FlashInferFusion, vllm_uses_oneshot  # noqa: E402
from opfuse.cli.launch import run  # noqa: E402

EPS = 1e-6
TOL = 2e-2  # bf16 outputs: a few roundings of values of order 1


def _inputs(tokens, hidden, seed, rank):
    gen = torch.Generator(device="cuda").manual_seed(seed * 131 + rank)
    x = torch.randn(tokens, hidden, generator=gen, device="cuda").to(torch.bfloat16)
    res_gen = torch.Generator(device="cuda").manual_seed(seed)  # the residual is replicated
    res = torch.randn(tokens, hidden, generator=res_gen, device="cuda").to(torch.bfloat16)
    return x, res


def _reference(x, res, gamma):
    h = x.double()
    dist.all_reduce(h)
    h += res.double()
    return F.rms_norm(h, (h.shape[-1],), gamma.double(), EPS), h


def _rel(got, ref):
    return ((got.double() - ref).norm() / ref.norm()).item()


def worker(rank, world, out):
    fi = FlashInferFusion(dist.group.WORLD, 1024 * 8192 * 2)
    failures = []

    def check(tag, x, res, gamma, y, h):
        y_ref, h_ref = _reference(x, res, gamma)
        ey, eh = _rel(y, y_ref), _rel(h, h_ref)
        if not (ey < TOL and eh < TOL):
            failures.append(f"{tag}: relative error y {ey:.2e}, h {eh:.2e} (tolerance {TOL})")

    # (tokens, hidden, one-shot?): None = vLLM's choice (one-shot at world 2, two-shot at world 4 there)
    cases = [(1, 8192, True), (7, 5120, True), (64, 2880, True), (33, 4096, False), (1024, 8192, None),
             (1000, 8192, False), (world + 1, 5120, False)]
    for seed, (tokens, hidden, oneshot) in enumerate(cases):
        if oneshot is None:
            oneshot = vllm_uses_oneshot(tokens * hidden * 2, world)
        gamma = (1 + 0.1 * torch.randn(hidden, device="cuda", generator=torch.Generator(device="cuda").manual_seed(
            seed))).to(torch.bfloat16)
        x, res = _inputs(tokens, hidden, seed, rank)
        y, h = torch.empty_like(x), torch.empty_like(x)
        tag = f"world {world} T={tokens} H={hidden} {'one' if oneshot else 'two'}-shot"
        if fi.can_run(tokens, x.numel() * 2, oneshot):
            failures.append(f"{tag}: {fi.can_run(tokens, x.numel() * 2, oneshot)}")
            continue
        for step in range(30 if tokens <= 64 else 3):  # back to back, fresh data: the buffers rotate
            x, res = _inputs(tokens, hidden, 1000 * seed + step, rank)
            fi(x, res, gamma, EPS, y, h, oneshot=oneshot)
            check(f"{tag} call {step}", x, res, gamma, y, h)
    # CUDA graph of both paths, replayed with new data copied into the captured inputs.
    hidden, gamma = 4096, torch.ones(4096, device="cuda", dtype=torch.bfloat16)
    static = {t: _inputs(t, hidden, 7, rank) for t in (16, 256)}
    outs = {t: (torch.empty_like(static[t][0]), torch.empty_like(static[t][0])) for t in static}
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for t, oneshot in ((16, True), (256, False)):
            fi(*static[t], gamma, EPS, *outs[t], oneshot=oneshot)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for t, oneshot in ((16, True), (256, False)):
            fi(*static[t], gamma, EPS, *outs[t], oneshot=oneshot)
    for replay in range(5):
        for t in static:
            x, res = _inputs(t, hidden, 100 + replay, rank)
            static[t][0].copy_(x)
            static[t][1].copy_(res)
        graph.replay()
        torch.cuda.synchronize()
        for t in static:
            check(f"world {world} graph replay {replay} T={t}", *static[t], gamma, *outs[t])
    everyone = [None] * world
    dist.all_gather_object(everyone, failures)
    if rank == 0:
        out.put(sorted({f"rank {r}: {line}" for r, lines in enumerate(everyone) for line in lines}))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--timeout", type=float, default=90.0, help="seconds per world size")
    args = parser.parse_args()
    try:
        print(f"flashinfer binding: {build.load()._name}", flush=True)
    except build.FlashInferUnavailable as error:
        print(f"flashinfer check skipped: {error}")
        return 1
    import torch.multiprocessing as mp

    failures, checked = [], []
    for world in args.world:
        if world not in WORLDS or torch.cuda.device_count() < world:
            print(f"world {world}: skipped ({torch.cuda.device_count()} GPUs; binding worlds {WORLDS})")
            continue
        queue = mp.get_context("spawn").SimpleQueue()
        try:
            run(worker, world, queue, backend="nccl", timeout=args.timeout)
        except Exception as error:  # noqa: BLE001 - a failed or hung rank
            failures.append(f"world {world}: {str(error).strip().splitlines()[-1][:300]}")
            continue
        failures += queue.get() if not queue.empty() else [f"world {world}: no result from rank 0"]
        checked.append(world)
    for line in failures:
        print("FAIL", line)
    if failures or not checked:
        print("flashinfer check FAILED" if failures else "flashinfer check: no world size could run here")
        return 1
    print(f"flashinfer check passed (world {', '.join(map(str, checked))})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
