"""Writes an FP8 copy of an unquantized checkpoint, in either format nanoserve reads: Qwen's block FP8
(e4m3 `weight` + `weight_scale_inv` per block) or compressed-tensors FP8_DYNAMIC (e4m3 `weight` +
`weight_scale` per output channel). The decoder layers' projections are quantized, every expert's of a
mixture of experts too; embeddings, norms, biases, the experts' routers and the LM head are copied as
they are, as are the config (with its quantization_config added), the tokenizer and generation_config.json.

    python -m nanoserve_cli.fp8_checkpoint SOURCE TARGET [--format fp8|compressed-tensors] [--block 128 128]
"""
import argparse
import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from nanoserve_kernels.fp8_reference import quantize_weight
from nanoserve_model.qwen3_moe import Qwen3MoeForCausalLM

FORMATS = ("fp8", "compressed-tensors")
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def quantization_config(fmt: str, block: tuple[int, int] = (128, 128), ignored: tuple[str, ...] = ()) -> dict:
    """config.json's `quantization_config` as each format's own tools write it."""
    if fmt == "fp8":
        return dict(quant_method="fp8", fmt="e4m3", activation_scheme="dynamic", weight_block_size=list(block),
                    modules_to_not_convert=list(ignored))
    number = dict(num_bits=8, type="float", symmetric=True, group_size=None, block_structure=None, actorder=None)
    return dict(quant_method="compressed-tensors", format="float-quantized", quantization_status="compressed",
                ignore=["lm_head", *ignored], kv_cache_scheme=None, config_groups=dict(group_0=dict(
                    targets=["Linear"], weights=dict(number, strategy="channel", dynamic=False, observer="minmax"),
                    input_activations=dict(number, strategy="token", dynamic=True, observer=None),
                    output_activations=None)))


def routers(config: dict) -> tuple[str, ...]:
    """A mixture of experts' router modules (`mlp.gate` of its sparse layers): Qwen's FP8 checkpoints leave
    them unquantized and list them in modules_to_not_convert."""
    if "num_experts" not in config:
        return ()
    moe = Qwen3MoeForCausalLM.moe_config(config, "config.json")
    return tuple(f"model.layers.{i}.mlp.gate" for i in range(config["num_hidden_layers"]) if moe.is_sparse(i))


def quantized(name: str, ignored: tuple[str, ...]) -> bool:
    module = name.removesuffix(".weight")
    return (name.endswith(".weight") and module.rsplit(".", 1)[-1] in PROJECTIONS
            and not any(module == entry or module.endswith("." + entry) for entry in ignored))


def fp8_tensors(weights: dict[str, torch.Tensor], fmt: str, block: tuple[int, int] = (128, 128),
                ignored: tuple[str, ...] = ()) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors with each projection weight quantized, its scales beside it."""
    out = {}
    for name, tensor in weights.items():
        if not quantized(name, ignored):
            out[name] = tensor
            continue
        module = name.removesuffix(".weight")
        if fmt == "fp8":
            out[name], out[f"{module}.weight_scale_inv"] = quantize_weight(tensor, block)
        else:
            out[name], out[f"{module}.weight_scale"] = quantize_weight(tensor, (1, tensor.shape[1]))
    return out


def write_fp8_checkpoint(source: Path, target: Path, fmt: str = "fp8", block: tuple[int, int] = (128, 128),
                         ignored: tuple[str, ...] = ()) -> Path:
    """TARGET: SOURCE (one model.safetensors) with its projections in FP8 of `fmt`; `ignored` modules
    (names or trailing parts of names) stay unquantized and are listed as such in the config."""
    target.mkdir(parents=True, exist_ok=True)
    for file in source.iterdir():
        if file.is_file() and file.suffix != ".safetensors" and file.name != "config.json":
            shutil.copy(file, target / file.name)
    config = json.loads((source / "config.json").read_text())
    config["quantization_config"] = quantization_config(fmt, block, ignored + routers(config))
    (target / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    save_file(fp8_tensors(load_file(source / "model.safetensors"), fmt, block, ignored), target / "model.safetensors",
              metadata={"format": "pt"})
    return target


def main() -> None:
    parser = argparse.ArgumentParser(description="Write an FP8 copy of an unquantized checkpoint.")
    parser.add_argument("source", type=Path)
    parser.add_argument("target", type=Path)
    parser.add_argument("--format", choices=FORMATS, default="fp8", help="fp8: Qwen's block FP8; "
                        "compressed-tensors: FP8_DYNAMIC, per-channel scales")
    parser.add_argument("--block", type=int, nargs=2, default=(128, 128), help="fp8: rows and columns a scale covers")
    args = parser.parse_args()
    print(write_fp8_checkpoint(args.source, args.target, args.format, tuple(args.block)))


if __name__ == "__main__":
    main()
