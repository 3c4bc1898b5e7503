"""Llama, Qwen2 and Mistral on a GPU against transformers: our kernels, the compiled rotary (and the
compiled bias-free and biased projections around it) and the decode graphs must not change the model.

Runs only where CUDA is present (the lent H100/H200), from the repo root:
    PYTHONPATH=.:proto python3 -m pytest tests/gpu/test_families_gpu.py -q
"""

import pytest
import torch

from nanoserve_cli.demo_model import config_json, random_weights, write_checkpoint
from tests.gpu.test_worker_gpu import (BACKENDS, SHAPE_128, assert_teacher_forced_logits_close, gpu_runner,
                                      hf_greedy, prompts)
from tests.worker.families import FAMILIES, family_model_dir
from tests.worker.worker_steps import StepWriter, generate

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.fixture(scope="module", params=FAMILIES)
def bf16_family_dir(request, tmp_path_factory):
    family = request.param
    return write_checkpoint(tmp_path_factory.mktemp(f"bf16-{family}"),
                            config_json(False, SHAPE_128, "bfloat16", family=family),
                            random_weights(False, SHAPE_128, 0.05, torch.bfloat16, family=family))


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("eager", [True, False], ids=["eager", "graphs"])
def test_greedy_fp32_matches_transformers(family, eager):
    model_dir = family_model_dir(family)
    runner = gpu_runner(model_dir, "triton", eager, "float32")
    batch = prompts(4)
    ours = generate(runner, StepWriter(runner.config.block_size), batch, 16, pipelined=True)
    for seq_id, prompt in batch.items():
        assert ours[seq_id] == hf_greedy(model_dir, prompt, 16, torch.float32)


@pytest.mark.parametrize("backend", BACKENDS)
def test_teacher_forced_bf16_logits_close_to_transformers(bf16_family_dir, backend):
    assert_teacher_forced_logits_close(bf16_family_dir, backend)
