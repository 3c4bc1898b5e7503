"""Session fixtures shared by every test file: the tiny Qwen3 checkpoints (untied and tied),
built once into the cache ($NANOSERVE_CACHE, default <repo>/.cache) and reused across runs."""
from pathlib import Path

import pytest

from model.tiny import build_tiny_model, cache_dir


def _tiny_model(name: str, tied: bool) -> Path:
    path = cache_dir() / name
    if not (path / "model.safetensors").exists():  # written last: its presence means a whole build
        build_tiny_model(path, tied)
    return path


@pytest.fixture(scope="session")
def tiny_model_dir() -> Path:
    return _tiny_model("tiny-qwen3", tied=False)


@pytest.fixture(scope="session")
def tiny_tied_model_dir() -> Path:
    return _tiny_model("tiny-qwen3-tied", tied=True)
