"""Qwen3-MoE through the real services on CPU: one worker rank and two (every expert split over both,
one all-reduce a layer) generate transformers' greedy tokens for concurrent prompts, one of them
prefilled in two chunks and one a prefix-cache hit; and two ranks driven by hand give the logits one
rank gives. The checkpoint is the top-8-of-16 variant with a dense first layer (moe_models), its
routers clear of near-ties on every sequence run here, and its block-FP8 copy (every expert in e4m3 with
per-expert block scales, dequantized at load on CPU), whose oracle is transformers on its dequantized weights."""
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from nanoserve.client import Client
from tests.services.processes import DEVICE, free_port, running_service
from tests.services.test_tensor_parallel import SCHEDULER_FLAGS, WORKER_FLAGS, token_prompt
from tests.worker.moe_models import hf_greedy, moe_model
from tests.worker.worker_steps import StepWriter, cpu_runner

VARIANT = "top8-plain"
MAX_TOKENS = 12
PROMPTS = [token_prompt(n) for n in (5, 23, 100, 37)]  # 100 tokens: two chunks of the 64-token budget
CACHED = PROMPTS[2][:64] + token_prompt(11)  # shares the 100-token prompt's first 4 blocks of 16


def sequences(hf) -> dict[str, list[int]]:
    return {str(i): p + hf_greedy(hf, p, MAX_TOKENS) for i, p in enumerate([*PROMPTS, CACHED])}


@pytest.fixture(scope="module")
def model():
    return moe_model(VARIANT, sequences)


@pytest.fixture(scope="module")
def fp8_model():
    """The variant's block-FP8 copy (16 x 16 blocks: each rank's half of an expert is whole blocks), and
    transformers on its dequantized weights."""
    return moe_model(VARIANT, sequences, fp8=True)


@pytest.mark.parametrize("ranks", [1, 2])
def test_greedy_tokens_are_transformers_over_one_and_two_ranks(model, ranks, tmp_path):
    assert_serves_transformers_greedy_tokens(model, ranks, tmp_path)


@pytest.mark.skipif(DEVICE == "cuda", reason="on CUDA the experts stay e4m3: tests/gpu/test_moe_fp8_gpu.py")
def test_an_fp8_checkpoint_over_two_ranks_gives_transformers_greedy_tokens_on_its_dequantized_weights(fp8_model,
                                                                                                      tmp_path):
    info = assert_serves_transformers_greedy_tokens(fp8_model, 2, tmp_path)
    assert (info.quantization, info.weight_dtype) == ("fp8, 16x16 blocks, dequantized at load", "float32")


def assert_serves_transformers_greedy_tokens(model, ranks: int, tmp_path: Path):
    """The concurrent prompts, then the prefix-cache hit, through the services; returns the model info."""
    path, hf, run = model
    expected = [run[str(i)][len(p):] for i, p in enumerate([*PROMPTS, CACHED])]
    with running_service(path, tmp_path / "services.log", tensor_parallel_size=ranks, worker_flags=WORKER_FLAGS,
                         scheduler_flags=SCHEDULER_FLAGS) as svc, Client(svc["address"]) as client:
        info = client.model_info()
        with ThreadPoolExecutor(len(PROMPTS)) as pool:
            results = list(pool.map(lambda p: client.generate(p, max_tokens=MAX_TOKENS, temperature=0,
                                                              ignore_eos=True), PROMPTS))
        assert [r.token_ids for r in results] == expected[:-1]
        cached = client.generate(CACHED, max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
        assert cached.token_ids == expected[-1] and cached.usage.cached_prompt_tokens == 64
    assert "(Qwen3MoeForCausalLM)" in (tmp_path / "services.log").read_text()
    return info


PREFILL = {1: token_prompt(20), 2: token_prompt(7), 3: token_prompt(33)}
BLOCK_SIZE, NUM_KV_BLOCKS = 16, 64


def _steps(runner) -> list[torch.Tensor | None]:
    writer = StepWriter(BLOCK_SIZE)
    prefill = writer.request(*(writer.entry(i, prompt, reset=True) for i, prompt in PREFILL.items()))
    decode = writer.request(*(writer.entry(i, [4242 + i], len(prompt), num_generated=1)
                              for i, prompt in PREFILL.items()))
    return [runner.step_logits(prefill), runner.step_logits(decode)]


def _run_rank(rank: int, port: int, paths: dict[str, str], out: str) -> None:
    """One of two spawned ranks: the steps on each checkpoint (one pair of processes for both)."""
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    torch.save({name: _steps(cpu_runner(path, BLOCK_SIZE, NUM_KV_BLOCKS, rank=rank, tensor_parallel_size=2))
                for name, path in paths.items()}, Path(out) / f"rank{rank}.pt")
    dist.destroy_process_group()


def test_two_ranks_give_one_ranks_logits(model, fp8_model, tmp_path):
    """Of the checkpoint and of its block-FP8 copy."""
    paths = {"model": str(model[0]), "fp8_model": str(fp8_model[0])}
    mp.spawn(_run_rank, args=(free_port(), paths, str(tmp_path)), nprocs=2)
    two = [torch.load(tmp_path / f"rank{rank}.pt") for rank in range(2)]
    for name, path in paths.items():
        for ours, one in zip(two[0][name], _steps(cpu_runner(path, BLOCK_SIZE, NUM_KV_BLOCKS))):
            error = ((ours - one).abs().max() / one.abs().max()).item()
            assert error < 1e-5, f"{name}: relative error {error:.2e}"
        assert two[1][name] == [None, None], name  # only rank 0 gathers logits
