"""The matrix-vector product of batch-1 decode: y [1, N] = x [1, K] @ W [N, K]^T (+ bias), optionally
with the RMSNorm before the projection made in its loads of x.

At batch 1 a decode step is a chain of matrix-vector products whose cost is reading each weight
once. cuBLAS runs them as GEMM tiles (split-K with a reduction pass on some shapes), at 0.7-0.8
TB/s on the Qwen3-0.6B shape's o and down projections (bench/gemv.py). Here each program owns
BLOCK_N whole rows of W, loads them BLOCK_K columns at a time, multiplies by x (a few KB, read
from L2 by every program) and reduces in float32: W is read once, in long contiguous rows, by
enough programs to keep every multiprocessor streaming, with no second pass. From two rows on,
cuBLAS's tiles reuse each weight load across the rows and win (bench/gemv.py), so only one takes this path.

A row's RMSNorm (with the residual add) before the q/k/v and gate/up projections is otherwise a kernel of
its own, a few microseconds at batch 1. Here x is made from its inputs in registers (the "prologue"), with
the float32 math and the rounding to the model dtype of the separate norm kernel (triton_rms_norm.py, which
kept those of the torch.compile'd norm it replaced: libdevice rsqrt, no rounding between fused elementwise
ops), so only x's source changes, not the products or their order. The statistics are a float32 sum over the
row, which every program recomputes (K values from L2); its order is this kernel's blocks', not the norm
kernel's one block a row, so the inverse RMS may differ from the unfused one in its last bit. The SiLU-and-
mul between gate/up and down is made in the gate/up gemv's output instead (each program takes gate rows and
the matching up rows, "SILU_MUL"): made in the down gemv's loads it was a loss (bench/gemv.py --fused, H100:
8B down 47.9 vs 38.7 us separate), every program recomputing an exp per element of a 12,288-wide row.
"""
import functools

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from nanoserve_kernels import fp8_configs
from nanoserve_kernels.e4m3_words import BITS_SUM_UNIT, BITS_X_UNIT, words_to_float32
from nanoserve_kernels.pdl import pdl_launch, wait_for_previous_kernel
from nanoserve_kernels.triton_activation import silu_mul

MAX_ROWS = 1
# Tiles (bench/gemv.py --sweep: the model's calls, fusions and PDL in, weights from memory, H100).
# Rows under 4,096 columns (the 0.6B shape) take one tile for the whole row, eight rows a program up
# to 1,024 columns and four beyond, and 8 warps with SiLU-and-mul: against two rows of at most 2,048
# columns, 4 warps, q/k/v 5.99 -> 4.40 us, o 2.85 -> 2.51, gate_up 8.05 -> 6.78, down 3.94 -> 3.28
# (3.9 us a layer, session 8). From 4,096 columns on (8B), four rows a program (with SiLU-and-mul: two
# gate and two up rows) gain 1.2 us on q/k/v, and on a row of 12,288 (8B down) tiles of 4,096 columns
# take 35.0 us where 2,048 took 40.6.
WIDE_K, LONG_K = 4096, 8192
NUM_WARPS, SILU_MUL_WARPS = 4, 8


@triton.jit
def _inverse_rms(x_ptr, residual_ptr, residual_out_ptr, K, eps, BLOCK_K: tl.constexpr, HAS_RESIDUAL: tl.constexpr):
    """1 / RMS of s = x (+ residual), from the unrounded float32 s as the compiled norm takes it.
    Program 0 also stores s, in the model dtype, as the next residual stream: it holds the whole row
    here anyway, and 2-8 KB more for one program is noise beside its 8-32 KB of weights, where shares
    would split K columns over thousands of programs (most with none, on the 0.6B shape)."""
    cols = tl.arange(0, BLOCK_K)
    squares = tl.zeros([BLOCK_K], tl.float32)
    for start in range(0, K, BLOCK_K):
        ok = start + cols < K
        s = tl.load(x_ptr + start + cols, mask=ok, other=0.0).to(tl.float32)
        if HAS_RESIDUAL:
            s += tl.load(residual_ptr + start + cols, mask=ok, other=0.0).to(tl.float32)
            tl.store(residual_out_ptr + start + cols, s.to(residual_out_ptr.dtype.element_ty),
                     mask=ok & (tl.program_id(0) == 0))
        squares += s * s
    return libdevice.rsqrt(tl.sum(squares, axis=0) / K + eps)


