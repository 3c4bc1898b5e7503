"""Batch-1 decode: the RMSNorm before the q/k/v and gate/up projections and the SiLU-and-mul before
the down projection are made in the matrix-vector kernel's loads of x (nanoserve_kernels/triton_gemv.py)
instead of in kernels of their own: three fewer launches per layer where a step is ~10 small
kernels per layer. Larger batches and the CPU run the separate modules, as does any step where
FUSED lacks the prologue."""
import torch

from nanoserve_model.activation import silu_and_mul
from nanoserve_model.linear import ColumnParallelLinear, RowParallelLinear, on_matvec_path
from nanoserve_model.norm import RMSNorm

# The prologues in use; tests and bench/gemv.py take them out to compare with the separate kernels.
FUSED = {"rms_norm", "silu_mul"}


def norm_project(norm: RMSNorm, proj: ColumnParallelLinear, hidden: torch.Tensor, residual: torch.Tensor | None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """(proj(norm(hidden + residual)), hidden + residual): the projection and the residual stream it
    has not been added to; without a residual stream yet (the first layer), of hidden alone."""
    if "rms_norm" in FUSED and on_matvec_path(hidden):
        from nanoserve_kernels.triton_gemv import rms_norm_gemv  # Triton is a GPU requirement only
        return rms_norm_gemv(hidden, residual, norm.weight, norm.eps, proj.weight, proj.bias)
    if residual is None:
        return proj(norm(hidden)), hidden
    hidden, residual = norm(hidden, residual)
    return proj(hidden), residual


def silu_mul_project(proj: RowParallelLinear, gate_up: torch.Tensor) -> torch.Tensor:
    """proj(silu(gate) * up) of this rank's packed (gate, up) shards."""
    if "silu_mul" in FUSED and on_matvec_path(gate_up):
        from nanoserve_kernels.triton_gemv import silu_mul_gemv
        return proj.reduce(silu_mul_gemv(gate_up, proj.weight))
    return proj(silu_and_mul(gate_up))
