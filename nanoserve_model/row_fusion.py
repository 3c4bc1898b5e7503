"""Batch-1 decode: the RMSNorm before the q/k/v and gate/up projections is made in the matrix-vector
kernel's loads of x (nanoserve_kernels/triton_gemv.py) instead of in a kernel of its own: two fewer
launches per layer where a step is ~10 small kernels per layer. Larger batches and the CPU run the
separate modules, as does any step where FUSED lacks the prologue."""
import torch

from nanoserve_model.linear import ColumnParallelLinear, on_matvec_path
from nanoserve_model.norm import RMSNorm

# The prologues in use; tests take them out to compare with the separate kernels.
FUSED = {"rms_norm"}


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
