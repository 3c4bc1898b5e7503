"""FP8 weights as the linear layers hold and load them.

A linear layer built inside `fp8_storage(scheme)` holds its weight as e4m3 (`weight`) with float32
scales (`weight_scale`, one per `weight_block` of its own slice: nanoserve_kernels/fp8_reference.py);
elsewhere (the CPU, which dequantizes at load) it holds the model dtype. Either way its weight loader
is handed an Fp8Source for a quantized layer: the checkpoint's e4m3 values and scales (CheckpointFp8),
or an unquantized tensor quantized as it loads (QuantizedAtLoad: --quantization fp8, dummy weights),
and takes from it the e4m3 slice and its scales, or the dequantized slice.
"""
import contextlib
from contextvars import ContextVar
from typing import Iterator, Protocol

import torch
from torch import nn

from nanoserve_kernels.fp8_reference import FP8_DTYPE, dequantize_weight, quantize_weight
from nanoserve_model.parallel import CheckpointTensor
from nanoserve_model.quantization import Fp8Scheme

_storage: ContextVar[Fp8Scheme | None] = ContextVar("fp8_storage", default=None)


@contextlib.contextmanager
def fp8_storage(scheme: Fp8Scheme | None) -> Iterator[None]:
    """Linear layers built inside hold e4m3 weights of `scheme` (None: the model dtype)."""
    token = _storage.set(scheme)
    try:
        yield
    finally:
        _storage.reset(token)


def storage_scheme() -> Fp8Scheme | None:
    return _storage.get()


class Fp8Source(Protocol):
    """A quantized layer's checkpoint weight; `shape` is the full weight's."""
    shape: torch.Size

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor:
        """The slice, dequantized (float32)."""

    def narrow_quantized(self, dim: int, start: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The slice's e4m3 values and the scales of its blocks (the slice starts on a block edge)."""


class CheckpointFp8:
    """An e4m3 weight and its scales as the checkpoint stores them; only the slices asked for are read."""

    def __init__(self, weight: CheckpointTensor, scale: CheckpointTensor, scheme: Fp8Scheme):
        self.weight, self.scale = weight, scale
        self.shape = weight.shape
        self.block = scheme.weight_block(weight.shape[1])

    def narrow_quantized(self, dim: int, start: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        size = self.block[dim]
        first = start // size
        scales = self.scale.narrow(dim, first, -(-(start + length) // size) - first)
        return self.weight.narrow(dim, start, length), scales.float()

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor:
        return dequantize_weight(*self.narrow_quantized(dim, start, length), self.block)


class QuantizedAtLoad:
    """An unquantized weight, quantized slice by slice as a rank loads it, on `device` (per channel, each
    row of the slice gets its own scale; a block scheme's slices start on block edges, so its blocks
    are the whole weight's)."""

    def __init__(self, weight: CheckpointTensor, scheme: Fp8Scheme, device: torch.device):
        self.weight, self.scheme, self.device = weight, scheme, device
        self.shape = weight.shape

    def narrow_quantized(self, dim: int, start: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        part = self.weight.narrow(dim, start, length).to(self.device)
        return quantize_weight(part, self.scheme.weight_block(part.shape[1]))

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor:
        quantized, scale = self.narrow_quantized(dim, start, length)
        return dequantize_weight(quantized, scale, self.scheme.weight_block(quantized.shape[1]))


def new_weight(layer: nn.Module, rows: int, columns: int, name: str = "weight", stacked: int | None = None
               ) -> nn.Parameter:
    """The layer's weight `name` [rows, columns] (one such per expert when `stacked`: [stacked, rows, columns])
    as it is being built: e4m3 beside a `{name}_scale` parameter and its `{name}_block` under fp8_storage,
    else in the default dtype with `{name}_scale` None."""
    lead = () if stacked is None else (stacked,)
    scheme = storage_scheme()
    if scheme is None:
        setattr(layer, f"{name}_scale", None)
        setattr(layer, f"{name}_block", None)
        return nn.Parameter(torch.empty(*lead, rows, columns))
    setattr(layer, f"{name}_block", scheme.weight_block(columns))
    setattr(layer, f"{name}_scale", nn.Parameter(torch.empty(*lead, *scheme.scales_shape(rows, columns),
                                                             dtype=torch.float32), requires_grad=False))
    return nn.Parameter(torch.empty(*lead, rows, columns, dtype=FP8_DTYPE), requires_grad=False)


def unquantize_storage(layer: nn.Module, dtype: torch.dtype, name: str = "weight") -> None:
    """A weight built under fp8_storage that the checkpoint leaves unquantized: `dtype` after all (its
    weight loader and checkpoint names, kept, now take unquantized tensors)."""
    if getattr(layer, f"{name}_scale") is None:
        return
    old = getattr(layer, name)
    new = nn.Parameter(torch.empty(old.shape, device=old.device, dtype=dtype))
    new.__dict__.update(old.__dict__)  # weight_loader, checkpoint_shapes (and checkpoint_names when stacked)
    setattr(layer, name, new)
    setattr(layer, f"{name}_scale", None)
    setattr(layer, f"{name}_block", None)


def copy_weight(layer: nn.Module, dim: int, destination: int, loaded: CheckpointTensor | Fp8Source, start: int,
                length: int, name: str = "weight", expert: int | None = None) -> None:
    """The loaded weight's `length` rows (dim 0) or columns (dim 1) from `start` into the layer's weight
    `name` (of `expert`, when stacked) from `destination`: e4m3 values and their scales into an FP8
    weight, the model dtype into another."""
    weight, scale, block = (getattr(layer, name + suffix) for suffix in ("", "_scale", "_block"))
    weight = weight.data if expert is None else weight.data[expert]
    if scale is None:
        weight.narrow(dim, destination, length).copy_(loaded.narrow(dim, start, length))
        return
    scale = scale.data if expert is None else scale.data[expert]
    quantized, scales = loaded.narrow_quantized(dim, start, length)
    weight.narrow(dim, destination, length).copy_(quantized)
    scale.narrow(dim, destination // block[dim], scales.shape[dim]).copy_(scales)