@triton.jit
def _weight_tile(w_ptr, rows, row_ok, start, cols, K, stride_w, STREAM: tl.constexpr):
    """W[rows, start:start + len(cols)]; zeros past its edges (a tile past K loads nothing). STREAM: past L1
    (".cg"), as read once: L1 keeps x, which every program on the multiprocessor reads."""
    return tl.load(w_ptr + rows[:, None].to(tl.int64) * stride_w + start + cols[None, :],
                   mask=row_ok[:, None] & (start + cols < K)[None, :], other=0.0, cache_modifier=".cg" if STREAM else "")


@triton.jit
def _x_at(x_ptr, residual_ptr, norm_ptr, columns, ok, inverse_rms, PROLOGUE: tl.constexpr,
          HAS_RESIDUAL: tl.constexpr):
    """x (or its RMSNorm) at `columns`, in float32 from the model dtype."""
    dtype = x_ptr.dtype.element_ty
    x = tl.load(x_ptr + columns, mask=ok, other=0.0).to(tl.float32)
    if PROLOGUE == "rms_norm":
        if HAS_RESIDUAL:  # normalized from the residual as stored, in the model dtype
            x = (x + tl.load(residual_ptr + columns, mask=ok, other=0.0).to(tl.float32)).to(dtype)
        weight = tl.load(norm_ptr + columns, mask=ok, other=0.0).to(tl.float32)
        x = (weight * (x.to(tl.float32) * inverse_rms)).to(dtype).to(tl.float32)
    return x


