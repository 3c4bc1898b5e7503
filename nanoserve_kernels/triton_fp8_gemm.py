"""y [M, N] = x [M, K] @ W [N, K]^T of an e4m3 weight with block scales (nanoserve_kernels/fp8_reference.py),
for batches of more than one row:

  - W8A8 (x quantized per token and 128 columns by triton_fp8_quant.py): e4m3 x e4m3 tensor-core dots,
    each BLOCK_K step's partial product scaled by its activation scales (per row) and weight scales
    (per output column) as it is added into the float32 accumulator: prefill and large batches, where
    the e4m3 dots run at twice the 16-bit rate;
  - weight-only (x in the model dtype): each weight tile converted to x's dtype in registers (exact:
    e4m3 values are bf16/fp16 values) and scaled the same way: small decode batches, whose cost is the
    weight read, halved by e4m3, and which would not repay the activations' quantization pass.

BLOCK_K divides the weight blocks' 128 columns, so one weight scale covers a step of a column, and of
the whole tile where BLOCK_N divides the blocks' 128 rows (TILE_SCALE: the scaling is then a multiply an
element, ~70 fewer registers a thread at 128 x 128); per-channel weights
(scales [N, 1]) are the case of one block per row. With SILU_MUL the weight holds gate rows then as many
up rows (the MLP's packed gate/up) and the epilogue writes silu(gate) * up, as the 16-bit path fuses it
(triton_gate_up.py), each half rounded to the output dtype first. Launch shapes come from fp8_configs.py.

SPLIT_K > 1 splits each output tile's K steps over that many programs: at decode batches the 8B shape's
4,096-row projections make 32-64 tiles of 128 x 128 for 132 multiprocessors, so a tile's weights would be
read by one program while most of the card waits (torch's scaled_mm at 256 rows: 41 us on the 8B down
projection against 50 us at 512). Each program stores its float32 partial sums in a workspace and counts
itself in the tile's counter; the last to arrive adds the partials in split order (the same sums whatever
the arrival order), runs the epilogue and sets the counter back to zero for the next call (CUTLASS's
serial split-K), so no second kernel and no memset.

SWAP_AB computes each tile transposed, weight rows by batch rows, then turns the sums around once before the
epilogue: Hopper's tensor-core instructions (wgmma) take 64 or more rows on their M side, so a batch of 16-32
rows on that side leaves them to the older, narrower instructions, where on the N side (any multiple of 8) it
fits; the weight's rows fill M instead (as CUTLASS's and TensorRT-LLM's small-batch FP8 kernels swap A and B).

TMA (W8A8 only) loads the a and weight tiles through tensor descriptors: Hopper's tensor-memory accelerator
copies each 128-byte-wide e4m3 tile into shared memory, with no address arithmetic in the threads and edges
read as zeros. The tuner offers every W8A8 launch both ways; on an H100 it served the 8B shape's o projection at
128-256 rows, down at 64-128 and q/k/v at 64, 0.3-1.3 us a call faster than the next choice (bench/RESULTS.md).
"""
import functools

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from nanoserve_kernels.fp8_reference import ACT_GROUP
from nanoserve_kernels.triton_activation import silu_mul

# Tile counters of split-K launches, zero between calls; a launch with more tiles runs unsplit.
SPLIT_K_COUNTERS = 1 << 16


@triton.jit
def _scaled_step(a, w, w_scale, a_scale, W8A8: tl.constexpr, TILE_SCALE: tl.constexpr):
    """One BLOCK_K step's product of the a tile with a weight tile, scaled to float32. TILE_SCALE: one weight
    scale for the tile's columns (w_scale a scalar, not a row of them), so the scaling is one multiply an
    element, not the outer product of two scale vectors and a multiply (the same float32 products)."""
    if TILE_SCALE:
        if W8A8:
            return tl.dot(a, tl.trans(w)) * (a_scale * w_scale)[:, None]
        return tl.dot(a, tl.trans(w.to(a.dtype))) * w_scale
    if W8A8:
        return tl.dot(a, tl.trans(w)) * (a_scale[:, None] * w_scale[None, :])
    return tl.dot(a, tl.trans(w.to(a.dtype))) * w_scale[None, :]


