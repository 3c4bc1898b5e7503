"""Plain-torch paged KV cache and attention: the CPU path and the oracle for the GPU kernels.

Shapes (one layer):
  k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim]
  slot_mapping:     [num_new_tokens] int, block_id * block_size + offset, -1 = skip
  block_tables:     [num_seqs, max_blocks] int32, rows padded with -1 past the sequence's blocks
  context_lens:     [num_seqs] int32, tokens in the cache for the sequence after this step's store
  cu_seqlens_q:     [num_seqs + 1] int32, prefix sums of the new-token counts
  cu_seqlens_k:     [num_seqs + 1] int32, prefix sums of context_lens
  max_seqlen_q/k:   Python ints, the longest new-token count and context (known on the host)

  k_scale, v_scale:  [num_blocks, kv_heads, block_size] float32, only with an FP8 cache (kv_quant.py)

Every backend keeps these signatures: store_kvcache, paged_prefill (flash-attn's varlen names),
paged_decode (per-row lengths on the device only, so a CUDA graph can replay it); paged_prefill
also takes `out=`, the buffer to write (piecewise CUDA graphs read attention from a static one).
A backend that reads FP8 caches takes k_scale= and v_scale= in all three; FP8 attention is
attention over the dequantized cache.
"""
import torch

from nanoserve.mathutil import cdiv
from nanoserve_kernels.kv_quant import dequantize, quantize, slot_major


def store_kvcache(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  slot_mapping: torch.Tensor, k_scale: torch.Tensor | None = None,
                  v_scale: torch.Tensor | None = None) -> None:
    """Writes new K/V rows ([N, kv_heads, head_dim]) into the paged cache at their slots; with
    scales, quantized to FP8 with each row's own scale."""
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    block_size = k_cache.shape[1]
    for new, cache, scales in ((k, k_cache, k_scale), (v, v_cache, v_scale)):
        rows = new[keep]
        if scales is not None:
            rows, row_scales = quantize(rows)
            slot_major(scales)[slots // block_size, slots % block_size] = row_scales
        cache.view(-1, *cache.shape[2:])[slots] = rows


def _context(cache: torch.Tensor, scales: torch.Tensor | None, block_table: torch.Tensor,
             length: int) -> torch.Tensor:
    """One sequence's first `length` K (or V) rows, dequantized if the cache is FP8."""
    rows = gather_context(cache, block_table, length)
    return rows if scales is None else dequantize(rows, gather_context(slot_major(scales), block_table, length))


def gather_context(cache: torch.Tensor, block_table: torch.Tensor, length: int) -> torch.Tensor:
    """The first `length` cached rows of one sequence: [length, kv_heads, head_dim]."""
    block_size = cache.shape[1]
    blocks = block_table[: cdiv(length, block_size)].long()
    return cache[blocks].flatten(0, 1)[:length]


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """q [n, H, D] over k/v [L, KvH, D]; query i sits at position L - n + i (causal)."""
    n, heads, _ = q.shape
    length, kv_heads, _ = k.shape
    group = heads // kv_heads
    k = k.repeat_interleave(group, dim=1).transpose(0, 1).float()
    v = v.repeat_interleave(group, dim=1).transpose(0, 1).float()
    scores = torch.matmul(q.transpose(0, 1).float(), k.transpose(1, 2)) * scale
    q_pos = torch.arange(length - n, length, device=q.device)[:, None]
    k_pos = torch.arange(length, device=q.device)[None, :]
    scores.masked_fill_(k_pos > q_pos, float("-inf"))
    out = torch.matmul(scores.softmax(dim=-1), v)
    return out.transpose(0, 1).to(q.dtype)


def paged_prefill(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int,
                  block_tables: torch.Tensor, scale: float, out: torch.Tensor | None = None,
                  k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None) -> torch.Tensor:
    """New tokens (q: [N, heads, head_dim], packed by cu_seqlens_q) attend causally to their
    sequence's whole cache (cached prefix + themselves, already stored), into `out` if given.
    The maxima are not needed here (no grid to size)."""
    # Contiguous even when q is a view into the QKV output (rotated in place): o_proj's GEMM reads it.
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device) if out is None else out
    starts, ends = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    for i in range(len(starts) - 1):
        lo, hi, length = starts[i], starts[i + 1], ends[i + 1] - ends[i]
        k = _context(k_cache, k_scale, block_tables[i], length)
        v = _context(v_cache, v_scale, block_tables[i], length)
        out[lo:hi] = _attend(q[lo:hi], k, v, scale)
    return out


def paged_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 context_lens: torch.Tensor, block_tables: torch.Tensor, scale: float,
                 k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
                 order: torch.Tensor | None = None) -> torch.Tensor:
    """One query per sequence (q: [num_seqs, heads, head_dim]) over its whole cache.
    A row with context length 0 (padding) gives zeros. `order`: the rows by context length, longest
    first, for a kernel that schedules its work (the Triton one); the result does not depend on it."""
    out = torch.zeros_like(q)
    for i, length in enumerate(context_lens.tolist()):
        if length > 0:
            k = _context(k_cache, k_scale, block_tables[i], length)
            v = _context(v_cache, v_scale, block_tables[i], length)
            out[i : i + 1] = _attend(q[i : i + 1], k, v, scale)
    return out
