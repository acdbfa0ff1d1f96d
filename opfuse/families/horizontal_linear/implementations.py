"""The horizontal-linear family's implementations: sequence parallel, ``all_gather_linear``'s
peer-to-peer overlap over the joined weight; else the reference (one GEMM)."""

from __future__ import annotations

from ...machinery.implementation import Implementation, ImplementationTable, always
from ..collective_linear import p2p as collective_p2p
from . import checks as horizontal_checks
from . import reference as horizontal_reference

__all__ = ["TABLE"]

TABLE = ImplementationTable("horizontal_linear", {
    "horizontal_linear": [
        Implementation(collective_p2p.NAME, horizontal_checks.check_p2p, collective_p2p.all_gather_linear_forward,
                       collective_p2p.all_gather_linear_backward, horizontal_checks.prepare_p2p,
                       "sequence parallel: all_gather_linear's overlap over the joined weight (one wider GEMM)"),
        Implementation("reference", always, horizontal_reference.forward, horizontal_reference.backward,
                       description="one GEMM over the joined weight (all-gather first when sequence parallel)"),
    ],
})
