"""``opfuse.fp8.autocast``: the recipe in force for the block calls it wraps.

The recipe is read when a block is compiled (it is part of the compile-cache key, so a block
called both inside and outside autocast keeps one program for each) and is fixed in that program:
the backward of a call runs with the recipe of its forward, wherever ``backward()`` is called.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Iterator

from .recipe import Recipe, TensorScaling

__all__ = ["autocast", "current_recipe", "weights_frozen", "weight_trained", "weights_trained"]

_state = threading.local()


def current_recipe() -> Recipe | None:
    """The recipe of the innermost active :func:`autocast` (``None`` outside, or where disabled)."""
    return getattr(_state, "recipe", None)


def weights_frozen() -> bool:
    """Whether the innermost :func:`autocast` declared its weights frozen (``frozen_weights=True``)."""
    return getattr(_state, "frozen", False)


def weight_trained(weight) -> bool:
    """Whether an FP8 GEMM should treat ``weight`` as trained (quantize ``W`` and ``W.T`` together,
    write the transposed bytes of ``x`` for the weight gradient): what the innermost
    :func:`weights_trained` says, else ``weight.requires_grad``."""
    override = getattr(_state, "trained", None)
    return weight.requires_grad if override is None else override


@contextlib.contextmanager
def weights_trained(trained: bool) -> Iterator[None]:
    """Say whether the FP8 GEMMs called inside take a weight gradient, whatever their weights'
    ``requires_grad`` says. A compiled graph decides this when it is built (its outputs' shapes
    depend on it) and passes the parameter itself, so that the FP8 copies cached for the
    parameter serve its forward and its backward alike (an alias made to carry the flag would be
    a new tensor, and a cache miss, on every call)."""
    previous = getattr(_state, "trained", None)
    _state.trained = bool(trained)
    try:
        yield
    finally:
        _state.trained = previous


@contextlib.contextmanager
def autocast(enabled: bool = True, recipe: Recipe | None = None,
             frozen_weights: bool = False) -> Iterator[Recipe | None]:
    """Run the GEMMs of opfuse blocks called inside this ``with`` block in FP8.

    Parameters
    ----------
    enabled:
        ``False`` turns FP8 off inside an outer ``autocast``.
    recipe:
        :class:`~opfuse.fp8.TensorScaling` (the default) or :class:`~opfuse.fp8.RowwiseScaling`.
    frozen_weights:
        The weights do not change while CUDA graphs captured inside run (inference): captured
        graphs then read the FP8 weights quantized before the capture instead of quantizing them on
        every replay. Without it a captured graph re-quantizes its weights on each replay (it sees
        optimizer steps); eager calls reuse FP8 weights while the parameter is unchanged either way.

    Linear GEMMs (forward, data gradient and, per recipe, weight gradient), their all-gathers and
    the grouped GEMMs of ``GroupedLinear`` run on FP8 operands; parameters stay in their dtype
    (the master weights) and are quantized when used. Thread-local.

    Examples
    --------
    >>> with opfuse.fp8.autocast(recipe=opfuse.fp8.TensorScaling()):   # doctest: +SKIP
    ...     y, residual = block(x, residual)
    >>> (y * dy).sum().backward()        # backward uses the forward's recipe   # doctest: +SKIP
    """
    for name, value in (("enabled", enabled), ("frozen_weights", frozen_weights)):
        # bool("no") is True: autocast(enabled="no") turned FP8 on.
        if not isinstance(value, bool):
            raise TypeError(f"opfuse.fp8.autocast: {name}={value!r}; expected True or False")
    if recipe is not None and not isinstance(recipe, Recipe):
        raise TypeError(f"opfuse.fp8.autocast: recipe={recipe!r}; expected opfuse.fp8.TensorScaling() or "
                        f"opfuse.fp8.RowwiseScaling()")
    previous = current_recipe(), weights_frozen()
    _state.recipe = (recipe or TensorScaling()) if enabled else None
    _state.frozen = bool(frozen_weights) and enabled
    try:
        yield _state.recipe
    finally:
        _state.recipe, _state.frozen = previous
