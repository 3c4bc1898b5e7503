"""Qwen3 for causal LM, built from tensor-parallel layers; runs over a flat batch of tokens
(all sequences of a step packed together) with its attention in the paged KV cache."""
import torch
from torch import nn

from model.activation import SiluAndMul
from model.attention import Attention
from model.compiled import fused_on_cuda
from model.embedding import ParallelLMHead, VocabParallelEmbedding
from model.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from model.norm import RMSNorm, rms_normalize
from model.qwen3_config import Qwen3Config
from model.rotary import RotaryEmbedding, rotate


@fused_on_cuda
def qk_norm_rotary(q: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor, eps: float,
                   cos_table: torch.Tensor, sin_table: torch.Tensor, positions: torch.Tensor
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """Qwen3's per-head RMSNorm of q [N, heads, head_dim] and k [N, kv_heads, head_dim], then
    rotary by each token's row of the cos/sin tables: one pass instead of six kernels a layer."""
    cos, sin = cos_table[positions].unsqueeze(1), sin_table[positions].unsqueeze(1)
    return (rotate(rms_normalize(q, q_weight, eps), cos, sin),
            rotate(rms_normalize(k, k_weight, eps), cos, sin))


class Qwen3Attention(nn.Module):
    def __init__(self, config: Qwen3Config, rotary_emb: RotaryEmbedding):
        super().__init__()
        head_dim = config.head_dim
        self.qkv_proj = QKVParallelLinear(config.hidden_size, head_dim, config.num_attention_heads,
                                          config.num_key_value_heads)
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.o_proj = RowParallelLinear(config.num_attention_heads * head_dim, config.hidden_size)
        self.q_norm = RMSNorm(head_dim, config.rms_norm_eps)  # weights only: applied in qk_norm_rotary
        self.k_norm = RMSNorm(head_dim, config.rms_norm_eps)
        self.rotary_emb = rotary_emb
        self.attn = Attention(self.num_heads, self.num_kv_heads, head_dim)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        head_dim = self.attn.head_dim
        q, k, v = self.qkv_proj(hidden).split(
            [self.num_heads * head_dim, self.num_kv_heads * head_dim, self.num_kv_heads * head_dim], dim=-1)
        q, k = qk_norm_rotary(q.view(-1, self.num_heads, head_dim), k.view(-1, self.num_kv_heads, head_dim),
                              self.q_norm.weight, self.k_norm.weight, self.q_norm.eps,
                              self.rotary_emb.cos, self.rotary_emb.sin, positions)
        out = self.attn(q, k, v.view(-1, self.num_kv_heads, head_dim))
        return self.o_proj(out.flatten(1))


class Qwen3MLP(nn.Module):
    def __init__(self, config: Qwen3Config):
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(config.hidden_size, [config.intermediate_size] * 2)
        self.down_proj = RowParallelLinear(config.intermediate_size, config.hidden_size)
        self.act_fn = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


class Qwen3DecoderLayer(nn.Module):
    def __init__(self, config: Qwen3Config, rotary_emb: RotaryEmbedding):
        super().__init__()
        self.self_attn = Qwen3Attention(config, rotary_emb)
        self.mlp = Qwen3MLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, residual: torch.Tensor | None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns the block's output and the residual stream it has not yet been added to."""
        if residual is None:
            hidden, residual = self.input_layernorm(hidden), hidden
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(positions, hidden)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class Qwen3Model(nn.Module):
    def __init__(self, config: Qwen3Config):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        # One cos/sin table shared by every layer (it is large for long-context models).
        rotary_emb = RotaryEmbedding(config.head_dim, config.max_position_embeddings, config.rope_theta)
        self.layers = nn.ModuleList(Qwen3DecoderLayer(config, rotary_emb) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        hidden, residual = self.embed_tokens(input_ids), None
        for layer in self.layers:
            hidden, residual = layer(positions, hidden, residual)
        hidden, _ = self.norm(hidden, residual)
        return hidden


class Qwen3ForCausalLM(nn.Module):
    # checkpoint module name -> (our packed module, shard id in it)
    packed_modules = {
        "q_proj": ("qkv_proj", "q"), "k_proj": ("qkv_proj", "k"), "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
    }

    def __init__(self, config: Qwen3Config):
        super().__init__()
        self.config = config
        self.model = Qwen3Model(config)
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Final hidden states [N, hidden] of N packed tokens at their positions."""
        return self.model(input_ids, positions)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """Logits of the given rows (rank 0; None on other ranks)."""
        return self.lm_head(hidden)

    def attention_layers(self) -> list[Attention]:
        return [layer.self_attn.attn for layer in self.model.layers]
