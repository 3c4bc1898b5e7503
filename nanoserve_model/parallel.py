"""This process's place in the tensor-parallel group. The group itself is joined elsewhere
(worker_svc.distributed); without it every layer is a plain, unsharded layer."""
from typing import Callable, Protocol

import torch
import torch.distributed as dist
from torch import nn

# Which checkpoint tensor of a packed parameter (None: the parameter's only one); stacked experts: (expert, part)
ShardId = int | str | tuple[int, int] | None


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
    reads only the part narrowed to (nanoserve_model.loader.StoredTensor); `shape` is the full shape."""
    shape: torch.Size

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor: ...


def set_weight_loader(param: nn.Parameter, loader: Callable[..., None],
                      checkpoint_shapes: dict[ShardId, tuple[int, ...]]) -> nn.Parameter:
    """How `param` is filled from a checkpoint: `loader(param, tensor[, shard_id])` copies this rank's
    part of each checkpoint tensor, whose full (unsharded) shape is `checkpoint_shapes[shard_id]`. The
    model loader checks every shape against these before it reads any weight."""
    param.weight_loader = loader
    param.checkpoint_shapes = {shard_id: tuple(shape) for shard_id, shape in checkpoint_shapes.items()}
    return param


def stack_checkpoint_tensors(param: nn.Parameter, names: dict[str, ShardId]) -> nn.Parameter:
    """Marks a parameter that stacks many checkpoint tensors (a layer's experts): `names` maps each
    tensor's name, relative to the parameter's module, to its shard id for the weight loader."""
    param.checkpoint_names = names
    return param
