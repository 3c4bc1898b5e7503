"""What one worker rank is asked to run: the model, its place in the tensor-parallel group, memory."""
from dataclasses import dataclass


@dataclass
class WorkerConfig:
    model: str                              # checkpoint directory (config.json + *.safetensors)
    dtype: str = "auto"                     # auto (from config.json), float32, bfloat16, float16
    device: str = "auto"                    # auto (cuda when available), cuda, cpu
    rank: int = 0
    tensor_parallel_size: int = 1
    dist_init_addr: str = "127.0.0.1:29500"  # where the ranks meet (torch.distributed TCP store)
    block_size: int = 256                   # tokens per KV block
    max_num_seqs: int = 256                 # largest decode batch (CUDA graphs are captured up to it)
    max_num_batched_tokens: int = 16384     # largest number of tokens in one step
    max_model_len: int = 0                  # 0: the model's max_position_embeddings
    gpu_memory_utilization: float = 0.9     # fraction of GPU memory the worker may use in all
    num_kv_blocks: int = 0                  # 0: size from free memory; > 0 forces the count
    cpu_kv_cache_gb: float = 1.0            # KV memory on CPU, where there is no free-memory probe
    enforce_eager: bool = False             # no CUDA graphs
    attention_backend: str = "auto"         # auto, flash-attn, triton, torch
    seed: int = 0
