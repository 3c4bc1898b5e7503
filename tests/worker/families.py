"""Tiny random checkpoints of every family nanoserve serves besides the demo Qwen3 (Llama with `llama3`
rope scaling and both bias switches, Qwen2 with its q/k/v bias, Mistral), built once into the cache
like the demo model, and loaded into transformers as the oracle."""
from pathlib import Path

import torch

from nanoserve_cli.cache import cache_dir
from nanoserve_cli.demo_model import build_tiny_model

FAMILIES = ("llama", "qwen2", "mistral")


def family_model_dir(family: str) -> Path:
    path = cache_dir() / f"tiny-{family}"
    if not (path / "model.safetensors").exists():  # written last: its presence means a whole build
        build_tiny_model(path, family=family)
    return path


def hf_model(path: Path) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM  # here: spawned ranks import this module without it
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
