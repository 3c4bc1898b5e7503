"""How each FP8 linear runs, by weight shape and batch-size bucket: weight-only or W8A8, through our
Triton GEMM or torch's blockwise scaled_mm, and the Triton launch shape. bench/tune_fp8.py measures
every candidate on the GPU and writes the fastest per (N, K, M bucket) into fp8_configs.json (beside
this file), one table per device name; shapes or devices it has not seen take DEFAULT's choice.
"""
import functools
import json
from dataclasses import dataclass, field
from pathlib import Path

CONFIG_FILE = Path(__file__).with_name("fp8_configs.json")
MAX_BUCKET = 8192  # larger batches take this bucket's choice
WEIGHT_ONLY = "weight_only"
W8A8 = "w8a8"
TRITON, SCALED_MM = "triton", "scaled_mm"


@dataclass(frozen=True)
class Fp8Choice:
    mode: str        # WEIGHT_ONLY or W8A8
    backend: str     # TRITON or SCALED_MM (W8A8 with 128 x 128 weight blocks only)
    launch: dict = field(default_factory=dict)  # the Triton kernel's BLOCK_M/N/K, GROUP_M, num_warps/stages


def bucket(rows: int) -> int:
    """The batch-size bucket of `rows` (> 1): the next power of two, at most MAX_BUCKET."""
    return min(MAX_BUCKET, 1 << (rows - 1).bit_length())


def shape_key(n: int, k: int, silu_mul: bool) -> str:
    return f"{n}x{k}{'+silu' if silu_mul else ''}"


def default_choice(rows_bucket: int) -> Fp8Choice:
    """Before tuning: weight-only up to 64 rows (one row block reads each weight tile once), W8A8 above.
    Up to 256 rows the column blocks are narrow, so that the 8B shape's 4,096-row projections still
    spread over every multiprocessor (128 programs of 32 rows at 64 rows and under)."""
    if rows_bucket <= 64:
        return Fp8Choice(WEIGHT_ONLY, TRITON, dict(BLOCK_M=max(16, rows_bucket), BLOCK_N=32, BLOCK_K=128, GROUP_M=8,
                                                   num_warps=4, num_stages=4))
    if rows_bucket <= 256:
        return Fp8Choice(W8A8, TRITON, dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=128, GROUP_M=8, num_warps=4,
                                            num_stages=4))
    return Fp8Choice(W8A8, TRITON, dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=128, GROUP_M=8, num_warps=8, num_stages=3))


@functools.cache
def _tables() -> dict:
    return json.loads(CONFIG_FILE.read_text()) if CONFIG_FILE.exists() else {}


def choose(device_name: str, n: int, k: int, rows: int, silu_mul: bool = False) -> Fp8Choice:
    """The tuned choice for this device and shape at `rows` rows, else the default."""
    entry = _tables().get(device_name, {}).get(shape_key(n, k, silu_mul), {}).get(str(bucket(rows)))
    return Fp8Choice(**entry) if entry else default_choice(bucket(rows))
