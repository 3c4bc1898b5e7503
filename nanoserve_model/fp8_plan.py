"""Which of a model's linear layers and stacks of experts an FP8 scheme quantizes, what that adds to the
checkpoint (a scale tensor beside each quantized weight, one per expert matrix), and whether every rank's
slice of each falls on whole scale blocks: all found from the model's geometry and the checkpoint's
config, before any weight is read."""
from dataclasses import dataclass

import torch
from torch import nn

from nanoserve_model.fp8_weights import CheckpointFp8, Fp8Source, QuantizedAtLoad, unquantize_storage
from nanoserve_model.linear import ColumnParallelLinear, RowParallelLinear
from nanoserve_model.moe import Experts
from nanoserve_model.parallel import CheckpointTensor, ShardId, tp_world_size
from nanoserve_model.quantization import PER_CHANNEL, Fp8Scheme

CHECKPOINT_FP8 = "F8_E4M3"  # safetensors' name of float8_e4m3fn


def checkpoint_modules(name: str, packed_modules: dict[str, tuple[str, ShardId]]) -> dict[str, ShardId]:
    """The checkpoint modules a layer of ours holds (several when packed) -> their shard ids."""
    parent, _, leaf = name.rpartition(".")
    sources = {f"{parent}.{source}": shard_id for source, (target, shard_id) in packed_modules.items()
               if target == leaf}
    return sources or {name: None}


@dataclass(frozen=True)
class Matrix:
    """One checkpoint matrix of a quantizable layer, as this rank holds it."""
    source: str                 # its checkpoint module, e.g. model.layers.0.mlp.experts.3.gate_proj
    shape: tuple[int, int]      # the full matrix's
    dim: int                    # split over the ranks along rows (0) or columns (1) ...
    start: int                  # ... this rank holding `length` of them from `start`
    length: int
    followed: bool              # another checkpoint matrix is packed right after it


def layer_matrices(name: str, layer: nn.Module, packed_modules: dict[str, tuple[str, ShardId]]) -> list[Matrix]:
    """The checkpoint matrices the layer `name` holds (none: not a layer FP8 quantizes): a linear layer's
    (several when packed), or every expert's gate, up and down of a stack of experts."""
    if isinstance(layer, Experts):
        return [Matrix(f"{name}.{source}", shape, dim, layer.start, layer.rows, followed)
                for source, (dim, shape, followed) in layer.matrices().items()]
    if not isinstance(layer, (ColumnParallelLinear, RowParallelLinear)):
        return []
    slices = layer.weight_slices()
    last = list(slices)[-1]
    return [Matrix(source, layer.weight.checkpoint_shapes[shard_id], *slices[shard_id], shard_id != last)
            for source, shard_id in checkpoint_modules(name, packed_modules).items()]


def _names(matrices: list[Matrix]) -> str:
    """A few of the matrices' names, for a one-line error."""
    shown = ", ".join(matrix.source for matrix in matrices[:3])
    return shown + (f" and {len(matrices) - 3} more" if len(matrices) > 3 else "")


class Fp8Plan:
    """The scheme's quantized layers of `model` (empty without a scheme): by checkpoint weight name,
    the layer and its scale tensor's name and full shape."""

    def __init__(self, model: nn.Module, scheme: Fp8Scheme | None):
        self.scheme = scheme
        self.layers: dict[str, nn.Module] = {}   # checkpoint weight name -> our layer
        self.scales: dict[str, tuple[str, tuple[int, ...]]] = {}  # weight name -> (scale name, shape)
        if scheme is None:
            return
        for name, layer in model.named_modules():
            matrices = layer_matrices(name, layer, model.packed_modules)
            ignored = [matrix for matrix in matrices if scheme.ignores(matrix.source)]
            if len(ignored) == len(matrices):
                continue
            if ignored:
                raise ValueError(f"{name}: the quantization_config leaves {_names(ignored)} unquantized but not "
                                 f"the rest of {_names(matrices)}, which {name} holds as one tensor")
            for matrix in matrices:
                self._check_blocks(name, matrix)
                self.layers[f"{matrix.source}.weight"] = layer
                if scheme.from_checkpoint:
                    self.scales[f"{matrix.source}.weight"] = (f"{matrix.source}.{scheme.scale_name}",
                                                              scheme.scales_shape(*matrix.shape))

    def _check_blocks(self, name: str, matrix: Matrix) -> None:
        """This rank's slice of the checkpoint matrix starts and ends on a scale block's edge (or the
        matrix's end), and a matrix packed before another fills whole blocks, so that each block's scale
        belongs to one rank and one matrix."""
        if self.scheme.block is PER_CHANNEL:
            return
        blocks = f"weight_block_size {list(self.scheme.block)}"
        size, unit, full = self.scheme.block[matrix.dim], ("rows", "columns")[matrix.dim], matrix.shape[matrix.dim]
        start, length = matrix.start, matrix.length
        if start % size or (length % size and start + length != full):
            raise ValueError(f"{matrix.source}: this rank holds its {unit} {start}..{start + length} of {full} "
                             f"(tensor-parallel size {tp_world_size()}), which split a {size}-{unit[:-1]} scale "
                             f"block ({blocks}): use a tensor-parallel size whose slices are whole blocks")
        if matrix.followed and length % size:
            raise ValueError(f"{matrix.source}: its {length} {unit} on this rank are not whole {size}-{unit[:-1]} "
                             f"scale blocks ({blocks}), and {name} packs the next matrix right after them")

    def unquantize_ignored(self, model: nn.Module, dtype: torch.dtype) -> None:
        """Layers built to hold e4m3 that the scheme leaves in the model dtype."""
        quantized = set(map(id, self.layers.values()))
        for layer in model.modules():
            if id(layer) in quantized:
                continue
            if isinstance(layer, (ColumnParallelLinear, RowParallelLinear)):
                unquantize_storage(layer, dtype)
            elif isinstance(layer, Experts):
                layer.unquantize_storage(dtype)

    def expected_shapes(self) -> dict[str, tuple[int, ...]]:
        """The scale tensors the checkpoint must hold, by name."""
        return dict(self.scales.values())

    def source(self, weight: CheckpointTensor, scale: CheckpointTensor | None, device: torch.device) -> Fp8Source:
        """What a quantized layer's weight loader reads: the checkpoint's e4m3 weight and its scales, or,
        without scales (--quantization fp8, dummy weights), the unquantized weight quantized as it loads."""
        return QuantizedAtLoad(weight, self.scheme, device) if scale is None else CheckpointFp8(weight, scale,
                                                                                               self.scheme)
