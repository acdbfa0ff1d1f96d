"""FP8 execution of opfuse blocks: recipes, ``autocast``, the quantization math and its float32
emulation, and the FP8 activation tensor.

>>> import opfuse
>>> with opfuse.fp8.autocast(recipe=opfuse.fp8.TensorScaling()):     # doctest: +SKIP
...     y = block(x)

Under ``autocast`` the compiler inserts a ``Quantize`` op in front of every ``Linear`` GEMM and
marks the GEMMs (and ``GroupedLinear``'s) as FP8; fusion rules turn them into FP8 kernels
(``torch._scaled_mm``, ``torch._scaled_grouped_mm``), norms that emit FP8, and all-gathers of FP8
bytes. The float32 emulation here is what runs on CPU and what the kernels are tested against.
This package depends on torch only.
"""

from .linear import fp8_linear
from .numerics import Quantized, dequantize, emulated_mm, quantize
from .recipe import E4M3, E5M2, Recipe, RowwiseScaling, TensorScaling, recipe_from_key
from .state import autocast, current_recipe, weights_frozen
from .tensor import Float8Activation, payload, quantize_activation

__all__ = ["autocast", "current_recipe", "weights_frozen", "Recipe", "TensorScaling", "RowwiseScaling", "recipe_from_key", "E4M3",
           "E5M2", "Float8Activation", "quantize_activation", "payload", "Quantized", "quantize", "dequantize",
           "emulated_mm", "fp8_linear"]
