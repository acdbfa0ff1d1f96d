import pytest
import torch
import torch.distributed as dist


@pytest.fixture(scope="session")
def world1():
    """A one-rank gloo process group: collectives are identities, so rules with collectives can be
    compiled and run in a single process."""
    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    return dist.group.WORLD


@pytest.fixture
def rng():
    return torch.Generator().manual_seed(torch.seed() % (2**31))


@pytest.fixture
def fresh_dynamo():
    """Dynamo's caches cleared before and after a test (compile tests count the graphs they make)."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()
