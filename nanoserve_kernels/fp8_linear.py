"""y = x @ W.T (+ bias) of an e4m3 weight W with block scales (nanoserve_kernels/fp8_reference.py), by
batch size: one row reads W through the matrix-vector kernel, dequantizing in registers
(triton_gemv.py); larger batches take what fp8_configs.py chose for the shape and bucket: the
weight-only GEMM against the 16-bit activations (small decode batches), or the activations quantized
per token and 128 columns (triton_fp8_quant.py) and the W8A8 GEMM, ours (triton_fp8_gemm.py), torch's
blockwise scaled_mm or DeepGEMM's (deepgemm_fp8.py; both for gate/up followed by the SiLU-and-mul pass,
where their rate repays it).
Off CUDA, and for scale blocks the kernels do not tile, the plain-torch reference. Every path has
fixed shapes for a given row count, so the step graphs capture it.

The projections' fusions take the same kernels: the RMSNorm before q/k/v and gate/up at one row is
the matrix-vector kernel's prologue (triton_gemv.rms_norm_gemv with the weight's scales), and the
SiLU-and-mul after gate/up the GEMM's epilogue (fp8_gate_up_silu). Before a W8A8 GEMM the RMSNorm
quantizes its own output (input_quantization says in which layout, quantized_linear takes it:
nanoserve_model/row_fusion.py); so does the SiLU-and-mul pass after scaled_mm or DeepGEMM for the down
projection (`output_layout`), and a decode step's attention kernel for the o projection (triton_decode.py);
the o projection's activations in prefill and mixed steps, and the down projection's after the Triton GEMM's
epilogue, take a quantization pass.
"""
import dataclasses
import functools

import torch
import torch.nn.functional as F

from nanoserve_kernels import deepgemm_fp8, fp8_configs, fp8_reference
from nanoserve_kernels.fp8_configs import DEEPGEMM, SCALED_MM, W8A8, Fp8Choice

# A projection's output: in the model dtype, or quantized for the next W8A8 GEMM (e4m3 values, their scales).
Activation = torch.Tensor | tuple[torch.Tensor, torch.Tensor]


@functools.cache
def _device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device)


def on_kernels(x: torch.Tensor, block: tuple[int, int]) -> bool:
    """Whether the FP8 kernels take x [rows, K] against a weight of these scale blocks: on CUDA, 16-bit
    activations, scale columns a power of two of at least 32 (e4m3 tensor-core dots take 32 columns at
    least; every checkpoint's blocks are 128) or one scale a row."""
    columns = block[1]
    return (x.is_cuda and x.dim() == 2 and x.stride(1) == 1 and x.dtype in (torch.bfloat16, torch.float16)
            and (columns >= x.shape[1] or (columns >= 32 and columns & (columns - 1) == 0)))


def choice(rows: int, weight: torch.Tensor, silu_mul: bool = False) -> Fp8Choice:
    """The table's choice for `rows` rows through this weight on its device (DeepGEMM's, where it is not
    installed, goes to torch's scaled_mm, which takes the same inputs)."""
    chosen = fp8_configs.choose(_device_name(weight.device), weight.shape[0], weight.shape[1], rows, silu_mul)
    if chosen.backend == DEEPGEMM and not deepgemm_fp8.available():
        return dataclasses.replace(chosen, backend=SCALED_MM)
    return chosen


def _gemm(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int],
          bias: torch.Tensor | None, silu_mul: bool, output_layout: dict | None = None) -> Activation:
    """The GEMM of more than one row, as chosen for the shape and bucket."""
    from nanoserve_kernels.triton_fp8_gemm import fp8_gemm
    from nanoserve_kernels.triton_fp8_quant import quantize_activation
    chosen = choice(x.shape[0], weight, silu_mul)
    if chosen.mode != W8A8:
        return fp8_gemm(x, weight, scale, block, _launch(chosen, scale, block), bias=bias, silu_mul=silu_mul)
    quantized = quantize_activation(x, **input_layout(chosen, x.shape, weight, block))
    return _w8a8(quantized, x.shape[0], x.dtype, weight, scale, block, bias, silu_mul, chosen, output_layout)


