"""How each FP8 linear runs, by weight shape and batch-size bucket: weight-only or W8A8, through our
Triton GEMM or torch's blockwise scaled_mm, and the Triton launch shape. bench/tune_fp8.py measures
every candidate on the GPU and writes the fastest per (N, K, M bucket) into fp8_configs.json (beside
this file), one table per device name, with the device's architecture under ARCHITECTURES. A bucket its
device's table lacks takes the entry of another device of the same architecture (the same multiprocessors
and shared memory run the same launches: an H200 with the H100's choices), else the default's. Bucket
1 is the matrix-vector kernel's (backend GEMV: its tiles and e4m3 conversion), written by bench/gemv.py.

Beside each choice the tuners record its time ("us") and that of the same layer in bf16 ("bf16_us": the
weight dequantized once, run by the 16-bit path), so that `served_in_bf16` can say where FP8 does not pay.
"""
import functools
import json
from dataclasses import dataclass, field
from pathlib import Path

CONFIG_FILE = Path(__file__).with_name("fp8_configs.json")
MAX_BUCKET = 8192  # larger batches take this bucket's choice
ARCHITECTURES = "architectures"  # the file's {device name: "sm_XY"} beside the device tables
WEIGHT_ONLY = "weight_only"
W8A8 = "w8a8"
TRITON, SCALED_MM, DEEPGEMM, GEMV = "triton", "scaled_mm", "deepgemm", "gemv"
# The batch sizes a decode step runs (--max-num-seqs defaults to 256), over which served_in_bf16 compares.
DECODE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)


@dataclass(frozen=True)
class Fp8Choice:
    mode: str        # WEIGHT_ONLY or W8A8
    backend: str     # TRITON, or SCALED_MM or DEEPGEMM (W8A8 with 128 x 128 weight blocks only)
    launch: dict = field(default_factory=dict)  # the Triton kernel's BLOCK_M/N/K, GROUP_M, num_warps/stages
    us: float | None = None       # its measured time, microseconds a call
    bf16_us: float | None = None  # the same layer's in bf16, measured beside it


def bucket(rows: int) -> int:
    """The batch-size bucket of `rows`: the next power of two, at most MAX_BUCKET."""
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


@functools.cache
def _current_device() -> tuple[str, str] | None:
    """The current CUDA device's name and architecture (as ARCHITECTURES records it); None without CUDA."""
    import torch
    if not torch.cuda.is_available():
        return None
    major, minor = torch.cuda.get_device_capability()
    return torch.cuda.get_device_name(), f"sm_{major}{minor}"


def this_device_table(tables: dict) -> dict:
    """The current CUDA device's table in `tables` (for a tuner to fill), its architecture recorded."""
    name, arch = _current_device()
    tables.setdefault(ARCHITECTURES, {})[name] = arch
    return tables.setdefault(name, {})


def _table_names(device_name: str, tables: dict) -> list[str]:
    """The tables a choice for `device_name` is looked up in: its own, then those of the devices of its
    architecture (recorded in the file, or the current device's), by name."""
    recorded, current = tables.get(ARCHITECTURES, {}), _current_device()
    arch = recorded.get(device_name)
    if arch is None and current is not None and current[0] == device_name:
        arch = current[1]
    return [device_name] + sorted(name for name, other in recorded.items() if other == arch and name != device_name)


@functools.cache
def _committed_table_names(device_name: str) -> tuple[str, ...]:
    """_table_names in the committed file, once a device (an eager step asks for every projection)."""
    return tuple(_table_names(device_name, _tables()))


def tuned(device_name: str, n: int, k: int, rows_bucket: int, silu_mul: bool = False,
          tables: dict | None = None) -> Fp8Choice | None:
    """The measured choice for this shape and bucket on this device, else on one of its architecture, if any."""
    names = _committed_table_names(device_name) if tables is None else _table_names(device_name, tables)
    tables = _tables() if tables is None else tables
    for name in names:
        entry = tables.get(name, {}).get(shape_key(n, k, silu_mul), {}).get(str(rows_bucket))
        if entry:
            return Fp8Choice(**entry)
    return None


def choose(device_name: str, n: int, k: int, rows: int, silu_mul: bool = False) -> Fp8Choice:
    """The tuned choice for this device and shape at `rows` (> 1) rows, else the default."""
    return tuned(device_name, n, k, bucket(rows), silu_mul) or default_choice(bucket(rows))


def served_in_bf16(device_name: str, n: int, k: int, silu_mul: bool = False, tables: dict | None = None) -> bool:
    """Whether the layer runs faster dequantized: with both times measured at every decode bucket, one call
    at each in bf16 takes less in all than one in FP8 at each. A sum, not a bucket-by-bucket vote, so that
    each batch size weighs by its time (the large decode batches of a loaded server most) and a near-tie
    in one small bucket does not decide. Served in bf16, the layer runs bf16 at prefill too. Unmeasured
    shapes stay in FP8."""
    choices = [tuned(device_name, n, k, rows_bucket, silu_mul, tables) for rows_bucket in DECODE_BUCKETS]
    if any(c is None or c.us is None or c.bf16_us is None for c in choices):
        return False
    return sum(c.bf16_us for c in choices) < sum(c.us for c in choices)
