"""Llama (2, 3.x): the shared decoder; `attention_bias` biases q, k, v and o, `mlp_bias` the MLP's
projections. Llama 3.1+ checkpoints scale their rotary frequencies (`llama3` rope, model.rotary)."""
from model.config import ModelConfig
from model.decoder import DecoderAttention, DecoderForCausalLM, GatedMLP
from model.rotary import RotaryEmbedding


class LlamaForCausalLM(DecoderForCausalLM):
    def attention(self, config: ModelConfig, rotary_emb: RotaryEmbedding) -> DecoderAttention:
        return DecoderAttention(config, rotary_emb, qkv_bias=config.attention_bias, o_bias=config.attention_bias)

    def mlp(self, config: ModelConfig) -> GatedMLP:
        return GatedMLP(config, bias=config.mlp_bias)
