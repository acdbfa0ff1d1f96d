"""The per-GPU choices of ``grouped_linear`` (opfuse/families/grouped_linear/tuning.py): size classes,
the measured order the select pass applies (measured implementations first, the rest in table
order, forcing untouched), the device name read once, and the shipped tables' consistency."""

import pytest
import torch

import opfuse
from opfuse import ops
from opfuse.core import dispatch as implementations
from opfuse.families.grouped_linear import persistent, tuning
from opfuse.machinery.implementation import CallSpec, Implementation, choose
from opfuse.runtime import device
from opfuse.ops.base import TensorMeta

H100 = "NVIDIA H100 80GB HBM3"


def spec(tokens=32768, groups=32, k=7168, n=2048, device="cuda:0", requires_grad=False):
    meta = lambda shape, dt=torch.bfloat16: TensorMeta(tuple(shape), dt, torch.device(device))  # noqa: E731
    return CallSpec("grouped_linear", {"x": meta([tokens, k]), "group_sizes": meta([groups], torch.int32),
                                       "weight": meta([groups, n, k]), "bias": None},
                    {"fsdp": False}, requires_grad=requires_grad)


def fake_impls(*names):
    return [Implementation(name, lambda s: None, lambda *a: None) for name in names]


@pytest.fixture
def on_h100(monkeypatch):
    """Pretend device 0 is an H100 (the name lookup is cached per device index)."""
    calls = []

    def name(index):
        calls.append(index)
        return H100

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", name)
    device._name_of.cache_clear()
    yield calls
    device._name_of.cache_clear()


@pytest.mark.parametrize("shape, cls", [
    ((256, 32, 7168, 2048), "decode"),          # 8 rows per expert
    ((544, 32, 7168, 2048), "small_m"),         # 17 rows per expert
    ((4096, 32, 7168, 2048), "small_m"),        # 128 rows per expert
    ((4128, 32, 7168, 2048), "large_m"),
    ((32768, 32, 7168, 2048), "large_m"),
    ((32768, 32, 128, 2048), "small_m"),        # K too small for 128x256 tiles to pay
    ((32768, 32, 7168, 192), "small_m"),
    ((0, 8, 64, 64), "decode"),
])
def test_size_classes(shape, cls):
    assert tuning.size_class(*shape) == cls


def test_size_class_boundaries():
    assert tuning.size_class(16 * 32, 32, 4096, 4096) == "decode"
    assert tuning.size_class(16 * 32 + 1, 32, 4096, 4096) == "small_m"
    assert tuning.size_class(128 * 32, 32, 4096, 4096) == "small_m"
    assert tuning.size_class(128 * 32 + 1, 32, 4096, 4096) == "large_m"


def test_measured_order_moves_measured_first_and_keeps_the_rest(on_h100):
    table = {H100: {"large_m": ("c", "a"), "decode": ("b",)}}
    impls = fake_impls("a", "b", "c", "unmeasured", "reference")
    assert [i.name for i in tuning.order(spec(), impls, table)] == ["c", "a", "b", "unmeasured", "reference"]
    assert [i.name for i in tuning.order(spec(tokens=256), impls, table)] == ["b", "a", "c", "unmeasured",
                                                                                "reference"]
    # A class without an entry, another GPU, a CPU call: the table order.
    assert [i.name for i in tuning.order(spec(tokens=2048), impls, table)] == ["a", "b", "c", "unmeasured",
                                                                                 "reference"]
    assert tuning.order(spec(), impls, {"NVIDIA H200": {"large_m": ("c",)}}) == impls
    assert tuning.order(spec(device="cpu"), impls, table) == impls
    # Names the table does not hold are ignored.
    assert [i.name for i in tuning.order(spec(), impls, {H100: {"large_m": ("gone", "b")}})][:2] == ["b", "a"]


