"""Triton KV store, and the paged-cache addressing that the attention kernels share.

Cache layout (see nanoserve_kernels/reference.py): [num_blocks, block_size, kv_heads, head_dim], contiguous,
so a slot (block_id * block_size + offset) addresses one [kv_heads, head_dim] row.
"""
import torch
import triton
import triton.language as tl


@triton.jit
def cache_rows(block_table_row, positions, valid, BLOCK_SIZE: tl.constexpr):
    """Cache slots (int64) of a sequence's token positions, looked up through its block table row.

    Invalid positions read no table entry (the table is -1 past the sequence) and get slot 0, so
    callers must mask their cache loads with `valid` too.
    """
    block_ids = tl.load(block_table_row + positions // BLOCK_SIZE, mask=valid, other=0)
    return block_ids.to(tl.int64) * BLOCK_SIZE + positions % BLOCK_SIZE


@triton.jit
def _store_kernel(k_ptr, v_ptr, k_cache, v_cache, slot_mapping,
                  stride_k_token, stride_k_head, stride_v_token, stride_v_head, stride_slot,
                  KV_HEADS: tl.constexpr, HEADS_POW2: tl.constexpr, HEAD_DIM: tl.constexpr):
    token = tl.program_id(0)
    slot = tl.load(slot_mapping + token).to(tl.int64)
    if slot < 0:
        return
    heads = tl.arange(0, HEADS_POW2)[:, None]
    dims = tl.arange(0, HEAD_DIM)[None, :]
    mask = heads < KV_HEADS
    cache_offsets = slot * stride_slot + heads * HEAD_DIM + dims
    k = tl.load(k_ptr + token * stride_k_token + heads * stride_k_head + dims, mask=mask)
    tl.store(k_cache + cache_offsets, k, mask=mask)
    v = tl.load(v_ptr + token * stride_v_token + heads * stride_v_head + dims, mask=mask)
    tl.store(v_cache + cache_offsets, v, mask=mask)


def store_kvcache(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  slot_mapping: torch.Tensor) -> None:
    """Writes new K/V rows ([N, kv_heads, head_dim], head_dim contiguous; the token and head strides
    may be those of a packed qkv view) into the paged cache at their slots; slot -1 skips."""
    num_tokens, kv_heads, head_dim = k.shape
    assert k.stride(2) == 1 and v.stride(2) == 1, "head_dim must be contiguous"
    assert k_cache.is_contiguous() and v_cache.is_contiguous()
    assert slot_mapping.numel() == num_tokens
    if num_tokens == 0:
        return
    _store_kernel[(num_tokens,)](
        k, v, k_cache, v_cache, slot_mapping,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1), k_cache.stride(1),
        KV_HEADS=kv_heads, HEADS_POW2=triton.next_power_of_2(kv_heads), HEAD_DIM=head_dim)
