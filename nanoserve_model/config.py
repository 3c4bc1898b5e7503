"""The hyper-parameters a worker needs, read from a checkpoint's config.json and generation_config.json
(no transformers). Every family reads the same fields; what a family reads differently (its sliding
window, its experts) it says itself (nanoserve_model.registry passes it in). Anything nanoserve cannot
run is an error here, naming the file and the field, before any weight is read."""
import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch

from nanoserve_model.moe_config import MoeConfig
from nanoserve_model.quantization import Fp8Scheme, QuantizationError, read_quantization

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
ROPE_TYPES = ("default", "llama3")


class ConfigError(ValueError):
    """A checkpoint nanoserve cannot serve, said in terms of its files and fields."""


@dataclass(frozen=True)
class RopeConfig:
    """Rotary embedding: the base `theta` and, for Llama 3.x, its frequency scaling."""
    theta: float
    type: str = "default"                 # one of ROPE_TYPES
    factor: float = 1.0                   # llama3: low frequencies are divided by it
    low_freq_factor: float = 1.0          # llama3: wavelengths beyond original / low are scaled
    high_freq_factor: float = 1.0         # llama3: wavelengths below original / high are kept
    original_max_position_embeddings: int = 0


@dataclass(frozen=True)
class SamplingDefaults:
    """generation_config.json's sampling values (None where it sets none): a request that leaves one
    unset gets the model's, as vLLM does."""
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None


@dataclass(frozen=True)
class ModelConfig:
    architecture: str               # config.json `architectures[0]`: the model class (nanoserve_model.registry)
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope: RopeConfig
    max_position_embeddings: int
    tie_word_embeddings: bool
    dtype: str                      # the checkpoint's own dtype name
    eos_token_ids: tuple[int, ...]  # from config.json and generation_config.json
    attention_bias: bool = False    # config.json's switch; each family says which projections it biases
    mlp_bias: bool = False
    sliding_window: int | None = None  # attention window in tokens; None: full attention
    moe: MoeConfig | None = None       # a mixture-of-experts family's experts; None: dense
    sampling_defaults: SamplingDefaults = SamplingDefaults()
    quantization: Fp8Scheme | None = None  # config.json's `quantization_config`: FP8 weights

    @classmethod
    def from_dir(cls, path: str | Path, sliding_window: int | None = None, moe: MoeConfig | None = None
                 ) -> "ModelConfig":
        path = Path(path)
        raw = read_config_json(path)
        where = f"{path / 'config.json'}"
        for field in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                      "num_attention_heads", "max_position_embeddings"):
            if not isinstance(raw.get(field), int):
                raise ConfigError(f"{where}: `{field}` is missing or not an integer")
        try:
            quantization = read_quantization(raw.get("quantization_config"), where)
        except QuantizationError as err:
            raise ConfigError(str(err)) from None
        if raw.get("hidden_act", "silu") != "silu":
            raise ConfigError(f"{where}: `hidden_act` {raw['hidden_act']!r} is not supported (only silu)")
        dtype = raw.get("dtype") or raw.get("torch_dtype") or "bfloat16"
        if dtype not in DTYPES:
            raise ConfigError(f"{where}: `dtype` {dtype!r} is not supported: one of {', '.join(DTYPES)}")
        return cls(
            architecture=architecture(raw, where),
            vocab_size=raw["vocab_size"],
            hidden_size=raw["hidden_size"],
            intermediate_size=raw["intermediate_size"],
            num_hidden_layers=raw["num_hidden_layers"],
            num_attention_heads=raw["num_attention_heads"],
            num_key_value_heads=raw.get("num_key_value_heads") or raw["num_attention_heads"],
            head_dim=raw.get("head_dim") or raw["hidden_size"] // raw["num_attention_heads"],
            rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
            rope=_rope(raw, where),
            max_position_embeddings=raw["max_position_embeddings"],
            tie_word_embeddings=raw.get("tie_word_embeddings", False),
            dtype=dtype,
            eos_token_ids=_eos_token_ids(raw, path),
            attention_bias=raw.get("attention_bias", False),
            mlp_bias=raw.get("mlp_bias", False),
            sliding_window=sliding_window,
            moe=moe,
            sampling_defaults=_sampling_defaults(path),
            quantization=quantization,
        )

    def context_limit(self, requested: int) -> int:
        """The longest sequence to serve: `requested` (0: the model's own), within what the model can attend
        to. Attention is over the whole context, so a sliding-window model serves up to its window."""
        limit = min(self.max_position_embeddings, self.sliding_window or self.max_position_embeddings)
        if requested == 0:
            return limit
        if requested > self.max_position_embeddings:
            raise ConfigError(f"--max-model-len {requested} exceeds the model's max_position_embeddings "
                              f"{self.max_position_embeddings} (config.json)")
        if requested > limit:
            raise ConfigError(f"--max-model-len {requested} exceeds the model's attention window: config.json "
                              f"`sliding_window` is {self.sliding_window} and nanoserve attends over the whole "
                              f"context, which equals the window only up to {limit} tokens; serve with "
                              f"--max-model-len {limit} or less")
        return requested


