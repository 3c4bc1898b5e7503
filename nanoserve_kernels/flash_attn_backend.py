"""flash-attn behind the kernels' three-function contract (nanoserve_kernels/reference.py), as the seeds
call it: varlen prefill through the block table, decode through the paged KV cache. flash-attn's
paged KV needs a block size that is a multiple of 256; the KV store is our Triton one.

flash_attn is optional: this module imports without it, and AVAILABLE says whether it can run.
"""
import torch

from nanoserve_kernels.triton_kv_store import store_kvcache

try:
    from flash_attn import flash_attn_varlen_func, flash_attn_with_kvcache
except ImportError:
    flash_attn_varlen_func = flash_attn_with_kvcache = None

AVAILABLE = flash_attn_varlen_func is not None
__all__ = ["AVAILABLE", "store_kvcache", "paged_prefill", "paged_decode"]


def paged_prefill(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int,
                  block_tables: torch.Tensor, scale: float, out: torch.Tensor | None = None) -> torch.Tensor:
    """New tokens attend causally to their whole cache; flash-attn sizes its grid from the maxima,
    which the caller knows on the host. Its public function takes no output buffer, so `out` is
    filled by a copy."""
    result = flash_attn_varlen_func(q, k_cache, v_cache, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                    max_seqlen_k, softmax_scale=scale, causal=True, block_table=block_tables)
    return result if out is None else out.copy_(result)


def paged_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 context_lens: torch.Tensor, block_tables: torch.Tensor, scale: float,
                 order: torch.Tensor | None = None) -> torch.Tensor:
    """One query per sequence over its cache; no host sync, so it can be captured in a CUDA graph.
    flash-attn schedules its own work: `order` goes unused."""
    out = flash_attn_with_kvcache(q.unsqueeze(1), k_cache, v_cache, cache_seqlens=context_lens,
                                  block_table=block_tables, softmax_scale=scale, causal=True)
    return out.squeeze(1)
