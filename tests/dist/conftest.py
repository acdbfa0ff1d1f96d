import pytest

from .shared_spawn import SharedSpawn


@pytest.fixture(scope="module")
def shared_spawn(request, tmp_path_factory):
    """The module's ``SHARED_CASES`` run in one spawn per world (tests/dist/shared_spawn.py)."""
    selected = sum(1 for item in request.session.items
                   if item.module is request.module and "shared_spawn" in getattr(item, "fixturenames", ()))
    return SharedSpawn(request.module.SHARED_CASES, selected, str(tmp_path_factory.mktemp("shared_spawn")))


@pytest.fixture(scope="session")
def session_spawn(request, tmp_path_factory):
    """The ``SESSION_CASES`` of every module whose tests use this fixture, run in one spawn per world
    for the session (tests/dist/shared_spawn.py)."""
    items = [item for item in request.session.items if "session_spawn" in getattr(item, "fixturenames", ())]
    modules = list(dict.fromkeys(item.module for item in items))
    planned = [case for module in modules for case in module.SESSION_CASES]
    return SharedSpawn(planned, len(items), str(tmp_path_factory.mktemp("session_spawn")))
