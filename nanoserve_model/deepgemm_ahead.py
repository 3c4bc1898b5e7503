"""DeepGEMM's kernels compiled ahead at start, several at a time.

DeepGEMM compiles a kernel for each (rows, N, K) at its first call, ~3 s with nvcc, and keeps it in its disk
cache (nanoserve_kernels/deepgemm_fp8.py). Left to the KV profile and the graph warm-up, which reach them one
step size after another, an 8B model's (four projections at up to eight padded row counts) compile one by
one on a cold cache: most of a minute and a half of a first start. Here the kernels that the FP8 launch
table gives to DeepGEMM, at every row count it takes, are compiled together on a few threads (nvcc runs
outside the GIL) right after the weights load. A failure here is only logged: the warm-up then compiles
what is missing, as it would without this."""
import logging
import os
import time

import torch
from torch import nn

from nanoserve_kernels.deepgemm_fp8 import Gemm
from nanoserve_model.fp8_bf16_layers import GATE_UP, fp8_linears

log = logging.getLogger("nanoserve.worker")
# nvcc processes at once: each takes a core and ~1 GB while it compiles CUTLASS's templates
MAX_THREADS = 8


def deepgemm_gemms(model: nn.Module, dtype: torch.dtype) -> list[Gemm]:
    """deepgemm_fp8.compile_ahead's (padded rows, weight, scale, tiling) for each distinct (padded rows, N, K,
    tiling) that the model's FP8 linear layers run on DeepGEMM, at any row count the table gives it."""
    from nanoserve_kernels import deepgemm_fp8
    from nanoserve_kernels.fp8_configs import DEEPGEMM
    from nanoserve_kernels.fp8_linear import choice, takes_deepgemm
    found: dict[tuple, Gemm] = {}
    shapes = {(tuple(layer.weight.shape), name.endswith(GATE_UP)): layer for name, layer in fp8_linears(model)}
    for (shape, silu_mul), layer in shapes.items():
        for rows in range(2, deepgemm_fp8.MAX_ROWS + 1):
            chosen = choice(rows, layer.weight, silu_mul)
            if chosen.backend == DEEPGEMM and takes_deepgemm(rows, layer.weight, layer.weight_block,
                                                             layer.weight_scale, dtype):
                padded, tiling = deepgemm_fp8.padded_rows(rows), chosen.launch.get(DEEPGEMM)
                key = (padded, *shape, tuple(sorted(tiling.items())) if tiling else None)
                found.setdefault(key, (padded, layer.weight, layer.weight_scale, tiling))
    return list(found.values())


def compile_deepgemm_ahead(model: nn.Module, dtype: torch.dtype, rank: int) -> None:
    """Compiles (or loads from DeepGEMM's cache) every kernel deepgemm_gemms names, and says so in one line."""
    from nanoserve_kernels import deepgemm_fp8
    if not deepgemm_fp8.available():
        return
    started = time.perf_counter()
    try:
        gemms = deepgemm_gemms(model, dtype)
        if not gemms:  # the table gives DeepGEMM none of this model's layers
            return
        deepgemm_fp8.compile_ahead(gemms, max(1, min(MAX_THREADS, (os.cpu_count() or 2) // 2)))
    except Exception as err:  # the warm-up compiles them one by one instead
        log.warning("rank %d: DeepGEMM's kernels not compiled ahead (%s: %s); the warm-up compiles them", rank,
                    type(err).__name__, err)
        return
    log.info("rank %d: DeepGEMM: %d kernels ready in %.1fs", rank, len(gemms), time.perf_counter() - started)