def test_training_calls_use_the_train_entry_then_the_forward_one(on_h100):
    table = {H100: {"large_m": ("a", "b"), "large_m+train": ("b", "a")}}
    impls = fake_impls("a", "b")
    assert [i.name for i in tuning.order(spec(requires_grad=True), impls, table)] == ["b", "a"]
    assert [i.name for i in tuning.order(spec(requires_grad=False), impls, table)] == ["a", "b"]
    table = {H100: {"large_m": ("b", "a")}}
    assert [i.name for i in tuning.order(spec(requires_grad=True), impls, table)] == ["b", "a"]


def test_device_name_is_read_once_per_device(on_h100):
    for _ in range(3):
        assert tuning.device_name(torch.device("cuda:0")) == H100
    tuning.device_name(torch.device("cuda:1"))
    assert on_h100 == [0, 1]
    assert tuning.device_name(torch.device("cpu")) is None


def test_measured_order_is_what_choose_walks(on_h100, monkeypatch):
    # A measured entry decides among capable implementations; incapable ones are still skipped.
    table = {H100: {"large_m": ("slow_check_fails", "b", "a")}}
    impls = [Implementation("a", lambda s: None, lambda *a: None),
             Implementation("b", lambda s: None, lambda *a: None),
             Implementation("slow_check_fails", lambda s: "not here", lambda *a: None)]
    ordered = tuning.order(spec(), impls, table)
    choice = choose(spec(), ordered)
    assert choice.name == "b" and choice.skipped == (("slow_check_fails", "not here"),)
    # Forcing ignores the measured order.
    assert choose(spec(), ordered, forced="a").name == "a"


def test_select_pass_asks_for_the_measured_order(monkeypatch):
    seen = []

    def reverse(call_spec, impls):
        seen.append(call_spec)
        return [impls[-1], *impls[:-1]]      # reference first

    monkeypatch.setitem(implementations.table("grouped_linear").measured_order, "grouped_linear", reverse)
    layer = ops.GroupedLinear(4, 8, 6)
    x, counts = torch.randn(10, 8), torch.tensor([3, 0, 4, 2])
    with opfuse.config.override(fuse=True):
        program = ops.Sequential(layer).program(x, counts)
    assert program.fusions[0].impl == "reference" and program.fusions[0].skipped == ()
    assert seen and seen[0].op == "grouped_linear" and seen[0].x.shape == (10, 8)
    table_order = implementations.table("grouped_linear").names()["grouped_linear"]
    assert [impl.name for impl in implementations.for_op("grouped_linear")] == table_order


def test_shipped_tables_name_known_implementations_and_classes():
    known = set(implementations.names()["grouped_linear"])
    keys = {tuning.class_key(c, t) for c in tuning.SIZE_CLASSES for t in (False, True)}
    for device, entry in tuning.ORDER.items():
        assert device.startswith("NVIDIA "), device
        for key, names in entry.items():
            assert key in keys, (device, key)
            assert names and set(names) <= known - {"reference"}, (device, key, names)
            assert len(set(names)) == len(names), (device, key)
    for device, entry in tuning.PERSISTENT_TILES.items():
        for cls, tiles in entry.items():
            assert cls in tuning.SIZE_CLASSES and isinstance(tiles, tuning.Tiles), (device, cls)


def test_persistent_tiles_default_and_candidates_fit_an_sm():
    # Shared memory per stage (A and B tiles, 2 bytes each) times stages, times programs per SM,
    # must fit H100/H200's 227 KiB. None warp-specialises: that kernel did not finish on H100
    # (Triton 3.6; docs/PERF_NOTES.md).
    for cls in tuning.SIZE_CLASSES:
        for t in (persistent.default_tiles(cls), *persistent.CANDIDATES[cls]):
            smem = t.num_stages * (t.bm + t.bn) * t.bk * 2
            assert smem * t.programs_per_sm <= 227 * 1024, (cls, t)
            assert not t.warp_specialize, (cls, t)
    assert persistent.tiles(torch.device("cpu"), 32768, 32, 7168, 2048) == persistent.default_tiles("large_m")


def test_persistent_check_explains_rejections():
    assert persistent.check(spec(device="cpu")) == "needs a CUDA device"
