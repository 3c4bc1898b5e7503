"""This process's place in the tensor-parallel group. The group itself is joined elsewhere
(worker_svc.distributed); without it every layer is a plain, unsharded layer."""
from typing import Protocol

import torch
import torch.distributed as dist


def tp_rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def tp_world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def divide(total: int, parts: int, what: str) -> int:
    if total % parts:
        raise ValueError(f"{what} ({total}) is not divisible by the tensor-parallel size ({parts})")
    return total // parts


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sums the partial results of every rank, in place."""
    if tp_world_size() > 1:
        dist.all_reduce(x)
    return x


def broadcast_from_first_rank(x: torch.Tensor) -> torch.Tensor:
    """Every rank ends with rank 0's x, in place."""
    if tp_world_size() > 1:
        dist.broadcast(x, src=0)
    return x


class CheckpointTensor(Protocol):
    """What a sharded layer's weight loader reads: a whole tensor, or one still in its file that
    reads only the part narrowed to (model.loader.StoredTensor); `shape` is the full shape."""
    shape: torch.Size

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor: ...


def check_shape(loaded: CheckpointTensor, expected: tuple[int, ...]) -> None:
    """Checkpoint tensors are checked against the full (unsharded) shape before a rank slices them."""
    if tuple(loaded.shape) != tuple(expected):
        raise ValueError(f"shape {tuple(loaded.shape)} in the checkpoint, expected {tuple(expected)}")
