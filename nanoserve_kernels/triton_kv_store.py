"""Triton KV store, and the paged-cache addressing that the attention kernels share.

Cache layout (see nanoserve_kernels/reference.py): [num_blocks, block_size, kv_heads, head_dim], contiguous,
so a slot (block_id * block_size + offset) addresses one [kv_heads, head_dim] row. An FP8 cache
adds per-row scales, [num_blocks, kv_heads, block_size] (nanoserve_kernels/kv_quant.py).
"""
import torch
import triton
import triton.language as tl

from nanoserve_kernels.backend import CacheWrite
from nanoserve_kernels.kv_quant import AMAX_FLOOR, FP8_MAX
from nanoserve_kernels.pdl import pdl_launch, wait_for_previous_kernel


@triton.jit
def cache_rows(block_table_row, positions, valid, BLOCK_SIZE: tl.constexpr):
    """Cache slots (int64) of a sequence's token positions, looked up through its block table row.

    Invalid positions read no table entry (the table is -1 past the sequence) and get slot 0, so
    callers must mask their cache loads with `valid` too.
    """
    block_ids = tl.load(block_table_row + positions // BLOCK_SIZE, mask=valid, other=0)
    return block_ids.to(tl.int64) * BLOCK_SIZE + positions % BLOCK_SIZE


@triton.jit
def tile_rows(block_table_row, start, positions, valid, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr):
    """cache_rows of a key tile: positions = start + [0, BLOCK_N), start a multiple of BLOCK_N. Where
    BLOCK_N divides the block size the tile lies in one cache block, so one table entry places it all;
    a gather of BLOCK_N entries and per-key block arithmetic cost FP8 decode (issue-bound: every key is
    converted in registers) 77% -> 81% of the copy rate at 256 x 1,024 (H100, bench/NOTES-kernels.md).
    The callers' tiles start before the sequence ends, so that entry is a real block."""
    if BLOCK_SIZE % BLOCK_N == 0:
        block_id = tl.load(block_table_row + start // BLOCK_SIZE)
        return block_id.to(tl.int64) * BLOCK_SIZE + start % BLOCK_SIZE + tl.arange(0, BLOCK_N)
    return cache_rows(block_table_row, positions, valid, BLOCK_SIZE)


@triton.jit
def scale_rows(rows, stride_scale_block, BLOCK_SIZE: tl.constexpr):
    """Offsets of cache slots `rows` in one KV head's scales (pointer already at that head)."""
    return rows // BLOCK_SIZE * stride_scale_block + rows % BLOCK_SIZE


@triton.jit
def round_to_e4m3_grid(x):
    """|x| <= 448 rounded to the nearest e4m3 value (ties to even), still in float32, so that the
    cast to e4m3 is exact whatever rounding it does (Triton's CPU interpreter truncates, and its
    round-to-nearest forgets the carry into the exponent). Normal values keep 3 mantissa bits;
    below 2**-6 e4m3 is subnormal, in steps of 2**-9: scaled by 2**9 (exact), those round to an
    integer by adding and taking off 2**23, once, as the hardware's own conversion rounds."""
    magnitude = tl.abs(x)
    bits = magnitude.to(tl.int32, bitcast=True)
    bits = (bits + 0x7FFFF + ((bits >> 20) & 1)) & -0x100000  # drop 20 of 23 mantissa bits, ties to even
    rounded = bits.to(tl.float32, bitcast=True)
    steps = (magnitude * 512.0 + 8388608.0) - 8388608.0
    rounded = tl.where(magnitude < 0.015625, steps * 0.001953125, rounded)
    return tl.where(x < 0, -rounded, rounded)


@triton.jit
def _quantize(x, row_scales, FP8_MAX: tl.constexpr):
    """x [heads, n] (float32) as e4m3 values of its heads' scales, still in float32."""
    scaled = tl.div_rn(x, row_scales[:, None])
    return round_to_e4m3_grid(tl.minimum(tl.maximum(scaled, -FP8_MAX), FP8_MAX))


@triton.jit
def store_row_halves(lo, hi, cache, scales, slot, stride_slot, stride_scale_block, KV_HEADS: tl.constexpr,
                     HEADS_POW2: tl.constexpr, HALF: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                     FP8_MAX: tl.constexpr, AMAX_FLOOR: tl.constexpr, QUANTIZED: tl.constexpr):
    """One token's K (or V) rows [kv_heads, head_dim] into the cache at `slot`, given as the first and
    second halves of each row, [HEADS_POW2, HALF] in the model's dtype (rows past KV_HEADS unused):
    the form in which the rotary kernel holds k. When QUANTIZED, in e4m3 with a scale per head
    (kv_quant.quantize, bit for bit: IEEE divisions as torch's)."""
    heads = tl.arange(0, HEADS_POW2)
    mask = (heads < KV_HEADS)[:, None]
    if QUANTIZED:
        lo = lo.to(tl.float32)
        hi = hi.to(tl.float32)
        amax = tl.maximum(tl.max(tl.abs(lo), 1), tl.max(tl.abs(hi), 1))
        row_scales = tl.div_rn(tl.maximum(amax, AMAX_FLOOR), FP8_MAX)
        lo = _quantize(lo, row_scales, FP8_MAX)
        hi = _quantize(hi, row_scales, FP8_MAX)
        tl.store(scales + heads * BLOCK_SIZE + scale_rows(slot, stride_scale_block, BLOCK_SIZE), row_scales,
                 mask=heads < KV_HEADS)
    first = cache + slot * stride_slot + heads[:, None] * (2 * HALF) + tl.arange(0, HALF)[None, :]
    tl.store(first, lo.to(cache.dtype.element_ty), mask=mask)
    tl.store(first + HALF, hi.to(cache.dtype.element_ty), mask=mask)


@triton.jit
def store_rows(new_ptr, cache, scales, token, slot, stride_token, stride_head, stride_slot,
               stride_scale_block, KV_HEADS: tl.constexpr, HEADS_POW2: tl.constexpr, HALF: tl.constexpr,
               BLOCK_SIZE: tl.constexpr, FP8_MAX: tl.constexpr, AMAX_FLOOR: tl.constexpr,
               QUANTIZED: tl.constexpr):
    """One token's K (or V) rows [kv_heads, head_dim], read at `new_ptr`, into the cache at `slot`."""
    heads = tl.arange(0, HEADS_POW2)[:, None]
    first = new_ptr + token * stride_token + heads * stride_head + tl.arange(0, HALF)[None, :]
    lo = tl.load(first, mask=heads < KV_HEADS, other=0.0)
    hi = tl.load(first + HALF, mask=heads < KV_HEADS, other=0.0)
    store_row_halves(lo, hi, cache, scales, slot, stride_slot, stride_scale_block, KV_HEADS, HEADS_POW2, HALF,
                     BLOCK_SIZE, FP8_MAX, AMAX_FLOOR, QUANTIZED)


@triton.jit
def _store_kernel(k_ptr, v_ptr, k_cache, v_cache, k_scale, v_scale, slot_mapping,
                  stride_k_token, stride_k_head, stride_v_token, stride_v_head, stride_slot,
                  stride_scale_block, KV_HEADS: tl.constexpr, HEADS_POW2: tl.constexpr,
                  HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, FP8_MAX: tl.constexpr,
                  AMAX_FLOOR: tl.constexpr, QUANTIZED: tl.constexpr, PDL: tl.constexpr):
    wait_for_previous_kernel(PDL)  # before the early return: a kernel must not end before its predecessor
    token = tl.program_id(0)
    slot = tl.load(slot_mapping + token).to(tl.int64)
    if slot < 0:
        return
    store_rows(k_ptr, k_cache, k_scale, token, slot, stride_k_token, stride_k_head, stride_slot,
               stride_scale_block, KV_HEADS, HEADS_POW2, HEAD_DIM // 2, BLOCK_SIZE, FP8_MAX, AMAX_FLOOR, QUANTIZED)
    store_rows(v_ptr, v_cache, v_scale, token, slot, stride_v_token, stride_v_head, stride_slot,
               stride_scale_block, KV_HEADS, HEADS_POW2, HEAD_DIM // 2, BLOCK_SIZE, FP8_MAX, AMAX_FLOOR, QUANTIZED)


def write_args(k: torch.Tensor, write: CacheWrite) -> dict:
    """The arguments, by name, that a kernel storing new K rows `k` ([N, kv_heads, head_dim]) and
    write.v takes for the cache: _store_kernel's, which the rotary kernel's repeat."""
    assert k.stride(2) == 1 and write.v.stride(2) == 1, "head_dim must be contiguous"
    assert write.k_cache.is_contiguous() and write.v_cache.is_contiguous()
    assert write.slot_mapping.numel() == k.shape[0]
    quantized = write.k_scale is not None
    assert not quantized or (write.k_scale.is_contiguous() and write.v_scale.is_contiguous())
    return dict(v_ptr=write.v, k_cache=write.k_cache, v_cache=write.v_cache, k_scale=write.k_scale,
                v_scale=write.v_scale, slot_mapping=write.slot_mapping, stride_v_token=write.v.stride(0),
                stride_v_head=write.v.stride(1), stride_slot=write.k_cache.stride(1),
                stride_scale_block=write.k_scale.stride(0) if quantized else 0, BLOCK_SIZE=write.k_cache.shape[1],
                FP8_MAX=FP8_MAX, AMAX_FLOOR=AMAX_FLOOR, QUANTIZED=quantized)


def store_kvcache(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  slot_mapping: torch.Tensor, k_scale: torch.Tensor | None = None,
                  v_scale: torch.Tensor | None = None) -> None:
    """Writes new K/V rows ([N, kv_heads, head_dim], head_dim contiguous; the token and head strides
    may be those of a packed qkv view) into the paged cache at their slots; slot -1 skips. With
    scales, the cache is FP8 and each row is quantized with its own scale."""
    num_tokens, kv_heads, head_dim = k.shape
    cache = write_args(k, CacheWrite(v, k_cache, v_cache, slot_mapping, k_scale, v_scale))
    if num_tokens == 0:
        return
    _store_kernel[(num_tokens,)](
        k, stride_k_token=k.stride(0), stride_k_head=k.stride(1), KV_HEADS=kv_heads,
        HEADS_POW2=triton.next_power_of_2(kv_heads), HEAD_DIM=head_dim, **cache, **pdl_launch(k.device))
