"""Builds a model on a device and fills its weights: from a checkpoint's safetensors files, each rank
reading only its shard, or (load format `dummy`) with random values generated on the device from the
config alone. Checkpoint tensors that do not match the model one to one (missing, unexpected,
mis-shaped) are errors found from the files' headers, before any weight is read. With an FP8 scheme
(nanoserve_model/quantization.py) the quantized layers and experts hold e4m3 weights on CUDA and load
dequantized elsewhere (nanoserve_model/fp8_weights.py); each reads its scales with its weight."""
import contextlib
import zlib
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import torch
from safetensors import safe_open
from torch import nn

from nanoserve_model.checkpoint import SafetensorsCheckpoint
from nanoserve_model.config import ModelConfig
from nanoserve_model.decoder import DecoderForCausalLM
from nanoserve_model.fp8_plan import CHECKPOINT_FP8, Fp8Plan
from nanoserve_model.fp8_weights import fp8_storage
from nanoserve_model.parallel import CheckpointTensor, ShardId
from nanoserve_model.quantization import Fp8Scheme
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
               load_format: str = "auto", quantization: Fp8Scheme | None = None,
               fp8_weights: bool | None = None) -> DecoderForCausalLM:
    """Parameters are created directly on `device` in `dtype`; buffers that need float32 (the
    rotary table) ask for it explicitly. The layers `quantization` covers hold e4m3 weights if
    `fp8_weights` (default: on CUDA, where the FP8 kernels are), else their dequantized values."""
    family = model_class(config.architecture)
    device = torch.device(device)
    fp8_weights = device.type == "cuda" if fp8_weights is None else fp8_weights
    with _default_dtype(dtype), torch.device(device), fp8_storage(quantization if fp8_weights else None):
        model = family(config)
    plan = Fp8Plan(model, quantization)  # refuses blocks split by a rank or a packing, before any read
    plan.unquantize_ignored(model, dtype)
    if load_format == "dummy":
        fill_dummy_weights(model, plan)
    else:
        load_weights(model, path, plan)
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
        if not hasattr(param, "weight_loader"):  # FP8 scales: read with their weight (Fp8Plan)
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


def check_checkpoint(checkpoint: SafetensorsCheckpoint, expected: dict[str, Target], model: DecoderForCausalLM,
                     plan: Fp8Plan | None = None) -> None:
    """ValueError naming the tensor (and its file) when one is unexpected, mis-shaped or missing, or when
    a weight the quantization config quantizes is not e4m3 in the checkpoint."""
    plan = plan or Fp8Plan(model, None)
    shapes = {name: target.shape for name, target in expected.items()} | plan.expected_shapes()
    for name, shape in checkpoint.shapes.items():
        if _ignored(name, model):
            continue
        file = checkpoint.files[name].name
        if name not in shapes:
            raise ValueError(f"{file}: unexpected tensor {name!r}: the model has no such parameter")
        if shape != shapes[name]:
            raise ValueError(f"{file}: tensor {name!r}: shape {shape} in the checkpoint, expected {shapes[name]}")
        if name in plan.scales and checkpoint.dtypes[name] != CHECKPOINT_FP8:
            raise ValueError(f"{file}: tensor {name!r} is {checkpoint.dtypes[name]}, but the quantization_config "
                             f"({plan.scheme.method}) quantizes it to {CHECKPOINT_FP8} (an unquantized layer belongs "
                             f"in its modules_to_not_convert / ignore list)")
    missing = sorted(shapes.keys() - checkpoint.shapes.keys())
    if missing:
        raise ValueError(f"{checkpoint.source}: missing tensor(s) {', '.join(repr(n) for n in missing)}")


def _read(tensors, name: str, target: Target) -> CheckpointTensor:
    """The tensor itself when the parameter keeps it whole (norms; everything unpacked at world size
    1); otherwise a StoredTensor that the parameter's loader narrows to this rank's part."""
    stored = tensors.get_slice(name)
    if target.shard_id is None and tuple(stored.get_shape()) == tuple(target.param.shape):
        return tensors.get_tensor(name)
    return StoredTensor(stored)


def load_weights(model: DecoderForCausalLM, path: str | Path, plan: Fp8Plan | None = None) -> None:
    plan = plan or Fp8Plan(model, None)
    checkpoint = SafetensorsCheckpoint(path)
    expected = expected_tensors(model)
    check_checkpoint(checkpoint, expected, model, plan)
    scale_names = {scale for scale, _ in plan.scales.values()}
    device = next(model.parameters()).device
    with ExitStack() as stack:  # a quantized weight's scales may lie in another file
        files = {file: stack.enter_context(safe_open(file, framework="pt", device="cpu"))
                 for file in checkpoint.by_file()}
        for file, names in checkpoint.by_file().items():
            for name in names:
                if _ignored(name, model) or name in scale_names:
                    continue
                if name in plan.layers:
                    scale = plan.scales[name][0] if name in plan.scales else None
                    stored_scale = scale and StoredTensor(files[checkpoint.files[scale]].get_slice(scale))
                    expected[name].load(plan.source(StoredTensor(files[file].get_slice(name)), stored_scale, device))
                else:
                    expected[name].load(_read(files[file], name, expected[name]))


def dummy_tensor(name: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A checkpoint tensor as random weights: biases 0, norm scales 1, matrices normal(0, DUMMY_STD),
    drawn on `device` from a seed of the name, so every rank and every tensor-parallel size sees the
    same full tensor."""
    if name.endswith(".bias"):
        return torch.zeros(shape, dtype=dtype, device=device)
    if len(shape) == 1:
        return torch.ones(shape, dtype=dtype, device=device)
    generator = torch.Generator(device).manual_seed(zlib.crc32(name.encode()))
    return torch.empty(shape, dtype=dtype, device=device).normal_(0.0, DUMMY_STD, generator=generator)


@torch.no_grad()
def fill_dummy_weights(model: DecoderForCausalLM, plan: Fp8Plan | None = None) -> None:
    """Every parameter through its own weight loader, as if the checkpoint held the dummy tensors; the
    layers an FP8 scheme quantizes get them quantized (e4m3 and scales, or their dequantized values)."""
    plan = plan or Fp8Plan(model, None)
    dtype = model.model.norm.weight.dtype  # the model dtype (a quantized weight's is e4m3)
    for name, target in expected_tensors(model).items():
        tensor = dummy_tensor(name, target.shape, dtype, target.param.device)
        if name in plan.layers:
            tensor = plan.source(tensor, None, target.param.device)
        target.load(tensor)
