"""What the handshake compares, hashed: the model a rank serves (equal on every rank of a group), and
what its KV room depends on (a restarted rank with the same is offered its previous group's pool
instead of measuring memory again; worker.proto DescribeRequest)."""
import hashlib
from pathlib import Path

import torch

from worker_svc.config import WorkerConfig


def model_fingerprint(path: Path, dtype: torch.dtype, kv_dtype: torch.dtype, load_format: str,
                      quantization: str = "") -> str:
    """Equal on ranks that serve the same checkpoint (or the same dummy weights) in the same dtypes."""
    digest = hashlib.sha256((path / "config.json").read_bytes())
    for file in sorted(path.glob("*.safetensors")) if load_format != "dummy" else ():
        digest.update(f"{file.name}:{file.stat().st_size}".encode())
    digest.update(f"{dtype} kv={kv_dtype} dummy={load_format == 'dummy'} quantization={quantization}".encode())
    return digest.hexdigest()[:16]


def kv_sizing(fingerprint: str, platform: str, device: torch.device, config: WorkerConfig, max_model_len: int,
              backend: str) -> str:
    """Equal for a rank restarted with the same model, limits and memory share on the same kind of
    device with the same memory: the KV blocks it measured before fit again."""
    total_memory = torch.cuda.mem_get_info(device)[1] if device.type == "cuda" else 0
    parts = (fingerprint, platform, total_memory, backend, max_model_len, config.rank, config.tensor_parallel_size,
             config.block_size, config.max_num_seqs, config.max_num_batched_tokens, config.gpu_memory_utilization,
             config.num_kv_blocks, config.cpu_kv_cache_gb, config.enforce_eager)
    return hashlib.sha256(repr(parts).encode()).hexdigest()[:16]
