"""Triton paged decode attention: one query per sequence, GQA-grouped, split-K along the context.

Each program takes one (sequence, KV head, split): the GROUP query heads sharing that KV head form
one [GROUP_PAD, head_dim] tile, so every K/V row is read once for all of them. A sequence's
context is cut into `splits` equal ranges computed in the kernel from its own length; a second
kernel merges the splits' partial softmaxes. The grid and every buffer depend only on tensor shapes
(batch, heads), never on per-step lengths, so the launch can be captured in a CUDA graph.

Programs start in grid order, KV heads fastest, and sequences in the `order` given: longest context
first (the worker's step inputs). A batch of mixed lengths in arbitrary order ends with a few long
sequences running alone on an idle GPU; longest first, the short ones fill in behind (at 256 contexts
uniform in [100, 2,000], H100: 93% -> 98% of the copy rate, FP8 75% -> 82%; bench/NOTES-kernels.md).
"""
import functools

import torch
import triton
import triton.language as tl

from nanoserve_kernels.fp8_reference import ACT_GROUP, AMAX_FLOOR, FP8_MAX
from nanoserve_kernels.pdl import pdl_launch, wait_for_previous_kernel
from nanoserve_kernels.triton_fp8_quant import quantize_groups
from nanoserve_kernels.triton_prefill import LOG2_E, attend_block, dot_precision, scale_block_stride

# Key tile and pipelining (bench/NOTES-kernels.md); an FP8 cache's rows are half the bytes, so its
# tiles take twice the keys to move as many bytes per load (tuned with bench/attention.py --sweep-fp8).
LAUNCH = dict(BLOCK_N=64, num_warps=4, num_stages=3)
FP8_LAUNCH = dict(BLOCK_N=128, num_warps=4, num_stages=3)
# Programs wanted in flight per multiprocessor before splitting stops paying for its merge.
PROGRAMS_PER_SM = 2
MAX_SPLITS = 32
# The activation quantization's constants (fp8_reference), as a kernel reads globals.
E4M3_MAX, SCALE_FLOOR = tl.constexpr(FP8_MAX), tl.constexpr(AMAX_FLOOR)
TRITON_DTYPES = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}


@triton.jit
def _split_range(length, split, SPLITS: tl.constexpr, BLOCK_N: tl.constexpr):
    """Key range [start, end) of one split: equal BLOCK_N-aligned chunks of the context."""
    chunk = tl.cdiv(tl.cdiv(length, SPLITS), BLOCK_N) * BLOCK_N
    start = split * chunk
    return start, tl.minimum(length, start + chunk)


# The step metadata's addresses may be offset (a mixed step's decodes are a slice of its rows):
# one compiled variant whatever their alignment, none compiled while serving.
@triton.jit(do_not_specialize_on_alignment=["context_lens", "block_tables", "order"])
def _decode_kernel(q_ptr, k_cache, v_cache, k_scale, v_scale, context_lens, block_tables, order, out_ptr,
                   out_scale, part_out, part_max, part_sum, qk_scale, stride_q_seq, stride_q_head, stride_o_seq,
                   stride_o_head, stride_os_seq, stride_os_head, stride_slot, stride_scale_block, stride_table,
                   GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr,
                   BLOCK_N: tl.constexpr, SPLITS: tl.constexpr, PRECISION: tl.constexpr,
                   QUANTIZED: tl.constexpr, ORDERED: tl.constexpr, PDL: tl.constexpr, QUANTIZE_OUT: tl.constexpr):
    wait_for_previous_kernel(PDL)  # before the early return: a kernel must not end before its predecessor
    kv_head = tl.program_id(0)
    seq = tl.load(order + tl.program_id(1)) if ORDERED else tl.program_id(1)
    split = tl.program_id(2)
    length = tl.load(context_lens + seq)
    start, end = _split_range(length, split, SPLITS, BLOCK_N)
    if SPLITS > 1 and start >= end:
        return  # the merge reads only the splits that hold keys
    group = tl.arange(0, GROUP_PAD)
    heads = (kv_head * GROUP + group)[:, None]
    head_valid = (group < GROUP)[:, None]
    dims = tl.arange(0, HEAD_DIM)[None, :]
    q = tl.load(q_ptr + seq * stride_q_seq + heads * stride_q_head + dims, mask=head_valid, other=0.0)
    # The single query sits after the whole context; masking at end - 1 hides the split's tail.
    q_pos = tl.full([GROUP_PAD], 0, tl.int32) + end - 1

    kv_offset = kv_head * HEAD_DIM
    k_scale_base = k_scale + kv_head * BLOCK_SIZE if QUANTIZED else k_scale
    v_scale_base = v_scale + kv_head * BLOCK_SIZE if QUANTIZED else v_scale
    table = block_tables + seq.to(tl.int64) * stride_table
    m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, HEAD_DIM], tl.float32)
    for block_start in range(start, end, BLOCK_N):
        m_i, l_i, acc = attend_block(q, q_pos, m_i, l_i, acc, k_cache + kv_offset, v_cache + kv_offset,
                                     k_scale_base, v_scale_base, table, block_start, end, qk_scale,
                                     stride_slot, stride_scale_block, BLOCK_SIZE, HEAD_DIM, BLOCK_N, True,
                                     PRECISION, QUANTIZED)
    if SPLITS == 1:
        out = acc / tl.maximum(l_i, 1e-30)[:, None]  # an empty row (length 0) gives zeros
        _store_out(out, out_ptr, out_scale, seq, heads, dims, head_valid, stride_o_seq, stride_o_head,
                   stride_os_seq, stride_os_head, q_ptr.dtype.element_ty, QUANTIZE_OUT)
    else:
        rows = (seq * tl.num_programs(0) * GROUP + heads) * SPLITS + split
        tl.store(part_out + rows * HEAD_DIM + dims, acc, mask=head_valid)
        tl.store(part_max + rows, m_i[:, None], mask=head_valid)
        tl.store(part_sum + rows, l_i[:, None], mask=head_valid)


