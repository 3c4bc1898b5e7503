"""Rotary position embedding (the rotate-half form of Llama, Qwen and Mistral): the precomputed cos/sin
tables, with Llama 3.x's frequency scaling, and the rotation of q and k. Qwen3 runs the rotation fused
with its q/k norms (nanoserve_model.qwen3.qk_norm_rotary); on CUDA both are one Triton kernel
(nanoserve_kernels.triton_rotary), which also stores k and v into the KV cache where the attention
backend's store is Triton's (nanoserve_model.attention.Attention.cache_write)."""
import math

import torch
from torch import nn

from nanoserve_kernels.backend import CacheWrite
from nanoserve_model.config import RopeConfig


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half rotary embedding of x [N, heads, head_dim] by cos/sin [N, 1, head_dim / 2]."""
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)


def rotary_qk(q: torch.Tensor, k: torch.Tensor, cos_table: torch.Tensor, sin_table: torch.Tensor,
              positions: torch.Tensor, write: CacheWrite | None = None, q_out: torch.Tensor | None = None
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """q [N, heads, head_dim] and k [N, kv_heads, head_dim] rotated by each token's row of the tables;
    on CUDA in place, in one Triton launch, which also makes the cache `write` if given (only there).
    With `q_out`, the rotated q is written there."""
    if q.is_cuda:  # Triton is a GPU requirement only, so imported here
        from nanoserve_kernels.triton_rotary import rotate_qk_
        return rotate_qk_(q, k, cos_table, sin_table, positions, write=write, q_out=q_out)
    cos, sin = cos_table[positions].unsqueeze(1), sin_table[positions].unsqueeze(1)
    return into(rotate(q, cos, sin), q_out), rotate(k, cos, sin)


def into(q: torch.Tensor, q_out: torch.Tensor | None) -> torch.Tensor:
    """q, or q copied into q_out if given (the torch paths' side of rotate_qk_'s q_out)."""
    return q if q_out is None else q_out.copy_(q)


def inverse_frequencies(head_dim: int, rope: RopeConfig) -> torch.Tensor:
    """theta^(-2i / head_dim) for i < head_dim / 2, float32; llama3 scaling divides the low frequencies
    (wavelengths beyond original / low_freq_factor) by `factor`, keeps the high ones (wavelengths below
    original / high_freq_factor) and blends linearly, in original / wavelength, in between."""
    inv_freq = 1.0 / (rope.theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    if rope.type == "default":
        return inv_freq
    periods_in_context = rope.original_max_position_embeddings * inv_freq / (2 * math.pi)  # original / wavelength
    kept = ((periods_in_context - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)).clamp(0, 1)
    return inv_freq / rope.factor * (1 - kept) + inv_freq * kept


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, max_position: int, rope: RopeConfig):
        super().__init__()
        angles = torch.outer(torch.arange(max_position, dtype=torch.float32), inverse_frequencies(head_dim, rope))
        # [max_position, head_dim / 2] each; not a parameter, so the loader never sees it.
        self.register_buffer("cos", angles.cos(), persistent=False)
        self.register_buffer("sin", angles.sin(), persistent=False)
