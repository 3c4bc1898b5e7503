"""The Qwen3 hyper-parameters a worker needs, read from a checkpoint's config.json (no transformers)."""
import json
from dataclasses import dataclass
from pathlib import Path

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class Qwen3Config:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    dtype: str                      # the checkpoint's own dtype name
    eos_token_ids: tuple[int, ...]  # from config.json and generation_config.json

    @classmethod
    def from_dir(cls, path: str | Path) -> "Qwen3Config":
        path = Path(path)
        raw = json.loads((path / "config.json").read_text())
        if raw.get("model_type") != "qwen3":
            raise ValueError(f"{path}/config.json: model_type {raw.get('model_type')!r}, expected 'qwen3'")
        if raw.get("hidden_act", "silu") != "silu" or raw.get("attention_bias", False):
            raise ValueError(f"{path}/config.json: only silu MLPs without attention bias are supported")
        return cls(
            vocab_size=raw["vocab_size"],
            hidden_size=raw["hidden_size"],
            intermediate_size=raw["intermediate_size"],
            num_hidden_layers=raw["num_hidden_layers"],
            num_attention_heads=raw["num_attention_heads"],
            num_key_value_heads=raw.get("num_key_value_heads") or raw["num_attention_heads"],
            head_dim=raw.get("head_dim") or raw["hidden_size"] // raw["num_attention_heads"],
            rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
            rope_theta=_rope_theta(raw, path),
            max_position_embeddings=raw["max_position_embeddings"],
            tie_word_embeddings=raw.get("tie_word_embeddings", False),
            dtype=raw.get("dtype") or raw.get("torch_dtype") or "bfloat16",
            eos_token_ids=_eos_token_ids(raw, path),
        )


def _rope_theta(raw: dict, path: Path) -> float:
    """Older configs put rope_theta at the top; transformers 5 nests it in rope_parameters."""
    params = raw.get("rope_parameters") or {}
    scaling = raw.get("rope_scaling") or params
    if scaling.get("rope_type", scaling.get("type", "default")) != "default":
        raise ValueError(f"{path}/config.json: rope scaling {scaling} is not supported")
    return float(params.get("rope_theta", raw.get("rope_theta", 10000.0)))


def _as_list(value: int | list[int] | None) -> list[int]:
    if value is None:
        return []
    return [value] if isinstance(value, int) else list(value)


def _eos_token_ids(raw: dict, path: Path) -> tuple[int, ...]:
    ids = _as_list(raw.get("eos_token_id"))
    generation = path / "generation_config.json"
    if generation.exists():
        ids += _as_list(json.loads(generation.read_text()).get("eos_token_id"))
    return tuple(dict.fromkeys(ids))  # unique, first-seen order


def resolve_dtype(flag: str, config: Qwen3Config) -> torch.dtype:
    """The dtype to run in: the flag, or the checkpoint's own when the flag is 'auto'."""
    name = config.dtype if flag == "auto" else flag
    if name not in DTYPES:
        raise ValueError(f"dtype {name!r} is not supported: use one of {', '.join(DTYPES)}")
    return DTYPES[name]
