"""Paged attention over the KV cache: stores this step's K/V, then attends through the backend
named in the step context.

Where the backend stores with the Triton store kernel, the rotary kernel before attention stores
them instead, as it makes k (cache_write): a layer on CUDA is then the QKV projection, rotary with
the store, attention; elsewhere the store is attention's first kernel."""
import torch
from torch import nn

from nanoserve_kernels.backend import CacheWrite
from nanoserve_kernels.fp8_reference import ACT_GROUP
from nanoserve_model.step_context import StepContext, get_step_context


class Attention(nn.Module):
    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale = head_dim ** -0.5
        self.k_cache = self.v_cache = torch.empty(0)  # bound by the runner once memory is sized
        self.kv_scales: dict[str, torch.Tensor] = {}

    def bind_kv_cache(self, k_cache: torch.Tensor, v_cache: torch.Tensor, k_scale: torch.Tensor | None = None,
                      v_scale: torch.Tensor | None = None) -> None:
        """This layer's [num_blocks, block_size, kv_heads, head_dim] slices of the cache, and with
        an FP8 cache its scales (nanoserve_kernels/kv_quant.py), passed to every backend call."""
        self.k_cache, self.v_cache = k_cache, v_cache
        self.kv_scales = {} if k_scale is None else dict(k_scale=k_scale, v_scale=v_scale)

    def query_buffer(self, q: torch.Tensor) -> torch.Tensor | None:
        """Where the positioned queries go: the static buffer a piecewise graph's attention cut reads
        them from (written there by the rotary kernel instead of copied by the cut), or None: in place."""
        queries = get_step_context().attention_queries
        return None if queries is None else queries[:len(q)]

    def cache_write(self, q: torch.Tensor, v: torch.Tensor) -> CacheWrite | None:
        """The store of this step's k and v, for the rotary kernel to make as it rotates k (one launch
        fewer a layer), where the backend's own store is the Triton kernel whose work that is: on CUDA
        (q's device: rotary runs the kernel there), head_dim a power of 2. None elsewhere, and
        forward stores them itself."""
        ctx = get_step_context()
        if not (q.is_cuda and ctx.backend.stores_with_triton and self.head_dim & (self.head_dim - 1) == 0):
            return None
        return CacheWrite(v, self.k_cache, self.v_cache, ctx.slot_mapping, **self.kv_scales)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, stored: bool = False,
                quantization: dict | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """q [N, heads, head_dim], k/v [N, kv_heads, head_dim] -> [N, heads, head_dim]; `stored`: k and v
        are in the cache already (cache_write's store ran). `quantization`: the o projection's W8A8 input
        layout (fp8_linear.input_quantization), in which a decode step whose backend can returns its output
        quantized instead, (e4m3 [N+, heads * head_dim], scales), with head_dim one group."""
        ctx = get_step_context()
        backend = ctx.backend
        if not stored:
            backend.store_kvcache(k, v, self.k_cache, self.v_cache, ctx.slot_mapping, **self.kv_scales)
        if ctx.attention_cut is not None:
            return ctx.attention_cut(self, q)
        if ctx.is_prefill:
            return self.prefill(q, ctx)
        outputs = {}
        if quantization is not None and backend.decode_quantizes and self.head_dim == ACT_GROUP:
            from nanoserve_kernels.triton_fp8_quant import empty_quantized
            outputs["quantized_out"] = empty_quantized(len(q), self.num_heads * self.head_dim, q.device,
                                                       **quantization)
        return backend.paged_decode(q, self.k_cache, self.v_cache, ctx.context_lens, ctx.block_tables, self.scale,
                                    order=ctx.decode_order, **self.kv_scales, **outputs)

    def prefill(self, q: torch.Tensor, ctx: StepContext, out: torch.Tensor | None = None) -> torch.Tensor:
        """Prefill attention of q over the cache, which holds the step's K/V already; into `out`
        if given (a piecewise graph's replay runs this between its pieces). A mixed step's leading
        decodes (ctx.num_decodes queries, one per sequence) attend through the decode kernel."""
        backend, num_decodes = ctx.backend, ctx.num_decodes
        if not num_decodes:
            return backend.paged_prefill(q, self.k_cache, self.v_cache, ctx.cu_seqlens_q, ctx.cu_seqlens_k,
                                         ctx.max_seqlen_q, ctx.max_seqlen_k, ctx.block_tables, self.scale, out=out,
                                         **self.kv_scales)
        # Contiguous even when q is a view into the QKV output (rotated in place): o_proj's GEMM reads it.
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device) if out is None else out
        out[:num_decodes] = backend.paged_decode(q[:num_decodes], self.k_cache, self.v_cache,
                                                 ctx.context_lens[:num_decodes], ctx.block_tables[:num_decodes],
                                                 self.scale, order=ctx.decode_order, **self.kv_scales)
        backend.paged_prefill(q[num_decodes:], self.k_cache, self.v_cache, ctx.cu_seqlens_q, ctx.cu_seqlens_k,
                              ctx.max_seqlen_q, ctx.max_seqlen_k, ctx.block_tables[num_decodes:], self.scale,
                              out=out[num_decodes:], **self.kv_scales)
        return out
