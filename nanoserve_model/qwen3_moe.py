"""Qwen3-MoE (Qwen3-30B-A3B, 235B-A22B): Qwen3 whose MLP is a sparse block of experts in the layers
config.json says (nanoserve_model.moe), the dense MLP in the others. Its config fields and defaults are
transformers' own; a feature of other MoE families that nanoserve does not run (a shared expert) is
refused by name, before any weight is read."""
from torch import nn

from nanoserve_model.config import ConfigError, ModelConfig
from nanoserve_model.decoder import GatedMLP
from nanoserve_model.moe import SparseMoeBlock
from nanoserve_model.moe_config import MoeConfig
from nanoserve_model.qwen3 import Qwen3ForCausalLM

# Fields other MoE families set; a Qwen3-MoE config that sets one asks for what nanoserve does not run.
UNSUPPORTED = {
    "shared_expert_intermediate_size": "a shared expert (Qwen2-MoE)",
    "n_shared_experts": "shared experts (DeepSeek)",
}


def _integer(raw: dict, field: str, where: str, default: int | None = None, least: int = 0) -> int:
    value = raw.get(field, default)
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise ConfigError(f"{where}: `{field}` is {'missing' if value is None else repr(value)}: "
                          f"it must be an integer of at least {least}")
    return value


class Qwen3MoeForCausalLM(Qwen3ForCausalLM):
    def __init__(self, config: ModelConfig):
        if config.moe is None:
            raise ConfigError(f"{config.architecture} needs its experts' config (read the checkpoint with "
                              "nanoserve_model.registry.read_model_config)")
        super().__init__(config)

    def mlp(self, config: ModelConfig, layer: int) -> nn.Module:
        return SparseMoeBlock(config.hidden_size, config.moe) if config.moe.is_sparse(layer) else GatedMLP(config)

    @classmethod
    def moe_config(cls, raw_config: dict, where: str) -> MoeConfig:
        for field, feature in UNSUPPORTED.items():
            if raw_config.get(field):
                raise ConfigError(f"{where}: `{field}` is {raw_config[field]!r}: {feature} is not supported")
        num_experts = _integer(raw_config, "num_experts", where)
        top_k = _integer(raw_config, "num_experts_per_tok", where, least=1)
        if num_experts and top_k > num_experts:
            raise ConfigError(f"{where}: `num_experts_per_tok` {top_k} exceeds `num_experts` {num_experts}")
        only = raw_config.get("mlp_only_layers") or []
        if not (isinstance(only, list) and all(isinstance(i, int) and not isinstance(i, bool) for i in only)):
            raise ConfigError(f"{where}: `mlp_only_layers` {only!r} is not a list of layer indices")
        return MoeConfig(num_experts, top_k, _integer(raw_config, "moe_intermediate_size", where, least=1),
                         bool(raw_config.get("norm_topk_prob", False)),
                         _integer(raw_config, "decoder_sparse_step", where, default=1, least=1), tuple(only))
