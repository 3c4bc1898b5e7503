"""Qwen2 and Qwen2.5: the shared decoder with a bias on q, k and v (none on o, none in the MLP) and no
q/k norm."""
from nanoserve_model.config import ModelConfig
from nanoserve_model.decoder import DecoderAttention, DecoderForCausalLM
from nanoserve_model.rotary import RotaryEmbedding


def qwen_sliding_window(raw_config: dict) -> int | None:
    """Qwen configs carry a `sliding_window` that applies only with `use_sliding_window` set (transformers
    then takes 4096 when the window itself is absent)."""
    return (raw_config.get("sliding_window") or 4096) if raw_config.get("use_sliding_window") else None


class Qwen2ForCausalLM(DecoderForCausalLM):
    def attention(self, config: ModelConfig, rotary_emb: RotaryEmbedding) -> DecoderAttention:
        return DecoderAttention(config, rotary_emb, qkv_bias=True)

    @classmethod
    def sliding_window(cls, raw_config: dict) -> int | None:
        return qwen_sliding_window(raw_config)
