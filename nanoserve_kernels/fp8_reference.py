"""FP8 (e4m3) weights and activations: the plain-torch semantics every FP8 kernel reproduces, and the
CPU path (which dequantizes at load).

A quantized weight W [N, K] is stored as e4m3 values Q with float32 scales S, one per (bn x bk) block:
W[n, k] = Q[n, k] * S[n // bn, k // bk], so S is [ceil(N / bn), ceil(K / bk)]. Qwen's FP8 checkpoints
use 128 x 128 blocks (S is their `weight_scale_inv`); compressed-tensors' per-channel weights are the
case bn = 1, bk = K (S [N, 1], their `weight_scale`). Activations are quantized as they come (dynamic),
per token and group of ACT_GROUP columns: x[m, k] ~ Qx[m, k] * Sx[m, k // ACT_GROUP], the group
matching the weight blocks' K so that a W8A8 product needs one scale pair per K block.
"""
import torch

from nanoserve.mathutil import cdiv

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0     # e4m3's largest finite value
AMAX_FLOOR = 1e-12  # an all-zero block gets a tiny scale, not 0 (no 0 / 0)
ACT_GROUP = 128     # activation columns that share a scale, per token


def block_scales_shape(rows: int, columns: int, block: tuple[int, int]) -> tuple[int, int]:
    return cdiv(rows, block[0]), cdiv(columns, block[1])


def _expand(scale: torch.Tensor, rows: int, columns: int, block: tuple[int, int]) -> torch.Tensor:
    """One scale per element: each block's scale repeated over its rows and columns, cut at the edges."""
    return scale.repeat_interleave(block[0], 0)[:rows].repeat_interleave(min(block[1], columns), 1)[:, :columns]


def quantize_weight(weight: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(Q, S) of W [N, K] with a scale per block: S = amax(|block|) / 448, Q = W / S rounded to e4m3 (the
    block's largest value lands on 448: nothing clips)."""
    rows, columns = weight.shape
    grid_rows, grid_cols = block_scales_shape(rows, columns, block)
    padded = torch.zeros(grid_rows * block[0], grid_cols * block[1], dtype=torch.float32, device=weight.device)
    padded[:rows, :columns] = weight
    blocks = padded.view(grid_rows, block[0], grid_cols, block[1])
    # A tensor divisor, not the float: torch on CUDA multiplies by the float's reciprocal instead of
    # dividing, one ulp off the IEEE quotient the kernels compute for some scales.
    scale = (blocks.abs().amax(dim=(1, 3)) / torch.full((), FP8_MAX, device=weight.device)).clamp(min=AMAX_FLOOR)
    quantized = (weight.float() / _expand(scale, rows, columns, block)).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return quantized, scale


def dequantize_weight(quantized: torch.Tensor, scale: torch.Tensor, block: tuple[int, int],
                      dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """W [N, K] from its e4m3 values and block scales."""
    rows, columns = quantized.shape
    return (quantized.float() * _expand(scale.float(), rows, columns, block)).to(dtype)


def quantize_activation(x: torch.Tensor, group: int = ACT_GROUP) -> tuple[torch.Tensor, torch.Tensor]:
    """(Qx [M, K] e4m3, Sx [M, ceil(K / group)] float32) of x [M, K], a scale per token and group."""
    return quantize_weight(x, (1, group))


def fp8_linear(x: torch.Tensor, quantized: torch.Tensor, scale: torch.Tensor, block: tuple[int, int],
               bias: torch.Tensor | None = None, quantize_input: bool = False) -> torch.Tensor:
    """y = x @ W.T (+ bias) in float32 from the dequantized weight, rounded to x's dtype once; with
    `quantize_input`, x too goes through e4m3 (per token and group) first: the W8A8 product."""
    if quantize_input:
        x_quantized, x_scale = quantize_activation(x)
        x = dequantize_weight(x_quantized, x_scale, (1, ACT_GROUP)).to(x.dtype)
    y = x.float() @ dequantize_weight(quantized, scale, block).T
    return (y if bias is None else y + bias.float()).to(x.dtype)
