"""Plain-torch mixture of experts: the CPU path and the oracle for the fused kernels (fused_moe.py).

Shapes (one layer, one rank):
  hidden:        [tokens, hidden]
  router_logits: [tokens, experts]
  gate_up:       [experts, 2 * d, hidden], each expert's gate rows then its up rows (d: this rank's
                 share of the expert's intermediate size)
  down:          [experts, hidden, d]
  weights, ids:  [tokens, top_k] float32 routing weights and int64 expert ids (route())
FP8 experts hold e4m3 gate_up and down with BlockScales beside each; the reference multiplies their
dequantized values (dequantize_experts).
"""
from typing import NamedTuple

import torch
import torch.nn.functional as F

from nanoserve_kernels.fp8_reference import dequantize_weight, quantize_weight


def route(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax over all experts in float32, the top_k largest, renormalised to sum to 1 if asked
    (Qwen3-MoE's `norm_topk_prob`): (weights float32, expert ids int64), each [tokens, top_k]."""
    probs = torch.softmax(router_logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def experts_reference(hidden: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, weights: torch.Tensor,
                      ids: torch.Tensor) -> torch.Tensor:
    """sum over k of weights[:, k] * expert_{ids[:, k]}(hidden), one expert at a time over the tokens
    routed to it. Each expert's output is in the model dtype; the weighting and the sum are in float32,
    rounded once."""
    accumulate = torch.promote_types(hidden.dtype, torch.float32)  # float64 for a float64 oracle
    out = torch.zeros(hidden.shape, dtype=accumulate, device=hidden.device)
    for expert in ids.unique().tolist():
        token, slot = torch.where(ids == expert)
        gate, up = F.linear(hidden[token], gate_up[expert]).chunk(2, dim=-1)
        expert_out = F.linear(F.silu(gate) * up, down[expert])
        out.index_add_(0, token, expert_out.to(accumulate) * weights[token, slot, None].to(accumulate))
    return out.to(hidden.dtype)


class BlockScales(NamedTuple):
    """The float32 scales of a stacked e4m3 expert weight [experts, rows, columns], one per (bn x bk) block
    of each expert's matrix: [experts, ceil(rows / bn), ceil(columns / bk)] (fp8_reference.py's layout)."""
    scale: torch.Tensor
    block: tuple[int, int]


def quantize_experts(weight: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, BlockScales]:
    """Every expert's matrix of `weight` [experts, rows, columns] in e4m3 with its block scales (as the
    checkpoint's per-expert tensors stack)."""
    quantized = [quantize_weight(matrix, block) for matrix in weight]
    return torch.stack([q for q, _ in quantized]), BlockScales(torch.stack([s for _, s in quantized]), block)


def dequantize_experts(weight: torch.Tensor, scales: BlockScales, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Every expert's e4m3 matrix times its block scales, in `dtype`."""
    return torch.stack([dequantize_weight(matrix, scale, scales.block, dtype)
                        for matrix, scale in zip(weight, scales.scale)])
