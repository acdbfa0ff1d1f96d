"""Host (CPU) issue cost of each primitive an eager overlap call makes, on one GPU.

    PYTHONPATH=. python3 bench/host_primitives.py [--json FILE] [--plot FILE.png]

An eager ``p2p_overlap`` call issues one torch call per plan instruction; on the 4x / 8x H200
hosts the measured issue time was ~11 us per instruction, against ~1 us of Python per
instruction on a CPU without CUDA (``bench/overlap_hostcost.py``). This times each
primitive alone (microseconds of host time per call, median of 7 batches of CALLS calls, the GPU
kept far from saturated: tiny operands, a sync between batches), to show where that goes.
Symmetric-memory signals need a group: a one-rank NCCL group, every signal to itself.
"""

from __future__ import annotations

import os
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import common  # noqa: E402  (bench/common.py)

CALLS, REPS = 200, 7


def host_us(fn, calls: int = CALLS) -> float:
    times = []
    for _ in range(REPS):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        times.append((time.perf_counter() - t0) * 1e6 / calls)
        torch.cuda.synchronize()
    return sorted(times)[len(times) // 2]


def measure() -> list:
    """``[[primitive, host us per call, note], ...]`` on GPU 0 (a one-rank NCCL group)."""
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", rank=0, world_size=1, device_id=torch.device("cuda", 0))
    from torch.distributed import _symmetric_memory as symm_mem

    bf = torch.bfloat16
    a, b = torch.randn(64, 512, device="cuda", dtype=bf), torch.randn(512, 512, device="cuda", dtype=bf)
    out, bias = torch.empty(64, 512, device="cuda", dtype=bf), torch.randn(512, device="cuda", dtype=bf)
    src = torch.randn(1 << 16, device="cuda", dtype=bf)
    dst = torch.empty_like(src)
    buf = symm_mem.empty(1 << 20, device="cuda", dtype=torch.uint8)
    handle = symm_mem.rendezvous(buf, dist.group.WORLD.group_name)
    peer = handle.get_buffer(0, (1 << 16,), bf, 0)
    side = torch.cuda.Stream(priority=-1)
    ev = torch.cuda.Event()
    C = torch._C
    key = tuple(C._cuda_getCurrentStream(0))
    side_key = (side.stream_id, side.device_index, side.device_type)
    rows = []

    def add(name, fn, note=""):
        fn()
        torch.cuda.synchronize()
        rows.append([name, host_us(fn), note])
        common.progress(f"{name} done")

    add("mm(out=) bf16 64x512x512", lambda: torch.mm(a, b, out=out))
    add("addmm(bias, out=) (cuBLASLt epilogue)", lambda: torch.addmm(bias, a, b, out=out))
    add("addmm_ (beta=1 accumulate)", lambda: out.addmm_(a, b))
    add("copy_ 128 KiB local -> local", lambda: dst.copy_(src))
    add("copy_ 128 KiB local -> symmetric view", lambda: peer.copy_(src))
    add("add(out=) 64x512", lambda: torch.add(out, out, out=dst[:64 * 512].view(64, 512)))
    add("event record + wait (C methods)", lambda: (C._CudaEventBase.record(ev, side), C._CudaEventBase.wait(ev, side)))
    add("set stream x2 (C setter)", lambda: (C._cuda_setStream(*side_key), C._cuda_setStream(*key)))

    def put_wait():
        handle.put_signal(0, 8, 0)
        handle.wait_signal(0, 8, 0)
    add("put_signal + wait_signal (pair)", put_wait, "two kernel launches")
    add("barrier (symm mem)", lambda: handle.barrier(9, 0))

    def empty_kernel():
        torch.cuda._sleep(0)
    add("torch.cuda._sleep(0) (bare launch)", empty_kernel)
    dist.destroy_process_group()
    return rows


def main() -> int:
    parser = common.parser("host_primitives", __doc__)
    args = parser.parse_args()
    rows = common.results(args, "host_primitives", 1, measure)
    if rows is None:
        return 0
    print("| primitive | host us/call | note |")
    print("|---|---|---|")
    for name, us, note in rows:
        print(f"| {name} | {us:.2f} | {note} |")
    common.finish(args, rows, bars={name: us for name, us, _ in rows}, ylabel="host us per call",
                  title="host issue cost per torch primitive (one GPU)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
