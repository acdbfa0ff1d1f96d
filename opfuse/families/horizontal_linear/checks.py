"""The ``p2p_overlap`` implementation of ``horizontal_linear``'s sequence-parallel form: the
all-gather + GEMM overlap of ``all_gather_linear`` over the joined weight (same math, one wider
GEMM). Its check and preparation are ``all_gather_linear``'s for the joined shapes."""

from __future__ import annotations

import dataclasses
from typing import Optional

from ..collective_linear import p2p as collective_p2p

__all__ = ["check_p2p", "prepare_p2p"]


def _as_all_gather_linear(spec):
    return dataclasses.replace(spec, op="all_gather_linear")


def check_p2p(spec) -> Optional[str]:
    if spec.group_name is None:
        return "no all-gather to overlap (the input's tokens are not sharded)"
    return collective_p2p.check_all_gather_linear(_as_all_gather_linear(spec))


def prepare_p2p(spec) -> None:
    collective_p2p.prepare(_as_all_gather_linear(spec))
