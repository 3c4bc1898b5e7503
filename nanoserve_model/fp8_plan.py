"""Which of a model's linear layers an FP8 scheme quantizes, what that adds to the checkpoint (a scale
tensor beside each quantized weight), and whether every rank's slice of each falls on whole scale
blocks: all found from the model's geometry and the checkpoint's config, before any weight is read."""
import torch
from torch import nn

from nanoserve_model.fp8_weights import CheckpointFp8, Fp8Source, QuantizedAtLoad, unquantize_storage
from nanoserve_model.linear import ColumnParallelLinear, RowParallelLinear
from nanoserve_model.parallel import CheckpointTensor, ShardId, tp_world_size
from nanoserve_model.quantization import PER_CHANNEL, Fp8Scheme

CHECKPOINT_FP8 = "F8_E4M3"  # safetensors' name of float8_e4m3fn


def checkpoint_modules(name: str, packed_modules: dict[str, tuple[str, ShardId]]) -> dict[str, ShardId]:
    """The checkpoint modules a layer of ours holds (several when packed) -> their shard ids."""
    parent, _, leaf = name.rpartition(".")
    sources = {f"{parent}.{source}": shard_id for source, (target, shard_id) in packed_modules.items()
               if target == leaf}
    return sources or {name: None}


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
            if not isinstance(layer, (ColumnParallelLinear, RowParallelLinear)):
                continue
            sources = checkpoint_modules(name, model.packed_modules)
            ignored = [source for source in sources if scheme.ignores(source)]
            if len(ignored) == len(sources):
                continue
            if ignored:
                raise ValueError(f"{name}: the quantization_config leaves {', '.join(ignored)} unquantized but not "
                                 f"the rest of {', '.join(sources)}, which run as one packed matrix")
            self._check_blocks(name, layer, sources)
            for source, shard_id in sources.items():
                self.layers[f"{source}.weight"] = layer
                if scheme.from_checkpoint:
                    self.scales[f"{source}.weight"] = (f"{source}.{scheme.scale_name}",
                                                       scheme.scales_shape(*layer.weight.checkpoint_shapes[shard_id]))

    def _check_blocks(self, name: str, layer: nn.Module, sources: dict[str, ShardId]) -> None:
        """Every rank's slice of each checkpoint matrix starts and ends on a scale block's edge (or the
        matrix's end), and packed matrices but the last fill whole blocks, so that each block's scale
        belongs to one rank and one matrix."""
        if self.scheme.block is PER_CHANNEL:
            return
        slices = layer.weight_slices()
        last = list(slices)[-1]
        blocks = f"weight_block_size {list(self.scheme.block)}"
        for source, shard_id in sources.items():
            dim, start, length, full = slices[shard_id]
            size, unit = self.scheme.block[dim], ("rows", "columns")[dim]
            if start % size or (length % size and start + length != full):
                raise ValueError(f"{source}: this rank holds its {unit} {start}..{start + length} of {full} "
                                 f"(tensor-parallel size {tp_world_size()}), which split a {size}-{unit[:-1]} scale "
                                 f"block ({blocks}): use a tensor-parallel size whose slices are whole blocks")
            if shard_id != last and length % size:
                raise ValueError(f"{source}: its {length} {unit} on this rank are not whole {size}-{unit[:-1]} scale "
                                 f"blocks ({blocks}), and {name} packs the next matrix right after them")

    def unquantize_ignored(self, model: nn.Module, dtype: torch.dtype) -> None:
        """Layers built to hold e4m3 that the scheme leaves in the model dtype."""
        quantized = set(map(id, self.layers.values()))
        for layer in model.modules():
            if isinstance(layer, (ColumnParallelLinear, RowParallelLinear)) and id(layer) not in quantized:
                unquantize_storage(layer, dtype)

    def expected_shapes(self) -> dict[str, tuple[int, ...]]:
        """The scale tensors the checkpoint must hold, by name."""
        return dict(self.scales.values())

    def source(self, weight: CheckpointTensor, scale: CheckpointTensor | None, device: torch.device) -> Fp8Source:
        """What a quantized layer's weight loader reads: the checkpoint's e4m3 weight and its scales, or,
        without scales (--quantization fp8, dummy weights), the unquantized weight quantized as it loads."""
        return QuantizedAtLoad(weight, self.scheme, device) if scale is None else CheckpointFp8(weight, scale,
                                                                                               self.scheme)
