"""The grouped GEMMs of a mixture-of-experts layer over sorted-and-padded pairs (triton_moe_align.py),
and the weighted sum of each token's top_k outputs.

A program computes BLOCK_M rows by BLOCK_N columns of one GEMM: its rows are pairs of one expert, so it
gathers their input rows and reads that expert's weight tile. The gate/up GEMM reads the token's hidden
row (pair // top_k) and, with SILU_MUL, holds BLOCK_N gate columns and the same BLOCK_N up columns in two
accumulators and writes silu(gate) * up: the [pairs, 2 d] gate/up output never goes to memory. The down
GEMM reads the pair's activation row and multiplies its rows by their routing weights in float32 before
the one rounding. Programs past the step's padded rows return at once (the grid is the static bound).
float32 inputs multiply in full precision (tests, the CPU-equal path), never TF32.
With FP8 experts (e4m3 weights, float32 scales per block of each expert's matrix, moe_reference.BlockScales)
the GEMMs are weight-only, as triton_fp8_gemm.py's mode of that name: each weight tile is converted to the
activations' dtype in registers (exact) and its product scaled per output column by the tile's block scale
as it is added into the float32 accumulator; BLOCK_K divides the blocks' 128 columns, so a step has one
scale per column. Activations are never quantized here (no W8A8).
The rounding of SiLU-and-mul is the unfused path's: gate and up rounded to the model dtype first.
"""
import math

import torch
import triton
import triton.language as tl

from nanoserve_kernels.moe_reference import BlockScales
from nanoserve_kernels.triton_activation import silu_mul


@triton.jit
def _accumulate(acc, a, b_ptrs, b_mask, scale_ptrs, col_ok, FP8_WEIGHTS: tl.constexpr, PRECISION: tl.constexpr):
    """acc + a @ one BLOCK_K step's weight tile; an e4m3 tile converted to a's dtype (exact) and its
    product scaled per output column by the step's block scale, in float32."""
    b = tl.load(b_ptrs, mask=b_mask, other=0.0)
    if FP8_WEIGHTS:
        scale = tl.load(scale_ptrs, mask=col_ok, other=0.0)
        acc += tl.dot(a, b.to(a.dtype), input_precision=PRECISION) * scale[None, :]
    else:
        acc = tl.dot(a, b, acc, input_precision=PRECISION)
    return acc


