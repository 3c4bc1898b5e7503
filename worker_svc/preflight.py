"""What a worker checks before it takes its port or loads anything, so a configuration that cannot
run fails at start with one line naming the flag, never at the first request: the rank is one of
its group's, the device exists, the attention backend can read the KV cache and run on the device,
the checkpoint directory has its config.json."""
import importlib
import os
from pathlib import Path

import torch

from nanoserve.checkpoint import CONFIG_FILE, CheckpointError, check_files
from nanoserve_kernels.backend import FLASH_ATTN_NO_FP8
from worker_svc.config import WorkerConfig
from worker_svc.distributed import uses_cuda


class StartupError(Exception):
    """A worker configuration that cannot serve; the message says which flag and why."""


def check_startup(config: WorkerConfig) -> None:
    if not 0 <= config.rank < config.tensor_parallel_size:
        raise StartupError(f"--rank {config.rank} is outside 0..{config.tensor_parallel_size - 1} "
                           f"(--tensor-parallel-size {config.tensor_parallel_size})")
    _check_device(config.device)
    if config.attention_backend == "flash-attn" and config.kv_cache_dtype == "fp8":
        raise StartupError(FLASH_ATTN_NO_FP8)
    _check_backend(config.attention_backend, "cuda" if uses_cuda(config) else "cpu")
    if Path(config.model).exists():  # anything else is left to the loader (e.g. a Hub id)
        try:
            check_files(config.model, (CONFIG_FILE,), "--model")
        except CheckpointError as err:
            raise StartupError(str(err)) from None


def _check_device(device: str) -> None:
    if device != "cuda" or torch.cuda.is_available():
        return
    why = (f"this torch {torch.__version__} is a CPU-only build" if torch.version.cuda is None else
           f"torch {torch.__version__} (CUDA {torch.version.cuda}) finds no usable GPU: no driver, or none visible "
           f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')})")
    raise StartupError(f"--device cuda, but CUDA is not available: {why}; use --device cpu, or auto")


def _check_backend(backend: str, device: str) -> None:
    if backend == "flash-attn":
        if device != "cuda":
            raise StartupError("--attention-backend flash-attn runs on CUDA only; on CPU use torch (or auto)")
        _require_module("flash_attn", "--attention-backend flash-attn needs the flash_attn package")
    elif backend == "triton":
        if device != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
            raise StartupError("--attention-backend triton runs on CUDA (or under TRITON_INTERPRET=1); "
                               "on CPU use torch (or auto)")
        _require_module("triton", "--attention-backend triton needs the triton package")


def _require_module(name: str, need: str) -> None:
    try:
        importlib.import_module(name)
    except Exception as err:  # not installed, or built for another torch / CUDA
        raise StartupError(f"{need}, which cannot be loaded here ({type(err).__name__}: {err}); "
                           "use --attention-backend auto") from None
