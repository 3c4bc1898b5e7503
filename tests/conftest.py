"""Session fixtures shared by every test file: the tiny Qwen3 checkpoints (untied and tied),
built once into the cache ($NANOSERVE_CACHE, else ~/.cache/nanoserve, as for `nanoserve up`) and
reused across runs."""
from pathlib import Path

import pytest

from nanoserve_cli.cache import demo_model_dir
from tests.services.processes import release_ports


def _tiny_model(tied: bool) -> Path:
    path = demo_model_dir(tied)
    if not (path / "model.safetensors").exists():  # written last: its presence means a whole build
        # imported here: make test's pytest-xdist controller loads this file too, and torch with
        # transformers would cost it ~2 s before it starts its workers
        from nanoserve_cli.demo_model import build_tiny_model

        build_tiny_model(path, tied)
    return path


@pytest.fixture(scope="session")
def tiny_model_dir() -> Path:
    return _tiny_model(tied=False)


@pytest.fixture(scope="session")
def tiny_tied_model_dir() -> Path:
    return _tiny_model(tied=True)


# Folders whose files share the servers of their conftest.py's session fixtures: one group, so that
# one worker starts them once (each worker would start its own). The longest groups: handed out first.
SHARED_SERVER_FOLDERS = ("tests/gateway/", "tests/routers/")
# Folders whose files start servers: tens of seconds to two minutes a file, handed out next.
SERVER_FOLDERS = ("tests/services/", "tests/deploy/")


def _group(item: pytest.Item) -> str:
    folder = next((f for f in SHARED_SERVER_FOLDERS if item.nodeid.startswith(f)), None)
    return folder or item.nodeid.split("::")[0]


def _turn(item: pytest.Item) -> int:
    """When the item's group is handed out: the longest groups first, so that the run ends on short
    files that fill the workers' last minutes evenly (a long group taken last runs alone at the end)."""
    if item.nodeid.startswith(SHARED_SERVER_FOLDERS):
        return 0
    if item.nodeid.startswith(SERVER_FOLDERS):
        return 1
    return 2 if item.get_closest_marker("xdist_group") is not None else 3


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist's, which reads the groups into the node ids
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """For pytest-xdist's --dist loadgroup (make test): each file is one group (or its folder, where the
    folder's files share servers), run by one worker in order, so the servers its fixtures start are
    started once; a test that names a group of its own (independent and long: the Triton interpreter
    cases) runs wherever a worker is free. Workers take groups in collection order
    (--no-loadscope-reorder; by default the groups of most tests go first), which _turn sets."""
    items.sort(key=_turn)  # stable: a file's tests keep their order
    for item in items:
        if item.get_closest_marker("xdist_group") is None:
            item.add_marker(pytest.mark.xdist_group(_group(item)))


@pytest.fixture(autouse=True)
def _release_ports():
    """Each test's reserved ports (processes.free_port) go when it ends, bound by its servers or not."""
    yield
    release_ports()
