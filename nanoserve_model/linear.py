"""Tensor-parallel linear layers, with an optional bias (Qwen2's q/k/v, Llama's `attention_bias` and
`mlp_bias`). Each keeps only its rank's slice of the weight and knows how to cut that slice out of a
full checkpoint tensor (its weight loader). At world size 1 they are plain linear layers. A layer built
under fp8_storage holds an e4m3 weight and its scales (nanoserve_model/fp8_weights.py) and runs the FP8
kernels (nanoserve_kernels/fp8_linear.py)."""
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from nanoserve_model.fp8_weights import Fp8Source, copy_weight, new_weight
from nanoserve_model.parallel import CheckpointTensor, all_reduce, divide, set_weight_loader, tp_rank, tp_world_size


def on_matvec_path(x: torch.Tensor) -> bool:
    """Whether x [rows, K] is a decode batch of so few rows, on CUDA, that it reads the weight
    through the matrix-vector kernel, where cuBLAS's GEMM tiles fall well short of the memory rate
    (bench/gemv.py)."""
    if not (x.is_cuda and x.dim() == 2 and x.stride(1) == 1):
        return False
    from nanoserve_kernels.triton_gemv import MAX_ROWS  # Triton is a GPU requirement only
    return x.shape[0] <= MAX_ROWS


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           weight_scale: torch.Tensor | None = None, weight_block: tuple[int, int] | None = None) -> torch.Tensor:
    """F.linear, through the matrix-vector kernel where on_matvec_path(x); of an e4m3 weight (given its
    scales), through the FP8 kernels."""
    if weight_scale is not None:
        from nanoserve_kernels.fp8_linear import fp8_linear
        return fp8_linear(x, weight, weight_scale, weight_block, bias)
    if on_matvec_path(x):
        from nanoserve_kernels.triton_gemv import gemv
        return gemv(x, weight, bias)
    return F.linear(x, weight, bias)


@dataclass(frozen=True)
class PackedPart:
    """One checkpoint matrix packed into a column-parallel weight, as this rank holds it."""
    full_rows: int  # rows of the checkpoint matrix
    start: int      # first of its rows this rank keeps
    rows: int       # how many rows this rank keeps


