"""Decode-step fusions on CUDA. At batch 1 the RMSNorm before the q/k/v and gate/up projections is
made in the matrix-vector kernel's loads of x (nanoserve_kernels/triton_gemv.py), and the SiLU-and-mul
after gate/up in its output, instead of in kernels of their own: three fewer launches per layer where a
step is ~10 small kernels per layer. At 2 to 128 rows the SiLU-and-mul is made in the gate/up GEMM's
epilogue (nanoserve_kernels/triton_gate_up.py; for e4m3 weights, at any batch size past one row, the
FP8 GEMM's: nanoserve_kernels/fp8_linear.py). Before an e4m3 projection that runs W8A8 at the batch's size,
the RMSNorm writes the quantized activations itself (nanoserve_kernels/triton_rms_norm.rms_norm_fp8), in
place of a quantization pass; so does the SiLU-and-mul pass after an e4m3 gate/up run by torch's scaled_mm,
for the down projection, and a decode step's attention kernel for the o projection (a head is one group of
128 columns). Larger batches and the CPU run the separate modules, as does any step where FUSED lacks the
fusion."""
import torch

from nanoserve_kernels.fp8_linear import Activation
from nanoserve_model.activation import silu_and_mul
from nanoserve_model.linear import ColumnParallelLinear, RowParallelLinear, on_matvec_path
from nanoserve_model.norm import RMSNorm

# The fusions in use; tests take them out to compare with the separate kernels.
FUSED = {"rms_norm", "silu_mul", "gate_up_silu", "rms_norm_quant", "silu_mul_quant", "attention_quant"}


def takes_weight(proj: ColumnParallelLinear) -> bool:
    """Whether the matrix-vector kernel reads the projection's weight: 16-bit, or e4m3 in scale blocks it tiles."""
    if proj.weight_scale is None:
        return True
    from nanoserve_kernels.triton_gemv import takes_fp8
    return takes_fp8(proj.weight, proj.weight_block)


def fp8_args(proj: ColumnParallelLinear) -> dict:
    """The matrix-vector kernel's arguments for an e4m3 weight (none for a 16-bit one)."""
    return {} if proj.weight_scale is None else dict(weight_scale=proj.weight_scale, block=proj.weight_block)


def row_parallel_layout(proj: RowParallelLinear | None, rows_like: torch.Tensor, fusion: str) -> dict | None:
    """The layout in which an e4m3 row-parallel projection's W8A8 GEMM takes a batch of rows_like's rows (its
    device and dtype), for the kernel making the activations to quantize them into (the SiLU-and-mul pass
    before down, the decode attention before o); None where it takes them unquantized or `fusion` is off."""
    if proj is None or proj.weight_scale is None or fusion not in FUSED:
        return None
    from nanoserve_kernels.fp8_linear import input_quantization
    return input_quantization(rows_like, proj.weight, proj.weight_block, columns=proj.weight.shape[1])


def _norm_quantized_project(norm: RMSNorm, proj: ColumnParallelLinear, hidden: torch.Tensor,
                            residual: torch.Tensor | None, silu_mul: bool, output_layout: dict | None = None
                            ) -> tuple[Activation, torch.Tensor] | None:
    """norm_project (silu(gate) * up of it with `silu_mul`, quantized in `output_layout` where a pass makes it)
    with the norm quantizing its output for the e4m3 projection's W8A8 GEMM; None where the projection takes
    this batch unquantized (16-bit, weight-only, one row) or the fusion is off."""
    if "rms_norm_quant" not in FUSED or proj.weight_scale is None or norm.weight.dtype != hidden.dtype:
        return None
    from nanoserve_kernels.fp8_linear import input_quantization, quantized_linear
    layout = input_quantization(hidden, proj.weight, proj.weight_block, silu_mul)
    if layout is None:
        return None
    from nanoserve_kernels.triton_rms_norm import rms_norm_fp8
    quantized, new_residual = rms_norm_fp8(hidden, norm.weight, norm.eps, residual, **layout)
    out = quantized_linear(quantized, hidden.shape[0], hidden.dtype, proj.weight, proj.weight_scale,
                           proj.weight_block, proj.bias, silu_mul, output_layout=output_layout)
    return out, hidden if residual is None else new_residual


def norm_project(norm: RMSNorm, proj: ColumnParallelLinear, hidden: torch.Tensor, residual: torch.Tensor | None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """(proj(norm(hidden + residual)), hidden + residual): the projection and the residual stream it
    has not been added to; without a residual stream yet (the first layer), of hidden alone."""
    if "rms_norm" in FUSED and on_matvec_path(hidden) and takes_weight(proj):
        from nanoserve_kernels.triton_gemv import rms_norm_gemv  # Triton is a GPU requirement only
        return rms_norm_gemv(hidden, residual, norm.weight, norm.eps, proj.weight, proj.bias, **fp8_args(proj))
    fused = _norm_quantized_project(norm, proj, hidden, residual, silu_mul=False)
    if fused is not None:
        return fused
    if residual is None:
        return proj(norm(hidden)), hidden
    hidden, residual = norm(hidden, residual)
    return proj(hidden), residual


def norm_project_silu_mul(norm: RMSNorm, proj: ColumnParallelLinear, hidden: torch.Tensor,
                          residual: torch.Tensor, down: RowParallelLinear | None = None
                          ) -> tuple[Activation, torch.Tensor]:
    """(silu(gate) * up of proj(norm(hidden + residual)) packed as (gate, up), hidden + residual); the
    activation already quantized for `down`, the projection it goes to, where a pass of its own makes it
    (a tuple: RowParallelLinear.forward_quantized takes it)."""
    if {"rms_norm", "silu_mul"} <= FUSED and on_matvec_path(hidden) and takes_weight(proj):
        from nanoserve_kernels.triton_gemv import rms_norm_gemv
        return rms_norm_gemv(hidden, residual, norm.weight, norm.eps, proj.weight, proj.bias, silu_mul=True,
                             **fp8_args(proj))
    if "gate_up_silu" in FUSED and proj.weight_scale is not None and hidden.shape[0] > 1:
        layout = row_parallel_layout(down, hidden, "silu_mul_quant")
        fused = _norm_quantized_project(norm, proj, hidden, residual, silu_mul=True, output_layout=layout)
        if fused is not None:
            return fused
        from nanoserve_kernels.fp8_linear import fp8_gate_up_silu
        normed, new_residual = norm(hidden, residual)
        activation = fp8_gate_up_silu(normed, proj.weight, proj.weight_scale, proj.weight_block, proj.bias, layout)
        if activation is not None:
            return activation, new_residual
        return silu_and_mul(proj(normed)), new_residual
    if "gate_up_silu" in FUSED and hidden.is_cuda and proj.bias is None:
        from nanoserve_kernels.triton_gate_up import gate_up_silu, takes
        if takes(hidden, proj.weight):
            hidden, residual = norm(hidden, residual)
            return gate_up_silu(hidden, proj.weight), residual
    gate_up, residual = norm_project(norm, proj, hidden, residual)
    return silu_and_mul(gate_up), residual
