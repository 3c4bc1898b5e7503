"""The decoder-only transformer that Llama, Qwen2, Qwen3, Qwen3-MoE and Mistral share: token embedding;
layers of GQA attention with rotary and a SiLU-gated MLP (or a block of experts: nanoserve_model.moe),
each behind an RMSNorm with the residual add fused in (at batch 1 on CUDA, into the projection after
it: nanoserve_model.row_fusion); a final norm and a tied or untied LM head. It runs over a flat batch
of tokens (all sequences of a step packed together) with its attention in the paged KV cache, built
from tensor-parallel layers.

A family (one file each, named in nanoserve_model.registry) subclasses DecoderForCausalLM and says only where it
differs: which projections carry a bias, Qwen3's q/k norms, how its config.json sets a sliding window,
which layers have experts. Module names follow transformers', so checkpoint tensors map onto
parameters by name."""
from typing import Callable

import torch
from torch import nn

from nanoserve_kernels.backend import CacheWrite
from nanoserve_model.attention import Attention
from nanoserve_model.config import ModelConfig
from nanoserve_model.embedding import ParallelLMHead, VocabParallelEmbedding
from nanoserve_model.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from nanoserve_model.moe_config import MoeConfig
from nanoserve_model.norm import RMSNorm
from nanoserve_model.rotary import RotaryEmbedding, rotary_qk
from nanoserve_model.row_fusion import norm_project, norm_project_silu_mul, row_parallel_layout


class DecoderAttention(nn.Module):
    def __init__(self, config: ModelConfig, rotary_emb: RotaryEmbedding, qkv_bias: bool = False,
                 o_bias: bool = False):
        super().__init__()
        head_dim = config.head_dim
        self.qkv_proj = QKVParallelLinear(config.hidden_size, head_dim, config.num_attention_heads,
                                          config.num_key_value_heads, qkv_bias)
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.o_proj = RowParallelLinear(config.num_attention_heads * head_dim, config.hidden_size, o_bias)
        self.rotary_emb = rotary_emb
        self.attn = Attention(self.num_heads, self.num_kv_heads, head_dim)

    def forward(self, positions: torch.Tensor, qkv: torch.Tensor) -> torch.Tensor:
        """Attention from the packed q/k/v projection, which the layer runs (fused with its norm)."""
        head_dim = self.attn.head_dim
        q, k, v = qkv.split(
            [self.num_heads * head_dim, self.num_kv_heads * head_dim, self.num_kv_heads * head_dim], dim=-1)
        q, v = q.view(-1, self.num_heads, head_dim), v.view(-1, self.num_kv_heads, head_dim)
        write = self.attn.cache_write(q, v)
        q, k = self.position(q, k.view(-1, self.num_kv_heads, head_dim), positions, write, self.attn.query_buffer(q))
        out = self.attn(q, k, v, stored=write is not None,
                        quantization=row_parallel_layout(self.o_proj, q[:, 0], "attention_quant"))
        if isinstance(out, tuple):  # quantized for the o projection by the decode kernel
            return self.o_proj.forward_quantized(out, len(q), q.dtype)
        return self.o_proj(out.flatten(1))

    def position(self, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, write: CacheWrite | None,
                 q_out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """q [N, heads, head_dim] and k [N, kv_heads, head_dim] made position-aware: rotary; with
        `write` (on CUDA only), k and write.v also stored into the cache; with `q_out`, q written there."""
        return rotary_qk(q, k, self.rotary_emb.cos, self.rotary_emb.sin, positions, write, q_out)


class GatedMLP(nn.Module):
    def __init__(self, config: ModelConfig, bias: bool = False):
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(config.hidden_size, [config.intermediate_size] * 2, bias)
        self.down_proj = RowParallelLinear(config.intermediate_size, config.hidden_size, bias)

    def forward(self, activation: torch.Tensor) -> torch.Tensor:
        """The MLP from silu(gate) * up, which after_norm makes (fused with the norm and projection)."""
        return self.down_proj(activation)

    def after_norm(self, norm: RMSNorm, hidden: torch.Tensor, residual: torch.Tensor
                   ) -> tuple[torch.Tensor, torch.Tensor]:
        """(the MLP of norm(hidden + residual), hidden + residual)."""
        activation, residual = norm_project_silu_mul(norm, self.gate_up_proj, hidden, residual, self.down_proj)
        if isinstance(activation, tuple):  # quantized for the down projection by the SiLU-and-mul pass
            return self.down_proj.forward_quantized(activation, hidden.shape[0], hidden.dtype), residual
        return self(activation), residual


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, self_attn: DecoderAttention, mlp: nn.Module):
        """`mlp`: a GatedMLP, or a family's own block with the same after_norm() (experts:
        nanoserve_model.moe)."""
        super().__init__()
        self.self_attn = self_attn
        self.mlp = mlp
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, residual: torch.Tensor | None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns the block's output and the residual stream it has not yet been added to."""
        qkv, residual = norm_project(self.input_layernorm, self.self_attn.qkv_proj, hidden, residual)
        hidden = self.self_attn(positions, qkv)
        return self.mlp.after_norm(self.post_attention_layernorm, hidden, residual)


class DecoderModel(nn.Module):
    def __init__(self, config: ModelConfig, make_layer: Callable[[RotaryEmbedding, int], DecoderLayer]):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        # One cos/sin table shared by every layer (it is large for long-context models).
        rotary_emb = RotaryEmbedding(config.head_dim, config.max_position_embeddings, config.rope)
        self.layers = nn.ModuleList(make_layer(rotary_emb, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        hidden, residual = self.embed_tokens(input_ids), None
        for layer in self.layers:
            hidden, residual = layer(positions, hidden, residual)
        hidden, _ = self.norm(hidden, residual)
        return hidden


class DecoderForCausalLM(nn.Module):
    """The shared skeleton, without biases; a family overrides attention(), mlp(), sliding_window() and
    moe_config() where its checkpoints differ."""
    # checkpoint module name -> (our packed module, shard id in it)
    packed_modules = {
        "q_proj": ("qkv_proj", "q"), "k_proj": ("qkv_proj", "k"), "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
    }

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.model = DecoderModel(config, lambda rotary_emb, layer: DecoderLayer(
            config, self.attention(config, rotary_emb), self.mlp(config, layer)))
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def attention(self, config: ModelConfig, rotary_emb: RotaryEmbedding) -> DecoderAttention:
        return DecoderAttention(config, rotary_emb)

    def mlp(self, config: ModelConfig, layer: int) -> nn.Module:
        """Decoder layer `layer`'s MLP."""
        return GatedMLP(config)

    @classmethod
    def sliding_window(cls, raw_config: dict) -> int | None:
        """The attention window (tokens) config.json sets for this family; None: full attention."""
        return None

    @classmethod
    def moe_config(cls, raw_config: dict, where: str) -> MoeConfig | None:
        """The experts config.json sets for this family; None: a dense model."""
        return None

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Final hidden states [N, hidden] of N packed tokens at their positions."""
        return self.model(input_ids, positions)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """Logits of the given rows (rank 0; None on other ranks)."""
        return self.lm_head(hidden)

    def attention_layers(self) -> list[Attention]:
        return [layer.self_attn.attn for layer in self.model.layers]
