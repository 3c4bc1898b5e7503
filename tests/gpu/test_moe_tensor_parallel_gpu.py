"""Qwen3-MoE over two tensor-parallel ranks on two GPUs (each expert's width split in two, one NCCL
all-reduce a layer), CUDA graphs on, against one rank on one GPU, in float32 (the GEMMs' dots in full
precision): the checkpoint's routers clear the margin on the sequences run (moe_models), so both group
sizes route alike; and the same over its block-FP8 copy, each rank holding its half of every e4m3 expert
with its scales.

Needs two GPUs, from the repo root:
    PYTHONPATH=.:proto python3 -m pytest tests/gpu/test_moe_tensor_parallel_gpu.py -q
"""
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tests.gpu.test_moe_gpu import MOE_128
from tests.gpu.test_tensor_parallel_gpu import NEXT_TOKENS, PROMPTS, SHAPE_128, run_model
from tests.services.processes import free_port
from tests.worker.moe_models import hf_greedy, moe_model

pytestmark = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")
GREEDY_TOKENS = 16  # run_model's


def sequences(hf) -> dict[str, list[int]]:
    """What run_model runs: prefill, a decode of NEXT_TOKENS, sequence 1 alone a step further, and greedy."""
    return {**{f"next{i}": p + [NEXT_TOKENS[i]] for i, p in PROMPTS.items()},
            "alone": PROMPTS[1] + [NEXT_TOKENS[1], NEXT_TOKENS[2]],
            **{f"greedy{i}": p + hf_greedy(hf, p, GREEDY_TOKENS) for i, p in PROMPTS.items()}}


@pytest.fixture(scope="module", params=[False, True], ids=["unquantized", "fp8"])
def model(request) -> str:
    return str(moe_model("tp-gpu", sequences, SHAPE_128 | MOE_128, fp8=request.param)[0])


def _rank(rank: int, port: int, model_dir: str, out: str) -> None:
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            device_id=torch.device("cuda", rank))
    torch.save(run_model(model_dir, rank, 2), Path(out) / f"rank{rank}.pt")
    dist.destroy_process_group()


def test_two_ranks_match_one_rank_with_cuda_graphs(model, tmp_path):
    mp.spawn(_rank, args=(free_port(), model, str(tmp_path)), nprocs=2)
    two = [torch.load(tmp_path / f"rank{rank}.pt") for rank in range(2)]
    one = run_model(model)
    for step, ours, reference in zip(("prefill", "decode", "batch-1 decode"), two[0]["logits"], one["logits"]):
        error = ((ours - reference).abs().max() / reference.abs().max()).item()
        assert error < 1e-4, f"{step}: relative error {error:.2e}"
    assert two[1]["logits"] == [None] * 3  # only rank 0 gathers logits
    assert two[0]["greedy"] == one["greedy"]