@triton.jit
def _store_out(out, out_ptr, out_scale, seq, heads, dims, mask, stride_o_seq, stride_o_head, stride_os_seq,
               stride_os_head, DTYPE: tl.constexpr, QUANTIZE_OUT: tl.constexpr):
    """Stores out [heads, HEAD_DIM] (float32) in DTYPE; with QUANTIZE_OUT, rounded to DTYPE as stored, then
    quantized per head (one ACT_GROUP of the o projection's input) as quantize_activation would: e4m3 values
    at out_ptr, each head's scale at out_scale."""
    if QUANTIZE_OUT:
        values, scale = quantize_groups(out.to(DTYPE).to(tl.float32), E4M3_MAX, SCALE_FLOOR)
        tl.store(out_ptr + seq * stride_o_seq + heads * stride_o_head + dims,
                 values.to(out_ptr.dtype.element_ty), mask=mask)
        tl.store(out_scale + seq * stride_os_seq + heads * stride_os_head, scale[:, None], mask=mask)
    else:
        tl.store(out_ptr + seq * stride_o_seq + heads * stride_o_head + dims, out.to(out_ptr.dtype.element_ty),
                 mask=mask)


@triton.jit(do_not_specialize_on_alignment=["context_lens"])
def _merge_kernel(context_lens, part_out, part_max, part_sum, out_ptr, out_scale, stride_o_seq, stride_o_head,
                  stride_os_seq, stride_os_head, HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr,
                  SPLITS: tl.constexpr, PDL: tl.constexpr, DTYPE: tl.constexpr, QUANTIZE_OUT: tl.constexpr):
    wait_for_previous_kernel(PDL)
    seq = tl.program_id(0)
    head = tl.program_id(1)
    length = tl.load(context_lens + seq)
    chunk = tl.cdiv(tl.cdiv(length, SPLITS), BLOCK_N) * BLOCK_N
    used = tl.cdiv(length, tl.maximum(chunk, 1))
    splits = tl.arange(0, SPLITS)
    rows = (seq * tl.num_programs(1) + head) * SPLITS + splits
    maxes = tl.load(part_max + rows, mask=splits < used, other=float("-inf"))
    top = tl.max(maxes, 0)
    weights = tl.where(splits < used, tl.exp2(maxes - top), 0.0)
    total = tl.sum(weights * tl.load(part_sum + rows, mask=splits < used, other=0.0), 0)
    dims = tl.arange(0, HEAD_DIM)
    parts = tl.load(part_out + rows[:, None] * HEAD_DIM + dims[None, :], mask=(splits < used)[:, None],
                    other=0.0)
    out = tl.sum(parts * weights[:, None], 0) / tl.maximum(total, 1e-30)  # no splits: zeros
    _store_out(tl.reshape(out, [1, HEAD_DIM]), out_ptr, out_scale, seq, tl.full([1, 1], 0, tl.int32) + head,
               dims[None, :], tl.full([1, 1], 1, tl.int1), stride_o_seq, stride_o_head, stride_os_seq,
               stride_os_head, DTYPE, QUANTIZE_OUT)


