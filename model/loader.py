"""Builds a Qwen3 model on a device and fills it from a checkpoint's *.safetensors files, each rank
reading only its shard; checkpoint names that do not match the model one to one are errors."""
import contextlib
from pathlib import Path
from typing import Iterator

import torch
from safetensors import safe_open
from torch import nn

from model.parallel import CheckpointTensor
from model.qwen3 import Qwen3ForCausalLM
from model.qwen3_config import Qwen3Config

ShardId = int | str | None


class StoredTensor:
    """A tensor still in its safetensors file: a rank's weight loader narrows it to its shard and only
    those bytes are read (safe_open's get_slice), so no rank holds a whole sharded tensor."""

    def __init__(self, stored):  # safetensors' slice handle
        self.stored = stored
        self.shape = torch.Size(stored.get_shape())

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor:
        return self.stored[(slice(None),) * dim + (slice(start, start + length),)]


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def load_model(path: str | Path, config: Qwen3Config, dtype: torch.dtype,
               device: torch.device | str) -> Qwen3ForCausalLM:
    """Parameters are created directly on `device` in `dtype`; buffers that need float32 (the
    rotary table) ask for it explicitly."""
    with _default_dtype(dtype), torch.device(device):
        model = Qwen3ForCausalLM(config)
    load_weights(model, path)
    return model.eval()


def expected_tensors(model: Qwen3ForCausalLM) -> dict[str, tuple[nn.Parameter, ShardId]]:
    """Checkpoint tensor name -> the parameter it loads into and its shard id there (q/k/v and
    gate/up are separate tensors in the checkpoint, packed matrices in the model)."""
    expected = {}
    for name, param in model.named_parameters():
        packed = [(source, target, shard_id) for source, (target, shard_id) in model.packed_modules.items()
                  if f".{target}." in name]
        if not packed:
            expected[name] = (param, None)
        for source, target, shard_id in packed:
            expected[name.replace(f".{target}.", f".{source}.")] = (param, shard_id)
    return expected


def _read(tensors, name: str, param: nn.Parameter, shard_id: ShardId) -> CheckpointTensor:
    """The tensor itself when the parameter keeps it whole (norms; everything unpacked at world size
    1); otherwise a StoredTensor that the parameter's loader narrows to this rank's part."""
    stored = tensors.get_slice(name)
    if shard_id is None and stored.get_shape() == list(param.shape):
        return tensors.get_tensor(name)
    return StoredTensor(stored)


def load_weights(model: Qwen3ForCausalLM, path: str | Path) -> None:
    """ValueError naming the tensor when one is missing, unexpected, or of the wrong shape."""
    path = Path(path)
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ValueError(f"{path}: no *.safetensors files")
    expected, loaded = expected_tensors(model), set()
    for file in files:
        with safe_open(file, framework="pt", device="cpu") as tensors:
            for name in tensors.keys():
                if name == "lm_head.weight" and model.config.tie_word_embeddings:
                    continue  # a tied checkpoint may still carry a copy of the embedding
                if name not in expected:
                    raise ValueError(f"{file.name}: unexpected tensor {name!r}: the model has no such parameter")
                param, shard_id = expected[name]
                shard = () if shard_id is None else (shard_id,)
                try:
                    param.weight_loader(param, _read(tensors, name, param, shard_id), *shard)
                except ValueError as err:
                    raise ValueError(f"{file.name}: tensor {name!r}: {err}") from None
                loaded.add(name)
    missing = sorted(expected.keys() - loaded)
    if missing:
        raise ValueError(f"{path}: missing tensor(s) {', '.join(repr(n) for n in missing)}")