@triton.jit
def _x_tile(x_ptr, residual_ptr, norm_ptr, start, cols, K, inverse_rms, PROLOGUE: tl.constexpr,
            HAS_RESIDUAL: tl.constexpr, CONVERT: tl.constexpr, X_BY_THREAD: tl.constexpr,
            THREAD_COLUMNS: tl.constexpr, BLOCK_K: tl.constexpr):
    """x over one tile, float32, as _products takes it: [columns] (CONVERT "triton"), or [words, 4], the
    columns of each word ("bits": times 2^64). X_BY_THREAD: [threads, vectors, columns] instead (_as_x_operand
    makes it the above), each thread's THREAD_COLUMNS columns in 16-byte vectors of x, so that x is loaded in
    the layout of the weight tile's columns, not loaded otherwise and moved through shared memory each tile."""
    if X_BY_THREAD:
        tl.static_assert(BLOCK_K % THREAD_COLUMNS == 0, "X_BY_THREAD: whole threads' columns in a tile")
        # Triton's coalescing puts 16-byte vectors on the last axis and threads on the first (of the axes alike
        # in contiguity, the first first): the middle one stays in each thread's registers (docs/fp8.md)
        vector: tl.constexpr = 128 // x_ptr.dtype.element_ty.primitive_bitwidth  # columns of a 16-byte load
        columns = (start + THREAD_COLUMNS * tl.arange(0, BLOCK_K // THREAD_COLUMNS)[:, None, None]
                   + vector * tl.arange(0, THREAD_COLUMNS // vector)[None, :, None]
                   + tl.arange(0, vector)[None, None, :])
    elif CONVERT == "ptx" or CONVERT == "bits":
        columns = start + 4 * cols[:, None] + tl.arange(0, 4)[None, :]
    else:
        columns = start + cols
    x = _x_at(x_ptr, residual_ptr, norm_ptr, columns, columns < K, inverse_rms, PROLOGUE, HAS_RESIDUAL)
    if CONVERT == "bits":
        x *= BITS_X_UNIT
    return x


@triton.jit
def _as_x_operand(x, BLOCK_K: tl.constexpr, CONVERT: tl.constexpr, X_BY_THREAD: tl.constexpr):
    """x from _x_tile as _products takes it: [threads, vectors, columns] (X_BY_THREAD) in column order to
    [words, 4] or [columns]."""
    if X_BY_THREAD:
        x = tl.reshape(x, [BLOCK_K // 4, 4] if CONVERT == "ptx" or CONVERT == "bits" else [BLOCK_K])
    return x


@triton.jit
def _products(w, x, CONVERT: tl.constexpr):
    """w * x over one tile (x from _as_x_operand), float32. CONVERT "triton": w [rows, columns] in the model dtype
    or e4m3 (Triton's conversion); "ptx" and "bits": w [rows, words] int32, four e4m3 a word
    (nanoserve_kernels/e4m3_words.py), and the result the sum of each word's four products ("bits": times
    2^-56)."""
    if CONVERT == "ptx" or CONVERT == "bits":
        products = tl.sum(words_to_float32(w, CONVERT) * x[None, :, :], axis=2)
    else:
        products = w.to(tl.float32) * x[None, :]
    return products


@triton.jit
def _times_column_scales(x, scale_ptr, row, start, cols, K, stride_scale, SCALE_BN: tl.constexpr,
                         SCALE_BK: tl.constexpr, CONVERT: tl.constexpr, X_BY_THREAD: tl.constexpr,
                         THREAD_COLUMNS: tl.constexpr, BLOCK_K: tl.constexpr):
    """x (from _x_tile) times the block scale of each of its columns, of the scale row holding `row`
    (X_BY_THREAD: one a thread, whose columns lie in one scale block)."""
    words: tl.constexpr = CONVERT == "ptx" or CONVERT == "bits"
    if X_BY_THREAD:
        tl.static_assert(SCALE_BK % THREAD_COLUMNS == 0, "X_BY_THREAD: a thread's columns in one scale block")
        columns = start + THREAD_COLUMNS * tl.arange(0, BLOCK_K // THREAD_COLUMNS)
    else:
        columns = start + (4 if words else 1) * cols  # a word's four columns share a scale block
    scale = tl.load(scale_ptr + (row // SCALE_BN) * stride_scale + columns // SCALE_BK, mask=columns < K, other=0.0)
    if X_BY_THREAD:
        x *= scale[:, None, None]
    elif words:
        x *= scale[:, None]
    else:
        x *= scale
    return x


@triton.jit
def _tile_sums(products, scale_ptr, rows, row_ok, start, K, stride_scale, BLOCK_N: tl.constexpr,
               BLOCK_K: tl.constexpr, SCALE_BN: tl.constexpr, SCALE_BK: tl.constexpr, WEIGHT_SCALE: tl.constexpr):
    """Each row's sum of the tile's products (a column each, or a word of LANES columns each); for an e4m3
    weight whose scales vary along K ("block"), each SCALE_BK-column group's sum times its scale (a per-row
    scale is applied once, at the end)."""
    if WEIGHT_SCALE == "block":
        groups = tl.arange(0, BLOCK_K // SCALE_BK)
        sums = tl.sum(tl.reshape(products, [BLOCK_N, BLOCK_K // SCALE_BK, products.shape[1] * SCALE_BK // BLOCK_K]),
                      axis=2)
        scales = tl.load(scale_ptr + (rows // SCALE_BN)[:, None] * stride_scale + (start // SCALE_BK + groups)[None, :],
                         mask=row_ok[:, None] & (start + groups * SCALE_BK < K)[None, :], other=0.0)
        return tl.sum(sums * scales, axis=1)
    return tl.sum(products, axis=1)


@triton.jit
def _tile_terms(w, x, scale_ptr, first_row, rows, row_ok, start, cols, K, stride_scale, BLOCK_N: tl.constexpr,
                BLOCK_K: tl.constexpr, SCALE_BN: tl.constexpr, SCALE_BK: tl.constexpr, WEIGHT_SCALE: tl.constexpr,
                CONVERT: tl.constexpr, SUM_ONCE: tl.constexpr, X_BY_THREAD: tl.constexpr,
                THREAD_COLUMNS: tl.constexpr):
    """One tile's addition to the accumulator: per column with SUM_ONCE (x taken times the block scales of
    the scale row holding `first_row`), else each row's sum (_tile_sums)."""
    if SUM_ONCE:
        if WEIGHT_SCALE == "block":
            x = _times_column_scales(x, scale_ptr, first_row, start, cols, K, stride_scale, SCALE_BN, SCALE_BK,
                                     CONVERT, X_BY_THREAD, THREAD_COLUMNS, BLOCK_K)
        terms = _products(w, _as_x_operand(x, BLOCK_K, CONVERT, X_BY_THREAD), CONVERT)
    else:
        terms = _tile_sums(_products(w, _as_x_operand(x, BLOCK_K, CONVERT, X_BY_THREAD), CONVERT), scale_ptr, rows,
                           row_ok, start, K, stride_scale, BLOCK_N, BLOCK_K, SCALE_BN, SCALE_BK, WEIGHT_SCALE)
    return terms


@triton.jit
def _gemv_kernel(x_ptr, residual_ptr, residual_out_ptr, norm_ptr, w_ptr, scale_ptr, bias_ptr, y_ptr, N, K, stride_w,
                 stride_scale, eps, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, HAS_BIAS: tl.constexpr,
                 PROLOGUE: tl.constexpr, HAS_RESIDUAL: tl.constexpr, SILU_MUL: tl.constexpr, PDL: tl.constexpr,
                 WEIGHT_SCALE: tl.constexpr = "none", SCALE_BN: tl.constexpr = 1, SCALE_BK: tl.constexpr = 1,
                 CONVERT: tl.constexpr = "triton", SUM_ONCE: tl.constexpr = False, STREAM: tl.constexpr = False,
                 X_BY_THREAD: tl.constexpr = False):
    """PROLOGUE "none": x as given; "rms_norm": x = norm(x (+ residual)). SILU_MUL: W holds N gate
    rows then N up rows, and y = silu(gate) * up of the products, each rounded to the model dtype
    first as the unfused projection's output is. Each weight tile is loaded one iteration ahead,
    the first before the wait for the previous kernel (nanoserve_kernels/pdl.py): weights are
    never written while serving (Triton's pipeliner, 2-3 tiles ahead through shared memory, never
    won: bench/RESULTS.md, 2026-11-27). WEIGHT_SCALE
    "none": W in the model dtype; else W is e4m3, dequantized in registers by its float32 scales
    [rows / SCALE_BN, K / SCALE_BK]: "row" one per row (per channel), "block" per SCALE_BK columns too. CONVERT (e4m3 only) says how (_products); "ptx" and
    "bits" take W as int32 words (w_ptr, stride_w in words; K a multiple of 4). SUM_ONCE with block scales
    needs a program's rows (and its up rows) in one scale row: BLOCK_N dividing SCALE_BN, which divides N.
    STREAM: the weight tiles loaded as read once (_weight_tile). X_BY_THREAD: x loaded as each thread's columns
    of the weight tile (_x_tile)."""
    dtype = y_ptr.dtype.element_ty
    LANES: tl.constexpr = 4 if CONVERT == "ptx" or CONVERT == "bits" else 1  # columns a loaded element holds
    # the columns of a thread's 16-byte load of W (with the column tile spread over every thread, its x)
    THREAD_COLUMNS: tl.constexpr = 128 * LANES // w_ptr.dtype.element_ty.primitive_bitwidth
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    cols = tl.arange(0, BLOCK_K // LANES)
    row_ok = rows < N
    # each tile loaded one iteration ahead, the first before the wait for the previous kernel
    w = _weight_tile(w_ptr, rows, row_ok, 0, cols, K // LANES, stride_w, STREAM)
    if SILU_MUL:
        w_up = _weight_tile(w_ptr, rows + N, row_ok, 0, cols, K // LANES, stride_w, STREAM)
    else:
        w_up = w
    wait_for_previous_kernel(PDL)
    inverse_rms = 1.0
    if PROLOGUE == "rms_norm":
        inverse_rms = _inverse_rms(x_ptr, residual_ptr, residual_out_ptr, K, eps, BLOCK_K, HAS_RESIDUAL)
    # SUM_ONCE: the products add up per column (the block scales on x's columns) and each row sums once, at
    # the end, instead of a reduction (across warps) per tile
    if SUM_ONCE:
        acc = tl.zeros([BLOCK_N, BLOCK_K // LANES], tl.float32)
        up_acc = tl.zeros([BLOCK_N, BLOCK_K // LANES], tl.float32)
    else:
        acc = tl.zeros([BLOCK_N], tl.float32)
        up_acc = tl.zeros([BLOCK_N], tl.float32)
    first_row = tl.program_id(0) * BLOCK_N
    for start in range(0, K, BLOCK_K):
        x = _x_tile(x_ptr, residual_ptr, norm_ptr, start, cols, K, inverse_rms, PROLOGUE, HAS_RESIDUAL, CONVERT,
                    X_BY_THREAD, THREAD_COLUMNS, BLOCK_K)
        acc += _tile_terms(w, x, scale_ptr, first_row, rows, row_ok, start, cols, K, stride_scale, BLOCK_N, BLOCK_K,
                           SCALE_BN, SCALE_BK, WEIGHT_SCALE, CONVERT, SUM_ONCE, X_BY_THREAD, THREAD_COLUMNS)
        w = _weight_tile(w_ptr, rows, row_ok, (start + BLOCK_K) // LANES, cols, K // LANES, stride_w, STREAM)
        if SILU_MUL:
            up_acc += _tile_terms(w_up, x, scale_ptr, first_row + N, rows + N, row_ok, start, cols, K, stride_scale,
                                  BLOCK_N, BLOCK_K, SCALE_BN, SCALE_BK, WEIGHT_SCALE, CONVERT, SUM_ONCE, X_BY_THREAD,
                                  THREAD_COLUMNS)
            w_up = _weight_tile(w_ptr, rows + N, row_ok, (start + BLOCK_K) // LANES, cols, K // LANES, stride_w,
                                STREAM)
    if SUM_ONCE:
        acc = tl.sum(acc, axis=1)
        up_acc = tl.sum(up_acc, axis=1)
    if CONVERT == "bits":
        acc *= BITS_SUM_UNIT
        up_acc *= BITS_SUM_UNIT
    if WEIGHT_SCALE == "row":
        acc *= tl.load(scale_ptr + (rows // SCALE_BN) * stride_scale, mask=row_ok, other=0.0)
        if SILU_MUL:
            up_acc *= tl.load(scale_ptr + ((rows + N) // SCALE_BN) * stride_scale, mask=row_ok, other=0.0)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)
        if SILU_MUL:
            up_acc += tl.load(bias_ptr + N + rows, mask=row_ok, other=0.0).to(tl.float32)
    if SILU_MUL:  # as the compiled silu_and_mul: float32 from the rounded products, one rounding
        gate = acc.to(dtype).to(tl.float32)
        acc = silu_mul(gate, up_acc.to(dtype).to(tl.float32))
    tl.store(y_ptr + rows, acc.to(dtype), mask=row_ok)


def tiles(k: int, silu_mul: bool = False, fp8: bool = False) -> tuple[int, int, int]:
    """(BLOCK_N, BLOCK_K, warps) for W [n, k]; with silu_mul, BLOCK_N gate rows and as many up rows.
    An e4m3 W (half the bytes a tile) takes its own (bench/gemv.py --fp8 block --sweep, H100, the
    model's calls, against the 16-bit tiles): four gate and four up rows of 1,024 columns with
    SiLU-and-mul (8B 57.7 -> 50.0 us, 0.6B 6.3 -> 5.9), two rows of 2,048 on 8B down (26.3 -> 22.0),
    eight of 1,024 on its q/k/v and o (15.1 -> 15.9 and 9.3 -> 8.2: 0.4 us less together), two rows a
    program on 0.6B down (3.0 -> 2.8): an 8B layer 108 -> 96 us."""
    if fp8:
        if silu_mul:
            return 4, min(1024, triton.next_power_of_2(k)), NUM_WARPS
        if k >= LONG_K:
            return 2, 2048, NUM_WARPS
        if k >= WIDE_K:
            return 8, 1024, NUM_WARPS
        if k > 2048:
            return 2, triton.next_power_of_2(k), NUM_WARPS
    if k >= WIDE_K:
        rows, block_k, warps = 4, 4096 if k >= LONG_K else 2048, NUM_WARPS
    else:
        rows, block_k = 8 if k <= 1024 else 4, triton.next_power_of_2(k)
        warps = SILU_MUL_WARPS if silu_mul else NUM_WARPS
    return rows // 2 if silu_mul else rows, block_k, warps


def _scale_args(weight_scale: torch.Tensor | None, block: tuple[int, int] | None, block_k: int) -> dict:
    """The kernel's WEIGHT_SCALE mode and scale geometry for an e4m3 weight (none for a 16-bit one)."""
    if weight_scale is None:
        return dict(WEIGHT_SCALE="none")
    if weight_scale.shape[1] == 1:
        return dict(WEIGHT_SCALE="row", SCALE_BN=block[0])
    assert block_k % block[1] == 0, (block, block_k)  # whole scale groups in a tile
    return dict(WEIGHT_SCALE="block", SCALE_BN=block[0], SCALE_BK=block[1])


def takes_fp8(weight: torch.Tensor, block: tuple[int, int]) -> bool:
    """Whether this kernel reads the e4m3 weight of these scale blocks: their columns a power of two that
    divides the tiles (every checkpoint's 128 does), or one scale a row."""
    k = weight.shape[1]
    return block[1] >= k or (block[1] & (block[1] - 1) == 0
                             and all(tiles(k, silu_mul, fp8=True)[1] % block[1] == 0 for silu_mul in (False, True)))


CONVERTS = ("triton", "ptx", "bits")  # ways to read e4m3 (_products), measured by bench/gemv.py --fp8 block --sweep
E4M3_THREAD_COLUMNS = 16  # the e4m3 columns of a thread's 16-byte load of W


def thread_spanning_columns(num_warps: int) -> int:
    """The fewest columns of an e4m3 tile that spread over every thread of a program (32 a warp), no thread on
    a second row of it: from there X_BY_THREAD loads x as each thread multiplies it, with no exchange between
    threads (fewer, and the threads of a column share its x, which Triton then moves through shared memory)."""
    return E4M3_THREAD_COLUMNS * 32 * num_warps


def default_launch(k: int, silu_mul: bool, fp8: bool) -> dict:
    """`tiles`, read with Triton's conversion and summed a tile at a time."""
    block_n, block_k, warps = tiles(k, silu_mul, fp8)
    return dict(BLOCK_N=block_n, BLOCK_K=block_k, num_warps=warps, CONVERT="triton", SUM_ONCE=False, STREAM=False,
                X_BY_THREAD=False)


def fp8_launch(device_name: str, n: int, k: int, silu_mul: bool, block: tuple[int, int]) -> dict:
    """The e4m3 launch (BLOCK_N, BLOCK_K, num_warps, CONVERT, SUM_ONCE, STREAM, X_BY_THREAD) for W [n, k] (n: the gate
    and up rows together with silu_mul): bench/gemv.py's measured winner for this device and shape where it
    tiles these scale blocks, else the default."""
    tuned = fp8_configs.tuned(device_name, n, k, 1, silu_mul)
    if tuned is not None and tuned.backend == fp8_configs.GEMV and (
            block[1] >= k or tuned.launch["BLOCK_K"] % block[1] == 0):
        return tuned.launch
    return default_launch(k, silu_mul, fp8=True)


@functools.cache
def _device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device)


def _as_words(weight: torch.Tensor) -> torch.Tensor | None:
    """The e4m3 weight as int32 words of four columns, where its rows are whole words."""
    if weight.shape[1] % 4 or weight.stride(0) % 4 or weight.data_ptr() % 4:
        return None
    return weight.view(torch.uint8).view(torch.int32)


def _launch(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, block_n: int | None = None,
            block_k: int | None = None, num_warps: int | None = None, residual: torch.Tensor | None = None,
            residual_out: torch.Tensor | None = None, norm_weight: torch.Tensor | None = None, eps: float = 0.0,
            prologue: str = "none", silu_mul: bool = False, weight_scale: torch.Tensor | None = None,
            block: tuple[int, int] | None = None, convert: str | None = None, sum_once: bool | None = None,
            stream: bool | None = None, x_by_thread: bool | None = None) -> torch.Tensor:
    n, k = weight.shape
    assert x.shape == (1, k) and x.stride(1) == 1 and weight.stride(1) == 1
    if weight_scale is not None and x.is_cuda:
        chosen = fp8_launch(_device_name(x.device), n, k, silu_mul, block)
    else:  # 16-bit, or the interpreter
        chosen = default_launch(k, silu_mul, fp8=weight_scale is not None)
    block_n, block_k = block_n or chosen["BLOCK_N"], block_k or chosen["BLOCK_K"]
    num_warps, convert = num_warps or chosen["num_warps"], convert or chosen["CONVERT"]
    sum_once = chosen.get("SUM_ONCE", False) if sum_once is None else sum_once
    stream = chosen.get("STREAM", False) if stream is None else stream
    x_by_thread = chosen.get("X_BY_THREAD", False) if x_by_thread is None else x_by_thread
    if sum_once and weight_scale is not None and weight_scale.shape[1] > 1:  # a program's rows in one scale row
        sum_once = block[0] % block_n == 0 and (not silu_mul or n // 2 % block[0] == 0)
    w = weight
    if convert != "triton":  # four e4m3 columns a word, where the rows are whole words
        assert weight_scale is not None, convert
        w = _as_words(weight)
        w, convert = (weight, "triton") if w is None else (w, convert)
    if silu_mul:  # gate rows, then as many up rows
        assert n % 2 == 0
        n //= 2
    y = torch.empty(1, n, dtype=x.dtype, device=x.device)
    _gemv_kernel[(triton.cdiv(n, block_n),)](
        x, residual, residual_out, norm_weight, w, weight_scale, bias, y, n, k, w.stride(0),
        0 if weight_scale is None else weight_scale.stride(0), eps, BLOCK_N=block_n, BLOCK_K=block_k,
        HAS_BIAS=bias is not None, PROLOGUE=prologue, HAS_RESIDUAL=residual is not None, SILU_MUL=silu_mul,
        CONVERT=convert, SUM_ONCE=sum_once, STREAM=stream, X_BY_THREAD=x_by_thread, num_warps=num_warps,
        **_scale_args(weight_scale, block, block_k), **pdl_launch(x.device))
    return y


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, block_n: int | None = None,
         block_k: int | None = None, num_warps: int | None = None, weight_scale: torch.Tensor | None = None,
         block: tuple[int, int] | None = None, convert: str | None = None, sum_once: bool | None = None,
         stream: bool | None = None, x_by_thread: bool | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias) for one row x [1, K] (tiles chosen by `tiles`, or `fp8_launch`, unless
    given); of an e4m3 weight given its scales and their block."""
    return _launch(x, weight, bias, block_n, block_k, num_warps, weight_scale=weight_scale, block=block,
                   convert=convert, sum_once=sum_once, stream=stream, x_by_thread=x_by_thread)


def rms_norm_gemv(x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float,
                  weight: torch.Tensor, bias: torch.Tensor | None = None, silu_mul: bool = False, **tile_args
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """(F.linear(rms_norm(s), weight, bias), s) for one row, s = x + residual, or x without one; with
    `silu_mul`, silu(gate) * up of that product packed as (gate, up) instead."""
    if residual is None:
        return _launch(x, weight, bias, norm_weight=norm_weight, eps=eps, prologue="rms_norm", silu_mul=silu_mul,
                       **tile_args), x
    assert residual.shape == x.shape and residual.stride(1) == 1
    residual_out = torch.empty_like(x)  # not in place: every program reads the old residual
    return _launch(x, weight, bias, residual=residual, residual_out=residual_out, norm_weight=norm_weight,
                   eps=eps, prologue="rms_norm", silu_mul=silu_mul, **tile_args), residual_out
