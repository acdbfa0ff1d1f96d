import pytest

from .shared_spawn import SharedSpawn


@pytest.fixture(scope="module")
def shared_spawn(request, tmp_path_factory):
    """The module's ``SHARED_CASES`` run in one spawn per world (tests/dist/shared_spawn.py)."""
    selected = sum(1 for item in request.session.items
                   if item.module is request.module and "shared_spawn" in item.fixturenames)
    return SharedSpawn(request.module, selected, str(tmp_path_factory.mktemp("shared_spawn")))
