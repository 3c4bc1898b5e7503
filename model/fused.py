"""Elementwise work that torch.compile fuses into single kernels on CUDA.

A decode step runs ~40 small elementwise kernels per layer; each costs a few microseconds even
inside a CUDA graph, so fusing them matters. On CPU (tests, CI) the plain functions run: no
compiler is needed and numerics stay the reference ones.
"""
import functools
from typing import Callable

import torch
import torch.nn.functional as F


# Every (dtype, layout, size-1 batch) variant is one recompile; past the limit dynamo would quietly
# run the function uncompiled, and CUDA-graph replay (compiled at capture) would then disagree with
# eager steps. One worker sees a handful of variants; tests with several models see more.
torch._dynamo.config.recompile_limit = 64


def fused_on_cuda(fn: Callable) -> Callable:
    compiled = torch.compile(fn, dynamic=True)  # compiles lazily, on the first CUDA call

    @functools.wraps(fn)
    def dispatch(x: torch.Tensor, *args):
        return compiled(x, *args) if x.is_cuda else fn(x, *args)
    return dispatch


def _normalize(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # Statistics in float32; the scale is applied in the model dtype, as transformers does.
    x32 = x.float()
    return weight * (x32 * torch.rsqrt(x32.pow(2).mean(dim=-1, keepdim=True) + eps)).to(x.dtype)


rms_norm = fused_on_cuda(_normalize)


@fused_on_cuda
def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """(norm(x + residual), x + residual)."""
    residual = x + residual
    return _normalize(residual, weight, eps), residual


@fused_on_cuda
def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half rotary embedding of x [N, heads, head_dim] by cos/sin [N, 1, head_dim / 2]."""
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)


@fused_on_cuda
def qk_norm_rotary(q: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor, eps: float,
                   cos_table: torch.Tensor, sin_table: torch.Tensor, positions: torch.Tensor
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """Qwen3's per-head RMSNorm of q [N, heads, head_dim] and k [N, kv_heads, head_dim], then
    rotary by each token's row of the cos/sin tables: one pass instead of six kernels a layer."""
    cos, sin = cos_table[positions].unsqueeze(1), sin_table[positions].unsqueeze(1)
    return _rotate(_normalize(q, q_weight, eps), cos, sin), _rotate(_normalize(k, k_weight, eps), cos, sin)


@fused_on_cuda
def race_scores(logits: torch.Tensor, temperatures: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """logits / T - log(E) per row; rows with T = 0 keep their plain logits (greedy)."""
    sampled = temperatures > 0
    scale = torch.where(sampled, temperatures, 1.0)[:, None]
    return logits.float() / scale - noise.log() * sampled[:, None]
