"""The gated activation of the Qwen3 MLP."""
import torch
import torch.nn.functional as F

from nanoserve_model.compiled import fused_on_cuda


@fused_on_cuda
def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """[.., 2 * d] packed as (gate, up) -> silu(gate) * up, [.., d]."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up