@triton.jit
def _scaled_step_swapped(a, w, w_scale, a_scale, W8A8: tl.constexpr, TILE_SCALE: tl.constexpr):
    """_scaled_step transposed: the product [BLOCK_N, BLOCK_M] of the weight tile with the a tile, so that the
    weight's rows fill the tensor cores' M side (64 or 128 of them) and the batch's few rows their N side."""
    if TILE_SCALE:
        if W8A8:
            return tl.dot(w, tl.trans(a)) * (a_scale * w_scale)[None, :]
        return tl.dot(w.to(a.dtype), tl.trans(a)) * w_scale
    if W8A8:
        return tl.dot(w, tl.trans(a)) * (w_scale[:, None] * a_scale[None, :])
    return tl.dot(w.to(a.dtype), tl.trans(a)) * w_scale[:, None]


@triton.jit
def _partial_offsets(tile, split, tiles, part: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Where split `split` of `tile` keeps its partial sums `part` (0: the product, 1: SILU_MUL's up half) in
    the workspace [SPLIT_K, tiles, 2, BLOCK_M, BLOCK_N] (float32)."""
    first = ((split * tiles + tile) * 2 + part).to(tl.int64) * (BLOCK_M * BLOCK_N)
    return first + tl.arange(0, BLOCK_M)[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]


@triton.jit
def _split_sum(partial_ptr, tile, tiles, part: tl.constexpr, last, SPLIT_K: tl.constexpr, BLOCK_M: tl.constexpr,
               BLOCK_N: tl.constexpr):
    """The tile's partial sums `part` added in split order (loaded by the last program only; L2, not L1)."""
    total = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for split in tl.static_range(SPLIT_K):
        total += tl.load(partial_ptr + _partial_offsets(tile, split, tiles, part, BLOCK_M, BLOCK_N), mask=last,
                         other=0.0, cache_modifier=".cg")
    return total


@triton.jit(do_not_specialize=["rows"])  # one compile a launch shape, whatever the batch size
def _fp8_gemm_kernel(a_ptr, a_scale_ptr, w_ptr, w_scale_ptr, bias_ptr, out_ptr, partial_ptr, counter_ptr, rows,
                     n_size, k_size, split_steps, stride_a, stride_asm, stride_ask, stride_w, stride_wsn, stride_wsk,
                     stride_out,
                     SCALE_BN: tl.constexpr, SCALE_BK: tl.constexpr, ACT_GROUP: tl.constexpr, W8A8: tl.constexpr,
                     SILU_MUL: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                     BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, SPLIT_K: tl.constexpr = 1,
                     TILE_SCALE: tl.constexpr = False, TMA: tl.constexpr = False, SWAP_AB: tl.constexpr = False):
    # Programs in groups of GROUP_M row blocks over each column block: the weight tiles they share
    # are read from memory once and from L2 after. With SPLIT_K, axis 1 is the program's share of K.
    # TILE_SCALE: the tile's columns, and their up rows, lie in one row of weight scales. TMA: a_ptr and w_ptr
    # are tensor descriptors, whose tiles Hopper's tensor-memory accelerator copies (rows past the edges zero).
    pid = tl.program_id(0)
    row_blocks, col_blocks = tl.cdiv(rows, BLOCK_M), tl.cdiv(n_size, BLOCK_N)
    group_size = GROUP_M * col_blocks
    first_row_block = (pid // group_size) * GROUP_M
    group_rows = tl.minimum(row_blocks - first_row_block, GROUP_M)
    row_block = first_row_block + (pid % group_size) % group_rows
    col_block = (pid % group_size) // group_rows

    row = row_block * BLOCK_M + tl.arange(0, BLOCK_M)
    col = col_block * BLOCK_N + tl.arange(0, BLOCK_N)
    k = tl.arange(0, BLOCK_K)
    row_ok, col_ok = row < rows, col < n_size
    if not TMA:
        a_ptrs = a_ptr + row[:, None].to(tl.int64) * stride_a + k[None, :]
        w_ptrs = w_ptr + col[:, None].to(tl.int64) * stride_w + k[None, :]
    if TILE_SCALE:
        w_scale_ptrs = w_scale_ptr + (col_block * BLOCK_N // SCALE_BN) * stride_wsn
    else:
        w_scale_ptrs = w_scale_ptr + (col // SCALE_BN) * stride_wsn
    up_offset = n_size * stride_w  # SILU_MUL: the up row of each gate row
    up_scale_offset = (n_size // SCALE_BN) * stride_wsn
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    up_acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    acc_t = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)  # SWAP_AB: the sums transposed, until the epilogue
    up_acc_t = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
    a_scale = tl.zeros([BLOCK_M], tl.float32)
    # split_steps BLOCK_K steps a split; the last split's may pass K: masked (TMA: read as zeros), adding zeros
    k_first = tl.program_id(1) * split_steps * BLOCK_K
    for step in range(0, split_steps):
        start = k_first + step * BLOCK_K
        if TMA:  # a and w are descriptors; a gate tile past N reads up rows, whose columns are not stored
            a = a_ptr.load([row_block * BLOCK_M, start])
            w = w_ptr.load([col_block * BLOCK_N, start])
        else:
            k_ok = start + k < k_size
            mask_w = col_ok[:, None] & k_ok[None, :]
            a = tl.load(a_ptrs + start, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            w = tl.load(w_ptrs + start, mask=mask_w, other=0.0)
        if W8A8:
            a_scale = tl.load(a_scale_ptr + row * stride_asm + (start // ACT_GROUP) * stride_ask,
                              mask=row_ok & (start < k_size), other=0.0)
        if TILE_SCALE:
            scale_ok = start < k_size
        else:
            scale_ok = col_ok & (start < k_size)
        scale_step = (start // SCALE_BK) * stride_wsk
        w_scale = tl.load(w_scale_ptrs + scale_step, mask=scale_ok, other=0.0)
        if SWAP_AB:
            acc_t += _scaled_step_swapped(a, w, w_scale, a_scale, W8A8, TILE_SCALE)
        else:
            acc += _scaled_step(a, w, w_scale, a_scale, W8A8, TILE_SCALE)
        if SILU_MUL:
            if TMA:
                w_up = w_ptr.load([n_size + col_block * BLOCK_N, start])
            else:
                w_up = tl.load(w_ptrs + up_offset + start, mask=mask_w, other=0.0)
            up_scale = tl.load(w_scale_ptrs + up_scale_offset + scale_step, mask=scale_ok, other=0.0)
            if SWAP_AB:
                up_acc_t += _scaled_step_swapped(a, w_up, up_scale, a_scale, W8A8, TILE_SCALE)
            else:
                up_acc += _scaled_step(a, w_up, up_scale, a_scale, W8A8, TILE_SCALE)
    if SWAP_AB:  # one transpose of the sums (through shared memory), then the epilogue as unswapped
        acc = tl.trans(acc_t)
        if SILU_MUL:
            up_acc = tl.trans(up_acc_t)
    store_ok = row_ok[:, None] & col_ok[None, :]
    if SPLIT_K > 1:
        tiles = row_blocks * col_blocks
        tl.store(partial_ptr + _partial_offsets(pid, tl.program_id(1), tiles, 0, BLOCK_M, BLOCK_N), acc)
        if SILU_MUL:
            tl.store(partial_ptr + _partial_offsets(pid, tl.program_id(1), tiles, 1, BLOCK_M, BLOCK_N), up_acc)
        tl.debug_barrier()  # every thread's partials stored before the count that releases them
        last = tl.atomic_add(counter_ptr + pid, 1, sem="acq_rel") == SPLIT_K - 1
        acc = _split_sum(partial_ptr, pid, tiles, 0, last, SPLIT_K, BLOCK_M, BLOCK_N)
        if SILU_MUL:
            up_acc = _split_sum(partial_ptr, pid, tiles, 1, last, SPLIT_K, BLOCK_M, BLOCK_N)
        tl.store(counter_ptr + pid, 0, mask=last)  # ready for the next call
        store_ok &= last
    out_dtype = out_ptr.dtype.element_ty
    if HAS_BIAS:
        acc += tl.load(bias_ptr + col, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        if SILU_MUL:
            up_acc += tl.load(bias_ptr + n_size + col, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    if SILU_MUL:  # as the unfused path: each half rounded to the output dtype, SiLU-and-mul in float32
        acc = silu_mul(acc.to(out_dtype).to(tl.float32), up_acc.to(out_dtype).to(tl.float32))
    tl.store(out_ptr + row[:, None].to(tl.int64) * stride_out + col[None, :], acc.to(out_dtype), mask=store_ok)


def takes_tma(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether x and the weight can be read through tensor descriptors: 16-byte aligned starts and rows. (TMA
    serves W8A8 only: its e4m3 tiles' 128-column rows are one 128-byte swizzle span.)"""
    return all(t.data_ptr() % 16 == 0 and t.stride(0) * t.element_size() % 16 == 0 for t in (x, weight))


@functools.cache
def _split_k_counters(device: torch.device) -> torch.Tensor:
    """The device's tile counters (zero between launches, in stream order; allocated before graph capture by
    the warm-up's eager calls)."""
    return torch.zeros(SPLIT_K_COUNTERS, dtype=torch.int32, device=device)


def fp8_gemm(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, block: tuple[int, int],
             launch: dict, x_scale: torch.Tensor | None = None, bias: torch.Tensor | None = None,
             silu_mul: bool = False, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """x @ weight.T (+ bias) [M, N] for x [M, K]: W8A8 when x is e4m3 with its `x_scale` [M, ceil(K / 128)],
    weight-only when x is 16-bit; with `silu_mul`, silu(gate) * up [M, N / 2] of the packed (gate, up).
    `launch`: BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, num_warps, num_stages, optionally SPLIT_K and TMA (W8A8's
    loads through tensor descriptors, where takes_tma; fp8_configs.py)."""
    rows, k_size = x.shape
    n_size = weight.shape[0] // 2 if silu_mul else weight.shape[0]
    assert x.stride(1) == 1 and weight.stride(1) == 1 and weight.shape[1] == k_size
    assert block[1] >= k_size or block[1] % launch["BLOCK_K"] == 0, (block, launch)  # a step in one scale block
    assert x_scale is None or ACT_GROUP % launch["BLOCK_K"] == 0, launch
    w8a8 = x_scale is not None
    per_row = weight_scale.shape[1] == 1  # one scale a row (per channel, or K within one block): stride 0 along K
    out = torch.empty(rows, n_size, dtype=out_dtype or x.dtype, device=x.device)
    tiles = triton.cdiv(rows, launch["BLOCK_M"]) * triton.cdiv(n_size, launch["BLOCK_N"])
    split_k = launch.get("SPLIT_K", 1) if tiles <= SPLIT_K_COUNTERS else 1
    partials = counters = None
    if split_k > 1:
        partials = torch.empty(split_k * tiles * 2 * launch["BLOCK_M"] * launch["BLOCK_N"], dtype=torch.float32,
                               device=x.device)
        counters = _split_k_counters(x.device)
    tma = launch.get("TMA", False) and w8a8 and takes_tma(x, weight)
    a_arg, w_arg = (x, weight) if not tma else (
        TensorDescriptor.from_tensor(x, [launch["BLOCK_M"], launch["BLOCK_K"]]),
        TensorDescriptor.from_tensor(weight, [launch["BLOCK_N"], launch["BLOCK_K"]]))
    _fp8_gemm_kernel[(tiles, split_k)](
        a_arg, x_scale, w_arg, weight_scale, bias, out, partials, counters, rows, n_size, k_size,
        triton.cdiv(triton.cdiv(k_size, launch["BLOCK_K"]), split_k), x.stride(0),
        x_scale.stride(0) if w8a8 else 0, x_scale.stride(1) if w8a8 else 0, weight.stride(0),
        weight_scale.stride(0), 0 if per_row else weight_scale.stride(1), out.stride(0),
        SCALE_BN=block[0], SCALE_BK=launch["BLOCK_K"] if per_row else block[1], ACT_GROUP=ACT_GROUP, W8A8=w8a8,
        SILU_MUL=silu_mul, HAS_BIAS=bias is not None, **dict(launch, SPLIT_K=split_k, TMA=tma),
        TILE_SCALE=block[0] % launch["BLOCK_N"] == 0 and (not silu_mul or n_size % block[0] == 0))
    return out
