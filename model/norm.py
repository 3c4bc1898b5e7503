"""RMSNorm, with the residual add of the next block fused into it."""
import torch
from torch import nn

from model.fused import add_rms_norm, rms_norm
from model.parallel import check_shape


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(size))
        self.weight.weight_loader = self.load_weight

    def load_weight(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        check_shape(loaded, param.shape)
        param.data.copy_(loaded)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """norm(x); or, given the residual stream, (norm(x + residual), x + residual)."""
        if residual is None:
            return rms_norm(x, self.weight, self.eps)
        return add_rms_norm(x, residual, self.weight, self.eps)
