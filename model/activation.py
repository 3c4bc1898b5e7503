"""The gated activation of the Qwen3 MLP."""
import torch
from torch import nn

from model.fused import silu_and_mul


class SiluAndMul(nn.Module):
    """[.., 2 * d] packed as (gate, up) -> silu(gate) * up, [.., d]."""

    def forward(self, gate_up: torch.Tensor) -> torch.Tensor:
        return silu_and_mul(gate_up)
