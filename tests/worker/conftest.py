from typing import Iterator

import pytest

from tests.worker.interpreter import Interpreter


@pytest.fixture(scope="session")
def interpreter() -> Iterator[Interpreter]:
    """The Triton interpreter's process (tests/worker/interpreter.py), one per pytest process."""
    child = Interpreter()
    try:
        yield child
    finally:
        child.close()
