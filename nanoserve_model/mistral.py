"""Mistral: the shared decoder without biases. Its config.json may set a `sliding_window` (Mistral 7B
v0.1: 4096; later versions null); transformers takes 4096 when the field is absent."""
from nanoserve_model.decoder import DecoderForCausalLM

DEFAULT_SLIDING_WINDOW = 4096


class MistralForCausalLM(DecoderForCausalLM):
    @classmethod
    def sliding_window(cls, raw_config: dict) -> int | None:
        return raw_config.get("sliding_window", DEFAULT_SLIDING_WINDOW)
