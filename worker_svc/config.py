"""What one worker rank is asked to run: the model, its place in the tensor-parallel group, memory.

Each field is the `worker` flag of the same name; its default and meaning live in the flag table
(nanoserve.flags), so a config built in a test and one parsed from the command line agree."""
import argparse
from dataclasses import dataclass, fields

from nanoserve.flags import defaults

_DEFAULT = defaults("worker")


@dataclass
class WorkerConfig:
    model: str                                              # a directory or a Hugging Face Hub id
    load_format: str = _DEFAULT["load_format"]              # dummy: random weights from config.json
    revision: str = _DEFAULT["revision"]                    # of a Hub model
    download_dir: str = _DEFAULT["download_dir"]            # of a Hub model; empty: the Hub cache
    dtype: str = _DEFAULT["dtype"]
    device: str = _DEFAULT["device"]
    rank: int = _DEFAULT["rank"]
    tensor_parallel_size: int = _DEFAULT["tensor_parallel_size"]
    dist_init_addr: str = _DEFAULT["dist_init_addr"]        # torch.distributed's TCP store
    advertise_host: str = _DEFAULT["advertise_host"]        # where peers reach this rank's gloo sockets
    dist_socket_ifname: str = _DEFAULT["dist_socket_ifname"]  # gloo's and NCCL's network interfaces
    block_size: int = _DEFAULT["block_size"]
    max_num_seqs: int = _DEFAULT["max_num_seqs"]            # largest decode batch (CUDA graphs up to it)
    max_num_batched_tokens: int = _DEFAULT["max_num_batched_tokens"]
    max_model_len: int = _DEFAULT["max_model_len"]          # 0: the model's max_position_embeddings
    gpu_memory_utilization: float = _DEFAULT["gpu_memory_utilization"]
    num_kv_blocks: int = _DEFAULT["num_kv_blocks"]          # 0: size from free memory; > 0 forces the count
    cpu_kv_cache_gb: float = _DEFAULT["cpu_kv_cache_gb"]    # CPU has no free-memory probe
    enforce_eager: bool = _DEFAULT["enforce_eager"]         # no CUDA graphs
    attention_backend: str = _DEFAULT["attention_backend"]
    kv_cache_dtype: str = _DEFAULT["kv_cache_dtype"]        # fp8: e4m3 values, float32 scales
    quantization: str = _DEFAULT["quantization"]            # fp8: quantize an unquantized checkpoint at load
    seed: int = _DEFAULT["seed"]
    step_timeout: float = _DEFAULT["step_timeout"]         # a step running longer ends the process (hung)

    @classmethod
    def from_flags(cls, args: argparse.Namespace) -> "WorkerConfig":
        return cls(**{field.name: getattr(args, field.name) for field in fields(cls)})
