"""Two tensor-parallel ranks on two GPUs (NCCL), CUDA graphs on, against one rank on one GPU; in
float32, bfloat16, and bfloat16 over an FP8 KV cache (its scales are per KV head, so each rank
quantizes its heads as the single rank does).

Needs two GPUs (the lent nvidia-h200-x2), from the repo root:
    PYTHONPATH=.:proto python3 -m pytest tests/gpu/test_tensor_parallel_gpu.py -q
"""
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from nanoserve_cli.demo_model import SHAPE, config_json, random_weights, write_checkpoint
from tests.services.processes import free_port
from tests.worker.worker_steps import StepWriter, generate
from worker_svc.config import WorkerConfig
from worker_svc.runner import ModelRunner

pytestmark = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")
# Two KV heads, so each rank holds one; head_dim 128 as the benchmark model.
SHAPE_128 = {**SHAPE, "hidden_size": 256, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 128}
BLOCK_SIZE, NUM_BLOCKS = 16, 64
PROMPTS = {1: [785, 3974, 13876, 38835, 34208] * 5, 2: [11, 22, 33], 3: list(range(100, 140))}
NEXT_TOKENS = {1: 4242, 2: 17, 3: 99_999}
VARIANTS = {"bfloat16": ("bfloat16", "auto"), "float32": ("float32", "auto"), "fp8": ("bfloat16", "fp8")}


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("tp-gpu")
    return {dtype: str(write_checkpoint(root / dtype, config_json(False, SHAPE_128, dtype),
                                        random_weights(False, SHAPE_128, 0.05, getattr(torch, dtype))))
            for dtype in ("bfloat16", "float32")}


def run_model(model_dir: str, rank: int = 0, world_size: int = 1, kv_cache_dtype: str = "auto") -> dict:
    """Prefill, decode and batch-1 decode (the gemvs with the norm fused in) logits and 16 pipelined
    greedy tokens, decode steps replayed from graphs."""
    runner = ModelRunner(WorkerConfig(model=model_dir, device="cuda", rank=rank, tensor_parallel_size=world_size,
                                      block_size=BLOCK_SIZE, num_kv_blocks=NUM_BLOCKS, max_num_seqs=8,
                                      attention_backend="triton", max_model_len=512, kv_cache_dtype=kv_cache_dtype))
    runner.allocate_kv_cache(NUM_BLOCKS)  # captures the decode graphs, all-reduces inside
    assert runner.graphs is not None
    writer = StepWriter(BLOCK_SIZE)
    prefill = writer.request(*(writer.entry(i, prompt, reset=True) for i, prompt in PROMPTS.items()))
    decode = writer.request(*(writer.entry(i, [NEXT_TOKENS[i]], len(prompt), num_generated=1)
                              for i, prompt in PROMPTS.items()))
    alone = writer.request(writer.entry(1, [NEXT_TOKENS[2]], len(PROMPTS[1]) + 1, num_generated=2))
    logits = [runner.step_logits(step) for step in (prefill, decode, alone)]
    greedy = generate(runner, StepWriter(BLOCK_SIZE), PROMPTS, 16, {i: {} for i in PROMPTS}, pipelined=True)
    return {"logits": [None if x is None else x.float().cpu() for x in logits], "greedy": greedy}


def _rank(rank: int, port: int, models: dict[str, str], out: str) -> None:
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            device_id=torch.device("cuda", rank))
    torch.save({name: run_model(models[dtype], rank, 2, kv) for name, (dtype, kv) in VARIANTS.items()},
               Path(out) / f"rank{rank}.pt")
    dist.destroy_process_group()


def test_two_ranks_match_one_rank_with_cuda_graphs(models, tmp_path):
    mp.spawn(_rank, args=(free_port(), models, str(tmp_path)), nprocs=2)
    ranks = [torch.load(tmp_path / f"rank{rank}.pt") for rank in range(2)]
    for dtype, tolerance in (("bfloat16", 3e-2), ("float32", 1e-4), ("fp8", 3e-2)):
        one = run_model(models[VARIANTS[dtype][0]], kv_cache_dtype=VARIANTS[dtype][1])
        two = ranks[0][dtype]
        for step, ours, reference in zip(("prefill", "decode", "batch-1 decode"), two["logits"], one["logits"]):
            error = ((ours - reference).abs().max() / reference.abs().max()).item()
            assert error < tolerance, f"{dtype} {step}: relative error {error:.2e}"
        assert ranks[1][dtype]["logits"] == [None] * 3  # only rank 0 gathers logits
        if dtype == "float32":
            assert two["greedy"] == one["greedy"]
