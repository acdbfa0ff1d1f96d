"""What a fused-op family declares: its fused ops' implementation table, its fusion rules and its
torch.compile recognizers.

A family is one folder under ``opfuse/families/`` (op, reference, implementations, rules, kernels);
its ``__init__.py`` builds its :class:`Family` and ``opfuse/families/__init__.py`` lists every
family once (:data:`opfuse.families.FAMILIES`). The rule registry and the dispatch table are built
by iterating that list: nothing registers itself on import.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

from .implementation import ImplementationTable
from .recognizer import Recognizer
from .rule import Rule

__all__ = ["Family"]


@dataclasses.dataclass(frozen=True)
class Family:
    """A fused-op family.

    Attributes
    ----------
    name:
        The folder's name (``residual_norm``); a family with CUDA kernels keeps them in
        ``families/<name>/csrc/`` (built as the extension module ``_opfuse_<name>``).
    implementations:
        Its fused ops and their implementations in the order tried (reference last).
    rules:
        Its fusion rules, each building one of its fused ops.
    recognizers:
        How the torch.compile front end finds, in aten graphs, the basic ops only its rules read
        (none when the front end's own recognizers cover them).
    """

    name: str
    implementations: ImplementationTable
    rules: Sequence[Rule] = ()
    recognizers: Sequence[Recognizer] = ()

    def __post_init__(self):
        if not self.name.isidentifier():
            raise ValueError(f"Family: name={self.name!r}; expected the family folder's name (an identifier)")
        if not isinstance(self.implementations, ImplementationTable):
            raise TypeError(f"Family {self.name!r}: implementations={self.implementations!r}; expected an "
                            f"opfuse.machinery.implementation.ImplementationTable")
        for rule in self.rules:
            if not isinstance(rule, Rule):
                raise TypeError(f"Family {self.name!r}: rules holds {rule!r}; expected opfuse Rule objects")
        for recognizer in self.recognizers:
            if not isinstance(recognizer, Recognizer):
                raise TypeError(f"Family {self.name!r}: recognizers holds {recognizer!r}; expected opfuse Recognizer "
                                f"objects")
        object.__setattr__(self, "rules", tuple(self.rules))
        object.__setattr__(self, "recognizers", tuple(self.recognizers))

    def fused_ops(self) -> list[str]:
        """The names of the family's fused ops."""
        return self.implementations.ops()
