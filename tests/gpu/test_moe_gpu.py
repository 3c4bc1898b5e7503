"""The fused MoE kernels and the Qwen3-MoE model on a GPU: the kernels against the per-expert loop in
bf16 (the interpreter cannot check bf16 dots), float16 and float32, at the test shapes and at
Qwen3-30B-A3B's layer (128 experts of width 768, top-8) for 1 to 256 tokens; the layer replayed from a
CUDA graph with new routing; the tiny Qwen3-MoE in float32 generating transformers' greedy tokens
eagerly and from graphs; and a bf16 model whose decode graphs give its eager tokens.

Runs only where CUDA is present, from the repo root:
    PYTHONPATH=.:proto python3 -m pytest tests/gpu/test_moe_gpu.py -q
"""
import pytest
import torch

from nanoserve_cli.demo_model import config_json, random_weights, write_checkpoint
from nanoserve_kernels.moe_reference import experts_reference, route
from tests.gpu.test_worker_gpu import SHAPE_128, gpu_runner, prompts
from tests.worker.moe_models import moe_model
from tests.worker.test_moe_kernels import SMALL_TILES, check_align, check_layers, check_route, separated_logits
from tests.worker.test_moe_vs_hf import GREEDY, GREEDY_TOKENS, sequences
from tests.worker.worker_steps import StepWriter, generate
from worker_svc.config import WorkerConfig
from worker_svc.runner import ModelRunner

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
A3B_LAYER = dict(experts=128, top_k=8, hidden=2048, width=768)
# With SHAPE_128's attention: 16 experts of width 128, top-4, in every layer.
MOE_128 = dict(num_experts=16, num_experts_per_tok=4, moe_intermediate_size=128, norm_topk_prob=True,
               decoder_sparse_step=1, mlp_only_layers=[])


def test_routing_and_sort_match_the_reference():
    from nanoserve_kernels.triton_moe_align import align_block_size
    from nanoserve_kernels.triton_moe_routing import route as route_kernel
    check_route(route_kernel, "cuda")
    check_align(align_block_size, "cuda")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_fused_layers_match_the_reference(dtype):
    from nanoserve_kernels.fused_moe import fused_experts
    check_layers(fused_experts, "cuda", dtype, (SMALL_TILES, None))


def a3b_layer(tokens: int, seed: int) -> tuple[torch.Tensor, ...]:
    """Qwen3-30B-A3B's layer in bf16 at a trained model's scale, routed by separated logits."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    e, h, d = A3B_LAYER["experts"], A3B_LAYER["hidden"], A3B_LAYER["width"]
    hidden = torch.randn(tokens, h, device="cuda", generator=g).bfloat16()
    gate_up = (torch.randn(e, 2 * d, h, device="cuda", generator=g) * 0.02).bfloat16()
    down = (torch.randn(e, h, d, device="cuda", generator=g) * 0.02).bfloat16()
    logits = separated_logits(tokens, e, seed, device="cuda")
    return hidden, gate_up, down, logits


@pytest.mark.parametrize("tokens", [1, 8, 64, 256])
def test_the_a3b_layer_matches_the_reference(tokens):
    from nanoserve_kernels.fused_moe import fused_moe
    hidden, gate_up, down, logits = a3b_layer(tokens, tokens)
    weights, ids = route(logits, A3B_LAYER["top_k"], True)
    expected = experts_reference(hidden.float(), gate_up.float(), down.float(), weights, ids)
    out = fused_moe(hidden, gate_up, down, logits, A3B_LAYER["top_k"], True)
    error = ((out.float() - expected).norm() / expected.norm()).item()
    assert error < 1e-2, error


def test_a_graph_replays_new_routing():
    """Captured at 4 tokens, replayed with other inputs and routing: the eager result of those."""
    from nanoserve_kernels.fused_moe import fused_moe
    hidden, gate_up, down, logits = a3b_layer(4, 0)
    static_hidden, static_logits = hidden.clone(), logits.clone()
    fused_moe(static_hidden, gate_up, down, static_logits, 8, True)  # compiles outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = fused_moe(static_hidden, gate_up, down, static_logits, 8, True)
    for seed in (1, 2):
        new_hidden, _, _, new_logits = a3b_layer(4, seed)
        static_hidden.copy_(new_hidden)
        static_logits.copy_(new_logits)
        graph.replay()
        assert torch.equal(static_out, fused_moe(new_hidden, gate_up, down, new_logits, 8, True))


@pytest.mark.parametrize("eager", [True, False], ids=["eager", "graphs"])
def test_greedy_fp32_matches_transformers(eager):
    """float32 on CUDA (the GEMMs' dots in full precision) over the tiny top-2 variant, whose routers
    clear the margin on these sequences."""
    path, _, run = moe_model("top2", sequences)
    runner = gpu_runner(path, "triton", eager, "float32")
    ours = generate(runner, StepWriter(runner.config.block_size), GREEDY, GREEDY_TOKENS, pipelined=True)
    for seq_id, prompt in GREEDY.items():
        assert ours[seq_id] == run[f"greedy{seq_id}"][len(prompt):]


@pytest.mark.parametrize("batch_size", [1, 3, 16])
def test_bf16_decode_graphs_give_the_eager_tokens(tmp_path, batch_size):
    shape = SHAPE_128 | MOE_128
    path = write_checkpoint(tmp_path, config_json(False, shape, "bfloat16", "qwen3_moe"),
                            random_weights(False, shape, 0.05, torch.bfloat16, "qwen3_moe"))
    runner = gpu_runner(path, "triton", False, "bfloat16", num_blocks=256)
    batch = prompts(batch_size, seed=2)
    replayed = generate(runner, StepWriter(runner.config.block_size), batch, 32)
    graphs, runner.graphs = runner.graphs, None
    eager = generate(runner, StepWriter(runner.config.block_size), batch, 32)
    assert graphs is not None and replayed == eager


def test_a_gpu_without_room_for_the_kv_cache_says_so(tmp_path):
    """The weights fit but nothing is left for KV blocks: one line naming the flags, when the room is
    sized (at the handshake)."""
    path = write_checkpoint(tmp_path, config_json(False, SHAPE_128 | MOE_128, "bfloat16", "qwen3_moe"), None)
    torch.cuda.empty_cache()  # what earlier tests cached would be given back while the worker measures
    free, total = torch.cuda.mem_get_info()
    share = (total - free) / total  # what is taken already: nothing left for the weights, let alone KV
    with pytest.raises(ValueError, match=r"no room for the KV cache: --gpu-memory-utilization .* raise "
                                         r"--gpu-memory-utilization"):
        ModelRunner(WorkerConfig(model=str(path), device="cuda", load_format="dummy",
                                 gpu_memory_utilization=share)).size_kv_cache()
