"""The gated activation of the Qwen3 MLP."""
import torch
import torch.nn.functional as F
from torch import nn

from nanoserve_model.compiled import fused_on_cuda


@fused_on_cuda
def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


class SiluAndMul(nn.Module):
    """[.., 2 * d] packed as (gate, up) -> silu(gate) * up, [.., d]."""

    def forward(self, gate_up: torch.Tensor) -> torch.Tensor:
        return silu_and_mul(gate_up)
