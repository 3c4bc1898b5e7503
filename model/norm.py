"""RMSNorm, with the residual add of the next block fused into it."""
import torch
from torch import nn

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

    def _normalize(self, x: torch.Tensor) -> torch.Tensor:
        # Statistics in float32; the scale is applied in the model dtype, as transformers does.
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(dim=-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """norm(x); or, given the residual stream, (norm(x + residual), x + residual)."""
        if residual is None:
            return self._normalize(x)
        residual = x + residual
        return self._normalize(residual), residual
