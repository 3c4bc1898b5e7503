"""FP8 copies of the tiny Qwen3 checkpoint in both formats nanoserve reads, built once into the cache like
the demo model, and an unquantized copy of each's dequantized weights for transformers (the oracle)."""
import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from nanoserve_cli.cache import cache_dir, demo_model_dir
from nanoserve_cli.demo_model import build_tiny_model
from nanoserve_cli.fp8_checkpoint import write_fp8_checkpoint

# The tiny model's q/k/v rows are 64/32/32 and its hidden size 64: 16 x 16 blocks split whole at two ranks.
TINY_BLOCK = (16, 16)
FORMATS = ("fp8", "compressed-tensors")


def tiny_fp8_dir(fmt: str) -> Path:
    path = cache_dir() / f"tiny-qwen3-{fmt}"
    if not (path / "model.safetensors").exists():  # written last: its presence means a whole build
        source = demo_model_dir(tied=False)
        if not (source / "model.safetensors").exists():
            build_tiny_model(source)
        staged = write_fp8_checkpoint(source, path.with_name(path.name + ".staged"), fmt, TINY_BLOCK)
        shutil.rmtree(path, ignore_errors=True)
        staged.rename(path)
    return path


def dequantize(quantized: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """Each e4m3 value times the scale of its block, by index (written apart from the loader's)."""
    rows, columns = quantized.shape
    per_element = scale.float()[torch.arange(rows) // block[0]][:, torch.arange(columns) // block[1]]
    return quantized.float() * per_element


def dequantized_weights(path: Path) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors with every e4m3 weight times its scales, in float32, scales dropped."""
    config = json.loads((path / "config.json").read_text())["quantization_config"]
    tensors = load_file(path / "model.safetensors")
    out = {}
    for name, tensor in tensors.items():
        if name.endswith((".weight_scale", ".weight_scale_inv")):
            continue
        scale = tensors.get(name + "_scale_inv", tensors.get(name + "_scale"))
        if scale is None:
            out[name] = tensor
            continue
        block = tuple(config["weight_block_size"]) if "weight_block_size" in config else (1, tensor.shape[1])
        out[name] = dequantize(tensor, scale, block)
    return out


def write_dequantized(source: Path, target: Path) -> Path:
    """An unquantized copy of the FP8 checkpoint `source`: its dequantized weights in float32 (exact:
    e4m3 values times float32 scales), its config without the quantization_config."""
    target.mkdir(parents=True, exist_ok=True)
    config = json.loads((source / "config.json").read_text())
    del config["quantization_config"]
    for file in source.iterdir():
        if file.suffix != ".safetensors" and file.name != "config.json":
            shutil.copy(file, target / file.name)
    (target / "config.json").write_text(json.dumps(config))
    save_file(dequantized_weights(source), target / "model.safetensors", metadata={"format": "pt"})
    return target


def dequantized_dir(fmt: str) -> Path:
    """The tiny FP8 checkpoint of `fmt`, dequantized (built once into the cache)."""
    path = cache_dir() / f"tiny-qwen3-{fmt}-dequantized"
    if not (path / "model.safetensors").exists():
        write_dequantized(tiny_fp8_dir(fmt), path)
    return path
