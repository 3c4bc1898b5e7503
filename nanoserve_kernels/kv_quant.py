"""FP8 (e4m3) KV cache: what is stored, and the torch semantics every backend reproduces.

Values are stored as float8_e4m3fn with one float32 scale per (token, KV head), computed when the
token is stored: scale = amax(|row|) / 448 over the head's head_dim values, stored = row / scale
rounded to nearest even, read back as stored * scale. Why per token-head, computed at store time:
  - no calibration data is needed and nothing clips: every row uses e4m3's full range, whatever
    the model's activation sizes (a per-tensor scale of 1.0, the usual uncalibrated default,
    clips K/V beyond 448 and drops small heads into e4m3's coarse subnormals);
  - a new token never changes an older token's scale, so prefix-cached, preempted and recomputed
    blocks hold the same bytes whichever step stored them;
  - it costs 4 bytes per 128-byte row at head_dim 128 (3% of the cache and of decode's reads);
    per-head or per-tensor scales would save that but need the calibration above.

Scales lie per block, head-major: [num_blocks, kv_heads, block_size], so the block_size scales
one KV head reads from one block are contiguous.
"""
import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # e4m3's largest finite value
AMAX_FLOOR = 1e-30  # an all-zero row gets a tiny scale, not 0 (no 0 / 0)
KV_CACHE_DTYPES = ("auto", "fp8")


def kv_cache_dtype(name: str, model_dtype: torch.dtype) -> torch.dtype:
    """The storage dtype of --kv-cache-dtype `name`: auto = the model's own dtype."""
    if name not in KV_CACHE_DTYPES:
        raise ValueError(f"--kv-cache-dtype {name!r}: expected one of {', '.join(KV_CACHE_DTYPES)}")
    return FP8_DTYPE if name == "fp8" else model_dtype


def is_quantized(dtype: torch.dtype) -> bool:
    return dtype == FP8_DTYPE


def bytes_per_row(dtype: torch.dtype, head_dim: int) -> int:
    """Cache bytes one token's K (or V) of one KV head takes, its scale included."""
    return head_dim * dtype.itemsize + (torch.float32.itemsize if is_quantized(dtype) else 0)


def quantize(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """rows [..., head_dim] -> (e4m3 values [..., head_dim], float32 scales [...])."""
    rows = rows.float()
    # A tensor divisor, not the float: torch on CUDA multiplies by the float's reciprocal instead
    # of dividing, one ulp off the IEEE quotient the store kernel computes for some scales.
    scales = rows.abs().amax(dim=-1).clamp_min(AMAX_FLOOR) / torch.full((), FP8_MAX, device=rows.device)
    values = (rows / scales[..., None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return values, scales


def dequantize(values: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """The float32 rows that e4m3 values [..., head_dim] with scales [...] stand for."""
    return values.float() * scales[..., None]


def scales_shape(num_blocks: int, block_size: int, kv_heads: int) -> tuple[int, int, int]:
    """One layer's K (or V) scale cache (float32), in the layout above."""
    return num_blocks, kv_heads, block_size


def slot_major(scales: torch.Tensor) -> torch.Tensor:
    """A scale cache viewed as [num_blocks, block_size, kv_heads]: indexed like the values."""
    return scales.transpose(1, 2)
