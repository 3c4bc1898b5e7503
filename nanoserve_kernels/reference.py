"""Plain-torch paged KV cache and attention: the CPU path and the oracle for the GPU kernels.

Shapes (one layer):
  k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim]
  slot_mapping:     [num_new_tokens] int, block_id * block_size + offset, -1 = skip
  block_tables:     [num_seqs, max_blocks] int32, rows padded with -1 past the sequence's blocks
  context_lens:     [num_seqs] int32, tokens in the cache for the sequence after this step's store
  cu_seqlens_q:     [num_seqs + 1] int32, prefix sums of the new-token counts
  cu_seqlens_k:     [num_seqs + 1] int32, prefix sums of context_lens
  max_seqlen_q/k:   Python ints, the longest new-token count and context (known on the host)

Every backend keeps these signatures: store_kvcache, paged_prefill (flash-attn's varlen names),
paged_decode (per-row lengths on the device only, so a CUDA graph can replay it); paged_prefill
also takes `out=`, the buffer to write (piecewise CUDA graphs read attention from a static one).
"""
import torch

from nanoserve.mathutil import cdiv


def store_kvcache(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  slot_mapping: torch.Tensor) -> None:
    """Writes new K/V rows ([N, kv_heads, head_dim]) into the paged cache at their slots."""
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    k_cache.view(-1, *k_cache.shape[2:])[slots] = k[keep]
    v_cache.view(-1, *v_cache.shape[2:])[slots] = v[keep]


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
                  block_tables: torch.Tensor, scale: float, out: torch.Tensor | None = None) -> torch.Tensor:
    """New tokens (q: [N, heads, head_dim], packed by cu_seqlens_q) attend causally to their
    sequence's whole cache (cached prefix + themselves, already stored), into `out` if given.
    The maxima are not needed here (no grid to size)."""
    out = torch.empty_like(q) if out is None else out
    starts, ends = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    for i in range(len(starts) - 1):
        lo, hi, length = starts[i], starts[i + 1], ends[i + 1] - ends[i]
        k = gather_context(k_cache, block_tables[i], length)
        v = gather_context(v_cache, block_tables[i], length)
        out[lo:hi] = _attend(q[lo:hi], k, v, scale)
    return out


def paged_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 context_lens: torch.Tensor, block_tables: torch.Tensor, scale: float) -> torch.Tensor:
    """One query per sequence (q: [num_seqs, heads, head_dim]) over its whole cache.
    A row with context length 0 (padding) gives zeros."""
    out = torch.zeros_like(q)
    for i, length in enumerate(context_lens.tolist()):
        if length > 0:
            k = gather_context(k_cache, block_tables[i], length)
            v = gather_context(v_cache, block_tables[i], length)
            out[i : i + 1] = _attend(q[i : i + 1], k, v, scale)
    return out
