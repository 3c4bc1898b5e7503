"""FP8 checkpoints served end to end on CPU, where the worker dequantizes them at load: Qwen's block
format over two tensor-parallel ranks, and an unquantized checkpoint served with --quantization fp8
(per channel, as compressed-tensors' FP8_DYNAMIC checkpoints are). Each gives transformers' float32 greedy tokens on the
dequantized weights, and the model info says how the weights are held. (On CUDA the weights stay e4m3
and the W8A8 kernels run: tests/gpu/test_fp8_weights_gpu.py bounds their accuracy instead.)"""
from pathlib import Path

import pytest

from nanoserve.client import Client
from tests.services.processes import DEVICE, running_service
from tests.services.test_tensor_parallel import SCHEDULER_FLAGS, WORKER_FLAGS, hf_greedy, token_prompt
from tests.worker.families import hf_model
from tests.worker.fp8_models import dequantized_dir, tiny_fp8_dir

MAX_TOKENS = 12
pytestmark = pytest.mark.skipif(DEVICE == "cuda", reason="on CUDA the weights stay e4m3: tests/gpu covers them")


def test_a_block_fp8_checkpoint_over_two_ranks_serves_transformers_greedy_tokens(tmp_path):
    hf = hf_model(dequantized_dir("fp8"))
    with running_service(tiny_fp8_dir("fp8"), tmp_path / "services.log", tensor_parallel_size=2,
                         worker_flags=WORKER_FLAGS, scheduler_flags=SCHEDULER_FLAGS) as svc, \
            Client(svc["address"]) as client:
        info = client.model_info()
        assert (info.quantization, info.weight_dtype) == ("fp8, 16x16 blocks, dequantized at load", "float32")
        for prompt in (token_prompt(7), token_prompt(90)):  # 90: prefilled in two chunks
            assert client.generate(prompt, max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True).token_ids == \
                hf_greedy(hf, prompt, MAX_TOKENS)


def test_quantization_fp8_serves_the_per_channel_weights(tmp_path, tiny_model_dir):
    """--quantization fp8 quantizes each output channel as compressed-tensors' FP8_DYNAMIC does, so the
    dequantized copy of that checkpoint is the oracle."""
    hf = hf_model(dequantized_dir("compressed-tensors"))
    with running_service(Path(tiny_model_dir), tmp_path / "services.log",
                         worker_flags=WORKER_FLAGS + ("--quantization", "fp8"),
                         scheduler_flags=SCHEDULER_FLAGS) as svc, Client(svc["address"]) as client:
        assert client.model_info().quantization == "fp8 (at load), per channel, dequantized at load"
        prompt = token_prompt(33)
        assert client.generate(prompt, max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True).token_ids == \
            hf_greedy(hf, prompt, MAX_TOKENS)
