"""A mixture-of-experts layer on CUDA in six Triton launches, none of which reads a length back to the
host (so a decode step stays inside its CUDA graph): the router's top-k (triton_moe_routing.py), the
sort-and-pad of the (token, expert) pairs (triton_moe_align.py, three launches), the gate/up GEMM with
SiLU-and-mul in its epilogue, the down GEMM with the routing weights, and the sum of each token's top_k
rows (triton_moe_gemm.py). Shapes as in moe_reference.py, which is the oracle."""
import functools

import torch

from nanoserve_kernels.moe_launch import launch_config
from nanoserve_kernels.triton_moe_align import align_block_size
from nanoserve_kernels.triton_moe_gemm import grouped_gemm, sum_top_k
from nanoserve_kernels.triton_moe_routing import route


@functools.cache
def _device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else device.type


def fused_experts(hidden: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, weights: torch.Tensor,
                  ids: torch.Tensor, launch: dict | None = None) -> torch.Tensor:
    """sum over k of weights[:, k] * expert_{ids[:, k]}(hidden): [tokens, hidden]. `launch` overrides the
    tuned config (moe_launch.py) of this batch size."""
    tokens, top_k = ids.shape
    num_experts, width = gate_up.shape[0], gate_up.shape[1] // 2
    launch = launch or launch_config(tokens, num_experts, width, _device_name(hidden.device))
    sorted_pairs, block_experts, num_padded = align_block_size(ids, num_experts, launch["BLOCK_M"])
    num_pairs = tokens * top_k
    blocks = (sorted_pairs, block_experts, num_padded, num_pairs)
    activation = torch.empty(num_pairs, width, dtype=hidden.dtype, device=hidden.device)
    grouped_gemm(hidden, gate_up, activation, *blocks, top_k, launch | launch["gate_up"], silu_mul=True)
    partial = torch.empty(num_pairs, down.shape[1], dtype=hidden.dtype, device=hidden.device)
    grouped_gemm(activation, down, partial, *blocks, 1, launch | launch["down"], pair_weights=weights)
    return sum_top_k(partial, tokens, top_k)


def fused_moe(hidden: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, router_logits: torch.Tensor,
              top_k: int, renormalize: bool) -> torch.Tensor:
    """The layer from its router's logits: route, then fused_experts."""
    weights, ids = route(router_logits, top_k, renormalize)
    return fused_experts(hidden, gate_up, down, weights, ids)
