"""The grouped-linear family's implementations, per fused op in the order they are tried (on a GPU
kind measured by ``bench/grouped_tune.py`` the measured order of the call's size class comes first:
:mod:`.tuning`), and its FP8 variant's."""

from __future__ import annotations

from ...machinery.implementation import Implementation, ImplementationTable, always
from . import cudnn as grouped_cudnn
from . import persistent as grouped_persistent
from . import reference as grouped_reference
from . import torch_mm, triton_impl
from . import tuning as grouped_tuning
from .fp8 import reference as fp8_grouped_reference
from .fp8 import scaled_grouped_mm

__all__ = ["TABLE"]

TABLE = ImplementationTable("grouped_linear", {
    "grouped_linear": [
        Implementation("triton", triton_impl.check, triton_impl.forward, triton_impl.backward,
                       description="Triton grouped GEMM, pointer loads (any size), device group sizes"),
        Implementation("triton_tma", triton_impl.check_tma, triton_impl.forward_tma, triton_impl.backward_tma,
                       description="Triton grouped GEMM, TMA loads, device group sizes, fused bias, zeroed tail"),
        Implementation("torch_grouped_mm", torch_mm.check, torch_mm.forward, torch_mm.backward,
                       description="torch._grouped_mm (CUTLASS) with device offsets, tail and empty groups zeroed"),
        Implementation(grouped_persistent.NAME, grouped_persistent.check, grouped_persistent.forward,
                       grouped_persistent.backward,
                       description="persistent Triton grouped GEMM (sm90+): TMA loads, device tile map, warp-specialised "
                                   "large tiles; weight gradient through device-side TMA descriptors"),
        Implementation(grouped_cudnn.NAME, grouped_cudnn.check, grouped_cudnn.forward, grouped_cudnn.backward,
                       grouped_cudnn.prepare,
                       "cuDNN MoE grouped matmul with device offsets (dgrad/wgrad on cuDNN where it has engines, "
                       "else the Triton kernels); optional: opfuse[cudnn]"),
        Implementation("reference", always, grouped_reference.reference_forward,
                       grouped_reference.reference_backward, description="loop of matmuls over host group sizes (syncs "
                                                                           "on a GPU)"),
    ],
    "grouped_linear_fp8": [
        Implementation("scaled_grouped_mm", scaled_grouped_mm.check, scaled_grouped_mm.forward,
                       scaled_grouped_mm.backward,
                       description="torch._scaled_grouped_mm (E4M3, per-row scales) with device offsets; wgrad "
                                   "on E4M3 per expert and feature (recipe.fp8_wgrad) or torch._grouped_mm"),
        Implementation("reference", always, fp8_grouped_reference.forward, fp8_grouped_reference.backward,
                       description="float32 emulation, loop over host group sizes (syncs on a GPU)"),
    ],
}, measured_order={"grouped_linear": grouped_tuning.order})