def read_config_json(path: Path) -> dict:
    file = path / "config.json"
    if not file.is_file():
        raise ConfigError(f"{path}: no config.json (is this a checkpoint directory?)")
    try:
        return json.loads(file.read_text())
    except json.JSONDecodeError as err:
        raise ConfigError(f"{file}: not valid JSON ({err})") from None


def architecture(raw: dict, where: str) -> str:
    names = raw.get("architectures") or []
    if len(names) != 1:
        raise ConfigError(f"{where}: `architectures` is {names!r}; expected one model class name")
    return names[0]


def _rope(raw: dict, where: str) -> RopeConfig:
    """transformers 5 writes `rope_parameters` (theta inside); checkpoints on the Hub mostly carry the
    older top-level `rope_theta` with an optional `rope_scaling`."""
    field = "rope_parameters" if raw.get("rope_parameters") else "rope_scaling"
    params = raw.get(field) or {}
    kind = params.get("rope_type", params.get("type", "default"))
    if kind not in ROPE_TYPES:
        raise ConfigError(f"{where}: `{field}` rope_type {kind!r} is not supported: one of {', '.join(ROPE_TYPES)}")
    if params.get("partial_rotary_factor", raw.get("partial_rotary_factor", 1.0)) != 1.0:
        raise ConfigError(f"{where}: `partial_rotary_factor` is not supported (rotary over the whole head only)")
    theta = float(params.get("rope_theta", raw.get("rope_theta", 10000.0)))
    if kind == "default":
        return RopeConfig(theta)
    try:
        rope = RopeConfig(theta, kind, float(params["factor"]), float(params["low_freq_factor"]),
                          float(params["high_freq_factor"]), int(params["original_max_position_embeddings"]))
    except KeyError as err:
        raise ConfigError(f"{where}: `{field}` of rope_type llama3 has no {err}") from None
    if not rope.high_freq_factor > rope.low_freq_factor:
        raise ConfigError(f"{where}: `{field}` needs high_freq_factor > low_freq_factor")
    return rope


def _as_list(value: int | list[int] | None) -> list[int]:
    if value is None:
        return []
    return [value] if isinstance(value, int) else list(value)


def _generation_config(path: Path) -> dict:
    file = path / "generation_config.json"
    return json.loads(file.read_text()) if file.exists() else {}


def _eos_token_ids(raw: dict, path: Path) -> tuple[int, ...]:
    ids = _as_list(raw.get("eos_token_id")) + _as_list(_generation_config(path).get("eos_token_id"))
    return tuple(dict.fromkeys(ids))  # unique, first-seen order


def _sampling_defaults(path: Path) -> SamplingDefaults:
    generation = _generation_config(path)
    where = path / "generation_config.json"

    def value(field: str, kind: type, valid) -> float | int | None:
        if generation.get(field) is None:
            return None
        number = generation[field]
        if isinstance(number, bool) or not isinstance(number, (int, float)) or not valid(number):
            raise ConfigError(f"{where}: `{field}` {number!r} is not a valid value")
        return kind(number)

    return SamplingDefaults(
        temperature=value("temperature", float, lambda t: math.isfinite(t) and t >= 0),
        top_p=value("top_p", float, lambda p: 0 < p <= 1),
        top_k=value("top_k", int, lambda k: k >= 0 and k == int(k)),
    )


def resolve_dtype(flag: str, config: ModelConfig) -> torch.dtype:
    """The dtype to run in: the flag, or the checkpoint's own when the flag is 'auto'."""
    name = config.dtype if flag == "auto" else flag
    if name not in DTYPES:
        raise ConfigError(f"--dtype {name!r} is not supported: use one of {', '.join(DTYPES)}")
    return DTYPES[name]
