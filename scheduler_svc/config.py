"""Scheduler limits: batch sizes, token budget, KV pool shape. No torch here, ever."""
from dataclasses import dataclass


@dataclass
class SchedulerConfig:
    num_kv_blocks: int                      # agreed with the workers (their smallest count)
    block_size: int                         # tokens per block, as the workers report it
    max_model_len: int                      # prompt + generated tokens of one sequence
    eos_token_ids: tuple[int, ...] = ()
    max_num_seqs: int = 256                 # running sequences at once
    max_num_batched_tokens: int = 16384     # tokens computed in one step (prefill chunks included)
    enable_prefix_caching: bool = True
