"""The MLP's gate/up projection with SiLU-and-mul in its epilogue, for decode batches of 2 to 128 rows.

Unfused, cuBLAS writes [rows, 2 d] of gate and up, and a second kernel reads them back to write
silu(gate) * up [rows, d]: one more launch and three more passes over rows x d values a layer. Here a
program's weight tile is BLOCK_N gate rows stacked on the BLOCK_N up rows of the same columns, so its
accumulator holds both halves of its outputs. Up to 128 rows the weight read bounds this GEMM and the
kernel keeps pace with cuBLAS; past that cuBLAS's compute-bound tiles win by more than the fusion saves
(bench/RESULTS.md, session 12), so larger batches keep the separate kernels. The rounding is the unfused
path's: gate and up rounded to the model dtype, SiLU-and-mul in float32 from them, one rounding.
"""
import torch
import triton
import triton.language as tl

from nanoserve_kernels.triton_activation import silu_mul

MAX_ROWS = 128
MAX_BLOCK_N, MAX_BLOCK_K = 64, 128


def tiles(rows: int, k_size: int) -> dict:
    """Launch shape by batch size and row length: the best of a sweep at the Qwen3-0.6B and 8B shapes
    (bench/RESULTS.md, session 12, H100). Blocks of rows as tall as the batch, so each weight tile is
    read once; at 65 to 128 rows a short row (0.6B's 1,024) wants deeper K tiles and 8 warps."""
    shape = dict(BLOCK_N=32, BLOCK_K=128, num_warps=4, num_stages=4)
    if rows <= 64:
        return dict(shape, BLOCK_M=16 if rows <= 16 else 32 if rows <= 32 else 64)
    if k_size >= 4096:
        return dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=64, num_warps=4, num_stages=3)
    return dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=128, num_warps=8, num_stages=4)


@triton.jit(do_not_specialize=["rows"])  # one compile a tile shape, whatever the batch size
def _gate_up_silu_kernel(x_ptr, w_ptr, out_ptr, rows, d, k_size, stride_x, stride_w, stride_out,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    row_blocks = tl.cdiv(rows, BLOCK_M)
    # Row blocks fastest: the programs that share a weight tile run together, so memory serves it once.
    row_block, col_block = tl.program_id(0) % row_blocks, tl.program_id(0) // row_blocks
    row = row_block * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = row < rows
    pair = tl.arange(0, 2 * BLOCK_N)
    weight_row = col_block * BLOCK_N + pair % BLOCK_N + (pair // BLOCK_N) * d  # gate rows, then their up rows
    k = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + row[:, None].to(tl.int64) * stride_x + k[None, :]
    w_ptrs = w_ptr + weight_row[:, None].to(tl.int64) * stride_w + k[None, :]
    acc = tl.zeros([BLOCK_M, 2 * BLOCK_N], tl.float32)
    for start in range(0, k_size, BLOCK_K):
        x = tl.load(x_ptrs + start, mask=row_ok[:, None], other=0.0)
        acc = tl.dot(x, tl.trans(tl.load(w_ptrs + start)), acc)
    halves = acc.to(out_ptr.dtype.element_ty).to(tl.float32)
    gate, up = tl.split(tl.permute(tl.reshape(halves, [BLOCK_M, 2, BLOCK_N]), (0, 2, 1)))
    col = col_block * BLOCK_N + tl.arange(0, BLOCK_N)
    tl.store(out_ptr + row[:, None].to(tl.int64) * stride_out + col[None, :],
             silu_mul(gate, up).to(out_ptr.dtype.element_ty), mask=row_ok[:, None])


def takes(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether x [rows, K] times the packed (gate, up) weight [2 d, K] runs here: 16-bit floats on CUDA
    (float32 stays on cuBLAS: Triton's dots would round it to TF32), 2 to MAX_ROWS rows, K and d
    multiples of the largest tiles."""
    return (x.is_cuda and x.dim() == 2 and x.stride(1) == 1 and weight.is_contiguous()
            and x.dtype in (torch.bfloat16, torch.float16) and weight.dtype == x.dtype
            and 2 <= x.shape[0] <= MAX_ROWS and x.shape[1] == weight.shape[1]
            and x.shape[1] % MAX_BLOCK_K == 0 and weight.shape[0] % (2 * MAX_BLOCK_N) == 0)


def gate_up_silu(x: torch.Tensor, weight: torch.Tensor, launch: dict | None = None) -> torch.Tensor:
    """silu(x @ gate.T) * (x @ up.T) [rows, d], the weight [2 d, K] packed as (gate, up); `launch`
    overrides tiles(rows, K) (tests)."""
    rows, k_size = x.shape
    d = weight.shape[0] // 2
    launch = launch or tiles(rows, k_size)
    assert k_size % launch["BLOCK_K"] == 0 and d % launch["BLOCK_N"] == 0, (k_size, d, launch)
    out = torch.empty(rows, d, dtype=x.dtype, device=x.device)
    grid = (triton.cdiv(rows, launch["BLOCK_M"]) * (d // launch["BLOCK_N"]),)
    _gate_up_silu_kernel[grid](x, weight, out, rows, d, k_size, x.stride(0), weight.stride(0), out.stride(0),
                               **launch)
    return out
