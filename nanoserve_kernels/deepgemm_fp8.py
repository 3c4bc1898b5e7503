"""DeepGEMM's block-scaled W8A8 GEMM (deepseek-ai/DeepGEMM, Hopper), where bench/tune_fp8.py measured it the
fastest: decode batches of 64-256 rows of the 8B shape's projections, up to 10-20% under Triton's and torch's
scaled_mm on an H100 and an H200 (bench/RESULTS.md). Optional: bench/deepgemm.sh builds it; without it,
its table entries run torch's scaled_mm, which takes the same inputs.

It takes the activations as scaled_mm does (e4m3, per-token 1 x 128 scales stored token-minor) and the
checkpoint's 128 x 128 weight scales as they are. It compiles a kernel for each row count at its first call
(seconds, cached on disk by DeepGEMM), so the rows are padded: to their bucket up to 64 rows, above that to
a multiple of 64, its row tile (a 144-row batch computes 192 rows, not 256). The step graphs' warm-up at
start compiles each of those sizes of each shape once, and nothing compiles while serving."""
import functools
import logging
import os
from concurrent.futures import ThreadPoolExecutor

import torch

from nanoserve_kernels import deepgemm_tiles
from nanoserve_kernels.deepgemm_tiles import Tiling
from nanoserve_kernels.fp8_configs import bucket

# Decode buckets only: from 512 rows torch's scaled_mm is as fast (bench/RESULTS.md), and a prefill's
# row counts vary step to step, which would compile while serving.
MAX_ROWS = 256
MIN_PADDED_ROWS = 4  # the scales' rows, 4-byte floats in 16-byte aligned runs for the tensor-memory loads
ROW_TILE = 64

log = logging.getLogger("nanoserve.kernels")


@functools.cache
def available() -> bool:
    """Whether DeepGEMM is importable here with a compiler for its kernels (nvcc, unless told to use NVRTC)."""
    try:
        import deep_gemm
    except Exception:  # not installed, or its CUDA bindings missing: serve without it, quietly
        return False
    try:
        if not int(os.environ.get("DG_JIT_USE_NVRTC", "0")):
            deep_gemm.jit.get_nvcc_compiler()
    except Exception as err:  # installed but unable to compile: say so once, serve with scaled_mm
        log.warning("DeepGEMM is installed but cannot compile its kernels (%s): its table entries run torch's "
                    "scaled_mm", err)
        return False
    return True


def takes(rows: int, weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int], dtype: torch.dtype) -> bool:
    """Whether the GEMM takes `rows` rows through this weight: 128 x 128 blocks over whole K and N blocks, its
    scales contiguous, a bf16 output, a decode batch."""
    n, k = weight.shape
    return (block == (128, 128) and k % 128 == 0 and n % 128 == 0 and scale.is_contiguous()
            and dtype == torch.bfloat16 and 1 < rows <= MAX_ROWS)


def padded_rows(rows: int) -> int:
    return max(MIN_PADDED_ROWS, bucket(rows)) if rows <= ROW_TILE else -(-rows // ROW_TILE) * ROW_TILE


def gemm(x_quantized: torch.Tensor, x_scale: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
         tiling: Tiling | None = None) -> torch.Tensor:
    """bf16 [padded rows, N] = dequant(x) @ dequant(W).T, x in padded_rows' layout (the padding rows' outputs
    are whatever their unwritten inputs give: the caller slices them off); in `tiling` (deepgemm_tiles.py) where
    the table gives one, else in DeepGEMM's own."""
    import deep_gemm
    out = torch.empty(x_quantized.shape[0], weight.shape[0], device=x_quantized.device, dtype=torch.bfloat16)
    with deepgemm_tiles.forced(tiling):
        deep_gemm.gemm_fp8_fp8_bf16_nt((x_quantized, x_scale), (weight, scale), out)
    return out


Gemm = tuple[int, torch.Tensor, torch.Tensor, Tiling | None]  # (padded rows, weight, scale, tiling)


def compile_ahead(gemms: list[Gemm], threads: int) -> None:
    """Runs each GEMM once on zero activations, `threads` at a time, so that DeepGEMM compiles their kernels
    (or loads them from its cache) in parallel."""
    device = gemms[0][1].device

    def run(gemm_args: Gemm) -> None:
        rows, weight, scale, tiling = gemm_args
        torch.cuda.set_device(device)  # a pool thread's driver calls need the device's context current
        k = weight.shape[1]
        x_scale = torch.ones(k // 128, rows, device=device).t()  # token-minor, as quantize_activation stores them
        gemm(torch.zeros(rows, k, device=device, dtype=weight.dtype), x_scale, weight, scale, tiling)

    with ThreadPoolExecutor(threads, thread_name_prefix="deepgemm") as pool:
        list(pool.map(run, gemms))  # each error surfaces here
    torch.cuda.synchronize(device)
