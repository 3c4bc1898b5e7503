"""The gated activation of the Qwen3 MLP."""
import torch
import torch.nn.functional as F


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """[rows, 2 * d] packed as (gate, up) -> silu(gate) * up, [rows, d]. On CUDA one Triton pass
    (nanoserve_kernels/triton_activation.py), in float32 with one rounding; on CPU the plain ops."""
    if gate_up.is_cuda:
        from nanoserve_kernels.triton_activation import silu_and_mul as on_gpu  # Triton: a GPU requirement only
        return on_gpu(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up
