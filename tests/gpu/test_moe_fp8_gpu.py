"""FP8 experts on CUDA: the grouped GEMMs reading e4m3 experts (weight-only) against the per-expert loop
on their dequantized weights, in bf16 (which the interpreter cannot check), float16 and float32 at the
interpreter's shapes (block and per-channel scales, tails, idle experts, batch 1) and at Qwen3-30B-A3B's
layer with 128 x 128 blocks for 1 to 256 tokens; the layer replayed from a CUDA graph with new routing;
the tiny block-FP8 Qwen3-MoE in float32 generating transformers' greedy tokens on its dequantized weights,
eagerly and from graphs; and a bf16 model of 128-blocks whose decode graphs give its eager tokens.

Runs only where CUDA is present, from the repo root:
    PYTHONPATH=.:proto python3 -m pytest tests/gpu/test_moe_fp8_gpu.py -q
"""
import pytest
import torch

from nanoserve_cli.demo_model import config_json, random_weights, write_checkpoint
from nanoserve_cli.fp8_checkpoint import write_fp8_checkpoint
from nanoserve_kernels.fp8_reference import FP8_DTYPE
from nanoserve_kernels.moe_reference import dequantize_experts, experts_reference, quantize_experts, route
from tests.gpu.test_moe_gpu import A3B_LAYER, MOE_128, a3b_layer
from tests.gpu.test_worker_gpu import SHAPE_128, gpu_runner, prompts
from tests.worker.moe_models import moe_model
from tests.worker.test_moe_kernels import SMALL_TILES, check_fp8_layers
from tests.worker.test_moe_vs_hf import GREEDY, GREEDY_TOKENS, sequences
from tests.worker.worker_steps import StepWriter, generate

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
BLOCK = (128, 128)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_fp8_layers_match_the_reference(dtype):
    from nanoserve_kernels.fused_moe import fused_experts
    check_fp8_layers(fused_experts, "cuda", dtype, (SMALL_TILES, None))


def a3b_fp8_layer(tokens: int, seed: int) -> tuple:
    """Qwen3-30B-A3B's layer with its experts in e4m3, 128 x 128 blocks: (hidden, logits, gate_up, its
    BlockScales, down, its BlockScales), all on the GPU."""
    hidden, gate_up, down, logits = a3b_layer(tokens, seed)
    return hidden, logits, *quantize_experts(gate_up, BLOCK), *quantize_experts(down, BLOCK)


@pytest.mark.parametrize("tokens", [1, 8, 64, 256])
def test_the_a3b_fp8_layer_matches_the_reference(tokens):
    from nanoserve_kernels.fused_moe import fused_moe
    hidden, logits, gate_up, gate_up_scales, down, down_scales = a3b_fp8_layer(tokens, tokens)
    weights, ids = route(logits, A3B_LAYER["top_k"], True)
    expected = experts_reference(hidden.float(), dequantize_experts(gate_up, gate_up_scales),
                                 dequantize_experts(down, down_scales), weights, ids)
    out = fused_moe(hidden, gate_up, down, logits, A3B_LAYER["top_k"], True, gate_up_scales=gate_up_scales,
                    down_scales=down_scales)
    assert gate_up.dtype == FP8_DTYPE
    error = ((out.float() - expected).norm() / expected.norm()).item()
    assert error < 1e-2, error


def test_a_graph_replays_new_routing_over_fp8_experts():
    """Captured at 4 tokens, replayed with other inputs and routing: the eager result of those."""
    from nanoserve_kernels.fused_moe import fused_moe
    hidden, logits, *experts = a3b_fp8_layer(4, 0)
    gate_up, gate_up_scales, down, down_scales = experts
    scales = dict(gate_up_scales=gate_up_scales, down_scales=down_scales)
    static_hidden, static_logits = hidden.clone(), logits.clone()
    fused_moe(static_hidden, gate_up, down, static_logits, 8, True, **scales)  # compiles outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = fused_moe(static_hidden, gate_up, down, static_logits, 8, True, **scales)
    for seed in (1, 2):
        new_hidden, _, _, new_logits = a3b_layer(4, seed)
        static_hidden.copy_(new_hidden)
        static_logits.copy_(new_logits)
        graph.replay()
        assert torch.equal(static_out, fused_moe(new_hidden, gate_up, down, new_logits, 8, True, **scales))


@pytest.mark.parametrize("eager", [True, False], ids=["eager", "graphs"])
def test_greedy_fp32_of_an_fp8_checkpoint_matches_transformers_on_its_dequantized_weights(eager):
    """The tiny top-2 variant's block-FP8 copy, its experts e4m3 on the GPU, in float32 (full-precision dots)."""
    path, _, run = moe_model("top2", sequences, fp8=True)
    runner = gpu_runner(path, "triton", eager, "float32")
    assert runner.model.model.layers[0].mlp.experts.gate_up_proj.dtype == FP8_DTYPE
    ours = generate(runner, StepWriter(runner.config.block_size), GREEDY, GREEDY_TOKENS, pipelined=True)
    for seq_id, prompt in GREEDY.items():
        assert ours[seq_id] == run[f"greedy{seq_id}"][len(prompt):]


@pytest.mark.parametrize("batch_size", [1, 3, 16])
def test_bf16_decode_graphs_of_fp8_experts_give_the_eager_tokens(tmp_path, batch_size):
    shape = SHAPE_128 | MOE_128  # every projection and expert whole 128-blocks
    source = write_checkpoint(tmp_path / "bf16", config_json(False, shape, "bfloat16", "qwen3_moe"),
                              random_weights(False, shape, 0.05, torch.bfloat16, "qwen3_moe"))
    path = write_fp8_checkpoint(source, tmp_path / "fp8", "fp8", BLOCK)
    runner = gpu_runner(path, "triton", False, "bfloat16", num_blocks=256)
    assert runner.model.model.layers[1].mlp.experts.down_proj_scale.shape == (16, 2, 1)
    batch = prompts(batch_size, seed=2)
    replayed = generate(runner, StepWriter(runner.config.block_size), batch, 32)
    graphs, runner.graphs = runner.graphs, None
    eager = generate(runner, StepWriter(runner.config.block_size), batch, 32)
    assert graphs is not None and replayed == eager
