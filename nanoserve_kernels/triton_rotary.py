"""Rotary embedding of q and k in one Triton launch per layer, optionally after Qwen3's per-head RMSNorm,
and optionally storing the rotated k and v into the paged KV cache in the same launch.

torch.compile turns the same work into ~6 kernels a layer (two variance reductions, two apply passes,
two copies); at batch 1 each costs ~1 us of a ~1.5 ms decode step, so one kernel saves ~10% there.
q and k are rotated in place: they are views into the QKV projection's output, which nothing else
reads. Rounding follows the plain functions (nanoserve_model.norm.rms_normalize, nanoserve_model.rotary.
rotate): statistics and rotation in float32, the normalized value and its weighted product rounded to
the model dtype in between.

Where the backend stores with the Triton store kernel, this kernel does its work instead (a CacheWrite):
each program holds its token's rotated k in registers already, so it writes it to the cache from
there, with v, exactly as triton_kv_store.store_kvcache would after it. A layer's rotary is then
followed by attention directly, with no store kernel between them (the separate store took 43 us of a
1.04 ms batch-1 decode step on an H100, bench/RESULTS.md).
"""
import torch
import triton
import triton.language as tl

from nanoserve_kernels.backend import CacheWrite
from nanoserve_kernels.pdl import pdl_launch, wait_for_previous_kernel
from nanoserve_kernels.triton_kv_store import store_row_halves, store_rows, write_args


@triton.jit
def _rotate_heads(base, stride_head, out, stride_out_head, weight, cos, sin, eps, HEADS: tl.constexpr,
                  HEADS_POW2: tl.constexpr, HALF: tl.constexpr, HALF_POW2: tl.constexpr, NORM: tl.constexpr):
    """All heads of one token: [heads, head_dim] at `base`, rotate-half form, normalized first if NORM,
    stored at `out` (`base` itself: in place). Returns the rotated halves [HEADS_POW2, HALF_POW2] as
    stored (in the model's dtype), for the cache."""
    heads = tl.arange(0, HEADS_POW2)[:, None]
    dims = tl.arange(0, HALF_POW2)[None, :]
    mask = (heads < HEADS) & (dims < HALF)
    first = base + heads * stride_head + dims
    dtype = base.dtype.element_ty
    x1 = tl.load(first, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(first + HALF, mask=mask, other=0.0).to(tl.float32)
    if NORM:
        inv_rms = tl.rsqrt((tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)) / (2 * HALF) + eps)[:, None]
        w1 = tl.load(weight + dims, mask=dims < HALF).to(tl.float32)
        w2 = tl.load(weight + HALF + dims, mask=dims < HALF).to(tl.float32)
        x1 = ((x1 * inv_rms).to(dtype).to(tl.float32) * w1).to(dtype).to(tl.float32)
        x2 = ((x2 * inv_rms).to(dtype).to(tl.float32) * w2).to(dtype).to(tl.float32)
    lo = (x1 * cos - x2 * sin).to(dtype)
    hi = (x2 * cos + x1 * sin).to(dtype)
    destination = out + heads * stride_out_head + dims
    tl.store(destination, lo, mask=mask)
    tl.store(destination + HALF, hi, mask=mask)
    return lo, hi


