"""Tiny random Qwen3-MoE checkpoints (hidden 64, 8-16 experts, top-2 to top-8) in the variants tests
compare with transformers, and the guard that makes those comparisons meaningful: a token whose k-th
and (k+1)-th router logits nearly tie may pick a different expert in two correct implementations (their
roundings differ by ~1e-6), so a checkpoint is only used once every token of every sequence the tests
run clears MARGIN in every sparse layer. A checkpoint that does not gets its routers re-drawn from the
next seed, deterministically, so every machine uses the same one. Each variant has a block-FP8 copy too
(its experts in e4m3), whose oracle is transformers on the copy's dequantized weights."""
import os
import shutil
from pathlib import Path
from typing import Callable

import torch

from nanoserve_cli.cache import cache_dir
from nanoserve_cli.demo_model import TINY_MOE, WEIGHT_STD, config_json, random_weights, write_checkpoint
from nanoserve_cli.fp8_checkpoint import write_fp8_checkpoint
from tests.worker.fp8_models import TINY_BLOCK, write_dequantized

VARIANTS = {
    # 3 layers, 8 experts, top-2, renormalised
    "top2": TINY_MOE,
    # 16 experts, top-8, weights not renormalised, layer 0 dense
    "top8-plain": TINY_MOE | dict(num_hidden_layers=2, num_experts=16, num_experts_per_tok=8, norm_topk_prob=False,
                                  mlp_only_layers=[0]),
    # 4 layers, experts in every second one (1 and 3), 16 experts top-4
    "step2": TINY_MOE | dict(num_hidden_layers=4, num_experts=16, num_experts_per_tok=4, decoder_sparse_step=2),
}
MARGIN = 1e-4    # router logits; fp32 implementations differ by ~1e-6 there
MAX_REDRAWS = 8


def hf_model(path: Path) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM  # here: spawned ranks import this module without it
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def hf_greedy(hf: torch.nn.Module, token_ids: list[int], n: int) -> list[int]:
    """transformers' greedy continuation of n tokens."""
    with torch.no_grad():
        out = hf.generate(torch.tensor([token_ids]), max_new_tokens=n, min_new_tokens=n, do_sample=False)
    return out[0, len(token_ids):].tolist()


def router_margin(hf: torch.nn.Module, token_ids: list[int]) -> float:
    """The smallest gap between the k-th and (k+1)-th largest router logit over the sequence's tokens
    and the model's sparse layers."""
    k = hf.config.num_experts_per_tok
    with torch.no_grad():
        router_logits = hf(torch.tensor([token_ids]), output_router_logits=True).router_logits
    gaps = [top[:, k - 1] - top[:, k] for top in (logits.topk(k + 1, dim=-1).values for logits in router_logits)]
    return torch.cat(gaps).min().item()


def _redraw_routers(weights: dict[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {name: torch.randn(tensor.shape, generator=g) * WEIGHT_STD if name.endswith(".mlp.gate.weight") else tensor
            for name, tensor in weights.items()}


def _checkpoint(variant: str, shape: dict, redraw: int) -> Path:
    path = cache_dir() / f"tiny-qwen3-moe-{variant}-r{redraw}"
    if not (path / "model.safetensors").exists():  # written last: its presence means a whole build
        weights = random_weights(False, shape, family="qwen3_moe")
        write_checkpoint(path, config_json(False, shape, family="qwen3_moe"),
                         _redraw_routers(weights, redraw) if redraw else weights)
    return path


def _fp8_copies(source: Path) -> tuple[Path, Path]:
    """(the block-FP8 copy of `source`, its dequantized weights unquantized), built once into the cache."""
    fp8, dequantized = source.with_name(source.name + "-fp8"), source.with_name(source.name + "-fp8-dequantized")
    for path, write in ((fp8, lambda target: write_fp8_checkpoint(source, target, "fp8", TINY_BLOCK)),
                        (dequantized, lambda target: write_dequantized(fp8, target))):
        if not (path / "model.safetensors").exists():
            staged = write(path.with_name(f"{path.name}.{os.getpid()}.staged"))
            shutil.rmtree(path, ignore_errors=True)
            staged.rename(path)
    return fp8, dequantized


def moe_model(variant: str, sequences: Callable[[torch.nn.Module], dict[str, list[int]]], shape: dict | None = None,
              fp8: bool = False) -> tuple[Path, torch.nn.Module, dict[str, list[int]]]:
    """The variant's checkpoint (cached), transformers' model of it and `sequences(hf)` (the sequences
    the tests run: prompts and transformers' continuations), routers re-drawn until every token of
    those clears MARGIN, so no comparison rests on a lucky tie-break. `shape`: a variant of the caller's
    own, named `variant`. `fp8`: the checkpoint's block-FP8 copy (every expert's matrices in e4m3 with
    TINY_BLOCK scales, the routers unquantized, as Qwen's), transformers holding its dequantized weights."""
    shape = shape or VARIANTS[variant]
    for redraw in range(MAX_REDRAWS):
        path = oracle = _checkpoint(variant, shape, redraw)
        if fp8:
            path, oracle = _fp8_copies(path)
        hf = hf_model(oracle)
        run = sequences(hf)
        if min(router_margin(hf, seq) for seq in run.values()) > MARGIN:
            return path, hf, run
    raise AssertionError(f"no router draw of {variant} separates its top-k by {MARGIN} on the test sequences")
