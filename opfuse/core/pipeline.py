"""The pass pipeline, top to bottom, and the passes users register into it.

Each pass is ``fn(graph_module, ctx) -> None`` and edits the graph in place (``ctx`` is a
:class:`~opfuse.machinery.context.PassContext`). The built-in passes, in order::

    partition               expand composite ops, insert the collectives their layouts need
    horizontal_gemm         GEMMs reading the same value -> one GEMM (registered with register_pass)
    all_gather_keep         an all-gather other ops read too -> fused with its largest GEMM, the gathered
                            value kept for the others (torch.compile graphs; registered with register_pass)
    linear_reduce_scatter_batch  GEMM -> split/cat -> reduce-scatter of batch > 1 sequences -> one
                            linear_reduce_scatter (torch.compile graphs; registered with register_pass)
    fuse                    fusion rules by priority, to a fixed point
    cleanup                 fold what no rule fused and would round twice (GEMM + bias, extra output +
                            norm), drop identities and dead values
    select_implementations  backend dispatch per fused op
    verify                  lint and invariants

Users add passes at named points (:func:`register_pass`); :func:`run_pipeline` is the one entry
point every front end compiles through, so registered passes run for ``ops.Sequential`` blocks
and graphs from ``torch.compile`` alike. After each registered pass the graph is verified (the
error names the pass) and ``OPFUSE_DUMP`` writes it.
"""

from __future__ import annotations

from typing import Callable

from torch import fx

from ..config import config
from .passes.cleanup import cleanup
from ..machinery.context import PassContext
from .passes.fuse import fuse
from .passes.gather_keep import all_gather_keep
from .passes.horizontal import horizontal_gemm
from .passes.scatter_batch import linear_reduce_scatter_batch
from .passes.partition import partition
from ..machinery.graph_pass import Pass, PassError, PassRegistry, function_location
from ..machinery.rule import caller_location
from .passes.select import select_implementations
from .passes.verify import VerifyError, check_invariants, verify

__all__ = ["BUILTIN_PASSES", "Pass", "PassContext", "PassError", "register_pass", "remove_pass", "passes",
           "disabled_passes", "run_pipeline"]


def _builtin(name: str, fn, required: bool = False) -> Pass:
    return Pass(name, fn, source=function_location(fn, "?"), builtin=True, required=required)


#: The stages every program goes through, in order.
BUILTIN_PASSES: tuple[Pass, ...] = (
    _builtin("partition", partition, required=True),
    _builtin("fuse", fuse),
    _builtin("cleanup", cleanup),
    _builtin("select_implementations", select_implementations, required=True),
    _builtin("verify", verify, required=True),
)

_PASSES = PassRegistry(BUILTIN_PASSES)


def register_pass(fn: Callable | None = None, *, name: str, after: str | None = None, before: str | None = None):
    """Add a graph pass ``fn(graph_module, ctx)`` to the pipeline (also a decorator).

    ``after`` / ``before`` name an anchor: a built-in pass (``partition``, ``fuse``, ``cleanup``,
    ``select_implementations``, ``verify``) or a registered one (see :func:`passes`). Without
    either the pass runs after fusion, before ``cleanup``. Unknown anchors, duplicate names,
    impossible placements and functions that cannot be called as ``fn(graph_module, ctx)`` raise
    :class:`PassError` here. Returns ``fn``.

    Examples
    --------
    >>> @register_pass(name="count_linears", after="partition")
    ... def count_linears(gm, ctx):
    ...     ctx.note(f"{sum(ctx.kind(n) == 'BasicLinear' for n in gm.graph.nodes)} linears")
    >>> _ = remove_pass("count_linears")
    """
    if after is None and before is None:
        before = "cleanup"
    registered_at = caller_location(1)

    def finish(function: Callable) -> Callable:
        _PASSES.add(Pass(name, function, source=function_location(function, registered_at), after=after,
                         before=before))
        return function

    return finish if fn is None else finish(fn)


def remove_pass(name: str) -> Pass:
    """Unregister the pass called ``name`` and return it."""
    return _PASSES.remove(name)


def passes() -> list[Pass]:
    """The pipeline: every pass (built-in and registered) in the order it runs."""
    return _PASSES.ordered()


def disabled_passes(*names: str):
    """Context manager: passes ``names`` do not run inside the block (``partition``,
    ``select_implementations`` and ``verify`` cannot be disabled)."""
    return _PASSES.disabled(*names)


def get_pass_registry() -> PassRegistry:
    """The process-wide pass registry."""
    return _PASSES


# Built-in passes registered through the public API (they could live outside opfuse).
register_pass(horizontal_gemm, name="horizontal_gemm", after="partition")
register_pass(all_gather_keep, name="all_gather_keep", after="horizontal_gemm")
register_pass(linear_reduce_scatter_batch, name="linear_reduce_scatter_batch", after="all_gather_keep")


def _run_registered(item: Pass, gm: fx.GraphModule, ctx: PassContext,
                    after_pass: Callable[[str, fx.GraphModule], None]) -> None:
    try:
        item.run(gm, ctx)
    except (PassError, VerifyError):
        raise
    except Exception as error:
        raise PassError(f"pass {item.name!r} ({item.source}) raised {type(error).__name__}: {error}") from error
    if config.verify:
        try:
            check_invariants(gm, ctx, f"after pass {item.name!r} ({item.source})")
        except VerifyError:
            try:  # the broken graph is the most useful dump there is
                after_pass(item.name, gm)
            except Exception:  # noqa: BLE001 - a graph broken enough not to render
                pass
            raise


def run_pipeline(gm: fx.GraphModule, ctx: PassContext, after_pass: Callable[[str, fx.GraphModule], None]) -> None:
    """Run every active pass on ``gm`` in order; ``after_pass(name, gm)`` sees the graph after
    lowering (``"lowered"``) and after each pass (dumps, the unfused copy)."""
    ctx.graph_module = gm
    after_pass("lowered", gm)
    for item in _PASSES.active():
        ctx.current = item
        if item.builtin:
            item.run(gm, ctx)
        else:
            gm.recompile()  # a registered pass may run the module it is given
            _run_registered(item, gm, ctx, after_pass)
        after_pass(item.name, gm)
    ctx.current = None
    # Built-in passes edit the graph only; its Python code is generated once, for the final graph.
    gm.recompile()
