"""Which model class serves a checkpoint: config.json's `architectures` name -> the family's class."""
from pathlib import Path

from nanoserve_model.config import ConfigError, ModelConfig, architecture, read_config_json
from nanoserve_model.decoder import DecoderForCausalLM
from nanoserve_model.llama import LlamaForCausalLM
from nanoserve_model.mistral import MistralForCausalLM
from nanoserve_model.qwen2 import Qwen2ForCausalLM
from nanoserve_model.qwen3 import Qwen3ForCausalLM
from nanoserve_model.qwen3_moe import Qwen3MoeForCausalLM

ARCHITECTURES: dict[str, type[DecoderForCausalLM]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": MistralForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
}


def model_class(name: str, where: str = "config.json") -> type[DecoderForCausalLM]:
    if name not in ARCHITECTURES:
        raise ConfigError(f"{where}: `architectures` {name!r} is not supported: one of {', '.join(ARCHITECTURES)}")
    return ARCHITECTURES[name]


def read_model_config(path: str | Path) -> ModelConfig:
    """The checkpoint's config, once its architecture is known to be one nanoserve implements (the
    family says how its config.json sets a sliding window and experts)."""
    path = Path(path)
    raw = read_config_json(path)
    where = str(path / "config.json")
    family = model_class(architecture(raw, where), where)
    return ModelConfig.from_dir(path, sliding_window=family.sliding_window(raw), moe=family.moe_config(raw, where))
