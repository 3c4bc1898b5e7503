"""Triton paged prefill attention: flash-attention's online softmax over the paged cache.

New tokens attend causally to their whole sequence, cached prefix included, reading K/V through
the block table: the model stores this step's K/V first, so first prefills, prefix-cache hits and
chunked prefill are one case. Query i of a sequence with n new tokens and L cached tokens sits at
position L - n + i. One program per (query tile, query head).
"""
import os

import torch
import triton
import triton.language as tl

from nanoserve_kernels.triton_kv_store import scale_rows, tile_rows

LOG2_E = 1.4426950408889634
# e4m3 -> bf16 with integer ops (below) on the GPU; the CPU interpreter cannot run inline PTX.
E4M3_BY_BITS: tl.constexpr = tl.constexpr(os.environ.get("TRITON_INTERPRET") != "1")


def dot_precision(dtype: torch.dtype) -> str:
    """float32 models get full-precision dots (Triton would round them to tf32); others are exact."""
    return "ieee" if dtype == torch.float32 else "tf32"


def scale_block_stride(k_scale: torch.Tensor | None, v_scale: torch.Tensor | None) -> int:
    """The scales' block stride (0 without scales), checked to suit the kernels' addressing."""
    if k_scale is None:
        return 0
    assert k_scale.is_contiguous() and v_scale.is_contiguous() and k_scale.shape == v_scale.shape
    return k_scale.stride(0)


@triton.jit
def e4m3_to_bf16(values):
    """e4m3 values -> the same numbers in bf16, four at a time. Triton converts through float16,
    ~2.5 conversion instructions per value at a quarter of the integer rate, which held FP8 decode
    at 75% of the copy rate. Here a value's sign, exponent and mantissa bits move into bf16's places
    (byte b becomes (b & 0x80) << 8 | (b & 0x7F) << 4: exponent bias 7 instead of 127, subnormals
    included), and one bf16 multiply by 2^120 rebiases, exactly."""
    return tl.inline_asm_elementwise(
        asm="""{
        .reg .b32 zero, lo, hi, sign_lo, sign_hi, bias, neg_zero;
        mov.b32 zero, 0;
        mov.b32 bias, 0x7B807B80;
        mov.b32 neg_zero, 0x80008000;
        prmt.b32 lo, $2, zero, 0x1404;
        prmt.b32 hi, $2, zero, 0x3424;
        and.b32 sign_lo, lo, 0x80008000;
        and.b32 sign_hi, hi, 0x80008000;
        shr.b32 lo, lo, 4;
        shr.b32 hi, hi, 4;
        and.b32 lo, lo, 0x07F007F0;
        and.b32 hi, hi, 0x07F007F0;
        or.b32 lo, lo, sign_lo;
        or.b32 hi, hi, sign_hi;
        fma.rn.bf16x2 $0, lo, bias, neg_zero;
        fma.rn.bf16x2 $1, hi, bias, neg_zero;
        }""",
        constraints="=r,=r,r", args=[values.to(tl.uint8, bitcast=True)], dtype=tl.bfloat16, is_pure=True, pack=4)


@triton.jit
def load_kv(pointers, mask, dtype: tl.constexpr, QUANTIZED: tl.constexpr):
    """A K or V tile in the queries' dtype (an FP8 one as stored, unscaled)."""
    tile = tl.load(pointers, mask=mask, other=0.0)
    if QUANTIZED and E4M3_BY_BITS and dtype == tl.bfloat16:
        return e4m3_to_bf16(tile)
    return tile.to(dtype)


