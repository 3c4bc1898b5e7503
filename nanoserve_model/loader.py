"""Builds a model on a device and fills its weights: from a checkpoint's safetensors files, each rank
reading only its shard, or (load format `dummy`) with random values generated on the device from the
config alone. Checkpoint tensors that do not match the model one to one (missing, unexpected,
mis-shaped) are errors found from the files' headers, before any weight is read."""
import contextlib
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import torch
from safetensors import safe_open
from torch import nn

from nanoserve_model.checkpoint import SafetensorsCheckpoint
from nanoserve_model.config import ModelConfig
from nanoserve_model.decoder import DecoderForCausalLM
from nanoserve_model.parallel import CheckpointTensor, ShardId
from nanoserve_model.registry import model_class

LOAD_FORMATS = ("auto", "safetensors", "dummy")  # auto: safetensors, the one format read from disk
DUMMY_STD = 0.02  # a trained model's init scale: activations stay finite through many bf16 layers


@dataclass(frozen=True)
class Target:
    """Where one checkpoint tensor goes: a parameter, and its shard id there when packed."""
    param: nn.Parameter
    shard_id: ShardId

    @property
    def shape(self) -> tuple[int, ...]:
        """The checkpoint tensor's full (unsharded) shape."""
        return self.param.checkpoint_shapes[self.shard_id]

    def load(self, tensor: CheckpointTensor) -> None:
        self.param.weight_loader(self.param, tensor, *(() if self.shard_id is None else (self.shard_id,)))


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


def load_model(path: str | Path, config: ModelConfig, dtype: torch.dtype, device: torch.device | str,
               load_format: str = "auto") -> DecoderForCausalLM:
    """Parameters are created directly on `device` in `dtype`; buffers that need float32 (the
    rotary table) ask for it explicitly."""
    family = model_class(config.architecture)
    with _default_dtype(dtype), torch.device(device):
        model = family(config)
    if load_format == "dummy":
        fill_dummy_weights(model)
    else:
        load_weights(model, path)
    return model.eval()


def expected_tensors(model: DecoderForCausalLM) -> dict[str, Target]:
    """Checkpoint tensor name -> where it loads (q/k/v and gate/up are separate tensors in the
    checkpoint, packed matrices and biases in the model; each expert's are stacked per layer)."""
    expected = {}
    for name, param in model.named_parameters():
        if stacked := getattr(param, "checkpoint_names", None):  # e.g. a layer's experts
            module = name.rpartition(".")[0]
            expected |= {f"{module}.{tensor}": Target(param, shard_id) for tensor, shard_id in stacked.items()}
            continue
        packed = [(source, target, shard_id) for source, (target, shard_id) in model.packed_modules.items()
                  if f".{target}." in name]
        if not packed:
            expected[name] = Target(param, None)
        for source, target, shard_id in packed:
            expected[name.replace(f".{target}.", f".{source}.")] = Target(param, shard_id)
    return expected


def _ignored(name: str, model: DecoderForCausalLM) -> bool:
    """Tensors a checkpoint may carry that the model recomputes or shares."""
    return ((name == "lm_head.weight" and model.config.tie_word_embeddings)  # a copy of the embedding
            or name.endswith(".rotary_emb.inv_freq"))  # older Llama checkpoints store the rotary table


def check_checkpoint(checkpoint: SafetensorsCheckpoint, expected: dict[str, Target], model: DecoderForCausalLM
                     ) -> None:
    """ValueError naming the tensor (and its file) when one is unexpected, mis-shaped or missing."""
    for name, shape in checkpoint.shapes.items():
        if _ignored(name, model):
            continue
        file = checkpoint.files[name].name
        if name not in expected:
            raise ValueError(f"{file}: unexpected tensor {name!r}: the model has no such parameter")
        if shape != expected[name].shape:
            raise ValueError(f"{file}: tensor {name!r}: shape {shape} in the checkpoint, "
                             f"expected {expected[name].shape}")
    missing = sorted(expected.keys() - checkpoint.shapes.keys())
    if missing:
        raise ValueError(f"{checkpoint.source}: missing tensor(s) {', '.join(repr(n) for n in missing)}")


def _read(tensors, name: str, target: Target) -> CheckpointTensor:
    """The tensor itself when the parameter keeps it whole (norms; everything unpacked at world size
    1); otherwise a StoredTensor that the parameter's loader narrows to this rank's part."""
    stored = tensors.get_slice(name)
    if target.shard_id is None and tuple(stored.get_shape()) == tuple(target.param.shape):
        return tensors.get_tensor(name)
    return StoredTensor(stored)


def load_weights(model: DecoderForCausalLM, path: str | Path) -> None:
    checkpoint = SafetensorsCheckpoint(path)
    expected = expected_tensors(model)
    check_checkpoint(checkpoint, expected, model)
    for file, names in checkpoint.by_file().items():
        with safe_open(file, framework="pt", device="cpu") as tensors:
            for name in names:
                if not _ignored(name, model):
                    expected[name].load(_read(tensors, name, expected[name]))


def dummy_tensor(name: str, shape: tuple[int, ...], like: torch.Tensor) -> torch.Tensor:
    """A checkpoint tensor as random weights: biases 0, norm scales 1, matrices normal(0, DUMMY_STD),
    drawn on the parameter's device from a seed of the name, so every rank and every tensor-parallel
    size sees the same full tensor."""
    if name.endswith(".bias"):
        return torch.zeros(shape, dtype=like.dtype, device=like.device)
    if len(shape) == 1:
        return torch.ones(shape, dtype=like.dtype, device=like.device)
    generator = torch.Generator(like.device).manual_seed(zlib.crc32(name.encode()))
    return torch.empty(shape, dtype=like.dtype, device=like.device).normal_(0.0, DUMMY_STD, generator=generator)


@torch.no_grad()
def fill_dummy_weights(model: DecoderForCausalLM) -> None:
    """Every parameter through its own weight loader, as if the checkpoint held the dummy tensors."""
    for name, target in expected_tensors(model).items():
        target.load(dummy_tensor(name, target.shape, target.param))
