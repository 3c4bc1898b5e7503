"""RMSNorm, with the residual add of the next block fused into it."""
import torch
from torch import nn

from nanoserve_model.parallel import set_weight_loader


def rms_normalize(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The plain function (Qwen3's q/k norm fuses it with rotary). Statistics in float32; the scale
    is applied in the model dtype, as transformers does."""
    x32 = x.float()
    return weight * (x32 * torch.rsqrt(x32.pow(2).mean(dim=-1, keepdim=True) + eps)).to(x.dtype)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """On CUDA one Triton pass (nanoserve_kernels/triton_rms_norm.py); on CPU the plain function."""
    if x.is_cuda:
        from nanoserve_kernels.triton_rms_norm import rms_norm as on_gpu  # Triton: a GPU requirement only
        return on_gpu(x, weight, eps)
    return rms_normalize(x, weight, eps)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """(norm(x + residual), x + residual), on CUDA in the same Triton pass."""
    if x.is_cuda:
        from nanoserve_kernels.triton_rms_norm import rms_norm as on_gpu
        return on_gpu(x, weight, eps, residual)
    residual = x + residual
    return rms_normalize(residual, weight, eps), residual


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = set_weight_loader(nn.Parameter(torch.ones(size)), self.load_weight, {None: (size,)})

    @staticmethod
    def load_weight(param: nn.Parameter, loaded: torch.Tensor) -> None:
        param.data.copy_(loaded)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """norm(x); or, given the residual stream, (norm(x + residual), x + residual)."""
        if residual is None:
            return rms_norm(x, self.weight, self.eps)
        return add_rms_norm(x, residual, self.weight, self.eps)
