"""Joins this worker process to its tensor-parallel group (NCCL on GPU, gloo on CPU)."""
import logging
from datetime import timedelta

import torch
import torch.distributed as dist

from worker_svc.config import WorkerConfig

log = logging.getLogger("nanoserve.worker")


def uses_cuda(config: WorkerConfig) -> bool:
    return config.device == "cuda" or (config.device == "auto" and torch.cuda.is_available())


def init_distributed(config: WorkerConfig) -> None:
    """Every rank blocks here until the whole group has met (world size 1 skips it)."""
    if config.tensor_parallel_size == 1:
        return
    if not 0 <= config.rank < config.tensor_parallel_size:
        raise SystemExit(f"--rank {config.rank} is outside 0..{config.tensor_parallel_size - 1}")
    cuda = uses_cuda(config)
    if cuda:
        torch.cuda.set_device(config.rank % torch.cuda.device_count())
    log.info("rank %d waiting for %d ranks at %s", config.rank, config.tensor_parallel_size,
             config.dist_init_addr)
    dist.init_process_group("nccl" if cuda else "gloo", init_method=f"tcp://{config.dist_init_addr}",
                            rank=config.rank, world_size=config.tensor_parallel_size,
                            timeout=timedelta(minutes=10))
    log.info("rank %d joined its group", config.rank)
