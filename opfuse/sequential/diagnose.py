"""Explaining a compiled program's failure at call time.

The per-call guard of a block covers its inputs, the grad mode, its parameters'
``requires_grad`` and every change made through the ops' attributes (:mod:`opfuse.epoch`). A
few changes cannot be seen that cheaply: a parameter's ``.data`` replaced by a tensor of another
shape or dtype, or the process group re-created with another size. When a program raises, the
block is lowered again for the same inputs: if the block no longer accepts them, that error (which
names the op and what changed) is raised instead of the raw one from deep inside the program.
"""

from __future__ import annotations

import torch

from ..ops.base import OpInputError, TensorMeta
from ..ops.group import GroupError
from .lower import lower

__all__ = ["diagnose_failure"]


def diagnose_failure(seq, program, inputs, error: Exception) -> None:
    """Raise a clear error if ``seq`` changed under ``program`` so that it no longer accepts
    ``inputs``; return otherwise (the caller re-raises ``error``)."""
    if isinstance(error, (OpInputError, GroupError)):
        return
    try:
        lower(seq, [TensorMeta.of(t) for t in inputs if isinstance(t, torch.Tensor)])
    except (OpInputError, GroupError) as clear:
        raise type(clear)(
            f"{clear} (the block changed after it was compiled for these inputs; the call failed with "
            f"{type(error).__name__}: {error})") from error
    except Exception:  # noqa: BLE001 - the diagnosis must never hide the original error
        return
