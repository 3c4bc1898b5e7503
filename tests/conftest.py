"""Session fixtures shared by every test file: the tiny Qwen3 checkpoints (untied and tied),
built once into the cache ($NANOSERVE_CACHE, else ~/.cache/nanoserve, as for `nanoserve up`) and
reused across runs."""
from pathlib import Path

import pytest

from nanoserve_cli.cache import demo_model_dir
from nanoserve_cli.demo_model import build_tiny_model
from tests.services.processes import release_ports


def _tiny_model(tied: bool) -> Path:
    path = demo_model_dir(tied)
    if not (path / "model.safetensors").exists():  # written last: its presence means a whole build
        build_tiny_model(path, tied)
    return path


@pytest.fixture(scope="session")
def tiny_model_dir() -> Path:
    return _tiny_model(tied=False)


@pytest.fixture(scope="session")
def tiny_tied_model_dir() -> Path:
    return _tiny_model(tied=True)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """For pytest-xdist's --dist loadgroup (make test): each file is one group, run by one worker in
    order, so the servers its module fixtures start are started once; a test that names a group of
    its own (independent and long: the Triton interpreter cases) runs wherever a worker is free."""
    for item in items:
        if item.get_closest_marker("xdist_group") is None:
            item.add_marker(pytest.mark.xdist_group(item.nodeid.split("::")[0]))


@pytest.fixture(autouse=True)
def _release_ports():
    """Each test's reserved ports (processes.free_port) go when it ends, bound by its servers or not."""
    yield
    release_ports()