def _launch(chosen: Fp8Choice, scale: torch.Tensor, block: tuple[int, int]) -> dict:
    """The Triton launch (without a DeepGEMM entry's tiling), its K step within one scale block (any step where K
    is one block: per row)."""
    launch = {name: value for name, value in chosen.launch.items() if name != DEEPGEMM}
    return launch if scale.shape[1] == 1 else dict(launch, BLOCK_K=min(launch["BLOCK_K"], block[1]))


def input_layout(chosen: Fp8Choice, x_shape: torch.Size, weight: torch.Tensor, block: tuple[int, int]) -> dict:
    """quantize_activation's layout for the W8A8 GEMM chosen: torch's scaled_mm wants the scales token-minor
    and the rows a multiple of 4; DeepGEMM the same, the rows padded further (deepgemm_fp8.padded_rows)."""
    if chosen.backend == DEEPGEMM and takes_deepgemm(x_shape[0], weight, block):
        return dict(token_minor=True, padded_rows=deepgemm_fp8.padded_rows(x_shape[0]))
    if chosen.backend in (SCALED_MM, DEEPGEMM) and takes_scaled_mm(x_shape[1], weight, block):
        return dict(token_minor=True, padded_rows=-(-x_shape[0] // 4) * 4)
    return dict(token_minor=False, padded_rows=None)


def _w8a8(quantized: tuple[torch.Tensor, torch.Tensor], rows: int, dtype: torch.dtype, weight: torch.Tensor,
          scale: torch.Tensor, block: tuple[int, int], bias: torch.Tensor | None, silu_mul: bool,
          chosen: Fp8Choice, output_layout: dict | None = None) -> Activation:
    """The W8A8 GEMM of `rows` rows quantized in input_layout's layout, output in `dtype`; with `silu_mul` and
    `output_layout`, the SiLU-and-mul quantized in that layout where it is a pass of its own (scaled_mm, DeepGEMM)."""
    from nanoserve_kernels.triton_activation import silu_and_mul
    from nanoserve_kernels.triton_fp8_gemm import fp8_gemm
    from nanoserve_kernels.triton_fp8_quant import quantize_activation
    x_quantized, x_scale = quantized
    if chosen.backend == DEEPGEMM and takes_deepgemm(rows, weight, block, scale, dtype):
        y = deepgemm_fp8.gemm(x_quantized, x_scale, weight, scale, chosen.launch.get(DEEPGEMM))[:rows]
    elif chosen.backend in (SCALED_MM, DEEPGEMM) and takes_scaled_mm(x_quantized.shape[1], weight, block):
        y = _scaled_mm_quantized(x_quantized, x_scale, weight, scale, dtype)[:rows]
    else:
        return fp8_gemm(x_quantized, weight, scale, block, _launch(chosen, scale, block), x_scale=x_scale, bias=bias,
                        silu_mul=silu_mul, out_dtype=dtype)
    y = y if bias is None else y + bias
    if silu_mul and output_layout is not None:
        return quantize_activation(y, silu_mul=True, **output_layout)
    return silu_and_mul(y) if silu_mul else y  # each half rounded first, as the fused epilogue


def input_quantization(x: torch.Tensor, weight: torch.Tensor, block: tuple[int, int], silu_mul: bool = False,
                       columns: int | None = None) -> dict | None:
    """For x [rows, K] that the projection (fp8_linear, or fp8_gate_up_silu with `silu_mul`) would quantize for
    a W8A8 GEMM: quantize_activation's layout (token_minor, padded_rows), so that the kernel making x can
    quantize it instead (triton_rms_norm.rms_norm_fp8); None where x goes in unquantized. `columns`: K, where x
    is the tensor that x will be made from (same rows, device and dtype)."""
    if not on_kernels(x, block) or x.shape[0] < 2:
        return None
    chosen = choice(x.shape[0], weight, silu_mul)
    shape = torch.Size((x.shape[0], columns or x.shape[1]))
    return input_layout(chosen, shape, weight, block) if chosen.mode == W8A8 else None


def quantized_linear(quantized: tuple[torch.Tensor, torch.Tensor], rows: int, dtype: torch.dtype,
                     weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int],
                     bias: torch.Tensor | None = None, silu_mul: bool = False, chosen: Fp8Choice | None = None,
                     output_layout: dict | None = None) -> Activation:
    """fp8_linear (fp8_gate_up_silu with `silu_mul`, and its `output_layout`) of x [rows, K] in `dtype`, given x
    already quantized in the layout input_quantization gave; through `chosen` (a W8A8 choice: the tuner's
    candidates), else the table's."""
    chosen = chosen or choice(rows, weight, silu_mul)
    return _w8a8(quantized, rows, dtype, weight, scale, block, bias, silu_mul, chosen, output_layout)


def takes_scaled_mm(k: int, weight: torch.Tensor, block: tuple[int, int]) -> bool:
    """torch's blockwise scaled_mm (sm90, CUDA 12.9+) of K columns: 128 x 128 weight blocks, whole K blocks."""
    return block == (128, 128) and k % 128 == 0 and weight.shape[0] % 128 == 0


def takes_deepgemm(rows: int, weight: torch.Tensor, block: tuple[int, int], scale: torch.Tensor | None = None,
                   dtype: torch.dtype = torch.bfloat16) -> bool:
    """DeepGEMM (installed) of `rows` rows: deepgemm_fp8.takes; the scales checked where given."""
    return deepgemm_fp8.available() and deepgemm_fp8.takes(rows, weight, weight if scale is None else scale,
                                                            block, dtype)


def _scaled_mm_quantized(x_quantized: torch.Tensor, x_scale: torch.Tensor, weight: torch.Tensor,
                         scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The padded rows' product, the weight scales' K blocks padded to a multiple of 4 as cuBLAS wants."""
    w_scale = F.pad(scale, (0, -scale.shape[1] % 4)) if scale.shape[1] % 4 else scale
    if hasattr(F, "scaled_mm"):  # newer torch names the scalings
        return F.scaled_mm(x_quantized, weight.t(), x_scale, F.ScalingType.BlockWise1x128, w_scale.t(),
                           F.ScalingType.BlockWise128x128, output_dtype=dtype)
    # older, _scaled_mm tells them from the scales' shapes
    return torch._scaled_mm(x_quantized, weight.t(), scale_a=x_scale, scale_b=w_scale.t(), out_dtype=dtype)


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int],
               bias: torch.Tensor | None = None) -> torch.Tensor:
    if not on_kernels(x, block):
        return fp8_reference.fp8_linear(x, weight, scale, block, bias)
    if x.shape[0] == 1:
        from nanoserve_kernels.triton_gemv import gemv, takes_fp8
        if takes_fp8(weight, block):
            return gemv(x, weight, bias, weight_scale=scale, block=block)
    return _gemm(x, weight, scale, block, bias, silu_mul=False)


def fp8_gate_up_silu(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int],
                     bias: torch.Tensor | None = None, output_layout: dict | None = None) -> Activation | None:
    """silu(gate) * up of x [rows > 1, K] times the packed (gate, up) e4m3 weight, the SiLU-and-mul in the
    GEMM's epilogue, or a pass of its own that quantizes it in `output_layout` if given (scaled_mm, DeepGEMM); None
    where the kernels do not take x."""
    if not on_kernels(x, block) or x.shape[0] < 2:
        return None
    return _gemm(x, weight, scale, block, bias, silu_mul=True, output_layout=output_layout)
