"""The reusable rule predicates (``opfuse.passes.predicates``, the public name; defined in
:mod:`opfuse.machinery.predicates`)."""

from ..machinery.predicates import *  # noqa: F401,F403 - the public name of the machinery's predicates
from ..machinery.predicates import __all__  # noqa: F401
