"""A mixture-of-experts layer on CUDA in Triton launches, none of which reads a length back to the host
(so a decode step stays inside its CUDA graph): the router's top-k (triton_moe_routing.py), the
sort-and-pad of the (token, expert) pairs (triton_moe_align.py: three launches, or at decode sizes one
with the top-k), the gate/up GEMM with SiLU-and-mul in its epilogue, the down GEMM with the routing
weights, and the sum of each token's top_k rows (triton_moe_gemm.py). Shapes as in moe_reference.py,
which is the oracle. FP8 experts (e4m3 with block scales) take the same launches, weight-only, with
launch configs tuned for them."""
import functools

import torch

from nanoserve_kernels.fp8_reference import FP8_DTYPE
from nanoserve_kernels.moe_launch import launch_config
from nanoserve_kernels.moe_reference import BlockScales
from nanoserve_kernels.triton_moe_align import SMALL_PAIRS, align_block_size, route_and_align
from nanoserve_kernels.triton_moe_gemm import grouped_gemm, sum_top_k
from nanoserve_kernels.triton_moe_routing import route


@functools.cache
def _device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else device.type


def fused_experts(hidden: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, weights: torch.Tensor,
                  ids: torch.Tensor, launch: dict | None = None, gate_up_scales: BlockScales | None = None,
                  down_scales: BlockScales | None = None) -> torch.Tensor:
    """sum over k of weights[:, k] * expert_{ids[:, k]}(hidden): [tokens, hidden]. `launch` overrides the
    tuned config (moe_launch.py) of this batch size. With the scales, gate_up and down are e4m3 (FP8 experts)."""
    launch = launch or _launch(hidden, gate_up)
    sort = align_block_size(ids, gate_up.shape[0], launch["BLOCK_M"])
    return _experts(hidden, gate_up, down, weights, sort, launch, gate_up_scales, down_scales)


def fused_moe(hidden: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, router_logits: torch.Tensor,
              top_k: int, renormalize: bool, launch: dict | None = None, gate_up_scales: BlockScales | None = None,
              down_scales: BlockScales | None = None) -> torch.Tensor:
    """The layer from its router's logits: route, sort-and-pad (one launch for both at decode sizes), the
    experts. `launch` and the scales as in fused_experts."""
    launch = launch or _launch(hidden, gate_up)
    if hidden.shape[0] * top_k <= SMALL_PAIRS:
        weights, _, sort = route_and_align(router_logits, top_k, renormalize, launch["BLOCK_M"])
        return _experts(hidden, gate_up, down, weights, sort, launch, gate_up_scales, down_scales)
    weights, ids = route(router_logits, top_k, renormalize)
    return fused_experts(hidden, gate_up, down, weights, ids, launch, gate_up_scales, down_scales)


def _launch(hidden: torch.Tensor, gate_up: torch.Tensor) -> dict:
    return launch_config(hidden.shape[0], gate_up.shape[0], gate_up.shape[1] // 2, _device_name(hidden.device),
                         fp8=gate_up.dtype == FP8_DTYPE)


def _experts(hidden: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, weights: torch.Tensor,
             sort: tuple[torch.Tensor, torch.Tensor, torch.Tensor], launch: dict,
             gate_up_scales: BlockScales | None, down_scales: BlockScales | None) -> torch.Tensor:
    """Both GEMMs and the sum over sorted-and-padded pairs."""
    tokens, top_k = weights.shape
    num_pairs, width = tokens * top_k, gate_up.shape[1] // 2
    blocks = (*sort, num_pairs)
    activation = torch.empty(num_pairs, width, dtype=hidden.dtype, device=hidden.device)
    grouped_gemm(hidden, gate_up, activation, *blocks, top_k, launch | launch["gate_up"], silu_mul=True,
                 scales=gate_up_scales)
    partial = torch.empty(num_pairs, down.shape[1], dtype=hidden.dtype, device=hidden.device)
    grouped_gemm(activation, down, partial, *blocks, 1, launch | launch["down"], pair_weights=weights,
                 scales=down_scales)
    return sum_top_k(partial, tokens, top_k)
