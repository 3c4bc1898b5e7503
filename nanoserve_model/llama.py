"""Llama (2, 3.x): the shared decoder; `attention_bias` biases q, k, v and o, `mlp_bias` the MLP's
projections. Llama 3.1+ checkpoints scale their rotary frequencies (`llama3` rope, nanoserve_model.rotary)."""
from nanoserve_model.config import ModelConfig
from nanoserve_model.decoder import DecoderAttention, DecoderForCausalLM, GatedMLP
from nanoserve_model.rotary import RotaryEmbedding


class LlamaForCausalLM(DecoderForCausalLM):
    def attention(self, config: ModelConfig, rotary_emb: RotaryEmbedding) -> DecoderAttention:
        return DecoderAttention(config, rotary_emb, qkv_bias=config.attention_bias, o_bias=config.attention_bias)

    def mlp(self, config: ModelConfig, layer: int) -> GatedMLP:
        return GatedMLP(config, bias=config.mlp_bias)
