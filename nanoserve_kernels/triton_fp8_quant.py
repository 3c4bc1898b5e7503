"""Dynamic activation quantization for the W8A8 GEMM: x [M, K] (16-bit) -> e4m3 values [M, K] and a
float32 scale per token and ACT_GROUP columns (nanoserve_kernels/fp8_reference.py's semantics: scale =
amax / 448 of the group, values = x / scale rounded to nearest even), bit for bit: IEEE divisions, and
the rounding made on the e4m3 grid in float32 before the (then exact) cast.

One program quantizes GROUPS groups of one row (a [GROUPS, ACT_GROUP] tile, ~1-2K values): a whole row
per program would hold 12K values of the 8B MLP in registers, a group per program would launch
hundreds of thousands of programs for a long prefill. The scales are written through strides, so the
caller picks their layout: torch's blockwise scaled_mm wants them token-minor ([K / 128, M] stored,
seen as [M, K / 128]). `quantize_groups` is the arithmetic, which the RMSNorm kernel also runs on the rows
it normalizes (triton_rms_norm.py), so that the projections after a norm need no pass of their own.
With `silu_mul` the pass reads the MLP's packed (gate, up) instead and quantizes silu(gate) * up, rounded to
the input's dtype first: bit for bit the SiLU-and-mul pass then this one, in one pass (the down projection
after a gate/up GEMM whose epilogue cannot make the SiLU-and-mul, torch's scaled_mm).
"""
import torch
import triton
import triton.language as tl

from nanoserve_kernels.fp8_reference import ACT_GROUP, AMAX_FLOOR, FP8_DTYPE, FP8_MAX
from nanoserve_kernels.triton_activation import silu_mul
from nanoserve_kernels.triton_kv_store import round_to_e4m3_grid

GROUPS = 8


@triton.jit
def quantize_groups(x, FP8_MAX: tl.constexpr, AMAX_FLOOR: tl.constexpr):
    """(values on the e4m3 grid, in float32; scale [groups]) of x [groups, group size] in float32."""
    scale = tl.maximum(tl.div_rn(tl.max(tl.abs(x), axis=1), FP8_MAX), AMAX_FLOOR)
    return round_to_e4m3_grid(tl.clamp(tl.div_rn(x, scale[:, None]), -FP8_MAX, FP8_MAX)), scale


# One compile whatever the batch: the row count, and the scale strides that follow it (token-minor
# scales of a padded batch), are not specialized on (a batch that is a multiple of 16 would compile anew).
@triton.jit(do_not_specialize=["rows", "stride_sm", "stride_sk"])
def _quantize_groups_kernel(x_ptr, q_ptr, scale_ptr, rows, k_size, stride_x, stride_q, stride_sm, stride_sk,
                            GROUP: tl.constexpr, GROUPS: tl.constexpr, FP8_MAX: tl.constexpr,
                            AMAX_FLOOR: tl.constexpr, SILU_MUL: tl.constexpr = False):
    row = tl.program_id(0)
    group = tl.program_id(1) * GROUPS + tl.arange(0, GROUPS)
    cols = group[:, None] * GROUP + tl.arange(0, GROUP)[None, :]
    ok = cols < k_size
    x_row = x_ptr + row.to(tl.int64) * stride_x
    x = tl.load(x_row + cols, mask=ok, other=0.0)
    if SILU_MUL:  # x holds (gate, up), each k_size wide: the activation rounded as the SiLU-and-mul pass stores it
        up = tl.load(x_row + k_size + cols, mask=ok, other=0.0)
        x = silu_mul(x.to(tl.float32), up.to(tl.float32)).to(x_ptr.dtype.element_ty)
    x = x.to(tl.float32)
    q, scale = quantize_groups(x, FP8_MAX, AMAX_FLOOR)
    tl.store(q_ptr + row.to(tl.int64) * stride_q + cols, q.to(q_ptr.dtype.element_ty), mask=ok)
    tl.store(scale_ptr + row * stride_sm + group * stride_sk, scale, mask=group * GROUP < k_size)


def empty_quantized(rows: int, k_size: int, device: torch.device, token_minor: bool = False,
                    padded_rows: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 [padded_rows, K], float32 scales [padded_rows, ceil(K / ACT_GROUP)]) to quantize rows into, the
    scales stored token-minor (stride (1, padded_rows)) if asked."""
    padded_rows = padded_rows or rows
    groups = triton.cdiv(k_size, ACT_GROUP)
    q = torch.empty(padded_rows, k_size, dtype=FP8_DTYPE, device=device)
    if token_minor:
        return q, torch.empty(groups, padded_rows, dtype=torch.float32, device=device).t()
    return q, torch.empty(padded_rows, groups, dtype=torch.float32, device=device)


def quantize_activation(x: torch.Tensor, token_minor: bool = False, padded_rows: int | None = None,
                        silu_mul: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 [M, K], scales [M, ceil(K / ACT_GROUP)]) of x [M, K]. `token_minor` stores the scales as
    their transpose (stride (1, rows)); `padded_rows` (>= M) sizes both outputs for that many rows, the
    rows past M left unwritten (torch's blockwise scaled_mm wants a multiple of 4). With `silu_mul`, of
    silu(gate) * up for x [M, 2K] packed as (gate, up)."""
    rows, k_size = x.shape[0], x.shape[1] // 2 if silu_mul else x.shape[1]
    assert x.stride(1) == 1 and (not silu_mul or x.shape[1] % 2 == 0)
    q, scale = empty_quantized(rows, k_size, x.device, token_minor, padded_rows)
    if rows:
        _quantize_groups_kernel[(rows, triton.cdiv(scale.shape[1], GROUPS))](
            x, q, scale, rows, k_size, x.stride(0), q.stride(0), scale.stride(0), scale.stride(1), GROUP=ACT_GROUP,
            GROUPS=GROUPS, FP8_MAX=FP8_MAX, AMAX_FLOOR=AMAX_FLOOR, SILU_MUL=silu_mul)
    return q, scale
