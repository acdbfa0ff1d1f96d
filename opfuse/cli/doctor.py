"""``python -m opfuse doctor``: what this machine offers opfuse (torch, CUDA, nvcc, the extension,
symmetric memory), the settings in effect, the passes, the rules and the implementation table."""

from __future__ import annotations

import dataclasses
import os
import subprocess

import torch

import opfuse
from opfuse.core import dispatch as implementations
from opfuse.runtime import cublasmp, cudnn_frontend, extension
from opfuse.debug.html import find_dot

#: The implementations each optional NVIDIA library provides (``doctor`` says why they can run or not).
OPTIONAL_LIBRARIES = (
    ("cuDNN frontend", cudnn_frontend, "cudnn", ("add_rmsnorm", "add_layernorm", "linear_bias_activation",
                                                 "grouped_linear")),
    ("cuBLASMp", cublasmp, "cublasmp", ("all_gather_linear", "linear_reduce_scatter")),
)


def main_doctor(argv) -> int:
    """``python -m opfuse doctor``: print what this machine offers opfuse."""
    from .args import Parser

    Parser(prog="python -m opfuse doctor", description=__doc__).parse_args(argv)
    print(f"opfuse {opfuse.__version__}  torch {torch.__version__}  python {os.sys.version.split()[0]}")
    if torch.cuda.is_available():
        names = {torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())}
        print(f"cuda: {torch.cuda.device_count()} device(s) {sorted(names)}, runtime {torch.version.cuda}")
        try:
            print(f"nccl: {'.'.join(map(str, torch.cuda.nccl.version()))}")
        except Exception as error:  # noqa: BLE001 - informational
            print(f"nccl: unavailable ({error})")
    else:
        print("cuda: not available (reference implementations on CPU)")
    nvcc = extension.find_nvcc()
    if nvcc:
        version = subprocess.run([nvcc, "--version"], capture_output=True, text=True).stdout.strip().splitlines()[-1]
        print(f"nvcc: {nvcc} ({version})")
    else:
        print("nvcc: not found (the CUDA extension cannot be built here)")
    for family in extension.families():
        print(f"extension {family}: {extension.status(family)}")
    dot = find_dot()
    print(f"graphviz: {dot} (lays out dump('html'))" if dot else
          "graphviz: not found (dump('html') lays itself out with the vendored dagre)")
    print("optional libraries:")
    for title, library, impl, ops in OPTIONAL_LIBRARIES:
        print(f"  {title}: {library.describe()}")
        if library.status() is not None:
            verdict = "not capable: the library is missing"
        elif not torch.cuda.is_available():
            verdict = "not capable here: no CUDA device"
        else:
            verdict = "available; each program's capability check decides (dtypes, shapes, world, engine support)"
        print(f"    implementation {impl!r} of {', '.join(ops)}: {verdict}")
    for var in ("NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST"):
        print(f"{var}={os.environ.get(var, '(unset)')}")
    print("settings:")
    for field in dataclasses.fields(opfuse.config):
        print(f"  {field.name} = {getattr(opfuse.config, field.name)!r}")
    print("passes (in the order run):")
    for item in opfuse.passes.passes():
        where = "built-in" if item.builtin else (f"after {item.after}" if item.after else f"before {item.before}")
        print(f"  {item.name:<28} {where:<24} [{item.source}]")
    print("rules (in the order tried):")
    for rule in opfuse.passes.rules():
        print(f"  {rule.priority:>3}  {rule.name:<28} {rule.pattern.describe()}  [{rule.source}]")
    print("implementation table (in the order tried):")
    for op, names in implementations.names().items():
        print(f"  {op:<24} {', '.join(names)}")
    return 0
