"""Arithmetic both services use on block counts."""
from typing import TypeVar

T = TypeVar("T")  # int, or a numpy array of ints


def cdiv(a: T, b: int) -> T:
    """a / b rounded up: the blocks that `a` tokens fill at `b` tokens a block."""
    return -(-a // b)
