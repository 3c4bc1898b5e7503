"""Rotary position embedding (the rotate-half form Qwen3 uses): the precomputed cos/sin tables and
the rotation. Qwen3 runs the rotation fused with its q/k norms (model.qwen3.qk_norm_rotary)."""
import torch
from torch import nn


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half rotary embedding of x [N, heads, head_dim] by cos/sin [N, 1, head_dim / 2]."""
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, max_position: int, theta: float):
        super().__init__()
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
        angles = torch.outer(torch.arange(max_position, dtype=torch.float32), inv_freq)
        # [max_position, head_dim / 2] each; not a parameter, so the loader never sees it.
        self.register_buffer("cos", angles.cos(), persistent=False)
        self.register_buffer("sin", angles.sin(), persistent=False)
