"""The FP8 variants of bench/model.py (``--fp8 tensor|tensor-pow2|row``, issue 27): opfuse.optimize with the
recipe (the output head kept in bfloat16), and torchao's float8 training + torch.compile with the
same recipe and filter as a baseline column where ``torchao`` imports.

torchao's float8 needs its own tensor-parallel styles for DTensor models (``Float8ColwiseParallel``
...): its column is measured on the ``tp`` cases (torch.distributed all-reduces, the
per-rank shards are plain ``nn.Linear`` layers) and left empty on ``sp``. The wheel travels to GPU
hosts in ``.thirdparty/wheels/`` (tools/gpu_session.sh ``install_bench_wheels``).
"""

from __future__ import annotations

__all__ = ["RECIPE_NAMES", "recipe", "keep_high_precision", "torchao_compiler"]

#: ``--fp8`` choices -> torchao's recipe for its column (``tensor-pow2``: opfuse's power-of-two weight
#: scales, quantized in one read; torchao runs its standard tensorwise recipe beside it).
_TORCHAO_RECIPES = {"tensor": "tensorwise", "tensor-pow2": "tensorwise", "row": "rowwise"}
RECIPE_NAMES = tuple(_TORCHAO_RECIPES)


def recipe(name: str | None):
    """The opfuse recipe ``--fp8`` names (``None`` without it)."""
    if name is None:
        return None
    import opfuse

    return {"tensor": opfuse.fp8.TensorScaling(), "tensor-pow2": opfuse.fp8.TensorScaling(pow2_weight_scales=True),
            "row": opfuse.fp8.RowwiseScaling()}[name]


def keep_high_precision(fqn: str, module) -> bool:
    """opfuse's ``fp8_filter``: every projection but the output head."""
    return fqn != "output"


def torchao_compiler(name: str | None, mode: str | None = None):
    """``(fn(model) -> compiled, None)`` for torchao float8 + torch.compile (``mode``: its
    torch.compile mode), or ``(None, reason)``."""
    if name is None:
        return None, "no --fp8"
    try:
        import torchao
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    except ImportError as error:
        return None, f"torchao not installed ({error})"
    import torch

    config = Float8LinearConfig.from_recipe_name(_TORCHAO_RECIPES[name])

    def compile_with_torchao(model):
        convert_to_float8_training(model, config=config, module_filter_fn=lambda module, fqn: fqn != "output")
        # torchao's Float8Linear returns a view made inside its autograd function, which autograd
        # forbids modifying in place: the tp model all-reduces its row-parallel outputs in place
        # (Megatron/gpt-fast style). A clone of each output makes that legal; Inductor writes it as
        # one copy of the GEMM output (the same bytes the all-reduce reads anyway).
        for module in model.modules():
            if type(module).__name__ == "Float8Linear":
                module.register_forward_hook(lambda _module, _inputs, output: output.clone())
        return torch.compile(model, mode=mode, dynamic=False)

    return compile_with_torchao, f"torchao {getattr(torchao, '__version__', '?')}"
