"""The torch.compile backend's rank-agreement check (opfuse/torch_compile/agree.py) at world 2 (gloo),
on a Megatron block (column-parallel up, row-parallel down + all-reduce, add, RMSNorm):

* ranks under the same settings compile and run as eager does, once per group and settings: a
  recompile for a new shape exchanges nothing, a settings change on every rank checks again, a
  graph without collectives or on a group of one rank never touches the store;
* a setting that differs on one rank (``allreduce_chunks``, ``disabled_rules``) raises
  ``RankMismatchError`` on both ranks at compile time, naming the setting, well before any timeout;
  a rank whose settings are invalid (a misspelt rule) passes its error to the other; after an error
  the ranks check in step again.
"""

import time

import pytest
import torch
import torch.distributed as dist

from .test_compile_collectives import H, TOKENS, Block, _copy_shards

KEY = "opfuse/agree-compile/{group}/{number}/{rank}"


def _block(rank, world, group=None):
    torch.manual_seed(0)
    full = Block(None, 1, True)
    mine = Block(group or dist.group.WORLD, world, True)
    _copy_shards(mine, full, rank, world)
    return mine


def _step(model, shape):
    """Output and input gradient of ``model`` on a replicated input (the same on every rank)."""
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(shape[1])).requires_grad_()
    out = model(x)
    out.sum().backward()
    return out.detach(), x.grad


def _compile_error(compiled, shape):
    """The error opfuse raised while compiling ``compiled`` for ``shape`` (Dynamo wraps it)."""
    with pytest.raises(Exception) as caught:
        _step(compiled, shape)
    return getattr(caught.value, "inner_exception", caught.value)


def _checked(store, number) -> bool:
    return store.check([KEY.format(group=dist.group.WORLD.group_name, number=number, rank=0)])


def agreeing(rank, world):
    import opfuse
    from opfuse.torch_compile.agree import CompileAgreement

    store = dist.distributed_c10d._get_default_store()
    mine = _block(rank, world)
    compiled = opfuse.optimize(mine, options={"inductor": False})
    with opfuse.config.override(peer_timeout_ms=30_000):
        for shape in [(2, TOKENS, H), (2, TOKENS + 2, H)]:  # the second recompiles: no new check
            got, grad = _step(compiled, shape)
            want, want_grad = _step(mine, shape)
            torch.testing.assert_close(got, want)
            torch.testing.assert_close(grad, want_grad)
        assert len(opfuse.programs(compiled)) == 2
        assert _checked(store, 1) and not _checked(store, 2)
        with opfuse.config.override(allreduce_chunks=2):  # changed on every rank: checked again
            got, _ = _step(compiled, (2, TOKENS + 4, H))
        torch.testing.assert_close(got, _step(mine, (2, TOKENS + 4, H))[0])
        assert _checked(store, 2) and not _checked(store, 3)

    # No store traffic: a graph without collectives, and collectives on a group of one rank.
    singles = [dist.new_group([r]) for r in range(world)]
    published = []
    original = CompileAgreement.publish
    CompileAgreement.publish = lambda self, *a, **k: published.append(self) or original(self, *a, **k)
    try:
        x = torch.randn(4, H)
        torch.testing.assert_close(opfuse.optimize(lambda t: torch.sin(t) * 2, options={"inductor": False})(x),
                                   torch.sin(x) * 2)
        alone = Block(singles[rank], 1, True)
        torch.testing.assert_close(opfuse.optimize(alone, options={"inductor": False})(x), alone(x))
    finally:
        CompileAgreement.publish = original
    assert published == []


def disagreeing(rank, world):
    import opfuse
    from opfuse.core.agree import RankMismatchError

    # Each case on a group of its own: settings checked on a group are not checked again until this
    # rank's change (a rank that changes them alone meets the others only after the timeout).
    odd = rank == world - 1
    shape = (2, TOKENS, H)
    cases = [({"allreduce_chunks": 2}, "setting allreduce_chunks=", "(OPFUSE_ALLREDUCE_CHUNKS)"),
             ({"disabled_rules": ("allreduce_add_rmsnorm",)}, "setting disabled_rules=", "allreduce_add_rmsnorm")]
    with opfuse.config.override(peer_timeout_ms=30_000):
        for settings, *patterns in cases:
            group = dist.new_group(list(range(world)))
            compiled = opfuse.optimize(_block(rank, world, group), options={"inductor": False})
            start = time.perf_counter()
            with opfuse.config.override(**(settings if odd else {})):
                error = _compile_error(compiled, shape)
            assert time.perf_counter() - start < 20, f"waited for a timeout instead of comparing: {error}"
            assert isinstance(error, RankMismatchError), repr(error)
            text = str(error)
            for pattern in [f"process group {group.group_name!r}", "settings check #1",
                            "the ranks compile with different opfuse settings", "first difference", *patterns]:
                assert pattern in text, f"rank {rank}: {pattern!r} not in:\n{text}"
            # The first differing line is the setting's, on both sides.
            mine, other = text.split("first difference:\n")[1].splitlines()[:2]
            assert mine.split(": ", 1)[1].startswith(patterns[0]) and other.split(": ", 1)[1].startswith(patterns[0])
            # Same settings again: the ranks check in step (#2) and run.
            block = _block(rank, world, group)
            torch.testing.assert_close(_step(opfuse.optimize(block, options={"inductor": False}), shape)[0],
                                       _step(block, shape)[0])
        # Invalid settings on one rank: it raises its own error, the other learns it at once.
        compiled = opfuse.optimize(_block(rank, world, dist.new_group(list(range(world)))), options={"inductor": False})
        with opfuse.config.override(disabled_rules=("no_such_rule",) if odd else ()):
            error = _compile_error(compiled, shape)
        if odd:
            assert isinstance(error, ValueError) and "no_such_rule" in str(error), repr(error)
        else:
            assert isinstance(error, RankMismatchError), repr(error)
            assert f"compiling failed on global rank {world - 1}: ValueError" in str(error), str(error)


@pytest.mark.dist
def test_ranks_under_the_same_settings_agree_once_per_group_and_settings(shared_spawn):
    shared_spawn.run(agreeing, 2, timeout=300)


@pytest.mark.dist
def test_a_setting_differing_on_one_rank_fails_on_every_rank_naming_it(shared_spawn):
    shared_spawn.run(disagreeing, 2, timeout=300)


#: Both tests' cases in one spawn (tests/dist/shared_spawn.py; a case that does not finish there runs
#: alone in its test), the agreeing one first: it counts the settings checks on the default group
#: from the first, which the disagreeing one (on groups of its own) does not touch.
SHARED_CASES = [(agreeing, 2, ()), (disagreeing, 2, ())]