@triton.jit
def _grouped_gemm_kernel(a_ptr, b_ptr, c_ptr, pair_weights_ptr, sorted_pairs_ptr, block_experts_ptr,
                         num_padded_ptr, b_scale_ptr, n_size, k_size, num_pairs, stride_a, stride_be, stride_bn,
                         stride_c, stride_se, stride_sn, stride_sk,
                         PAIRS_PER_A_ROW: tl.constexpr, SILU_MUL: tl.constexpr, MUL_WEIGHTS: tl.constexpr,
                         FP8_WEIGHTS: tl.constexpr, SCALE_BN: tl.constexpr, SCALE_BK: tl.constexpr,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                         GROUP_M: tl.constexpr, PRECISION: tl.constexpr):
    # Programs in groups of GROUP_M row blocks by every column block, so neighbours share input rows.
    pid = tl.program_id(0)
    row_blocks, col_blocks = tl.num_programs(0) // tl.cdiv(n_size, BLOCK_N), tl.cdiv(n_size, BLOCK_N)
    group = pid // (GROUP_M * col_blocks)
    first = group * GROUP_M
    group_size = tl.minimum(row_blocks - first, GROUP_M)
    row_block = first + (pid % (GROUP_M * col_blocks)) % group_size
    col_block = (pid % (GROUP_M * col_blocks)) // group_size
    if row_block * BLOCK_M >= tl.load(num_padded_ptr):
        return
    pair = tl.load(sorted_pairs_ptr + row_block * BLOCK_M + tl.arange(0, BLOCK_M))
    is_pair = pair < num_pairs
    expert = tl.load(block_experts_ptr + row_block).to(tl.int64)
    col = col_block * BLOCK_N + tl.arange(0, BLOCK_N)
    k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + (pair // PAIRS_PER_A_ROW).to(tl.int64)[:, None] * stride_a + k[None, :]
    b_ptrs = b_ptr + expert * stride_be + col.to(tl.int64)[None, :] * stride_bn + k[:, None]
    scale_ptrs = b_scale_ptr + expert * stride_se + (col // SCALE_BN) * stride_sn  # FP8_WEIGHTS only
    up_offset, up_scale_offset = n_size * stride_bn, (n_size // SCALE_BN) * stride_sn  # the up rows follow gate's
    col_ok = col < n_size
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    if SILU_MUL:
        up_acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for start in range(0, k_size, BLOCK_K):
        k_ok = k < k_size - start
        a = tl.load(a_ptrs + start, mask=is_pair[:, None] & k_ok[None, :], other=0.0)
        b_mask = k_ok[:, None] & col_ok[None, :]
        step_scales = scale_ptrs + (start // SCALE_BK) * stride_sk
        acc = _accumulate(acc, a, b_ptrs + start, b_mask, step_scales, col_ok, FP8_WEIGHTS, PRECISION)
        if SILU_MUL:
            up_acc = _accumulate(up_acc, a, b_ptrs + up_offset + start, b_mask, step_scales + up_scale_offset,
                                 col_ok, FP8_WEIGHTS, PRECISION)
    if SILU_MUL:
        dtype = c_ptr.dtype.element_ty
        acc = silu_mul(acc.to(dtype).to(tl.float32), up_acc.to(dtype).to(tl.float32))
    if MUL_WEIGHTS:
        acc = acc * tl.load(pair_weights_ptr + pair, mask=is_pair, other=0.0)[:, None]
    tl.store(c_ptr + pair.to(tl.int64)[:, None] * stride_c + col[None, :], acc.to(c_ptr.dtype.element_ty),
             mask=is_pair[:, None] & col_ok[None, :])


@triton.jit
def _sum_kernel(partial_ptr, out_ptr, size, TOP_K: tl.constexpr, BLOCK: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    col = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    acc = tl.zeros([BLOCK], tl.float32)
    for k in tl.static_range(TOP_K):
        acc += tl.load(partial_ptr + (token * TOP_K + k) * size + col, mask=col < size, other=0.0).to(tl.float32)
    tl.store(out_ptr + token * size + col, acc.to(out_ptr.dtype.element_ty), mask=col < size)


def grouped_gemm(a: torch.Tensor, weights: torch.Tensor, out: torch.Tensor, sorted_pairs: torch.Tensor,
                 block_experts: torch.Tensor, num_padded: torch.Tensor, num_pairs: int, pairs_per_a_row: int,
                 launch: dict, silu_mul: bool = False, pair_weights: torch.Tensor | None = None,
                 scales: BlockScales | None = None) -> torch.Tensor:
    """out [num_pairs, n] = for each pair p: a[p // pairs_per_a_row] @ weights[expert of p].T, n rows of
    weights [experts, n (2 n with silu_mul), K]; with silu_mul, silu of the first n rows' output times the
    next n rows'; with pair_weights [num_pairs] float32, each row times its weight; with `scales`, weights
    are e4m3 and each expert's matrix is dequantized by its blocks' scales (weight-only: a stays 16-bit).
    `launch`: BLOCK_M (the sort's), BLOCK_N, BLOCK_K, GROUP_M, num_warps, num_stages; with block scales
    BLOCK_K is cut to divide the blocks' columns."""
    n_size = weights.shape[1] // 2 if silu_mul else weights.shape[1]
    k_size = weights.shape[2]
    assert a.stride(1) == weights.stride(2) == out.stride(1) == 1 and out.shape[1] == n_size
    tiles = {name: launch[name] for name in ("BLOCK_M", "BLOCK_N", "BLOCK_K", "GROUP_M")}
    scale_ptr, scale_strides, scale_block = weights, (0, 0, 0), (1, 1)  # without FP8 weights: never read
    if scales is not None:
        scale_ptr, scale_block = scales
        per_row = scale_ptr.shape[2] == 1  # one scale along K (per channel, or K within one block): stride 0
        scale_strides = (*scale_ptr.stride()[:2], 0 if per_row else scale_ptr.stride(2))
        assert not silu_mul or n_size % scale_block[0] == 0, (n_size, scale_block)  # up's scales start a row
        if not per_row:
            tiles["BLOCK_K"] = math.gcd(tiles["BLOCK_K"], scale_block[1])  # a step within one scale block
            assert tiles["BLOCK_K"] >= 16, f"scale blocks of {scale_block[1]} columns: K steps need 16 at least"
    grid = (block_experts.numel() * triton.cdiv(n_size, tiles["BLOCK_N"]),)
    _grouped_gemm_kernel[grid](a, weights, out, pair_weights, sorted_pairs, block_experts, num_padded, scale_ptr,
                               n_size, k_size, num_pairs, a.stride(0), weights.stride(0), weights.stride(1),
                               out.stride(0), *scale_strides, PAIRS_PER_A_ROW=pairs_per_a_row, SILU_MUL=silu_mul,
                               MUL_WEIGHTS=pair_weights is not None, FP8_WEIGHTS=scales is not None,
                               SCALE_BN=scale_block[0], SCALE_BK=scale_block[1], **tiles,
                               PRECISION="ieee" if a.dtype == torch.float32 else "tf32", num_warps=launch["num_warps"],
                               num_stages=launch["num_stages"])
    return out


def sum_top_k(partial: torch.Tensor, tokens: int, top_k: int) -> torch.Tensor:
    """partial [tokens * top_k, size] (a token's top_k rows together) -> [tokens, size], summed in float32."""
    size = partial.shape[1]
    out = torch.empty(tokens, size, dtype=partial.dtype, device=partial.device)
    block = min(1024, triton.next_power_of_2(size))
    if tokens:
        _sum_kernel[(tokens, triton.cdiv(size, block))](partial, out, size, TOP_K=top_k, BLOCK=block, num_warps=4)
    return out
