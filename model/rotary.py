"""Rotary position embedding (the rotate-half form Qwen3 uses): the precomputed cos/sin tables.
The rotation itself runs fused with the q/k norms (model.fused.qk_norm_rotary)."""
import torch
from torch import nn


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, max_position: int, theta: float):
        super().__init__()
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
        angles = torch.outer(torch.arange(max_position, dtype=torch.float32), inv_freq)
        # [max_position, head_dim / 2] each; not a parameter, so the loader never sees it.
        self.register_buffer("cos", angles.cos(), persistent=False)
        self.register_buffer("sin", angles.sin(), persistent=False)
