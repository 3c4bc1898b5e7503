"""RMSNorm of rows, with the residual add of the next block fused in: one Triton program a row.

The model's norms were the worker's one use of torch.compile, and compiling them (a variant per
dtype, layout and size-1 batch, dynamo's tracing included) took ~13 s of every worker start on an
H200, restarts included, on-disk caches or not, where a cached Triton kernel loads in milliseconds.
The rounding is the compiled function's, which the gemv's norm prologue (triton_gemv.py) also
follows: the statistics from the unrounded float32 sum s = x + residual, s stored in the model dtype
as the next residual stream and normalized as stored, then weight x normalized in float32 with one
rounding.
"""
import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice


@triton.jit
def _rms_norm_kernel(x_ptr, residual_ptr, weight_ptr, out_ptr, residual_out_ptr, n, eps, stride_x, stride_residual,
                     stride_out, stride_residual_out, HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    ok = cols < n
    s = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        s += tl.load(residual_ptr + row * stride_residual + cols, mask=ok, other=0.0).to(tl.float32)
        stored = s.to(residual_out_ptr.dtype.element_ty)
        tl.store(residual_out_ptr + row * stride_residual_out + cols, stored, mask=ok)
        x = stored.to(tl.float32)
    else:
        x = s
    inverse_rms = libdevice.rsqrt(tl.sum(s * s, axis=0) / n + eps)
    weight = tl.load(weight_ptr + cols, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_out + cols, (weight * (x * inverse_rms)).to(out_ptr.dtype.element_ty), mask=ok)


def _warps(block: int) -> int:
    """Enough threads that a row of the widest Qwen3 hidden size (8,192 columns) stays in registers."""
    return 4 if block <= 1024 else 8 if block <= 4096 else 16


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
             ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """norm(x) over the last dimension; given the residual stream, (norm(x + residual), x + residual)."""
    n = x.shape[-1]
    rows = x.reshape(-1, n)
    assert rows.stride(-1) == 1 and weight.shape == (n,)
    out = torch.empty(rows.shape, dtype=torch.promote_types(weight.dtype, x.dtype), device=x.device)
    if residual is not None:
        residual_rows = residual.reshape(-1, n)
        residual_out = torch.empty(rows.shape, dtype=torch.promote_types(x.dtype, residual.dtype), device=x.device)
    else:
        residual_rows = residual_out = rows  # not read: HAS_RESIDUAL is off
    block = triton.next_power_of_2(n)
    if rows.shape[0]:
        _rms_norm_kernel[(rows.shape[0],)](
            rows, residual_rows, weight, out, residual_out, n, eps, rows.stride(0), residual_rows.stride(0),
            out.stride(0), residual_out.stride(0), HAS_RESIDUAL=residual is not None, BLOCK=block,
            num_warps=_warps(block))
    if residual is None:
        return out.view(x.shape)
    return out.view(x.shape), residual_out.view(x.shape)