class ColumnParallelLinear(nn.Module):
    """Output features split across ranks: each rank computes its slice of y, no communication.
    Several checkpoint matrices of the same input (`parts`, by shard id) are packed side by side
    so that they run as one matmul; a bias is split and packed like the weight's rows."""

    def __init__(self, input_size: int, parts: dict[int | str, PackedPart], bias: bool = False):
        super().__init__()
        self.input_size = input_size
        self.parts = parts
        self.offsets, offset = {}, 0
        for shard_id, part in parts.items():
            self.offsets[shard_id], offset = offset, offset + part.rows
        self.weight = set_weight_loader(new_weight(self, offset, input_size), self.load_weight_rows,
                                        {i: (part.full_rows, input_size) for i, part in parts.items()})
        self.bias = set_weight_loader(nn.Parameter(torch.empty(offset)), self.load_bias_rows,
                                      {i: (part.full_rows,) for i, part in parts.items()}) if bias else None

    def load_weight_rows(self, param: nn.Parameter, loaded: CheckpointTensor | Fp8Source, shard_id: int | str) -> None:
        part = self.parts[shard_id]
        copy_weight(self, 0, self.offsets[shard_id], loaded, part.start, part.rows)

    def load_bias_rows(self, param: nn.Parameter, loaded: CheckpointTensor, shard_id: int | str) -> None:
        part = self.parts[shard_id]
        param.data.narrow(0, self.offsets[shard_id], part.rows).copy_(loaded.narrow(0, part.start, part.rows))

    def weight_slices(self) -> dict[int | str, tuple[int, int, int]]:
        """Per checkpoint matrix: (dim, start, length) of the slice this rank holds."""
        return {shard_id: (0, part.start, part.rows) for shard_id, part in self.parts.items()}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias, self.weight_scale, self.weight_block)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Projections of one input (gate and up), each split evenly across ranks; shard ids 0, 1, ..."""

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool = False):
        rank, world_size = tp_rank(), tp_world_size()
        parts = {}
        for shard_id, size in enumerate(output_sizes):
            rows = divide(size, world_size, "output features")
            parts[shard_id] = PackedPart(size, rank * rows, rows)
        super().__init__(input_size, parts, bias)


class QKVParallelLinear(ColumnParallelLinear):
    """q, k and v (shard ids "q", "k", "v") split across ranks by heads. With fewer KV heads than
    ranks, each KV head is replicated on the ranks whose query heads share it."""

    def __init__(self, hidden_size: int, head_dim: int, total_heads: int, total_kv_heads: int, bias: bool = False):
        rank, world_size = tp_rank(), tp_world_size()
        self.num_heads = divide(total_heads, world_size, "attention heads")
        if total_kv_heads >= world_size:
            self.num_kv_heads = divide(total_kv_heads, world_size, "KV heads")
            kv_start = rank * self.num_kv_heads
        else:
            if world_size % total_kv_heads:
                raise ValueError(f"the tensor-parallel size ({world_size}) is not a multiple of the KV heads "
                                 f"({total_kv_heads}): they cannot be replicated evenly across the ranks")
            self.num_kv_heads = 1
            kv_start = rank // (world_size // total_kv_heads)
        q_rows, kv_rows = self.num_heads * head_dim, self.num_kv_heads * head_dim
        kv = PackedPart(total_kv_heads * head_dim, kv_start * head_dim, kv_rows)
        super().__init__(hidden_size, {"q": PackedPart(total_heads * head_dim, rank * q_rows, q_rows),
                                       "k": kv, "v": kv}, bias)


class RowParallelLinear(nn.Module):
    """Input features split across ranks (a column-parallel layer's output slices): each rank
    computes a partial y and the all-reduce sums them; the bias, whole on every rank, is added
    once, after the sum."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False):
        super().__init__()
        self.rank = tp_rank()
        columns = divide(input_size, tp_world_size(), "input features")
        self.weight = set_weight_loader(new_weight(self, output_size, columns), self.load_columns,
                                        {None: (output_size, input_size)})
        self.bias = set_weight_loader(nn.Parameter(torch.empty(output_size)), self.load_whole,
                                      {None: (output_size,)}) if bias else None

    def load_columns(self, param: nn.Parameter, loaded: CheckpointTensor | Fp8Source) -> None:
        columns = param.shape[1]
        copy_weight(self, 1, 0, loaded, self.rank * columns, columns)

    def weight_slices(self) -> dict[None, tuple[int, int, int]]:
        """(dim, start, length) of the checkpoint weight's slice this rank holds."""
        columns = self.weight.shape[1]
        return {None: (1, self.rank * columns, columns)}

    @staticmethod
    def load_whole(param: nn.Parameter, loaded: CheckpointTensor) -> None:
        param.data.copy_(loaded.narrow(0, 0, param.shape[0]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._reduced(linear(x, self.weight, None, self.weight_scale, self.weight_block))

    def forward_quantized(self, quantized: tuple[torch.Tensor, torch.Tensor], rows: int, dtype: torch.dtype
                          ) -> torch.Tensor:
        """forward() of x [rows, K] (in `dtype`) given already quantized for this e4m3 weight's W8A8 GEMM, in the
        layout fp8_linear.input_quantization gives."""
        from nanoserve_kernels.fp8_linear import quantized_linear
        return self._reduced(quantized_linear(quantized, rows, dtype, self.weight, self.weight_scale,
                                              self.weight_block))

    def _reduced(self, partial: torch.Tensor) -> torch.Tensor:
        """The ranks' partial outputs summed, then the bias."""
        y = all_reduce(partial)
        return y if self.bias is None else y + self.bias
