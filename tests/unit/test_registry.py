"""The backend registry's contract: capability checks are pure (no allocation, no collective), only
the chosen implementation is prepared, forcing is strict, one name per fused op, and the custom-op
factory gives every fused op a schema, a fake and autograd."""

import pytest
import torch

from opfuse.core import dispatch as implementations
from opfuse.machinery import fused_op as registry
from opfuse.machinery.implementation import CallSpec, Implementation, ImplementationError, choose, forced_for
from opfuse.families.residual_norm import cuda as norm_cuda
from opfuse.runtime import symm_pool
from opfuse.ops.base import TensorMeta

CUDA = torch.device("cuda", 0)


def _spec(op="allreduce_add_rmsnorm", tokens=4, hidden=64, dtype=torch.bfloat16, device=CUDA, world=2):
    x = TensorMeta((tokens, hidden), dtype, device)
    return CallSpec(op=op, inputs={"x": x, "residual": x, "bias": None, "weight": TensorMeta((hidden,), dtype, device),
                                   "norm_bias": None},
                    attrs={"norm": "rms", "eps": 1e-6, "write_residual": True}, group_name="tp", world_size=world)


def test_only_the_chosen_implementation_is_prepared():
    prepared = []

    def impl(name, capable):
        return Implementation(name, lambda spec: None if capable else f"{name} cannot", lambda *a: None,
                              prepare=lambda spec: prepared.append(name))

    choice = choose(_spec(), [impl("a", False), impl("b", True), impl("c", True)])
    assert choice.name == "b" and prepared == ["b"] and choice.skipped == (("a", "a cannot"),)


def test_prepare_runs_on_real_tensors_inside_a_fake_tensor_mode():
    # torch.compile's joint-graph pass (where opfuse selects implementations) runs under a
    # FakeTensorMode; prepare() allocates and exchanges real data (on GPUs: all_gather_object,
    # whose .item() raised DataDependentOutputException there and broke the graph).
    from torch._subclasses.fake_tensor import FakeTensorMode

    seen = []

    def real_sum(where):
        t = torch.arange(3.0)
        seen.append((where, type(t).__name__, t.sum().item()))

    def check(spec):
        real_sum("check")
        return None

    impls = [Implementation("a", check, lambda *a: None, prepare=lambda spec: real_sum("prepare"))]
    with FakeTensorMode():
        assert choose(_spec(), impls).name == "a"
    assert seen == [("check", "Tensor", 3.0), ("prepare", "Tensor", 3.0)]


def test_the_symmetric_pool_opens_on_real_tensors_inside_a_fake_tensor_mode(monkeypatch):
    from torch._subclasses.fake_tensor import FakeTensorMode

    seen = []

    def open_(pg, device, key):
        seen.append(type(torch.zeros(1)).__name__)
        return None

    monkeypatch.setattr(symm_pool.SymmetricPool, "_open", staticmethod(open_))
    monkeypatch.setattr(symm_pool.groups, "resolve", lambda group: type("PG", (), {"group_name": "fake-tp"})())
    with FakeTensorMode():
        assert symm_pool.open_pool("fake-tp", torch.device("cuda", 0)) is None
    assert seen == ["Tensor"]


def test_forcing_is_strict():
    impls = [Implementation("a", lambda s: "no", lambda *a: None), Implementation("b", lambda s: None, lambda *a: None)]
    with pytest.raises(ImplementationError, match="forced implementation 'a' cannot run: no"):
        choose(_spec(), impls, forced="a")
    with pytest.raises(ImplementationError, match=r"forced implementation 'z' does not exist; known: \['a', 'b'\]"):
        choose(_spec(), impls, forced="z")
    assert choose(_spec(), impls, forced="b").name == "b"


def test_a_bare_forced_name_forces_only_the_ops_that_have_it():
    impls = [Implementation("a", lambda s: None, lambda *a: None), Implementation("b", lambda s: None, lambda *a: None)]
    assert forced_for("op", impls, {None: "b"}) == "b"
    assert forced_for("op", impls, {None: "cuda"}) is None  # another family's name: this op chooses freely
    assert forced_for("op", impls, {"op": "a", None: "b"}) == "a"  # its own entry wins over the bare name
    assert forced_for("op", impls, {"op": "z"}) == "z"  # named for this op: checked (and refused) by choose
    assert forced_for("op", impls, {"other": "a"}) is None


class _FakeExtension:
    MAX_WORLD = 8

    @staticmethod
    def oneshot_region_bytes(world, capacity):
        return world * capacity * 3

    @staticmethod
    def twoshot_region_bytes(world, capacity):
        return 2 * world * capacity

    @staticmethod
    def lamport_region_bytes(world, capacity):
        return 4 * capacity


class _Pool:
    """A pool that fails loudly if a check reserves anything."""

    def __init__(self, fits):
        self.fits, self.asked = fits, []

    def can_reserve_all(self, items):
        self.asked.extend(items)
        return self.fits

    def reserve(self, name, nbytes):
        raise AssertionError("a capability check reserved symmetric memory")


def test_peer_kernel_checks_are_pure(monkeypatch):
    """The one-shot / two-shot checks answer from cached state only: no reservation, no barrier,
    no collective; whether a region fits is asked of the pool without reserving it."""
    monkeypatch.setattr(norm_cuda.extension, "load", lambda family: _FakeExtension)
    monkeypatch.setattr(norm_cuda.dist, "barrier", lambda *a, **k: pytest.fail("a check called a barrier"))
    monkeypatch.setattr(norm_cuda.dist, "all_gather_object", lambda *a, **k: pytest.fail("a check ran a collective"))
    pool = _Pool(fits=True)
    monkeypatch.setattr(symm_pool, "lookup", lambda group, device=None: (pool, None))
    # a table in which every peer kernel takes this message (the shipped one keeps the Lamport kernel off)
    table = norm_cuda.crossovers.CrossoverTable.from_dict(
        {"worlds": {"2": [{"row_bytes": 128, "oneshot_max": 1 << 20, "twoshot_max": None, "lamport_max": None}]}})
    monkeypatch.setattr(norm_cuda.crossovers, "table", lambda: table)
    assert norm_cuda.check_oneshot(_spec()) is None
    assert norm_cuda.check_twoshot(_spec()) is None
    assert norm_cuda.check_lamport(_spec()) is None
    assert pool.asked and all(name.startswith("residual_norm/") for name, _ in pool.asked)
    pool.fits = False
    assert "symmetric pool cannot hold" in norm_cuda.check_oneshot(_spec())
    monkeypatch.setattr(symm_pool, "lookup", lambda group, device=None: (None, "group has one rank"))
    assert norm_cuda.check_oneshot(_spec()) == "no peer memory: group has one rank"


def test_one_name_per_fused_op():
    """The fused op's name is its kind, its table key and its custom op (and its backward's)."""
    table = implementations.names()
    fused_classes = [cls for cls in _subclasses(registry.FusedOp) if cls.name]
    assert {cls.name for cls in fused_classes} == set(table)
    for cls in fused_classes:
        assert hasattr(torch.ops.opfuse, cls.name), cls.name
        assert table[cls.name][-1] == "reference"


def _subclasses(cls):
    for sub in cls.__subclasses__():
        yield sub
        yield from _subclasses(sub)


def test_factory_rejects_a_prototype_without_impl_last():
    def proto(x: torch.Tensor, other: str) -> torch.Tensor:
        """Prototype."""

    with pytest.raises(TypeError, match="last parameter must be 'impl: str'"):
        registry.define_fused_op("test_bad_prototype", lookup=implementations.get, forward=proto,
                                 fake=lambda x, other: x)