@triton.jit
def attend_block(q, q_pos, m_i, l_i, acc, k_base, v_base, k_scale_base, v_scale_base, block_table_row,
                 start, length, qk_scale, stride_slot, stride_scale_block, BLOCK_SIZE: tl.constexpr,
                 HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr,
                 PRECISION: tl.constexpr, QUANTIZED: tl.constexpr):
    """Folds keys [start, start + BLOCK_N) of one sequence and KV head into the running softmax of
    queries q [M, HEAD_DIM] (base-2 scores); start is a multiple of BLOCK_N, below `length`. Keys at
    or past `length` are never read; with MASKED, keys after a row's position q_pos are hidden from
    it (which hides keys >= length from every row whose q_pos < length).

    QUANTIZED: K/V are e4m3 with a scale per row (kv_quant.py), read as they are stored: e4m3
    converts exactly to q's dtype, a key's scale joins the score scale of its column, and a value's
    scale weighs its column of the probabilities, so the second dot takes the stored values too
    (scaling P [M, BLOCK_N] instead of V [BLOCK_N, HEAD_DIM]: HEAD_DIM / M times fewer multiplies in
    decode, no float32 V tile)."""
    positions = start + tl.arange(0, BLOCK_N)
    valid = positions < length
    rows = tile_rows(block_table_row, start, positions, valid, BLOCK_SIZE, BLOCK_N)
    offsets = rows[:, None] * stride_slot + tl.arange(0, HEAD_DIM)[None, :]
    k = load_kv(k_base + offsets, valid[:, None], q.dtype, QUANTIZED)
    v = load_kv(v_base + offsets, valid[:, None], q.dtype, QUANTIZED)
    scores = tl.dot(q, tl.trans(k), input_precision=PRECISION)
    if QUANTIZED:
        scale_offsets = scale_rows(rows, stride_scale_block, BLOCK_SIZE)
        scores *= (tl.load(k_scale_base + scale_offsets, mask=valid, other=0.0) * qk_scale)[None, :]
        v_scales = tl.load(v_scale_base + scale_offsets, mask=valid, other=0.0)
    else:
        scores *= qk_scale
    if MASKED:
        scores = tl.where(positions[None, :] <= q_pos[:, None], scores, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(scores, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(scores - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    if QUANTIZED:
        p *= v_scales[None, :]
    acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v, input_precision=PRECISION)
    return m_new, l_i, acc


@triton.jit
def _find_sequence(cu_seqlens_q, num_seqs, slot, BLOCK_M: tl.constexpr):
    """Binary search for the sequence owning tile slot `slot`; sequence i's tiles start at slot
    cu_seqlens_q[i] // BLOCK_M + i, a layout that needs no host-side tile count."""
    lo = 0
    hi = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        if tl.load(cu_seqlens_q + mid) // BLOCK_M + mid <= slot:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


# One compiled kernel for every batch size and block-table width (both change from step to step,
# and Triton would otherwise specialise on their divisibility and compile again mid-service); the
# same for the step metadata's addresses, which a mixed step offsets past its decodes (a new
# 16-byte alignment compiled a variant while serving: 1.4 s steps on the H100).
@triton.jit(do_not_specialize=["num_seqs", "stride_table"],
            do_not_specialize_on_alignment=["cu_seqlens_q", "cu_seqlens_k", "block_tables"])
def _prefill_kernel(q_ptr, k_cache, v_cache, k_scale, v_scale, out_ptr, cu_seqlens_q, cu_seqlens_k,
                    block_tables, num_seqs, qk_scale, stride_q_token, stride_q_head, stride_o_token,
                    stride_o_head, stride_slot, stride_scale_block, stride_table, GROUP: tl.constexpr,
                    BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr,
                    BLOCK_N: tl.constexpr, PRECISION: tl.constexpr, QUANTIZED: tl.constexpr):
    # Reversed, so the last tiles of each sequence (the most keys under the mask) start first.
    slot = tl.num_programs(0) - 1 - tl.program_id(0)
    head = tl.program_id(1)
    seq = _find_sequence(cu_seqlens_q, num_seqs, slot, BLOCK_M)
    q_start = tl.load(cu_seqlens_q + seq)
    num_new = tl.load(cu_seqlens_q + seq + 1) - q_start
    tile = slot - (q_start // BLOCK_M + seq)
    if tile * BLOCK_M >= num_new:
        return
    length = tl.load(cu_seqlens_k + seq + 1) - tl.load(cu_seqlens_k + seq)
    rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    row_valid = (rows < num_new)[:, None]
    tokens = (q_start + rows).to(tl.int64)[:, None]
    dims = tl.arange(0, HEAD_DIM)[None, :]
    q = tl.load(q_ptr + tokens * stride_q_token + head * stride_q_head + dims, mask=row_valid, other=0.0)
    q_pos = length - num_new + rows

    kv_head = head // GROUP
    k_base = k_cache + kv_head * HEAD_DIM
    v_base = v_cache + kv_head * HEAD_DIM
    k_scale_base = k_scale + kv_head * BLOCK_SIZE if QUANTIZED else k_scale
    v_scale_base = v_scale + kv_head * BLOCK_SIZE if QUANTIZED else v_scale
    table = block_tables + seq.to(tl.int64) * stride_table
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    # Keys up to the tile's first query position are visible to every row: no mask there.
    first_pos = length - num_new + tile * BLOCK_M
    unmasked_end = (first_pos + 1) // BLOCK_N * BLOCK_N
    for start in range(0, unmasked_end, BLOCK_N):
        m_i, l_i, acc = attend_block(q, q_pos, m_i, l_i, acc, k_base, v_base, k_scale_base, v_scale_base, table,
                                     start, length, qk_scale, stride_slot, stride_scale_block, BLOCK_SIZE,
                                     HEAD_DIM, BLOCK_N, False, PRECISION, QUANTIZED)
    end = tl.minimum(length, first_pos + BLOCK_M)
    for start in range(unmasked_end, end, BLOCK_N):
        m_i, l_i, acc = attend_block(q, q_pos, m_i, l_i, acc, k_base, v_base, k_scale_base, v_scale_base, table,
                                     start, length, qk_scale, stride_slot, stride_scale_block, BLOCK_SIZE,
                                     HEAD_DIM, BLOCK_N, True, PRECISION, QUANTIZED)
    out = acc / l_i[:, None]
    tl.store(out_ptr + tokens * stride_o_token + head * stride_o_head + dims,
             out.to(out_ptr.dtype.element_ty), mask=row_valid)


# From this many new tokens of one sequence on, the query tiles are long enough (2,000 keys each on
# average) for 128 x 128 tiles on 8 warps to beat 64 x 64 on 4: 1 x 4,000 tokens 0.426 -> 0.402 ms a
# layer, 1 x 8,000 1.496 -> 1.342 (8B shape, H100); at 16 x 1,024 they lose 4%. Only the eager step
# that sizes memory at start-up can be that long, and it compiles them then.
LONG_PROMPT = 2048


def _launch_config(head_dim: int, max_seqlen_q: int, quantized: bool) -> dict:
    """Tile shapes and pipelining, tuned on an H100 for head_dim 128 (bench/NOTES-kernels.md);
    larger heads take narrower key tiles, or their registers spill."""
    if head_dim > 128:
        return dict(BLOCK_M=64, BLOCK_N=32, num_warps=4, num_stages=2)
    if max_seqlen_q >= LONG_PROMPT and not quantized:
        return dict(BLOCK_M=128, BLOCK_N=128, num_warps=8, num_stages=2)
    return dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=2)


def paged_prefill(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int,
                  block_tables: torch.Tensor, scale: float, out: torch.Tensor | None = None,
                  k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None) -> torch.Tensor:
    """New tokens (q: [N, heads, head_dim], packed by cu_seqlens_q) attend causally to their
    sequence's whole cache (cached prefix + themselves, already stored), into `out` if given (a
    static buffer between CUDA-graph pieces); an FP8 cache comes with its scales. No host sync; the
    grid comes from shapes alone, and the longest new run picks the tiles (max_seqlen_k goes unused)."""
    num_tokens, heads, head_dim = q.shape
    _, block_size, kv_heads, _ = k_cache.shape
    assert q.stride(2) == 1 and k_cache.is_contiguous() and v_cache.is_contiguous()
    # Contiguous even when q is a view into the QKV output (rotated in place): o_proj's GEMM reads it.
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device) if out is None else out
    assert out.shape == q.shape and out.stride(2) == 1
    num_seqs = cu_seqlens_q.numel() - 1
    config = _launch_config(head_dim, max_seqlen_q, k_scale is not None)
    # Enough tile slots for any split of num_tokens into num_seqs sequences (see _find_sequence).
    grid = (num_tokens // config["BLOCK_M"] + num_seqs, heads)
    _prefill_kernel[grid](
        q, k_cache, v_cache, k_scale, v_scale, out, cu_seqlens_q, cu_seqlens_k, block_tables,
        num_seqs, scale * LOG2_E, q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(1), scale_block_stride(k_scale, v_scale), block_tables.stride(0),
        GROUP=heads // kv_heads, BLOCK_SIZE=block_size, HEAD_DIM=head_dim,
        PRECISION=dot_precision(q.dtype), QUANTIZED=k_scale is not None, **config)
    return out
