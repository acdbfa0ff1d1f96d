"""Compile the persistent grouped-GEMM kernels for a GPU target without a GPU and report what the
compiler made of each tile configuration: warp specialisation applied or not, warpgroup MMA,
TMA loads, shared memory, registers and spills (ptxas, through cuobjdump).

    python tools/grouped_compile_report.py [--arch 90] [--dtype bf16]

Uses the triton installed here (its bundled ptxas/cuobjdump); no driver needed. The shapes are
the bench's (K=7168, N=2048), so the integer arguments get the divisibility a real launch sees.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _resources(cubin: bytes, cuobjdump: str) -> str:
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        out = subprocess.run([cuobjdump, "--dump-resource-usage", f.name], capture_output=True, text=True).stdout
    regs = re.search(r"REG:(\d+)", out)
    stack = re.search(r"STACK:(\d+)", out)
    local = re.search(r"LOCAL:(\d+)", out)
    return (f"regs {regs.group(1) if regs else '?'}, stack {stack.group(1) if stack else '?'}, "
            f"local {local.group(1) if local else '?'}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--arch", type=int, default=90)
    parser.add_argument("--dtype", default="bf16", choices=["bf16", "fp16"])
    parser.add_argument("--odd", action="store_true",
                        help="integer arguments without divisibility by 16 (odd K/N), as odd shapes launch")
    args = parser.parse_args(argv)

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from opfuse.families.grouped_linear import persistent, tuning
    from opfuse.families.grouped_linear.persistent_kernels import (grouped_mm_persistent_kernel,
                                                                   grouped_tile_map_kernel, grouped_wgrad_tma_kernel)

    bin_dir = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    cuobjdump = os.path.join(bin_dir, "cuobjdump")
    target = GPUTarget("cuda", args.arch, 32)
    dt = args.dtype
    div16 = [["tt.divisibility", 16]]

    def compile_report(label, fn, signature, constexprs, attrs, num_warps, num_stages):
        src = ASTSource(fn, signature, constexprs=constexprs, attrs=attrs)
        try:
            kernel = triton.compile(src, target=target, options={"num_warps": num_warps, "num_stages": num_stages})
        except Exception as error:  # noqa: BLE001 - a failed config is a line of the report
            first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
            print(f"{label:58s} FAILED: {first[:160]}")
            return
        ttgir = kernel.asm["ttgir"]
        threads = re.search(r"\.reqntid (\d+)", kernel.asm["ptx"])
        print(f"{label:58s} ws={'ttg.warp_specialize' in ttgir!s:5s} wgmma={'warp_group_dot' in ttgir!s:5s} "
              f"tma={'async_tma_copy_global_to_local' in ttgir!s:5s} threads={threads.group(1) if threads else '?'} "
              f"smem={kernel.metadata.shared // 1024} KiB, {_resources(kernel.asm['cubin'], cuobjdump)}")

    candidates = {cls: [persistent.default_tiles(cls), *persistent.CANDIDATES[cls]] for cls in tuning.SIZE_CLASSES}

    k, n = 7168, 2048
    for cls, options in candidates.items():
        for t in options:
            for nk in (True, False):
                n_out, kc = (n, k) if nk else (k, n)
                b_block = f"[{t.bn},{t.bk}]" if nk else f"[1,{t.bk},{t.bn}]"
                signature = {"a_desc": f"tensordesc<{dt}[{t.bm},{t.bk}]>", "b_desc": f"tensordesc<{dt}{b_block}>",
                             "C": f"*{dt}", "Bias": f"*{dt}", "Map": "*i32", "N": "i32", "KC": "i32", "G": "i32",
                             "stride_cm": "i32"}
                constexprs = {"HAS_BIAS": nk, "B_NK": nk, "BM": t.bm, "BN": t.bn, "BK": t.bk, "GROUP_M": t.group_m,
                              "WARP_SPECIALIZE": t.warp_specialize}
                for name in constexprs:
                    signature[name] = "constexpr"
                attrs = {(i,): div16 for i in ((2, 3, 4) if args.odd else (2, 3, 4, 5, 6, 8))}
                label = (f"{cls:8s} {'fwd  ' if nk else 'dgrad'} {t.bm}x{t.bn}x{t.bk} w{t.num_warps} s{t.num_stages}"
                         f"{' ws' if t.warp_specialize else ''} x{t.programs_per_sm}")
                compile_report(label, grouped_mm_persistent_kernel, signature, constexprs, attrs, t.num_warps,
                               t.num_stages)
    signature = {"Sizes": "*i32", "Map": "*i32", "T": "i32", "G": "i32", "BM": "constexpr", "GP": "constexpr",
                 "BLOCK": "constexpr"}
    for gp in (64, 256, 1024):
        block, warps = persistent._map_block(gp), persistent._map_warps(gp)
        compile_report(f"tile map GP={gp} BLOCK={block} BM=128 w{warps}", grouped_tile_map_kernel, signature,
                       {"BM": 128, "GP": gp, "BLOCK": block}, {(0,): div16, (1,): div16}, warps, 1)
    w = persistent.WGRAD_TILES
    signature = {"DY": f"*{dt}", "X": f"*{dt}", "DW": f"*{dt}", "DB": f"*{dt}", "Sizes": "*i32", "T": "i32",
                 "N": "i32", "K": "i32", "G": "i32"}
    for has_bias in (False, True):
        constexprs = {"HAS_BIAS": has_bias, "BN": w.bn, "BK": w.bk, "BT": w.bt, "GP": 64, "NUM_STAGES": w.num_stages}
        sig = dict(signature, **{name: "constexpr" for name in constexprs})
        attrs = {(i,): div16 for i in (0, 1, 2, 3, 4, 6, 7)}
        compile_report(f"wgrad {w.bn}x{w.bk} bt{w.bt} w{w.num_warps} s{w.num_stages} bias={has_bias}",
                       grouped_wgrad_tma_kernel, sig, constexprs, attrs, w.num_warps, w.num_stages)
    return 0


if __name__ == "__main__":
    sys.exit(main())
