"""RMSNorm of rows, with the residual add of the next block fused in: one Triton program a row.

The model's norms were the worker's one use of torch.compile, and compiling them (a variant per
dtype, layout and size-1 batch, dynamo's tracing included) took ~13 s of every worker start on an
H200, restarts included, on-disk caches or not, where a cached Triton kernel loads in milliseconds.
The rounding is the compiled function's, which the gemv's norm prologue (triton_gemv.py) also
follows: the statistics from the unrounded float32 sum s = x + residual, s stored in the model dtype
as the next residual stream and normalized as stored, then weight x normalized in float32 with one
rounding.

Before a W8A8 projection (nanoserve_kernels/fp8_linear.py) the kernel also quantizes the normalized row,
rounded as above, per token and ACT_GROUP columns (triton_fp8_quant.quantize_groups), and writes the e4m3
values and scales instead of the 16-bit row: the projection's activations then need no pass of their own.
"""
import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from nanoserve_kernels.fp8_reference import ACT_GROUP, AMAX_FLOOR, FP8_MAX
from nanoserve_kernels.triton_fp8_quant import empty_quantized, quantize_groups


@triton.jit
def _rms_norm_kernel(x_ptr, residual_ptr, weight_ptr, out_ptr, residual_out_ptr, scale_ptr, n, eps, stride_x,
                     stride_residual, stride_out, stride_residual_out, stride_sm, stride_sk,
                     HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr, GROUP: tl.constexpr = 0,
                     FP8_MAX: tl.constexpr = 448.0, AMAX_FLOOR: tl.constexpr = 1e-12):
    """GROUP: out is e4m3, the normalized row (rounded to x's dtype) quantized per GROUP columns, each
    group's scale stored at scale_ptr (strides per row and per group)."""
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
    normed = weight * (x * inverse_rms)
    if GROUP:
        normed = normed.to(x_ptr.dtype.element_ty).to(tl.float32)
        q, scale = quantize_groups(tl.reshape(normed, [BLOCK // GROUP, GROUP]), FP8_MAX, AMAX_FLOOR)
        tl.store(out_ptr + row * stride_out + cols, tl.reshape(q, [BLOCK]).to(out_ptr.dtype.element_ty), mask=ok)
        groups = tl.arange(0, BLOCK // GROUP)
        tl.store(scale_ptr + row * stride_sm + groups * stride_sk, scale, mask=groups * GROUP < n)
    else:
        tl.store(out_ptr + row * stride_out + cols, normed.to(out_ptr.dtype.element_ty), mask=ok)


def _warps(block: int) -> int:
    """Enough threads that a row of the widest Qwen3 hidden size (8,192 columns) stays in registers."""
    return 4 if block <= 1024 else 8 if block <= 4096 else 16


def _normalize(rows: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None,
               out: torch.Tensor, scale: torch.Tensor | None = None) -> torch.Tensor | None:
    """Runs the kernel over rows [M, n] into out (e4m3, with its scales, if given); x + residual, given one."""
    n = rows.shape[1]
    assert rows.stride(1) == 1 and weight.shape == (n,)
    if residual is not None:
        residual_rows = residual.reshape(-1, n)
        residual_out = torch.empty(rows.shape, dtype=torch.promote_types(rows.dtype, residual.dtype),
                                   device=rows.device)
    else:
        residual_rows = residual_out = rows  # not read: HAS_RESIDUAL is off
    block = max(triton.next_power_of_2(n), ACT_GROUP if scale is not None else 1)
    if rows.shape[0]:
        _rms_norm_kernel[(rows.shape[0],)](
            rows, residual_rows, weight, out, residual_out, scale, n, eps, rows.stride(0), residual_rows.stride(0),
            out.stride(0), residual_out.stride(0), 0 if scale is None else scale.stride(0),
            0 if scale is None else scale.stride(1), HAS_RESIDUAL=residual is not None, BLOCK=block,
            GROUP=0 if scale is None else ACT_GROUP, FP8_MAX=FP8_MAX, AMAX_FLOOR=AMAX_FLOOR, num_warps=_warps(block))
    return None if residual is None else residual_out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
             ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """norm(x) over the last dimension; given the residual stream, (norm(x + residual), x + residual)."""
    rows = x.reshape(-1, x.shape[-1])
    out = torch.empty(rows.shape, dtype=torch.promote_types(weight.dtype, x.dtype), device=x.device)
    residual_out = _normalize(rows, weight, eps, residual, out)
    if residual is None:
        return out.view(x.shape)
    return out.view(x.shape), residual_out.view(x.shape)


def rms_norm_fp8(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None,
                 token_minor: bool = False, padded_rows: int | None = None
                 ) -> tuple[tuple[torch.Tensor, torch.Tensor], torch.Tensor | None]:
    """((e4m3, scales) of norm(x (+ residual)) for x [M, K], in the arithmetic of quantize_activation (with these
    `token_minor` and `padded_rows`) on rms_norm's output; x + residual, or None without a residual). Compiled,
    the two variants may sum a row's squares in different orders: a rare element lands one e4m3 step away."""
    assert x.dim() == 2 and weight.dtype == x.dtype  # rounded to x's dtype, as rms_norm's output would be
    q, scale = empty_quantized(x.shape[0], x.shape[1], x.device, token_minor, padded_rows)
    return (q, scale), _normalize(x, weight, eps, residual, q, scale)
