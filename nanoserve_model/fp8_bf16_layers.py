"""FP8 linear layers served in the model dtype where that is faster on this GPU.

bench/tune_fp8.py and bench/gemv.py time each layer shape of the benchmark models in FP8 and, beside it,
in bf16 (the weight dequantized once, run by the 16-bit path), at every decode batch size; where the bf16
copy is the faster (nanoserve_kernels/fp8_configs.served_in_bf16 says by which rule), the layer's e4m3
weight is dequantized once at start and the layer runs exactly as in an unquantized model. Small models
are where this happens: their matrices are read in a few microseconds, and the e4m3 conversion and the
activations' quantization pass cost more than the bytes they save. The checkpoint's quantization is
still what GetModelInfo reports, with the count of layers served this way.
"""
from dataclasses import dataclass

import torch
from torch import nn

from nanoserve_kernels.fp8_configs import served_in_bf16
from nanoserve_kernels.fp8_reference import dequantize_weight
from nanoserve_model.fp8_weights import unquantize_storage
from nanoserve_model.linear import ColumnParallelLinear, RowParallelLinear

GATE_UP = "gate_up_proj"  # the packed gate/up projection, followed by SiLU-and-mul (the tuners' "+silu" shapes)


@dataclass(frozen=True)
class Bf16Layers:
    """Which FP8 layers run in the model dtype, and what their copies cost."""
    names: tuple[str, ...]
    shapes: tuple[str, ...]  # distinct "NxK" of those layers
    fp8_layers: int          # FP8 linear layers in the model before
    extra_bytes: int         # memory the dequantized weights take beyond their e4m3 values and scales

    def describe(self) -> str:
        return f"{len(self.names)} of {self.fp8_layers} linear layers in bf16 (faster here)"

    def log_line(self, device_name: str) -> str:
        return (f"FP8 linear layers served in bf16, measured faster on {device_name} "
                f"(nanoserve_kernels/fp8_configs.json): {len(self.names)} of {self.fp8_layers}, shapes "
                f"{', '.join(self.shapes)}; their weights take {self.extra_bytes / 2**20:.0f} MiB more")


def fp8_linears(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """(name, layer) of each linear layer holding an e4m3 weight and its scales."""
    return [(name, module) for name, module in model.named_modules()
            if isinstance(module, (ColumnParallelLinear, RowParallelLinear)) and module.weight_scale is not None]


def serve_faster_layers_in_bf16(model: nn.Module, device_name: str, dtype: torch.dtype,
                                tables: dict | None = None) -> Bf16Layers:
    """Dequantizes, in place, each FP8 linear layer whose shape `served_in_bf16` (of `tables`, default the
    committed fp8_configs.json) says runs faster in `dtype` on this device."""
    layers = fp8_linears(model)
    names, shapes, extra = [], [], 0
    for name, layer in layers:
        n, k = layer.weight.shape
        if not served_in_bf16(device_name, n, k, name.endswith(GATE_UP), tables):
            continue
        fp8_bytes = layer.weight.nbytes + layer.weight_scale.nbytes
        weight = dequantize_weight(layer.weight.data, layer.weight_scale.data, layer.weight_block, dtype)
        unquantize_storage(layer, dtype)
        layer.weight.data.copy_(weight)
        del weight
        names.append(name)
        shapes += [] if f"{n}x{k}" in shapes else [f"{n}x{k}"]
        extra += layer.weight.nbytes - fp8_bytes
    return Bf16Layers(tuple(names), tuple(shapes), len(layers), extra)
