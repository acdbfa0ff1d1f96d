"""Bounded waits on peers, what can be checked without a GPU: a timeout record becomes an error that
names the op, the wait and the peer, on the call after it and every later one; the overlap plans
hand the setting to every signal wait."""

import pytest
import torch

import opfuse
from opfuse.families.collective_linear.overlap import cpu_binding
from opfuse.runtime import peer_watch

SITES = {"one-shot": 1, "two-shot reduce-scatter": 2, "two-shot all-gather": 3}


class FakeRecord:
    """Stands for the extension's PeerWatch (host-mapped record of the first wait that timed out)."""

    flag, record = 0x1000, 0x2000

    def __init__(self):
        self.fields = (False, 0, 0, 0, 0, 0, 0)

    def failed(self):
        return self.fields[0]

    def read(self):
        return self.fields


@pytest.fixture
def watch():
    made = peer_watch.PeerWatch(FakeRecord(), ("allreduce", "allreduce_add_rmsnorm"), SITES, [4, 5, 6, 7],
                                "residual_norm twoshot region of group 'tp'")
    yield made
    peer_watch._WATCHES.remove(made)


def test_the_default_bound_is_the_process_group_timeout_range():
    assert opfuse.config.peer_timeout_ms == 600_000
    with opfuse.config.override(peer_timeout_ms=1500):
        assert peer_watch.timeout_ns() == 1_500_000_000
    with opfuse.config.override(peer_timeout_ms=0):
        assert peer_watch.timeout_ns() == 0  # wait forever


def test_a_timeout_record_raises_on_every_later_check(watch):
    watch.check()
    opfuse.check_peers()
    watch.record.fields = (True, 2, 1, 3, 1, 17, 1_503_000_000)
    for _ in range(2):
        with pytest.raises(opfuse.PeerTimeoutError) as caught:
            opfuse.check_peers()
        text = str(caught.value)
        assert text.startswith("opfuse allreduce_add_rmsnorm: rank 1 of its group waited 1503 ms in the two-shot "
                               "reduce-scatter for peer rank 3 (global rank 7), which never arrived"), text
        assert "OPFUSE_PEER_TIMEOUT_MS" in text and "residual_norm twoshot region of group 'tp'" in text
        assert "every later call raises" in text


def test_overlap_plans_pass_the_timeout_to_every_signal():
    seen = []

    class Handle(cpu_binding.NoOpHandle):
        def put_signal(self, peer, channel=0, timeout_ms=0):
            seen.append(timeout_ms)

        def wait_signal(self, peer, channel=0, timeout_ms=0):
            seen.append(timeout_ms)

        def barrier(self, channel=0, timeout_ms=0):
            seen.append(timeout_ms)

    for op in ("AG+GEMM", "GEMM+RS"):
        plan, cols, buffers, b = cpu_binding.tiny_case_plans(2, 2048, op)[0]
        bound = cpu_binding.bind(plan, cols, handle=Handle())
        with opfuse.config.override(peer_timeout_ms=1234):
            bound(b, **buffers)
    assert seen and set(seen) == {1234}
