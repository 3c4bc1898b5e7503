"""The gated activation of the Qwen3 MLP."""
import torch
import torch.nn.functional as F
from torch import nn


class SiluAndMul(nn.Module):
    """[.., 2 * d] packed as (gate, up) -> silu(gate) * up, [.., d]."""

    def forward(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up