@triton.jit
def _qk_rotary_kernel(q_ptr, k_ptr, q_out_ptr, q_weight, k_weight, cos_table, sin_table, positions, eps,
                      stride_q_token, stride_q_head, stride_k_token, stride_k_head, stride_qo_token, stride_qo_head,
                      Q_HEADS: tl.constexpr, Q_HEADS_POW2: tl.constexpr, K_HEADS: tl.constexpr,
                      K_HEADS_POW2: tl.constexpr, HALF: tl.constexpr, HALF_POW2: tl.constexpr,
                      NORM: tl.constexpr, PDL: tl.constexpr, STORE: tl.constexpr = False,
                      # the cache write (triton_kv_store.write_args), used only if STORE
                      v_ptr=None, k_cache=None, v_cache=None, k_scale=None, v_scale=None, slot_mapping=None,
                      stride_v_token=0, stride_v_head=0, stride_slot=0, stride_scale_block=0,
                      BLOCK_SIZE: tl.constexpr = 1, FP8_MAX: tl.constexpr = 0.0, AMAX_FLOOR: tl.constexpr = 0.0,
                      QUANTIZED: tl.constexpr = False):
    wait_for_previous_kernel(PDL)
    token = tl.program_id(0).to(tl.int64)
    position = tl.load(positions + token).to(tl.int64)
    dims = tl.arange(0, HALF_POW2)[None, :]
    cos = tl.load(cos_table + position * HALF + dims, mask=dims < HALF, other=0.0)
    sin = tl.load(sin_table + position * HALF + dims, mask=dims < HALF, other=0.0)
    _rotate_heads(q_ptr + token * stride_q_token, stride_q_head, q_out_ptr + token * stride_qo_token, stride_qo_head,
                  q_weight, cos, sin, eps, Q_HEADS, Q_HEADS_POW2, HALF, HALF_POW2, NORM)
    k = k_ptr + token * stride_k_token
    k_lo, k_hi = _rotate_heads(k, stride_k_head, k, stride_k_head, k_weight, cos, sin, eps,
                               K_HEADS, K_HEADS_POW2, HALF, HALF_POW2, NORM)
    if STORE:
        slot = tl.load(slot_mapping + token).to(tl.int64)
        if slot >= 0:
            # k from registers: reading back what this program just stored could see another
            # thread's elements before they land.
            store_row_halves(k_lo, k_hi, k_cache, k_scale, slot, stride_slot, stride_scale_block, K_HEADS,
                             K_HEADS_POW2, HALF, BLOCK_SIZE, FP8_MAX, AMAX_FLOOR, QUANTIZED)
            store_rows(v_ptr, v_cache, v_scale, token, slot, stride_v_token, stride_v_head, stride_slot,
                       stride_scale_block, K_HEADS, K_HEADS_POW2, HALF, BLOCK_SIZE, FP8_MAX, AMAX_FLOOR, QUANTIZED)


def rotate_qk_(q: torch.Tensor, k: torch.Tensor, cos_table: torch.Tensor, sin_table: torch.Tensor,
               positions: torch.Tensor, q_weight: torch.Tensor | None = None, k_weight: torch.Tensor | None = None,
               eps: float = 0.0, write: CacheWrite | None = None, q_out: torch.Tensor | None = None
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotates q [N, heads, head_dim] and k [N, kv_heads, head_dim] in place by the float32 cos/sin tables
    [max_position, head_dim / 2] at `positions` [N]; with q_weight/k_weight, each head is RMS-normalized
    first (Qwen3). With `q_out` (q's shape), the rotated q goes there and q is left as it was. head_dim
    must be contiguous; the token and head strides are free. With `write`, also stores the rotated k and
    write.v into the paged cache as store_kvcache(k, write.v, ...) would after it; head_dim must then be
    a power of 2. Returns (rotated q, k)."""
    q_out = q if q_out is None else q_out
    assert q.stride(2) == 1 and k.stride(2) == 1 and cos_table.is_contiguous() and sin_table.is_contiguous()
    assert q_out.shape == q.shape and q_out.stride(2) == 1
    half = q.shape[2] // 2
    norm = q_weight is not None
    cache = {}
    if write is not None:
        assert q.shape[2] & (q.shape[2] - 1) == 0, "the cache write needs a power-of-2 head_dim"
        cache = dict(STORE=True, **write_args(k, write))
    if q.shape[0]:
        _qk_rotary_kernel[(q.shape[0],)](
            q, k, q_out, q_weight if norm else q, k_weight if norm else k, cos_table, sin_table, positions, eps,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), q_out.stride(0), q_out.stride(1),
            Q_HEADS=q.shape[1], Q_HEADS_POW2=triton.next_power_of_2(q.shape[1]), K_HEADS=k.shape[1],
            K_HEADS_POW2=triton.next_power_of_2(k.shape[1]), HALF=half, HALF_POW2=triton.next_power_of_2(half),
            NORM=norm, **pdl_launch(q.device), **cache)
    return q_out, k
