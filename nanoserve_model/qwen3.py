"""Qwen3: the shared decoder with a per-head RMSNorm of q and k before rotary; `attention_bias` biases
q, k, v and o alike."""
import torch

from nanoserve_kernels.backend import CacheWrite
from nanoserve_model.config import ModelConfig
from nanoserve_model.decoder import DecoderAttention, DecoderForCausalLM
from nanoserve_model.norm import RMSNorm, rms_normalize
from nanoserve_model.qwen2 import qwen_sliding_window
from nanoserve_model.rotary import RotaryEmbedding, into, rotate


def qk_norm_rotary(q: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor, eps: float,
                   cos_table: torch.Tensor, sin_table: torch.Tensor, positions: torch.Tensor,
                   write: CacheWrite | None = None, q_out: torch.Tensor | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """Qwen3's per-head RMSNorm of q [N, heads, head_dim] and k [N, kv_heads, head_dim], then
    rotary by each token's row of the cos/sin tables; on CUDA in place, in one Triton launch instead
    of the six kernels torch.compile makes of it, which also makes the cache `write` if given (only there).
    With `q_out`, the positioned q is written there."""
    if q.is_cuda:  # Triton is a GPU requirement only, so imported here
        from nanoserve_kernels.triton_rotary import rotate_qk_
        return rotate_qk_(q, k, cos_table, sin_table, positions, q_weight, k_weight, eps, write, q_out)
    cos, sin = cos_table[positions].unsqueeze(1), sin_table[positions].unsqueeze(1)
    return (into(rotate(rms_normalize(q, q_weight, eps), cos, sin), q_out),
            rotate(rms_normalize(k, k_weight, eps), cos, sin))


class Qwen3Attention(DecoderAttention):
    def __init__(self, config: ModelConfig, rotary_emb: RotaryEmbedding):
        super().__init__(config, rotary_emb, qkv_bias=config.attention_bias, o_bias=config.attention_bias)
        self.q_norm = RMSNorm(config.head_dim, config.rms_norm_eps)  # weights only: applied in qk_norm_rotary
        self.k_norm = RMSNorm(config.head_dim, config.rms_norm_eps)

    def position(self, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, write: CacheWrite | None,
                 q_out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        return qk_norm_rotary(q, k, self.q_norm.weight, self.k_norm.weight, self.q_norm.eps,
                              self.rotary_emb.cos, self.rotary_emb.sin, positions, write, q_out)


class Qwen3ForCausalLM(DecoderForCausalLM):
    def attention(self, config: ModelConfig, rotary_emb: RotaryEmbedding) -> Qwen3Attention:
        return Qwen3Attention(config, rotary_emb)

    @classmethod
    def sliding_window(cls, raw_config: dict) -> int | None:
        return qwen_sliding_window(raw_config)