@functools.cache
def _multiprocessors(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4  # the CPU interpreter: a small stand-in, so that small test batches still split


def num_splits(num_seqs: int, kv_heads: int, device: torch.device) -> int:
    """Splits per (sequence, KV head): enough programs to fill the GPU, from shapes alone."""
    wanted = PROGRAMS_PER_SM * _multiprocessors(device)
    return min(MAX_SPLITS, triton.next_power_of_2(triton.cdiv(wanted, num_seqs * kv_heads)))


def paged_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 context_lens: torch.Tensor, block_tables: torch.Tensor, scale: float,
                 k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
                 order: torch.Tensor | None = None, quantized_out: tuple[torch.Tensor, torch.Tensor] | None = None
                 ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """One query per sequence (q: [num_seqs, heads, head_dim]) over its whole cache (an FP8 one
    with its scales). A row with context length 0 (padding) gives zeros. `order` (int32 [num_seqs],
    a permutation of the rows): the order to start the sequences in, longest context first; the
    output does not depend on it. `quantized_out` (e4m3 [num_seqs or more, heads * head_dim], float32 scales
    [num_seqs or more, heads], any strides): where the output goes instead, quantized per token and head as
    quantize_activation would quantize the 16-bit output (head_dim must be ACT_GROUP: a head is one group), for
    the o projection's W8A8 GEMM; returned."""
    num_seqs, heads, head_dim = q.shape
    _, block_size, kv_heads, _ = k_cache.shape
    assert q.stride(2) == 1 and k_cache.is_contiguous() and v_cache.is_contiguous()
    group = heads // kv_heads
    group_pad = max(16, triton.next_power_of_2(group))  # tl.dot takes 16 rows at least
    splits = num_splits(num_seqs, kv_heads, q.device)
    launch = FP8_LAUNCH if k_scale is not None else LAUNCH
    pdl = pdl_launch(q.device)
    if quantized_out is None:
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)  # contiguous for o_proj (see triton_prefill)
        out_scale, scale_strides = out, (0, 0)  # not read: QUANTIZE_OUT is off
    else:
        assert head_dim == ACT_GROUP and quantized_out[0].stride(1) == 1, (head_dim, quantized_out[0].stride())
        out, out_scale = quantized_out[0].view(-1, heads, head_dim), quantized_out[1]
        scale_strides = out_scale.stride()
    part_out = torch.empty(num_seqs, heads, splits, head_dim, dtype=torch.float32, device=q.device)
    part_max = torch.empty(num_seqs, heads, splits, dtype=torch.float32, device=q.device)
    part_sum = torch.empty_like(part_max)
    quantize_out = quantized_out is not None
    _decode_kernel[(kv_heads, num_seqs, splits)](
        q, k_cache, v_cache, k_scale, v_scale, context_lens, block_tables, order, out, out_scale, part_out, part_max,
        part_sum, scale * LOG2_E, q.stride(0), q.stride(1), out.stride(0), out.stride(1), *scale_strides,
        k_cache.stride(1), scale_block_stride(k_scale, v_scale), block_tables.stride(0), GROUP=group,
        GROUP_PAD=group_pad, BLOCK_SIZE=block_size, HEAD_DIM=head_dim, SPLITS=splits,
        PRECISION=dot_precision(q.dtype), QUANTIZED=k_scale is not None, ORDERED=order is not None, **launch, **pdl,
        QUANTIZE_OUT=quantize_out)
    if splits > 1:
        _merge_kernel[(num_seqs, heads)](
            context_lens, part_out, part_max, part_sum, out, out_scale, out.stride(0), out.stride(1), *scale_strides,
            HEAD_DIM=head_dim, BLOCK_N=launch["BLOCK_N"], SPLITS=splits, **pdl, DTYPE=TRITON_DTYPES[q.dtype],
            QUANTIZE_OUT=quantize_out)
    return quantized_out if quantize_out else out
