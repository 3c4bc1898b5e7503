"""The matrix-vector product of batch-1 decode: y [1, N] = x [1, K] @ W [N, K]^T (+ bias).

At batch 1 a decode step is a chain of matrix-vector products whose cost is reading each weight
once. cuBLAS runs them as GEMM tiles (split-K with a reduction pass on some shapes), at 0.7-0.8
TB/s on the Qwen3-0.6B shape's o and down projections (bench/gemv.py). Here each program owns
BLOCK_N whole rows of W, loads them BLOCK_K columns at a time, multiplies by x (a few KB, read
from L2 by every program) and reduces in float32: W is read once, in long contiguous rows, by
enough programs to keep every multiprocessor streaming, with no second pass. From two rows on,
cuBLAS's tiles reuse each weight load across the rows and win (bench/gemv.py), so only one takes this path.
"""
import torch
import triton
import triton.language as tl

MAX_ROWS = 1
# Two rows of up to 2,048 columns a program, 4 warps: within 4% of the best tile on each projection
# of the 0.6B and 8B shapes but the 0.6B down projection (9%) (bench/gemv.py --sweep, weights from
# memory, H100); larger tiles leave too few programs on the narrow projections, and 8 warps lose
# on the 0.6B ones.
BLOCK_N = 2
MAX_BLOCK_K = 2048


@triton.jit
def _gemv_kernel(x_ptr, w_ptr, bias_ptr, y_ptr, N, K, stride_w, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 HAS_BIAS: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    cols = tl.arange(0, BLOCK_K)
    row_ok = rows < N
    acc = tl.zeros([BLOCK_N], tl.float32)
    for start in range(0, K, BLOCK_K):
        col_ok = start + cols < K
        w = tl.load(w_ptr + rows[:, None].to(tl.int64) * stride_w + start + cols[None, :],
                    mask=row_ok[:, None] & col_ok[None, :], other=0.0)
        x = tl.load(x_ptr + start + cols, mask=col_ok, other=0.0)
        acc += tl.sum(w.to(tl.float32) * x.to(tl.float32)[None, :], axis=1)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)
    tl.store(y_ptr + rows, acc.to(y_ptr.dtype.element_ty), mask=row_ok)


def tiles(n: int, k: int) -> tuple[int, int]:
    """(BLOCK_N, BLOCK_K) for W [n, k]."""
    return BLOCK_N, min(triton.next_power_of_2(k), MAX_BLOCK_K)


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, block_n: int | None = None,
         block_k: int | None = None, num_warps: int = 4) -> torch.Tensor:
    """F.linear(x, weight, bias) for one row x [1, K] (tiles chosen by `tiles` unless given)."""
    n, k = weight.shape
    assert x.shape == (1, k) and x.stride(1) == 1 and weight.stride(1) == 1
    if block_n is None or block_k is None:
        block_n, block_k = tiles(n, k)
    y = torch.empty(1, n, dtype=x.dtype, device=x.device)
    _gemv_kernel[(triton.cdiv(n, block_n),)](x, weight, bias, y, n, k, weight.stride(0), BLOCK_N=block_n,
                                             BLOCK_K=block_k, HAS_BIAS=bias is not None, num_warps=num_warps)
    return y
